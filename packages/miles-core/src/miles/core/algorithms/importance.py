"""Rollout/training mismatch corrections: weights from the trainer's old log-probs vs the engine's, no gradient.

The engine samples from pi_rollout (other kernels, other precision) while PPO's ratio assumes pi_old; each token's
loss is multiplied by a detached weight built from rho = pi_old / pi_rollout:
  tis: rho clamped to [lower, upper] (truncated importance sampling);
  mis: rho where lower <= rho <= upper, else 0 (masked importance sampling);
  icepop: mis at token level (IcePop, the Ring-1T paper's calibration).
``level`` says where rho is measured: per token; per sequence (product over its tokens); or the sequence's
geometric mean (exp of the mean token log-ratio, length-independent).
Off-policy sequence masking (OPSM) drops negative-advantage sequences that drifted too far from the sampler.
"""

from __future__ import annotations

from typing import Literal

import torch
from miles.core.algorithms.ratios import LOG_RATIO_CLAMP
from torch import Tensor

ImportanceMode = Literal["tis", "mis", "icepop"]
ImportanceLevel = Literal["token", "sequence", "geometric"]


def importance_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    *,
    mode: ImportanceMode,
    level: ImportanceLevel,
    lower: float,
    upper: float,
) -> tuple[Tensor, Tensor]:
    """Detached per-token weights w(rho), rho = pi_old / pi_rollout at the chosen level.

    Args:
        old_log_probs: [B, T] float32 nats, trainer's log-probs of the sampled tokens (pre-update); no grad.
        rollout_log_probs: [B, T] float32 nats, the engine's log-probs of the same tokens.
        loss_mask: [B, T] bool; masked tokens are left out of sequence sums and get weight 0.
        mode: "tis" (clamp), "mis" (zero outside the bounds), "icepop" (mis at token level).
        level: "token", "sequence" (rho_i = prod_t rho_t) or "geometric" (rho_i = (prod_t rho_t)^(1/n_i)).
        lower, upper: bounds on rho, 0 <= lower <= 1 <= upper.
    Returns: (weights [B, T] float32, 0 off the mask; outside [B, T] bool, True where rho was clamped or masked).
    Raises: ValueError for bounds out of order, an unknown mode or level, or mismatched shapes.
    References: TIS, Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (2025);
        MIS/sequence level, Liu et al., "When Speed Kills Stability" (2025); IcePop, Ring-1T arXiv:2510.18855 Eq. 4.
    """
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != loss_mask.shape:
        raise ValueError(
            f"shape mismatch: old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs "
            f"{tuple(rollout_log_probs.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    if not 0.0 <= lower <= 1.0 <= upper:
        raise ValueError(f"importance bounds must satisfy 0 <= lower <= 1 <= upper, got lower={lower}, upper={upper}")
    if mode == "icepop":
        mode, level = "mis", "token"
    with torch.no_grad():
        log_rho = torch.where(loss_mask, old_log_probs.float() - rollout_log_probs.float(), 0.0)
        if level == "sequence":
            log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho)
        elif level == "geometric":
            mean = log_rho.sum(dim=-1, keepdim=True) / loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
            log_rho = mean.expand_as(log_rho)
        elif level != "token":
            raise ValueError(f"unknown importance level {level!r}; choose token, sequence or geometric")
        rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        outside = ((rho < lower) | (rho > upper)) & loss_mask
        if mode == "tis":
            weights = rho.clamp(lower, upper)
        elif mode == "mis":
            weights = torch.where(outside, 0.0, rho)
        else:
            raise ValueError(f"unknown importance mode {mode!r}; choose tis, mis or icepop")
        return torch.where(loss_mask, weights, 0.0), outside


def ess_ratio(weights: Tensor, loss_mask: Tensor) -> Tensor:
    """Effective sample size ratio (sum w)^2 / (N sum w^2) over the N masked tokens: 1 = on-policy, -> 0 = degenerate.

    Args:
        weights: [B, T] float32 importance weights; loss_mask: [B, T] bool.
    Returns: scalar float32; 1.0 when there are no masked tokens or all weights are 0.
    References: Kong (1992); used as an off-policy health metric by slime/verl rollout correction.
    """
    w = torch.where(loss_mask, weights.float(), 0.0)
    count, total, total_sq = loss_mask.sum(), w.sum(), w.square().sum()
    if int(count) == 0 or float(total_sq) == 0.0:  # host sync (metrics)
        return torch.tensor(1.0)
    return total.square() / (count * total_sq)


def off_policy_sequence_mask(
    log_probs: Tensor, rollout_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor, *, threshold: float
) -> Tensor:
    """OPSM: drop tokens with A < 0 of sequences whose mean log(pi_rollout / pi_theta) exceeds ``threshold``.

    Learning from one's own negative samples that the current policy has drifted away from mostly adds noise;
    positive-advantage sequences are always kept.

    Args:
        log_probs: [B, T] float32 nats, current policy (detached here).
        rollout_log_probs: [B, T] float32 nats at sampling.
        advantages: [B, T] float32.
        loss_mask: [B, T] bool.
        threshold: delta, in nats per token (DeepSeek-V3.2 leaves it a hyperparameter; ~1e-3 to 1e-1).
    Returns: [B, T] bool, the loss mask with the dropped tokens set to False.
    References: DeepSeek-V3.2 arXiv:2512.02556 Sec. 3.1, "Off-Policy Sequence Masking".
    """
    with torch.no_grad():
        divergence = torch.where(loss_mask, rollout_log_probs.float() - log_probs.detach().float(), 0.0)
        mean_div = divergence.sum(dim=-1, keepdim=True) / loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
        drop = (advantages < 0) & (mean_div > threshold)
    return loss_mask & ~drop
