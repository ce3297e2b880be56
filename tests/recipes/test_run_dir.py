"""The run directory through `miles train`: one writer at a time (a second start, `--resume` or `--overwrite` of a
live run is refused naming its pid, and touches nothing of it), and a directory that cannot be written or whose disk
cannot hold one checkpoint is one `miles:` line, exit 2, before any model loads."""

import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from miles.recipes.cli import main, resolve_config
from miles.recipes.run_dir import LOCK_FILE, RunDirError, RunDirLock
from safetensors import safe_open

# Blocks the first reward call until the test creates the RELEASE file, announcing itself through MARKER: the run
# holding the lock stays alive (mid-step 1) as long as the test needs.
REWARD_MODULE = """
import os, time
from pathlib import Path

def held(sample):
    Path(os.environ["MARKER"]).write_text("in step 1")
    while not Path(os.environ["RELEASE"]).exists():
        time.sleep(0.02)
    return float(sample.response_tokens[0] % 2)
"""


def _overrides(model_dir, run_dir, name, data):
    return [
        "--models.policy.path", str(model_dir), "--data.source", "file", "--data.path", str(data),
        "--reward.type", "custom", "--reward.path", "held_reward:held", "--reward.timeout-s", "600",
        "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "4",
        "--rollout.sampling.max-new-tokens", "3",
        "--train.micro-batch-size", "8", "--eval.num-prompts", "0", "--loop.num-steps", "1",
        "--run.dir", str(run_dir), "--run.name", name, "--run.progress", "false", "--run.num-threads", "1",
    ]  # fmt: skip


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        "\n".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) for i in range(4))
    )
    return path


def _start(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.update(MARKER=str(tmp_path / "marker"), RELEASE=str(tmp_path / "release"))
    cmd = [sys.executable, "-m", "miles.recipes.cli", "train", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _files(run: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file of a run directory: (size, mtime in ns, content)."""
    return {
        str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


@pytest.mark.integration
def test_a_live_run_refuses_a_second_start_resume_and_overwrite_and_keeps_its_files(
    tiny_smollm2_dir, tmp_path, data, monkeypatch, capsys
):
    (tmp_path / "held_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = _overrides(tiny_smollm2_dir, tmp_path, "live", data)
    run = tmp_path / "live"
    # Two plain starts of the same run at the same moment: exactly one runs, the other is refused at once.
    first, second = _start(args, tmp_path), _start(args, tmp_path)
    try:
        deadline = time.monotonic() + 300
        while first.poll() is None and second.poll() is None:
            assert time.monotonic() < deadline, "neither start was refused"
            time.sleep(0.05)
        refused, live = (first, second) if first.poll() is not None else (second, first)
        _, stderr = refused.communicate(timeout=60)
        assert refused.returncode == 2, stderr[-3000:]
        assert "Traceback" not in stderr
        busy = f"miles: run directory {run} is in use by the live run of process {live.pid}, and a second writer "
        assert stderr.strip().splitlines()[-1] == (
            f"{busy}would corrupt it (nothing of it was touched); pick another --run.name, or wait for that run to end"
        )
        while not (tmp_path / "marker").exists():  # the live run is in step 1 (its reward waits for the test)
            assert live.poll() is None, live.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the live run never reached its reward"
            time.sleep(0.05)
        assert (run / LOCK_FILE).read_text().split()[0] == str(live.pid)
        before = _files(run)
        assert {"config.yaml", "train.log", "metrics.jsonl", LOCK_FILE} <= before.keys()

        stop_first = "stop that run first (Ctrl-C in its terminal, or kill -INT with its pid, saves a checkpoint), then"
        for extra, fix in [
            ([], "pick another --run.name, or wait for that run to end"),
            (["--resume"], f"{stop_first} --resume continues it"),
            (["--overwrite"], f"{stop_first} --overwrite starts it over; or pick another --run.name"),
        ]:
            capsys.readouterr()
            assert main(["train", *args, *extra]) == 2, extra
            err = capsys.readouterr().err
            assert err == f"{busy}would corrupt it (nothing of it was touched); {fix}\n", extra
        assert _files(run) == before  # nothing read-modified, deleted or added
    finally:
        (tmp_path / "release").write_text("go")
        for process in (first, second):
            if process.poll() is None:
                process.wait(timeout=300)
    _, stderr = live.communicate()
    assert live.returncode == 0, stderr[-3000:]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_1"
    assert not (run / LOCK_FILE).exists()  # released on exit


def test_a_lock_file_left_by_a_dead_process_is_taken_over_with_a_note(tmp_path, caplog):
    run = tmp_path / "runs" / "crashed"
    run.mkdir(parents=True)
    (run / LOCK_FILE).write_text("4194303 some-host\n")  # what a kill -9'd holder leaves: the OS dropped its lock
    with caplog.at_level(logging.WARNING, logger="miles"), RunDirLock.acquire(run) as lock:
        assert (run / LOCK_FILE).read_text().split()[0] == str(os.getpid())
        with pytest.raises(RunDirError, match=f"in use by the live run of process {os.getpid()}, "):
            RunDirLock.acquire(run)  # another open of the file: a second writer, even in this process
        assert lock.path == run / LOCK_FILE
    assert [r.getMessage() for r in caplog.records] == [
        f"{run}: taking over the lock file of process 4194303 on host some-host, which is no longer running (it did "
        "not end cleanly)"
    ]
    assert sorted(p.name for p in run.iterdir()) == []  # released: the lock file is gone, the directory stays


def test_a_run_directory_under_a_regular_file_is_one_line_before_anything_loads(tmp_path, data):
    """A real unwritable place, also for root (which chmod does not stop): a run.dir whose parent is a file. The
    model path does not exist either: the run directory is checked first, before the build reads anything."""
    (tmp_path / "afile").write_text("not a directory")
    runs = tmp_path / "afile" / "runs"
    cmd = [sys.executable, "-m", "miles.recipes.cli", "train", *_overrides(tmp_path / "no_model", runs, "x", data)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (
        f"miles: run directory {runs / 'x'} cannot be written (Not a directory: {runs}); pass --run.dir a writable "
        f"directory (run.dir is {runs}), or make it writable"
    )
    assert "Traceback" not in result.stderr and "loaded" not in result.stderr
    assert (tmp_path / "afile").read_text() == "not a directory"


def _never(*args, **kwargs):
    raise AssertionError("a model was loaded")


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any tokenizer, engine or trainer load fails the test: the checks must come first."""
    import miles.rollout.engines.launch
    import miles.train
    import transformers

    monkeypatch.setattr(transformers, "AutoTokenizer", type("NoTokenizer", (), {"from_pretrained": _never}))
    monkeypatch.setattr(miles.rollout.engines.launch, "launch_engine", _never)
    monkeypatch.setattr(miles.train, "FSDP2Backend", _never)


def _recorded_run(run: Path, model_dir: Path, data: Path, *, checkpoint_bytes: int = 0) -> list[str]:
    """A run directory as a run leaves it (config.yaml; with ``checkpoint_bytes``, a step_1 checkpoint of about that
    size); returns the overrides that name it."""
    args = _overrides(model_dir, run.parent, run.name, data)
    args[args.index("--loop.num-steps") + 1] = "2"
    recorded = resolve_config("smollm2_grpo_arithmetic", args).model_dump(mode="json")
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(recorded))
    if checkpoint_bytes:
        step = run / "checkpoints" / "step_1"
        step.mkdir(parents=True)
        (step / "config.yaml").write_text(yaml.safe_dump(recorded))
        (step / "run_state.json").write_text(json.dumps({"step": 1, "weight_version": 1, "data_source": {}}))
        (step / "optimizer.pt").write_bytes(b"\0" * (checkpoint_bytes - _size(step)))
        (run / "checkpoints" / "latest").write_text("step_1\n")
    return ["--run.dir", str(run.parent), "--run.name", run.name]


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_resuming_a_run_directory_this_process_cannot_write_is_one_line(
    tiny_smollm2_dir, tmp_path, data, monkeypatch, capsys, no_model_loads
):
    run = tmp_path / "runs" / "readonly"
    names = _recorded_run(run, tiny_smollm2_dir, data)
    before = _files(run)
    real_access = os.access
    # Root writes through chmod, so the read-only directory is os.access's answer (as for a user on a read-only mount)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != run and real_access(path, mode))
    assert main(["train", *names, "--resume"]) == 2
    assert capsys.readouterr().err == (
        f"miles: run directory {run} cannot be written (Permission denied: {run}); pass --run.dir a writable "
        f"directory (run.dir is {run.parent}), or make it writable\n"
    )
    assert _files(run) == before  # no lock file left, nothing else touched


@pytest.mark.parametrize("resumed", [False, True], ids=["new_run", "resume"])
def test_a_disk_without_room_for_one_checkpoint_is_one_line_before_any_model_loads(
    tiny_smollm2_dir, tmp_path, data, monkeypatch, capsys, no_model_loads, resumed
):
    import shutil

    (tmp_path / "held_reward.py").write_text(REWARD_MODULE)  # build_inputs imports the reward first
    monkeypatch.syspath_prepend(str(tmp_path))
    mib = 1 << 20
    if resumed:
        names = _recorded_run(tmp_path / "runs" / "full", tiny_smollm2_dir, data, checkpoint_bytes=5 * mib)
        args, needed = [*names, "--resume"], "5.0 MiB (the size of step_1)"
    else:
        args = _overrides(tiny_smollm2_dir, tmp_path / "runs", "full", data)
        with safe_open(tiny_smollm2_dir / "model.safetensors", "pt") as f:  # tied embedding stored once
            num_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        # 49152 x 32 embedding (tied: stored once) + 2 layers of 9280 (q, o 32x32; k, v 32x16; gate, up, down
        # 32x64; 2 norms of 32) + the final norm's 32
        assert num_params == 49152 * 32 + 2 * 9280 + 32
        needed = f"{12 * num_params / mib:.1f} MiB (12 bytes per parameter: fp32 weights and AdamW state)"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=4 * mib))
    assert main(["train", *args]) == 2
    run = tmp_path / "runs" / "full"
    assert capsys.readouterr().err == (
        f"miles: run directory {run}: its disk has 4.0 MiB free, but one checkpoint needs about {needed}; free some "
        "space, or pass --run.dir a directory on a larger disk\n"
    )
    assert not (run / LOCK_FILE).exists()
    if not resumed:
        assert not (tmp_path / "runs").exists()  # nothing written


def test_a_lora_checkpoint_is_estimated_at_the_merged_model_plus_adapters(tiny_smollm2_dir, tmp_path):
    # Regression: a LoRA run was estimated at 12 bytes per parameter (full AdamW state) though its checkpoint holds
    # the merged fp32 model and small adapters, so a disk with room for it refused the run
    from miles.recipes.run_dir import checkpoint_size

    with safe_open(tiny_smollm2_dir / "model.safetensors", "pt") as f:
        num_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert checkpoint_size(resume_from=None, model_dirs=[tiny_smollm2_dir])[0] == 12 * num_params
    size, how = checkpoint_size(resume_from=None, model_dirs=[tiny_smollm2_dir, tiny_smollm2_dir], lora=True)
    assert size == 5 * num_params + 12 * num_params  # a LoRA policy; a critic beside it trains in full
    assert how.startswith("5 bytes per parameter: the merged fp32 model")


def test_a_checkpoint_that_cannot_be_written_mid_run_is_one_line_with_exit_1(
    tiny_smollm2_dir, tmp_path, data, capsys, monkeypatch
):
    """A disk that fills up (torch's zip writer raises RuntimeError, not OSError) or a checkpoints/ directory that
    becomes unwritable during the run: one line naming the checkpoint and what to do, not a traceback."""
    import miles.recipes.run

    (tmp_path / "odd_reward.py").write_text("def odd(sample):\n    return float(sample.response_tokens[0] % 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def disk_full(checkpoints, step, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 113324416 vs 113324304")

    monkeypatch.setattr(miles.recipes.run, "save_run_checkpoint", disk_full)
    args = _overrides(tiny_smollm2_dir, tmp_path / "runs", "full", data)
    args[args.index("--reward.path") + 1] = "odd_reward:odd"
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    checkpoints = tmp_path / "runs" / "full" / "checkpoints"
    assert err[-1].startswith(
        f"miles: could not write checkpoint step_1 in {checkpoints} ([enforce fail at inline_container.cc:672] . "
        "unexpected pos 113324416 vs 113324304); the run stopped and no checkpoint was written (it starts at step 0). "
        "Free disk space (one checkpoint is ~12 bytes per parameter) or make the directory writable. Continue with: "
    )
    assert not any("Traceback" in line for line in err)
    assert "could not write checkpoint step_1" in (tmp_path / "runs" / "full" / "train.log").read_text()

    # Any other RuntimeError of a save is a bug, not a full disk: it is not dressed up as one.
    monkeypatch.setattr(
        miles.recipes.run, "save_run_checkpoint", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug"))
    )
    args[args.index("--run.name") + 1] = "bug"
    with pytest.raises(RuntimeError, match="bug"):
        main(["train", *args])


def test_a_checkpoints_directory_root_cannot_write_is_caught_before_anything_loads(tmp_path, monkeypatch):
    """os.access says yes to root on an immutable (chattr +i) directory; the check writes a probe file instead."""
    from miles.recipes.run_dir import check_writable

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    real_mkstemp = __import__("tempfile").mkstemp

    def immutable(*args, dir=None, **kwargs):
        if Path(dir) == run / "checkpoints":
            raise PermissionError(1, "Operation not permitted", str(run / "checkpoints" / ".write-probe-x"))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr("tempfile.mkstemp", immutable)
    with pytest.raises(RunDirError, match=r"cannot be written \(Operation not permitted: .*checkpoints/.write-probe"):
        check_writable(run)
    assert sorted(p.name for p in run.rglob("*")) == ["checkpoints"]  # the probes of run/ left nothing


def test_dynamic_sampling_that_finds_no_signal_is_one_line_exit_2_numbered_as_the_bar(
    tiny_smollm2_dir, tmp_path, data, capsys, monkeypatch
):
    """Every reward equal: dynamic sampling keeps no group within max_rounds. It ended in a traceback saying
    "step 0"; now one line, exit 2, step 1 as the progress bar and metrics.jsonl number it."""
    (tmp_path / "same_reward.py").write_text("def same(sample):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = _overrides(tiny_smollm2_dir, tmp_path / "runs", "flat", data)
    args[args.index("--reward.path") + 1] = "same_reward:same"
    args += ["--algorithm.dynamic-sampling.max-rounds", "1"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "miles: step 1: dynamic sampling kept 0 of rollout.rollout_batch_size=2 groups after "
        "algorithm.dynamic_sampling.max_rounds=1 generation rounds (2 groups filtered: all rewards equal"
    )
    assert err[-1].endswith("No step was completed, so the same command starts the run again")
    assert not any("Traceback" in line for line in err)
