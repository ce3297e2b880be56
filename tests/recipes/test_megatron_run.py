"""`miles train --train.backend megatron` end to end on a tiny model: the default job's loop on the Megatron-core
backend (fp32, CPU), the engine following its pushes, a KL reference, and an exact resume."""

import json

import pytest
import torch
import yaml
from miles.recipes.cli import resolve_config
from miles.recipes.run import RunSetupError, run
from moe_models import save_moe_model
from tiny_runs import TINY_RUN_PATH, tiny_run

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="train.backend megatron trains on the CPU only")

OVERRIDES = [
    *tiny_run(data_size=32, num_steps=3),
    "--loop.save-interval", "2",
    "--train.backend", "megatron",
    "--train.dtype", "auto",
    "--algorithm.kl.coef", "0.1",
]  # fmt: skip


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


LORA = ["--train.lora.rank", "4", "--train.lora.alpha", "8"]


@pytest.mark.parametrize("lora", [None, "merged", "adapter"], ids=["full", "lora", "lora_adapter_sync"])
def test_megatron_run_trains_the_engine_follows_and_resume_is_exact(tiny_smollm2_dir, tmp_path, monkeypatch, lora):
    """With LoRA: adapters on the fused linears, merged pushes or HF adapters the engine applies, the reference is
    the policy with its adapters off, and the checkpoint's adapter/ resumes them."""
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    args = ["--models.policy.path", str(tiny_smollm2_dir), *OVERRIDES]
    args += [*LORA, "--train.lora.sync", lora] if lora else []
    cfg = resolve_config("smollm2_grpo_arithmetic", args)
    result = run(cfg, tmp_path / "whole")
    assert result.steps_done == 3
    rows = _rows(tmp_path / "whole")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in rows)
    # Steps 2 and 3 sample with the weights Megatron pushed after steps 1 and 2 (fused q/k/v and gate/up split back
    # into HF's tensors, the tied embedding once): engine and trainer agree to fp32 rounding.
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in rows), rows
    assert rows[-1]["loss/kl"] > 0  # the reference (a frozen Megatron copy, or the adapters off) differs
    config = yaml.safe_load((tmp_path / "whole" / "config.yaml").read_text())
    assert config["train"]["backend"] == "megatron" and config["train"]["dtype"] == "fp32"  # auto -> fp32, logged
    assert "train.dtype auto -> fp32: train.backend megatron" in (tmp_path / "whole" / "train.log").read_text()
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_2"
    assert (checkpoint / "optimizer" / "tp0_ep0.pt").is_file()
    assert (checkpoint / "model" / "model.safetensors").is_file()
    assert (checkpoint / "adapter" / "megatron_adapters.safetensors").is_file() == bool(lora)

    # Stop after step 2, resume: step 3 equals the uninterrupted run's.
    run(resolve_config("smollm2_grpo_arithmetic", [*args, "--loop.num-steps", "2"]), tmp_path / "cut")
    run(cfg, tmp_path / "cut", resume_from=tmp_path / "cut" / "checkpoints" / "step_2")
    resumed = _rows(tmp_path / "cut")
    assert resumed[-1]["step"] == 3
    for key in ("loss", "grad_norm", "reward/mean", "loss/kl"):
        assert resumed[-1][key] == rows[-1][key], key


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--train.lora.dropout", "0.1"],
            "does not support train.lora.dropout > 0 yet: use --train.lora.dropout 0",
        ),
        (
            ["--train.lora.target-modules", '["q_proj", "v_proj"]'],
            r"lists \['q_proj', 'v_proj'\] of \['q_proj', 'k_proj', 'v_proj'\]: Megatron fuses them",
        ),
        (["--train.dtype", "bf16"], "does not support train.dtype bf16 yet"),
        (
            ["--train.megatron.tensor-parallel-size", "2"],
            "tensor_parallel_size is 2, expert_parallel_size 1 and pipeline_parallel_size 1 but train.world_size is 1",
        ),
        (
            ["--train.megatron.pipeline-parallel-size", "2"],
            r"pipeline_parallel_size 2 but train.world_size is 1: .* set --train.world-size to a multiple of 2 "
            r"\(several ranks run as Ray actors: --execution.mode ray\)",
        ),
        (
            ["--train.megatron.pipeline-parallel-size", "2", "--train.megatron.expert-parallel-size", "2"],
            r"expert_parallel_size 2 and pipeline_parallel_size 2 but train.world_size is 1: .* a stage's replicas "
            r"split its experts expert_parallel_size ways; set --train.world-size to a multiple of 4",
        ),
        (
            ["--train.megatron.context-parallel-size", "2"],
            r"context_parallel_size is 2 \(tensor_parallel_size 1, pipeline_parallel_size 1\) but train.world_size "
            r"is 1: .* set --train.world-size to a multiple of 2",
        ),
        (
            ["--train.megatron.context-parallel-size", "2", "--train.megatron.pipeline-parallel-size", "2"],
            r"context_parallel_size 2 with train.megatron.pipeline_parallel_size 2 is not supported yet",
        ),
        (
            ["--train.megatron.context-parallel-size", "2", "--train.megatron.tensor-parallel-size", "2"],
            r"context_parallel_size 2 with train.megatron.tensor_parallel_size 2 is not supported yet",
        ),
        (  # FSDP2 would ignore the layout without a word
            ["--train.backend", "fsdp2", "--train.megatron.pipeline-parallel-size", "2"],
            r"train.megatron.pipeline_parallel_size is 2 but train.backend is 'fsdp2', which does not read "
            r"train.megatron",
        ),
        (
            ["--train.world-size", "2"],
            "Set --execution.mode ray to run 2 Megatron ranks as Ray actors",
        ),
    ],
)
def test_what_megatron_does_not_hold_yet_is_refused_before_any_model_loads(tiny_smollm2_dir, extra, message):
    with pytest.raises(ValueError, match=message):
        resolve_config("smollm2_grpo_arithmetic", ["--models.policy.path", str(tiny_smollm2_dir), *OVERRIDES, *extra])


@pytest.mark.parametrize(
    ("model_type", "extra", "message"),
    [
        ("glm_moe_dsa", [], r"models.policy.path \(.*\): .*model type 'glm_moe_dsa' has no Megatron"),
        ("qwen3_moe", LORA, r"is an MoE model: train.backend megatron does not support train.lora on MoE models"),
    ],
)
def test_a_model_megatron_cannot_train_is_refused_before_any_engine_starts(
    tmp_path, monkeypatch, model_type, extra, message
):
    monkeypatch.syspath_prepend(TINY_RUN_PATH)  # the reward plugin (imported before the model check)
    model = save_moe_model(model_type, tmp_path / model_type)
    cfg = resolve_config("smollm2_grpo_arithmetic", ["--models.policy.path", str(model), *OVERRIDES, *extra])
    with pytest.raises(RunSetupError, match=message):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_context_parallelism_refuses_an_moe_policy_before_any_engine_starts(tmp_path):
    """CP 2 on 2 Ray ranks passes the config checks; the model check refuses an MoE policy (dense models only)."""
    from miles.recipes.run import _check_megatron_models

    model = save_moe_model("qwen3_moe", tmp_path / "qwen3_moe")
    ranks = [
        "--execution.mode",
        "ray",
        "--engine.type",
        "sglang",
        "--engine.server",
        "miles",
        "--train.world-size",
        "2",
    ]
    ranks += ["--train.megatron.context-parallel-size", "2"]
    cfg = resolve_config("smollm2_grpo_arithmetic", ["--models.policy.path", str(model), *OVERRIDES, *ranks])
    with pytest.raises(RunSetupError, match=r"models.policy.path \(.*\): train.megatron.context_parallel_size 2: "):
        _check_megatron_models(cfg, model)
