"""The real SGLang router (PyPI ``sglang-router``, a Rust load balancer) in front of engine servers.

``SGLangRouter`` runs ``python -m sglang_router.launch_router`` as a ``ServerProcess`` bound to 127.0.0.1 and adds and
removes workers through the router's HTTP API. ``WorkerMonitor`` probes each watched server's ``/health``, removes a
dead one from the router, and adds it back once a server answers again at the same URL (a restarted server).

What sglang-router 0.3.2 does (measured against the wheel; tests/rollout/test_router.py checks the parts Miles uses):

- Worker API: ``POST /workers`` with ``{"url": ...}`` answers 202 ``{"worker_id": <uuid>, ...}`` and registers the
  worker in the background. ``GET /workers`` answers ``{"workers": [{"id", "url", "is_healthy", ...}], ...}`` with
  registered workers only. ``DELETE /workers/{id}`` takes the UUID (a URL is a 400) and also works in the background.
  The older ``/add_worker``, ``/remove_worker`` and ``/list_workers`` answer 404.
- Registering a worker calls its ``GET /health``, probes gRPC on the same port (an HTTP/1.1 server logs "Invalid HTTP
  request"), then ``GET /server_info`` and ``/model_info``, falling back to ``/get_server_info`` and
  ``/get_model_info``. Only ``/health`` and ``/generate`` are required. An add whose URL does not answer is retried in
  the background and cannot be cancelled: it registers the URL whenever something starts answering there, which is
  why ``add_worker`` checks the worker's health before asking the router.
- ``POST /generate`` is parsed into the router's request type and sent on re-serialized: fields it does not know are
  dropped, at the top level and inside ``sampling_params`` (``seed`` is dropped; ``sampling_seed`` and ``rid`` pass).
  The response body comes back as the worker sent it. A 4xx is returned as is; a 5xx or a refused connection is
  retried (5 attempts in all, on any worker), and 10 consecutive failures open a worker's circuit breaker for 60 s.
- The router's own health checker marks a worker unhealthy after ``--health-failure-threshold`` failed ``/health``
  probes and routes around it, but never removes it; it marks it healthy again once it answers.
- It always serves Prometheus metrics (``smg_worker_cb_outcomes_total{worker=...}`` counts requests per worker), on
  0.0.0.0:29000 unless told otherwise, and panics at start when that port is taken; each router here gets a free one.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
from miles.rollout.engines.server import ServerProcess, free_port, log_tail

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'miles-rollout[router]'"

RouterPolicy = Literal["cache_aware", "round_robin", "random", "power_of_two"]
RouterLogLevel = Literal["debug", "info", "warn", "error"]

# How often add_worker / remove_worker look at the router's worker list while its background job runs.
_POLL_INTERVAL_S = 0.1


class RouterError(RuntimeError):
    """The router refused, or did not finish in time, a worker operation. The message has the router's answer."""


def normalize_worker_url(url: str) -> str:
    """``url`` without a trailing slash, as the router lists it. Raises: ValueError if it is not an http(s) URL."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(
            f"worker url {url!r} is not an HTTP base URL: the router sends /generate to '<url>/generate'. "
            "Pass it as http://HOST:PORT (for example http://127.0.0.1:30000)."
        )
    return url.rstrip("/")


def answers_health(client: httpx.Client, url: str, *, timeout_s: float) -> bool:
    """True when ``url``/health answers 200 within ``timeout_s`` (connection refused, timeouts, 5xx: False)."""
    try:
        return client.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


class SGLangRouter:
    """The sglang-router process and its worker list.

    Example::

        with SGLangRouter(["http://127.0.0.1:30001", "http://127.0.0.1:30002"], policy="round_robin") as router:
            httpx.post(router.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}})

    Args:
        worker_urls: servers to add once the router is up (each must already answer ``/health``).
        policy: how the router picks a worker. cache_aware (the router's default) sends prompts sharing a prefix to
            the same worker for its prefix cache; round_robin alternates (deterministic, used by the tests); random;
            power_of_two picks the less loaded of two random workers (polls each worker's ``/get_load`` every 30 s).
        host: where the router and its Prometheus metrics listen; 127.0.0.1 keeps both off the network.
        port: router port; 0 picks a free one.
        log_path: file receiving the router's output; default a file named after the port in the temp directory.
        log_level: the router's log level. warn keeps one log line per request (info) out of long runs.
        health_check_interval_s: seconds between the router's own ``/health`` probes of each worker.
        health_failure_threshold: failed probes in a row before the router stops routing to a worker.
        startup_timeout_s: how long ``start`` waits for the router to answer ``/health``.
        worker_timeout_s: how long ``add_worker`` / ``remove_worker`` wait for the router's background job.

    Raises: ImportError if sglang_router is not installed; ValueError on a bad URL or setting.
    """

    def __init__(
        self,
        worker_urls: Sequence[str] = (),
        *,
        policy: RouterPolicy = "cache_aware",
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | Path | None = None,
        log_level: RouterLogLevel = "warn",
        health_check_interval_s: int = 10,
        health_failure_threshold: int = 3,
        startup_timeout_s: float = 60.0,
        worker_timeout_s: float = 60.0,
    ) -> None:
        if importlib.util.find_spec("sglang_router") is None:
            raise ImportError(
                "SGLangRouter runs the real SGLang router, but the sglang_router package is not installed in "
                f"{sys.executable}. Install it with: {INSTALL_HINT}"
            )
        if health_check_interval_s < 1 or health_failure_threshold < 1:
            raise ValueError(
                f"health_check_interval_s is {health_check_interval_s} and health_failure_threshold is "
                f"{health_failure_threshold}, but the router takes whole seconds and counts of at least 1. "
                "Use 1 or more (the defaults are 10 s and 3 probes)."
            )
        self._initial_workers = [normalize_worker_url(url) for url in worker_urls]
        self.policy = policy
        self.worker_timeout_s = worker_timeout_s
        port = port or free_port(host)
        self.metrics_port = free_port(host)
        log_path = Path(log_path) if log_path is not None else Path(tempfile.gettempdir()) / f"sglang-router-{port}.log"
        command = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", host,
            "--port", port,
            "--policy", policy,
            "--prometheus-host", host,
            "--prometheus-port", self.metrics_port,
            "--log-level", log_level,
            "--health-check-endpoint", "/health",
            "--health-check-interval-secs", health_check_interval_s,
            "--health-failure-threshold", health_failure_threshold,
            "--health-success-threshold", 1,
        ]  # fmt: skip
        self._server = ServerProcess(
            "sglang-router",
            command,
            host=host,
            port=port,
            health_path="/health",  # the router's liveness: 200 as soon as it listens, with or without workers
            log_path=log_path,
            startup_timeout_s=startup_timeout_s,
            hint=f"read the router log above; the router itself comes from {INSTALL_HINT}",
        )
        self._client = httpx.Client(timeout=10.0, trust_env=False)  # control traffic: never through a proxy

    @property
    def url(self) -> str:
        """Where clients send ``/generate`` (``http://host:port``)."""
        return self._server.url

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def metrics_url(self) -> str:
        """The router's Prometheus metrics."""
        return f"http://{self._server.host}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path:
        return self._server.log_path

    @property
    def process(self) -> ServerProcess:
        """The router's ``ServerProcess`` (its command, log file, lifetime)."""
        return self._server

    @property
    def running(self) -> bool:
        return self._server.running

    @property
    def pid(self) -> int | None:
        """The router's process id while it runs."""
        return self._server.process.pid if self._server.process is not None else None

    def start(self) -> SGLangRouter:
        """Start the router, then add ``worker_urls``; returns self. The router is stopped if an add fails.

        Raises: ServerStartError if the router does not come up; RouterError if a worker cannot be added.
        """
        self._server.start()
        try:
            for url in self._initial_workers:
                self.add_worker(url)
        except BaseException:
            self.stop()
            raise
        if self._initial_workers:
            logger.info(
                "sglang-router at %s routes to %d workers (policy %s)",
                self.url,
                len(self._initial_workers),
                self.policy,
            )
        else:  # Ray mode: each server joins once its actor serves
            logger.info("sglang-router at %s is up (policy %s); the servers join as they start", self.url, self.policy)
        return self

    def workers(self) -> list[str]:
        """URLs of the workers registered with the router (healthy or not), in the router's order."""
        return [entry["url"] for entry in self._worker_entries()]

    def add_worker(self, url: str) -> None:
        """Register ``url`` with the router and wait until it routes to it. A registered URL is left as it is.

        Raises: RouterError if the worker does not answer ``/health`` (the router is not asked, since a queued add
            cannot be cancelled), the router refuses, or registration does not finish within ``worker_timeout_s``.
        """
        url = normalize_worker_url(url)
        if self._entry(url) is not None:
            return
        if not answers_health(self._client, url, timeout_s=5.0):
            raise RouterError(
                f"worker {url} does not answer GET /health with 200, so it was not added to the router at "
                f"{self.url}: sglang-router cannot cancel a queued add, which would register the URL whenever "
                "something starts listening there. Start the server and wait for its /health, then add it."
            )
        started = time.monotonic()
        worker_id = self._call("POST", "/workers", json={"url": url}).json()["worker_id"]
        while (entry := self._entry(url)) is None or not entry["is_healthy"]:
            if time.monotonic() - started > self.worker_timeout_s:
                job = self._call("GET", f"/workers/{worker_id}").json().get("job_status")
                raise RouterError(
                    f"sglang-router at {self.url} did not register worker {url} within {self.worker_timeout_s:.0f}s "
                    f"(job: {job}). Router log {self.log_path}:\n{log_tail(self.log_path, lines=10)}"
                )
            time.sleep(_POLL_INTERVAL_S)
        logger.info("router %s: added worker %s in %.2fs", self.url, url, time.monotonic() - started)

    def remove_worker(self, url: str) -> None:
        """Stop routing to ``url`` and wait until the router no longer lists it. An unknown URL is a no-op.

        Requests already sent to it finish or fail there (a failed one is retried on another worker by the router).
        Raises: RouterError if the router refuses or does not remove it within ``worker_timeout_s``.
        """
        url = normalize_worker_url(url)
        entry = self._entry(url)
        if entry is None:
            return
        started = time.monotonic()
        self._call("DELETE", f"/workers/{entry['id']}")
        while self._entry(url) is not None:
            if time.monotonic() - started > self.worker_timeout_s:
                raise RouterError(
                    f"sglang-router at {self.url} still lists worker {url} {self.worker_timeout_s:.0f}s after "
                    f"DELETE /workers/{entry['id']}. Router log {self.log_path}:\n{log_tail(self.log_path, lines=10)}"
                )
            time.sleep(_POLL_INTERVAL_S)
        logger.info("router %s: removed worker %s", self.url, url)

    def stop(self) -> None:
        """End the router process (its workers keep running). Idempotent."""
        self._server.stop()

    def __enter__(self) -> SGLangRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self._client.request(method, self.url + path, **kwargs)
        except httpx.HTTPError as err:
            raise RouterError(
                f"sglang-router at {self.url} did not answer {method} {path} ({err!r}); running: {self.running}. "
                f"Router log: {self.log_path}"
            ) from err
        if response.status_code >= 400:
            raise RouterError(
                f"sglang-router at {self.url} answered {method} {path} with {response.status_code}: {response.text}"
            )
        return response

    def _worker_entries(self) -> list[dict]:
        return self._call("GET", "/workers").json()["workers"]

    def _entry(self, url: str) -> dict | None:
        return next((entry for entry in self._worker_entries() if entry["url"] == url), None)


@dataclass(frozen=True)
class MonitorReport:
    """What one ``WorkerMonitor.check_once`` changed in the router."""

    removed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()


class WorkerMonitor:
    """Keeps the router's workers equal to the watched servers that answer ``/health``.

    Each check probes every watched URL: a registered one that does not answer 200 within ``health_timeout_s`` is
    removed from the router; an unregistered one that answers is added (a server restarted at the same URL), unless
    ``readd`` is False: then it is only logged, once, since a server restarted behind Miles' back holds its initial
    weights, not the run's (local mode cannot re-weight it; Ray mode's engine supervisor does). Workers
    the router has that are not watched are left alone. ``check_once`` runs one check (tests call it directly);
    ``start`` runs checks every ``interval_s`` seconds in a daemon thread until ``stop``.

    Removing, rather than leaving the router's own checker to mark the worker unhealthy, also drops the dead worker's
    circuit-breaker state: a restarted server is added back as a fresh worker and gets traffic at once.

    Args:
        router: the router to keep in step.
        urls: the servers to watch.
        interval_s: seconds between checks of the background thread.
        health_timeout_s: how long a probe waits; a worker that stalls longer counts as dead.
        readd: add back a watched server that answers again (False: log it and leave it out).
    """

    def __init__(
        self,
        router: SGLangRouter,
        urls: Iterable[str],
        *,
        interval_s: float = 10.0,
        health_timeout_s: float = 5.0,
        readd: bool = True,
    ) -> None:
        self.router = router
        self.readd = readd
        self._left_out: set[str] = set()  # answering again but not added back (readd False), logged once
        self.urls = tuple(normalize_worker_url(url) for url in urls)
        self.interval_s = interval_s
        self.health_timeout_s = health_timeout_s
        self._client = httpx.Client(trust_env=False)
        self._lock = threading.Lock()  # check_once from a caller and from the thread never interleave
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def check_once(self) -> MonitorReport:
        """Probe every watched server once and remove or add workers to match. Raises: RouterError from the router."""
        with self._lock:
            registered = set(self.router.workers())
            removed, added = [], []
            for url in self.urls:
                alive = answers_health(self._client, url, timeout_s=self.health_timeout_s)
                if url in registered and not alive:
                    self.router.remove_worker(url)
                    removed.append(url)
                elif url not in registered and alive and self.readd:
                    self.router.add_worker(url)
                    added.append(url)
                elif url not in registered and alive and url not in self._left_out:
                    self._left_out.add(url)
                    logger.warning(
                        "worker %s answers /health again but stays out of the router at %s: a restarted server holds "
                        "its initial weights and execution.mode local cannot bring it to the run's; restart the run "
                        "(--resume), or use execution.mode ray, whose supervisor restarts and re-weights servers",
                        url,
                        self.router.url,
                    )
        for url in removed:
            logger.warning("worker %s does not answer /health: removed from the router at %s", url, self.router.url)
        for url in added:
            logger.info("worker %s answers /health again: added back to the router at %s", url, self.router.url)
        return MonitorReport(removed=tuple(removed), added=tuple(added))

    def start(self) -> WorkerMonitor:
        """Run ``check_once`` every ``interval_s`` seconds in a daemon thread; returns self."""
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="miles-worker-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the background thread (waits for a check in progress). Idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> WorkerMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self.check_once()
            except (RouterError, httpx.HTTPError) as err:  # a router hiccup must not end monitoring; try next time
                logger.warning("worker check against the router at %s failed: %s", self.router.url, err)
