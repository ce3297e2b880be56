"""Miles's extension points: every ``module:attr`` a config may name, what it must be, and loading it.

``EXTENSION_POINTS`` is the one table of them (the config key, the expected signature, the positional arguments
checked at start-up, the protocol in ``miles.core.protocols`` and the runnable example under ``examples/plugins``);
``load_plugin`` imports a path and checks it against its key's entry, so that a wrong path or signature fails
before any model loads with one line naming the key and the expected signature. A path is ``module:attr`` (a
module on ``sys.path`` or in the current directory) or ``path/to/file.py:attr``. ``docs/extending.md`` is the table
for readers; ``tests/recipes/test_extension_points.py`` runs every example through the real loop.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class ExtensionPoint:
    """One extension point.

    Attributes:
        key: the dotted config key (a list key such as ``run.hooks`` takes one path per item: ``run.hooks[0]``).
        signature: what the named callable must be, as a user reads it.
        num_positional: the positional arguments it must accept (checked with ``inspect.signature``).
        protocol: the typed protocol in ``miles.core.protocols`` (or the module that defines it).
        example: ``module:attr`` of the runnable example (``examples/plugins``, on ``sys.path`` in its test).
    """

    key: str
    signature: str
    num_positional: int
    protocol: str
    example: str


EXTENSION_POINTS: dict[str, ExtensionPoint] = {
    p.key: p
    for p in (
        ExtensionPoint(
            "rollout.generate_path",
            "(context: GenerateContext) -> GroupGenerateFn: a factory of the rollout (one prompt -> its n samples)",
            1,
            "miles.core.protocols.GroupGenerateFn",
            "group_generate:build_generate",
        ),
        ExtensionPoint(
            "rollout.sample_hook_path",
            "(sample: Sample) -> None: called on every generated sample before its reward (may edit metadata)",
            1,
            "miles.core.protocols.SampleHook",
            "sample_hook:tag_answer",
        ),
        ExtensionPoint(
            "reward.path",
            "(sample: Sample) -> float: one completed sample's reward (raising fails the sample)",
            1,
            "miles.core.protocols.RewardFn",
            "rewards:answer_in_response",
        ),
        ExtensionPoint(
            "reward.group_path",
            "(group: list[Sample]) -> list[float]: the group's rewards, after each sample's own reward",
            1,
            "miles.core.protocols.GroupRewardFn",
            "rewards:rank_in_group",
        ),
        ExtensionPoint(
            "algorithm.reward_post_process_path",
            "(samples: list[Sample], rewards: Tensor [B] float32) -> Tensor [B] float32",
            2,
            "miles.core.loop.shape_rewards",
            "algorithms:clip_rewards",
        ),
        ExtensionPoint(
            "algorithm.advantage.estimator_path",
            "(inputs: AdvantageInputs, params: AdvantageParams) -> (advantages [B, T], returns [B, T] or None)",
            2,
            "miles.core.algorithms.advantages.compute_advantages",
            "algorithms:mean_baseline",
        ),
        ExtensionPoint(
            "algorithm.loss.policy_loss_path",
            "(log_probs, old_log_probs, advantages, loss_mask, params) -> (token_loss [B, T], clipped [B, T])",
            5,
            "miles.core.algorithms.objective.PolicyObjective",
            "algorithms:plain_pg_loss",
        ),
        ExtensionPoint(
            "algorithm.loss.reducer_path",
            "(token_loss [B, T], loss_mask [B, T], num_tokens: int, num_sequences: int) -> scalar",
            4,
            "miles.core.algorithms.objective.PolicyObjective",
            "algorithms:token_mean",
        ),
        ExtensionPoint(
            "algorithm.dynamic_sampling.filter_path",
            "(group: list[Sample]) -> bool or (bool, reason: str): keep the group (True) or drop it",
            1,
            "miles.core.protocols.GroupFilter",
            "filters:has_two_rewards",
        ),
        ExtensionPoint(
            "algorithm.buffer_filter_path",
            "(groups: list[list[Sample]]) -> list[list[Sample]]: the scored groups to train on, a non-empty subset",
            1,
            "miles.core.protocols.BufferFilter",
            "filters:drop_failed_groups",
        ),
        ExtensionPoint(
            "data.source_path",
            "(context: DataContext) -> DataSource: a factory of the prompts (next_prompts, state_dict, "
            "load_state_dict)",
            1,
            "miles.core.protocols.DataSource",
            "data_source:build_source",
        ),
        ExtensionPoint(
            "eval.path",
            "(components: Components, evaluation: EvalConfig) -> dict[str, float]: one evaluation's metrics",
            2,
            "miles.core.protocols.EvalFn",
            "eval_fn:evaluate_with_length",
        ),
        ExtensionPoint(
            "run.hooks",
            "(context: RunContext) -> TrainHooks: a factory of an object with any of on_rollout_end(step, samples), "
            "on_train_step_end(step, metrics), on_save(step, path)",
            1,
            "miles.core.protocols.TrainHooks",
            "hooks:build_hooks",
        ),
        ExtensionPoint(
            "run.sinks",
            "(context: RunContext) -> MetricsSink: a factory of an object with log(metrics, step) and close()",
            1,
            "miles.core.protocols.MetricsSink",
            "sinks:build_csv_sink",
        ),
        ExtensionPoint(
            "rollout.multi_turn.tools",
            "a miles.rollout.tools.Tool (name, description, JSON-schema parameters, fn(**arguments) -> str)",
            0,
            "miles.rollout.tools.Tool",
            "tools:word_count",
        ),
        ExtensionPoint(
            "rollout.multi_turn.agent_path",
            "(base_url: str, prompt: Sample) -> None, async or sync: one sample's agent, which talks to the OpenAI "
            "chat-completions endpoint at base_url",
            2,
            "miles.rollout.agents.AgentFn",
            "session_agent:agent",
        ),
    )
}


def check_plugin_path(key: str, path: str, example: str) -> None:
    """Config-time check (nothing imported) that a set ``path`` looks like ``module:attr``.

    Raises: ValueError naming the key, the flag and ``example``.
    """
    module_name, sep, attr = path.partition(":")
    if path and not (sep and module_name and attr):
        base = re.sub(r"\[\d+\]$", "", key)
        flag = "--" + base.replace("_", "-")
        if base != key:  # a list item
            example = f"'[{example}]'"
        raise ValueError(f"{key} is {path!r}; expected module:attr or path/to/file.py:attr, e.g. {flag} {example}")


def extension_point(key: str) -> ExtensionPoint | None:
    """The entry of a dotted key; a list item's key (``run.hooks[1]``) finds its list's entry."""
    return EXTENSION_POINTS.get(re.sub(r"\[\d+\]$", "", key))


def load_plugin(
    path: str, *, key: str, num_positional: int | None = None, signature: str | None = None
) -> Callable[..., Any]:
    """Import ``module:attr`` and return the callable, failing at start-up with the config key in the message.

    Args:
        path: "package.module:function" (a dotted attr after the colon is allowed): the module is imported with the
            current directory on ``sys.path`` (appended: it shadows no installed module); or
            "path/to/file.py:function" (relative to the current directory), whose directory is appended to
            ``sys.path`` as well, so that the file may import its neighbours.
        key: the dotted config key that named it, e.g. "reward.path" (quoted in errors).
        num_positional: if given, the callable must accept this many positional arguments; default: the key's
            ``EXTENSION_POINTS`` entry, whose signature the errors quote.
        signature: the signature the errors quote instead of the entry's (the same key in another schema, e.g. a
            diffusion recipe's ``reward.path``).
    Raises: ValueError for a malformed path, ImportError/AttributeError naming the key (an error raised while the
        module runs, e.g. a SyntaxError, becomes an ImportError naming its file and line), TypeError for a
        non-callable or a wrong signature.
    """
    point = extension_point(key)
    if num_positional is None and point is not None and point.num_positional:
        num_positional = point.num_positional
    if signature is None and point is not None:
        signature = point.signature
    expected = f"; expected {signature}" if signature is not None else ""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"{key} is {path!r}; expected 'module:attr' or 'path/to/file.py:attr', e.g. 'my_pkg.rewards:score'"
            f"{expected}"
        )
    obj: Any = _import_file(module_name, key) if _is_file_path(module_name) else _import_module(module_name, key)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{key}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{key}: {path!r} is an object of type {type(obj).__name__}, not a callable{expected}")
    if num_positional is not None:
        try:
            inspect.signature(obj).bind(*([None] * num_positional))
        except TypeError as err:
            raise TypeError(
                f"{key}: {path!r} must accept {num_positional} positional argument(s): {err}{expected}"
            ) from err
    return obj


def _is_file_path(module_name: str) -> bool:
    """A ``path/to/file.py`` rather than a dotted module name (which has neither a slash nor a ``.py`` suffix)."""
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def _append_to_sys_path(directory: str) -> None:
    if directory not in sys.path and not (directory == os.getcwd() and ("" in sys.path or "." in sys.path)):
        sys.path.append(directory)


def _import_module(module_name: str, key: str) -> ModuleType:
    _append_to_sys_path(os.getcwd())  # `miles` is a console script: unlike `python -m`, it puts no "" on sys.path
    try:
        return importlib.import_module(module_name)
    except Exception as err:
        missing = isinstance(err, ModuleNotFoundError) and f"{module_name}.".startswith(f"{err.name}.")
        if not missing:  # the module is there but failed as it ran (a SyntaxError, an import of its own)
            raise ImportError(f"{key}: importing module {module_name!r} failed: {_where(err)}") from err
        raise ImportError(
            f"{key}: cannot import module {module_name!r} ({err}); is it on PYTHONPATH or in the current directory "
            f"({os.getcwd()})? A file can be named as path/to/file.py:attr"
        ) from err


def _import_file(file_name: str, key: str) -> ModuleType:
    """Run ``file_name`` as a module, once per process: it is registered in ``sys.modules`` under its stem (or the
    stem and a hash of its path, when another module has the stem: imported, or importable from ``sys.path``, so a
    plugin file never shadows a module a later ``module:attr`` plugin names), so that two plugins in one file share
    it and its functions pickle by reference within this process."""
    file = Path(file_name).expanduser().resolve()
    if not file.is_file():
        raise ImportError(
            f"{key}: no file {file_name!r} (looked for {file}); name an existing file as path/to/file.py:attr, or a "
            "module on PYTHONPATH or in the current directory as module:attr"
        )
    name = file.stem
    if _stem_taken(name, file):
        name = f"{file.stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    _append_to_sys_path(str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ImportError(f"{key}: importing {file_name!r} failed: {_where(err)}") from err
    return module


def _stem_taken(name: str, file: Path) -> bool:
    """Whether module ``name`` is, or would import as, something other than ``file``."""
    if name in sys.modules:
        return getattr(sys.modules[name], "__file__", None) != str(file)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a broken package of that name: keep clear of it too
        return True
    return spec is not None and spec.origin != str(file)


def _where(err: Exception) -> str:
    """``file:line: Type: message`` of an error raised while a plugin module ran (its innermost frame)."""
    if isinstance(err, SyntaxError):
        return f"{err.filename}:{err.lineno}: SyntaxError: {err.msg}"
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if not frame.filename.startswith("<")]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""  # not importlib's frozen frames
    return f"{where}{type(err).__name__}: {err}"
