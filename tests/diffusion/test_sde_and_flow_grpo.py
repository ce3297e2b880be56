"""Flow-GRPO's stochastic sampler and objective (``miles.diffusion``): hand-computed steps, the density against
torch's Normal, recomputed log-probs equal the sampler's, the SDE keeps the flow's marginals on a Gaussian whose
exact velocity is known, and the loss on a hand-computed case."""

import math

import pytest
import torch
from miles.diffusion.flow_grpo import flow_grpo_loss, gaussian_kl
from miles.diffusion.sde import noise_std, ode_step, sde_step, transition_log_prob


def test_one_step_by_hand():
    # x = 1, v = -1, t = 0.5 -> 0.4, a = 0.7: s = 0.7 sqrt(0.5 / 0.5) = 0.7, dt = -0.1,
    # mean = 1 + (-1 + 0.49 / (2 * 0.5) * (1 + 0.5 * -1)) * -0.1 = 1 + (-1 + 0.245) * -0.1 = 1.0755
    x, v = torch.ones(1, 1), -torch.ones(1, 1)
    step = sde_step(x, v, 0.5, 0.4, noise_level=0.7, sigma_max=0.9, x_next=torch.full((1, 1), 1.2))
    assert step.mean.item() == pytest.approx(1.0755, abs=1e-6)
    assert step.scale.item() == pytest.approx(0.7 * math.sqrt(0.1), abs=1e-7)
    z = (1.2 - 1.0755) / (0.7 * math.sqrt(0.1))
    expected = -0.5 * z * z - math.log(0.7 * math.sqrt(0.1)) - 0.5 * math.log(2 * math.pi)
    assert step.log_prob.item() == pytest.approx(expected, abs=1e-5)
    # at t = 1 the denominator is 1 - sigma_max
    assert noise_std(1.0, noise_level=0.7, sigma_max=0.9).item() == pytest.approx(0.7 * math.sqrt(10), rel=1e-6)
    assert ode_step(x, v, 0.5, 0.4).item() == pytest.approx(1.1)


def test_the_density_is_torch_normals_averaged_over_elements_and_the_recompute_equals_the_sampler():
    torch.manual_seed(0)
    x, v = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    sigma = torch.tensor([1.0, 0.7, 0.3])
    sampled = sde_step(x, v, sigma, sigma - 0.1, noise_level=0.7, sigma_max=0.95,
                       generator=torch.Generator().manual_seed(1))  # fmt: skip
    normal = torch.distributions.Normal(sampled.mean, sampled.scale.expand_as(sampled.mean))
    assert torch.allclose(sampled.log_prob, normal.log_prob(sampled.x_next).flatten(1).mean(dim=1), atol=1e-5)
    rescored = sde_step(x, v, sigma, sigma - 0.1, noise_level=0.7, sigma_max=0.95, x_next=sampled.x_next)
    assert torch.equal(rescored.log_prob, sampled.log_prob)  # the trainer's recompute: bit-equal on the same inputs
    assert torch.equal(transition_log_prob(sampled.x_next, sampled.mean, sampled.scale), sampled.log_prob)


@pytest.mark.parametrize("noise_level", [0.0, 0.7])
def test_the_sde_keeps_the_flows_marginals(noise_level):
    """Data x0 ~ N(0, s^2), x_t = (1 - t) x0 + t eps: the exact velocity is E[eps - x0 | x_t] =
    x (t - (1 - t) s^2) / ((1 - t)^2 s^2 + t^2). Sampling from noise with it must give back var s^2 at t = 0 (and the
    marginal variance on the way), with noise (SDE) as without (ODE)."""
    s2, steps, n = 0.25, 400, 200_000
    gen = torch.Generator().manual_seed(0)
    times = torch.linspace(1.0, 0.0, steps + 1)
    x = torch.randn(n, 1, generator=gen)
    for i in range(steps):
        t, t_next = float(times[i]), float(times[i + 1])
        velocity = x * (t - (1 - t) * s2) / ((1 - t) ** 2 * s2 + t**2)
        if noise_level:
            x = sde_step(
                x, velocity, t, t_next, noise_level=noise_level, sigma_max=float(times[1]), generator=gen
            ).x_next
        else:
            x = ode_step(x, velocity, t, t_next)
        if i + 1 == steps // 2:  # t = 0.5
            assert float(x.var()) == pytest.approx(0.25 * s2 + 0.25, rel=0.03)
    assert float(x.var()) == pytest.approx(s2, rel=0.03)
    assert abs(float(x.mean())) < 0.01


def test_refusals():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="noise_level > 0"):
        sde_step(x, x, 0.5, 0.4, noise_level=0.0, sigma_max=0.9)
    with pytest.raises(ValueError, match="smaller sigma_next"):
        sde_step(x, x, 0.4, 0.5, noise_level=0.7, sigma_max=0.9)
    with pytest.raises(ValueError, match="sigma_max must be in"):
        noise_std(0.5, noise_level=0.7, sigma_max=1.0)


def test_the_loss_by_hand():
    # 2 images x 2 steps, the second image's step 1 untrained. Ratios e^0.1, e^-0.2, e^0.05; clip 0.1.
    log_probs = torch.tensor([[0.1, -0.2], [0.05, 3.0]], requires_grad=True)
    old = torch.zeros(2, 2)
    advantages = torch.tensor([1.0, -7.0])  # clipped to -5
    mask = torch.tensor([[True, True], [True, False]])
    loss, metrics = flow_grpo_loss(log_probs, old, advantages, mask, clip_low=0.1, clip_high=0.1, advantage_clip=5.0)
    r = [math.exp(0.1), math.exp(-0.2), math.exp(0.05)]
    terms = [
        max(-r[0] * 1.0, -min(r[0], 1.1) * 1.0),  # A > 0, r > 1.1: clipped at 1.1
        max(-r[1] * 1.0, -max(r[1], 0.9) * 1.0),  # A > 0, r < 0.9: unclipped (min picks r A)
        max(r[2] * 5.0, min(max(r[2], 0.9), 1.1) * 5.0),  # A = -5, r in range
    ]
    assert loss.item() == pytest.approx(sum(terms) / 3, rel=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert log_probs.grad[1, 1] == 0 and log_probs.grad[0, 0] == 0  # untrained step; clipped step
    assert log_probs.grad[0, 1].item() == pytest.approx(-r[1] / 3, rel=1e-6)
    mean, ref, scale = torch.ones(1, 4), torch.zeros(1, 4), torch.full((1, 1), 0.5)
    assert gaussian_kl(mean, ref, scale).item() == pytest.approx(1 / (2 * 0.25))
    with pytest.raises(ValueError, match="kl_coef > 0 needs"):
        flow_grpo_loss(log_probs, old, advantages, mask, kl_coef=0.1)
