"""Checkpoints that need their own Python code to load, found before transformers would fail on them.

A checkpoint names its own classes under ``auto_map`` (Kimi K2's tokenizer: ``tokenization_kimi.TikTokenTokenizer``
in tokenizer_config.json); transformers imports them only with ``trust_remote_code=True``. Without it, it raises a
long ValueError from inside the first ``from_pretrained`` when it has no class of its own for that file, or (for a
tokenizer of a model type it knows, as Kimi K2.5's kimi_k25) silently falls back to a generic tokenizer.
``check_remote_code`` reads the JSON files alone (nothing imported from the checkpoint, no code run) so that a run
refuses such a checkpoint up front, in one line naming the setting to change. An ``auto_map`` beside a class
transformers holds itself (DeepSeek-V3's config.json: model type deepseek_v3) needs no trust: transformers then
loads its own class, as it did before this check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "TRUST_REMOTE_CODE_EXTRA_ARG",
    "TRUST_REMOTE_CODE_FLAG",
    "check_remote_code",
    "remote_code_files",
]

TRUST_REMOTE_CODE_FLAG = "--trust-remote-code"
"""The server flag (vLLM, SGLang, ``miles serve``) that lets a server run the checkpoint's code."""

TRUST_REMOTE_CODE_EXTRA_ARG = (
    "engine.extra_args has --trust-remote-code; set --models.policy.trust-remote-code true instead, which the "
    "servers get from it and the trainer and tokenizer need as well"
)
"""The refusal of ``--trust-remote-code`` among a server's extra arguments."""


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when it is absent, unreadable or not an object (transformers reports those)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _is_transformers_class(name: Any) -> bool:
    """Whether transformers itself holds the class ``name`` (a "...Fast" name or its slow twin)."""
    import transformers

    return isinstance(name, str) and any(
        hasattr(transformers, candidate) for candidate in (name, name.removesuffix("Fast"), name + "Fast")
    )


def remote_code_files(path: str | Path) -> list[str]:
    """The files of the checkpoint directory ``path`` whose ``auto_map`` names a class that transformers has no
    class of its own for, so that loading them needs the checkpoint's code: config.json (an unknown model type),
    tokenizer_config.json (an unknown ``tokenizer_class``, or none and a model type without a tokenizer),
    preprocessor_config.json / processor_config.json (an unknown image processor / processor class).
    [] for a path that is not a directory or has none."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    root = Path(path).expanduser()
    config = _read_json(root / "config.json")
    model_type = config.get("model_type")
    found = []
    if "AutoConfig" in config.get("auto_map", {}) and model_type not in CONFIG_MAPPING_NAMES:
        found.append("config.json")
    tokenizer = _read_json(root / "tokenizer_config.json")
    if "AutoTokenizer" in tokenizer.get("auto_map", {}):
        name = tokenizer.get("tokenizer_class")
        known = (
            tokenizer_class_from_name(name.removesuffix("Fast")) is not None
            or tokenizer_class_from_name(name.removesuffix("Fast") + "Fast") is not None
            if isinstance(name, str)
            else model_type in TOKENIZER_MAPPING_NAMES
        )
        if not known:
            found.append("tokenizer_config.json")
    for file, auto, key in (
        ("preprocessor_config.json", "AutoImageProcessor", "image_processor_type"),
        ("processor_config.json", "AutoProcessor", "processor_class"),
    ):
        data = _read_json(root / file)
        if auto in data.get("auto_map", {}) and not _is_transformers_class(data.get(key)):
            found.append(file)
    return found


def check_remote_code(path: str | Path, *, trusted: bool, where: str, fix: str) -> None:
    """Refuse the checkpoint directory ``path`` when loading it needs its own code and ``trusted`` is false.

    Args:
        path: a local checkpoint directory (anything else passes: nothing to read).
        trusted: the setting that allows the checkpoint's code (``models.<model>.trust_remote_code``).
        where: the setting that names the checkpoint, e.g. "models.policy.path".
        fix: how to allow its code, e.g. "set --models.policy.trust-remote-code true".
    Raises: ValueError, one line: the path, the files with ``auto_map``, the fix and its security meaning.
    """
    if trusted or not (files := remote_code_files(path)):
        return
    raise ValueError(
        f"{where} {path} ships its own code (auto_map in {', '.join(files)}), which runs only when trusted: "
        f"{fix} if you trust that checkpoint's files (its Python runs with this run's permissions)"
    )
