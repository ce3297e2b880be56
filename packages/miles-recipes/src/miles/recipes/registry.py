"""Recipes (YAML files shipped in ``miles/recipes/recipes/``) and registered model names.

A recipe may start from another: ``base: NAME`` (a shipped recipe, or a YAML path relative to the recipe's own
file) and give only its differences. The merge is deep: mappings merge key by key, any other value (a list, a
scalar, ``null``) replaces the base's, so ``kl: null`` turns a section of the base off.
"""

from __future__ import annotations

import copy
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


def _read_recipe(name_or_path: str, *, relative_to: Path | None = None) -> tuple[dict[str, Any], Path | None]:
    """The raw mapping of one recipe file (its ``base`` not applied) and the file's directory for a path recipe."""
    path = Path(name_or_path)
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if path.suffix in (".yaml", ".yml") and path.is_file():
        text, folder = path.read_text(), path.absolute().parent
    else:
        resource = resources.files("miles.recipes") / "recipes" / f"{name_or_path}.yaml"
        if not resource.is_file():
            raise ValueError(f"--recipe {name_or_path!r} is neither a shipped recipe {recipe_names()} nor a YAML file")
        text, folder = resource.read_text(), None
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"recipe {name_or_path!r} must be a YAML mapping, got {type(data).__name__}")
    return data, folder


def merge_recipe(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` deep-merged onto a copy of ``base``: mappings key by key, anything else replaces."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_recipe(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """The raw config dict of a shipped recipe name, or of a YAML file path, with its ``base`` chain merged in.

    Raises: ValueError listing the shipped recipes when a name is unknown, or naming a ``base`` cycle.
    """
    chain: list[dict[str, Any]] = []
    seen: list[str] = []
    name, folder = name_or_path, None
    while True:
        data, here = _read_recipe(name, relative_to=folder)
        key = str(here / Path(name).name) if here is not None else name
        if key in seen:
            raise ValueError(f"recipe {name_or_path!r}: its base chain {' -> '.join([*seen, key])} is a cycle")
        seen.append(key)
        data.pop("description", None)
        base = data.pop("base", None)
        chain.append(data)
        if base is None:
            break
        if not isinstance(base, str):
            raise ValueError(f"recipe {name!r}: base must be a recipe name or YAML path, got {base!r}")
        name, folder = base, here
    merged: dict[str, Any] = {}
    for data in reversed(chain):
        merged = merge_recipe(merged, data)
    return merged


def recipe_description(name: str) -> str:
    """The ``description`` line of a shipped recipe."""
    text = (resources.files("miles.recipes") / "recipes" / f"{name}.yaml").read_text()
    return str((yaml.safe_load(text) or {}).get("description", ""))


def check_model_path(name_or_path: str, *, key: str) -> None:
    """Refuse a model that is neither a registered name nor a directory with ``config.json`` (reads the disk).

    Raises: ValueError naming ``key`` and the fix.
    """
    if name_or_path in MODELS or (Path(name_or_path).expanduser() / "config.json").is_file():
        return
    raise ValueError(
        f"{key} is {name_or_path!r}: not a registered model {sorted(MODELS)} and not a directory with "
        f"config.json. Pass --{key.replace('_', '-')} smollm2-135m-instruct or a local HF model directory."
    )


def resolve_model_path(name_or_path: str, *, key: str = "models.policy.path") -> Path:
    """A registered model name (converted into the cache on first use) or an existing HF model directory.

    Raises: ValueError naming ``key`` when it is neither.
    """
    check_model_path(name_or_path, key=key)
    if name_or_path in MODELS:
        return MODELS[name_or_path]()
    return Path(name_or_path).expanduser()
