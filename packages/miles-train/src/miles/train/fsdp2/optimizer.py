"""The optimizer step shared by the policy and the critic: gradient clipping, a guard against non-finite steps and
the linear LR warmup (``train.warmup_steps``, ``train.skip_nonfinite_steps``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger(__name__)


def warmup_factor(step: int, *, warmup_steps: int) -> float:
    """LR multiplier of optimizer step ``step`` (0-based): min(1, (step + 1) / warmup_steps); 1.0 without warmup."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


def warmup_schedule(optimizer: torch.optim.Optimizer, *, warmup_steps: int, steps_done: int = 0) -> LambdaLR:
    """Linear warmup of every param group's LR to its base value over ``warmup_steps`` optimizer steps.

    Args:
        optimizer: the optimizer whose ``lr`` is the peak (base) learning rate.
        warmup_steps: steps of the ramp; 0 = constant LR.
        steps_done: optimizer steps already applied, to continue a schedule whose state was never saved (the next
            step then uses ``warmup_factor(steps_done)``); 0 for a fresh run.
    Returns: the scheduler; call its ``step()`` after each applied optimizer step.
    """
    for group in optimizer.param_groups:  # LambdaLR needs the base LR to start past step 0
        group.setdefault("initial_lr", group["lr"])
    return LambdaLR(optimizer, lambda step: warmup_factor(step, warmup_steps=warmup_steps), last_epoch=steps_done - 1)


def guarded_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR,
    *,
    loss: float,
    grad_clip: float,
    skip_nonfinite: bool,
    step: int,
    what: str,
    lr_key: str,
    clip_grads: Callable[[float], torch.Tensor] | None = None,
    skip_note: str = "",
) -> tuple[float, bool]:
    """Clip the gradient norm; step the optimizer and the schedule only if ``loss`` and the norm are finite; zero
    the gradients. A non-finite step is never applied: it is skipped (``skip_nonfinite``) or stops the run.

    Args:
        model: the (FSDP2-sharded) module whose gradients were accumulated.
        optimizer, scheduler: its optimizer and LR schedule.
        loss: the global loss of the step (host float).
        grad_clip: max global L2 norm of the gradients.
        skip_nonfinite: ``train.skip_nonfinite_steps``.
        step: optimizer steps done before this one (0-based); messages name step + 1, the run's step number.
        what: "policy" or "critic", for messages; lr_key: the config key of its learning rate, e.g. "train.lr".
        clip_grads: ``max_norm -> norm``: computes the global gradient norm and clips to ``max_norm`` (a backend whose
            parameters are sharded in a way ``clip_grad_norm_`` cannot see, e.g. Megatron tensor parallelism);
            default ``torch.nn.utils.clip_grad_norm_`` over ``model``'s parameters.
        skip_note: what a skipped step's warning adds (e.g. the fp16 loss-scale overflow it was).
    Returns: (grad norm before clipping, True if the step was applied).
    Raises: FloatingPointError naming the values and the fixes when the step is non-finite and not skipped.
    """
    if clip_grads is None:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        grad_norm = clip_grads(grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # host sync
    finite = math.isfinite(grad_norm) and math.isfinite(loss)
    if finite:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if not finite and not skip_nonfinite:
        raise FloatingPointError(
            f"step {step + 1}: {what} loss is {loss} and grad norm {grad_norm}; applying it would turn the {what} "
            "weights into NaN, so the run stops (train.skip_nonfinite_steps is false). Usual causes: a too high "
            f"{lr_key}, bf16 overflow, or NaN rewards/advantages. Lower --{lr_key.replace('_', '-')}, use "
            "--train.dtype fp32, or set --train.skip-nonfinite-steps true to skip such steps and continue."
        )
    if not finite:
        logger.warning(
            "step %d: non-finite %s loss/grad norm (%s), optimizer step skipped%s", step + 1, what, grad_norm, skip_note
        )
    return grad_norm, finite
