"""DiffusionNFT's objective (``miles.diffusion.nft``) against hand-computed values, and in the trainer."""

import pytest
import torch
from miles.diffusion.config import FlowGRPOConfig
from miles.diffusion.models import tiny_flow_model
from miles.diffusion.nft import diffusion_nft_loss, forward_noised, optimality
from miles.diffusion.trainer import FlowGRPOTrainer
from pydantic import ValidationError


def test_optimality_maps_advantages_into_zero_one():
    r = optimality(torch.tensor([-3.0, -0.5, 0.0, 0.5, 3.0]), scale=1.0)
    assert torch.equal(r, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
    assert torch.equal(optimality(torch.tensor([1.0]), scale=2.0), torch.tensor([0.75]))
    with pytest.raises(ValueError, match="scale must be > 0"):
        optimality(torch.zeros(1), scale=0.0)


def test_the_forward_process_and_its_velocity():
    x0, eps = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]])
    x_t, v = forward_noised(x0, 0.25, eps)
    assert torch.equal(x_t, torch.tensor([[1.5, 1.25]])) and torch.equal(v, torch.tensor([[2.0, -3.0]]))
    x_t, _ = forward_noised(torch.ones(2, 1), torch.tensor([0.0, 1.0]), torch.zeros(2, 1))
    assert torch.equal(x_t, torch.tensor([[1.0], [0.0]]))


def test_the_loss_by_hand():
    v_theta = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    v_old = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    target = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    r = torch.tensor([1.0, 0.25])
    loss, metrics = diffusion_nft_loss(v_theta, v_old, target, r, beta=0.5)
    # image 0: v+ = 0.5 v_old + 0.5 v = (0.5, 0) -> mse((-0.5, -1)) = 0.625; v- = 1.5 v_old - 0.5 v = (-0.5, 0)
    #   -> mse((-1.5, -1)) = 1.625; r = 1: 0.625
    # image 1: v+ = (0.5, 1.5) -> mse = (0.25 + 2.25) / 2 = 1.25; v- = (1.5, 0.5) -> (2.25 + 0.25) / 2 = 1.25
    #   r = 0.25: 0.25 * 1.25 + 0.75 * 1.25 = 1.25
    assert loss.item() == pytest.approx((0.625 + 1.25) / 2)
    assert metrics["nft/positive_mse"].item() == pytest.approx((0.625 + 1.25) / 2)
    assert metrics["nft/negative_mse"].item() == pytest.approx((1.625 + 1.25) / 2)
    loss.backward()
    # d/dv of r * mse(v+ - t) + (1 - r) * mse(v- - t), mean over 2 images, mse over 2 elements:
    # image 0 (r = 1): 0.5 * 2 * beta * (v+ - t) / 2 = 0.25 * (-0.5, -1)
    assert torch.allclose(v_theta.grad[0], torch.tensor([-0.125, -0.25]))
    # image 1: 0.5 * [r * beta * (v+ - t) - (1 - r) * beta * (v- - t)] = 0.25 * [0.25 (0.5, 1.5) - 0.75 (1.5, 0.5)]
    assert torch.allclose(v_theta.grad[1], 0.25 * (0.25 * torch.tensor([0.5, 1.5]) - 0.75 * torch.tensor([1.5, 0.5])))


def test_beta_one_and_reward_one_is_flow_matching():
    v_theta, v_old, target = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    loss, _ = diffusion_nft_loss(v_theta, v_old, target, torch.ones(3), beta=1.0)
    assert loss.item() == pytest.approx(((v_theta - target) ** 2).mean().item(), rel=1e-6)
    with pytest.raises(ValueError, match="beta must be > 0"):
        diffusion_nft_loss(v_theta, v_old, target, torch.ones(3), beta=0.0)
    with pytest.raises(ValueError, match="shapes differ"):
        diffusion_nft_loss(v_theta, v_old, target, torch.ones(2))


def brightness(prompts, images):
    return [float(image.mean()) / 255 for image in images]


def test_an_nft_step_moves_the_velocity_towards_the_better_images():
    config = FlowGRPOConfig(loss="diffusion_nft", prompts_per_step=2, group_size=4, num_steps=3, lr=1e-3,
                            weight_decay=0.0)  # fmt: skip
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    rollout = trainer.rollout(["a", "b"], step=0)
    x0 = rollout.trajectories.latents[:, -1]
    cond = trainer.model.encode(rollout.prompts)
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7))
    sigma = rollout.trajectories.sigmas[1]
    x_t, target = forward_noised(x0, sigma, eps)
    from miles.diffusion.sampler import velocity

    with torch.no_grad():
        before = ((velocity(trainer.policy, x_t, sigma, cond) - target) ** 2).flatten(1).mean(1)
    metrics = trainer.train(rollout, step=0)
    assert set(metrics) >= {"loss", "grad_norm", "nft/positive_mse", "nft/negative_mse"}
    assert "train_rollout_logprob_max_abs_diff" not in metrics and metrics["weight_version"] == 2
    with torch.no_grad():
        after = ((velocity(trainer.policy, x_t, sigma, cond) - target) ** 2).flatten(1).mean(1)
    # the flow-matching error falls more (or rises less) on above-average images than on below-average ones
    assert float(((before - after) * rollout.advantages).sum()) > 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"guidance_scale": 3.0}, "diffusion_nft trains CFG-free"),
        ({"kl_coef": 0.1}, "diffusion_nft has none"),
        ({"nft_beta": 0.0}, "nft_beta"),
    ],
)
def test_nft_settings_that_cannot_run(fields, message):
    with pytest.raises(ValidationError, match=message):
        FlowGRPOConfig(loss="diffusion_nft", **fields)
