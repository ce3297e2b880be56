"""Metric sinks: JSONL file, console progress bar, reward plot."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

CONSOLE_KEYS = ("reward/mean", "eval/reward", "loss", "grad_norm", "response_length/mean", "time/step")


class JsonlSink:
    """Appends one JSON object per ``log`` call (``{"step": k, ...metrics}``), flushed each line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ConsoleSink:
    """A tqdm progress bar over the run's steps, showing the key metrics of the last step; ``eval_bar`` opens a
    second, transient one while an evaluation runs (as ``Components.progress``).

    A console that goes away (the terminal closed, ``| tee`` killed by the same Ctrl-C) turns the bars off instead
    of failing the run: a write error (``OSError``, e.g. ``BrokenPipeError``) disables them, and the run goes on to
    its checkpoint.
    """

    def __init__(self, total_steps: int, *, initial: int = 0, enabled: bool = True, file=None) -> None:
        from tqdm import tqdm

        self._file = file
        bar_args = dict(total=total_steps, initial=initial, desc="miles", unit="step", file=file)
        try:
            self.bar = tqdm(disable=not enabled, **bar_args)
        except OSError as err:  # no console to draw on
            self.bar = tqdm(disable=True, **bar_args)
            self._console_lost(err)
        self._shown: dict[str, float] = {}

    def eval_bar(self, total: int) -> _GuardedBar:
        """A bar under the step bar counting finished eval samples out of ``total``; erased when closed."""
        from tqdm import tqdm

        bar_args = dict(total=total, desc="eval", unit="sample", leave=False, file=self._file)
        try:
            bar = tqdm(disable=self.bar.disable, **bar_args)
        except OSError as err:
            bar = tqdm(disable=True, **bar_args)
            self._console_lost(err)
        return _GuardedBar(bar, on_error=self._console_lost)

    def log(self, metrics: dict[str, float], step: int) -> None:
        logger.debug("step %d: %s", step, metrics)
        self._shown.update({k: v for k, v in metrics.items() if k in CONSOLE_KEYS})
        try:
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in self._shown.items()}, refresh=False)
            if step == 0 and self.bar.n == 0:  # the step-0 eval is not a training step: keep it out of the ETA
                self.bar.reset(total=self.bar.total)
            if step > self.bar.n:
                self.bar.update(step - self.bar.n)
        except OSError as err:
            self._console_lost(err)

    def close(self) -> None:
        try:
            self.bar.close()
        except OSError as err:
            self._console_lost(err)

    def _console_lost(self, err: OSError) -> None:
        self.bar.disable = True
        logger.debug("console progress bar off: %s", err)


class _GuardedBar:
    """A tqdm bar whose write errors (``OSError``) switch the console off instead of propagating."""

    def __init__(self, bar, *, on_error) -> None:
        self.bar, self._on_error = bar, on_error

    def __getattr__(self, name: str) -> Any:  # n, total, desc, ... of the bar
        return getattr(self.bar, name)

    def update(self, n: int = 1) -> None:
        if self.bar.disable:
            return
        try:
            self.bar.update(n)
        except OSError as err:
            self.bar.disable = True
            self._on_error(err)

    def close(self) -> None:
        try:
            self.bar.close()
        except OSError as err:
            self.bar.disable = True
            self._on_error(err)


class MultiSink:
    """Fans each call out to several sinks."""

    def __init__(self, *sinks: JsonlSink | ConsoleSink) -> None:
        self.sinks = sinks

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def reward_figure(rows: list[dict[str, Any]]) -> Figure:
    """Train reward per step as a line with markers, eval reward as markers only (evals are sparse: a line would
    invent values for the steps between them), integer step ticks.

    Args:
        rows: ``metrics.jsonl`` rows, ``{"step": k, "reward/mean": ..., "eval/reward": ...}`` (keys optional).
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    train = [(r["step"], r["reward/mean"]) for r in rows if r.get("reward/mean") is not None]
    evals = [(r["step"], r["eval/reward"]) for r in rows if r.get("eval/reward") is not None]
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), marker="o", label="train reward (rollout batch)")
    if evals:
        ax.plot(*zip(*evals), marker="s", markersize=8, linestyle="None", label="eval reward (held-out)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, also on short runs
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_rewards(metrics_path: Path, out_path: Path) -> None:
    """Write ``reward_figure`` of a ``metrics.jsonl`` as a PNG, atomically (a temp file, then renamed)."""
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    tmp = out_path.with_suffix(".tmp.png")
    reward_figure(rows).savefig(tmp, dpi=100)  # a bare Figure: no pyplot state, no backend switch
    tmp.replace(out_path)
