"""`miles train --train.lora ...` end to end on a tiny model: the engine samples with the merged adapters (its
log-probs equal the trainer's), the KL reference is the adapter-disabled policy, and the run resumes exactly."""

import json

import pytest
from miles.recipes.cli import resolve_config
from miles.recipes.run import run
from tiny_runs import TINY_RUN_PATH, tiny_run

OVERRIDES = [
    *tiny_run(data_size=64, num_steps=3),
    "--loop.save-interval", "2",
    "--train.lora.rank", "4",
    "--train.lora.target-modules", '["q_proj", "v_proj"]',
    "--algorithm.kl.coef", "0.1",
]  # fmt: skip


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_lora_run_trains_adapters_the_engine_follows_and_resume_is_exact(tiny_smollm2_dir, tmp_path, monkeypatch, sync):
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    overrides = [*OVERRIDES, "--train.lora.sync", sync]
    cfg = resolve_config("smollm2_grpo_arithmetic", ["--models.policy.path", str(tiny_smollm2_dir), *overrides])
    assert cfg.train.lora.rank == 4 and cfg.train.lora.target_modules == ["q_proj", "v_proj"]
    run(cfg, tmp_path / "whole")
    rows = [r for r in _rows(tmp_path / "whole") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Steps 2 and 3 sample with the weights pushed after steps 1 and 2 (merged, or adapters the engine applies):
    # engine and trainer agree to fp32 rounding (a push of the base alone would leave ~grad-step-sized differences).
    assert all(r["grad_norm"] > 0 for r in rows)  # the adapters train
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in rows), rows
    assert rows[-1]["loss/kl"] > 0  # the reference (adapters off) differs from the trained policy
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_2"
    assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    assert (checkpoint / "model" / "model.safetensors").is_file()

    # Stop after step 2, resume: step 3 equals the uninterrupted run's.
    cut = resolve_config(
        "smollm2_grpo_arithmetic", ["--models.policy.path", str(tiny_smollm2_dir), *overrides, "--loop.num-steps", "2"]
    )
    run(cut, tmp_path / "cut")
    run(cfg, tmp_path / "cut", resume_from=tmp_path / "cut" / "checkpoints" / "step_2")
    resumed = [r for r in _rows(tmp_path / "cut") if "loss" in r]
    assert resumed[-1]["step"] == 3
    for key in ("loss", "grad_norm", "reward/mean", "loss/kl"):
        assert resumed[-1][key] == rows[-1][key], key


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (
            ["--engine.type", "sglang", "--loop.mode", "fully_async", "--loop.partial-rollout", "true"],
            "loop.partial_rollout is on with train.lora.sync adapter on SGLang servers",
        ),
        (
            ["--engine.type", "vllm", "--engine.delta-weights", "true"],
            "engine.delta_weights is on with train.lora.sync",
        ),
        (["--engine.type", "vllm", "--train.lora.rank", "600"], "train.lora.rank is 600 with train.lora.sync adapter"),
    ],
)
def test_adapter_sync_where_it_cannot_hold_is_refused_in_one_line(tiny_smollm2_dir, engine, message):
    with pytest.raises(ValueError, match=message):
        resolve_config(
            "smollm2_grpo_arithmetic",
            ["--models.policy.path", str(tiny_smollm2_dir), *OVERRIDES, "--train.lora.sync", "adapter", *engine],
        )


@pytest.mark.slow  # starts a miles serve process: ~1 min here
@pytest.mark.e2e
def test_adapter_sync_through_sglangs_api_into_miles_serve(tiny_smollm2_dir, tmp_path, monkeypatch):
    """engine.type sglang with miles serve: each version is loaded by name through /load_lora_adapter and
    requests name it (what ran is miles serve speaking SGLang's API, not SGLang)."""
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    overrides = [*OVERRIDES, "--loop.num-steps", "2", "--train.lora.sync", "adapter", "--engine.type", "sglang",
                 "--engine.server", "miles"]  # fmt: skip
    run(
        resolve_config("smollm2_grpo_arithmetic", ["--models.policy.path", str(tiny_smollm2_dir), *overrides]),
        tmp_path / "serve",
    )
    rows = [r for r in _rows(tmp_path / "serve") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in rows), rows  # step 2 sampled with v1's adapter
    log = next((tmp_path / "serve" / "servers").glob("*.log")).read_text()
    assert "loaded LoRA adapter miles-adapter-v1" in log and "loaded LoRA adapter miles-adapter-v2" in log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve"]  # the adapter versions went with the run
