"""Dynamic loss scaling for fp16 training (``train.dtype fp16``).

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero and values above 65504 overflow. Multiplying the loss
by a scale S before the backward moves small gradients into range; they are divided by S before the optimizer sees
them. S is adapted (Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740): a step whose unscaled
gradients are non-finite was an overflow, so it is skipped and S is multiplied by ``backoff_factor``; after
``growth_interval`` applied steps in a row S is multiplied by ``growth_factor``. These are ``torch.amp.GradScaler``'s
rules and defaults; the scaler is kept here because the overflow decision must be the same on every rank, and the
FSDP2 backend already reduces the global gradient norm it clips with (non-finite on every rank when any rank
overflowed), which GradScaler's per-rank ``found_inf`` is not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch


@dataclass
class DynamicLossScaler:
    """The loss scale and its schedule (state saved with checkpoints, so a resumed run continues it exactly).

    Attributes:
        scale: the current loss scale S (a power of two by default, so scaling is exact in binary floating point).
        growth_factor: S is multiplied by this after ``growth_interval`` applied steps in a row.
        backoff_factor: S is multiplied by this after an overflow.
        growth_interval: applied steps in a row before S grows.
        min_scale: S never goes below this.
        good_steps: applied steps since the last overflow or growth.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Divide every gradient by ``scale`` in place (plain tensors or DTensor shards)."""
        inverse = 1.0 / self.scale
        for param in params:
            if param.grad is not None:
                param.grad.mul_(inverse)

    def backed_off(self) -> float:
        """The scale after an overflow now: ``max(scale * backoff_factor, min_scale)``."""
        return max(self.scale * self.backoff_factor, self.min_scale)

    def update(self, *, overflow: bool) -> None:
        """Advance the schedule after a step: back off on ``overflow``, else count the step and grow after
        ``growth_interval`` of them."""
        if overflow:
            self.scale = self.backed_off()
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        """Every field (scale, its schedule and ``good_steps``), for ``trainer_state.json``."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Continue from ``state_dict()``'s ``scale`` and ``good_steps``; the schedule stays this scaler's own.

        Raises: KeyError when ``state`` lacks either."""
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


__all__ = ["DynamicLossScaler"]
