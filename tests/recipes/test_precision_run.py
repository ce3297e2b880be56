"""Precision end to end on a tiny model: `--engine.weight-codec C [--train.qat C]` (a quantized rollout costs a
train / rollout log-prob mismatch, and QAT with the same codec removes it: the trainer computes with the engine's
weights) and `--train.dtype fp16` (dynamic loss scaling)."""

import json

import pytest
from miles.recipes.cli import resolve_config
from miles.recipes.run import run
from tiny_runs import TINY_RUN_PATH, tiny_run

OVERRIDES = [*tiny_run(data_size=32, num_steps=2), "--engine.weight-codec", "int4"]


def _train_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_int4_rollout_mismatch_is_removed_by_int4_qat(tiny_smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    base = ["--models.policy.path", str(tiny_smollm2_dir), *OVERRIDES]
    run(resolve_config("smollm2_grpo_arithmetic", base), tmp_path / "plain")
    run(resolve_config("smollm2_grpo_arithmetic", [*base, "--train.qat", "int4"]), tmp_path / "qat")
    plain, qat = _train_rows(tmp_path / "plain"), _train_rows(tmp_path / "qat")
    assert [r["step"] for r in qat] == [1, 2]
    # Measured here: int4 weights without QAT 2.8e-3 to 7.6e-3 nats per token on this random model; with QAT the
    # two sides compute with the same weights and agree to fp32 rounding (~2e-8), as with exact weights.
    assert all(r["train_rollout_logprob_abs_diff"] > 1e-3 for r in plain), plain
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-6 for r in qat), qat
    assert all(r["sync/probe_logprob_max_abs_diff"] < 1e-5 for r in qat), qat  # after each push too
    assert all(r["grad_norm"] > 0 for r in qat)  # gradients pass through the fake quantization
    config = (tmp_path / "qat" / "config.yaml").read_text()
    assert "qat: int4" in config and "weight_codec: int4" in config


def test_fp16_training_and_rollout_run_with_a_loss_scale(tiny_smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    overrides = [*tiny_run(data_size=32, num_steps=2), "--train.dtype", "fp16", "--engine.dtype", "fp16"]
    run(
        resolve_config("smollm2_grpo_arithmetic", ["--models.policy.path", str(tiny_smollm2_dir), *overrides]), tmp_path
    )
    rows = _train_rows(tmp_path)
    assert [r["loss_scale"] for r in rows] == [2.0**16, 2.0**16]  # no overflow on this model: the scale holds
    assert all(r["grad_norm"] > 0 and r["skipped_steps"] == 0 for r in rows)
    # both sides fp16: measured 1.8e-5 to 3.7e-5 nats per token here (fp32: ~2e-8)
    assert all(1e-7 < r["train_rollout_logprob_abs_diff"] < 1e-3 for r in rows), rows


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--train.qat", "int4"], "train.qat is 'int4' but engine.weight_codec is 'identity'.*drop --train.qat"),
        (
            ["--train.qat", "int4", "--engine.weight-codec", "fp8"],
            "train.qat is 'int4' but engine.weight_codec is 'fp8'.*--engine.weight-codec int4, or --train.qat fp8",
        ),
        (["--train.qat", "fp8", "--engine.type", "vllm"], "engine.type vllm has no weight_codec"),
        (
            ["--train.qat", "int4", "--engine.weight-codec", "int4", "--train.lora.rank", "4"],
            "train.qat is 'int4' with train.lora on",
        ),
        (
            ["--train.qat", "fp8", "--engine.weight-codec", "fp8", "--train.backend", "megatron"],
            "train.qat fp8 on train.backend megatron: fp8's blocks span rows .* use --train.qat int4 or mxfp8",
        ),
        (["--engine.weight-codec", "int3"], "weight_codec"),
        (["--train.dtype", "fp16", "--train.backend", "megatron"], "does not support train.dtype fp16 yet"),
    ],
)
def test_qat_that_cannot_match_the_engine_is_refused_in_one_line(tiny_smollm2_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_config("smollm2_grpo_arithmetic", ["--models.policy.path", str(tiny_smollm2_dir), *overrides])


def test_fp16_with_a_critic_is_refused_in_one_line(tiny_smollm2_dir):
    with pytest.raises(ValueError, match="train.dtype is 'fp16' with a critic"):
        resolve_config(
            "smollm2_ppo_arithmetic", ["--models.policy.path", str(tiny_smollm2_dir), "--train.dtype", "fp16"]
        )


def test_the_weight_probe_reports_only_for_quantized_weights_without_qat(tiny_smollm2_dir):
    from miles.recipes.run import build_probe
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_smollm2_dir)
    base = ["--models.policy.path", str(tiny_smollm2_dir), "--engine.weight-codec", "fp8"]
    plain = build_probe(resolve_config("smollm2_grpo_arithmetic", base), tokenizer)
    qat = build_probe(resolve_config("smollm2_grpo_arithmetic", [*base, "--train.qat", "fp8"]), tokenizer)
    explicit = build_probe(
        resolve_config("smollm2_grpo_arithmetic", [*base, "--engine.probe.max-abs-diff", "2"]), tokenizer
    )
    assert (plain.max_abs_diff, qat.max_abs_diff, explicit.max_abs_diff) == (None, 0.1, 2.0)


def test_qat_on_fused_moe_experts_is_one_line_before_any_model_loads(tmp_path):
    # Regression (new-user trial): the MoE twin's fused expert tensors ended the run in a traceback from the trainer.
    from miles.recipes.run import RunSetupError

    cfg = resolve_config(
        "qwen3_30b_a3b_grpo_gsm8k", ["--engine.weight-codec", "int4", "--train.qat", "int4"], tiny=True
    )
    with pytest.raises(RunSetupError, match=r"experts.gate_up_proj would be quantized .* Use a dense model"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing written
