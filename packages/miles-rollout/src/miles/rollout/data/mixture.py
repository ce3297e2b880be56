"""Prompts drawn from several data sources by weight (``data.mixture``): a deterministic weighted round-robin.

Prompt n of the run comes from the component with the largest lag ``(n + 1) * w_i / W - c_i`` (``w_i`` its weight,
``W`` the sum of the weights, ``c_i`` the prompts it served so far; ties go to the earlier component). This is
smooth weighted round-robin (nginx's upstream balancer) written over the counts, so the counts alone are the
schedule's state. Integer weights repeat with period ``W``: weights 3 and 1 serve A A B A, A A B A, ...

Bound: with ``k`` components and shares ``p_i = w_i / W``, after ``n`` prompts every component has served
``n * p_i - (k - 1) < c_i < n * p_i + 1`` prompts: within 1 of its share for two components, exact at multiples of
``W`` for integer weights. Proof: the lags ``L_i = n * p_i - c_i`` start at 0 and sum to 0. The component picked has
the largest ``L_i + p_i``, at least their mean 1/k, so its lag after the pick is ``>= 1/k - 1 > -1``; the others only
gain ``p_i``. So every ``L_i > -1``, and since the lags sum to 0, every ``L_i < k - 1``. The lags are computed in
exact rational arithmetic (``fractions.Fraction`` of the float weights), so ties are exact ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from miles.core.protocols import DataSource
from miles.core.sample import Sample


def next_component(weights: Sequence[float], counts: Sequence[int]) -> int:
    """The component serving the next prompt: the largest lag ``(n + 1) * w_i / W - c_i``, earliest on a tie.

    Args:
        weights: the components' weights, each > 0.
        counts: prompts each component served so far (n = their sum).
    """
    exact = [Fraction(weight) for weight in weights]  # exact: a tie is a tie, whatever the float rounding
    total, num_next = sum(exact), sum(counts) + 1
    lags = [num_next * weight / total - count for weight, count in zip(exact, counts, strict=True)]
    return max(range(len(lags)), key=lambda i: (lags[i], -i))


def mixture_counts(weights: Sequence[float], num: int) -> list[int]:
    """How many of the first ``num`` prompts each component serves (``next_component`` applied ``num`` times)."""
    counts = [0] * len(weights)
    for _ in range(num):
        counts[next_component(weights, counts)] += 1
    return counts


class MixtureSource:
    """``DataSource`` drawing each prompt from one of several named sources by weight (see the module docstring).

    Every component keeps its own epochs and order (it is asked only for the prompts it serves), each prompt's
    ``index`` / ``group_index`` count prompts over the whole mixture, and ``metadata["dataset"]`` names its component,
    which rewards and metrics (``reward/mean/<name>``) read.

    Args:
        components: (name, weight, source) per component, in the order ties are broken; names unique, weights > 0.
    Raises: ValueError for no components, a repeated name or a weight <= 0.
    """

    def __init__(self, components: Sequence[tuple[str, float, DataSource]]) -> None:
        names = [name for name, _, _ in components]
        if not components:
            raise ValueError("a MixtureSource needs at least one component")
        if len(set(names)) != len(names):
            raise ValueError(f"MixtureSource component names must be unique, got {names}")
        bad = [(name, weight) for name, weight, _ in components if not weight > 0]
        if bad:
            raise ValueError(f"MixtureSource weights must be > 0, got {bad}")
        self.names = names
        self.weights = [float(weight) for _, weight, _ in components]
        self.sources = [source for _, _, source in components]
        self.counts = [0] * len(components)

    @property
    def num_prompts(self) -> int:
        """Prompts served over the whole run."""
        return sum(self.counts)

    def next_prompts(self, num: int) -> list[Sample]:
        """The next ``num`` prompts, each from the component ``next_component`` picks."""
        picks = []
        for _ in range(num):
            picks.append(next_component(self.weights, self.counts))
            self.counts[picks[-1]] += 1
        drawn = [iter(source.next_prompts(picks.count(i))) for i, source in enumerate(self.sources)]
        prompts = []
        for offset, i in enumerate(picks):
            prompt = next(drawn[i])
            prompt.index = prompt.group_index = self.num_prompts - num + offset
            prompt.metadata["dataset"] = self.names[i]
            prompts.append(prompt)
        return prompts

    def state_dict(self) -> dict[str, Any]:
        """Per component, in order: its weight, the prompts it served and its own ``state_dict``."""
        return {
            "datasets": {
                name: {"weight": weight, "served": count, "state": source.state_dict()}
                for name, weight, count, source in zip(self.names, self.weights, self.counts, self.sources)
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the prompt after the one ``state_dict`` was taken at.

        Raises: ValueError when the state is of another mixture (other names, order or weights), before anything
            is loaded; as the components' ``load_state_dict``.
        """
        datasets = state.get("datasets")
        if not isinstance(datasets, dict):
            raise ValueError(
                f"data source state has keys {sorted(state)}, not a data.mixture state ('datasets'): the checkpoint "
                "was written by a run without data.mixture; resume it with its own data settings"
            )
        theirs = [(name, entry["weight"]) for name, entry in datasets.items()]
        ours = list(zip(self.names, self.weights))
        if theirs != ours:
            raise ValueError(
                f"data.mixture state has (name, weight) {theirs}, this mixture {ours}: another mixture's checkpoint "
                "would continue on a different schedule. Resume with the data.mixture of the checkpoint's run."
            )
        for source, entry in zip(self.sources, datasets.values()):
            source.load_state_dict(entry["state"])
        self.counts = [entry["served"] for entry in datasets.values()]
