"""Scoring samples with a reward function, where one bad reward never takes the run down."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from miles.core.protocols import RewardFn
from miles.core.sample import Sample, SampleStatus

logger = logging.getLogger(__name__)


def score_samples(samples: Sequence[Sample], reward_fn: RewardFn) -> int:
    """Set ``sample.reward`` for every sample; returns how many failed.

    A reward function that raises, or returns None / NaN / inf / a non-number, marks the sample FAILED with the
    reason in ``metadata["failure"]``; failed samples are excluded from advantages and the loss.
    """
    num_failed = 0
    for sample in samples:
        if sample.status in (SampleStatus.FAILED, SampleStatus.ABORTED):
            num_failed += 1
            continue
        try:
            value = reward_fn(sample)
        except Exception as err:  # noqa: BLE001 - any reward bug fails this sample only
            reason = f"reward function raised {type(err).__name__}: {err}"
        else:
            if isinstance(value, bool) or not isinstance(value, int | float):
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
