"""Sample-level masks and reward shaping around the response length limit (DAPO's overlong handling)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from miles.core.sample import Sample, SampleStatus
from torch import Tensor


def overlong_penalty(response_lengths: Tensor, *, max_length: int, buffer_length: int, factor: float) -> Tensor:
    """DAPO soft overlong punishment, added to the reward of each sample.

    penalty(L) = 0                                   if L <= max_length - buffer_length,
                 factor * (max_length - buffer_length - L) / buffer_length   if within the buffer,
                 -factor                             if L > max_length.

    Args:
        response_lengths: [B] int64 response tokens.
        max_length: the response length limit (sampling.max_new_tokens).
        buffer_length: width of the penalty ramp before max_length, 1 <= buffer_length <= max_length.
        factor: penalty at (and beyond) max_length, as a positive magnitude.
    Returns: [B] float32 penalties (<= 0).
    Raises: ValueError if buffer_length is outside [1, max_length].
    References: DAPO arXiv:2503.14476 Eq. 13.
    """
    if not 1 <= buffer_length <= max_length:
        raise ValueError(f"overlong buffer_length must be in [1, max_length={max_length}], got {buffer_length}")
    excess = (response_lengths.float() - (max_length - buffer_length)).clamp(min=0.0, max=float(buffer_length))
    return -factor * excess / buffer_length


def overlong_filter_keep(samples: Sequence[Sample]) -> list[bool]:
    """DAPO overlong filtering: False for samples the engine cut at the length limit (status TRUNCATED).

    The decision comes from the finish reason, never from the last token: a response that ends in an end-of-turn
    id but was cut by length is still truncated, and one that stopped on any stop token is complete.
    References: DAPO arXiv:2503.14476 Sec. 3.4.
    """
    return [s.status != SampleStatus.TRUNCATED for s in samples]


def has_trainable_tokens(samples: Sequence[Sample]) -> list[bool]:
    """True for samples with at least one trainable response token of their own (``sample.loss_mask`` not all 0).

    False for an empty response and for one whose loss mask is all 0, e.g. a turn of only tool/environment tokens.
    Such a sample cannot be trained and, having no trainable token, leaves every group/batch statistic of the
    advantages (``AdvantageInputs.valid``). The overlong filter is not such a reason: it is decided separately.
    """
    return [s.response_length > 0 and (s.loss_mask is None or any(s.loss_mask)) for s in samples]


def response_mask(response_lengths: Tensor, num_columns: int) -> Tensor:
    """[B, T] bool, True at response columns t < response_lengths[b] (tool tokens included)."""
    return torch.arange(num_columns)[None, :] < response_lengths[:, None]
