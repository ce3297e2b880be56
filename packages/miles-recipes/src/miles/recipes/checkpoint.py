"""Run checkpoints: ``checkpoints/step_N/`` written to a temp dir and published by atomic rename; ``latest``
(a one-line file naming the newest step dir) is replaced last."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from miles.core.protocols import DataSource, TrainBackend


def save_run_checkpoint(
    checkpoints_dir: Path, step: int, *, backend: TrainBackend, data_source: DataSource, weight_version: int
) -> Path:
    """Write ``step_<step>/`` (backend state + ``run_state.json``) and point ``latest`` at it.

    A crash at any point leaves the previous ``latest`` and its directory intact.
    Returns: the published directory.
    """
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=checkpoints_dir))
    try:
        backend.save(tmp)
        state = {
            "step": step,
            "weight_version": weight_version,
            "data_source": data_source.state_dict(),
            "rng": {"python": repr(random.getstate()), "numpy_seed_hint": int(np.random.get_state()[1][0])},
        }
        (tmp / "run_state.json").write_text(json.dumps(state, indent=2))
        torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = checkpoints_dir / ".latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, checkpoints_dir / "latest")
    return final


def read_latest(checkpoints_dir: Path) -> Path | None:
    """The directory ``latest`` names, or None if there is no checkpoint yet."""
    latest = checkpoints_dir / "latest"
    if not latest.is_file():
        return None
    return checkpoints_dir / latest.read_text().strip()


def load_run_state(checkpoint_dir: Path) -> dict[str, Any]:
    """``run_state.json`` of a checkpoint directory."""
    return json.loads((checkpoint_dir / "run_state.json").read_text())
