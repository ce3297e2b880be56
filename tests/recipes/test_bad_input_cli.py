"""A user's mistake in data or plugins ends `miles train` with one `miles:` line and exit status 2, before any
model loads and without writing anything into the run directory."""

import json
import logging

import pytest
from miles.recipes.cli import main, resolve_config
from miles.recipes.run import build_inputs

GOOD = json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"})

WRONG_SIGNATURE = """
def two_args(sample, extra):
    return 1.0
"""


def _args(model_dir, run_dir, data_file, *extra):
    return [
        "--model.path", str(model_dir),
        "--data.source", "file", "--data.path", str(data_file), "--reward.type", "math",
        "--eval.num-prompts", "1",
        "--run.dir", str(run_dir), "--run.name", "bad", "--run.progress", "false", *extra,
    ]  # fmt: skip


CASES = [
    pytest.param(
        GOOD + '\n{"question": "2 + 2?", "answer": "#### 4"\n' + GOOD,  # line 2 has 41 characters: "," expected at 42
        [],
        "has 1 bad row (data.bad_rows is 'stop'): data.jsonl:2:42: not JSON (Expecting ',' delimiter at column 42).",
        id="malformed_row",
    ),
    pytest.param(
        GOOD + "\n" + json.dumps({"question": " ", "answer": "#### 1"}) + "\n" + GOOD,
        [],
        "data.jsonl:2: 'question' is an empty string. Fix the rows",
        id="empty_prompt",
    ),
    pytest.param("", [], "has no usable row (the file is empty or blank); point --data.path", id="empty_file"),
    pytest.param(
        GOOD + "\n" + GOOD,
        ["--reward.type", "custom", "--reward.path", "no_such_module:score"],
        "reward.path: cannot import module 'no_such_module' (No module named 'no_such_module'); is it on PYTHONPATH?",
        id="reward_module_missing",
    ),
    pytest.param(
        GOOD + "\n" + GOOD,
        ["--reward.type", "custom", "--reward.path", "bad_reward:nope"],
        "reward.path: module 'bad_reward' has no attribute 'nope'",
        id="reward_attr_missing",
    ),
    pytest.param(
        GOOD + "\n" + GOOD,
        ["--reward.type", "custom", "--reward.path", "bad_reward:two_args"],
        "reward.path: 'bad_reward:two_args' must accept 1 positional argument(s)",
        id="reward_wrong_signature",
    ),
]


@pytest.mark.parametrize("content, extra, message", CASES)
def test_bad_data_or_reward_plugin_is_one_line_exit_2_and_writes_nothing(
    tiny_llama_dir, tmp_path, monkeypatch, capsys, content, extra, message
):
    (tmp_path / "bad_reward.py").write_text(WRONG_SIGNATURE)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    runs = tmp_path / "runs"
    assert main(["train", *_args(tiny_llama_dir, runs, data, *extra)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("miles: "), err
    assert message in err
    assert not runs.exists()  # nothing written: no config.yaml, no log, no metrics


def test_a_skip_warning_is_logged_once_although_train_and_eval_prompts_come_from_the_file(
    tiny_llama_dir, tmp_path, caplog
):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([GOOD, "\x1c", GOOD, GOOD]))
    cfg = resolve_config("smollm2_grpo_arithmetic", _args(tiny_llama_dir, tmp_path, data, "--data.bad-rows", "skip"))
    with caplog.at_level(logging.WARNING):
        _, source, eval_prompts = build_inputs(cfg)
    skipped = [r for r in caplog.records if "skipped 1 of 4 rows" in r.getMessage()]
    assert len(skipped) == 1
    assert (source.size, len(eval_prompts)) == (2, 1)  # one good row held out for eval, never trained on


def test_an_eval_file_is_used_for_eval_prompts(tiny_llama_dir, tmp_path):
    data, eval_data = tmp_path / "data.jsonl", tmp_path / "eval.jsonl"
    data.write_text("\n".join([GOOD] * 3))
    eval_data.write_text(json.dumps({"question": "held out?", "answer": "#### 7"}))
    cfg = resolve_config(
        "smollm2_grpo_arithmetic", _args(tiny_llama_dir, tmp_path, data, "--data.eval-path", str(eval_data))
    )
    _, source, eval_prompts = build_inputs(cfg)
    assert source.size == 3
    assert [p.label for p in eval_prompts] == ["#### 7"]


def test_train_help_lists_common_options_and_points_to_config_show(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--loop.num-steps", "--rollout.n-samples-per-prompt", "--train.lr", "--resume", "--overwrite"):
        assert option in out
    assert "miles config show RECIPE" in out
