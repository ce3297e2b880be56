"""A bfloat16 sampling copy (``algorithm.rollout_dtype``) and bfloat16 frozen parts (``model.frozen_dtype``): the
copy holds the float32 policy rounded after every push, the old log-probs are the trainer's float32 recompute so the
ratio starts at exactly 1 (and the sampler's gap is measured, not hidden), a checkpoint saves float32 weights, and
the SD3.5 recipe's settings run that way end to end."""

import json

import pytest
import torch
from miles.diffusion.config import FlowGRPOConfig
from miles.diffusion.models import tiny_flow_model
from miles.diffusion.sampler import step_transition
from miles.diffusion.trainer import FlowGRPOTrainer
from miles.train.fsdp2.lora import merged_weights
from pydantic import ValidationError

PROMPTS = ["a red image", "a blue image"]
SMALL = dict(prompts_per_step=2, group_size=4, num_steps=4, micro_batch_size=8, lr=1e-3, seed=3)


def brightness(prompts, images):
    return [float(image.mean()) / 255 for image in images]


def rounded_policy(trainer):
    return {name: t.detach().to(torch.bfloat16) for name, t in trainer.policy.state_dict().items()}


def test_the_copy_is_the_policy_rounded_and_the_ratio_starts_at_one_with_the_gap_measured():
    trainer = FlowGRPOTrainer(tiny_flow_model(), FlowGRPOConfig(**SMALL, rollout_dtype="bfloat16"), brightness)
    copy = trainer.rollout_transformer.state_dict()
    assert {t.dtype for t in copy.values()} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())  # the master weights
    assert all(torch.equal(copy[n], t) for n, t in rounded_policy(trainer).items())
    rollout = trainer.rollout(PROMPTS, step=0)
    # the sampler's log-probs are the bfloat16 copy's: the float32 policy's differ by more than float32 rounding
    fp32 = step_transition(trainer.policy, rollout.trajectories, trainer._conditions(rollout.prompts)[0], 0)
    gap = (fp32.log_prob.detach() - rollout.trajectories.log_probs[:, 0]).abs().max().item()
    assert gap > 1e-5
    metrics = trainer.train(rollout, step=0)
    assert metrics["train_rollout_logprob_max_abs_diff"] >= gap  # every trained step's gap, the whole rollout
    assert metrics["clipfrac"] == 0 and metrics["approx_kl"] == 0  # old = the policy's own recompute: ratio 1
    copy = trainer.rollout_transformer.state_dict()
    assert all(torch.equal(copy[n], t) for n, t in rounded_policy(trainer).items())  # the push, rounded
    trusting = FlowGRPOTrainer(
        tiny_flow_model(), FlowGRPOConfig(**SMALL, rollout_dtype="bfloat16", old_log_probs="rollout"), brightness
    )
    metrics = trusting.train(trusting.rollout(PROMPTS, step=0), step=0)
    assert metrics["approx_kl"] > 0 and metrics["clipfrac"] > 0  # the sampler's log-probs: ratios leave 1 +- 1e-4


def test_recomputing_in_float32_changes_nothing_but_costs_a_forward():
    runs = {}
    for old in ("rollout", "recompute"):
        trainer = FlowGRPOTrainer(tiny_flow_model(), FlowGRPOConfig(**SMALL, old_log_probs=old), brightness)
        runs[old] = [trainer.step(PROMPTS) for _ in range(2)]
    for a, b in zip(runs["rollout"], runs["recompute"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-7) and b["train_rollout_logprob_max_abs_diff"] < 1e-5


def test_a_checkpoint_of_a_bfloat16_copy_with_lora_saves_the_float32_merged_weights():
    config = FlowGRPOConfig(**SMALL, rollout_dtype="bfloat16", lora={"rank": 4, "alpha": 8.0})
    trainer = FlowGRPOTrainer(tiny_flow_model(), config, brightness)
    trainer.step(PROMPTS)
    held = {n: t.detach().clone() for n, t in trainer.rollout_transformer.state_dict().items()}
    merged = dict(merged_weights(trainer.policy, trainer.policy.state_dict().items()))  # every layer, float32
    assert set(merged) == set(held)
    with trainer.trained_transformer() as transformer:
        saved = transformer.state_dict()
        assert {t.dtype for t in saved.values()} == {torch.float32}
        # the adapted layers merged, and the others exactly as loaded (not their bf16 roundings)
        assert all(torch.equal(saved[n], t) for n, t in merged.items())
    after = trainer.rollout_transformer.state_dict()
    assert all(after[n].dtype == torch.bfloat16 and torch.equal(after[n], held[n]) for n in held)
    assert trainer.step(PROMPTS)["weight_version"] == 3  # the copy still takes pushes (its tensor map rebuilt)
    assert all(torch.equal(trainer.rollout_transformer.state_dict()[n], t.to(torch.bfloat16))
               for n, t in merged_weights(trainer.policy, trainer._adapted()))  # fmt: skip


def test_old_log_probs_is_a_flow_grpo_setting():
    with pytest.raises(ValidationError, match="algorithm.old_log_probs is flow_grpo's ratio denominator"):
        FlowGRPOConfig(**SMALL, loss="diffusion_nft", old_log_probs="recompute")


def test_the_sd35_recipe_trains_in_bfloat16_on_its_tiny_twin(tmp_path, monkeypatch):
    from miles.recipes.cli import main, resolve_config
    from miles.recipes.diffusion import build_model

    cfg = resolve_config("sd35_medium_flow_grpo_compressibility", [], tiny=True)
    assert (cfg.model.frozen_dtype, cfg.algorithm.rollout_dtype) == ("bfloat16", "bfloat16")
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    model = build_model(cfg)
    assert {p.dtype for m in model.frozen for p in m.parameters()} == {torch.bfloat16}
    assert model.encode(PROMPTS).prompt_embeds.dtype == torch.float32
    assert model.decode(torch.zeros(1, *model.latent_shape)).dtype == torch.float32
    args = ["train", "--recipe", "sd35_medium_flow_grpo_compressibility", "--tiny", "--run.dir", str(tmp_path),
            "--run.name", "b", "--run.progress", "false"]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2] and all(r["grad_norm"] > 0 for r in train_rows)
    assert all(0 < r["train_rollout_logprob_max_abs_diff"] < 1 for r in train_rows)  # bfloat16's gap, measured


def test_the_tiny_twins_encoder_moves_and_casts_with_the_model():
    model = tiny_flow_model()
    model.to("meta")  # the byte encoder is a frozen part: a GPU run moves it with the transformer (it stayed behind)
    assert model.frozen[0].byte_table.device.type == "meta"
    model = tiny_flow_model().cast_frozen(torch.bfloat16)
    cond = model.encode(PROMPTS)
    assert model.frozen[0].byte_table.dtype == torch.bfloat16 and cond.prompt_embeds.dtype == torch.float32
    assert torch.isfinite(cond.pooled).all()
