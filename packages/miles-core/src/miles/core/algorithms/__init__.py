"""Pure tensor functions: advantage estimators, policy and value losses, KL estimators, rollout corrections,
length masks and shaping. Each kind has one registry; see docs/algorithms.md."""

from miles.core.algorithms.advantages import (
    AdvantageInputs,
    AdvantageParams,
    compute_advantages,
    gae_advantages,
    group_mean_std,
    grpo_advantages,
    opd_advantages,
    rloo_advantages,
    whiten,
)
from miles.core.algorithms.importance import ess_ratio, importance_weights, off_policy_sequence_mask
from miles.core.algorithms.kl import kl_estimate
from miles.core.algorithms.losses import (
    LossParams,
    aggregate,
    cispo_loss,
    entropy_from_logits,
    gspo_loss,
    policy_loss,
    ppo_clip,
    sft_loss,
    value_loss,
)
from miles.core.algorithms.masking import has_trainable_tokens, overlong_filter_keep, overlong_penalty

__all__ = [
    "AdvantageInputs",
    "AdvantageParams",
    "LossParams",
    "aggregate",
    "cispo_loss",
    "compute_advantages",
    "entropy_from_logits",
    "ess_ratio",
    "gae_advantages",
    "group_mean_std",
    "grpo_advantages",
    "gspo_loss",
    "has_trainable_tokens",
    "importance_weights",
    "kl_estimate",
    "off_policy_sequence_mask",
    "opd_advantages",
    "overlong_filter_keep",
    "overlong_penalty",
    "policy_loss",
    "ppo_clip",
    "rloo_advantages",
    "sft_loss",
    "value_loss",
    "whiten",
]
