"""Pure tensor functions: advantage estimators, policy losses, KL estimators, aggregation."""

from miles.core.algorithms.advantages import compute_advantages, group_mean_std, grpo_advantages
from miles.core.algorithms.kl import kl_estimate
from miles.core.algorithms.losses import aggregate, entropy_from_logits, policy_loss, ppo_clip

__all__ = [
    "aggregate",
    "compute_advantages",
    "entropy_from_logits",
    "group_mean_std",
    "grpo_advantages",
    "kl_estimate",
    "policy_loss",
    "ppo_clip",
]
