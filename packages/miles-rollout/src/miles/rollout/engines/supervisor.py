"""Engine fault tolerance: a health monitor per engine server that restarts a dead one and brings it back.

``EngineSupervisor`` runs one thread per server (``ServerActorHandle``s from
``miles.rollout.engines.server_actor``). Each probes its server every ``interval_s`` after a grace period of
``first_wait_s``; a probe that fails or takes longer than ``timeout_s`` is a failure, and after
``max_consecutive_failures`` in a row (or at once, when a probe finds the actor dead or a new server process: Ray
restarts it, or restarted it between two probes) the engine is recovered:

1. removed from the router, so no new request reaches it (a restarted ``ServerActor`` also leaves the router before
   its new server answers, which closes the window in which the router would route to it on its own);
2. restarted: Ray restarts an actor that died, or whose server died (the actor then ends itself); an actor that
   answers but whose server fails its health check is killed so that Ray restarts it; then the supervisor waits,
   at most ``restart_timeout_s``, until the new server serves;
3. given the current weights: ``on_restarted(url)`` (the run re-publishes its current weight version to that one
   server) is called once the server process is new, never concurrently with another ``on_restarted``;
4. added back to the router; ``engine/restarts`` counts it.

Requests that were running on the dead server are resubmitted by the client: sglang-router retries a request
whose worker dropped the connection on another worker, and ``SGLangEngine`` retries a dropped or refused
connection (and the router's "no worker" answer) with the same rid and seed, so a resubmitted sample samples what
it would have, and each prompt's group is complete. A server that does not come back, or whose ``on_restarted``
fails, stays out of the router; ``raise_if_failed`` raises its error (the loop calls it between steps).

The option names and defaults follow slime's fault tolerance (``--rollout-health-check-interval`` 30,
``--rollout-health-check-timeout`` 30, ``--rollout-health-check-first-wait`` 0,
``--rollout-health-check-max-consecutive-failures`` 2); slime probes ``/health_generate``, Miles the server's
health path (``ServerSpec.health_path``: ``/health`` by default, which answers while the engine is paused for a
weight update).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from miles.rollout.config import HealthCheckConfig
from miles.rollout.engines.router import RouterError, SGLangRouter
from miles.rollout.engines.server_actor import EngineRestartError, Probe

logger = logging.getLogger(__name__)


class SupervisedServer(Protocol):
    """What the supervisor needs of a server (``ServerActorHandle`` is the implementation)."""

    url: str
    pid: int | None  # the server process last seen serving

    def probe(self, timeout_s: float) -> Probe:
        """One health probe, within ``timeout_s``."""
        ...

    def restart(self) -> None:
        """Have the server restarted (returns at once)."""
        ...

    def wait_ready(
        self, timeout_s: float, *, not_pid: int | None = None, probe_timeout_s: float = 5.0,
        cancelled: Callable[[], bool] = ...,
    ) -> int:  # fmt: skip
        """Wait until a server process (other than ``not_pid``) serves; set and return its pid."""
        ...


def watch_health(
    probe: Callable[[], Probe],
    *,
    config: HealthCheckConfig,
    on_failed: Callable[[Probe], None],
    wait: Callable[[float], bool],
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Probe one engine until ``wait`` returns True; call ``on_failed(outcome)`` when it needs recovering.

    Probes start ``first_wait_s`` after the call, then every ``interval_s`` (start to start; at once when a probe
    took longer). HEALTHY resets the failure count, unless the probe took longer than ``timeout_s`` (then it is
    UNHEALTHY); UNHEALTHY and NO_ANSWER add one, and the ``max_consecutive_failures``-th in a row calls
    ``on_failed`` with that outcome; DIED and RESTARTED call it at once (there is no doubt to wait out). After
    ``on_failed`` returns the count starts again from 0 and the next probe is ``interval_s`` later.

    Args:
        probe: one probe of the engine.
        config: the schedule and the failure threshold.
        on_failed: recovers the engine (blocking this watch meanwhile); what it raises ends the watch.
        wait: sleeps up to the given seconds; True = stop (``threading.Event.wait``).
        clock: monotonic seconds.
    """
    next_at = clock() + config.first_wait_s
    failures = 0
    while not wait(max(next_at - clock(), 0.0)):
        started = clock()
        outcome = probe()
        if outcome is Probe.HEALTHY and clock() - started > config.timeout_s:
            outcome = Probe.UNHEALTHY
        if outcome is Probe.HEALTHY:
            failures = 0
        else:
            failures += 1
        if outcome in (Probe.DIED, Probe.RESTARTED) or failures >= config.max_consecutive_failures:
            on_failed(outcome)
            failures = 0
            next_at = clock() + config.interval_s
        else:
            next_at = started + config.interval_s


class EngineSupervisor:
    """Watches engine servers and restarts, re-weights and re-registers a dead one (see the module doc).

    Args:
        servers: the servers to watch (``start_server_actors``), each serving when the supervisor starts.
        config: probe schedule, threshold and restart timeout.
        on_restarted: called with a restarted server's URL before it rejoins the router; it must bring that
            server to the current weight version (e.g. push the current weights to it alone) and raise if it
            cannot. Runs in a supervisor thread holding ``resync_lock``; the run takes the same lock around its own
            weight pushes, so a push cannot fall between the two and leave the server one version behind (and
            calls ``wait_available`` before taking it: a push to every server fails while one is restarting).
        router: the sglang-router in front of the servers; None when clients talk to the servers directly (a
            restarted server is then reachable before ``on_restarted`` has run).

    ``start`` / ``stop`` (or ``with``) run and end the threads; the servers' lifetime is the caller's.
    """

    def __init__(
        self,
        servers: Sequence[SupervisedServer],
        *,
        config: HealthCheckConfig,
        on_restarted: Callable[[str], None],
        router: SGLangRouter | None = None,
    ) -> None:
        urls = [server.url for server in servers]
        if not servers or len(set(urls)) != len(urls):
            raise ValueError(f"EngineSupervisor needs at least one server and distinct URLs; got {urls}")
        self.servers = list(servers)
        self.config = config
        self.on_restarted = on_restarted
        self.router = router
        self._restarts = 0
        self._recovering: set[str] = set()
        self._errors: dict[str, BaseException] = {}
        self._state = threading.Condition()  # guards the three above
        self.resync_lock = threading.Lock()  # held by each on_restarted; the run's weight pushes take it too
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def restarts(self) -> int:
        """Engines restarted and brought back so far (``engine/restarts``)."""
        with self._state:
            return self._restarts

    def metrics(self) -> dict[str, float]:
        """``engine/restarts`` (cumulative) and ``engine/unavailable`` (servers out of service now)."""
        with self._state:
            return {"engine/restarts": float(self._restarts),
                    "engine/unavailable": float(len(self._recovering | self._errors.keys()))}  # fmt: skip

    def raise_if_failed(self) -> None:
        """Raise EngineRestartError for a server that could not be brought back (the first, naming the rest)."""
        with self._state:
            errors = dict(self._errors)
        if errors:
            url, err = next(iter(errors.items()))
            more = f" (and {len(errors) - 1} more servers)" if len(errors) > 1 else ""
            raise EngineRestartError(f"engine {url} is out of service{more}: {err}") from err

    def wait_available(self, timeout_s: float) -> None:
        """Block until no server is being recovered (e.g. before a weight push that needs every server).

        Raises: EngineRestartError as ``raise_if_failed``; TimeoutError naming the servers still recovering.
        """
        deadline = time.monotonic() + timeout_s
        with self._state:
            while self._recovering and not self._errors:
                if not self._state.wait(timeout=deadline - time.monotonic()) and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"engines {sorted(self._recovering)} were still being restarted after {timeout_s:.0f}s; "
                        "raise the wait, or health_check.restart_timeout_s bounds each restart"
                    )
        self.raise_if_failed()

    @contextlib.contextmanager
    def publish_guard(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold off recoveries for a weight push to every server (``EnginePublisher(guard=...)``).

        Waits until no server is being recovered (``wait_available``), takes ``resync_lock``, and probes every
        server once: if one does not answer healthy (it died since its last probe, or a recovery started
        meanwhile), the lock is given back and the wait starts again, until its watch has brought it back. The
        lock is held for the block, so a restarted server's ``on_restarted`` runs before or after the push, never
        during it, and reads the version the push left.

        Args:
            timeout_s: the longest wait for recoveries; None = 2 x ``restart_timeout_s`` (a restart is bounded by
                it, its weight push by the sink's timeout).
        Raises: EngineRestartError for a server that could not be brought back; TimeoutError naming the servers
            still recovering (or not healthy) after ``timeout_s``.
        """
        deadline = time.monotonic() + (2 * self.config.restart_timeout_s if timeout_s is None else timeout_s)
        while True:
            self.wait_available(max(deadline - time.monotonic(), 0.0))
            self.resync_lock.acquire()
            with self._state:
                recovering = bool(self._recovering)
            unhealthy = [] if recovering else self._unhealthy()
            if not recovering and not unhealthy:
                break
            self.resync_lock.release()
            if unhealthy:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"engines {unhealthy} were not healthy for a weight push within the wait; raise the wait, "
                        "or health_check.restart_timeout_s bounds each restart"
                    )
                time.sleep(min(self.config.interval_s, max(deadline - time.monotonic(), 0.0)))
        try:
            yield
        finally:
            self.resync_lock.release()

    def _unhealthy(self) -> list[str]:
        """URLs of the servers whose probe (one each, now) is not HEALTHY."""
        return [s.url for s in self.servers if s.probe(self.config.timeout_s) is not Probe.HEALTHY]

    def check(self) -> dict[str, float]:
        """Between two steps: ``raise_if_failed``, then ``metrics()`` (the loop's ``Components.engine_health``)."""
        self.raise_if_failed()
        return self.metrics()

    def start(self) -> EngineSupervisor:
        """Start one watch thread per server; returns self."""
        if not self._threads:
            self._stopping.clear()
            for server in self.servers:
                thread = threading.Thread(target=self._watch, args=(server,), name=f"miles-health {server.url}",
                                          daemon=True)  # fmt: skip
                thread.start()
                self._threads.append(thread)
            logger.info(
                "watching %d engines: probe every %gs after %gs, restart after %d failures",
                len(self.servers), self.config.interval_s, self.config.first_wait_s,
                self.config.max_consecutive_failures,
            )  # fmt: skip
        return self

    def stop(self) -> None:
        """Stop the watch threads (a recovery in progress is abandoned at its next poll). Idempotent."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=self.config.timeout_s + 10.0)
        self._threads = []

    def __enter__(self) -> EngineSupervisor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- one engine ------------------------------------------------------------------------------
    def _watch(self, server: SupervisedServer) -> None:
        try:
            watch_health(
                lambda: server.probe(self.config.timeout_s),
                config=self.config,
                on_failed=lambda outcome: self._recover(server, outcome),
                wait=self._stopping.wait,
            )
        except Exception as err:  # the engine stays out of service; raise_if_failed reports it
            if self._stopping.is_set():
                return
            logger.error("engine %s could not be brought back: %s", server.url, err)
            with self._state:
                self._errors[server.url] = err
                self._recovering.discard(server.url)
                self._state.notify_all()

    def _recover(self, server: SupervisedServer, outcome: Probe) -> None:
        """Remove, restart, re-weight and re-add one server (module doc, steps 1-4).

        Raises: EngineRestartError when it does not serve within ``restart_timeout_s``; what ``on_restarted``
            raises; RouterError when the router refuses.
        """
        started = time.monotonic()
        old_pid = server.pid
        logger.warning("engine %s %s; restarting it", server.url, _describe(outcome, self.config))
        with self._state:
            self._recovering.add(server.url)
        if self.router is not None:
            self.router.remove_worker(server.url)
        if outcome is Probe.UNHEALTHY:  # the actor answers but its server does not: make Ray restart both
            server.restart()
        pid = server.wait_ready(
            self.config.restart_timeout_s,
            not_pid=old_pid if outcome is Probe.UNHEALTHY else None,
            probe_timeout_s=self.config.timeout_s,
            cancelled=self._stopping.is_set,
        )
        restarted = pid != old_pid
        if restarted:
            with self.resync_lock:
                self.on_restarted(server.url)
        if self.router is not None:
            try:
                self.router.add_worker(server.url)
            except RouterError:
                if not self._stopping.is_set():
                    raise
        with self._state:
            self._recovering.discard(server.url)
            self._restarts += restarted
            self._state.notify_all()
        what = "restarted and brought to the current weights" if restarted else "answers again"
        logger.info(
            "engine %s %s in %.1fs (server pid %s -> %s)", server.url, what, time.monotonic() - started, old_pid, pid
        )


def _describe(outcome: Probe, config: HealthCheckConfig) -> str:
    if outcome is Probe.RESTARTED:
        return "has a new server process (Ray restarted it between two probes)"
    if outcome is Probe.DIED:
        return "lost its Ray actor (its server died, or it was killed; Ray restarts it)"
    what = "did not answer" if outcome is Probe.NO_ANSWER else "answered unhealthy"
    return f"{what} {config.max_consecutive_failures} probes in a row (timeout {config.timeout_s:.0f}s)"
