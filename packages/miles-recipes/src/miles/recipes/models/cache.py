"""The model cache: directories Miles builds once (a de-quantized SmolLM2, the tiny random twins, ``tiny-sd3``) under
``$MILES_CACHE_DIR/models`` (default ``~/.cache/miles/models``), each published by an atomic rename."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def default_cache_dir() -> Path:
    """The model cache root: ``$MILES_CACHE_DIR/models`` if set, else ``~/.cache/miles/models``."""
    root = os.environ.get("MILES_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "miles") / "models"


def publish_model_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """Build a model directory at ``target`` atomically: ``build(tmp)`` writes it into a temporary sibling
    directory, which is then renamed to ``target``, so a crash never leaves a half-written model that later runs
    would load. A concurrent process that published ``target`` first wins (its copy is complete); ours is removed.

    Returns: ``target``. Raises: what ``build`` raises (nothing is left behind), OSError from the rename.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # lost a race with another process: theirs is complete (a model, or a diffusers pipeline)
            if not ((target / "config.json").exists() or (target / "model_index.json").exists()):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def ensure_built(
    name: str,
    build: Callable[[Path], None],
    *,
    logger: logging.Logger,
    cache_dir: Path | None = None,
    marker: str = "config.json",
) -> Path:
    """``cache_dir / name`` (default ``default_cache_dir()``), built by ``build`` on first use with
    ``publish_model_dir``; it counts as built once ``marker`` (a file inside it) exists. The "built" line goes to
    ``logger``, the model module's own (the console names the model's module, not this helper's).

    Returns: the directory. Raises: what ``build`` raises.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / name
    if (target / marker).exists():
        return target
    start = time.perf_counter()
    publish_model_dir(target, build)
    logger.info("built %s in %.1fs", target, time.perf_counter() - start)
    return target
