"""Dotted command-line overrides (``--rollout.n-samples-per-prompt 8``) applied to a raw config dict."""

from __future__ import annotations

import copy
from typing import Any

import yaml


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


def format_validation_error(err: Any) -> str:
    """One line per pydantic error: dotted key, CLI form, message."""
    lines = ["invalid configuration:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        cli = "--" + key.replace("_", "-") if key else "(root)"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"  {key or '(root)'} [{cli}]: {e['msg']}{got}")
    return "\n".join(lines)
