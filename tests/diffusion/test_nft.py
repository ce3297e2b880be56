"""DiffusionNFT's objective (``miles.diffusion.nft``) against hand-computed values, and in the trainer."""

import pytest
import torch
from miles.diffusion.config import FlowGRPOConfig, FlowLoraConfig
from miles.diffusion.models import tiny_flow_model
from miles.diffusion.nft import diffusion_nft_loss, forward_noised, old_policy_decay, optimality
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
        ({"nft_decay_max": 1.0}, "nft_decay_max"),
    ],
)
def test_nft_settings_that_cannot_run(fields, message):
    with pytest.raises(ValidationError, match=message):
        FlowGRPOConfig(loss="diffusion_nft", **fields)


def test_flow_grpo_refuses_the_old_policys_soft_update():
    with pytest.raises(ValidationError, match="nft_decay_rate is DiffusionNFT's soft update"):
        FlowGRPOConfig(nft_decay_rate=0.001)


def test_the_soft_update_schedule_by_hand():
    """DiffusionNFT's schedule: eta = min(rate x (steps - delay), max) from delay on, 0 before."""
    default = dict(rate=0.001, max_decay=0.5)
    assert [old_policy_decay(s, **default) for s in (0, 1, 100, 499, 500, 2000)] == pytest.approx(
        [0.0, 0.001, 0.1, 0.499, 0.5, 0.5]
    )
    ocr = dict(rate=0.0075, max_decay=0.999, delay=75)
    assert [old_policy_decay(s, **ocr) for s in (0, 74, 75, 175, 300)] == pytest.approx([0.0, 0.0, 0.0, 0.75, 0.999])
    with pytest.raises(ValueError, match="max_decay"):
        old_policy_decay(1, rate=0.1, max_decay=1.0)


NFT = dict(loss="diffusion_nft", prompts_per_step=2, group_size=4, num_steps=3, lr=1e-2, weight_decay=0.0)


@pytest.mark.parametrize("lora", [None, FlowLoraConfig(rank=4, alpha=8.0)], ids=["full", "lora"])
def test_the_sampling_copy_holds_the_soft_updated_old_policy(lora):
    """With nft_decay_rate the rollout copy (DiffusionNFT's v_old, the sampling policy) gets
    eta old + (1 - eta) theta of the trained parameters after each step (with LoRA: of A and B, merged), by hand."""
    config = FlowGRPOConfig(**NFT, nft_decay_rate=0.25, nft_decay_max=0.4, lora=lora)
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    start = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    first = trainer.step(["a", "b"])
    assert first["nft/old_decay"] == 0.25  # 1 optimizer step: min(0.25 x 1, 0.4)
    theta1 = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if n in start}
    old1 = {n: 0.25 * start[n] + 0.75 * theta1[n] for n in start}
    assert trainer.step(["a", "b"])["nft/old_decay"] == 0.4  # 2 steps: min(0.5, 0.4)
    theta2 = {n: p.detach() for n, p in trainer.policy.named_parameters() if n in start}
    old2 = {n: 0.4 * old1[n] + 0.6 * theta2[n] for n in start}
    copy = {k: v.clone() for k, v in trainer.rollout_transformer.state_dict().items()}
    if lora is None:
        for name in start:
            torch.testing.assert_close(copy[name], old2[name], atol=1e-7, rtol=0, msg=name)
        assert any(not torch.allclose(copy[n], theta2[n]) for n in start)  # the copy lags the trained weights
    else:
        base = tiny_flow_model(seed=0).transformer.state_dict()
        layer = "transformer_blocks.0.attn.to_q"
        a, b = old2[f"{layer}.lora_A.default.weight"], old2[f"{layer}.lora_B.default.weight"]
        torch.testing.assert_close(copy[f"{layer}.weight"], base[f"{layer}.weight"] + (b @ a) * 2.0, atol=1e-7, rtol=0)
        # what a checkpoint saves: the trained weights, merged; the copy holds the old policy again afterwards
        live = dict(trainer.policy.named_parameters())
        a, b = live[f"{layer}.lora_A.default.weight"], live[f"{layer}.lora_B.default.weight"]
        with trainer.trained_transformer() as trained:
            torch.testing.assert_close(trained.state_dict()[f"{layer}.weight"], base[f"{layer}.weight"] + (b @ a) * 2.0,
                                       atol=1e-7, rtol=0)  # fmt: skip
        assert all(torch.equal(trainer.rollout_transformer.state_dict()[k], copy[k]) for k in copy)
    # an exact resume carries the old policy
    state = trainer.state_dict()
    resumed = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    resumed.load_state_dict(state)
    again = resumed.rollout_transformer.state_dict()
    assert all(torch.equal(again[k], copy[k]) for k in copy)
    assert resumed.step(["a", "b"])["loss"] == trainer.step(["a", "b"])["loss"]
