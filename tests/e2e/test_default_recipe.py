"""End to end: `miles train` on the default recipe with the real SmolLM2-135M-Instruct, 2 small steps."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from servers import SMALL_RUN


@pytest.mark.e2e
def test_two_steps_of_the_default_recipe_write_a_complete_run_directory(smollm2_dir, tmp_path):
    overrides = [*SMALL_RUN, "--run.dir", str(tmp_path), "--run.name", "e2e", "--run.tensorboard", "true"]
    overrides += ["--run.wandb", "on"]  # offline: no network; W&B's own folders kept under tmp_path
    cmd = [sys.executable, "-m", "miles.recipes.cli", "train", "--recipe", "smollm2_grpo_arithmetic", *overrides]
    wandb_env = {var: str(tmp_path / var.lower()) for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **wandb_env})
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "e2e"

    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["loop"]["num_steps"] == 2 and config["data"]["task"] == "basic_arithmetic"

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/reward" in rows[0] and "eval/reward" in rows[2]
    for key in (
        "reward/mean", "reward/std", "response_length/mean", "truncated_ratio", "loss", "entropy", "pg_clipfrac",
        "grad_norm", "train_rollout_logprob_abs_diff", "time/rollout", "time/train", "time/sync",
        "throughput/rollout_tokens_per_s", "weight_version",
    ):  # fmt: skip
        assert key in rows[1], key
    assert [r["weight_version"] for r in rows[1:]] == [1.0, 2.0]
    assert 0.0 <= rows[1]["reward/mean"] <= 1.0
    # Step 2 was sampled with the weights pushed after step 1 (tied LM head sent once): engine and trainer agree.
    assert rows[2]["train_rollout_logprob_abs_diff"] < 1e-4
    assert rows[2]["train_rollout_logprob_abs_diff"] <= rows[2]["train_rollout_logprob_abs_diff_max"] < 1e-3
    assert all(r["sync/probe_logprob_max_abs_diff"] < 1e-4 for r in rows[1:])  # each update probed

    checkpoint = run / "checkpoints" / "step_2"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 2
    assert json.loads((checkpoint / "run_state.json").read_text())["data_source"]["num_prompts"] == 4
    assert "optimizer" in torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert (run / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_id = (run / "wandb_run_id").read_text().strip()  # the values read back: tests/recipes/test_sinks.py
    assert len(list((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))) == 1
    # The same scalars in TensorBoard's event files, read back with TensorBoard's own reader (float32 there).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for key in ("reward/mean", "loss", "grad_norm", "eval/reward"):
        logged = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        read = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in read] == [s for s, _ in logged] and all(
            abs(a - b) <= 1e-6 * max(1.0, abs(b)) for (_, a), (_, b) in zip(read, logged)
        ), key

    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert json.loads((checkpoint / "model" / "config.json").read_text())["use_cache"] is True
    assert (checkpoint / "model" / "generation_config.json").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert (checkpoint / "model" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # not 0600
    trained = AutoModelForCausalLM.from_pretrained(checkpoint / "model", dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(checkpoint / "model").chat_template
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    trained_state, base_state = trained.state_dict(), base.state_dict()
    assert trained_state.keys() == base_state.keys()
    assert torch.equal(trained_state["lm_head.weight"], trained_state["model.embed_tokens.weight"])  # still tied
    if rows[1]["grad_norm"] > 0 or rows[2]["grad_norm"] > 0:
        assert any(not torch.equal(trained_state[k], base_state[k]) for k in base_state)
