"""Server processes that Miles starts and stops: engine servers (vLLM, SGLang, ``miles serve``) and the router.

``ServerProcess`` runs one command as a child process in its own process group, bound to 127.0.0.1 unless told
otherwise, with its output in a log file; ``start`` waits until a health URL answers 200 and raises one
``ServerStartError`` with the tail of the log and the likely fix when the server exits or never becomes healthy.
``stop`` ends the whole process tree (SIGTERM, then SIGKILL); every started server is also stopped at interpreter
exit, so a run leaves nothing running.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


class ServerStartError(RuntimeError):
    """A server did not start: it exited, or its health URL did not answer in time. The message has its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it; another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


class ServerProcess:
    """One server command, started, health-checked and stopped by Miles.

    Args:
        name: what the server is, for messages ("vLLM server", "miles serve", "sglang-router").
        command: argv; it must bind ``host:port`` (the caller puts them into the command).
        host, port: where it listens; ``url`` is ``http://host:port``.
        health_path: GET path that answers 200 once the server can serve ("/health").
        log_path: file receiving the server's stdout and stderr (appended: a restart keeps the earlier log).
        env: extra environment variables (on top of this process's environment).
        startup_timeout_s: how long ``start`` waits for health.
        hint: the likely fix, appended to a start failure's message.
    """

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        *,
        host: str,
        port: int,
        health_path: str = "/health",
        log_path: str | Path,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 300.0,
        hint: str = "",
    ) -> None:
        self.name = name
        self.command = [str(part) for part in command]
        self.host, self.port = host, port
        self.health_path = health_path
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.hint = hint
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _fail(self, what: str) -> ServerStartError:
        tail = log_tail(self.log_path)
        message = f"{self.name} at {self.url} {what}. Command: {' '.join(self.command)}"
        if tail:
            message += f"\n--- last lines of {self.log_path} ---\n{tail}\n---"
        if self.hint:
            message += f"\nFix: {self.hint}"
        return ServerStartError(message)

    def start(self) -> ServerProcess:
        """Start the command and wait for health; returns self.

        Raises: ServerStartError if the port is taken, the command is missing, the process exits, or health does
            not answer within ``startup_timeout_s`` (the process is stopped first).
        """
        if self.process is not None and self.process.poll() is None:
            return self
        if port_in_use(self.host, self.port):
            raise ServerStartError(
                f"{self.name}: port {self.port} on {self.host} is already in use; choose another port (0 picks a "
                "free one) or stop what listens there"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.command)}\n".encode())
            try:
                self.process = subprocess.Popen(
                    self.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **self.env},
                    start_new_session=True,  # its own process group: stop() ends its children too
                )
            except FileNotFoundError as err:
                raise self._fail(f"could not start ({err.strerror}: {err.filename})") from None
        _LIVE.add(self)
        logger.info("starting %s at %s (log: %s)", self.name, self.url, self.log_path)
        started = time.monotonic()
        deadline = started + self.startup_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                self.process = None
                raise self._fail(f"exited with code {code} while starting")
            if self.healthy(timeout_s=2.0):
                logger.info("%s is up at %s after %.1fs", self.name, self.url, time.monotonic() - started)
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise self._fail(f"did not answer {self.health_path} within {self.startup_timeout_s:.0f}s")
            time.sleep(0.5)

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """True when the health URL answers 200 now."""
        try:
            return httpx.get(self.url + self.health_path, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        """End the server and its children: SIGTERM to its process group, SIGKILL after ``timeout_s``. Idempotent."""
        process, self.process = self.process, None
        _LIVE.discard(self)
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        # Children that outlived their parent (engine-core processes) share the group: end them too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        logger.info("stopped %s at %s", self.name, self.url)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout_s=5.0)
