"""A user's mistake in data, model paths or plugins ends `miles train` with one `miles:` line and exit status 2,
before any model loads and without writing anything into the run directory. These are build-time checks:
validating the config reads no file, so each such config validates and fails in ``build_inputs``."""

import json
import logging

import pytest
from miles.recipes.cli import main, resolve_config
from miles.recipes.run import RunSetupError, build_inputs

GOOD = json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"})

WRONG_SIGNATURE = """
def two_args(sample, extra):
    return 1.0


def keep(group):
    return True
"""


def _args(model_dir, run_dir, data_file, *extra):
    return [
        "--models.policy.path", str(model_dir),
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
    pytest.param(
        GOOD + "\n" + GOOD,
        ["--models.policy.path", "/no/such/model"],
        "models.policy.path is '/no/such/model': not a registered model ['smollm2-135m-instruct'] and not a "
        "directory with config.json. Pass --models.policy.path smollm2-135m-instruct or a local HF model directory.",
        id="missing_model_path",
    ),
    pytest.param(
        GOOD + "\n" + GOOD,
        ["--data.path", "no/such.jsonl"],
        "data.path is 'no/such.jsonl', which does not exist",
        id="missing_data_file",
    ),
    pytest.param(
        GOOD + "\n" + GOOD,
        ["--algorithm.loss.policy-loss-path", "no_such_plugins:loss"],
        "algorithm.loss.policy_loss_path: cannot import module 'no_such_plugins'",
        id="loss_plugin_missing",
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


@pytest.mark.parametrize(
    "extra, message",
    [
        pytest.param(
            ["--algorithm.kl.coef", "0.1", "--models.reference.path", "/no/ref"],
            "models.reference.path is '/no/ref': not a registered model",
            id="reference_path",
        ),
        pytest.param(
            ["--algorithm.advantage.estimator", "opd", "--models.teacher.path", "/no/teacher"],
            "models.teacher.path is '/no/teacher': not a registered model",
            id="teacher_path",
        ),
        pytest.param(
            ["--algorithm.advantage.estimator", "gae", "--models.critic.path", "/no/critic"],
            "models.critic.path is '/no/critic': not a registered model",
            id="critic_path",
        ),
        pytest.param(
            ["--algorithm.dynamic-sampling.filter-path", "bad_reward:two_args"],
            "algorithm.dynamic_sampling.filter_path: 'bad_reward:two_args' must accept 1 positional argument(s)",
            id="filter_plugin_signature",
        ),
        pytest.param(
            ["--algorithm.reward-post-process-path", "bad_reward:nope"],
            "algorithm.reward_post_process_path: module 'bad_reward' has no attribute 'nope'",
            id="post_process_plugin_attr",
        ),
        pytest.param(
            ["--algorithm.advantage.estimator-path", "bad_reward:keep"],
            "algorithm.advantage.estimator_path: 'bad_reward:keep' must accept 2 positional argument(s)",
            id="estimator_plugin_signature",
        ),
        pytest.param(
            ["--data.eval-path", "no/eval.jsonl"],
            "data.eval_path is 'no/eval.jsonl', which does not exist",
            id="eval_file",
        ),
    ],
)
def test_missing_models_files_and_bad_plugins_validate_and_fail_at_build_naming_the_key(
    tiny_llama_dir, tmp_path, monkeypatch, extra, message
):
    (tmp_path / "bad_reward.py").write_text(WRONG_SIGNATURE)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_text(GOOD + "\n" + GOOD)
    cfg = resolve_config("smollm2_grpo_arithmetic", _args(tiny_llama_dir, tmp_path / "runs", data, *extra))  # pure
    with pytest.raises(RunSetupError) as err:
        build_inputs(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_group_generate_factory_that_refuses_to_build_is_one_line_and_writes_nothing(
    tiny_smollm2_dir, tmp_path, monkeypatch, capsys
):
    # Its build ran after the run directory was created, which then held a config and a log of a run that never ran.
    (tmp_path / "refusing_factory.py").write_text(
        "def build(context):\n    raise ValueError('this tokenizer has no chat template; pick a chat model')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_text(GOOD + "\n" + GOOD)
    runs = tmp_path / "runs"
    extra = ["--rollout.generate-path", "refusing_factory:build"]
    assert main(["train", *_args(tiny_smollm2_dir, runs, data, *extra)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err == "miles: this tokenizer has no chat template; pick a chat model\n", err
    assert not runs.exists()
