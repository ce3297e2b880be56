"""The algorithm extension points: reward post-processing, an advantage estimator, a policy loss and a reducer."""

import torch


def clip_rewards(samples, rewards):
    """``algorithm.reward_post_process_path``: rewards [B] float32 clipped to [-1, 1]."""
    return rewards.clamp(-1.0, 1.0)


def mean_baseline(inputs, params):
    """``algorithm.advantage.estimator_path``: REINFORCE with the batch-mean baseline, A_i = r_i - mean(r_valid),
    broadcast over the response tokens. Returns (advantages [B, T] float32, no returns)."""
    valid = inputs.valid
    baseline = inputs.rewards[valid].mean() if valid.any() else torch.tensor(0.0)
    per_sample = torch.where(valid, inputs.rewards - baseline, torch.zeros_like(inputs.rewards))
    return (per_sample[:, None] * inputs.loss_mask).float(), None


def plain_pg_loss(log_probs, old_log_probs, advantages, loss_mask, params):
    """``algorithm.loss.policy_loss_path``: the unclipped importance-weighted policy gradient
    -exp(log_probs - old_log_probs) * A per token (its gradient at ratio 1 is REINFORCE's). Returns
    (token_loss [B, T], clipped [B, T] all False)."""
    ratio = torch.exp(log_probs - old_log_probs.detach())
    return -ratio * advantages, torch.zeros_like(loss_mask, dtype=torch.bool)


def token_mean(token_loss, loss_mask, num_tokens, num_sequences):
    """``algorithm.loss.reducer_path``: sum of the trained tokens' losses / the global batch's token count."""
    return torch.where(loss_mask, token_loss, torch.zeros_like(token_loss)).sum() / max(num_tokens, 1)
