"""An engine server owned by a Ray actor, so Ray restarts it (DESIGN.md section 5: "Ray restarts failed engine actors").

``ServerActor`` runs one server command (``miles serve``, vLLM, SGLang: the caller builds the argv) as a
``ServerProcess`` started in the actor's ``__init__`` at a fixed host and port, so every incarnation of the actor
serves at the same URL. The actor is created with ``max_restarts`` (default -1: always) and ``max_task_retries=0``
(a health probe is never replayed on the next incarnation). What leads to a restart:

- the actor process dies (``ray.kill(actor, no_restart=False)``, a crash, the OOM killer): Ray restarts it. Its
  server dies with it: the server is started under ``PR_SET_PDEATHSIG`` (Linux), and the next incarnation ends
  the old server's process group if it still runs (found through a pid file beside the log), and leaves the
  router (``ServerSpec.router_url``) before its new server answers;
- the server process dies: the actor's ``health`` sees it and ends the actor process with ``os._exit(1)``, an
  unexpected exit, which Ray restarts (``ray.actor.exit_actor`` would be an intentional exit, never restarted).

``ServerActorHandle`` is the driver's side: probes with a timeout, the server's pid (which tells a restart from a
stall), a forced restart, waiting until an incarnation serves, and a clean stop.

Usage::

    spec = ServerSpec("miles serve", [sys.executable, "-m", "miles.rollout.serve", "--model", path, "--port", "30001"],
                      port=30001, log_path="logs/serve-0.log")
    with ray_session(num_cpus=4):
        (server,) = start_server_actors([spec])
        ...  # server.url serves; EngineSupervisor([server], ...) watches it
        server.stop()
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from miles.core.execution import import_ray
from miles.rollout.engines.server import ServerProcess, ServerStartError, log_tail, port_in_use

logger = logging.getLogger(__name__)

# Runs the server under PR_SET_PDEATHSIG (prctl option 1): the kernel SIGKILLs it when the actor that started it
# dies, however it dies. The flag survives exec; argv[1] is the actor's pid, to catch an actor that died already.
# One line, so that the command reads well in the server's log and in error messages.
_EXEC_WITH_PARENT_DEATH_SIGNAL = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execvp(sys.argv[2], sys.argv[2:])"
)
_PORT_RELEASE_S = 10.0  # how long a new incarnation waits for the old server's port after killing it


class EngineRestartError(RuntimeError):
    """A supervised server did not come back: its actor died for good, or no incarnation served in time."""


class Probe(enum.Enum):
    """One health probe's outcome."""

    HEALTHY = "healthy"  # the actor answered and the server answered /health with 200
    UNHEALTHY = "unhealthy"  # the actor answered: the server process runs but /health failed or was too slow
    NO_ANSWER = "no_answer"  # the actor did not answer in time (it may be starting, or hang)
    DIED = "died"  # the actor process died during the call (its server did, or it was killed): Ray restarts it
    RESTARTED = "restarted"  # healthy, but a new server process since it was last seen: it needs the weights


@dataclass(frozen=True)
class ServerSpec:
    """One server an actor owns.

    Attributes:
        name: what the server is, for messages ("miles serve", "vLLM server").
        command: argv; it must bind ``host:port``.
        port: the fixed port every incarnation binds (a restarted server keeps its URL, so the router and the
            clients keep it too); must be > 0.
        log_path: the server's log file, appended by every incarnation; ``<log_path>.pid`` holds its process group.
        host: where it listens (127.0.0.1: this machine only).
        health_path: GET path that answers 200 once the server serves.
        env: extra environment variables of the server.
        startup_timeout_s: how long one incarnation may take to answer ``health_path``.
        router_url: the sglang-router in front of the server, if any: a restarted incarnation removes its URL
            from it before its server starts, so the router does not route to the new server (which holds the
            weights it loaded, not the run's current ones) before the supervisor has brought it up to date.
        hold_path: for servers without a router (vLLM: ``/pause?mode=keep``): a POST path a restarted
            incarnation sends its server as soon as it serves, so that it holds the requests that reach it, rather
            than answer them from the weights it loaded, until the supervisor has brought it up to date and
            resumed it (``VLLMEngine.add_worker``). None: nothing is held.
    """

    name: str
    command: Sequence[str]
    port: int
    log_path: str | Path
    host: str = "127.0.0.1"
    health_path: str = "/health"
    env: Mapping[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    router_url: str | None = None
    hold_path: str | None = None

    def __post_init__(self) -> None:
        if self.port <= 0:
            raise ValueError(
                f"ServerSpec({self.name!r}).port is {self.port}, but a restarted server must come back at the same "
                "URL; pick a fixed port (miles.rollout.engines.server.free_port() finds one)"
            )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class ServerActor:
    """The body of the Ray actor owning one server (``start_server_actors`` makes the actor; see the module doc).

    ``__init__`` of a restarted incarnation (the pid file exists: an earlier one did not ``stop``) ends what is left
    of the earlier server and leaves the router; then it starts the server and waits for its health.
    Raises: ServerStartError from ``ServerProcess.start`` (the actor's creation fails; Ray reports it as dead).
    """

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self._pid_path = Path(f"{spec.log_path}.pid")
        command = list(map(str, spec.command))
        restarted = self._pid_path.exists()
        if restarted:
            end_previous_server(self._pid_path, command, host=spec.host, port=spec.port)
            if spec.router_url is not None:
                _leave_router(spec.router_url, spec.url)
        if sys.platform == "linux":
            command = [sys.executable, "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, str(os.getpid()), *command]
        self._server = ServerProcess(
            spec.name,
            command,
            host=spec.host,
            port=spec.port,
            health_path=spec.health_path,
            log_path=spec.log_path,
            env=spec.env,
            startup_timeout_s=spec.startup_timeout_s,
        )
        self._stopped = False
        self._server.start()
        assert self._server.process is not None
        self.pid = self._server.process.pid  # also its process group id (start_new_session)
        self._pid_path.write_text(str(self.pid))
        if restarted and spec.hold_path is not None:
            self._hold()

    def _hold(self) -> None:
        """POST ``spec.hold_path`` to the new server. Raises: ServerStartError (the server stopped) if it fails:
        a restarted server that cannot hold its requests must not serve them from its initial weights."""
        try:
            response = httpx.post(self.spec.url + self.spec.hold_path, timeout=30.0, trust_env=False)
            error = f"answered {response.status_code}: {response.text[:300]}" if response.status_code >= 400 else ""
        except httpx.HTTPError as err:
            error = repr(err)
        if error:
            self._server.stop()
            raise ServerStartError(f"{self.spec.name} at {self.spec.url}: POST {self.spec.hold_path} {error}")
        logger.info("%s at %s restarted and holds its requests until it is brought up to date", self.spec.name,
                    self.spec.url)  # fmt: skip

    def info(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """``{"url", "pid", "healthy"}``; ends the actor (Ray restarts it) if the server process died."""
        return {"url": self.spec.url, "pid": self.pid, "healthy": self.health(timeout_s)}

    def health(self, timeout_s: float = 5.0) -> bool:
        """True when the server answers its health path within ``timeout_s``; False once ``stop`` was called.

        If the server process died, this ends the actor process (``os._exit(1)``): the caller gets a RayActorError
        and Ray restarts the actor, which starts the server again.
        """
        if self._stopped:
            return False
        if not self._server.running:
            code = self._server.process.poll() if self._server.process is not None else None
            logger.error(
                "%s at %s (pid %d) exited with code %s; ending its actor so that Ray restarts both. Log %s:\n%s",
                self.spec.name, self.spec.url, self.pid, code, self.spec.log_path, log_tail(Path(self.spec.log_path)),
            )  # fmt: skip
            self._server.stop(timeout_s=5.0)  # what is left of its process group
            os._exit(1)
        return self._server.healthy(timeout_s=timeout_s)

    def stop(self) -> None:
        """Stop the server for good (this incarnation then reports unhealthy and never restarts it)."""
        self._stopped = True
        self._server.stop()
        with contextlib.suppress(FileNotFoundError):
            self._pid_path.unlink()


def end_previous_server(
    pid_path: Path, command: Sequence[str], *, host: str, port: int, wait_s: float = _PORT_RELEASE_S
) -> None:
    """Before a restarted server starts: kill the process group ``pid_path`` names if its leader still runs
    ``command`` (a server that outlived its actor; a pid reused since by another program is left alone), then wait
    up to ``wait_s`` for ``host:port`` to be free.

    Raises: ServerStartError if something keeps listening on the port.
    """
    try:
        pgid = int(pid_path.read_text())
        leader = Path(f"/proc/{pgid}/cmdline").read_bytes().split(b"\0")[:-1]
    except (OSError, ValueError):
        pgid, leader = 0, []
    if pgid and [part.decode(errors="replace") for part in leader] == list(command):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
            logger.warning("ended the previous server at %s:%d (process group %d)", host, port, pgid)
    deadline = time.monotonic() + wait_s
    while port_in_use(host, port):
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"restarting the server at {host}:{port}: the port is still in use {wait_s:g}s after the previous "
                f"server ended (pid file {pid_path}: {pgid or 'no running server'}), so something else listens "
                "there. Stop it, or give the server another port"
            )
        time.sleep(0.1)


def _leave_router(router_url: str, url: str, *, timeout_s: float = 30.0) -> None:
    """Remove ``url`` from sglang-router's workers and wait until it is gone (router.py describes the API).

    Best effort: a router that does not answer is logged and left alone (the supervisor removes the worker too).
    """
    try:
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            deadline = time.monotonic() + timeout_s
            deleted = False
            while True:
                workers = client.get(f"{router_url}/workers").json()["workers"]
                entry = next((worker for worker in workers if worker["url"] == url), None)
                if entry is None:
                    return
                if not deleted:
                    client.delete(f"{router_url}/workers/{entry['id']}").raise_for_status()
                    deleted = True
                if time.monotonic() > deadline:
                    logger.warning("router %s still lists %s %.0fs after removing it", router_url, url, timeout_s)
                    return
                time.sleep(0.1)
    except (httpx.HTTPError, ValueError, KeyError) as err:
        logger.warning("could not remove restarted server %s from the router at %s: %r", url, router_url, err)


class ServerActorHandle:
    """The driver's handle on one ``ServerActor``: probes, restarts, waits, stops (see the module doc).

    At most one probe is outstanding: while the actor restarts, calls queue behind its ``__init__``, and a probe
    that did not answer is waited on by the next one instead of sending another. Thread-safe: the supervisor's
    watch thread and its publish guard probe the same handle.

    Args:
        actor: the Ray actor handle (from ``start_server_actors``).
        spec: the server it owns.
    """

    def __init__(self, actor: Any, spec: ServerSpec) -> None:
        self.actor = actor
        self.spec = spec
        self.url = spec.url
        self.pid: int | None = None  # the server's pid when last seen serving
        self._pending: Any = None  # ObjectRef of an unanswered info call
        self._lock = threading.Lock()  # guards _pending
        self.last_error = ""  # the last Ray error of a call to the actor, for messages

    def probe(self, timeout_s: float) -> Probe:
        """Ask the actor for its server's health, waiting at most ``timeout_s``; DIED when the actor process died
        during the call; RESTARTED when a healthy server is not the process ``pid`` names (``wait_ready`` records
        the new one)."""
        answer = self._ask(timeout_s)
        if isinstance(answer, Probe):
            return answer
        if not answer["healthy"]:
            return Probe.UNHEALTHY
        return Probe.HEALTHY if answer["pid"] == self.pid else Probe.RESTARTED

    def restart(self) -> None:
        """Kill the actor process; Ray restarts it (and its server). Returns at once."""
        with self._lock:
            self._pending = None
        import_ray().kill(self.actor, no_restart=False)

    def wait_ready(
        self,
        timeout_s: float,
        *,
        not_pid: int | None = None,
        probe_timeout_s: float = 5.0,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> int:
        """Wait until the server serves (with a pid other than ``not_pid`` when given); record and return its pid.

        Raises: EngineRestartError when the actor's ``__init__`` failed (its error included), on timeout (with
            the last Ray error and the server's log tail), or once ``cancelled()`` is true.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if cancelled():
                raise EngineRestartError(f"waiting for {self.spec.name} at {self.url} was cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineRestartError(
                    f"{self.spec.name} at {self.url} did not serve again within {timeout_s:.0f}s (pid before: "
                    f"{not_pid or self.pid}; last Ray error: {self.last_error or 'none'}). Raise the restart timeout "
                    f"if it starts slowly, or max_restarts if they are spent; log {self.spec.log_path}:\n"
                    f"{log_tail(Path(self.spec.log_path), lines=15)}"
                )
            answer = self._info(min(probe_timeout_s, remaining))
            if answer is not None and answer["healthy"] and answer["pid"] != not_pid:
                self.pid = answer["pid"]
                return self.pid
            if answer is not None:  # it answered, not (yet) as wanted: do not spin
                time.sleep(min(0.2, max(remaining, 0.0)))

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the server, then end the actor without restart. Best effort: a dead actor is only killed."""
        ray = import_ray()
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.actor.stop.remote(), timeout=timeout_s)
        ray.kill(self.actor, no_restart=True)
        logger.info("stopped %s at %s and its Ray actor", self.spec.name, self.url)

    def _info(self, timeout_s: float) -> dict[str, Any] | None:
        """The actor's ``info``, or None if it did not answer within ``timeout_s`` or died (Ray restarts it).

        Raises: EngineRestartError if the actor's ``__init__`` failed (Ray does not restart that).
        """
        answer = self._ask(timeout_s)
        return None if isinstance(answer, Probe) else answer

    def _ask(self, timeout_s: float) -> dict[str, Any] | Probe:
        """The actor's ``info``; NO_ANSWER if it did not answer within ``timeout_s``, DIED if it died meanwhile.

        Raises: EngineRestartError if the actor's ``__init__`` failed (Ray does not restart that).
        """
        ray = import_ray()
        with self._lock:
            if self._pending is None:
                self._pending = self.actor.info.remote(timeout_s)
            ready, _ = ray.wait([self._pending], timeout=timeout_s)
            if not ready:
                return Probe.NO_ANSWER
            ref, self._pending = self._pending, None
            try:
                return ray.get(ref)
            except ray.exceptions.RayActorError as err:
                if err.actor_init_failed:  # __init__ raised: Ray does not restart it
                    raise EngineRestartError(
                        f"the Ray actor owning {self.spec.name} at {self.url} failed to start its server and will "
                        f"not restart: {err}"
                    ) from err
                self.last_error = " ".join(str(err).split())[:500]  # died (Ray restarts it, or its restarts are spent)
                return Probe.DIED


def start_server_actors(
    specs: Sequence[ServerSpec],
    *,
    max_restarts: int = -1,
    actor_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    timeout_s: float | None = None,
) -> list[ServerActorHandle]:
    """Create one ``ServerActor`` per spec (they start their servers concurrently) and wait until all serve.

    Args:
        specs: the servers, each with its own fixed port.
        max_restarts: Ray restarts of each actor; -1 = unlimited (a server that keeps dying then keeps being
            restarted, each restart counted in ``engine/restarts``).
        actor_options: more ``ray.remote`` options (``num_cpus``, ``num_gpus``, ``scheduling_strategy`` for a
            placement-group bundle, ``runtime_env``); not ``max_restarts`` / ``max_task_retries``. One mapping for
            every actor, or one per spec (e.g. each server in its own bundle).
        timeout_s: how long to wait for all to serve; None = the longest ``startup_timeout_s`` plus 60 s.
    Raises: ValueError for duplicate URLs or restart options in ``actor_options``; EngineRestartError naming the
        server that did not start (the others are stopped first).
    """
    ray = import_ray()
    urls = [spec.url for spec in specs]
    if len(set(urls)) != len(urls):
        raise ValueError(f"start_server_actors: two servers share a URL in {urls}; give each its own port")
    per_spec = [dict(o) for o in actor_options] if isinstance(actor_options, Sequence) else None
    if per_spec is not None and len(per_spec) != len(specs):
        raise ValueError(f"start_server_actors: {len(per_spec)} actor_options for {len(specs)} specs; give one each")
    options = per_spec or [dict(actor_options or {})] * len(specs)
    clash = sorted({"max_restarts", "max_task_retries"} & {key for o in options for key in o})
    if clash:
        raise ValueError(f"actor_options sets {clash}; pass max_restarts as an argument (task retries are always 0)")
    actor_class = ray.remote(ServerActor)
    handles = [
        ServerActorHandle(actor_class.options(max_restarts=max_restarts, max_task_retries=0, **o).remote(spec), spec)
        for spec, o in zip(specs, options)
    ]
    if timeout_s is None:
        timeout_s = max(spec.startup_timeout_s for spec in specs) + 60.0
    deadline = time.monotonic() + timeout_s
    try:
        for handle in handles:  # they start concurrently; this only waits for each in turn
            handle.wait_ready(max(deadline - time.monotonic(), 0.1), probe_timeout_s=timeout_s)
    except BaseException:
        for handle in handles:
            handle.stop(timeout_s=10.0)
        raise
    logger.info("%d engine servers serve from Ray actors: %s", len(handles), ", ".join(urls))
    return handles
