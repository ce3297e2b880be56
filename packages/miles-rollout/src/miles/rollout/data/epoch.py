"""Shared by the built-in data sources: a seeded shuffle per epoch, a resumable position, chat messages."""

from __future__ import annotations

import random
from typing import Any

from miles.core.sample import Sample


def make_messages(question: str, *, system_prompt: str | None, prompt_suffix: str) -> list[dict[str, str]]:
    """Chat messages for one question: optional system message, then the question plus a suffix."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question + prompt_suffix})
    return messages


class EpochShuffledSource:
    """Base of the built-in ``DataSource``s: subclasses set ``size`` and ``seed`` and implement ``sample_at``.

    Prompt k of the run is row ``order(epoch)[position]``; the order is a pure function of (seed, epoch), so
    ``state_dict`` (epoch, position, prompts served) is all a resume needs.
    """

    size: int
    seed: int

    def _start(self) -> None:
        self.epoch, self.position, self.num_prompts = 0, 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def sample_at(self, index: int, group_index: int) -> Sample:
        raise NotImplementedError

    def next_prompts(self, num: int) -> list[Sample]:
        """The next ``num`` prompts as pending samples; ``group_index`` counts prompts over the whole run."""
        prompts = []
        for _ in range(num):
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            prompts.append(self.sample_at(self._order[self.position], self.num_prompts))
            self.position += 1
            self.num_prompts += 1
        return prompts

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "num_prompts": self.num_prompts, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data source state has seed {state['seed']}, this source {self.seed}: not the same data")
        self.epoch, self.position, self.num_prompts = state["epoch"], state["position"], state["num_prompts"]
        self._order = self._shuffled(self.epoch)
