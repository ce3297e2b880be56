"""Ctrl-C and restarts with default checkpoint settings (tiny model, real `miles train` processes).

One Ctrl-C mid-step finishes the step, saves it and exits 130 with one line; `--resume` then continues exactly as
a run that was never interrupted. Two Ctrl-C abandon the step at once; a run without any checkpoint can be
started again (`--resume` from step 0, or `--overwrite`). A finished run says so when resumed. Under `uv run`
without a terminal one signal to the process group arrives twice (uv forwards it): still one request.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from miles.recipes.cli import command_prefix, main
from miles.recipes.interrupts import REPEAT_WINDOW_S

pytestmark = pytest.mark.integration

# Rewards of a tiny random model; on the first sample of step `SLOW_STEP` (0-based) it announces itself through a
# marker file and sleeps, so the test's signal arrives mid-step, during the rollout's scoring.
REWARD_MODULE = """
import os, time
from pathlib import Path

def odd_first_token(sample):
    slow_step, prompts_per_step = int(os.environ["SLOW_STEP"]), 2
    marker = Path(os.environ["MARKER"])
    if sample.group_index // prompts_per_step == slow_step and not marker.exists():
        marker.write_text("in step")
        time.sleep(float(os.environ["SLEEP_S"]))
    return float(sample.response_tokens[0] % 2)
"""

# A group-generate function that is the built-in single-turn one, announcing through a marker file that the
# engine is about to generate, so a test's signal arrives mid-generation.
GENERATE_MODULE = """
import os
from pathlib import Path

from miles.rollout.generate import ChatRollout


def build_generate(context):
    chat = ChatRollout(context.engine, context.tokenizer, max_prompt_tokens=context.max_prompt_tokens)

    async def generate_group(prompt, *, n, sampling, seeds):
        Path(os.environ["GENERATE_MARKER"]).touch()
        return await chat(prompt, n=n, sampling=sampling, seeds=seeds)

    return generate_group
"""

NUM_STEPS = 4
ROOT = Path(__file__).resolve().parents[2]


def _overrides(model_dir, run_dir, name):
    return [
        "--models.policy.path", str(model_dir),
        "--data.size", "6",
        "--reward.type", "custom", "--reward.path", "interrupt_reward:odd_first_token",
        "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "4",
        "--rollout.sampling.max-new-tokens", "3",
        "--train.lr", "1e-2", "--train.micro-batch-size", "8",
        "--eval.num-prompts", "0",
        "--loop.num-steps", str(NUM_STEPS),  # loop.save_interval and loop.keep_checkpoints: the defaults
        "--run.dir", str(run_dir), "--run.name", name, "--run.progress", "false", "--run.num-threads", "1",
    ]  # fmt: skip


@pytest.fixture
def reward_env(tmp_path, monkeypatch):
    (tmp_path / "interrupt_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = {"SLOW_STEP": "-1", "MARKER": str(tmp_path / "marker"), "SLEEP_S": "0"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def _start(args, tmp_path, *, slow_step, sleep_s):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.update(SLOW_STEP=str(slow_step), MARKER=str(tmp_path / "marker"), SLEEP_S=str(sleep_s))
    cmd = [sys.executable, "-m", "miles.recipes.cli", "train", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, process, timeout_s=300.0):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached the slow step"
        time.sleep(0.05)


class _LineReader:
    """Reads a process's stream in a thread, so a test can wait for a line while the process runs."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self._thread.start()

    def wait_for(self, text: str, process, timeout_s=60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in list(self.lines)):
            assert process.poll() is None, self.text()[-3000:]
            assert time.monotonic() < deadline, f"no line with {text!r} in: {self.text()[-3000:]}"
            time.sleep(0.05)

    def text(self, timeout_s: float | None = None) -> str:
        """What was read; with ``timeout_s``, all of it (waits for EOF)."""
        if timeout_s is not None:
            self._thread.join(timeout_s)
        return "".join(self.lines)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_one_ctrl_c_mid_step_saves_that_step_and_resume_continues_exactly(
    tiny_smollm2_dir, tmp_path, reward_env, capsys
):
    assert main(["train", *_overrides(tiny_smollm2_dir, tmp_path, "straight")]) == 0

    process = _start(_overrides(tiny_smollm2_dir, tmp_path, "stopped"), tmp_path, slow_step=1, sleep_s=2)
    _wait_for(tmp_path / "marker", process)
    process.send_signal(signal.SIGINT)  # during step 2 (0-based 1): the default save interval (5) is not due
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert " DEBUG " not in stderr  # per-step lines go to train.log only (tqdm's log redirect kept no level)
    run = tmp_path / "stopped"
    assert stderr.strip().splitlines()[-1] == (
        f"miles: stopped by SIGINT after step 2 of {NUM_STEPS}; checkpoint {run / 'checkpoints' / 'step_2'}. "
        f"Continue with: {command_prefix()}miles train --run.name stopped --run.dir {tmp_path} --resume"
    )
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert [r["step"] for r in _metrics(run)] == [1, 2]

    capsys.readouterr()
    assert main(["train", "--run.dir", str(tmp_path), "--run.name", "stopped", "--resume"]) == 0
    straight, resumed = _metrics(tmp_path / "straight"), _metrics(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("loss", "reward/mean", "grad_norm", "weight_version"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
    assert any(r["grad_norm"] > 0 for r in straight)
    # defaults: a periodic save every 5 steps, the newest 2 kept
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_2", "step_4"]
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["name"] == "stopped"
    assert (run / "train.log").is_file() and "pushed weights v4" in (run / "train.log").read_text()

    capsys.readouterr()
    assert main(["train", "--run.dir", str(tmp_path), "--run.name", "stopped", "--resume"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"miles: run stopped already finished: step_4 has 4 of loop.num_steps {NUM_STEPS} steps; to train on, add "
        f"--loop.num-steps 8 to `{command_prefix()}miles train --run.name stopped --run.dir {tmp_path} --resume`"
    )


def test_two_ctrl_c_abandon_the_step_and_a_run_without_checkpoint_can_be_restarted(
    tiny_smollm2_dir, tmp_path, reward_env, capsys
):
    args = _overrides(tiny_smollm2_dir, tmp_path, "abandoned")
    process = _start(args, tmp_path, slow_step=0, sleep_s=120)
    _wait_for(tmp_path / "marker", process)
    reader = _LineReader(process.stderr)
    process.send_signal(signal.SIGINT)
    # The second Ctrl-C once the first was handled: CPython runs a handler once for signals that arrive before it
    # runs (a gen-2 GC in another thread can hold the GIL that long), so a fixed pause raced on a loaded machine.
    reader.wait_for("SIGINT: finishing the current step", process)
    time.sleep(REPEAT_WINDOW_S + 0.2)  # a signal sooner after the first is taken as the same one, delivered twice
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)  # the 120 s sleep was cut short
    stderr = reader.text(timeout_s=10)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        "miles: interrupted; no checkpoint was written, so it starts from step 0. "
        f"Continue with: {command_prefix()}miles train --run.name abandoned --run.dir {tmp_path} --resume"
    )
    run = tmp_path / "abandoned"
    assert not (run / "checkpoints").exists()

    assert main(["train", *args, "--resume"]) == 0
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4]
    capsys.readouterr()
    assert main(["train", *args]) == 2  # a fresh start would mix two runs' metrics (a run without a step would not)
    assert capsys.readouterr().err == (
        f"miles: run directory {run} already has a run; continue it with --run.name abandoned --resume (its latest "
        "checkpoint is step_4), start it over with --overwrite, or pick another --run.name\n"
    )
    assert main(["train", *args, "--overwrite", "--loop.num-steps", "1"]) == 0
    assert [r["step"] for r in _metrics(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_1"]


def _start_with_uv(args, tmp_path, *, slow_step, sleep_s):
    """`uv run miles train ...` as a user starts it from a script or an IDE: no terminal on stdin (so uv forwards
    SIGINT to its child), in a process group of its own that the test signals as a whole."""
    uv = os.environ.get("UV") or shutil.which("uv")  # `uv run` sets UV to its own path
    if uv is None:
        pytest.skip("uv is not installed: this test checks how `uv run` passes signals on")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.update(SLOW_STEP=str(slow_step), MARKER=str(tmp_path / "marker"), SLEEP_S=str(sleep_s))
    env["GENERATE_MARKER"] = str(tmp_path / "generating")
    return subprocess.Popen(
        [uv, "run", "--no-sync", "miles", "train", *args],  # --no-sync: the test uses the environment as it is
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.fixture
def process_groups():
    """Started process groups (append the Popen); any still running when the test ends is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_one_sigint_to_the_process_group_of_uv_run_is_one_request_and_saves_the_step(
    tiny_smollm2_dir, tmp_path, reward_env, process_groups
):
    process = _start_with_uv(_overrides(tiny_smollm2_dir, tmp_path, "group"), tmp_path, slow_step=0, sleep_s=3)
    process_groups.append(process)
    _wait_for(tmp_path / "marker", process)
    os.killpg(process.pid, signal.SIGINT)  # uv and miles get it, and uv forwards it to miles: two deliveries
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "terminate called" not in stderr
    run = tmp_path / "group"
    assert stderr.strip().splitlines()[-1] == (
        f"miles: stopped by SIGINT after step 1 of {NUM_STEPS}; checkpoint {run / 'checkpoints' / 'step_1'}. "
        f"Continue with: uv run miles train --run.name group --run.dir {tmp_path} --resume"
    )
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_1"
    assert [r["step"] for r in _metrics(run)] == [1]
    train_log = (run / "train.log").read_text()
    assert train_log.count("SIGINT within 1.0s of the previous signal: taken as the same request") == 1


def test_a_second_sigint_mid_generation_stops_at_once_with_130_and_no_abort_of_the_engine_thread(
    tiny_smollm2_dir, tmp_path, reward_env, process_groups
):
    """The engine's worker thread is stopped before the interpreter exits: a thread still inside torch then was
    ended by CPython's pthread_exit, whose unwinding through C++ called std::terminate (exit 134)."""
    model = tmp_path / "model"  # room for responses long enough that generation outlasts the test's signals
    shutil.copytree(tiny_smollm2_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    (tmp_path / "generate_marker.py").write_text(GENERATE_MODULE)
    args = [
        *_overrides(model, tmp_path, "mid_generation"),
        "--rollout.generate-path", "generate_marker:build_generate",
        "--rollout.rollout-batch-size", "4", "--rollout.n-samples-per-prompt", "8",
        "--rollout.sampling.max-new-tokens", "2000",
    ]  # fmt: skip
    process = _start_with_uv(args, tmp_path, slow_step=-1, sleep_s=0)
    process_groups.append(process)
    _wait_for(tmp_path / "generating", process)
    reader = _LineReader(process.stderr)
    os.killpg(process.pid, signal.SIGINT)
    reader.wait_for("SIGINT: finishing the current step", process)
    time.sleep(REPEAT_WINDOW_S + 0.2)  # a person pressing Ctrl-C again
    os.killpg(process.pid, signal.SIGINT)
    process.wait(timeout=60)
    stderr = reader.text(timeout_s=10)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "terminate called" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        "miles: interrupted; no checkpoint was written, so it starts from step 0. "
        f"Continue with: uv run miles train --run.name mid_generation --run.dir {tmp_path} --resume"
    )
    run = tmp_path / "mid_generation"
    # All 4 x 8 responses were still being sampled (2000 tokens each) when the engine was stopped.
    assert "pause(abort): 32 requests interrupted" in (run / "train.log").read_text()
    assert _metrics(run) == [] and not (run / "checkpoints").exists()


def test_a_generated_run_name_is_recorded_in_the_config(tiny_smollm2_dir, tmp_path, reward_env):
    args = _overrides(tiny_smollm2_dir, tmp_path, "x")
    name_at = args.index("--run.name")
    del args[name_at : name_at + 2]
    assert main(["train", *args, "--loop.num-steps", "1"]) == 0
    (run,) = tmp_path.glob("smollm2_grpo_arithmetic-*")
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["name"] == run.name


def test_ctrl_c_still_saves_when_the_console_pipe_is_gone(tiny_smollm2_dir, tmp_path, reward_env):
    """`miles train ... | tee log` and Ctrl-C: tee dies with the same SIGINT, so every later console write fails."""
    args = [*_overrides(tiny_smollm2_dir, tmp_path, "piped"), "--run.progress", "true"]
    process = _start(args, tmp_path, slow_step=1, sleep_s=2)
    _wait_for(tmp_path / "marker", process)
    process.stdout.close()
    process.stderr.close()  # the reader is gone: the progress bar and the last line hit a broken pipe
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=300) == 130
    run = tmp_path / "piped"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert "miles.recipes.run: stopped by SIGINT after step 2 of 4" in (run / "train.log").read_text()


def test_resume_uses_the_runs_latest_settings_not_an_older_checkpoints(tiny_llama_dir, tmp_path):
    """A run extended with `--resume --loop.num-steps 6` and stopped before its next save: continuing it must
    keep 6, not go back to the 3 of the checkpoint it started from."""
    from miles.recipes.cli import resolve_config, resolve_resume

    base = ["--models.policy.path", str(tiny_llama_dir), "--run.dir", str(tmp_path), "--run.name", "ext"]
    run = tmp_path / "ext"
    checkpoint = run / "checkpoints" / "step_3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "run_state.json").write_text(json.dumps({"step": 3, "weight_version": 3, "data_source": {}}))
    old = resolve_config("smollm2_grpo_arithmetic", [*base, "--loop.num-steps", "3"]).model_dump(mode="json")
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(old))
    (run / "config.yaml").write_text(yaml.safe_dump({**old, "loop": {**old["loop"], "num_steps": 6}}))
    cfg, run_dir, found = resolve_resume("latest", "smollm2_grpo_arithmetic", base)
    assert (cfg.loop.num_steps, run_dir, found) == (6, run, checkpoint)
    cfg, _, _ = resolve_resume(str(checkpoint), "smollm2_grpo_arithmetic", [])  # an explicit checkpoint: its own
    assert cfg.loop.num_steps == 3
