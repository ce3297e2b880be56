"""Run checkpoints (DESIGN.md section 8) that survive a crash at any instant, and exact resume.

Layout of ``runs/<name>/checkpoints/``::

    step_N/                      one complete checkpoint, published by an atomic rename
        model/                   HF directory: config.json, model.safetensors, tokenizer files
        optimizer.pt             optimizer + LR scheduler state (tensors only: loads with weights_only=True)
        trainer_state.json       backend step, skipped steps
        run_state.json           loop step, weight version, data-source position (epoch, index, seed)
        rng_rank{R}.json         python / numpy / torch RNG states of rank R
        config.yaml              the resolved config of the run
    latest                       one line naming the newest step dir; replaced (atomically) last

A save writes into ``.tmp-step_N-*/``, fsyncs every file, renames it to ``step_N`` and only then replaces
``latest``. A ``kill -9`` at any point therefore leaves either the old ``latest`` (naming a complete checkpoint)
or the new one, never a half-written file; leftover ``.tmp-*`` / ``.trash-*`` directories are removed by the
next save. Old checkpoints are pruned after ``latest`` moves, keeping the newest ``keep``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from miles.core.protocols import DataSource, TrainBackend
from miles.core.rng import capture_rng_state, restore_rng_state
from miles.diffusion.models import FLOW_META, PIPELINES

logger = logging.getLogger(__name__)

LATEST = "latest"
RUN_STATE = "run_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class RunState:
    """What a resumed run continues from.

    Attributes:
        step: loop steps completed when the checkpoint was taken (the next step to run).
        weight_version: version of the weights the engines held; a resume pushes the restored weights with it.
        data_source: the data source's ``state_dict`` (epoch, position, prompts served, shuffle seed).
    """

    step: int
    weight_version: int
    data_source: dict[str, Any]


# -- save -----------------------------------------------------------------------------------------------
def save_run_checkpoint(
    checkpoints_dir: Path,
    step: int,
    *,
    backend: TrainBackend,
    data_source: DataSource,
    weight_version: int,
    config: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
    keep: int = 0,
    rank: int = 0,
) -> Path:
    """Write ``step_<step>/``, point ``latest`` at it, then prune to the newest ``keep`` checkpoints.

    A crash (even ``kill -9``) at any point leaves the previous ``latest`` and its directory intact.

    Args:
        checkpoints_dir: the run's ``checkpoints/`` directory (created if missing).
        step: loop steps completed.
        backend: writes ``model/``, ``optimizer.pt``, ``trainer_state.json``; raises on non-finite weights.
        data_source: its ``state_dict`` is stored so a resume continues on the same data order.
        weight_version: the engines' weight version.
        config: the resolved run config, stored as ``config.yaml``; None stores none.
        tokenizer: saved into ``model/`` (anything with ``save_pretrained``) so the model dir is complete.
        keep: checkpoints to keep (the one ``latest`` names always survives); 0 keeps all.
        rank: this process's rank (names the RNG file).
    Returns: the published directory.
    """
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(checkpoints_dir)
    final = checkpoints_dir / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=checkpoints_dir))
    try:
        backend.save(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        state = {"step": step, "weight_version": weight_version, "data_source": data_source.state_dict()}
        (tmp / RUN_STATE).write_text(json.dumps(state, indent=2))
        (tmp / f"rng_rank{rank}.json").write_text(json.dumps(capture_rng_state()))
        if config is not None:
            (tmp / "config.yaml").write_text(yaml.safe_dump(dict(config), sort_keys=False))
        _default_permissions(tmp)
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (resumed from an older checkpoint): move the old one aside first
            os.replace(final, checkpoints_dir / f".trash-{final.name}-{os.getpid()}")
        os.replace(tmp, final)
        _fsync_dir(checkpoints_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(checkpoints_dir / LATEST, final.name + "\n")
    if keep:
        prune_checkpoints(checkpoints_dir, keep=keep)
    _remove_leftovers(checkpoints_dir)
    return final


def prune_checkpoints(checkpoints_dir: Path, *, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` ``step_N`` dirs; the one ``latest`` names is never deleted.

    Each victim is first renamed to ``.trash-*`` (atomic), so a crash mid-delete never leaves a partial
    ``step_N`` that could be mistaken for a checkpoint. Returns: the deleted directories.
    """
    latest = read_latest(checkpoints_dir)
    steps = sorted(_step_dirs(checkpoints_dir), key=lambda p: _step_of(p), reverse=True)
    victims = [p for p in steps[keep:] if latest is None or p.name != latest.name]
    for victim in victims:
        trash = checkpoints_dir / f".trash-{victim.name}-{os.getpid()}"
        os.replace(victim, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return victims


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# -- load -----------------------------------------------------------------------------------------------
def read_latest(checkpoints_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, or None if there is no checkpoint yet.

    If ``latest`` is missing or names a directory that is gone (a crash between publishing ``step_N`` and
    replacing ``latest``, or a hand-deleted dir), the newest complete ``step_N`` is returned instead: every
    ``step_N`` was published whole by a rename.
    """
    latest = checkpoints_dir / LATEST
    if latest.is_file():
        named = checkpoints_dir / latest.read_text().strip()
        if (named / RUN_STATE).is_file():
            return named
        logger.warning("%s names %s, which is not a complete checkpoint; using the newest step dir", latest, named)
    candidates = [p for p in _step_dirs(checkpoints_dir) if (p / RUN_STATE).is_file()]
    return max(candidates, key=_step_of) if candidates else None


def checkpoint_in(path: Path, *, flag: str) -> Path:
    """The checkpoint a command-line ``path`` names: a ``step_N`` directory itself; a run directory
    (``runs/NAME``) or its ``checkpoints/``: the checkpoint ``latest`` names there (``read_latest``); anything else
    as it is (the command says what it lacks).

    Raises: FileNotFoundError naming ``flag`` for a run directory without a checkpoint yet.
    """
    path = Path(path)
    if (path / RUN_STATE).is_file():
        return path
    run_dir = (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file()
    checkpoints = path / "checkpoints" if run_dir else path
    if not run_dir and not ((path / LATEST).is_file() or _step_dirs(path)):
        return path
    latest = read_latest(checkpoints)
    if latest is None:
        raise FileNotFoundError(
            f"{flag} {path}: that run has no checkpoint yet (one is saved every loop.save_interval steps, after the "
            "last step and on Ctrl-C); pass a runs/<name>/checkpoints/step_N directory of a run that saved one"
        )
    return latest


def load_run_state(checkpoint_dir: Path) -> dict[str, Any]:
    """``run_state.json`` of a checkpoint directory."""
    return json.loads((checkpoint_dir / RUN_STATE).read_text())


def restore_run_checkpoint(
    checkpoint_dir: Path, *, backend: TrainBackend, data_source: DataSource, rank: int = 0
) -> RunState:
    """Load model, optimizer, scheduler, data-source position and RNG states from a checkpoint.

    Call it after every component is built (building a model consumes RNG draws), right before training.
    The caller pushes the restored weights to the engines with ``RunState.weight_version``.

    Raises: FileNotFoundError naming the checkpoint when it is not one.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / RUN_STATE).is_file():
        raise FileNotFoundError(
            f"--resume {checkpoint_dir}: no {RUN_STATE} there, so it is not a Miles checkpoint; pass a "
            "runs/<name>/checkpoints/step_N directory, or --resume alone with --run.name NAME"
        )
    state = load_run_state(checkpoint_dir)
    backend.load(checkpoint_dir)
    data_source.load_state_dict(state["data_source"])
    rng_file = checkpoint_dir / f"rng_rank{rank}.json"
    if rng_file.is_file():
        restore_rng_state(json.loads(rng_file.read_text()))
    else:
        logger.warning("%s has no RNG state for rank %d; RNG streams restart from their seeds", checkpoint_dir, rank)
    return RunState(step=state["step"], weight_version=state["weight_version"], data_source=state["data_source"])


# -- export ---------------------------------------------------------------------------------------------
def export_hf_model(checkpoint_dir: Path, out: Path) -> Path:
    """Write the checkpoint's model as a plain HF directory (config, safetensors, tokenizer) at ``out``; a diffusion
    run's tiny flow model (``miles_flow.json`` + ``transformer/``, diffusers' layout) is copied as it is, an SD3 or
    Qwen-Image pipeline's is written as the whole pipeline with the trained transformer (``StableDiffusion3Pipeline``,
    ``QwenImagePipeline``).

    The copy goes to a temporary sibling and is renamed into place, so ``out`` is complete or absent.

    Raises:
        FileNotFoundError: the checkpoint has no complete ``model/`` (config.json, model.safetensors, tokenizer;
            a flow model: miles_flow.json, transformer weights), naming what it lacks.
        FileExistsError: ``out`` exists (nothing is overwritten).
        ValueError: a weight holds NaN/inf.
    """
    from safetensors.torch import load_file

    src, out = Path(checkpoint_dir) / "model", Path(out)
    fix = "pass a runs/<name>/checkpoints/step_N directory (or the run directory runs/<name>: its latest checkpoint)"
    if not Path(checkpoint_dir).is_dir():
        raise FileNotFoundError(f"--checkpoint {checkpoint_dir} does not exist; {fix}")
    if not src.is_dir():
        raise FileNotFoundError(
            f"--checkpoint {checkpoint_dir}: no model/ there, so it is not a Miles checkpoint; {fix}"
        )
    if (src / FLOW_META).is_file() or _recorded_kind(Path(checkpoint_dir)) == "diffusion":  # a flow model
        weights = src / "transformer" / "diffusion_pytorch_model.safetensors"
        missing = [f for f in (FLOW_META, "transformer/diffusion_pytorch_model.safetensors") if not (src / f).is_file()]
        if not missing and json.loads((src / FLOW_META).read_text()).get("kind") in PIPELINES:
            return _export_pipeline(src, out)
    else:
        weights = src / "model.safetensors"
        missing = [f for f in ("config.json", "model.safetensors") if not (src / f).is_file()]
        if not any((src / f).is_file() for f in _TOKENIZER_FILES):
            missing.append("tokenizer.json")
    if missing:
        raise FileNotFoundError(
            f"--checkpoint {checkpoint_dir}: {src} lacks {missing}; pass a runs/<name>/checkpoints/step_N directory"
        )
    if out.exists():
        raise FileExistsError(f"--out {out} already exists; pass a new directory (export never overwrites)")
    bad = [name for name, t in load_file(weights).items() if not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"--checkpoint {checkpoint_dir}: weights {bad[:3]} hold NaN/inf; export an earlier step")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        _default_permissions(tmp)
        _fsync_tree(tmp)
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _recorded_kind(checkpoint_dir: Path) -> str | None:
    """The ``kind`` a checkpoint's ``config.yaml`` records (``diffusion``), or None (an LLM run, or no file)."""
    path = checkpoint_dir / "config.yaml"
    raw = yaml.safe_load(path.read_text()) if path.is_file() else None
    return raw.get("kind") if isinstance(raw, dict) else None


def _export_pipeline(src: Path, out: Path) -> Path:
    """A diffusion run's SD3 / Qwen-Image model as a whole diffusers pipeline at ``out`` (temporary sibling, then
    renamed)."""
    from miles.diffusion.models import export_pipeline, load_flow_model

    if out.exists():
        raise FileExistsError(f"--out {out} already exists; pass a new directory (export never overwrites)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        export_pipeline(load_flow_model(src), tmp)
        _fsync_tree(tmp)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# -- helpers ----------------------------------------------------------------------------------------------
def _default_permissions(root: Path) -> None:
    """Give a tree the modes a plain mkdir/open would (mkdtemp and some writers use 0700/0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for path in root.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _step_dirs(checkpoints_dir: Path) -> list[Path]:
    if not checkpoints_dir.is_dir():
        return []
    return [p for p in checkpoints_dir.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def _remove_leftovers(checkpoints_dir: Path) -> None:
    """Remove ``.tmp-*`` / ``.trash-*`` dirs and ``.latest.tmp-*`` files a killed save or prune left behind
    (one writer per run)."""
    for path in checkpoints_dir.iterdir():
        if path.is_dir() and path.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_file() and path.name.startswith(f".{LATEST}.tmp-"):
            path.unlink(missing_ok=True)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under root: the rename that publishes it must not outrun the data."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
