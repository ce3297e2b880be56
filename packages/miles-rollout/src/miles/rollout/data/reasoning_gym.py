"""Procedural reasoning tasks from reasoning-gym (Apache-2.0): seeded, offline, each with its own scorer."""

from __future__ import annotations

import sys
import warnings
from types import ModuleType
from typing import Any

from miles.core.sample import Sample
from miles.rollout.data.epoch import EpochShuffledSource, make_messages

# cellpylib (a reasoning-gym dependency) writes `memoize is "recursive"`. Python warns about `is` with a literal
# when it compiles a .py file, so an import that compiles cellpylib (the first one, or every one when no bytecode
# cache is written: PYTHONDONTWRITEBYTECODE, read-only site-packages) prints 4 SyntaxWarnings. A compile-time
# warning's module is the file path minus ".py" (.../site-packages/cellpylib/ca_functions), not the dotted name,
# so a filter on module "cellpylib.*" never matches; this pattern accepts both forms.
_CELLPYLIB_MODULE = r"(.*[/\\])?cellpylib[/\\.]"


def import_reasoning_gym() -> ModuleType:
    """``import reasoning_gym``, without the SyntaxWarnings its dependency cellpylib raises while being compiled.

    Only that warning, and only during the first import, is ignored; every other warning still shows.
    """
    if "reasoning_gym" not in sys.modules:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r'"is" with a literal', category=SyntaxWarning, module=_CELLPYLIB_MODULE
            )
            import reasoning_gym  # noqa: F401
    return sys.modules["reasoning_gym"]


class ReasoningGymSource(EpochShuffledSource):
    """``DataSource`` over a reasoning-gym task, reshuffled every epoch with a seeded order.

    Args:
        task: reasoning-gym dataset name, e.g. "basic_arithmetic".
        size: entries per epoch.
        seed: seed of the task generator (the entries) and of the shuffle order.
        task_kwargs: passed to ``reasoning_gym.create_dataset``.
        system_prompt: optional system message (None: the tokenizer template's default).
        prompt_suffix: appended to each question.
    The label of each sample is the reasoning-gym entry (question, answer, metadata) its scorer needs.
    """

    def __init__(
        self,
        task: str,
        *,
        size: int,
        seed: int,
        task_kwargs: dict[str, Any] | None = None,
        system_prompt: str | None = None,
        prompt_suffix: str = "",
    ) -> None:
        reasoning_gym = import_reasoning_gym()
        try:
            self.dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **(task_kwargs or {}))
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(f"data.task {task!r} with data.task_kwargs {task_kwargs}: {err}") from err
        self.size, self.seed = size, seed
        self.system_prompt, self.prompt_suffix = system_prompt, prompt_suffix
        self._start()

    def sample_at(self, index: int, group_index: int) -> Sample:
        entry = self.dataset[index]
        return Sample(
            index=group_index,
            group_index=group_index,
            prompt=make_messages(entry["question"], system_prompt=self.system_prompt, prompt_suffix=self.prompt_suffix),
            label=entry,
            metadata={"data_index": index, "answer": entry["answer"]},
        )
