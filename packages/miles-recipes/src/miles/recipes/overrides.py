"""Dotted command-line overrides (``--rollout.n-samples-per-prompt 8``) applied to a raw config dict."""

from __future__ import annotations

import copy
import textwrap
from typing import Any

import yaml
from pydantic import BaseModel


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--a.b-c", "1", "--d", "x"]`` -> ``{"a.b_c": 1, "d": "x"}``; values are parsed as YAML scalars.

    Raises: ValueError for a token that is not ``--key`` or a key without a value.
    """
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--") or len(token) == 2:
            raise ValueError(f"unexpected argument {token!r}; overrides look like --section.key value")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ValueError(f"override --{key} has no value; write --{key} VALUE")
            value, i = args[i + 1], i + 1
        overrides[key.replace("-", "_")] = yaml.safe_load(value) if value != "" else ""
        i += 1
    return overrides


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with each dotted key set (intermediate sections are created).

    Unknown keys are kept so that validation reports them with the allowed names.
    """
    result = copy.deepcopy(config)
    for dotted, value in overrides.items():
        node = result
        *parents, leaf = dotted.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"--{dotted}: {part!r} is a value, not a section")
            node = child
        node[leaf] = value
    return result


def format_validation_error(err: Any, model: type[BaseModel] | None = None) -> str:
    """One line per pydantic error: ``dotted.key [--cli-form]: reason (got value)``.

    Cross-field errors (raised by a section's validator) already name their keys, so they are printed as is;
    an unknown key lists the valid keys of its section (``model`` is the root config class).
    """
    lines = ["invalid configuration:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error":  # a model_validator: the message names the keys and the fix
            lines.append(f"  {message}")
            continue
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        if e["type"] == "extra_forbidden":
            message = "unknown key"
            section = _section_model(model, e["loc"][:-1])
            if section is not None:
                message += f"; valid keys here: {', '.join(section.model_fields)}"
        lines.append(f"  {key} [--{key.replace('_', '-')}]: {message}{got}")
    return "\n".join(lines)


def _section_model(model: type[BaseModel] | None, loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class at a dotted location of the root config, or None."""
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return model


def documented_yaml(config: BaseModel, indent: int = 0) -> str:
    """YAML of a config with each field's description as a comment above it (``miles config show``)."""
    lines = []
    pad = " " * indent
    for name, field in type(config).model_fields.items():
        value = getattr(config, name)
        if field.description:
            lines.extend(f"{pad}# {line}" for line in textwrap.wrap(field.description, 116 - indent))
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            lines.append(documented_yaml(value, indent + 2))
        else:
            dumped = yaml.safe_dump({name: _plain(value)}, sort_keys=False, default_flow_style=True, width=1000)
            lines.append(pad + dumped.strip().removeprefix("{").removesuffix("}"))
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    """JSON-like Python values (tuples -> lists) for YAML dumping."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
