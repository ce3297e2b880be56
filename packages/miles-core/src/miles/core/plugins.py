"""Loading user extension points given as ``module:attr`` strings in config."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any


def load_plugin(path: str, *, key: str, num_positional: int | None = None) -> Callable[..., Any]:
    """Import ``module:attr`` and return the callable, failing at start-up with the config key in the message.

    Args:
        path: "package.module:function" (a dotted attr after the colon is allowed).
        key: the dotted config key that named it, e.g. "reward.path" (quoted in errors).
        num_positional: if given, the callable must accept exactly this many positional arguments.
    Raises: ValueError for a malformed path, ImportError/AttributeError naming the key, TypeError for a
        non-callable or a wrong signature.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key} is {path!r}; expected 'module:attr', e.g. 'my_pkg.rewards:score'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"{key}: cannot import module {module_name!r} ({err}); is it on PYTHONPATH?") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{key}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{key}: {path!r} is a {type(obj).__name__}, not a callable")
    if num_positional is not None:
        try:
            inspect.signature(obj).bind(*([None] * num_positional))
        except TypeError as err:
            raise TypeError(f"{key}: {path!r} must accept {num_positional} positional argument(s): {err}") from err
    return obj
