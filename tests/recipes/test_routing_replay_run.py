"""`miles train --engine.routed-experts true` end to end on a tiny Qwen3-MoE (and DeepSeek-V3 on Megatron): the
embedded engine records each token's experts, the trainer replays them, and engine and trainer log-probs agree after
every weight push."""

import json

import pytest
from miles.recipes.cli import resolve_config
from miles.recipes.run import RunSetupError, run
from moe_models import save_moe_model
from tiny_runs import TINY_RUN_PATH, tiny_run

OVERRIDES = [*tiny_run(data_size=16, num_steps=2), "--engine.routed-experts", "true"]


@pytest.fixture(scope="module")
def moe_smollm2_dirs(tmp_path_factory):
    """family -> the tiny MoE model of that family sized for SmolLM2's tokenizer (saved once per module)."""
    from miles.recipes.models.smollm2 import ensure_smollm2
    from transformers import AutoTokenizer

    tokenizer, saved = AutoTokenizer.from_pretrained(ensure_smollm2()), {}

    def get(family: str):
        if family not in saved:
            saved[family] = save_moe_model(family, tmp_path_factory.mktemp(f"tiny_{family}"), tokenizer=tokenizer)
        return saved[family]

    return get


@pytest.fixture(scope="module")
def moe_smollm2_dir(moe_smollm2_dirs):
    return moe_smollm2_dirs("qwen3_moe")


@pytest.mark.parametrize(
    ("backend", "family"), [("fsdp2", "qwen3_moe"), ("megatron", "qwen3_moe"), ("megatron", "deepseek_v3")]
)
def test_routed_run_replays_the_engines_experts(moe_smollm2_dirs, tmp_path, monkeypatch, backend, family):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    args = ["--models.policy.path", str(moe_smollm2_dirs(family)), *OVERRIDES, "--train.backend", backend]
    cfg = resolve_config("smollm2_grpo_arithmetic", args)
    assert cfg.engine.routed_experts
    run(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 for r in rows)
    # step 2 samples with the weights pushed after step 1; the replayed trainer agrees to fp32 rounding
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in rows), rows
    assert all(r["samples/failed"] == 0 for r in rows)  # every answer carried routing of the right shape


def test_routed_experts_with_a_dense_model_fails_in_one_line(tiny_smollm2_dir, tmp_path):
    cfg = resolve_config("smollm2_grpo_arithmetic", ["--models.policy.path", str(tiny_smollm2_dir), *OVERRIDES])
    with pytest.raises(RunSetupError, match=r"engine.routed_experts is true but models.policy.path \(.*\) has no MoE"):
        run(cfg, tmp_path)  # at setup, from config.json, before any model loads
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.integration
def test_routed_run_through_a_miles_serve_server_replays_its_experts(moe_smollm2_dir, tmp_path, monkeypatch):
    """The same run with the engine a `miles serve` server Miles starts (SGLang's API: return_routed_experts, weights
    pushed over gloo), read by the SGLang client."""
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    server = ["--engine.type", "sglang", "--engine.server", "miles", "--engine.num-servers", "1"]
    cfg = resolve_config("smollm2_grpo_arithmetic", ["--models.policy.path", str(moe_smollm2_dir), *OVERRIDES, *server])
    run(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in rows), rows
    assert all(r["samples/failed"] == 0 for r in rows)  # every answer carried routing of the right shape


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_int4_rollout_of_an_moe_model_matches_megatron_with_int4_qat(moe_smollm2_dirs, tmp_path, monkeypatch, family):
    """An int4 engine (experts included) with R3 and `--train.qat int4` on Megatron: the trainer computes with the
    engine's weights, so the int4 mismatch is gone (and the FSDP2 backend, which cannot fake-quantize fused expert
    tensors, is not needed)."""
    pytest.importorskip("megatron.core")
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    args = ["--models.policy.path", str(moe_smollm2_dirs(family)), *OVERRIDES, "--train.backend", "megatron",
            "--engine.weight-codec", "int4", "--train.qat", "int4"]  # fmt: skip
    run(resolve_config("smollm2_grpo_arithmetic", args), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)
    # as exact weights (< 1e-4 above); int4 without QAT is off by ~1e-3 and more on these models (test_megatron_qat)
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in rows), rows
