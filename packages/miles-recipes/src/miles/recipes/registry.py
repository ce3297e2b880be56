"""Recipes (YAML files shipped in ``miles/recipes/recipes/``) and registered model names.

A recipe may start from others: ``base: NAME`` or ``base: [NAME, ...]`` (shipped recipes, the shared parts under
``recipes/bases/`` such as ``bases/model/qwen3_moe``, or YAML paths relative to the recipe's own file) and give only
its differences; a list composes its bases left to right (model x algorithm x task), then the recipe itself. The
merge is deep: mappings merge key by key, any other value (a list, a scalar, ``null``) replaces the earlier one, so
``kl: null`` turns a section of a base off.

A recipe (or one of its bases) may carry a ``tiny`` section: the overrides that run it on its model family's tiny
twin on a CPU (``miles train --recipe NAME --tiny``; ``miles.recipes.models.tiny``); ``tiny`` sections compose like
the recipes and are applied last.
"""

from __future__ import annotations

import copy
import difflib
import functools
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from miles.recipes.models import tiny
from miles.recipes.models.smollm2 import ensure_smollm2
from miles.recipes.models.smollm2_vl import MODEL_NAME as SMOLLM2_VL
from miles.recipes.models.smollm2_vl import ensure_smollm2_vl
from miles.recipes.models.tiny_smolvlm import MODEL_NAME as TINY_SMOLVLM
from miles.recipes.models.tiny_smolvlm import ensure_tiny_smolvlm
from miles.rollout.remote_code import check_remote_code

MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m-instruct": ensure_smollm2,
    SMOLLM2_VL: ensure_smollm2_vl,
    TINY_SMOLVLM: ensure_tiny_smolvlm,
    **{tiny.model_name(family): functools.partial(tiny.ensure_tiny, family) for family in tiny.FAMILIES},
}


def recipe_names() -> list[str]:
    """Names of the shipped recipes (file stems)."""
    root = resources.files("miles.recipes") / "recipes"
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def _read_recipe(name_or_path: str, *, relative_to: Path | None = None) -> tuple[dict[str, Any], Path | None]:
    """The raw mapping of one recipe file (its ``base`` not applied) and the file's directory for a path recipe."""
    text, folder, _ = _recipe_text(name_or_path, relative_to=relative_to)
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"recipe {name_or_path!r} must be a YAML mapping, got {type(data).__name__}")
    return data, folder


def _recipe_text(name_or_path: str, *, relative_to: Path | None = None) -> tuple[str, Path | None, str]:
    """One recipe file's text, its directory for a path recipe (None for a shipped one), and its label: the path,
    or ``recipes/NAME.yaml`` for a shipped one."""
    path = Path(name_or_path)
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path.read_text(), path.absolute().parent, str(path)
    resource = resources.files("miles.recipes") / "recipes" / f"{name_or_path}.yaml"
    if not resource.is_file():
        names = recipe_names()
        near = [n for n in names if name_or_path and n.startswith(name_or_path)]
        near = near or difflib.get_close_matches(name_or_path, names)
        hint = f"; did you mean --recipe {near[0]}?" if near else ""
        raise ValueError(f"--recipe {name_or_path!r} is neither a shipped recipe {names} nor a YAML file{hint}")
    return resource.read_text(), None, f"recipes/{name_or_path}.yaml"


def merge_recipe(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` deep-merged onto a copy of ``base``: mappings key by key, anything else replaces. A mapping
    whose ``type`` differs from the base's (``engine.type`` embedded -> sglang, ``reward.type`` ...) replaces it
    whole: the other type's fields do not apply to it."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        old = merged.get(key)
        # as miles.recipes.overrides does: only when both name a type, and another one
        switched = isinstance(value, dict) and isinstance(old, dict) and "type" in value and "type" in old
        switched = switched and value["type"] != old["type"]
        if isinstance(value, dict) and isinstance(old, dict) and not switched:
            merged[key] = merge_recipe(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_recipe(name_or_path: str, *, tiny: bool = False) -> dict[str, Any]:
    """The raw config dict of a shipped recipe name, or of a YAML file path, with its bases merged in (and with
    ``tiny``, its ``tiny`` sections applied last).

    Raises: ValueError listing the shipped recipes when a name is unknown, naming a ``base`` cycle, or (``tiny``)
        naming the recipes that have a tiny twin when this one has none.
    """
    merged, tiny_overrides = _load_composed(name_or_path, None, ())
    if not tiny:
        return merged
    if not tiny_overrides:
        raise ValueError(
            f"recipe {name_or_path!r} has no tiny twin (no `tiny:` section); --tiny works with {tiny_recipe_names()}"
        )
    return merge_recipe(merged, tiny_overrides)


def _load_composed(name: str, folder: Path | None, stack: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(recipe, tiny overrides) of ``name`` with its bases composed in, depth first."""
    data, here = _read_recipe(name, relative_to=folder)
    key = str(here / Path(name).name) if here is not None else name
    if key in stack:
        raise ValueError(f"recipe {stack[0]!r}: its base chain {' -> '.join([*stack, key])} is a cycle")
    data.pop("description", None)
    bases = data.pop("base", None)
    own_tiny = data.pop("tiny", None) or {}
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ValueError(f"recipe {name!r}: base must be a recipe name or YAML path, or a list of them, got {bases!r}")
    if not isinstance(own_tiny, dict):
        raise ValueError(f"recipe {name!r}: tiny must be a mapping of config overrides, got {own_tiny!r}")
    merged: dict[str, Any] = {}
    tiny_overrides: dict[str, Any] = {}
    for base in bases:
        base_config, base_tiny = _load_composed(base, here, (*stack, key))
        merged, tiny_overrides = merge_recipe(merged, base_config), merge_recipe(tiny_overrides, base_tiny)
    return merge_recipe(merged, data), merge_recipe(tiny_overrides, own_tiny)


def recipe_files(name_or_path: str) -> list[tuple[str, str]]:
    """(label, text) of each file a recipe composes, as written (comments kept): its bases depth first, then the
    recipe itself; a file reached twice is listed once, where it is first reached."""
    files: list[tuple[str, str]] = []
    seen: set[str] = set()

    def visit(name: str, folder: Path | None) -> None:
        text, here, label = _recipe_text(name, relative_to=folder)
        if label in seen:  # a base shared by two bases (or a cycle, which load_recipe refuses)
            return
        seen.add(label)
        data = yaml.safe_load(text) or {}
        bases = (data.get("base") or []) if isinstance(data, dict) else []
        for base in [bases] if isinstance(bases, str) else bases:
            visit(base, here)
        files.append((label, text))

    visit(name_or_path, None)
    return files


def commented_lines(text: str) -> list[str]:
    """The lines of a YAML text that carry a comment, as written, with the keys that place them: the line under a
    comment block (the key it is about) and the parent keys of a nested line (``train:`` above ``  world_size: 256
    # ...``); other lines are dropped."""
    lines = text.splitlines()
    kept: set[int] = set()
    for i, line in enumerate(lines):
        under_note = i > 0 and line.strip() and lines[i - 1].lstrip().startswith("#")
        if _has_comment(line) or under_note:
            kept.add(i)
            kept.update(_parent_lines(lines, i))
    return [lines[i] for i in sorted(kept)]


def _parent_lines(lines: list[str], index: int) -> list[int]:
    """The indices of the keys a line is nested in: each nearest line above it that is less indented."""
    parents, indent = [], _indent(lines[index])
    for i in range(index - 1, -1, -1):
        text = lines[i].strip()
        if text and not text.startswith("#") and _indent(lines[i]) < indent:
            parents.append(i)
            indent = _indent(lines[i])
    return parents


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _has_comment(line: str) -> bool:
    """Whether a YAML line holds a comment: a ``#`` at its start or after a space, outside a quoted scalar (one that
    opens with its quote: ``Kimi's`` in a plain scalar is no quote)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"" and (i == 0 or line[i - 1] in " [{,:"):
            quote = char
        elif char == "#" and (i == 0 or line[i - 1] in " \t"):
            return True
    return False


def recipe_bases(name_or_path: str) -> list[str]:
    """The bases a recipe names directly (``base``), in order."""
    data, _ = _read_recipe(name_or_path)
    bases = data.get("base") or []
    return [bases] if isinstance(bases, str) else list(bases)


def tiny_recipe_names() -> list[str]:
    """The shipped recipes with a tiny twin (a ``tiny`` section of their own or from a base)."""
    return [name for name in recipe_names() if _load_composed(name, None, ())[1]]


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
    flag = f"--{key.replace('_', '-')}"
    hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith(("/", ".", "~"))
    fix = (
        f"Miles does not download models: fetch {name_or_path} (e.g. `huggingface-cli download {name_or_path} "
        f"--local-dir DIR`) and pass {flag} DIR; on a CPU, a recipe with a tiny twin runs with --tiny."
        if hub_id
        else f"Pass {flag} smollm2-135m-instruct or a local HF model directory."
    )
    if near := difflib.get_close_matches(name_or_path, list(MODELS), n=1, cutoff=0.8):  # a typo of a registered name
        fix = f"Did you mean {flag} {near[0]}?"
    raise ValueError(
        f"{key} is {name_or_path!r}: not a registered model ({', '.join(sorted(MODELS))}) and not a directory with "
        f"config.json. {fix}"
    )


def check_model_code(name_or_path: str, *, key: str, trusted: bool) -> None:
    """Refuse a model directory that ships its own code (``auto_map`` in its config.json, tokenizer_config.json,
    ...) unless ``trusted`` (the ``trust_remote_code`` beside ``key``); registered models ship none. Reads JSON only.

    Raises: ValueError naming ``key``, the files and the setting to turn on.
    """
    if name_or_path in MODELS:
        return
    setting = key.removesuffix(".path") + ".trust_remote_code"
    fix = f"set {setting}: true (--{setting.replace('_', '-')} true)"
    check_remote_code(name_or_path, trusted=trusted, where=key, fix=fix)


def resolve_model_path(name_or_path: str, *, key: str = "models.policy.path") -> Path:
    """A registered model name (converted into the cache on first use) or an existing HF model directory.

    Raises: ValueError naming ``key`` when it is neither.
    """
    check_model_path(name_or_path, key=key)
    if name_or_path in MODELS:
        return MODELS[name_or_path]()
    return Path(name_or_path).expanduser()
