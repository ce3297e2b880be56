"""A user's mistake in data, model paths or plugins ends `miles train` with one `miles:` line and exit status 2,
before any model loads and without writing anything into the run directory. These are build-time checks:
validating the config reads no file, so each such config validates and fails in ``build_inputs``."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from miles.recipes.cli import main, resolve_config
from miles.recipes.run import RunSetupError, build_inputs

# the registered models as the message lists them, written once here (adding a model edits this line)
REGISTERED = (
    "smollm2-135m-instruct, smollm2-vl, tiny-deepseek-v3, tiny-deepseek-v4, tiny-glm-5, tiny-kimi-k2.5, tiny-qwen3, "
    "tiny-qwen3-moe, tiny-qwen3-vl, tiny-qwen3.5, tiny-qwen3.5-moe, tiny-smolvlm"
)
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
        "reward.path: cannot import module 'no_such_module' (No module named 'no_such_module'); is it on PYTHONPATH "
        "or in the current directory (",
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
        f"models.policy.path is '/no/such/model': not a registered model ({REGISTERED}) and not a directory with "
        "config.json. Pass --models.policy.path smollm2-135m-instruct or a local HF model directory.",
        id="missing_model_path",
    ),
    pytest.param(
        GOOD + "\n" + GOOD,
        ["--models.policy.path", "Qwen/Qwen3-30B-A3B"],
        f"models.policy.path is 'Qwen/Qwen3-30B-A3B': not a registered model ({REGISTERED}) and not a directory "
        "with config.json. Miles does not download models: fetch Qwen/Qwen3-30B-A3B (e.g. `huggingface-cli download "
        "Qwen/Qwen3-30B-A3B --local-dir DIR`) and pass --models.policy.path DIR; on a CPU, a recipe with a tiny twin "
        "runs with --tiny.",
        id="hub_id_model_path",
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


def _config_key_exists(schema, dotted: str) -> bool:
    from miles.recipes.overrides import _section_members

    holders = [schema]
    *parents, leaf = dotted.split(".")
    for part in parents:
        holders = [
            m for h in holders if part in h.model_fields for m in _section_members(h.model_fields[part].annotation)
        ]
    return any(leaf in h.model_fields for h in holders)


def test_train_help_lists_diffusion_keys_that_are_real_keys_and_names_the_diffusion_recipes(capsys):
    import re

    from miles.recipes.cli import TRAIN_EPILOG
    from miles.recipes.config import MilesConfig
    from miles.recipes.diffusion import DiffusionConfig, is_diffusion
    from miles.recipes.registry import load_recipe, recipe_names

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for option in ("--model.resolution", "--algorithm.lora.rank", "--algorithm.lora.target-modules to_q,to_k"):
        assert option in out
    assert "every key of a diffusion recipe:      miles config show tiny_flow_grpo_compressibility" in out
    llm, diffusion = TRAIN_EPILOG.split("diffusion recipes (kind: diffusion")
    diffusion = diffusion.split("every key, its default")[0]
    for schema, text in ((MilesConfig, llm), (DiffusionConfig, diffusion)):
        keys = {k.replace("-", "_") for k in re.findall(r"--([a-z][a-z_-]*(?:\.[a-z_-]+)+)", text)} - {"section.key"}
        assert keys and [k for k in keys if not _config_key_exists(schema, k)] == []
    named = {n for n in recipe_names() if is_diffusion(load_recipe(n))}
    assert named and all(n in diffusion for n in named)


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


# A reward broken on every sample, the way REWARD_MODE says; "ok" is the fixed one.
ALL_FAIL_REWARD = """
import math, os, time

def score(sample):
    mode = os.environ["REWARD_MODE"]
    if mode == "raise":
        raise ValueError("scorer is down")
    if mode == "nan":
        return math.nan
    if mode == "hang":  # far past reward.timeout_s; bounded, so the abandoned threads end with the test session
        time.sleep(30)
    return float(sample.response_tokens[0] % 2)
"""


def _all_fail_args(model_dir, tmp_path, *extra):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([GOOD] * 4))
    return [
        "--models.policy.path", str(model_dir), "--data.source", "file", "--data.path", str(data),
        "--reward.type", "custom", "--reward.path", "all_fail_reward:score",
        "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "4",
        "--rollout.sampling.max-new-tokens", "3", "--train.micro-batch-size", "8",
        "--eval.num-prompts", "0", "--loop.num-steps", "1",
        "--run.dir", str(tmp_path), "--run.name", "broken", "--run.progress", "false", "--run.num-threads", "1", *extra,
    ]  # fmt: skip


def _all_failed_line(reason: str, fix: str) -> str:
    return f"step 1: all 8 samples failed (reward: reward.path 'all_fail_reward:score'); first reasons: {reason}. {fix}"


NO_STEP = "No step was completed, so the same command starts the run again"
FIX_REWARD = "Fix the reward function (call it on one sample in Python to see its error)"


@pytest.mark.integration
def test_a_step_where_every_reward_raises_is_one_line_exit_2_in_train_log_and_the_same_command_starts_again(
    tiny_smollm2_dir, tmp_path, monkeypatch, capsys
):
    """A real `miles train` process: no traceback (it was 31 lines of `[rank0]: Traceback`, exit 1), the line in
    train.log too, and once the reward is fixed the same command runs (it was refused: "already has a run")."""
    (tmp_path / "all_fail_reward.py").write_text(ALL_FAIL_REWARD)
    args = _all_fail_args(tiny_smollm2_dir, tmp_path)
    env = dict(os.environ, REWARD_MODE="raise")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "miles.recipes.cli", "train", *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    message = _all_failed_line("reward function raised ValueError: scorer is down", FIX_REWARD)
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == f"miles: {message}. {NO_STEP}"
    assert [line for line in lines if line.startswith("miles:")] == lines[-1:]
    run = tmp_path / "broken"
    assert f"ERROR miles.recipes.run: the run stopped: {message}\n" in (run / "train.log").read_text()
    assert not (run / "checkpoints").exists() and (run / "metrics.jsonl").read_text() == ""

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("REWARD_MODE", "ok")
    capsys.readouterr()
    assert main(["train", *args]) == 0  # the directory held no completed step: replaced, not refused
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    log = (run / "train.log").read_text()
    assert "all 8 samples failed" not in log and "pushed weights v1" in log


@pytest.mark.integration
@pytest.mark.parametrize(
    "mode, extra, reason, fix",
    [
        pytest.param("nan", [], "reward function returned nan", FIX_REWARD, id="nan"),
        pytest.param(
            "hang",
            ["--reward.timeout-s", "0.25"],  # 8 calls x 0.25 s, each abandoned in its thread
            "reward function raised RewardTimeoutError: reward function did not return within reward.timeout_s=0.25s",
            "Make the reward function return within reward.timeout_s (0.25 s), or raise --reward.timeout-s",
            id="hangs",
        ),
    ],
)
def test_a_step_where_every_reward_is_nan_or_times_out_is_one_line_exit_2_naming_the_reward(
    tiny_smollm2_dir, tmp_path, monkeypatch, capsys, mode, extra, reason, fix
):
    (tmp_path / "all_fail_reward.py").write_text(ALL_FAIL_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("REWARD_MODE", mode)
    assert main(["train", *_all_fail_args(tiny_smollm2_dir, tmp_path, *extra)]) == 2
    message = _all_failed_line(reason, fix)
    assert capsys.readouterr().err == f"miles: {message}. {NO_STEP}\n"
    run = tmp_path / "broken"
    assert f"ERROR miles.recipes.run: the run stopped: {message}\n" in (run / "train.log").read_text()


def test_any_error_that_ends_a_started_run_is_written_to_train_log_with_its_traceback(tmp_path):
    from miles.recipes.run import _run_log

    with pytest.raises(ZeroDivisionError), _run_log(tmp_path) as start_log:
        start_log()
        1 / 0  # a bug in the loop  # noqa: B018
    log = (tmp_path / "train.log").read_text()
    assert "ERROR miles.recipes.run: the run failed: ZeroDivisionError: division by zero\nTraceback" in log
    assert log.rstrip().endswith("ZeroDivisionError: division by zero")


def test_an_engine_server_that_does_not_start_is_one_line_with_the_fix_and_its_log(tiny_smollm2_dir, tmp_path, capsys):
    """SGLang is not installed here (nor in CI): its server exits at start; the CLI prints what failed, the fix and
    where the server's log is, not a traceback (the log, beside the run directory, keeps the details)."""
    import importlib.util
    import re

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed: its server would start")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([GOOD] * 3))
    args = _args(tiny_smollm2_dir, tmp_path / "runs", data, "--engine.type", "sglang", "--engine.server", "sglang")
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("miles: SGLang server 0 at http://127.0.0.1:"), err
    assert "exited with code 1 while starting" in err and "Fix: SGLang needs a GPU and `pip install sglang`" in err
    log = re.search(r"\(server log: (.+)\)$", err.strip()).group(1)
    assert "No module named" in Path(log).read_text()  # the details are in the log


def test_a_typo_of_a_registered_model_or_a_recipe_name_suggests_the_near_name():
    from miles.recipes.registry import check_model_path, load_recipe

    with pytest.raises(ValueError, match=r"config.json. Did you mean --models-policy-path tiny-glm-5\?$"):
        check_model_path("tiny-glm5", key="models_policy_path")
    with pytest.raises(ValueError, match=r"nor a YAML file; did you mean --recipe qwen3_6_35b_a3b_grpo_gsm8k\?$"):
        load_recipe("qwen3_6_35b_a3b")  # a prefix
    with pytest.raises(ValueError, match=r"nor a YAML file; did you mean --recipe smollm2_grpo_arithmetic\?$"):
        load_recipe("smollm2_grpo_arithmetc")
    with pytest.raises(ValueError, match=r"nor a YAML file$"):
        load_recipe("llama4_ppo")  # nothing near: no suggestion


def test_a_step_where_generation_failed_every_sample_does_not_blame_the_reward():
    """All samples failed in the engine (no failure kind of the reward's): the line names the reasons, not the reward
    function; a step where the reward failed them names it."""
    from miles.core.loop import AllSamplesFailed
    from miles.core.sample import Sample, SampleStatus
    from miles.recipes.run import all_failed_message
    from miles.rollout.config import RewardConfig

    def failed(reason, kind=None):
        sample = Sample(index=0, group_index=0, prompt="p", status=SampleStatus.FAILED, metadata={"failure": reason})
        if kind:
            sample.metadata["failure_kind"] = kind
        return sample

    reward = RewardConfig(type="custom", path="my_rewards:score")
    engine = AllSamplesFailed(3, [failed("engine error: connection refused")] * 4)
    assert all_failed_message(engine, reward) == (
        "step 3: all 4 samples failed; first reasons: engine error: connection refused. Fix what the reasons name"
    )
    scored = AllSamplesFailed(1, [failed("reward function raised KeyError: 'x'", "reward_error")] * 2)
    assert all_failed_message(scored, reward) == (
        "step 1: all 2 samples failed (reward: reward.path 'my_rewards:score'); first reasons: reward function raised "
        "KeyError: 'x'. Fix the reward function (call it on one sample in Python to see its error)"
    )
