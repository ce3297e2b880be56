"""The ``rollout.generate_path`` extension point: a factory, named ``module:attr``, that builds the group-generate
function (``GroupGenerateFn``, the one rollout protocol) of a run from typed parts.

A factory is called once at start-up with a ``GenerateContext`` and returns an async callable with the
``GroupGenerateFn`` signature; the built-in multi-turn rollout (``miles.rollout.multiturn:build_multi_turn``) is one::

    def build_generate(context: GenerateContext) -> GroupGenerateFn:
        return MyAgent(context.engine, context.tokenizer, context.rollout.multi_turn).generate_group
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol

from miles.core.config import RolloutConfig
from miles.core.plugins import load_plugin
from miles.core.protocols import Engine, GroupGenerateFn

KEY = "rollout.generate_path"
# The factory of each rollout.mode that has one when rollout.generate_path is empty.
BUILTIN_FACTORIES = {"multi_turn": "miles.rollout.multiturn:build_multi_turn"}
# rollout.mode multi_turn with rollout.multi_turn.agent_path: an agent drives each sample through a session endpoint.
AGENT_FACTORY = "miles.rollout.agents:build_agent_generate"
AGENT_KEY = "rollout.multi_turn.agent_path"


@dataclass(frozen=True)
class GenerateContext:
    """What a group-generate factory builds from.

    Attributes:
        engine: the run's engine (``miles.core.Engine``).
        tokenizer: the policy's HF tokenizer (chat template).
        rollout: the ``rollout`` section (sampling, ``max_resubmits``, ``multi_turn``).
        max_prompt_tokens: ``data.max_prompt_tokens``: a longer prompt fails its samples instead of the run.
        mask_stale_segments: ``loop.mask_stale_segments``: train only tokens of the newest weights of a sample.
    """

    engine: Engine
    tokenizer: Any
    rollout: RolloutConfig
    max_prompt_tokens: int = 2048
    mask_stale_segments: bool = False


class GenerateFactory(Protocol):
    """Builds a run's ``GroupGenerateFn``; the object ``rollout.generate_path`` names."""

    def __call__(self, context: GenerateContext) -> GroupGenerateFn: ...


def generate_factory_path(rollout: RolloutConfig) -> str | None:
    """The factory a rollout section selects: ``generate_path``, else the agent sessions' one when
    ``multi_turn.agent_path`` is set, else the built-in one of its mode, else None (the single-turn ``ChatRollout`` or
    SFT, which take no factory)."""
    if rollout.generate_path:
        return rollout.generate_path
    if rollout.mode == "multi_turn" and rollout.multi_turn.agent_path:
        return AGENT_FACTORY
    return BUILTIN_FACTORIES.get(rollout.mode)


def load_generate_factory(rollout: RolloutConfig) -> GenerateFactory | None:
    """Import the section's factory (``generate_factory_path``) and check it takes one argument; for
    rollout.mode multi_turn, import and check its tools and agent too. Cheap: nothing is built. None when there is
    none.

    Raises: ValueError, ImportError, AttributeError or TypeError naming the key (``rollout.generate_path``,
        ``rollout.multi_turn.tools[i]``, ``rollout.multi_turn.agent_path``).
    """
    from miles.rollout.tools import load_tools

    path = generate_factory_path(rollout)
    if path is None:
        return None
    factory = load_plugin(path, key=KEY, num_positional=1)
    if rollout.mode == "multi_turn":
        load_tools(rollout.multi_turn.tools)
        if rollout.multi_turn.agent_path:
            load_plugin(rollout.multi_turn.agent_path, key=AGENT_KEY)
    return factory


def build_generate_fn(rollout: RolloutConfig, context: GenerateContext) -> GroupGenerateFn | None:
    """The section's ``GroupGenerateFn``: its factory called with ``context``, its result checked. None when the
    section selects no factory.

    Raises: as ``load_generate_factory``; TypeError naming the key when the factory returns something that is not
        an async callable taking ``(prompt, *, n, sampling, seeds)``; what the factory raises.
    """
    factory = load_generate_factory(rollout)
    if factory is None:
        return None
    generate_group = factory(context)
    is_async = inspect.iscoroutinefunction(generate_group) or (
        callable(generate_group) and inspect.iscoroutinefunction(type(generate_group).__call__)
    )
    if not is_async:
        raise TypeError(
            f"{KEY}: {generate_factory_path(rollout)!r} returned a {type(generate_group).__name__}, not an async "
            "group-generate function: return an `async def f(prompt, *, n, sampling, seeds)`"
        )
    try:
        inspect.signature(generate_group).bind(None, n=1, sampling=None, seeds=[0])
    except TypeError as err:
        raise TypeError(
            f"{KEY}: the function returned by {generate_factory_path(rollout)!r} must accept (prompt, *, n, sampling, "
            f"seeds): {err}"
        ) from err
    return generate_group
