"""Run checkpoints: kill -9 at every step of a save, RNG round trips, keep-N pruning, never a NaN checkpoint."""

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from miles.recipes.checkpoint import (
    capture_rng_state,
    prune_checkpoints,
    read_latest,
    restore_rng_state,
    save_run_checkpoint,
)

CRASHER = Path(__file__).with_name("checkpoint_crasher.py")


class FileBackend:
    """Writes one small file per save; enough for the publish/prune bookkeeping."""

    def __init__(self, step=0):
        self.step = step

    def save(self, path):
        (path / "trainer_state.json").write_text(json.dumps({"step": self.step}))


class Positions:
    def state_dict(self):
        return {"epoch": 0, "position": 0, "num_prompts": 0, "seed": 0}


def _save(checkpoints, step, keep=0):
    return save_run_checkpoint(
        checkpoints, step, backend=FileBackend(step), data_source=Positions(), weight_version=step, keep=keep
    )


def test_kill_9_at_every_step_of_a_save_and_at_random_times_leaves_a_loadable_latest(tmp_path):
    # 1 deterministic kill before each filesystem operation of a save (~37) + 6 kills at random times.
    result = subprocess.run(
        [sys.executable, str(CRASHER), str(tmp_path), "6", "0"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["violations"] == []
    assert summary["num_fs_events_per_save"] >= 20 and summary["num_kills"] >= 26
    steps = summary["steps_seen"]
    assert steps == sorted(steps) and steps[-1] > steps[0]  # kills landed both before and after `latest` moved
    assert summary["leftovers"] == []  # the next clean save removed every .tmp-/.trash- dir
    assert len(summary["step_dirs"]) == 2  # keep=2


def test_rng_states_round_trip_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    state = json.loads(json.dumps(capture_rng_state()))
    expected = (random.random(), np.random.standard_normal(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(state)
    got = (random.random(), np.random.standard_normal(), np.random.rand(), torch.rand(3))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


def test_keep_n_prunes_old_checkpoints_but_never_the_latest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_4", "step_5"]
    # latest names an older step (a resume from it): pruning keeps it even when it is not among the newest.
    (tmp_path / "latest").write_text("step_4\n")
    _save(tmp_path, 6)
    (tmp_path / "latest").write_text("step_4\n")
    assert [p.name for p in prune_checkpoints(tmp_path, keep=1)] == ["step_5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_4", "step_6"]


def test_read_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    assert read_latest(tmp_path) is None
    _save(tmp_path, 1), _save(tmp_path, 2)
    (tmp_path / "latest").unlink()  # a crash between publishing step_2 and writing `latest` on the first save
    (tmp_path / ".tmp-step_3-x").mkdir()  # and a half-written save
    assert read_latest(tmp_path).name == "step_2"
    (tmp_path / "latest").write_text("step_9\n")  # names a directory that is gone
    assert read_latest(tmp_path).name == "step_2"


def test_resaving_an_existing_step_replaces_it(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]


def test_a_backend_with_nan_weights_refuses_to_save_and_the_previous_checkpoint_stays(tiny_llama_dir, tmp_path):
    from miles.train import FSDP2Backend, TrainConfig

    backend = FSDP2Backend(tiny_llama_dir, train=TrainConfig(), temperature=1.0)
    save_run_checkpoint(tmp_path, 1, backend=backend, data_source=Positions(), weight_version=1)
    with torch.no_grad():
        next(backend.model.parameters()).fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="refusing to save a checkpoint.*NaN"):
        save_run_checkpoint(tmp_path, 2, backend=backend, data_source=Positions(), weight_version=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]
    assert read_latest(tmp_path).name == "step_1"


def test_a_nonfinite_step_stops_the_run_when_skipping_is_off(tiny_llama_dir):
    from miles.train import FSDP2Backend, TrainConfig

    def backend(skip):
        return FSDP2Backend(tiny_llama_dir, train=TrainConfig(skip_nonfinite_steps=skip), temperature=1.0)

    skipping = backend(True)
    before = {k: v.clone() for k, v in skipping.full_state_dict().items()}
    assert skipping.optimizer_step(loss=float("nan"))["skipped_steps"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in skipping.full_state_dict().items())
    with pytest.raises(FloatingPointError, match="skip-nonfinite-steps true"):
        backend(False).optimizer_step(loss=float("inf"))
