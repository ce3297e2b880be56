import pytest
import torch
from miles.core.algorithms.kl import kl_estimate


@pytest.mark.parametrize(
    "estimator, value, grad",
    [
        # log_ratio = ref - logp = -0.5
        pytest.param("k1", 0.5, 1.0, id="k1=-log_ratio"),
        pytest.param("k2", 0.125, 0.5, id="k2=log_ratio^2/2"),
        pytest.param("k3", 0.10653, 0.39347, id="k3=e^-0.5+0.5-1"),
    ],
)
def test_kl_estimators_match_hand_values_and_gradients(estimator, value, grad):
    log_probs = torch.tensor([[0.0]], requires_grad=True)
    kl = kl_estimate(log_probs, torch.tensor([[-0.5]]), estimator=estimator)
    kl.sum().backward()
    assert kl.item() == pytest.approx(value, abs=1e-5)
    assert log_probs.grad.item() == pytest.approx(grad, abs=1e-5)


def test_k3_is_zero_and_nonnegative_around_equal_policies():
    log_probs = torch.linspace(-3, 0, 7)[None]
    assert torch.equal(kl_estimate(log_probs, log_probs, estimator="k3"), torch.zeros(1, 7))
    assert (kl_estimate(log_probs, log_probs.flip(-1), estimator="k3") >= 0).all()


def test_k3_stays_finite_for_huge_log_ratios():
    kl = kl_estimate(torch.tensor([[-200.0]]), torch.tensor([[0.0]]), estimator="k3")
    assert torch.isfinite(kl).all()


def test_unknown_kl_estimator_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), estimator="k4")


def test_low_var_kl_is_k3_clamped_at_ten():
    # log_ratio = ref - logp = 5: k3 = e^5 - 5 - 1 = 142.4 -> 10; small ratios equal k3.
    log_probs = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[5.0, -0.5]])
    got = kl_estimate(log_probs, ref, estimator="low_var_kl")
    torch.testing.assert_close(got, torch.tensor([[10.0, 0.10653]]), atol=1e-5, rtol=0)
