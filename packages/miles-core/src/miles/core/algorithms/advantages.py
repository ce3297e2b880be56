"""Advantage estimators over groups of samples (one group = the samples of one prompt).

Notation: B samples; ``group_index[b]`` names the prompt of sample b; groups may have unequal sizes
(dynamic filtering or failed rewards shrink them).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Rewards are compared to the group mean in float64 so that an all-equal group gives exactly 0.
_GROUP_DTYPE = torch.float64


def group_mean_std(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group statistics: mean, sample std (Bessel-corrected, n-1) and group size.

    Args:
        rewards: [B] float, one reward per sample.
        group_index: [B] int64, the group (prompt) of each sample; any integer labels.
    Returns: (mean [B] float64, std [B] float64, size [B] int64), each the value of the sample's group.
        The std of a group of one is 0 (not NaN).
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be [B]")
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    values = rewards.to(_GROUP_DTYPE)
    size = torch.zeros(num_groups, dtype=torch.int64).scatter_add_(0, inverse, torch.ones_like(inverse))
    total = torch.zeros(num_groups, dtype=_GROUP_DTYPE).scatter_add_(0, inverse, values)
    mean = (total / size)[inverse]
    sq_dev = torch.zeros(num_groups, dtype=_GROUP_DTYPE).scatter_add_(0, inverse, (values - mean) ** 2)
    var = sq_dev / (size - 1).clamp(min=1)
    return mean, var.sqrt()[inverse], size[inverse]


def grpo_advantages(rewards: Tensor, group_index: Tensor, *, normalize_std: bool, eps: float = 1e-6) -> Tensor:
    """GRPO advantage A_i = (r_i - mean(r_group)) / (std(r_group) + eps), or without the division.

    A group whose rewards are all equal (incl. a group of one) gets exactly 0: it carries no learning signal,
    and 0 / (0 + eps) must not turn rounding noise into a large advantage.

    Args:
        rewards: [B] float, one reward per sample.
        group_index: [B] int64, the prompt each sample belongs to.
        normalize_std: divide by the group's sample std (GRPO); False gives Dr.GRPO's mean-centring.
        eps: added to the std before dividing.
    Returns: [B] float32 advantages.
    References: GRPO (DeepSeekMath) arXiv:2402.03300 Sec. 4.1.2; Dr.GRPO arXiv:2503.20783 Sec. 3.
    """
    mean, std, _ = group_mean_std(rewards, group_index)
    centred = rewards.to(_GROUP_DTYPE) - mean
    if normalize_std:
        centred = centred / (std + eps)
    constant = std == 0  # covers all-equal groups and groups of one
    return centred.masked_fill(constant, 0.0).to(torch.float32)


def compute_advantages(
    rewards: Tensor, group_index: Tensor, valid: Tensor, *, estimator: str, eps: float = 1e-6
) -> Tensor:
    """Registry entry point: per-sample advantages of the valid samples; invalid ones get 0.

    Args:
        rewards: [B] float32, any value where not valid.
        group_index: [B] int64.
        valid: [B] bool, False for failed samples, which neither get an advantage nor enter their group's
            mean/std.
        estimator: "grpo" (mean-centred, std-normalized) or "dr_grpo" (mean-centred only).
        eps: std epsilon for "grpo".
    Returns: [B] float32.
    Raises: ValueError naming the choices for an unknown estimator.
    """
    if estimator not in _ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {sorted(_ESTIMATORS)}")
    advantages = torch.zeros(rewards.shape, dtype=torch.float32)
    if bool(valid.any()):
        advantages[valid] = _ESTIMATORS[estimator](rewards[valid], group_index[valid], eps)
    return advantages


_ESTIMATORS = {
    "grpo": lambda r, g, eps: grpo_advantages(r, g, normalize_std=True, eps=eps),
    "dr_grpo": lambda r, g, eps: grpo_advantages(r, g, normalize_std=False),
}
