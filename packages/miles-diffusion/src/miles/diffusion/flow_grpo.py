"""Flow-GRPO's objective over denoising steps, on ``miles.core``'s PPO clip and aggregation.

Each image is a trajectory of T denoising steps, each a Gaussian transition with a log-prob (``miles.diffusion.sde``);
the steps play the role of an LLM response's tokens: a [B, T] layout, one group-normalized advantage per image
broadcast over its trained steps, the clipped surrogate per step, a token-mean over the trained steps. Optional KL
to a reference model is the closed-form KL of two Gaussians with the same scale (Flow-GRPO, arXiv:2505.05470, Eq. 13).
Training on a subset of the sampled steps (the denoising-reduction trick) is a ``step_mask``.
"""

from __future__ import annotations

import torch
from miles.core.algorithms.losses import aggregate, ppo_clip
from torch import Tensor


def gaussian_kl(mean: Tensor, ref_mean: Tensor, scale: Tensor) -> Tensor:
    """KL(N(mean, s^2 I) || N(ref_mean, s^2 I)) = |mean - ref_mean|^2 / (2 s^2), averaged over each sample's elements
    (the per-element scale of ``transition_log_prob``).

    Args: mean [B, ...] (carries grad), ref_mean [B, ...], scale [B, 1, ...] > 0. Returns: [B] float32 >= 0.
    """
    scale = scale.float().expand_as(mean)
    return ((mean.float() - ref_mean.detach().float()) ** 2 / (2 * scale**2)).flatten(1).mean(dim=1)


def flow_grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    step_mask: Tensor,
    *,
    clip_low: float = 1e-4,
    clip_high: float = 1e-4,
    advantage_clip: float = 5.0,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Flow-GRPO loss: mean over trained steps of -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef * KL.

    Args:
        log_probs: [B, T] float32, each step's transition log-prob under the current policy (carries grad).
        old_log_probs: [B, T] float32, the same steps under the sampling policy.
        advantages: [B] float32, one per image (e.g. ``miles.core``'s GRPO group-normalized reward), clipped to
            +-``advantage_clip`` as Flow-GRPO does.
        step_mask: [B, T] bool, True at the steps trained on.
        clip_low, clip_high: the ratio clip; Flow-GRPO's ratios of averaged per-element densities move little, so
            its clip range is small (1e-4).
        kl: [B, T] float32 per-step ``gaussian_kl`` to a reference, or None.
        kl_coef: its weight (> 0 needs ``kl``).
    Returns: (scalar loss, metrics: ``clipfrac``, ``approx_kl`` (E[(r - 1) - log r] over trained steps), ``kl``).
    Raises: ValueError on shape mismatch or kl_coef > 0 without kl.
    """
    if advantages.dim() != 1 or advantages.shape[0] != log_probs.shape[0]:
        raise ValueError(f"advantages must be [B] = [{log_probs.shape[0]}], got {tuple(advantages.shape)}")
    if kl_coef > 0 and kl is None:
        raise ValueError("kl_coef > 0 needs the per-step kl to a reference model")
    per_step = advantages.float().clamp(-advantage_clip, advantage_clip)[:, None].expand_as(log_probs)
    step_loss, clipped = ppo_clip(log_probs, old_log_probs, per_step, clip_low=clip_low, clip_high=clip_high)
    metrics: dict[str, Tensor] = {}
    if kl is not None:
        step_loss = step_loss + kl_coef * kl
        metrics["kl"] = aggregate(kl.detach(), step_mask, mode="token_mean")
    loss = aggregate(step_loss, step_mask, mode="token_mean")
    log_ratio = (log_probs.detach() - old_log_probs).float()
    metrics["clipfrac"] = aggregate(clipped.float(), step_mask, mode="token_mean")
    metrics["approx_kl"] = aggregate(torch.expm1(log_ratio) - log_ratio, step_mask, mode="token_mean")
    return loss, metrics
