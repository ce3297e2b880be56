"""Policy losses (per token), the critic's value loss, and their aggregation into one scalar.

Policy losses share one signature, ``fn(log_probs, old_log_probs, advantages, loss_mask, params) -> (token_loss,
clipped)`` with [B, T] tensors; ``miles.core.algorithms.registry.POLICY_LOSSES`` is the only place a loss name is
matched, and a custom loss is a ``module:attr`` with that signature. Aggregation takes the *global* denominators
(tokens or sequences of the whole global batch, over all micro-batches and ranks) as arguments, so that summing
micro-batch losses equals the loss of one big batch.

Masked positions (padding, tool tokens, filtered samples) are removed by selection (``torch.where``), never by
multiplying with the mask: ``0 * x`` is NaN for x = NaN/inf, and in the backward pass the chain rule multiplies the
zero gradient of a masked slot by the local derivative there, so one NaN/inf input at a masked slot would make the
gradient of every parameter NaN. ``policy_loss`` therefore hands every loss (built-in or custom) 0 at the masked
slots of its per-token inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from miles.core.algorithms.ratios import LOG_RATIO_CLAMP
from torch import Tensor

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


@dataclass(frozen=True)
class LossParams:
    """Scalars of the policy losses (from ``algorithm.loss``).

    Attributes:
        clip_low: ratio >= 1 - clip_low (ppo, gspo; cispo's IS-weight floor).
        clip_high: ratio <= 1 + clip_high (ppo, gspo; cispo's IS-weight cap).
        dual_clip_c: ppo only: for negative advantages the loss is capped at c * |A| (c > 1); 0 disables.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float = 0.0


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A) per token and where the clipped branch is taken."""
    unclipped = -ratio * advantages
    clipped_loss = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped


def _check_shapes(*tensors: Tensor) -> None:
    if len({t.shape for t in tensors}) != 1:
        raise ValueError(
            f"shape mismatch: {[tuple(t.shape) for t in tensors]} (log_probs, old_log_probs, advantages...)"
        )


def zero_masked(values: Tensor, loss_mask: Tensor) -> Tensor:
    """``values`` with 0 at masked positions, by selection: NaN/inf there become 0 and get an exact 0 gradient.

    Args:
        values: [B, T] float, any value (NaN/inf included) at masked positions; may carry grad.
        loss_mask: [B, T] bool, True = kept.
    Returns: [B, T], the dtype of ``values``.
    """
    return torch.where(loss_mask, values, torch.zeros((), dtype=values.dtype))


def ppo_clip(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A), r = exp(log_probs - old_log_probs).

    With dual clip (c > 1), a token with A < 0 has its loss capped at -c*A: a huge ratio on a bad token can no
    longer produce an unbounded loss (gradient 0 once capped).

    Args:
        log_probs: [B, T] float32 nats, log pi_theta of the sampled tokens; carries grad.
        old_log_probs: [B, T] float32 nats, the same tokens before this update; no grad.
        advantages: [B, T] float32, one value per token.
            All three must be finite at masked positions (``policy_loss`` puts 0 there): the loss is unmasked.
        clip_low: lower clip, ratio >= 1 - clip_low.
        clip_high: upper clip, ratio <= 1 + clip_high (> clip_low = DAPO clip-higher).
        dual_clip_c: the dual-clip constant c (> 1, typically 3); 0 disables.
    Returns: token_loss [B, T] float32, unmasked; clipped [B, T] bool, True where a clipped branch was taken
        (it has zero gradient there).
    Raises: ValueError on shape mismatch.
    References: PPO arXiv:1707.06347 Eq. 7; asymmetric clip: DAPO arXiv:2503.14476 Eq. 10;
        dual clip: Ye et al. arXiv:1912.09729 Eq. 5.
    """
    _check_shapes(log_probs, old_log_probs, advantages)
    log_ratio = (log_probs.float() - old_log_probs.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_loss, clipped = _clipped_surrogate(torch.exp(log_ratio), advantages, clip_low=clip_low, clip_high=clip_high)
    if dual_clip_c > 0.0:
        cap = -dual_clip_c * advantages
        dual = (advantages < 0) & (token_loss > cap)
        token_loss = torch.where(dual, cap, token_loss)
        clipped = clipped | dual
    return token_loss, clipped


def gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, Tensor]:
    """GSPO: PPO clipping on the length-normalized sequence ratio s_i = exp(mean_t (log_probs - old_log_probs)).

    Token form (GSPO-token, Eq. 13): s_it = sg[s_i] * pi_t / sg[pi_t] has the value s_i and the gradient
    s_i * grad log pi_t, so ``seq_mean_token_mean`` aggregation gives the paper's sequence objective exactly.

    Args:
        log_probs: [B, T] float32 nats; carries grad.
        old_log_probs: [B, T] float32 nats; no grad.
        advantages: [B, T] float32, the sequence advantage on each of its tokens; any value at masked positions.
        loss_mask: [B, T] bool; only masked-in tokens enter s_i, and masked positions get loss and gradient 0
            (selected away, so NaN/inf there is harmless).
        clip_low, clip_high: clip of s_i (the paper uses 3e-4 and 4e-4).
    Returns: token_loss [B, T] float32; clipped [B, T] bool (the whole sequence when s_i is clipped).
    References: GSPO, Zheng et al. arXiv:2507.18071 Eq. 5-7, 13.
    """
    _check_shapes(log_probs, old_log_probs, advantages, loss_mask)
    # Selection first: a NaN/inf log-prob at a masked slot must reach neither s_i nor the gradient.
    log_probs = zero_masked(log_probs.float(), loss_mask)
    log_ratio = torch.where(loss_mask, log_probs - old_log_probs.float(), 0.0)
    seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_log_ratio = seq_log_ratio.detach() + log_probs - log_probs.detach()  # value: seq ratio
    advantages = zero_masked(advantages, loss_mask)
    return _clipped_surrogate(torch.exp(token_log_ratio), advantages, clip_low=clip_low, clip_high=clip_high)


def cispo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """CISPO per-token loss -sg(clip(r, 1-clip_low, 1+clip_high)) * A * log_probs, r = exp(log_probs - old).

    Unlike PPO, clipping bounds the (stop-gradient) importance weight and never drops a token's gradient.

    Args:
        log_probs: [B, T] float32 nats; carries grad.
        old_log_probs: [B, T] float32 nats; no grad.
        advantages: [B, T] float32.
            All three must be finite at masked positions (``policy_loss`` puts 0 there): the loss is unmasked, and
            a NaN/inf weight, advantage or log-prob there would make its gradient NaN.
        clip_low, clip_high: bounds of the IS weight (MiniMax-M1 effectively has no lower bound: clip_low ~1).
    Returns: token_loss [B, T] float32; clipped [B, T] bool where the weight was clipped.
    References: MiniMax-M1 arXiv:2506.13585 Eq. 4-5.
    """
    _check_shapes(log_probs, old_log_probs, advantages)
    with torch.no_grad():
        ratio = torch.exp((log_probs.float() - old_log_probs.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * log_probs.float(), weight != ratio


def sft_loss(log_probs: Tensor) -> tuple[Tensor, Tensor]:
    """Supervised fine-tuning: per-token negative log-likelihood -log_probs; the loss mask picks trained turns.

    Args:
        log_probs: [B, T] float32 nats of the target tokens; carries grad.
    Returns: token_loss [B, T] float32; clipped [B, T] bool, all False.
    """
    return -log_probs.float(), torch.zeros(log_probs.shape, dtype=torch.bool)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, *, clip: float) -> tuple[Tensor, Tensor]:
    """Clipped critic loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2) per token.

    Args:
        values: [B, T] float32 critic output; carries grad.
        old_values: [B, T] float32 critic output at rollout time (the GAE input); no grad.
        returns: [B, T] float32 value targets (GAE advantages + old values); no grad.
        clip: value clip range (in reward units); the clipped branch has zero gradient.
    Returns: token_loss [B, T] float32, unmasked; clipped [B, T] bool where the clipped branch is larger.
    References: PPO2 baselines value clipping; Andrychowicz et al. arXiv:2006.05990 Sec. 3.2; verl compute_value_loss.
    """
    _check_shapes(values, old_values, returns)
    values = values.float()
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, LossParams], tuple[Tensor, Tensor]]


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


LossReducer = Callable[[Tensor, Tensor, int, int], Tensor]
"""Custom aggregation: ``fn(token_loss [B, T], loss_mask [B, T] bool, num_tokens, num_sequences) -> scalar``, where
the counts are of the global batch; it must be a sum over rows divided by global constants, so that micro-batch
results add up to the full batch's."""


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    params: LossParams,
    aggregation: Aggregation,
    num_tokens: int,
    num_sequences: int,
    loss: str | PolicyLossFn = "ppo",
    reducer: LossReducer | None = None,
    normalizer: float | None = None,
    token_weights: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    metrics_num_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss with optional importance weights, KL-to-reference and entropy terms, aggregated over the mask.

    loss = agg(w * pg_token) + kl_coef * agg(kl_token) - entropy_coef * agg(entropy_token).

    Args:
        log_probs: [B, T] float32 nats, current policy; carries grad.
        old_log_probs: [B, T] float32 nats; no grad.
        advantages: [B, T] float32.
        loss_mask: [B, T] bool. Every per-token input may hold any value (NaN/inf included) at masked positions:
            it is replaced by 0 there by selection, so masked slots add exactly 0 to the loss and every gradient.
        params: clip bounds and dual-clip constant (see ``LossParams``).
        aggregation, num_tokens, num_sequences, normalizer: see ``aggregate``; counts are of the global batch.
        loss: a registered policy loss name (ppo, gspo, cispo, sft) or a custom ``PolicyLossFn``.
        reducer: a custom aggregation replacing ``aggregation`` (see ``LossReducer``).
        token_weights: [B, T] float32 rollout-correction weights (TIS/MIS, see ``importance.py``); no grad.
        ref_log_probs: [B, T] float32 nats of the reference policy; required when kl_coef > 0. The KL term is
            always computed from ``log_probs`` with gradient.
        kl_coef, kl_estimator: KL loss weight and estimator (see ``kl_estimate``).
        entropy: [B, T] float32 nats per token (with grad if entropy_coef > 0).
        entropy_coef: entropy bonus weight.
        metrics_num_tokens: token denominator of the token-mean metrics (default ``num_tokens``); differs when
            the caller skips rows that cannot change the loss.
    Returns: (loss scalar with grad, metrics of detached scalars: loss/pg, loss/kl, entropy, pg_clipfrac, ppo_kl),
        every metric already divided by the global denominators so micro-batch values add up.
    Raises: ValueError if kl_coef > 0 without ref_log_probs, or for an unknown loss name.
    """
    from miles.core.algorithms.kl import kl_estimate

    def reduce(values: Tensor) -> Tensor:
        if reducer is not None:
            return reducer(values, loss_mask, num_tokens, num_sequences)
        return aggregate(
            values,
            loss_mask,
            mode=aggregation,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            normalizer=normalizer,
        )

    from miles.core.algorithms.registry import get_policy_loss  # the registry imports this module's losses

    loss_fn = get_policy_loss(loss).fn if isinstance(loss, str) else loss
    # Selection, not multiplication (see the module docstring): every per-token input is 0 at masked slots, so a
    # NaN/inf there (padding, a filtered sample) changes neither the loss nor any gradient.
    log_probs, old_log_probs, advantages = (zero_masked(t, loss_mask) for t in (log_probs, old_log_probs, advantages))
    if ref_log_probs is not None:
        ref_log_probs = zero_masked(ref_log_probs, loss_mask)
    if token_weights is not None:
        token_weights = zero_masked(token_weights, loss_mask)
    if entropy is not None:
        entropy = zero_masked(entropy, loss_mask)
    pg_token, clipped = loss_fn(log_probs, old_log_probs, advantages, loss_mask, params)
    if token_weights is not None:
        pg_token = pg_token * token_weights.detach()
    pg_loss = reduce(pg_token)
    total = pg_loss
    metrics = {"loss/pg": pg_loss.detach()}
    tok = dict(mode="token_mean", num_tokens=metrics_num_tokens or num_tokens)
    with torch.no_grad():
        metrics["pg_clipfrac"] = aggregate(clipped.float(), loss_mask, **tok)
        metrics["ppo_kl"] = aggregate(old_log_probs - log_probs.detach(), loss_mask, **tok)
    if kl_coef > 0.0:
        if ref_log_probs is None:
            raise ValueError("kl_coef > 0 but the batch has no ref_log_probs; the backend must compute them")
        kl_loss = reduce(kl_estimate(log_probs, ref_log_probs, estimator=kl_estimator))
        total = total + kl_coef * kl_loss
        metrics["loss/kl"] = kl_loss.detach()
    if entropy is not None:
        if entropy_coef > 0.0:
            total = total - entropy_coef * reduce(entropy)
        metrics["entropy"] = aggregate(entropy.detach(), loss_mask, **tok)
    return total, metrics
