"""Scoring samples with a reward function, where one bad reward never takes the run down.

In-process scoring (a plain function, or ``TimeLimitedReward`` for a time limit) shares the trainer's interpreter:
a reward that hangs keeps a thread forever, one that segfaults or exhausts memory ends the run. ``ProcessPoolReward``
runs the reward function in worker processes with a time and memory limit instead: a call past its time limit gets
its worker killed, a worker that dies is replaced, and either way only that sample fails. Every failed sample carries
a reason (``metadata["failure"]``) and a countable kind (``metadata["failure_kind"]``, one of ``FAILURE_KINDS``;
``failure_counts`` turns them into metrics). ``ProcessPoolReward`` lives in ``miles.core.reward_pool``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles.core.protocols import GroupRewardFn, RewardFn, SampleHook
from miles.core.sample import Sample, SampleStatus, group_samples

logger = logging.getLogger(__name__)

# metadata["failure_kind"] of a sample failed by its reward: the call timed out, its worker process died (os._exit,
# a signal such as SIGSEGV or the OOM killer's SIGKILL), it raised MemoryError (past reward.memory_limit_mib), or it
# raised anything else / returned something that is not a finite number.
FAILURE_KINDS = ("reward_timeout", "reward_crash", "reward_memory", "reward_error")


@dataclass(frozen=True, slots=True)
class RewardOutcome:
    """What one reward call gave: the returned ``value`` (not yet checked to be a finite number), or the ``error``
    it failed with (then ``value`` is None); ``metadata``: the ``sample.metadata`` entries a call made in a worker
    process set (on the worker's copy), which ``score_samples`` copies onto the sample."""

    value: Any = None
    error: Exception | None = None
    metadata: dict[str, Any] | None = None


class RewardWorkerError(Exception):
    """A reward call failed in a ``ProcessPoolReward`` worker. The message is the sample's failure reason, ``kind``
    its ``metadata["failure_kind"]`` (one of ``FAILURE_KINDS``)."""

    def __init__(self, reason: str, *, kind: str) -> None:
        super().__init__(reason)
        self.kind = kind


class RewardTimeoutError(TimeoutError):
    """A reward function did not return within its time limit."""


def score_samples(
    samples: Sequence[Sample],
    reward_fn: RewardFn,
    *,
    sample_hook: SampleHook | None = None,
    group_reward_fn: GroupRewardFn | None = None,
) -> int:
    """Set ``sample.reward`` for every sample that is not FAILED or ABORTED; returns how many failed (FAILED
    before scoring or made FAILED here; ABORTED samples are skipped and not counted).

    ``sample_hook`` (``rollout.sample_hook_path``) first sees every sample to score; one that raises fails its
    sample (kind "sample_hook"). ``group_reward_fn`` (``reward.group_path``) then gets each group (samples of one
    ``group_index``, in order) still scored and replaces their rewards with what it returns; one that raises or
    returns other than one finite number per sample fails the group's samples (kind "reward_error").

    A reward function that raises, or returns None / NaN / inf / a non-number, marks the sample FAILED with the
    reason in ``metadata["failure"]`` and its kind in ``metadata["failure_kind"]`` (see ``FAILURE_KINDS``); failed
    samples are excluded from advantages and the loss. A reward function with a ``call_batch(samples) ->
    list[RewardOutcome]`` method (``ProcessPoolReward``) gets all samples to score in one call, so they are scored
    concurrently; the results are those of one call per sample, in order.
    """
    if sample_hook is not None:
        for sample in samples:
            if sample.status not in (SampleStatus.FAILED, SampleStatus.ABORTED):
                try:
                    sample_hook(sample)
                except Exception as err:  # noqa: BLE001 - a hook bug fails this sample only
                    _fail(sample, "sample_hook", f"sample hook raised {type(err).__name__}: {err}")
    num_failed = sum(sample.status == SampleStatus.FAILED for sample in samples)
    # ABORTED: cut off by the engine, not broken: neither scored nor failed
    to_score = [s for s in samples if s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)]
    call_batch = getattr(reward_fn, "call_batch", None)
    outcomes = call_batch(to_score) if call_batch is not None else [_call(reward_fn, s) for s in to_score]
    for sample, outcome in zip(to_score, outcomes, strict=True):
        if outcome.metadata:
            sample.metadata.update(outcome.metadata)
        failure = _failure(outcome)
        if failure is None:
            sample.reward = float(outcome.value)
            continue
        _fail(sample, *failure)
        num_failed += 1
    if group_reward_fn is not None:
        num_failed += _score_groups(samples, group_reward_fn)
    return num_failed


def _fail(sample: Sample, kind: str, reason: str) -> None:
    sample.status = SampleStatus.FAILED
    sample.reward = None
    sample.metadata["failure_kind"], sample.metadata["failure"] = kind, reason
    logger.debug("sample %d failed: %s", sample.index, reason)


def _score_groups(samples: Sequence[Sample], group_reward_fn: GroupRewardFn) -> int:
    """Apply a group reward function to each group's scored samples; returns how many it failed."""
    scored = [s for s in samples if s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)]
    num_failed = 0
    for group in group_samples(scored):
        try:
            values = [float(v) for v in resolve_reward(group_reward_fn(list(group)))]
            if len(values) != len(group) or not all(math.isfinite(v) for v in values):
                raise ValueError(f"returned {values[:8]} for {len(group)} samples, expected one finite float each")
        except Exception as err:  # noqa: BLE001 - a bad group reward fails this group only
            for sample in group:
                _fail(sample, "reward_error", f"group reward function {type(err).__name__}: {err}")
            num_failed += len(group)
            continue
        for sample, value in zip(group, values):
            sample.reward = value
    return num_failed


def outcome_counts(samples: Sequence[Sample]) -> dict[str, float]:
    """Scored samples per ``metadata["reward_outcome"]``, as metrics ``reward_outcome/<outcome>``.

    Rewards that say why a sample scored what it did set that key (the code reward: passed, failed_tests, timeout,
    memory, blocked_network, ...; ``miles.rollout.rewards.CODE_OUTCOMES``); a wrong program is a valid 0, not a
    failed sample, so these are counted apart from ``failure_counts``. Empty when no sample has the key; FAILED
    and ABORTED samples are not counted.
    """
    counts: dict[str, float] = {}
    for sample in samples:
        outcome = sample.metadata.get("reward_outcome")
        if outcome is not None and sample.status not in (SampleStatus.FAILED, SampleStatus.ABORTED):
            counts[f"reward_outcome/{outcome}"] = counts.get(f"reward_outcome/{outcome}", 0.0) + 1.0
    return counts


def failure_counts(samples: Sequence[Sample]) -> dict[str, float]:
    """Failed samples per ``metadata["failure_kind"]``, as metrics ``samples/failed_<kind>``.

    Every reward kind (``FAILURE_KINDS``) is present, 0.0 when none failed that way, so each metric is a continuous
    series; another kind set by other code is added when it occurs. FAILED samples without a kind (engine or data
    failures) are counted only in ``samples/failed``.
    """
    counts = {f"samples/failed_{kind}": 0.0 for kind in FAILURE_KINDS}
    for sample in samples:
        kind = sample.metadata.get("failure_kind")
        if sample.status == SampleStatus.FAILED and kind is not None:
            counts[f"samples/failed_{kind}"] = counts.get(f"samples/failed_{kind}", 0.0) + 1.0
    return counts


def resolve_reward(value: Any) -> Any:
    """``value``, or the result it awaits when the reward function is ``async def`` (a call to an ``async`` reward
    model or judge returns a coroutine): run to completion on an event loop of its own, in this thread, or in a
    helper thread when this one already runs a loop (a reward scored from async code). Raises what it raises."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = asyncio.run(wait())
        except BaseException as err:  # noqa: BLE001 - re-raised in the calling thread
            result["error"] = err

    thread = threading.Thread(target=run, name="async-reward", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _call(reward_fn: RewardFn, sample: Sample) -> RewardOutcome:
    try:
        return RewardOutcome(value=resolve_reward(reward_fn(sample)))
    except Exception as err:  # noqa: BLE001 - any reward bug fails this sample only
        return RewardOutcome(error=err)


def _failure(outcome: RewardOutcome) -> tuple[str, str] | None:
    """(failure kind, reason) of a reward call that failed or gave no finite number; None for a good reward."""
    err, value = outcome.error, outcome.value
    if isinstance(err, RewardWorkerError):
        return err.kind, str(err)
    if err is not None:
        kind = "reward_memory" if isinstance(err, MemoryError) else "reward_error"
        kind = "reward_timeout" if isinstance(err, RewardTimeoutError) else kind
        return kind, f"reward function raised {type(err).__name__}: {err}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return "reward_error", f"reward function returned {type(value).__name__} {value!r}, expected a finite float"
    if not math.isfinite(value):
        return "reward_error", f"reward function returned {value}"
    return None


class TimeLimitedReward:
    """``RewardFn`` wrapper: each call runs in a daemon thread and raises ``RewardTimeoutError`` after ``timeout_s``.

    ``score_samples`` turns the error into a FAILED sample, so a hanging scorer (a stuck HTTP call, a regex
    blow-up) costs one sample and ``timeout_s`` seconds, not the run. ``call_batch`` (what ``score_samples`` uses)
    starts every call of a batch at once against one deadline, so a scorer that hangs on every sample costs a batch
    ``timeout_s`` in all, not ``timeout_s`` per sample one after another. Python cannot kill a thread: a hung call
    keeps its daemon thread (which never blocks interpreter exit). After ``max_hung`` calls are still running,
    further calls fail fast with a message, since the scorer is evidently broken and threads would pile up.
    ``ProcessPoolReward`` kills a hung call instead.

    Args:
        reward_fn: the scorer to wrap.
        timeout_s: seconds one call may take.
        max_hung: how many timed-out calls may still be running before the wrapper stops calling the scorer.
    """

    def __init__(self, reward_fn: RewardFn, *, timeout_s: float, max_hung: int = 64) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s is {timeout_s}; it must be > 0 (0 in the config means no limit)")
        self.reward_fn, self.timeout_s, self.max_hung = reward_fn, timeout_s, max_hung
        self._hung: list[threading.Thread] = []

    def call_batch(self, samples: Sequence[Sample]) -> list[RewardOutcome]:
        """One call per sample, all running at once in daemon threads (at most ``max_hung`` minus the hung ones at
        a time), each given until ``timeout_s`` after its chunk started; returns their outcomes in order (a call
        still running then: ``RewardTimeoutError``). The scorer must allow concurrent calls (the built-in ones keep
        no state between calls)."""
        outcomes: list[RewardOutcome] = []
        while len(outcomes) < len(samples):
            self._hung = [t for t in self._hung if t.is_alive()]
            room = self.max_hung - len(self._hung)
            rest = samples[len(outcomes) :]
            if room <= 0:  # the scorer is broken: each call fails fast with the message of __call__
                outcomes.extend(_call(self, s) for s in rest)
                break
            outcomes.extend(self._at_once(rest[:room]))
        return outcomes

    def _at_once(self, samples: Sequence[Sample]) -> list[RewardOutcome]:
        results: list[dict[str, object]] = [{} for _ in samples]

        def call(sample: Sample, result: dict[str, object]) -> None:
            try:
                result["value"] = resolve_reward(self.reward_fn(sample))
            except BaseException as err:  # noqa: BLE001 - returned as the sample's outcome
                result["error"] = err

        threads = [
            threading.Thread(target=call, args=(s, r), name=f"reward-{s.index}", daemon=True)
            for s, r in zip(samples, results)
        ]
        deadline = time.monotonic() + self.timeout_s
        for thread in threads:
            thread.start()
        outcomes = []
        for thread, result in zip(threads, results):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self._hung.append(thread)
                err = RewardTimeoutError(f"reward function did not return within reward.timeout_s={self.timeout_s}s")
                outcomes.append(RewardOutcome(error=err))
            elif "error" in result:
                error = result["error"]
                if not isinstance(error, Exception):  # KeyboardInterrupt / SystemExit: not a sample failure
                    raise error  # type: ignore[misc]
                outcomes.append(RewardOutcome(error=error))
            else:
                outcomes.append(RewardOutcome(value=result["value"]))
        return outcomes

    def __call__(self, sample: Sample) -> float:
        self._hung = [t for t in self._hung if t.is_alive()]
        if len(self._hung) >= self.max_hung:
            raise RewardTimeoutError(
                f"{len(self._hung)} earlier reward calls are still running past reward.timeout_s={self.timeout_s}; "
                "the scorer is not called again. Fix the reward function (it hangs) or raise --reward.timeout-s."
            )
        result: dict[str, object] = {}

        def call() -> None:
            try:
                result["value"] = resolve_reward(self.reward_fn(sample))
            except BaseException as err:  # noqa: BLE001 - re-raised in the calling thread
                result["error"] = err

        thread = threading.Thread(target=call, name=f"reward-{sample.index}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self._hung.append(thread)
            raise RewardTimeoutError(f"reward function did not return within reward.timeout_s={self.timeout_s}s")
        if "error" in result:
            raise result["error"]  # type: ignore[misc]
        return result["value"]  # type: ignore[return-value]
