"""`engine.delta_weights` in `miles train`: the same run with delta weight updates trains exactly as with full ones
(the engine holds the trainer's weights bit for bit), and reports the bytes each update moved."""

import json

import pytest
from miles.recipes.cli import main

pytestmark = pytest.mark.integration


def _run(model_dir, run_dir, name, *extra):
    args = [
        "--models.policy.path", str(model_dir), "--data.size", "8",
        "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "4",
        "--rollout.sampling.max-new-tokens", "4", "--train.lr", "1e-4", "--eval.num-prompts", "0",
        "--loop.num-steps", "3", "--run.dir", str(run_dir), "--run.name", name, "--run.progress", "false",
        "--run.num-threads", "1", *extra,
    ]  # fmt: skip
    assert main(["train", *args]) == 0
    return [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]


def test_delta_weight_updates_train_exactly_as_full_ones_and_report_the_bytes_sent(tiny_smollm2_dir, tmp_path):
    full = _run(tiny_smollm2_dir, tmp_path, "full")
    delta = _run(tiny_smollm2_dir, tmp_path, "delta", "--engine.delta-weights", "true")
    assert [r["step"] for r in delta] == [1, 2, 3]
    for key in ("loss", "reward/mean", "grad_norm", "train_rollout_logprob_abs_diff"):
        assert [r[key] for r in delta] == [r[key] for r in full], key  # rollouts sampled from identical weights
    assert not any(key.startswith("sync/sent") for key in full[0])
    # Every update was probed: the engine samples with the trainer's weights (fp32: agreement to rounding).
    assert all(r["sync/probe_logprob_max_abs_diff"] < 1e-4 for r in full + delta)
    assert delta[0]["sync/sent_fraction"] == 1.0  # the first update has no base: in full
    for row in delta[1:]:  # an Adam step at lr 1e-4 changes fp32 weights' low mantissa bits only
        assert 0.0 < row["sync/sent_fraction"] < 0.9, row["sync/sent_fraction"]
        assert row["sync/sent_mib"] == pytest.approx(row["sync/sent_fraction"] * delta[0]["sync/sent_mib"])
