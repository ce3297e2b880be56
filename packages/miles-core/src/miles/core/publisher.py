"""``EnginePublisher``: the one owner of the weight version, trainer -> engines.

One publish is: pause every engine (all at once: engine control is async, an HTTP call per server) -> the backend
pushes its weights as version v + 1 (from the ranks that hold them, through ``miles.sync``) -> flush the engines'
caches (prefixes computed with older weights) -> the version becomes v + 1 -> resume the engines -> with a
``LogProbProbe``, check that the engines sample with the new weights. A failed push leaves the version, and the
engines resume on their old weights. A resumed run starts the counter at its checkpoint's version, so versions never
repeat within a run. The publish up to the resume runs inside the caller's ``guard`` (Ray mode: the engine
supervisor's, so that no engine is being restarted or re-weighted meanwhile).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import torch
from miles.core.batch import build_train_batch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest, TrainBackend
from miles.core.sample import Sample
from miles.sync import WeightUpdateError

logger = logging.getLogger(__name__)
T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code and return its result: on a new event loop in this thread,
    or, when this thread already runs a loop (a sync function called from async code), on a new loop in a worker
    thread (the caller blocks either way). Raises: what ``coro`` raises."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="miles-run-sync") as pool:
        return pool.submit(asyncio.run, coro).result()


async def control_all(engines: Sequence[Any], method: str, *args: Any) -> list[Any]:
    """Await ``engine.<method>(*args)`` on every engine at once (``Engine.pause`` / ``resume`` / ``flush_cache`` /
    ``health``); returns their results in engine order. Raises: the first error, after every call ended."""
    results = await asyncio.gather(*(getattr(engine, method)(*args) for engine in engines), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


class LogProbProbe:
    """Checks, after each weight update, that the engines sample with the trainer's weights: each engine samples a
    fixed prompt (a fixed seed, the rollouts' temperature, no truncation) and the trainer recomputes the log-probs
    of the sampled tokens; their largest difference must stay within ``max_abs_diff`` nats.

    A checksum cannot see every weight (vLLM's CPU backend packs linear layers into GEMM handles); this sees what
    sampling sees. fp32 engines agree with the fp32 trainer to ~1e-5 nats here; a missed or corrupted tensor moves
    log-probs by ~0.1 or more.

    Args:
        prompt_tokens: the probe prompt's token ids (non-empty).
        temperature: the rollouts' sampling temperature (the trainer's log-probs use logits / temperature).
        max_new_tokens: tokens sampled per engine and update.
        max_abs_diff: largest allowed |engine - trainer| log-prob of a sampled token, nats; None = report only.
        seed: the probe's sampling seed.
    Raises: ValueError for an empty prompt or max_new_tokens < 1.
    """

    metric = "sync/probe_logprob_max_abs_diff"

    def __init__(
        self,
        prompt_tokens: Sequence[int],
        *,
        temperature: float = 1.0,
        max_new_tokens: int = 16,
        max_abs_diff: float | None = 0.1,
        seed: int = 0,
    ) -> None:
        if not prompt_tokens:
            raise ValueError("the probe prompt is empty; it needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"the probe's max_new_tokens is {max_new_tokens}; it must be >= 1")
        self.prompt_tokens = list(prompt_tokens)
        self.sampling = SamplingConfig(temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens)
        self.max_abs_diff = max_abs_diff
        self.seed = seed

    def check(self, engines: Sequence[Any], backend: TrainBackend, version: int) -> dict[str, float]:
        """Sample the probe on every engine (concurrently) and compare with ``backend.forward``'s old_log_probs.

        Returns: {``metric``: the largest |engine - trainer| log-prob over the engines' sampled tokens, nats}; {}
            when no engine sampled a token.
        Raises: WeightUpdateError when an engine answers with another weight version than ``version``, or its
            log-probs differ by more than ``max_abs_diff``.
        """

        async def sample_all() -> list[Any]:
            return await asyncio.gather(
                *(e.generate(GenerateRequest(self.prompt_tokens, self.sampling, seed=self.seed)) for e in engines)
            )

        samples = []
        for i, output in enumerate(run_sync(sample_all())):
            if output.weight_version != version:
                raise WeightUpdateError(
                    f"the weight probe on engine {i} ran on weights v{output.weight_version}, not the v{version} "
                    "just published"
                )
            if output.response_tokens:
                samples.append(
                    Sample(
                        index=i,
                        group_index=i,
                        prompt=self.prompt_tokens,
                        tokens=self.prompt_tokens + list(output.response_tokens),
                        response_length=len(output.response_tokens),
                        rollout_log_probs=list(output.log_probs),
                    )
                )
        if not samples:
            return {}
        batch = build_train_batch(samples, torch.zeros(len(samples)), pad_token_id=0)
        old = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
        diff = (old - batch.rollout_log_probs).abs()[batch.loss_mask]
        worst = float(diff.max())
        if self.max_abs_diff is not None and not worst <= self.max_abs_diff:  # NaN fails too
            raise WeightUpdateError(
                f"after the update to v{version} an engine's log-probs of the probe prompt differ from the trainer's "
                f"by up to {worst:.3g} nats (allowed {self.max_abs_diff:g}): the engine does not sample with the "
                "trainer's weights (a tensor the transfer missed or corrupted). For a bf16 engine against an fp32 "
                "trainer raise engine.probe.max_abs_diff; engine.probe.tokens 0 turns the probe off."
            )
        return {self.metric: worst}


class Colocation:
    """Hands the memory between colocated engines and trainer (``execution.ray.colocate``) twice per step of the
    synchronous loop, in slime's order (``train.py`` with ``--colocate``):

    1. the rollout is done (nothing in flight) -> ``to_trainer``: every engine frees its weights and KV cache
       (``release_memory``), then the trainer takes the devices back (``backend.onload()``);
    2. the optimizer stepped -> ``before_push`` (the publisher, engines paused): the trainer offloads
       (``backend.offload()``) and the engines re-allocate their weights, zero-filled;
    3. the new version is pushed -> ``after_push``: the engines re-allocate their KV cache, and the next rollout
       can start. The push never competes with the KV cache for memory.

    A publish with nothing released (the checkpoint's weights pushed at a resume, a restarted server re-weighted)
    skips steps 2-3. If the push fails the engines hold zero-filled weights, and the publish's error stops the run.

    Args:
        engines: objects with ``release_memory(tags)`` / ``resume_memory(tags)``, SGLang's memory tags ("weights",
            "kv_cache"; None = all): ``SGLangEngine`` (every server; ``miles serve`` frees its parameters for real,
            SGLang its GPU memory).

    The trainer is passed to each call (the loop's and the publisher's current one: a trainer restart replaces
    it). Its optional ``offload()`` / ``onload()`` move its state off / onto the accelerator; ``offload`` must
    leave ``push_weights`` working (slime pushes from a host copy). The FSDP2 trainer runs on CPU here and has
    neither: it holds no accelerator memory.
    """

    def __init__(self, engines: Sequence[Any]) -> None:
        self.engines = list(engines)
        self.released: set[str] = set()  # SGLang's memory tags the engines have freed now
        self.seconds = 0.0  # spent handing memory over since the last ``metrics``

    def start(self, backend: Any) -> None:
        """Before the first rollout: the trainer offloads (it loaded onto the devices the engines generate on)."""
        _call_optional(backend, "offload")

    def to_trainer(self, backend: Any) -> None:
        """After a rollout: the engines free everything, the trainer onloads. Nothing when already released.

        Raises: what an engine raises (RuntimeError naming the server, e.g. requests still running)."""
        if self.released:
            return
        start = time.perf_counter()
        for engine in self.engines:
            engine.release_memory(None)
        self.released = {"weights", "kv_cache"}
        _call_optional(backend, "onload")
        self.seconds += time.perf_counter() - start

    def before_push(self, backend: Any) -> None:
        """The trainer offloads, the engines re-allocate their weights (zero-filled until the push)."""
        if not self.released:
            return
        start = time.perf_counter()
        _call_optional(backend, "offload")
        if "weights" in self.released:  # not again after a failed push (a restarted trainer's publish)
            for engine in self.engines:
                engine.resume_memory(["weights"])
            self.released.discard("weights")
        self.seconds += time.perf_counter() - start

    def after_push(self) -> None:
        """The engines re-allocate their KV cache: they can generate again."""
        if not self.released:
            return
        start = time.perf_counter()
        for engine in self.engines:
            engine.resume_memory(["kv_cache"])
        self.released.clear()
        self.seconds += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``time/colocation``: seconds spent freeing and re-allocating since the last call (then reset)."""
        seconds, self.seconds = self.seconds, 0.0
        return {"time/colocation": seconds}


def _call_optional(backend: Any, method: str) -> None:
    """``backend.<method>()`` when the backend has that optional capability (``TrainBackend``'s offload/onload)."""
    fn = getattr(backend, method, None)
    if fn is not None:
        fn()


class EnginePublisher:
    """``WeightPublisher`` over a backend and the engines it feeds.

    Args:
        backend: the ``TrainBackend``; ``push_weights(version)`` sends the weights.
        engines: the engines to pause, flush and resume around each push (an ``Engine`` each); may be empty
            when the push reaches receivers that are not engines.
        version: the version the engines hold now (0 at the start of a run; a checkpoint's on resume).
        pause_mode: how engines pause (``Engine.pause``): "keep" lets running work finish first (the synchronous
            loop has none in flight); "abort" / "retract" stop it (async training).
        guard: called once per publish; the context manager it returns is entered before the engines pause and
            left after they resume. The engine supervisor's ``publish_guard`` (Ray mode) waits there until no
            engine is being restarted and keeps a restarted one from being re-weighted during the push. What
            entering it raises (an engine that could not be brought back) fails the publish before anything ran.
        probe: checks each published version on the engines (``LogProbProbe``), after they resumed; None = off.
        colocation: engines and trainer share devices (``Colocation``): its ``before_push`` runs once the engines
            are paused, its ``after_push`` after the push; None = disaggregated.
    """

    def __init__(
        self,
        backend: TrainBackend,
        engines: Sequence[Any] = (),
        *,
        version: int = 0,
        pause_mode: str = "keep",
        guard: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        probe: LogProbProbe | None = None,
        colocation: Colocation | None = None,
    ) -> None:
        self.backend = backend
        self.engines = list(engines)
        self.pause_mode = pause_mode
        self.guard = guard
        self.probe = probe
        self.colocation = colocation
        self._version = version
        self._probe_metrics: dict[str, float] = {}

    @property
    def version(self) -> int:
        return self._version

    def metrics(self) -> dict[str, float]:
        """Metrics of the last publish: the probe's ``sync/probe_logprob_max_abs_diff`` (with a probe), and when its
        weight sink encodes deltas (a ``last_push`` with miles.sync's ``PushStats``), ``sync/sent_mib`` (MiB the
        transport moved) and ``sync/sent_fraction`` (of a full update's bytes; not for a sink in a Ray actor); with a
        colocation, ``time/colocation``."""
        metrics = dict(self._probe_metrics)
        if self.colocation is not None:
            metrics.update(self.colocation.metrics())
        stats = getattr(getattr(self.backend, "weight_sink", None), "last_push", None)
        if stats is not None and getattr(stats, "delta", False):
            metrics.update({"sync/sent_mib": stats.nbytes / 2**20, "sync/sent_fraction": stats.sent_fraction})
        return metrics

    def publish(self) -> int:
        """Push the backend's weights as ``version + 1`` with the engines paused; returns the new version.

        Raises: whatever the push raises (``WeightUpdateError``, ``TimeoutError``), or an engine's pause or flush
            (RuntimeError naming the server); the version is unchanged and the engines are resumed on their
            previous weights. What entering ``guard()`` raises. The probe's WeightUpdateError (the version is
            published, but the engines do not sample with it).
        """
        version = self._version + 1
        with self.guard():
            try:  # an engine that failed to pause (a server gone) must not leave the others paused
                run_sync(control_all(self.engines, "pause", self.pause_mode))
                if self.colocation is not None:
                    self.colocation.before_push(self.backend)
                self.backend.push_weights(version)
                if self.colocation is not None:
                    self.colocation.after_push()
                run_sync(control_all(self.engines, "flush_cache"))
                self._version = version
            finally:
                run_sync(control_all(self.engines, "resume"))
        if self.probe is not None and self.engines:
            self._probe_metrics = self.probe.check(self.engines, self.backend, version)
        return version
