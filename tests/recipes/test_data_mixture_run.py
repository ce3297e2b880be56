"""A 2-step run on a data.mixture of a reasoning-gym task and a JSONL file: every step trains on both datasets,
their rewards are logged apart, and the checkpoint stores each dataset's position."""

import json
import math

from miles.recipes.cli import resolve_config
from miles.recipes.run import run

# Scores each dataset its own way, as a mixed run's reward does: the sums by their entry, the facts by their label.
REWARD_MODULE = """
def per_dataset(sample):
    if sample.metadata["dataset"] == "sums":
        return 1.0 if sample.label["answer"] in (sample.response_text or "") else 0.0
    return 0.5 + 0.5 * float(sample.label in (sample.response_text or ""))
"""


def test_a_two_dataset_mixture_trains_two_steps_and_logs_each_datasets_reward(tiny_smollm2_dir, tmp_path, monkeypatch):
    facts = tmp_path / "facts.jsonl"
    facts.write_text("".join(json.dumps({"q": f"What is fact {i}?", "a": f"fact{i}"}) + "\n" for i in range(6)))
    (tmp_path / "mixture_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    mixture = (
        "[{name: sums, weight: 1, task: basic_arithmetic, size: 16, task_kwargs: {min_terms: 2, max_terms: 2, "
        "min_digits: 1, max_digits: 1, operators: ['+']}}, "
        f"{{name: facts, weight: 1, source: file, path: {facts}, prompt_key: q, label_key: a}}]"
    )
    overrides = [
        "--models.policy.path", str(tiny_smollm2_dir),
        "--data.task-kwargs", "{}", "--data.prompt-suffix", "",  # the recipe's single source, replaced
        "--data.mixture", mixture,
        "--reward.type", "custom", "--reward.path", "mixture_reward:per_dataset",
        "--loop.num-steps", "2",
        "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "4",
        "--rollout.sampling.max-new-tokens", "6",
        "--eval.num-prompts", "2", "--eval.n-samples-per-prompt", "1", "--eval.sampling.max-new-tokens", "6",
        "--train.micro-batch-size", "8",
        "--run.progress", "false",
    ]  # fmt: skip
    result = run(resolve_config("smollm2_grpo_arithmetic", overrides), tmp_path / "run")

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for row in train_rows:  # weights 1:1, 2 prompts a step: one of each
        assert math.isfinite(row["loss"]), row
        assert 0.0 <= row["reward/mean/sums"] <= 1.0 and 0.5 <= row["reward/mean/facts"] <= 1.0, row
        assert row["reward/mean"] == (row["reward/mean/sums"] + row["reward/mean/facts"]) / 2, row
    state = json.loads((result.checkpoint / "run_state.json").read_text())["data_source"]
    assert {name: entry["served"] for name, entry in state["datasets"].items()} == {"sums": 2, "facts": 2}
