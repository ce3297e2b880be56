import pytest
import torch
from miles.core.algorithms.advantages import (
    AdvantageInputs,
    AdvantageParams,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    group_mean_std,
    grpo_advantages,
    opd_advantages,
    outcome_token_rewards,
    rloo_advantages,
    whiten,
)

# Groups of unequal size: [0,1,1,1 | 5,7 | 2,3,4].
REWARDS = torch.tensor([0.0, 1, 1, 1, 5, 7, 2, 3, 4])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])


def test_grpo_mean_centred_advantages_of_unequal_groups_match_hand_values():
    # Group means 0.75, 6, 3.
    expected = torch.tensor([-0.75, 0.25, 0.25, 0.25, -1, 1, -1, 0, 1])
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUPS, normalize_std=False), expected)


def test_grpo_z_scored_advantages_use_the_sample_std_of_each_group():
    # Sample stds (n - 1): group 0: sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 1: sqrt(2);
    # group 2: 1.
    expected = torch.tensor([-1.5, 0.5, 0.5, 0.5, -0.70711, 0.70711, -1, 0, 1])
    got = grpo_advantages(REWARDS, GROUPS, normalize_std=True, eps=0.0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_advantages_are_exactly_zero_when_group_rewards_are_equal(normalize_std):
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 0.3])  # 0.1 * 3 / 3 is not exactly 0.1 in floating point
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    got = grpo_advantages(rewards, groups, normalize_std=normalize_std)
    assert torch.equal(got, torch.zeros(6))
    assert not torch.isnan(got).any()


def test_group_statistics_of_a_single_sample_group_have_zero_std_not_nan():
    mean, std, size = group_mean_std(torch.tensor([3.0]), torch.tensor([7]))
    assert mean.tolist() == [3.0] and std.tolist() == [0.0] and size.tolist() == [1]


def test_failed_samples_are_excluded_from_their_group_statistics_and_get_zero():
    # Group 1: [x(failed), 1, 0]; group 2: [0, 1, 0, 1] -> z-scores +-0.866 with sample std sqrt(1/3).
    rewards = torch.tensor([123.0, 1, 0, 0, 1, 0, 1])
    groups = torch.tensor([1, 1, 1, 2, 2, 2, 2])
    valid = torch.tensor([False, True, True, True, True, True, True])
    got, returns = compute_advantages(_inputs(rewards, groups, valid=valid), estimator="grpo", params=_params(eps=0.0))
    expected = torch.tensor([0.0, 0.70711, -0.70711, -0.86603, 0.86603, -0.86603, 0.86603])
    torch.testing.assert_close(got[:, 0], expected, atol=1e-5, rtol=0)
    assert returns is None


def test_grpo_matches_a_straightforward_reference_on_random_groups():
    gen = torch.Generator().manual_seed(0)
    sizes = [2, 5, 8, 3, 8]
    rewards = torch.rand(sum(sizes), generator=gen)
    groups = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    expected = []
    start = 0
    for n in sizes:
        r = rewards[start : start + n].tolist()
        mean = sum(r) / n
        std = (sum((x - mean) ** 2 for x in r) / (n - 1)) ** 0.5
        expected += [(x - mean) / (std + 1e-6) for x in r]
        start += n
    got = grpo_advantages(rewards, groups, normalize_std=True, eps=1e-6)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_unknown_estimator_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages(_inputs(REWARDS, GROUPS), estimator="ppo", params=_params())


def _params(**kw) -> AdvantageParams:
    return AdvantageParams(**kw)


def _inputs(rewards, groups, *, valid=None, lengths=None, num_cols=1, **tensors) -> AdvantageInputs:
    """Inputs where every sample has ``lengths[b]`` trained response tokens (default 1 column each)."""
    num = rewards.shape[0]
    lengths = torch.ones(num, dtype=torch.int64) if lengths is None else torch.tensor(lengths)
    mask = torch.arange(num_cols)[None, :] < lengths[:, None]
    valid = torch.ones(num, dtype=torch.bool) if valid is None else valid
    return AdvantageInputs(
        rewards=rewards, group_index=groups, valid=valid, loss_mask=mask, response_mask=mask, **tensors
    )


def test_every_estimator_broadcasts_per_sample_advantages_only_to_trained_tokens():
    rewards, groups = torch.tensor([0.0, 1.0]), torch.tensor([0, 0])
    got, _ = compute_advantages(
        _inputs(rewards, groups, lengths=[3, 1], num_cols=3), estimator="dr_grpo", params=_params()
    )
    assert got.tolist() == [[-0.5, -0.5, -0.5], [0.5, 0.0, 0.0]]


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # Group [0,1,1,1]: 0 - 1 = -1, 1 - 2/3 = 1/3; group [5,7]: -2, 2; group [2,3,4]: 2-3.5, 3-3, 4-2.5.
    expected = torch.tensor([-1.0, 1 / 3, 1 / 3, 1 / 3, -2, 2, -1.5, 0, 1.5])
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUPS), expected)


def test_rloo_of_a_group_of_one_is_zero():
    assert rloo_advantages(torch.tensor([3.0]), torch.tensor([0])).tolist() == [0.0]


def test_reinforce_pp_whitens_returns_over_all_trained_tokens_of_the_batch():
    # Rewards [1, 0, 0, 0], one token each: mean 0.25, population std sqrt(3)/4 = 0.4330.
    # (1 - 0.25) / 0.4330 = 1.7321; (0 - 0.25) / 0.4330 = -0.5774.
    rewards, groups = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 0, 1, 1])
    got, _ = compute_advantages(_inputs(rewards, groups), estimator="reinforce_plus_plus", params=_params(eps=0.0))
    torch.testing.assert_close(got[:, 0], torch.tensor([1.7321, -0.5774, -0.5774, -0.5774]), atol=1e-4, rtol=0)


def test_reinforce_pp_baseline_subtracts_the_group_mean_before_whitening():
    # Group means 0.5 and 0: centred [0.5, -0.5, 0, 0]; batch mean 0, population std sqrt(0.125) = 0.3536.
    rewards, groups = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 0, 1, 1])
    got, _ = compute_advantages(
        _inputs(rewards, groups), estimator="reinforce_plus_plus_baseline", params=_params(eps=0.0)
    )
    torch.testing.assert_close(got[:, 0], torch.tensor([1.4142, -1.4142, 0.0, 0.0]), atol=1e-4, rtol=0)


def test_whitening_of_equal_values_is_zero_not_nan():
    got = whiten(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool), eps=0.0)
    assert torch.equal(got, torch.zeros(2, 2))


def test_outcome_reward_sits_on_the_last_response_token_and_returns_discount_backwards():
    mask = torch.tensor([[True, True, True], [True, False, False]])
    token_rewards = outcome_token_rewards(torch.tensor([2.0, 5.0]), mask)
    assert token_rewards.tolist() == [[0.0, 0.0, 2.0], [5.0, 0.0, 0.0]]
    # gamma 0.5: [0.5^2 * 2, 0.5 * 2, 2] = [0.5, 1, 2].
    assert discounted_returns(token_rewards, gamma=0.5).tolist() == [[0.5, 1.0, 2.0], [5.0, 0.0, 0.0]]


def test_gae_matches_hand_computed_recursion():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma 0.9, lam 0.8, V after the end = 0.
    # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.9 * 0.7 - 0.6 = 0.03; delta_0 = 0.9 * 0.6 - 0.5 = 0.04.
    # A_2 = 0.3; A_1 = 0.03 + 0.72 * 0.3 = 0.246; A_0 = 0.04 + 0.72 * 0.246 = 0.21712.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])  # column 3 is padding: its value must be ignored
    mask = torch.tensor([[True, True, True, False]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[0.21712, 0.246, 0.3, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]), atol=1e-6, rtol=0)


def test_gae_with_gamma_and_lambda_one_is_reward_minus_value():
    advantages, _ = gae_advantages(
        torch.tensor([[0.0, 3.0]]), torch.tensor([[1.0, 2.0]]), torch.ones(1, 2, dtype=torch.bool), gamma=1.0, lam=1.0
    )
    assert advantages.tolist() == [[2.0, 1.0]]


def test_gae_estimator_without_critic_values_is_a_clear_error():
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages(_inputs(REWARDS, GROUPS), estimator="gae", params=_params())


def test_opd_advantage_is_teacher_minus_student_log_prob_per_token():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-0.5, -3.0, -9.0]])
    mask = torch.tensor([[True, True, False]])
    assert opd_advantages(old, teacher, mask).tolist() == [[0.5, -1.0, 0.0]]


def test_kl_reward_penalty_is_subtracted_as_reward_to_go_from_group_advantages():
    # Two samples, two tokens; k1 KL(old||ref) = old - ref = [0.25, 0.5] on sample 0, 0 on sample 1; coef 2.
    # Penalty rewards -2 * kl = [-0.5, -1]; reward-to-go [-1.5, -1]. Dr.GRPO outcome advantages: -0.5, +0.5.
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.25, -1.5], [-1.0, -1.0]])
    inputs = _inputs(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), lengths=[2, 2], num_cols=2)
    inputs = AdvantageInputs(**{**inputs.__dict__, "old_log_probs": old, "ref_log_probs": ref})
    got, _ = compute_advantages(inputs, estimator="dr_grpo", params=_params(kl_coef_in_reward=2.0))
    assert got.tolist() == [[-2.0, -1.5], [0.5, 0.5]]


def test_a_custom_estimator_with_a_wrong_shape_is_a_clear_error():
    def per_sample(inputs, params):
        return inputs.rewards, None

    with pytest.raises(ValueError, match="expected \\[B, T\\]"):
        compute_advantages(_inputs(REWARDS, GROUPS), estimator=per_sample, params=_params())
