"""Recipes (YAML files shipped in ``miles/recipes/recipes/``) and registered model names."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from miles.recipes.models.smollm2 import ensure_smollm2

MODELS: dict[str, Callable[[], Path]] = {"smollm2-135m-instruct": ensure_smollm2}


def recipe_names() -> list[str]:
    """Names of the shipped recipes (file stems)."""
    root = resources.files("miles.recipes") / "recipes"
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """The raw config dict of a shipped recipe name, or of a YAML file path.

    Raises: ValueError listing the shipped recipes when the name is unknown.
    """
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        text = path.read_text()
    else:
        resource = resources.files("miles.recipes") / "recipes" / f"{name_or_path}.yaml"
        if not resource.is_file():
            raise ValueError(f"--recipe {name_or_path!r} is neither a shipped recipe {recipe_names()} nor a YAML file")
        text = resource.read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"recipe {name_or_path!r} must be a YAML mapping, got {type(data).__name__}")
    data.pop("description", None)
    return data


def recipe_description(name: str) -> str:
    """The ``description`` line of a shipped recipe."""
    text = (resources.files("miles.recipes") / "recipes" / f"{name}.yaml").read_text()
    return str((yaml.safe_load(text) or {}).get("description", ""))


def resolve_model_path(name_or_path: str) -> Path:
    """A registered model name (converted into the cache on first use) or an existing HF model directory.

    Raises: ValueError naming ``model.path`` when it is neither.
    """
    if name_or_path in MODELS:
        return MODELS[name_or_path]()
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.path is {name_or_path!r}: not a registered model {sorted(MODELS)} and not a directory with "
            "config.json. Pass --model.path smollm2-135m-instruct or a local HF model directory."
        )
    return path
