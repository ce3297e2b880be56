"""Policy losses (per token) and their aggregation into one scalar.

Aggregation takes the *global* denominators (tokens or sequences of the whole global batch, over all
micro-batches and ranks) as arguments, so that summing micro-batch losses equals the loss of one big batch.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]

# exp() of larger log-ratios overflows; a ratio of e^20 is clipped by PPO anyway.
LOG_RATIO_CLAMP = 20.0


def ppo_clip(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A), r = exp(log_probs - old_log_probs).

    Args:
        log_probs: [B, T] float32 nats, log pi_theta of the sampled tokens; carries grad.
        old_log_probs: [B, T] float32 nats, the same tokens before this update; no grad.
        advantages: [B, T] float32, one value per token, 0 at masked positions.
        clip_low: lower clip, ratio >= 1 - clip_low.
        clip_high: upper clip, ratio <= 1 + clip_high (> clip_low = DAPO clip-higher).
    Returns: token_loss [B, T] float32, unmasked; clipped [B, T] bool, True where the clipped branch was taken
        (it has zero gradient there).
    Raises: ValueError on shape mismatch.
    References: PPO arXiv:1707.06347 Eq. 7; asymmetric clip: DAPO arXiv:2503.14476 Eq. 10.
    """
    if not (log_probs.shape == old_log_probs.shape == advantages.shape):
        raise ValueError(
            f"shape mismatch: log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)}, "
            f"advantages {tuple(advantages.shape)}"
        )
    log_ratio = (log_probs.float() - old_log_probs.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped_loss = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    token_loss = torch.maximum(unclipped, clipped_loss)
    return token_loss, clipped_loss > unclipped


def aggregate(
    token_loss: Tensor,
    loss_mask: Tensor,
    *,
    mode: Aggregation,
    num_tokens: int | None = None,
    num_sequences: int | None = None,
    normalizer: float | None = None,
) -> Tensor:
    """Reduce per-token values to a scalar over the masked (trained) positions.

    Modes (L_i = sum_t mask_it * loss_it, n_i = sum_t mask_it, S sequences, N = sum_i n_i tokens):
      token_mean: sum_i L_i / N (DAPO, arXiv:2503.14476 Eq. 12; default);
      seq_mean_token_mean: (1/S) sum_i L_i / n_i (GRPO paper, arXiv:2402.03300 Eq. 3);
      seq_mean_token_sum: (1/S) sum_i L_i;
      seq_mean_token_sum_norm: (1/S) sum_i L_i / normalizer, a constant such as the max response length
        (Dr.GRPO, arXiv:2503.20783), which removes the length bias of seq_mean_token_mean.

    Args:
        token_loss: [B, T] float32 per-token values, any value at masked positions.
        loss_mask: [B, T] bool, True = counted. Masked positions contribute exactly 0 to value and gradient.
        mode: one of the modes above.
        num_tokens: N of the whole global batch (token_mean); default this tensor's masked count.
        num_sequences: S of the whole global batch (seq_* modes); default B.
        normalizer: the constant of seq_mean_token_sum_norm (required for that mode).
    Returns: scalar float32. Empty selections give 0 (never NaN).
    Raises: ValueError on shape mismatch, a missing normalizer or an unknown mode.
    """
    if token_loss.shape != loss_mask.shape:
        raise ValueError(f"token_loss {tuple(token_loss.shape)} != loss_mask {tuple(loss_mask.shape)}")
    mask = loss_mask.to(token_loss.dtype)
    # where() rather than multiply: a NaN/inf at a masked slot must not leak into the sum or its gradient.
    seq_sum = torch.where(loss_mask, token_loss, torch.zeros_like(token_loss)).sum(dim=-1)  # [B]
    if mode == "token_mean":
        denom = num_tokens if num_tokens is not None else mask.sum()
        return seq_sum.sum() / max(denom, 1) if isinstance(denom, int) else seq_sum.sum() / denom.clamp(min=1)
    num_sequences = num_sequences if num_sequences is not None else token_loss.shape[0]
    if mode == "seq_mean_token_mean":
        per_seq = seq_sum / mask.sum(dim=-1).clamp(min=1)
    elif mode == "seq_mean_token_sum":
        per_seq = seq_sum
    elif mode == "seq_mean_token_sum_norm":
        if normalizer is None or normalizer <= 0:
            raise ValueError(f"aggregation 'seq_mean_token_sum_norm' needs a positive normalizer, got {normalizer}")
        per_seq = seq_sum / normalizer
    else:
        raise ValueError(
            f"unknown aggregation {mode!r}; choose token_mean, seq_mean_token_mean, seq_mean_token_sum "
            "or seq_mean_token_sum_norm"
        )
    return per_seq.sum() / max(num_sequences, 1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy -sum_v p_v log p_v of softmax(logits), in nats.

    Args:
        logits: [B, T, V] float (already temperature-scaled).
    Returns: [B, T] float32.
    """
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: Aggregation,
    num_tokens: int,
    num_sequences: int,
    normalizer: float | None = None,
    ref_log_probs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    metrics_num_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip policy loss with optional KL-to-reference and entropy terms, aggregated over the loss mask.

    loss = agg(pg_token) + kl_coef * agg(kl_token) - entropy_coef * agg(entropy_token).

    Args:
        log_probs: [B, T] float32 nats, current policy; carries grad.
        old_log_probs: [B, T] float32 nats; no grad.
        advantages: [B, T] float32, 0 at masked positions.
        loss_mask: [B, T] bool.
        clip_low, clip_high: PPO clip bounds (see ``ppo_clip``).
        aggregation, num_tokens, num_sequences, normalizer: see ``aggregate``; counts are of the global batch.
        ref_log_probs: [B, T] float32 nats of the reference policy; required when kl_coef > 0.
        kl_coef, kl_estimator: KL term weight and estimator (see ``kl_estimate``).
        entropy: [B, T] float32 nats per token (with grad if entropy_coef > 0).
        entropy_coef: entropy bonus weight.
        metrics_num_tokens: token denominator of the token-mean metrics (default ``num_tokens``); differs when
            the caller skips rows that cannot change the loss.
    Returns: (loss scalar with grad, metrics of detached scalars: loss/pg, loss/kl, entropy, pg_clipfrac, ppo_kl),
        every metric already divided by the global denominators so micro-batch values add up.
    """
    from miles.core.algorithms.kl import kl_estimate

    agg = dict(mode=aggregation, num_tokens=num_tokens, num_sequences=num_sequences, normalizer=normalizer)
    pg_token, clipped = ppo_clip(log_probs, old_log_probs, advantages, clip_low=clip_low, clip_high=clip_high)
    pg_loss = aggregate(pg_token, loss_mask, **agg)
    loss = pg_loss
    metrics = {"loss/pg": pg_loss.detach()}
    with torch.no_grad():
        tok = dict(mode="token_mean", num_tokens=metrics_num_tokens or num_tokens)
        metrics["pg_clipfrac"] = aggregate(clipped.float(), loss_mask, **tok)
        metrics["ppo_kl"] = aggregate(old_log_probs - log_probs.detach(), loss_mask, **tok)
    if kl_coef > 0.0:
        if ref_log_probs is None:
            raise ValueError("kl_coef > 0 but the batch has no ref_log_probs; the backend must compute them")
        kl_loss = aggregate(kl_estimate(log_probs, ref_log_probs, estimator=kl_estimator), loss_mask, **agg)
        loss = loss + kl_coef * kl_loss
        metrics["loss/kl"] = kl_loss.detach()
    if entropy is not None:
        entropy_mean = aggregate(entropy, loss_mask, mode="token_mean", num_tokens=metrics_num_tokens or num_tokens)
        if entropy_coef > 0.0:
            loss = loss - entropy_coef * aggregate(entropy, loss_mask, **agg)
        metrics["entropy"] = entropy_mean.detach()
    return loss, metrics
