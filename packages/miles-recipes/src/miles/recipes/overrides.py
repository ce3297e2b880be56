"""Dotted command-line overrides (``--rollout.n-samples-per-prompt 8``) applied to a raw config dict."""

from __future__ import annotations

import copy
import textwrap
import types
import typing
from typing import Any

import yaml
from miles.core.algorithms.config import section_switch
from pydantic import BaseModel


def parse_overrides(args: list[str], schema: type[BaseModel] | None = None) -> dict[str, Any]:
    """``["--a.b-c", "1", "--d", "x"]`` -> ``{"a.b_c": 1, "d": "x"}``; values are parsed as YAML scalars.

    With ``schema`` (the root config class), the value of a list-typed key whose items are scalars may also be a
    plain comma list: ``--algorithm.lora.target-modules to_q,to_k`` is ``["to_q", "to_k"]`` (the YAML form
    ``'[to_q, to_k]'`` still works, and is needed for items that hold a comma). Other keys keep their commas.

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
        key = key.replace("-", "_")
        item = list_item_type(schema, key) if schema is not None else None
        overrides[key] = _parse_value(value, item)
        i += 1
    return overrides


def _parse_value(value: str, list_item: Any = None) -> Any:
    """One override's text as YAML; for a list-typed key (``list_item``: its item type) a text that is not a YAML
    list or null is a comma list, each item a string for string items, else a YAML scalar."""
    parsed = yaml.safe_load(value) if value != "" else ""
    if list_item is None or parsed is None or isinstance(parsed, list | dict):
        return parsed
    if value.lstrip().startswith(("'", '"')):  # one quoted item, commas and all
        return [parsed]
    items = [part.strip() for part in value.split(",")] if value.strip() else []
    return items if list_item is str else [yaml.safe_load(part) for part in items]


def list_item_type(schema: type[BaseModel], dotted: str) -> Any:
    """The item type of the config key ``dotted`` when it is a list (or ``tuple[X, ...]``, optionally ``| None``)
    of scalars in every section class that has it (``str`` for string and string-literal items), else None."""
    holders: list[type[BaseModel]] = [schema]
    *parents, leaf = dotted.split(".")
    for part in parents:
        holders = [
            m for h in holders if part in h.model_fields for m in _section_members(h.model_fields[part].annotation)
        ]
    items = [_scalar_list_item(h.model_fields[leaf].annotation) for h in holders if leaf in h.model_fields]
    if not items or any(item is None for item in items):
        return None
    return str if str in items else items[0]


def _scalar_list_item(annotation: Any) -> Any:
    """``list[X]`` / ``tuple[X, ...]`` (or ``... | None``) of a scalar X -> X (``str`` for a str Literal); else None."""
    members = [a for a in typing.get_args(annotation) if a is not type(None)] if _is_union(annotation) else [annotation]
    if len(members) != 1:
        return None
    origin, args = typing.get_origin(members[0]), typing.get_args(members[0])
    if origin is list and len(args) == 1:
        item = args[0]
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
    else:
        return None
    if typing.get_origin(item) is typing.Literal:
        return str if all(isinstance(v, str) for v in typing.get_args(item)) else None
    return item if item in (str, int, float, bool) else None


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with each dotted key set (intermediate sections are created).

    A key inside a section that is off (``null``, or absent with a null default) turns it on, the other fields at
    their defaults: ``--algorithm.kl.coef 0.1``; ``--algorithm.kl null`` turns it off again. Changing a section's
    ``type`` (``--engine.type vllm``) starts that section afresh: the keys written for the old type are dropped,
    and the section's other overrides apply on top, whatever their order. Unknown keys are kept so that
    validation reports them with the allowed names.
    """
    result = copy.deepcopy(config)
    type_first = sorted(overrides.items(), key=lambda item: item[0].rsplit(".", 1)[-1] != "type")
    for dotted, value in type_first:
        node = result
        *parents, leaf = dotted.split(".")
        for part in parents:
            child = section_switch(node.get(part))
            if child is None:  # absent or off: turned on, the other keys at their defaults
                child = {}
            if not isinstance(child, dict):
                raise ValueError(f"--{dotted}: {part!r} is a value, not a section")
            node[part] = child
            node = child
        if leaf == "type" and parents and node.get("type", value) != value:
            node.clear()
        node[leaf] = value
    return result


def format_validation_error(err: Any, model: type[BaseModel] | None = None) -> str:
    """One line per pydantic error: ``dotted.key [--cli-form]: reason (got value)``.

    Cross-field errors (raised by a section's validator) already name their keys, so they are printed as is;
    an unknown key lists the valid keys of its section (``model`` is the root config class) and, for a key of the
    flat layout of an older Miles, where it lives now.
    """
    from miles.recipes.config import REMOVED_KEYS, RENAMED_KEYS

    lines = ["invalid configuration:"]
    for e in err.errors():
        parts, section = _config_loc(model, e["loc"])
        key = ".".join(parts)
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error":  # a model_validator: the message names the keys and the fix
            lines.append(f"  {message}")
            continue
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        if e["type"] == "extra_forbidden":
            message = "unknown key"
        if key in RENAMED_KEYS:
            message += f" (a key of the flat layout of an older Miles; it is now {RENAMED_KEYS[key]})"
        if key in REMOVED_KEYS:
            message += f" (removed: {REMOVED_KEYS[key]})"
        if e["type"] == "extra_forbidden" and section is not None:
            message += f"; valid keys here: {', '.join(section.model_fields)}"
            message += _other_member_hint(model, parts, section)
        if e["type"] == "missing" and len(parts) > 1:  # a required key of an optional section that was turned on
            section_key = ".".join(parts[:-1])
            message += f" while {section_key} is on (or turn it off: --{section_key.replace('_', '-')} null)"
        lines.append(f"  {key} [--{key.replace('_', '-')}]: {message}{got}")
    return "\n".join(lines)


def _section_members(annotation: Any) -> list[type[BaseModel]]:
    """The config section classes a field annotation allows: the model, the model of ``Section | None``, or the
    members of a union of sections (the engine)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    members: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):  # through Annotated[...] and unions of Annotated members
        members += [m for m in _section_members(arg) if m not in members]
    return members


def section_class(annotation: Any) -> type[BaseModel] | None:
    """The one config section class of a field annotation (``Section`` or ``Section | None``), else None."""
    members = _section_members(annotation)
    return members[0] if len(members) == 1 else None


def _config_loc(model: type[BaseModel] | None, loc: tuple) -> tuple[list[str], type[BaseModel] | None]:
    """The dotted config key of a pydantic error location, without the tags pydantic adds for a discriminated
    union (``engine.embedded.dtype`` -> ``engine.dtype``), and the section class holding its last part."""
    parts: list[str] = []
    candidates = [model] if model is not None else []
    holder = model
    for part in map(str, loc):
        tagged = [c for c in candidates if part not in c.model_fields and _type_tag(c) == part]
        if tagged:
            candidates = tagged
            continue
        parts.append(part)
        owner = next((c for c in candidates if part in c.model_fields), None)
        holder = owner if owner is not None else (candidates[0] if len(candidates) == 1 else None)
        candidates = _section_members(owner.model_fields[part].annotation) if owner is not None else []
    return parts, holder


def _other_member_hint(model: type[BaseModel] | None, parts: list[str], section: type[BaseModel]) -> str:
    """For an unknown key of one member of a union section (``engine``) that other members have: which ``type``
    takes it (``engine.pause_mode`` on the embedded engine: "it belongs to engine.type vllm, sglang")."""
    tag = _type_tag(section)
    if model is None or tag is None or len(parts) != 2 or parts[0] not in model.model_fields:
        return ""
    members = _section_members(model.model_fields[parts[0]].annotation)
    owners = [_type_tag(m) for m in members if parts[1] in m.model_fields and m is not section]
    if not owners:
        return ""
    types = ", ".join(str(o) for o in owners)
    return f" (it belongs to {parts[0]}.type {types}; this {parts[0]} is {tag!r})"


def _type_tag(section: type[BaseModel]) -> str | None:
    """The ``type`` literal of a member of a discriminated union section (``embedded``), or None."""
    field = section.model_fields.get("type")
    return field.default if field is not None and isinstance(field.default, str) else None


def documented_yaml(config: BaseModel, indent: int = 0, prefix: str = "") -> str:
    """YAML of a config with each field's description as a comment above it (``miles config show``).

    A section that is off prints as ``null`` followed by its fields (defaults, or ``<required>``) as comments, and a
    list of sections (``data.mixture``) prints its entries followed by an entry's fields the same way, so every field
    is shown and the output still loads as the config.
    """
    lines = []
    pad = " " * indent
    for name, field in type(config).model_fields.items():
        value = getattr(config, name)
        if field.description:
            lines.extend(f"{pad}# {line}" for line in _wrap(field.description, 116 - indent))
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            lines.append(documented_yaml(value, indent + 2, f"{prefix}{name}."))
        elif value is None and section_class(field.annotation) is not None:
            flag = "--" + f"{prefix}{name}".replace("_", "-")
            lines.append(f"{pad}{name}: null  # off; {flag}.KEY VALUE turns it on, the other keys at these defaults")
            lines.append(_documented_defaults(section_class(field.annotation), indent + 2))
        elif isinstance(value, list) and section_class(field.annotation) is not None:  # data.mixture, eval.sets
            lines.append(pad + _dumped(name, value))
            lines.append(f"{pad}  # each entry's keys, at their defaults:")
            lines.append(_documented_defaults(section_class(field.annotation), indent + 2))
        else:
            lines.append(pad + _dumped(name, value))
    return "\n".join(lines)


def _documented_defaults(section: type[BaseModel], indent: int) -> str:
    """The fields of a section that is off, as comments: description, then ``# key: default``."""
    lines = []
    pad = " " * indent
    for name, field in section.model_fields.items():
        if field.description:
            lines.extend(f"{pad}# {line}" for line in _wrap(field.description, 114 - indent))
        nested = section_class(field.annotation)
        if field.is_required():
            lines.append(f"{pad}# {name}: <required>")
        elif nested is not None and field.get_default(call_default_factory=True) is not None:
            lines.append(f"{pad}# {name}:")
            lines.append(_documented_defaults(nested, indent + 2))
        else:
            lines.append(f"{pad}# {_dumped(name, field.get_default(call_default_factory=True))}")
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False)  # "log-probs" stays one word


def _dumped(name: str, value: Any) -> str:
    dumped = yaml.safe_dump({name: _plain(value)}, sort_keys=False, default_flow_style=True, width=1000)
    return dumped.strip().removeprefix("{").removesuffix("}")


def _plain(value: Any) -> Any:
    """JSON-like Python values (tuples -> lists, sections in a list such as data.mixture -> dicts) for YAML dumping."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
