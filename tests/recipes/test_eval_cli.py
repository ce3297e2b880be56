"""Named eval sets with their own data and sampling, pass@k in the run's records, and `miles eval` on a checkpoint,
on a tiny model with a reward whose pass counts are known: of a prompt's 2 samples exactly one (the even sample
index) passes, so pass@1 = 1/2 and pass@2 = 1 on every set."""

import json
import textwrap

import pytest
from miles.recipes.cli import main, resolve_config
from miles.recipes.run import run

EVEN_SAMPLE = "def reward(sample):\n    return float(sample.index % 2 == 0)\n"


@pytest.fixture
def flags(tiny_smollm2_dir, tmp_path, monkeypatch):
    (tmp_path / "even_sample.py").write_text(EVEN_SAMPLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return [
        "--models.policy.path", str(tiny_smollm2_dir),
        "--loop.num-steps", "1",
        "--rollout.rollout-batch-size", "2",
        "--rollout.n-samples-per-prompt", "2",
        "--rollout.sampling.max-new-tokens", "4",
        "--train.micro-batch-size", "8",
        "--run.progress", "false",
        "--reward.type", "custom", "--reward.path", "even_sample:reward",
        "--eval.num-prompts", "2",
        "--eval.n-samples-per-prompt", "2",
        "--eval.pass-k", "[1, 2]",
        "--eval.sampling.max-new-tokens", "4",
        "--eval.sets", "[{name: chain, num_prompts: 3, n_samples_per_prompt: 2, pass_k: [2], "
        "data: {task: chain_sum, task_kwargs: {}}, sampling: {max_new_tokens: 3}}]",
    ]  # fmt: skip


def test_eval_sets_report_their_own_pass_at_k_in_the_run_and_from_a_checkpoint(flags, tmp_path, capsys):
    cfg = resolve_config("smollm2_grpo_arithmetic", flags)
    result = run(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 1]
    for row in evals:
        assert (row["eval/pass@1"], row["eval/pass@2"], row["eval/reward"]) == (0.5, 1.0, 0.5)
        assert (row["eval/chain/pass@2"], row["eval/chain/reward"]) == (1.0, 0.5)
        assert "eval/chain/pass@1" not in row
        assert row["eval/chain/response_length"] <= 3.0  # the set's own sampling

    out = tmp_path / "eval.json"
    code = main(["eval", "--checkpoint", str(result.checkpoint), "--out", str(out), "--run.progress", "false"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["model"] == str(result.checkpoint / "model")
    assert (printed["eval/pass@1"], printed["eval/pass@2"], printed["eval/chain/pass@2"]) == (0.5, 1.0, 1.0)
    assert "eval/weight_version" not in printed  # nothing was published: an evaluation alone


def test_bad_eval_input_is_one_line_naming_the_key(flags, tmp_path, capsys):
    bad_set = textwrap.dedent("[{name: chain, data: {tsk: chain_sum}}]")
    assert main(["config", "show", "--eval.sets", bad_set]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("miles: ") and "eval.sets[0].data.tsk" in err and "\n" not in err
    assert main(["eval", "--checkpoint", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint" in err and "no model/config.json there" in err
    assert main(["eval", *flags, "--eval.num-prompts", "0", "--eval.sets", "[]"]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
