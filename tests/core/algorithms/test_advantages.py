import pytest
import torch
from miles.core.algorithms.advantages import compute_advantages, group_mean_std, grpo_advantages

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
    got = compute_advantages(rewards, groups, valid, estimator="grpo", eps=0.0)
    expected = torch.tensor([0.0, 0.70711, -0.70711, -0.86603, 0.86603, -0.86603, 0.86603])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


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
        compute_advantages(REWARDS, GROUPS, torch.ones(9, dtype=torch.bool), estimator="ppo")
