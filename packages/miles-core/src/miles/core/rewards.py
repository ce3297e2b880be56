"""Scoring samples with a reward function, where one bad reward never takes the run down."""

from __future__ import annotations

import logging
import math
import numbers
import threading
from collections.abc import Sequence

from miles.core.protocols import RewardFn
from miles.core.sample import Sample, SampleStatus

logger = logging.getLogger(__name__)


def score_samples(samples: Sequence[Sample], reward_fn: RewardFn) -> int:
    """Set ``sample.reward`` for every sample that is not FAILED or ABORTED; returns how many failed (FAILED
    before scoring or made FAILED here; ABORTED samples are skipped and not counted).

    A reward function that raises, or returns None / NaN / inf / a non-number, marks the sample FAILED with the
    reason in ``metadata["failure"]``; failed samples are excluded from advantages and the loss.
    """
    num_failed = 0
    for sample in samples:
        if sample.status == SampleStatus.ABORTED:  # cut off by the engine, not broken: neither scored nor failed
            continue
        if sample.status == SampleStatus.FAILED:
            num_failed += 1
            continue
        try:
            value = reward_fn(sample)
        except Exception as err:  # noqa: BLE001 - any reward bug fails this sample only
            reason = f"reward function raised {type(err).__name__}: {err}"
        else:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                reason = f"reward function returned {type(value).__name__} {value!r}, expected a finite float"
            elif not math.isfinite(value):
                reason = f"reward function returned {value}"
            else:
                sample.reward = float(value)
                continue
        sample.status = SampleStatus.FAILED
        sample.reward = None
        sample.metadata["failure"] = reason
        num_failed += 1
        logger.debug("sample %d failed: %s", sample.index, reason)
    return num_failed


class RewardTimeoutError(TimeoutError):
    """A reward function did not return within its time limit."""


class TimeLimitedReward:
    """``RewardFn`` wrapper: each call runs in a daemon thread and raises ``RewardTimeoutError`` after ``timeout_s``.

    ``score_samples`` turns the error into a FAILED sample, so a hanging scorer (a stuck HTTP call, a regex
    blow-up) costs one sample and ``timeout_s`` seconds, not the run. Python cannot kill a thread: a hung call
    keeps its daemon thread (which never blocks interpreter exit). After ``max_hung`` calls are still running,
    further calls fail fast with a message, since the scorer is evidently broken and threads would pile up.

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
                result["value"] = self.reward_fn(sample)
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
