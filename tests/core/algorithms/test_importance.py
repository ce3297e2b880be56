import math

import pytest
import torch
from miles.core.algorithms.importance import ess_ratio, importance_weights, off_policy_sequence_mask

# Two tokens of one sequence: old - rollout = [ln 3, ln 0.25] -> token rho [3, 0.25]; product 0.75; geometric
# mean sqrt(0.75) = 0.8660. A third, masked column must be ignored everywhere.
OLD = torch.tensor([[math.log(3.0), math.log(0.25), 5.0]])
ROLLOUT = torch.zeros(1, 3)
MASK = torch.tensor([[True, True, False]])


@pytest.mark.parametrize(
    "mode, level, expected, outside",
    [
        pytest.param(
            "tis", "token", [2.0, 0.5, 0.0], [True, True, False], id="tis_token_clamps_3_to_2_and_0.25_to_0.5"
        ),
        pytest.param("mis", "token", [0.0, 0.0, 0.0], [True, True, False], id="mis_token_zeroes_both"),
        pytest.param("icepop", "sequence", [0.0, 0.0, 0.0], [True, True, False], id="icepop_is_token_level_mis"),
        pytest.param("tis", "sequence", [0.75, 0.75, 0.0], [False, False, False], id="tis_sequence_product_0.75"),
        pytest.param("mis", "geometric", [0.86603, 0.86603, 0.0], [False, False, False], id="mis_geometric_0.866"),
    ],
)
def test_importance_weights_match_hand_values(mode, level, expected, outside):
    weights, was_outside = importance_weights(OLD, ROLLOUT, MASK, mode=mode, level=level, lower=0.5, upper=2.0)
    torch.testing.assert_close(weights, torch.tensor([expected]), atol=1e-5, rtol=0)
    assert was_outside.tolist() == [outside]


def test_sequence_mis_drops_a_sequence_whose_product_leaves_the_bounds():
    weights, outside = importance_weights(OLD, ROLLOUT, MASK, mode="mis", level="sequence", lower=0.8, upper=2.0)
    assert weights.tolist() == [[0.0, 0.0, 0.0]] and outside.tolist() == [[True, True, False]]


def test_importance_weights_carry_no_gradient():
    old = OLD.clone().requires_grad_(True)
    weights, _ = importance_weights(old, ROLLOUT, MASK, mode="tis", level="token", lower=0.0, upper=2.0)
    assert not weights.requires_grad


def test_importance_bounds_out_of_order_are_a_clear_error():
    with pytest.raises(ValueError, match="0 <= lower <= 1 <= upper"):
        importance_weights(OLD, ROLLOUT, MASK, mode="tis", level="token", lower=1.5, upper=2.0)


def test_ess_ratio_is_one_for_equal_weights_and_matches_a_hand_value():
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert ess_ratio(torch.ones(1, 2), mask).item() == 1.0
    # w = [1, 3]: (1 + 3)^2 / (2 * (1 + 9)) = 16 / 20 = 0.8.
    assert ess_ratio(torch.tensor([[1.0, 3.0]]), mask).item() == pytest.approx(0.8)


def test_opsm_masks_only_negative_advantage_sequences_that_drifted_past_the_threshold():
    # Mean log(pi_rollout / pi_theta): row 0: (0.2 + 0.0) / 2 = 0.1 > 0.05; row 1: 0.01 < 0.05; row 2 as row 0
    # but with a positive advantage. Only row 0 is dropped.
    log_probs = torch.tensor([[-1.2, -1.0], [-1.01, -1.01], [-1.2, -1.0]])
    rollout = torch.full((3, 2), -1.0)
    advantages = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    keep = off_policy_sequence_mask(log_probs, rollout, advantages, mask, threshold=0.05)
    assert keep.tolist() == [[False, False], [True, True], [True, True]]
