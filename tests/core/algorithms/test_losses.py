import pytest
import torch
from miles.core.algorithms.losses import aggregate, entropy_from_logits, policy_loss, ppo_clip


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
        clip_low=0.2,
        clip_high=0.2,
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
