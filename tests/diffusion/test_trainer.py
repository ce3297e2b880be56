"""Flow-GRPO's trainer on the tiny twin (``miles.diffusion.trainer``): weights reach the rollout copy through
miles.sync (the recomputed log-probs equal the sampler's), the loss moves what the advantages say, a resumed run
equals an uninterrupted one, and the settings refuse what cannot run."""

import numpy as np
import pytest
import torch
from miles.diffusion.config import FlowGRPOConfig
from miles.diffusion.models import (
    ByteTextEncoder,
    load_flow_model,
    save_flow_model,
    tiny_flow_model,
)
from miles.diffusion.rewards import IMAGE_REWARDS
from miles.diffusion.trainer import FlowGRPOTrainer, RewardFailed
from pydantic import ValidationError

PROMPTS = ["a red image", "a blue image"]
SMALL = dict(prompts_per_step=2, group_size=3, num_steps=3, micro_batch_size=4, lr=1e-3)


def brightness(prompts, images):
    return [float(image.mean()) / 255 for image in images]


def weights(module):
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def test_the_byte_encoder_is_fixed_and_tells_prompts_apart():
    encoder = ByteTextEncoder(dim=8, pooled_dim=4, max_length=6, seed=3)
    cond = encoder(["red", "blue", "", "a very long prompt"])
    assert cond.prompt_embeds.shape == (4, 6, 8) and cond.pooled.shape == (4, 4)
    assert torch.equal(cond.prompt_embeds[2], torch.zeros(6, 8)) and torch.equal(cond.pooled[2], torch.zeros(4))
    assert torch.equal(cond.prompt_embeds[0, 3:], torch.zeros(3, 8))  # padding after the 3 bytes of "red"
    assert not torch.allclose(cond.pooled[0], cond.pooled[1])
    again = ByteTextEncoder(dim=8, pooled_dim=4, max_length=6, seed=3)(["a very long prompt, cut"])
    assert torch.equal(again.prompt_embeds[0], cond.prompt_embeds[3])  # cut at max_length bytes
    expected = (encoder.byte_table[list(b"red")] + encoder.positions[:3]).mean(0) @ encoder.pool
    assert torch.allclose(cond.pooled[0], expected, atol=1e-6)


def test_the_tiny_twin_round_trips_through_its_directory(tmp_path):
    model = tiny_flow_model(seed=0)
    with torch.no_grad():
        next(model.transformer.parameters()).add_(0.5)  # a "trained" weight must come back
    save_flow_model(model, tmp_path / "tiny")
    loaded = load_flow_model(tmp_path / "tiny")
    assert loaded.latent_shape == model.latent_shape == (3, 16, 16)
    for (name, a), (_, b) in zip(model.transformer.state_dict().items(), loaded.transformer.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(loaded.encode(PROMPTS).pooled, model.encode(PROMPTS).pooled)
    assert not list(tmp_path.glob(".*tmp"))
    with pytest.raises(FileExistsError):
        save_flow_model(model, tmp_path / "tiny")
    with pytest.raises(FileNotFoundError, match="miles_flow.json is missing"):
        load_flow_model(tmp_path)


def test_a_step_syncs_the_rollout_copy_through_miles_sync():
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), FlowGRPOConfig(**SMALL), brightness)
    assert trainer.receiver.weight_version == 1
    before = weights(trainer.rollout_transformer)
    metrics = trainer.step(PROMPTS)
    assert metrics["rollout/weight_version"] == 1 and metrics["weight_version"] == 2
    assert trainer.receiver.weight_version == 2
    # sampled with the policy's own weights: the trainer's recompute equals the sampler's log-probs
    assert metrics["train_rollout_logprob_max_abs_diff"] < 1e-5
    after = weights(trainer.rollout_transformer)
    policy = weights(trainer.policy)
    assert all(torch.equal(after[name], policy[name]) for name in policy)  # the copy holds the new weights
    assert any(not torch.equal(after[name], before[name]) for name in before)
    assert metrics["optimizer_steps"] == 1 and metrics["reward/no_signal_groups"] == 0


def test_equal_rewards_give_no_gradient():
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), FlowGRPOConfig(**SMALL), lambda p, images: [1.0] * len(p))
    rollout = trainer.rollout(PROMPTS, step=0)
    assert torch.equal(rollout.advantages, torch.zeros(6))
    metrics = trainer.train(rollout, step=0)
    assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0


def test_the_update_raises_the_log_prob_of_the_better_images():
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), FlowGRPOConfig(**SMALL, weight_decay=0.0), brightness)
    rollout = trainer.rollout(PROMPTS, step=0)
    trainer.train(rollout, step=0)
    from miles.diffusion.sampler import step_log_probs

    cond = trainer.model.encode(rollout.prompts)
    with torch.no_grad():
        new = step_log_probs(trainer.policy, rollout.trajectories, cond, range(3)).mean(1)
    change = new - rollout.trajectories.log_probs.mean(1)
    # the policy gradient raises the log-prob of above-average images relative to below-average ones
    assert float((change * rollout.advantages).sum()) > 0


def test_denoising_reduction_trains_a_seeded_subset_of_steps():
    trainer = FlowGRPOTrainer(
        tiny_flow_model(seed=0), FlowGRPOConfig(**{**SMALL, "num_steps": 6}, train_steps=2), brightness
    )
    subsets = [trainer._train_steps(step, 0) for step in range(8)]
    assert all(len(s) == 2 and len(set(s)) == 2 and all(0 <= i < 6 for i in s) for s in subsets)
    assert len({tuple(s) for s in subsets}) > 1
    assert subsets == [trainer._train_steps(step, 0) for step in range(8)]
    assert trainer.step(PROMPTS)["train_rollout_logprob_max_abs_diff"] < 1e-5


def test_resume_equals_an_uninterrupted_run():
    config = FlowGRPOConfig(**SMALL, updates_per_rollout=2, train_steps=2)
    straight = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    first = [straight.step(PROMPTS) for _ in range(2)]
    interrupted = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    interrupted.step(PROMPTS)
    state = interrupted.state_dict()
    resumed = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    resumed.load_state_dict(state)
    second = resumed.step(PROMPTS)
    for key in ("reward/mean", "loss", "grad_norm", "approx_kl"):
        assert second[key] == first[1][key], key
    assert resumed.receiver.weight_version == straight.receiver.weight_version == 3
    final, other = weights(straight.policy), weights(resumed.policy)
    assert all(torch.equal(final[name], other[name]) for name in final)
    assert first[1]["approx_kl"] > 0  # the second mini-batch is off-policy: the ratio moved


def test_evaluation_is_deterministic_and_held_out():
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), FlowGRPOConfig(**SMALL), IMAGE_REWARDS["named_colour"])
    score, images = trainer.evaluate(PROMPTS, seed=99)
    again, images_again = trainer.evaluate(PROMPTS, seed=99)
    assert score == again and np.array_equal(images, images_again) and images.shape == (2, 16, 16, 3)
    assert 0 < score < 1
    assert not np.array_equal(trainer.evaluate(PROMPTS, seed=100)[1], images)


def test_a_bad_reward_is_named():
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), FlowGRPOConfig(**SMALL), lambda p, images: [0.0])
    with pytest.raises(RewardFailed, match="must return 6 finite floats"):
        trainer.step(PROMPTS)
    raising = FlowGRPOTrainer(tiny_flow_model(seed=0), FlowGRPOConfig(**SMALL), IMAGE_REWARDS["named_colour"])
    with pytest.raises(RewardFailed, match="raised ValueError: prompt 'a dog' must name exactly one colour"):
        raising.step(["a dog", "a red image"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"updates_per_rollout": 4}, r"updates_per_rollout \(4\) must divide"),
        ({"train_steps": 4}, r"algorithm.train_steps \(4\) must be at most algorithm.num_steps \(3\)"),
        ({"group_size": 1}, "group_size"),
        ({"guidance_scale": 0.5}, "guidance_scale"),
        ({"lora": {"sync": "adapter"}}, "lora.sync"),
        ({"lora": {"rank": 0}}, "lora.rank"),
    ],
)
def test_the_config_refuses_what_cannot_run(fields, message):
    with pytest.raises(ValidationError, match=message):
        FlowGRPOConfig(**{**SMALL, **fields})


def test_kl_to_the_starting_model_is_zero_first_and_pulls_back():
    config = FlowGRPOConfig(**SMALL, kl_coef=0.5)
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    first = trainer.step(PROMPTS)
    assert first["kl"] == 0.0  # the policy starts at the reference
    second = trainer.step(PROMPTS)
    assert second["kl"] > 0
    # the KL term is the closed form of the two Gaussian steps: recompute one by hand
    from miles.diffusion.flow_grpo import gaussian_kl
    from miles.diffusion.sampler import step_transition

    rollout = trainer.rollout(PROMPTS, step=5)
    cond = trainer.model.encode(rollout.prompts)
    with torch.no_grad():
        a = step_transition(trainer.policy, rollout.trajectories, cond, 1)
        b = step_transition(trainer.reference, rollout.trajectories, cond, 1)
    expected = ((a.mean - b.mean) ** 2 / (2 * a.scale**2)).flatten(1).mean(1)
    assert torch.allclose(gaussian_kl(a.mean, b.mean, a.scale), expected)
    assert bool((expected > 0).all())
    plain = FlowGRPOTrainer(tiny_flow_model(seed=0), FlowGRPOConfig(**SMALL), brightness)
    assert plain.reference is None and "kl" not in plain.step(PROMPTS)


def test_a_resume_takes_the_configs_learning_rate_and_keeps_the_moments(caplog):
    config = FlowGRPOConfig(**SMALL, warmup_steps=4)
    first = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    first.step(PROMPTS)
    state = first.state_dict()
    resumed = FlowGRPOTrainer(tiny_flow_model(seed=0), config.model_copy(update={"lr": 5e-4}), brightness)
    with caplog.at_level("INFO", logger="miles.diffusion.trainer"):
        resumed.load_state_dict(state)
    assert "algorithm.lr changed on resume: 0.001 -> 0.0005" in caplog.text
    group = resumed.optimizer.param_groups[0]
    assert group["initial_lr"] == 5e-4 and group["lr"] == 5e-4 * 2 / 4  # step 2 of a 4-step warmup
    moments = resumed.optimizer.state[resumed.optimizer.param_groups[0]["params"][0]]["exp_avg"]
    assert torch.equal(moments, first.optimizer.state[first.optimizer.param_groups[0]["params"][0]]["exp_avg"])
    same = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    same.load_state_dict(state)  # unchanged settings: the schedule continues exactly where it was
    assert same.optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"] == 1e-3 * 2 / 4
