"""``ProcessPoolReward``: rewards scored in worker processes with a time and memory limit, so a reward that hangs,
segfaults or exhausts memory fails only its sample (``miles.core.rewards`` has the in-process scoring)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import pickle
import resource
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Literal

from miles.core.logs import warn_once
from miles.core.plugins import load_plugin
from miles.core.protocols import RewardFn
from miles.core.rewards import RewardOutcome, RewardWorkerError, _call, _failure
from miles.core.sample import Sample

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Worker:
    """One worker process as the pool sees it."""

    process: BaseProcess
    conn: Connection  # duplex: samples out; ("ready",), ("ok", value, metadata set), ("error", kind, reason) back
    alive: Connection  # write end of a pipe the worker watches: EOF (close(), or this process died) ends it
    state: Literal["starting", "idle", "busy", "stopped"] = "starting"
    task: int = -1  # the position of the sample being scored, in the call_batch argument
    deadline: float = math.inf  # time.monotonic() when the call (busy) or start-up (starting) has run too long


class ProcessPoolReward:
    """``RewardFn`` that runs the reward function in worker processes, each call with a time limit and each worker
    with a memory limit; a batch (``call_batch``, used by ``score_samples``) is scored concurrently across them.

    A call past ``timeout_s`` (timed by this process: works from any thread) fails its sample with "reward timed
    out after Xs" (kind reward_timeout) and its worker is SIGKILLed and replaced. A worker that dies (``os._exit``,
    a segfault, the OOM killer) fails only its sample, "reward worker died (exit code 3)" / "... (signal SIGSEGV)"
    (reward_crash), and is replaced; a MemoryError in the reward function (past ``memory_limit_mib``) fails it as
    "reward exceeded the memory limit ..." (reward_memory). Other results match in-process scoring exactly.

    Workers are forked from the multiprocessing fork server (never from the trainer, which has threads), which
    imports this module (and torch) once, so a worker (re)starts in well under a second plus what loading the
    reward function imports (unless ``preload``ed). A worker gets a copy of the sample: of what the reward function
    writes to it, only the ``metadata`` entries it sets (assigns, not mutates in place) of a call that returns come
    back, and ``score_samples`` sets them on the sample (e.g. the code reward's ``reward_outcome``). Workers
    ignore SIGINT (a first Ctrl-C asks the trainer for a clean stop), exit when this process dies (a pipe reaches
    EOF) and are killed by ``close()``, also run at exit. Calls from several threads are serialized. It isolates
    faults, it is no security sandbox: workers have the trainer's files and network.

    Args:
        reward_fn: "module:attr" (checked here with ``load_plugin``, imported by each worker) or a picklable
            callable (a module-level function; pickled by reference).
        num_workers: worker processes.
        timeout_s: seconds one call may take; None = no limit.
        memory_limit_mib: address space (virtual memory, MiB) a worker may add after loading the reward function
            (``RLIMIT_AS`` over its size then, so the trainer's libraries it inherits do not count); an allocation
            past it raises MemoryError. Threads reserve stacks and malloc arenas (up to 64 MiB each) from it. None
            = no limit.
        preload: modules the fork server imports before it forks the first worker, so no worker start (nor first
            call: its imports count against ``timeout_s``) imports them; only modules that start no thread at import
            (a fork keeps only the forking thread). Applies if this process has not started the fork server yet.
        startup_timeout_s: seconds a worker may take to start and load the reward function.
    Raises: ValueError/ImportError/AttributeError/TypeError for a reward function that does not load here or
        cannot be pickled, naming ``reward.path``; RuntimeError if a worker cannot start (its error in the message).
    """

    def __init__(
        self,
        reward_fn: str | Callable[[Sample], float],
        *,
        num_workers: int,
        timeout_s: float | None = None,
        memory_limit_mib: int | None = None,
        preload: Sequence[str] = (),
        startup_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"reward.workers is {num_workers}; a process pool needs at least 1 worker")
        if (timeout_s is not None and timeout_s <= 0) or (memory_limit_mib is not None and memory_limit_mib <= 0):
            raise ValueError(f"timeout_s={timeout_s} and memory_limit_mib={memory_limit_mib} must be > 0 or None")
        if isinstance(reward_fn, str):
            load_plugin(reward_fn, key="reward.path", num_positional=1)
        else:
            try:
                pickle.dumps(reward_fn)
            except Exception as err:
                raise TypeError(
                    f"the reward function {reward_fn!r} cannot be sent to reward worker processes ({err}); pass a "
                    "module-level function or its 'module:attr' path"
                ) from err
        self.reward_fn, self.num_workers, self.timeout_s = reward_fn, num_workers, timeout_s
        self.memory_limit_mib, self.startup_timeout_s = memory_limit_mib, startup_timeout_s
        self.num_restarts = 0  # workers replaced after a timeout or a death
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["__main__", __name__, *preload])
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        atexit.register(self.close)
        t0 = time.perf_counter()
        try:
            self._workers = [self._start_worker() for _ in range(num_workers)]
            while any(worker.state == "starting" for worker in self._workers):
                self._step([])
        except BaseException:
            self._shutdown()
            raise
        logger.info("started %d reward worker processes in %.1fs", num_workers, time.perf_counter() - t0)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers."""
        return [worker.process.pid for worker in self._workers]

    def __call__(self, sample: Sample) -> float:
        """Score one sample; raises ``RewardWorkerError`` if the call timed out, its worker died or the reward
        function raised (the worker's error, by name and message)."""
        (outcome,) = self.call_batch([sample])
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    def call_batch(self, samples: Sequence[Sample]) -> list[RewardOutcome]:
        """Call the reward function on every sample, concurrently across the workers; one outcome per sample, in
        order. A failed call's error is a ``RewardWorkerError`` whose message is the failure reason.

        Raises: RuntimeError if the pool is closed or a replacement worker cannot start; an error escaping
            this call (that one, KeyboardInterrupt) closes the pool.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("ProcessPoolReward.call_batch called after close()")
            outcomes: list[RewardOutcome | None] = [None] * len(samples)
            queue = deque(range(len(samples)))
            try:
                while True:
                    for i in range(len(self._workers)):  # by position: _send may replace a dead worker
                        while self._workers[i].state == "idle" and queue:
                            self._send(self._workers[i], queue, samples, outcomes)
                    if not queue and not any(worker.state == "busy" for worker in self._workers):
                        return outcomes  # type: ignore[return-value]
                    self._step(outcomes)
            except BaseException:
                self._shutdown()
                raise

    def close(self) -> None:
        """Stop the workers (a running call is abandoned); idempotent, also run at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if not self._lock.acquire(blocking=False):
            # call_batch runs in another thread: kill its workers; it sees them die and shuts the pool down
            for worker in self._workers:
                with contextlib.suppress(ValueError):  # that thread closed this process object meanwhile
                    worker.process.kill()
            return
        try:
            self._shutdown()
        finally:
            self._lock.release()

    def __enter__(self) -> ProcessPoolReward:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start_worker(self) -> _Worker:
        conn, child_conn = self._context.Pipe()
        alive_r, alive_w = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_worker_main,
            args=(child_conn, alive_r, self.reward_fn, self.memory_limit_mib),
            name="miles-reward-worker",
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            conn.close()
            alive_w.close()
            raise
        finally:  # the worker holds its own ends now: its death reads as EOF here
            child_conn.close()
            alive_r.close()
        return _Worker(process, conn, alive_w, deadline=time.monotonic() + self.startup_timeout_s)

    def _send(
        self, worker: _Worker, queue: deque[int], samples: Sequence[Sample], outcomes: list[RewardOutcome | None]
    ) -> None:
        task = queue.popleft()
        try:
            # a reward scores text (and metadata); pixel inputs would only weigh down the pipe
            worker.conn.send(dataclasses.replace(samples[task], multimodal_inputs=None))
        except OSError:  # died while idle: score the sample on another worker
            queue.appendleft(task)
            self._replace(worker, "a reward worker died while idle; it was replaced")
            return
        except Exception as err:  # noqa: BLE001 - pickled before anything is written: the pipe stays usable
            reason = f"sample {samples[task].index} cannot be sent to a reward worker: {type(err).__name__}: {err}"
            outcomes[task] = RewardOutcome(error=RewardWorkerError(reason, kind="reward_error"))
            return
        worker.state, worker.task = "busy", task
        worker.deadline = math.inf if self.timeout_s is None else time.monotonic() + self.timeout_s

    def _step(self, outcomes: list[RewardOutcome | None]) -> None:
        """Wait for the first reply, worker death or deadline among starting and busy workers, and handle it."""
        waiting = {}
        for worker in self._workers:
            if worker.state in ("starting", "busy"):
                waiting[worker.conn] = waiting[worker.process.sentinel] = worker
        deadline = min(worker.deadline for worker in waiting.values())
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        for worker in dict.fromkeys(waiting[ready] for ready in wait(list(waiting), timeout)):
            self._receive(worker, outcomes)
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.state == "busy" and worker.deadline <= now:
                reason = f"reward timed out after {self.timeout_s:g}s (reward.timeout_s); its worker was replaced"
                outcomes[worker.task] = RewardOutcome(error=RewardWorkerError(reason, kind="reward_timeout"))
                self._replace(worker, reason)
            elif worker.state == "starting" and worker.deadline <= now:
                raise RuntimeError(
                    f"a reward worker did not load the reward function within {self.startup_timeout_s:g}s"
                )

    def _receive(self, worker: _Worker, outcomes: list[RewardOutcome | None]) -> None:
        try:
            message = worker.conn.recv() if worker.conn.poll() else None
        except (EOFError, OSError):
            message = None
        if message is None:  # the process is gone
            worker.process.join(timeout=5.0)
            how = _how_it_ended(worker.process.exitcode)
            if self._closed:  # killed by close() in another thread
                raise RuntimeError("the reward pool was closed while it was scoring")
            if worker.state == "starting":
                raise RuntimeError(f"a reward worker died while loading the reward function ({how}); see its stderr")
            reason = f"reward worker died ({how}); it was replaced"  # busy: _step waits on no idle worker
            outcomes[worker.task] = RewardOutcome(error=RewardWorkerError(reason, kind="reward_crash"))
            self._replace(worker, reason)
        elif message[0] == "init_error":
            raise RuntimeError(f"a reward worker could not load the reward function {self.reward_fn!r}:\n{message[1]}")
        else:
            if message[0] == "ok":
                outcomes[worker.task] = RewardOutcome(value=message[1], metadata=message[2])
            elif message[0] == "error":
                outcomes[worker.task] = RewardOutcome(error=RewardWorkerError(message[2], kind=message[1]))
            worker.state, worker.task, worker.deadline = "idle", -1, math.inf

    def _replace(self, worker: _Worker, reason: str) -> None:
        """Kill a worker and start another in its place (not after close())."""
        if self._closed:  # by close() in another thread; _shutdown stops the workers
            raise RuntimeError("the reward pool was closed while it was scoring")
        warn_once(
            logger, "%s (pid %d); later replacements are counted in samples/failed_reward_*", reason, worker.process.pid
        )
        _stop(worker)
        self._workers[self._workers.index(worker)] = self._start_worker()
        self.num_restarts += 1

    def _shutdown(self) -> None:
        self._closed = True
        atexit.unregister(self.close)
        for worker in self._workers:
            worker.alive.close()  # the worker exits on this EOF, even in the middle of a call
        for worker in self._workers:
            _stop(worker, grace_s=1.0)
        self._workers = []


def _stop(worker: _Worker, *, grace_s: float = 0.0) -> None:
    """Join a worker, SIGKILLing it unless it exits within ``grace_s``, and close its pipes (once)."""
    if worker.state == "stopped":
        return
    worker.state = "stopped"
    worker.process.join(timeout=grace_s)
    if worker.process.exitcode is None:
        worker.process.kill()
        worker.process.join()
    worker.conn.close()
    worker.alive.close()
    worker.process.close()


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    names = {sig.value: sig.name for sig in signal.Signals}
    return f"signal {names.get(-exitcode, -exitcode)}"


def _worker_main(conn: Connection, alive: Connection, reward_fn: str | RewardFn, memory_limit_mib: int | None) -> None:
    """A reward worker: load the reward function, say ready, then score one sample per message until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a first Ctrl-C asks the trainer for a clean stop
    try:
        if isinstance(reward_fn, str):
            reward_fn = load_plugin(reward_fn, key="reward.path", num_positional=1)
        threading.Thread(target=_exit_on_eof, args=(alive,), name="reward-owner-watch", daemon=True).start()
        if memory_limit_mib is not None:  # last: what loading imported is not charged to the reward
            _limit_address_space(memory_limit_mib)
    except Exception:  # noqa: BLE001 - sent to the pool, which raises it
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready",))
    while True:
        try:
            sample = conn.recv()
        except EOFError:
            return
        before = dict(sample.metadata)
        outcome = _call(reward_fn, sample)
        if outcome.error is None:
            missing = object()
            metadata = {k: v for k, v in sample.metadata.items() if before.get(k, missing) is not v}
            reply = ("ok", outcome.value, metadata)
        else:
            outcome.error.__traceback__ = None  # free the failed call's frames (after a MemoryError, its memory)
            kind, reason = _failure(outcome)
            if kind == "reward_memory" and memory_limit_mib is not None:
                reason = f"reward exceeded the memory limit of {memory_limit_mib} MiB (reward.memory_limit_mib)"
            reply = ("error", kind, reason)
        try:
            conn.send(reply)
        except OSError:  # the pool is gone
            return
        except Exception as err:  # noqa: BLE001 - an unpicklable return value
            reason = f"reward function returned {type(outcome.value).__name__}, which cannot be sent back: {err}"
            conn.send(("error", "reward_error", reason))


def _exit_on_eof(alive: Connection) -> None:
    """Block until the pool's end of ``alive`` closes (close(), or its process died), then end this worker."""
    try:
        alive.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(0)


def _limit_address_space(limit_mib: int) -> None:
    """Cap this process's address space at its current size plus ``limit_mib`` MiB (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        in_use = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = in_use + limit_mib * 2**20
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
