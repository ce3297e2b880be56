"""Advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++ (+ baseline), PPO's GAE and on-policy distillation.

Notation: B samples, T response columns (``TrainBatch`` layout); ``group_index[b]`` names the prompt of sample b;
groups may have unequal sizes (dynamic filtering or failed rewards shrink them). Every estimator returns per-token
advantages [B, T] (per-sample values broadcast here, once) and, for GAE, the value targets (returns).

``miles.core.algorithms.registry.ESTIMATORS`` is the only place an estimator name is matched; a custom estimator is
a ``module:attr`` with the same signature as its entries, ``fn(inputs: AdvantageInputs, params: AdvantageParams) ->
(advantages, returns)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from miles.core.algorithms.kl import KLEstimator, kl_estimate
from torch import Tensor

# Rewards are compared to the group mean in float64 so that an all-equal group gives exactly 0.
_GROUP_DTYPE = torch.float64


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read about one rollout batch.

    Attributes:
        rewards: [B] float32 scalar rewards (after reward post-processing); any value where not ``valid``.
        group_index: [B] int64, the prompt of each sample.
        valid: [B] bool, True for the samples that enter the group/batch statistics (group mean/std, leave-one-out
            baseline, whitening); the others get advantage 0. The loop's rule (``run_step``): a sample is valid iff
            it was not FAILED/ABORTED and has at least one trainable token of its own (``has_trainable_tokens``):
            a sample with an all-0 loss mask (e.g. a response of only tool tokens) must not shift its siblings'
            advantages. A sample untrained only because of DAPO's overlong filter stays valid: truncated samples
            keep counting in their group's statistics (arXiv:2503.14476 Sec. 3.4), only their ``loss_mask`` is 0.
        loss_mask: [B, T] bool, True = trained token (overlong-filtered samples: all False, yet valid).
        response_mask: [B, T] bool, True for every response column t < response_length (tool tokens included).
        old_log_probs: [B, T] float32 nats of the sampling-time policy (trainer recompute); None if not computed.
        ref_log_probs: [B, T] float32 nats under the reference model; None without one.
        teacher_log_probs: [B, T] float32 nats under the teacher (on-policy distillation); None without one.
        values: [B, T] float32 critic values V(s_t) of the state before response token t; None without a critic.
    """

    rewards: Tensor
    group_index: Tensor
    valid: Tensor
    loss_mask: Tensor
    response_mask: Tensor
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    teacher_log_probs: Tensor | None = None
    values: Tensor | None = None


@dataclass(frozen=True)
class AdvantageParams:
    """Scalars of the estimators (from ``algorithm.advantage`` and ``algorithm.kl``).

    Attributes:
        eps: added to a std before dividing (grpo, reinforce++ whitening).
        gamma: discount of token rewards (gae, reinforce++); 1.0 = undiscounted, the LLM default.
        lam: GAE lambda; 1.0 = Monte-Carlo returns minus values, 0.0 = one-step TD.
        kl_coef_in_reward: weight of the per-token KL penalty added to the rewards; 0 = none.
        kl_estimator: estimator of that penalty (see ``kl_estimate``).
    """

    eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 1.0
    kl_coef_in_reward: float = 0.0
    kl_estimator: KLEstimator = "k1"


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


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO leave-one-out advantage A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r_group)).

    Args:
        rewards: [B] float, one reward per sample.
        group_index: [B] int64.
    Returns: [B] float32; 0 for a group of one (no other sample to form a baseline) and for all-equal groups.
    References: RLOO, Ahmadian et al. arXiv:2402.14740 Sec. 3.2 (Kool et al. 2019).
    """
    mean, std, size = group_mean_std(rewards, group_index)
    scale = size.to(_GROUP_DTYPE) / (size - 1).clamp(min=1).to(_GROUP_DTYPE)
    advantages = scale * (rewards.to(_GROUP_DTYPE) - mean)
    return advantages.masked_fill(std == 0, 0.0).to(torch.float32)


def broadcast_to_tokens(per_sample: Tensor, mask: Tensor) -> Tensor:
    """Per-sample values [B] -> [B, T] float32, 0 where ``mask`` ([B, T] bool) is False."""
    return torch.where(mask, per_sample.to(torch.float32)[:, None], torch.zeros((), dtype=torch.float32))


def outcome_token_rewards(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Place each scalar reward on its sample's last response token: [B] -> [B, T] float32, 0 elsewhere.

    Rows with no response column get no reward.
    """
    num_cols = response_mask.shape[1]
    lengths = response_mask.sum(dim=1)  # [B]
    last = (lengths - 1).clamp(min=0)
    onehot = torch.nn.functional.one_hot(last, num_cols).bool() & (lengths > 0)[:, None]
    return torch.where(onehot, rewards.to(torch.float32)[:, None], torch.zeros((), dtype=torch.float32))


def discounted_returns(token_rewards: Tensor, *, gamma: float) -> Tensor:
    """Reward-to-go G_t = sum_{s >= t} gamma^(s - t) r_s along the response.

    Args:
        token_rewards: [B, T] float32, 0 at padding.
        gamma: discount in [0, 1].
    Returns: [B, T] float32.
    """
    returns = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float32)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t].float() + gamma * running
        returns[:, t] = running
    return returns


def whiten(values: Tensor, mask: Tensor, *, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole batch (population std); 0 elsewhere.

    Args:
        values: [B, T] float32; mask: [B, T] bool.
    Returns: [B, T] float32. Fewer than 2 masked entries, or equal entries, give 0.
    References: REINFORCE++ global batch normalization, arXiv:2501.03262 Sec. 3.
    """
    count = mask.sum()
    if int(count) < 2:  # host sync (once per rollout)
        return torch.zeros_like(values, dtype=torch.float32)
    x = values.to(_GROUP_DTYPE)
    mean = torch.where(mask, x, 0.0).sum() / count
    var = torch.where(mask, (x - mean) ** 2, 0.0).sum() / count
    if float(var) == 0.0:
        return torch.zeros_like(values, dtype=torch.float32)
    return torch.where(mask, (x - mean) / (var.sqrt() + eps), 0.0).to(torch.float32)


def gae_advantages(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation: A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t.

    The state after the last response token is terminal (V = 0).

    Args:
        token_rewards: [B, T] float32 (outcome reward on the last token, plus any per-token penalty).
        values: [B, T] float32 V(s_t) from the critic; no grad.
        response_mask: [B, T] bool, True for response columns; values and rewards elsewhere are ignored.
        gamma: discount; lam: GAE lambda.
    Returns: (advantages [B, T] float32, returns = advantages + values [B, T] float32), both 0 off the mask.
    References: GAE, Schulman et al. arXiv:1506.02438 Eq. 16; PPO for LLMs, Ouyang et al. arXiv:2203.02155.
    """
    zero = torch.zeros((), dtype=torch.float32)
    rewards = torch.where(response_mask, token_rewards.float(), zero)
    values = torch.where(response_mask, values.float(), zero)
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=torch.float32)
    num_cols = rewards.shape[1]
    for t in reversed(range(num_cols)):
        next_value = values[:, t + 1] if t + 1 < num_cols else zero
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    advantages = torch.where(response_mask, advantages, zero)
    return advantages, torch.where(response_mask, advantages + values, zero)


def opd_advantages(old_log_probs: Tensor, teacher_log_probs: Tensor, loss_mask: Tensor) -> Tensor:
    """On-policy distillation: A_t = -(log pi_student(y_t) - log pi_teacher(y_t)), the negative per-token reverse KL.

    Maximizing sum_t A_t ratio_t moves the student towards the teacher on the student's own samples.

    Args:
        old_log_probs: [B, T] float32 nats, student at sampling time (at the sampling temperature); no grad.
        teacher_log_probs: [B, T] float32 nats, teacher on the same tokens (at the teacher temperature); no grad.
        loss_mask: [B, T] bool.
    Returns: [B, T] float32, 0 off the mask.
    References: Agarwal et al. (GKD) arXiv:2306.13649; Thinking Machines, "On-Policy Distillation" (2025).
    """
    return torch.where(loss_mask, (teacher_log_probs - old_log_probs).float(), torch.zeros((), dtype=torch.float32))


def kl_reward_penalty(inputs: AdvantageInputs, params: AdvantageParams) -> Tensor:
    """Per-token reward -kl_coef * KL_t(old || ref) (no grad), [B, T] float32; zeros when the penalty is off.

    Raises: ValueError if the penalty is on but old/ref log-probs were not computed.
    References: InstructGPT arXiv:2203.02155 Eq. 2; REINFORCE++ arXiv:2501.03262 Eq. 4.
    """
    if params.kl_coef_in_reward == 0.0:
        return torch.zeros(inputs.loss_mask.shape, dtype=torch.float32)
    if inputs.old_log_probs is None or inputs.ref_log_probs is None:
        raise ValueError("a KL reward penalty needs old_log_probs and ref_log_probs; the backend must compute them")
    kl = kl_estimate(inputs.old_log_probs, inputs.ref_log_probs, estimator=params.kl_estimator).detach()
    return torch.where(inputs.response_mask, -params.kl_coef_in_reward * kl, torch.zeros((), dtype=torch.float32))


def _with_penalty(per_sample: Tensor, inputs: AdvantageInputs, params: AdvantageParams) -> Tensor:
    """Broadcast per-sample advantages and add the reward-to-go of the KL penalty."""
    penalty = discounted_returns(kl_reward_penalty(inputs, params), gamma=1.0)
    return broadcast_to_tokens(per_sample, inputs.response_mask) + penalty


def _grouped(fn: Callable[[Tensor, Tensor, AdvantageParams], Tensor]):
    """Registry adapter: a per-sample group estimator over the valid samples, broadcast to [B, T]."""

    def estimator(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, None]:
        per_sample = torch.zeros(inputs.rewards.shape, dtype=torch.float32)
        if bool(inputs.valid.any()):
            per_sample[inputs.valid] = fn(inputs.rewards[inputs.valid], inputs.group_index[inputs.valid], params)
        return _with_penalty(per_sample, inputs, params), None

    return estimator


def _reinforce_pp(baseline: bool):
    """REINFORCE++: token returns (outcome - group mean if ``baseline``, plus KL penalty), whitened over the batch."""

    def estimator(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, None]:
        rewards = torch.where(inputs.valid, inputs.rewards.float(), 0.0)
        if baseline and bool(inputs.valid.any()):
            mean, _, _ = group_mean_std(rewards[inputs.valid], inputs.group_index[inputs.valid])
            rewards[inputs.valid] = rewards[inputs.valid] - mean.to(torch.float32)
        token_rewards = outcome_token_rewards(rewards, inputs.response_mask) + kl_reward_penalty(inputs, params)
        returns = discounted_returns(token_rewards, gamma=params.gamma)
        return whiten(returns, inputs.loss_mask & inputs.valid[:, None], eps=params.eps), None

    return estimator


def _gae(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    if inputs.values is None:
        raise ValueError("advantage 'gae' needs critic values; set models.critic (or use the ppo recipe)")
    rewards = torch.where(inputs.valid, inputs.rewards.float(), 0.0)
    token_rewards = outcome_token_rewards(rewards, inputs.response_mask) + kl_reward_penalty(inputs, params)
    advantages, returns = gae_advantages(
        token_rewards, inputs.values, inputs.response_mask, gamma=params.gamma, lam=params.lam
    )
    valid = inputs.valid[:, None]
    return torch.where(valid, advantages, 0.0), torch.where(valid, returns, 0.0)


def _opd(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, None]:
    if inputs.old_log_probs is None or inputs.teacher_log_probs is None:
        raise ValueError("advantage 'opd' needs old_log_probs and teacher_log_probs; set models.teacher.path")
    mask = inputs.loss_mask & inputs.valid[:, None]
    return opd_advantages(inputs.old_log_probs, inputs.teacher_log_probs, mask) + kl_reward_penalty(
        inputs, params
    ), None


AdvantageFn = Callable[[AdvantageInputs, AdvantageParams], tuple[Tensor, Tensor | None]]


def compute_advantages(
    inputs: AdvantageInputs, *, estimator: str | AdvantageFn, params: AdvantageParams
) -> tuple[Tensor, Tensor | None]:
    """Registry entry point: per-token advantages of the valid samples; invalid samples and masked tokens get 0.

    Args:
        inputs: the batch's rewards, groups, masks and (as needed) log-probs and values.
        estimator: a registered name (grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline,
            gae, opd) or a custom function with the registry signature.
        params: scalars of the estimators.
    Returns: (advantages [B, T] float32, 0 off ``loss_mask``; returns [B, T] float32 value targets or None).
    Raises: ValueError for an unknown name or missing inputs; ValueError for a custom estimator's wrong shape.
    """
    from miles.core.algorithms.registry import get_estimator  # the registry imports this module's estimators

    fn = get_estimator(estimator).fn if isinstance(estimator, str) else estimator
    advantages, returns = fn(inputs, params)
    if advantages.shape != inputs.loss_mask.shape:
        raise ValueError(
            f"advantage estimator {estimator!r} returned shape {tuple(advantages.shape)}, expected [B, T] = "
            f"{tuple(inputs.loss_mask.shape)}"
        )
    return torch.where(inputs.loss_mask, advantages.float(), 0.0), returns
