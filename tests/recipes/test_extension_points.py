"""Every extension point (``miles.core.plugins.EXTENSION_POINTS``): its example under ``examples/plugins`` loads
against the point's signature, a bad path or signature fails naming the key and the expected signature, and the
examples run through the real loop (``miles.recipes.run``) on a tiny model, each leaving a value that proves it ran."""

import csv
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from miles.core.plugins import EXTENSION_POINTS, load_plugin
from miles.recipes.cli import resolve_config
from miles.recipes.run import RunSetupError, load_run_plugins, run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "plugins"
# What each example sets on the flags of a tiny 2-step run.
TINY = [
    "--loop.num-steps", "2",
    "--rollout.rollout-batch-size", "2",
    "--rollout.n-samples-per-prompt", "2",
    "--rollout.sampling.max-new-tokens", "4",
    "--eval.num-prompts", "2",
    "--eval.n-samples-per-prompt", "1",
    "--eval.sampling.max-new-tokens", "4",
    "--train.micro-batch-size", "8",
    "--run.progress", "false",
    "--algorithm.dynamic-sampling", "null",
]  # fmt: skip


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.mark.parametrize("key", sorted(EXTENSION_POINTS))
def test_every_example_loads_against_its_point(key, examples_on_path):
    point = EXTENSION_POINTS[key]
    assert (EXAMPLES / f"{point.example.split(':')[0]}.py").is_file(), point.example
    assert callable(load_plugin(point.example, key=key))


def test_every_point_is_documented_with_its_example():
    docs = (ROOT / "docs" / "extending.md").read_text()
    readme = (EXAMPLES / "README.md").read_text()
    for key, point in EXTENSION_POINTS.items():
        assert f"`{key}`" in docs and point.example in docs, key
        assert f"`{key}`" in readme, key


@pytest.mark.parametrize("key", sorted(k for k, p in EXTENSION_POINTS.items() if p.num_positional))
def test_a_bad_path_or_signature_fails_naming_the_key_and_the_signature(key, tmp_path, monkeypatch):
    point = EXTENSION_POINTS[key]
    with pytest.raises(ImportError, match=f"^{key}: cannot import module 'no_such_module'"):
        load_plugin("no_such_module:fn", key=key)
    with pytest.raises(ValueError, match=f"^{key} is 'no_colon'; expected 'module:attr'"):
        load_plugin("no_colon", key=key)
    arguments = ", ".join(f"a{i}" for i in range(point.num_positional + 1))
    (tmp_path / "wrong_arity.py").write_text(f"def fn({arguments}):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError) as err:
        load_plugin("wrong_arity:fn", key=key)
    message = str(err.value)
    assert message.startswith(f"{key}: 'wrong_arity:fn' must accept {point.num_positional} positional")
    assert message.endswith(f"expected {point.signature}") and "\n" not in message


def test_run_plugins_fail_at_start_up_with_one_line_naming_the_key(tmp_path, monkeypatch):
    (tmp_path / "bad_plugins.py").write_text("def two(a, b):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for flags, key in [
        (["--eval.path", "bad_plugins:nothing"], "eval.path"),
        (["--reward.group-path", "bad_plugins:two"], "reward.group_path"),
        (["--rollout.sample-hook-path", "bad_plugins:two"], "rollout.sample_hook_path"),
        (["--run.hooks", "[bad_plugins:two]"], r"run.hooks\[0\]"),
        (["--run.sinks", "[miles.core:no_sink]"], r"run.sinks\[0\]"),
    ]:
        cfg = resolve_config("smollm2_grpo_arithmetic", flags)
        with pytest.raises(RunSetupError, match=f"^{key}"):
            load_run_plugins(cfg)


def test_the_examples_run_through_the_real_loop(tiny_smollm2_dir, tmp_path, examples_on_path):
    """Sync loop, a group-generate factory, and every per-sample, per-group, algorithm, data, eval, hook and sink
    point."""
    cfg = resolve_config(
        "smollm2_grpo_arithmetic",
        [
            "--models.policy.path", str(tiny_smollm2_dir), *TINY,
            "--loop.save-interval", "1",
            "--data.source", "custom", "--data.source-path", "data_source:build_source",
            "--reward.type", "custom", "--reward.path", "rewards:answer_in_response",
            "--reward.group-path", "rewards:rank_in_group",
            "--rollout.sample-hook-path", "sample_hook:tag_answer",
            "--rollout.generate-path", "group_generate:build_generate",
            "--algorithm.reward-post-process-path", "algorithms:clip_rewards",
            "--algorithm.advantage.estimator-path", "algorithms:mean_baseline",
            "--algorithm.loss.policy-loss-path", "algorithms:plain_pg_loss",
            "--algorithm.loss.reducer-path", "algorithms:token_mean",
            "--algorithm.buffer-filter-path", "filters:drop_failed_groups",
            "--eval.path", "eval_fn:evaluate_with_length",
            "--run.hooks", "[hooks:build_hooks]",
            "--run.sinks", "[sinks:build_csv_sink]",
        ],
    )  # fmt: skip
    result = run(cfg, tmp_path / "run")
    assert result.steps_done == 2
    events = [json.loads(line) for line in (tmp_path / "run" / "hooks.jsonl").read_text().splitlines()]
    rollouts = [e for e in events if e["event"] == "rollout_end"]
    assert [e["step"] for e in rollouts] == [0, 1]
    # The data source's prompts, prompt 0 and prompt 2 (2 per step): its own formula, same seed.
    from data_source import AdditionSource

    expected = AdditionSource(cfg.data.seed).next_prompts(4)
    assert [e["first_prompt"] for e in rollouts] == [expected[0].prompt[0]["content"], expected[2].prompt[0]["content"]]
    assert rollouts[0]["group_index"] == [0, 0, 1, 1]
    for e in rollouts:
        # A random model answers no sum: per-sample rewards 0, ranks in a group of 2 equal values = (0 + 1) / 2 / 1.
        assert e["rewards"] == [0.5] * 4
        assert {"parsed_answer", "group_size"} <= set(e["metadata_keys"])  # the sample hook, the group function
    assert [(e["step"], Path(e["path"]).name) for e in events if e["event"] == "save"] == [
        (1, "step_1"),
        (2, "step_2"),
    ]
    assert all(Path(e["path"]).is_dir() for e in events if e["event"] == "save")
    assert [e["step"] for e in events if e["event"] == "train_step_end"] == [1, 2]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    for row in train_rows:
        assert row["buffer/filtered_groups"] == 0.0
        # Equal rewards: the mean baseline gives advantage 0, so the plain policy-gradient loss is exactly 0.
        assert row["advantages/mean"] == 0.0 and row["loss"] == 0.0
    assert all("eval/max_response_length" in r for r in rows if "eval/reward" in r)
    with open(tmp_path / "run" / "metrics.csv") as f:
        csv_rows = list(csv.DictReader(f))
    logged = {(int(r["step"]), r["name"]) for r in csv_rows}
    assert (0, "eval/max_response_length") in logged and (2, "loss") in logged


GROUP_PARITY_REWARD = """
def one_even_sample_of_even_groups(sample):
    return float(sample.group_index % 2 == 0 and sample.index % 2 == 0)
"""


def test_a_group_generate_function_and_a_dynamic_filter_with_reasons(tiny_smollm2_dir, tmp_path, monkeypatch):
    """Groups of 2 with an even global prompt number have rewards {1, 0}, the others {0, 0}: the filter keeps the
    even ones and drops the odd ones as "same_reward". Step 1 sees prompts 0 (kept), 1 (dropped), 2 (kept); step 2
    sees 3 (dropped), 4 (kept), 5 (dropped), 6 (kept)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    (tmp_path / "parity_reward.py").write_text(textwrap.dedent(GROUP_PARITY_REWARD))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = resolve_config(
        "smollm2_grpo_arithmetic",
        [
            "--models.policy.path", str(tiny_smollm2_dir), *TINY,
            "--eval.num-prompts", "0",
            "--algorithm.dynamic-sampling", "{max_rounds: 3, over_sample: 1.0, filter_path: filters:has_two_rewards}",
            "--reward.type", "custom", "--reward.path", "parity_reward:one_even_sample_of_even_groups",
            "--data.source", "file", "--data.path", str(_arithmetic_file(tmp_path)),
            "--rollout.generate-path", "group_generate:build_generate",
            "--run.hooks", "[hooks:build_hooks]",
        ],
    )  # fmt: skip
    run(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["dynamic_sampling/filtered/same_reward"] for r in train_rows] == [1.0, 2.0]
    assert [r["dynamic_sampling/rounds"] for r in train_rows] == [2.0, 3.0]
    events = [json.loads(line) for line in (tmp_path / "run" / "hooks.jsonl").read_text().splitlines()]
    rollouts = [e for e in events if e["event"] == "rollout_end"]
    assert [sorted(set(e["group_index"])) for e in rollouts] == [[0, 2], [4, 6]]
    assert all("group_size" in e["metadata_keys"] for e in rollouts)  # the group-generate example ran


def _arithmetic_file(tmp_path: Path) -> Path:
    path = tmp_path / "sums.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(16)))
    return path


def test_a_multi_turn_rollout_runs_with_the_example_tool(tiny_smollm2_dir, tmp_path, examples_on_path):
    cfg = resolve_config(
        "smollm2_grpo_arithmetic",
        [
            "--models.policy.path", str(tiny_smollm2_dir), *TINY,
            "--loop.num-steps", "1",
            "--eval.num-prompts", "0",
            "--rollout.mode", "multi_turn",
            "--rollout.multi-turn.tools", "[tools:word_count]",
            "--rollout.multi-turn.max-turns", "2",
        ],
    )  # fmt: skip
    assert run(cfg, tmp_path / "run").steps_done == 1
    tool = load_plugin("tools:word_count", key="rollout.multi_turn.tools[0]")
    assert tool({"text": "three small words"}) == "3"


def test_a_buffer_filter_in_the_one_step_off_loop_drops_groups_and_consumes_their_prompts(
    tiny_smollm2_dir, tmp_path, monkeypatch, examples_on_path
):
    (tmp_path / "keep_first.py").write_text("def keep_first(groups):\n    return groups[:1]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = resolve_config(
        "smollm2_grpo_arithmetic",
        [
            "--models.policy.path", str(tiny_smollm2_dir), *TINY,
            "--eval.num-prompts", "0",
            "--loop.mode", "one_step_off",
            "--algorithm.buffer-filter-path", "keep_first:keep_first",
            "--run.hooks", "[hooks:build_hooks]",
        ],
    )  # fmt: skip
    result = run(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["buffer/filtered_groups"] for r in rows if "loss" in r] == [1.0, 1.0]
    events = [json.loads(line) for line in (tmp_path / "run" / "hooks.jsonl").read_text().splitlines()]
    trained = [e["group_index"] for e in events if e["event"] == "rollout_end"]
    # keep_first keeps the first group of each step's two: one whole group (2 samples) per step, never the same prompt
    # twice, from prompts 0-3. Which prompt's group comes first is the engine's timing: the four groups of steps 1
    # and 2 generate at once (one-step-off), and under load group 2 once finished before group 0.
    assert [len(g) for g in trained] == [2, 2] and all(len(set(g)) == 1 for g in trained)
    assert len({g[0] for g in trained}) == 2 and {g[0] for g in trained} <= {0, 1, 2, 3}
    state = json.loads((result.checkpoint / "run_state.json").read_text())
    # Prompts 0-3 are consumed, the dropped 1 and 3 too (not stored for a resume to train); 4-7 were generated ahead.
    assert [p["group_index"] for p in state["data_source"]["untrained"]] == [4, 5, 6, 7]


README_REWARD = re.search(r"```python\n(# my_reward\.py.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
GROUP_BONUS = "def add_quarter(group):\n    return [sample.reward + 0.25 for sample in group]\n"


def _miles_train(args, cwd):
    """The `miles` console script, as a user runs it: unlike `python -m`, it puts no current directory on
    sys.path. PYTHONPATH is left out, so only what the loader adds can find a plugin."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    miles = Path(sys.executable).parent / "miles"
    return subprocess.run([str(miles), "train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_readme_reward_runs_from_the_current_directory_and_a_plugin_file_by_its_path(tiny_smollm2_dir, tmp_path):
    project = tmp_path / "project"
    (project / "plugins").mkdir(parents=True)
    (project / "my_reward.py").write_text(README_REWARD.group(1))
    (project / "plugins" / "bonus.py").write_text(GROUP_BONUS)
    readme = (ROOT / "README.md").read_text()
    assert "--reward.type custom --reward.path my_reward:reward " in readme
    assert "--reward.type custom --reward.path path/to/my_reward.py:reward " in readme
    done = _miles_train(
        [
            "--models.policy.path", str(tiny_smollm2_dir),
            "--reward.type", "custom", "--reward.path", "my_reward:reward",
            "--reward.group-path", "plugins/bonus.py:add_quarter",
            "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "4",
            "--rollout.sampling.max-new-tokens", "3", "--train.micro-batch-size", "8",
            "--eval.num-prompts", "0", "--loop.num-steps", "1",
            "--run.dir", str(tmp_path / "runs"), "--run.name", "custom", "--run.progress", "false",
        ],
        cwd=project,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "runs" / "custom" / "metrics.jsonl").read_text().splitlines()]
    # The random model's 3-token responses never end with the sum: README reward 0, plus the group bonus 0.25.
    assert row["reward/mean"] == 0.25 and row["samples/failed"] == 0.0


@pytest.mark.parametrize(
    "path, message",
    [
        pytest.param(
            "nowhere/my_reward.py:reward",
            "reward.path: no file 'nowhere/my_reward.py' (looked for {cwd}/nowhere/my_reward.py); name an existing "
            "file as path/to/file.py:attr, or a module on PYTHONPATH or in the current directory as module:attr",
            id="missing_file",
        ),
        pytest.param(
            "no_such_reward:reward",
            "reward.path: cannot import module 'no_such_reward' (No module named 'no_such_reward'); is it on "
            "PYTHONPATH or in the current directory ({cwd})? A file can be named as path/to/file.py:attr",
            id="missing_module",
        ),
        pytest.param(
            "broken.py:reward",
            "reward.path: importing 'broken.py' failed: {cwd}/broken.py:1: SyntaxError: expected ':'",
            id="file_with_a_syntax_error",
        ),
        pytest.param(
            "raising:reward",
            "reward.path: importing module 'raising' failed: {cwd}/raising.py:1: ZeroDivisionError: division by zero",
            id="module_that_raises_as_it_runs",
        ),
        pytest.param(
            "plugins/bonus.py:nothing",
            "reward.path: module 'plugins/bonus.py' has no attribute 'nothing'",
            id="file_without_the_attribute",
        ),
    ],
)
def test_a_plugin_path_that_does_not_load_is_one_line_naming_the_key(path, message, tmp_path):
    (tmp_path / "broken.py").write_text("def reward(sample)\n    return 1.0\n")
    (tmp_path / "raising.py").write_text("1 / 0\n")
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "bonus.py").write_text(GROUP_BONUS)
    runs = tmp_path / "runs"
    done = _miles_train(["--reward.type", "custom", "--reward.path", path, "--run.dir", str(runs)], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr == f"miles: {message.format(cwd=tmp_path)}\n"
    assert not runs.exists()  # nothing written


SHARED_STATE = """
calls = []


def one(sample):
    calls.append(1)
    return 1.0


def group(samples):
    return [len(calls)] * len(samples)
"""


def test_two_plugins_in_one_file_share_its_module(tmp_path):
    (tmp_path / "shared_state.py").write_text(SHARED_STATE)
    reward = load_plugin(f"{tmp_path}/shared_state.py:one", key="reward.path")
    group = load_plugin(f"{tmp_path}/shared_state.py:group", key="reward.group_path")
    assert reward(None) == 1.0 and group([None, None]) == [1, 1]


def test_a_plugin_file_named_like_an_importable_module_does_not_shadow_it(tmp_path, monkeypatch):
    # Regression: a file plugin registered under its bare stem made a later `stem:attr` plugin get the file's module.
    (tmp_path / "on_path").mkdir()
    (tmp_path / "on_path" / "score_shadow_probe.py").write_text("def score(sample):\n    return 1.0\n")
    (tmp_path / "file_dir").mkdir()
    (tmp_path / "file_dir" / "score_shadow_probe.py").write_text("def score(sample):\n    return 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "on_path"))
    from_file = load_plugin(f"{tmp_path}/file_dir/score_shadow_probe.py:score", key="reward.path")
    from_module = load_plugin("score_shadow_probe:score", key="reward.path")
    assert (from_file(None), from_module(None)) == (2.0, 1.0)
    assert from_file.__module__.startswith("score_shadow_probe_") and from_module.__module__ == "score_shadow_probe"
