from typing import get_args

import pytest
import torch
from miles.core.algorithms.config import PolicyLoss
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


def test_ppo_clip_loss_and_gradient_match_hand_values_on_a_2x3_example():
    log_probs = torch.zeros(2, 3, requires_grad=True)
    old_log_probs = torch.tensor([[0.0, -0.5, 0.5], [0.0, -0.5, 0.5]])  # ratios 1, e^0.5 = 1.6487, e^-0.5 = 0.6065
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, clipped = ppo_clip(log_probs, old_log_probs, advantages, clip_low=0.2, clip_high=0.2)
    # A=+1: -min(r, clip(r)) -> [-1, -1.2 (capped at 1.2), -0.6065]; A=-1: max(r, clip(r)) -> [1, 1.6487, 0.8].
    expected = torch.tensor([[-1.0, -1.2, -0.60653], [1.0, 1.64872, 0.8]])
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    assert clipped.tolist() == [[False, True, False], [False, False, True]]
    loss.sum().backward()
    # d(-r A)/d log_prob = -r A on unclipped slots, 0 where the clipped branch is active.
    expected_grad = torch.tensor([[-1.0, 0.0, -0.60653], [1.0, 1.64872, 0.0]])
    torch.testing.assert_close(log_probs.grad, expected_grad, atol=1e-5, rtol=0)


def test_ppo_clip_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shape mismatch"):
        ppo_clip(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2), clip_low=0.2, clip_high=0.2)


def test_token_mean_ignores_masked_slots_in_value_and_gradient():
    token_loss = torch.tensor([[2.0, 80.0], [2.0, -30.0]], requires_grad=True)
    mask = torch.tensor([[True, False], [True, False]])
    loss = aggregate(token_loss, mask, mode="token_mean")
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    assert token_loss.grad.tolist() == [[0.5, 0.0], [0.5, 0.0]]


def test_masked_nan_does_not_leak_into_the_loss_or_gradient():
    token_loss = torch.tensor([[1.0, float("nan")]], requires_grad=True)
    loss = aggregate(token_loss, torch.tensor([[True, False]]), mode="token_mean")
    loss.backward()
    assert loss.item() == 1.0 and token_loss.grad.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize(
    "mode, expected",
    [
        pytest.param("token_mean", 10 / 6, id="token_mean_(4+6)/6"),
        pytest.param("seq_mean_token_mean", 2.0, id="seq_mean_token_mean_(1+3)/2"),
        pytest.param("seq_mean_token_sum", 5.0, id="seq_mean_token_sum_(4+6)/2"),
        pytest.param("seq_mean_token_sum_norm", 1.25, id="seq_mean_token_sum_norm_(4/4+6/4)/2"),
    ],
)
def test_aggregation_modes_match_hand_values(mode, expected):
    token_loss = torch.tensor([[1.0, 1, 1, 1], [3, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    got = aggregate(token_loss, mask, mode=mode, normalizer=4.0)
    assert got.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_aggregation_over_split_batches_with_global_denominators_equals_the_whole_batch(mode):
    gen = torch.Generator().manual_seed(0)
    token_loss = torch.randn(6, 5, generator=gen)
    mask = torch.rand(6, 5, generator=gen) > 0.3
    kw = dict(mode=mode, num_tokens=int(mask.sum()), num_sequences=6, normalizer=5.0)
    whole = aggregate(token_loss, mask, **kw)
    parts = aggregate(token_loss[:2], mask[:2], **kw) + aggregate(token_loss[2:], mask[2:], **kw)
    torch.testing.assert_close(whole, parts)


def test_seq_mean_token_sum_norm_without_a_normalizer_is_a_clear_error():
    with pytest.raises(ValueError, match="positive normalizer"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), mode="seq_mean_token_sum_norm")


def test_entropy_of_uniform_logits_is_log_vocab():
    got = entropy_from_logits(torch.zeros(1, 2, 8))
    torch.testing.assert_close(got, torch.full((1, 2), torch.log(torch.tensor(8.0)).item()))


def test_policy_loss_adds_the_kl_term_with_gradient_and_reports_metrics():
    # One token, logp = logp_ref + 0.5, advantage 0: only the k3 term is left: 0.1065, d/dlogp = 1 - e^-0.5.
    log_probs = torch.tensor([[0.0]], requires_grad=True)
    loss, metrics = policy_loss(
        log_probs,
        torch.tensor([[0.0]]),
        torch.tensor([[0.0]]),
        torch.tensor([[True]]),
        params=LossParams(),
        aggregation="token_mean",
        num_tokens=1,
        num_sequences=1,
        ref_log_probs=torch.tensor([[-0.5]]),
        kl_coef=1.0,
        kl_estimator="k3",
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.10653, abs=1e-5)
    assert log_probs.grad.item() == pytest.approx(0.39347, abs=1e-5)
    assert metrics["loss/kl"].item() == pytest.approx(0.10653, abs=1e-5)
    assert metrics["pg_clipfrac"].item() == 0.0


@pytest.mark.parametrize(
    "estimator, value, grad",
    [
        # logp = logp_ref + 0.5, advantage 0, coef 1: the loss is the KL term alone, with gradient.
        pytest.param("k1", 0.5, 1.0, id="k1"),
        pytest.param("k2", 0.125, 0.5, id="k2"),
        pytest.param("k3", 0.10653, 0.39347, id="k3"),
    ],
)
def test_kl_loss_term_carries_the_estimator_gradient(estimator, value, grad):
    log_probs = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = _one_token_policy_loss(
        log_probs, ref_log_probs=torch.tensor([[-0.5]]), kl_coef=1.0, kl_estimator=estimator
    )
    loss.backward()
    assert loss.item() == pytest.approx(value, abs=1e-5)
    assert log_probs.grad.item() == pytest.approx(grad, abs=1e-5)


def _one_token_policy_loss(log_probs, *, advantage=0.0, old=0.0, **kw):
    defaults = dict(params=LossParams(), aggregation="token_mean", num_tokens=1, num_sequences=1)
    return policy_loss(
        log_probs, torch.tensor([[old]]), torch.tensor([[advantage]]), torch.tensor([[True]]), **{**defaults, **kw}
    )


@pytest.mark.parametrize(
    "old_log_prob, expected_loss, expected_grad, clipped",
    [
        # A = -1, r = e^2 = 7.389: PPO loss max(7.389, 1.2) = 7.389 -> capped at c|A| = 3, gradient 0.
        pytest.param(-2.0, 3.0, 0.0, True, id="ratio_7.39_capped_at_3"),
        # r = e^0.5 = 1.6487 < 3: dual clip inactive, loss r, gradient r.
        pytest.param(-0.5, 1.64872, 1.64872, False, id="ratio_1.65_below_cap"),
    ],
)
def test_dual_clip_caps_the_loss_of_negative_advantages(old_log_prob, expected_loss, expected_grad, clipped):
    log_probs = torch.zeros(1, 1, requires_grad=True)
    loss, was_clipped = ppo_clip(
        log_probs,
        torch.full((1, 1), old_log_prob),
        torch.full((1, 1), -1.0),
        clip_low=0.2,
        clip_high=0.2,
        dual_clip_c=3.0,
    )
    loss.sum().backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-5)
    assert log_probs.grad.item() == pytest.approx(expected_grad, abs=1e-5)
    assert was_clipped.item() is clipped


def test_dual_clip_leaves_positive_advantages_alone():
    # A = +1, r = e^-2 = 0.13534: -min(r, clip(r, 0.8, 1.2)) = -0.13534, the same as without dual clip.
    args = (torch.zeros(1, 1), torch.full((1, 1), 2.0), torch.ones(1, 1))
    with_dual, _ = ppo_clip(*args, clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    assert with_dual.item() == pytest.approx(-0.13534, abs=1e-5)


def test_gspo_uses_the_length_normalized_sequence_ratio_on_every_token():
    # Sequence 0: log-ratios [0.2, 0.0] (third token masked out) -> s = e^0.1 = 1.10517, A = 1, within the clip.
    # Token loss -s each; seq_mean_token_mean: -1.10517; gradient per token s / 2 = 0.55259 (sign: loss -s).
    log_probs = torch.zeros(1, 3, requires_grad=True)
    old = torch.tensor([[-0.2, 0.0, -5.0]])
    mask = torch.tensor([[True, True, False]])
    advantages = torch.tensor([[1.0, 1.0, 0.0]])
    token_loss, clipped = gspo_loss(log_probs, old, advantages, mask, clip_low=0.2, clip_high=0.2)
    loss = aggregate(token_loss, mask, mode="seq_mean_token_mean")
    loss.backward()
    assert loss.item() == pytest.approx(-1.10517, abs=1e-5)
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.55259, -0.55259, 0.0]]), atol=1e-5, rtol=0)
    assert not clipped[mask].any()


def test_gspo_clips_the_whole_sequence_when_its_ratio_leaves_the_range():
    # s = e^0.1 = 1.105 > 1 + 0.05: loss -1.05 per token, no gradient.
    log_probs = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    token_loss, clipped = gspo_loss(
        log_probs, torch.tensor([[-0.2, 0.0]]), torch.ones(1, 2), mask, clip_low=0.05, clip_high=0.05
    )
    token_loss.sum().backward()
    torch.testing.assert_close(token_loss, torch.full((1, 2), -1.05))
    assert clipped.all() and torch.equal(log_probs.grad, torch.zeros(1, 2))


def test_cispo_clips_the_detached_weight_but_keeps_the_gradient():
    # r = e^(-1 + 1.5) = 1.6487 -> weight 1.28; A = 2: loss -1.28 * 2 * (-1) = 2.56; d/dlogp = -1.28 * 2 = -2.56.
    log_probs = torch.tensor([[-1.0]], requires_grad=True)
    token_loss, clipped = cispo_loss(
        log_probs, torch.tensor([[-1.5]]), torch.tensor([[2.0]]), clip_low=0.2, clip_high=0.28
    )
    token_loss.sum().backward()
    assert token_loss.item() == pytest.approx(2.56, abs=1e-5)
    assert log_probs.grad.item() == pytest.approx(-2.56, abs=1e-5)
    assert clipped.item()


def test_sft_loss_is_the_negative_log_likelihood_of_trained_tokens():
    # Multi-turn: the middle (user) token is masked. NLL = (0.5 + 2.0) / 2 = 1.25; grad -1/2 on kept tokens.
    log_probs = torch.tensor([[-0.5, -7.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[True, False, True]])
    token_loss, _ = sft_loss(log_probs)
    loss = aggregate(token_loss, mask, mode="token_mean")
    loss.backward()
    assert loss.item() == pytest.approx(1.25)
    assert log_probs.grad.tolist() == [[-0.5, 0.0, -0.5]]


def test_policy_loss_with_sft_ignores_advantages():
    log_probs = torch.tensor([[-0.5]], requires_grad=True)
    loss, _ = _one_token_policy_loss(log_probs, advantage=123.0, loss="sft")
    assert loss.item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "value, expected_loss, expected_grad, clipped",
    [
        # old 0.5, R 2, clip 0.2. V = 1.0: unclipped (1-2)^2 = 1, clipped V 0.7: 1.69 -> 0.845, gradient 0.
        pytest.param(1.0, 0.845, 0.0, True, id="clipped_branch_larger"),
        # V = 0.6 within the clip: both 1.96 -> 0.98, gradient V - R = -1.4.
        pytest.param(0.6, 0.98, -1.4, False, id="within_clip"),
    ],
)
def test_value_loss_clips_around_the_rollout_values(value, expected_loss, expected_grad, clipped):
    values = torch.tensor([[value]], requires_grad=True)
    loss, was_clipped = value_loss(values, torch.tensor([[0.5]]), torch.tensor([[2.0]]), clip=0.2)
    loss.sum().backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-5)
    assert values.grad.item() == pytest.approx(expected_grad, abs=1e-5)
    assert was_clipped.item() is clipped


def test_importance_weights_multiply_the_policy_loss_without_gradient():
    # A = 1, on-policy (r = 1): token loss -1, weight 0.5 -> loss -0.5, gradient -0.5.
    log_probs = torch.tensor([[0.0]], requires_grad=True)
    weights = torch.tensor([[0.5]], requires_grad=True)
    loss, _ = _one_token_policy_loss(log_probs, advantage=1.0, token_weights=weights)
    loss.backward()
    assert loss.item() == pytest.approx(-0.5) and log_probs.grad.item() == pytest.approx(-0.5)
    assert weights.grad is None


def test_entropy_metric_and_bonus_cover_only_loss_masked_positions():
    # Entropies [1, 5] with the second masked: metric 1; coef 0.1 bonus: loss -0.1, grad -0.1 / 0.
    entropy = torch.tensor([[1.0, 5.0]], requires_grad=True)
    loss, metrics = policy_loss(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.tensor([[True, False]]),
        params=LossParams(),
        aggregation="token_mean",
        num_tokens=1,
        num_sequences=1,
        entropy=entropy,
        entropy_coef=0.1,
    )
    loss.backward()
    assert metrics["entropy"].item() == 1.0 and loss.item() == pytest.approx(-0.1)
    assert entropy.grad.tolist() == [[pytest.approx(-0.1), 0.0]]


def test_a_custom_reducer_replaces_the_aggregation():
    def total_sum(token_loss, loss_mask, num_tokens, num_sequences):
        return torch.where(loss_mask, token_loss, 0.0).sum()

    loss, _ = policy_loss(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.ones(1, 2, dtype=torch.bool),
        params=LossParams(),
        aggregation="token_mean",
        num_tokens=2,
        num_sequences=1,
        reducer=total_sum,
    )
    assert loss.item() == -2.0


def test_unknown_policy_loss_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy loss 'dpo'"):
        _one_token_policy_loss(torch.zeros(1, 1), loss="dpo")


# Two rows, mask [[1, 1, 0], [1, 0, 0]]: the masked slots hold finite placeholders in the clean case.
MASK = torch.tensor([[True, True, False], [True, False, False]])
CLEAN = {
    "log_probs": torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.0, -1.5]]),
    "old_log_probs": torch.tensor([[-1.2, -0.5, -1.0], [-0.1, -0.7, -0.2]]),
    "advantages": torch.tensor([[1.0, 1.0, 3.0], [-2.0, 0.5, -1.0]]),
    "ref_log_probs": torch.tensor([[-1.1, -0.7, -0.4], [-0.2, -0.9, -0.6]]),
}


def _loss_and_grad(loss_name, inputs):
    log_probs = inputs["log_probs"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        log_probs,
        inputs["old_log_probs"],
        inputs["advantages"],
        MASK,
        params=LossParams(clip_low=0.2, clip_high=0.28),
        aggregation="seq_mean_token_mean",
        num_tokens=3,
        num_sequences=2,
        loss=loss_name,
        ref_log_probs=inputs["ref_log_probs"],
        kl_coef=0.1,
    )
    loss.backward()
    return loss.detach(), log_probs.grad


@pytest.mark.parametrize("loss_name", get_args(PolicyLoss))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "minus_inf"])
@pytest.mark.parametrize("where", [*CLEAN, "all"])
def test_nan_or_inf_at_masked_slots_leaves_the_loss_and_gradient_of_every_registered_loss_unchanged(
    loss_name, bad, where
):
    # Selection, not multiplication: 0 * d(loss)/dx is NaN where x is NaN/inf, so one bad masked slot would poison
    # every parameter's gradient (cispo's -w * A * log_probs, ppo's and gspo's exp(log_ratio), k3's exp).
    dirty = {name: t.clone() for name, t in CLEAN.items()}
    for name in CLEAN if where == "all" else [where]:
        dirty[name][~MASK] = bad
    clean_loss, clean_grad = _loss_and_grad(loss_name, CLEAN)
    loss, grad = _loss_and_grad(loss_name, dirty)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
    torch.testing.assert_close(loss, clean_loss, atol=0, rtol=0)
    torch.testing.assert_close(grad, clean_grad, atol=0, rtol=0)
    assert torch.equal(grad[~MASK], torch.zeros(3))


@pytest.mark.parametrize(
    "loss_name, expected_loss, expected_grad",
    [
        # One trained token: log_prob -1, old -1.1 (r = e^0.1 = 1.10517, inside [0.8, 1.28]), A = 2.
        pytest.param("ppo", -2.21034, -2.21034, id="ppo_-rA_grad_-rA"),
        pytest.param("gspo", -2.21034, -2.21034, id="gspo_one_token_s_equals_r"),
        pytest.param("cispo", 2.21034, -2.21034, id="cispo_-wA*logp_grad_-wA"),
        pytest.param("sft", 1.0, -1.0, id="sft_-logp"),
    ],
)
def test_a_nan_masked_slot_keeps_each_loss_at_its_hand_computed_value(loss_name, expected_loss, expected_grad):
    nan = float("nan")
    log_probs = torch.tensor([[-1.0, nan]], requires_grad=True)
    loss, _ = policy_loss(
        log_probs,
        torch.tensor([[-1.1, nan]]),
        torch.tensor([[2.0, nan]]),
        torch.tensor([[True, False]]),
        params=LossParams(clip_low=0.2, clip_high=0.28),
        aggregation="token_mean",
        num_tokens=1,
        num_sequences=1,
        loss=loss_name,
    )
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-5)
    assert log_probs.grad[0, 0].item() == pytest.approx(expected_grad, abs=1e-5)
    assert log_probs.grad[0, 1].item() == 0.0
