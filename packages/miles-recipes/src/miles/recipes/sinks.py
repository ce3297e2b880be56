"""Metric sinks: JSONL file, console progress bar, reward plot."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

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
    """A tqdm progress bar over the run's steps, showing the key metrics of the last step."""

    def __init__(self, total_steps: int, *, initial: int = 0, enabled: bool = True) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=initial, desc="miles", unit="step", disable=not enabled)
        self._shown: dict[str, float] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._shown.update({k: v for k, v in metrics.items() if k in CONSOLE_KEYS})
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in self._shown.items()}, refresh=False)
        if step == 0 and self.bar.n == 0:  # the step-0 eval is not a training step: keep it out of the ETA
            self.bar.reset(total=self.bar.total)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        logger.debug("step %d: %s", step, metrics)

    def close(self) -> None:
        self.bar.close()


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


def plot_rewards(metrics_path: Path, out_path: Path) -> None:
    """PNG of train reward per step (and eval reward where measured) from a ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [(r["step"], r["reward/mean"]) for r in rows if r.get("reward/mean") is not None]
    evals = [(r["step"], r["eval/reward"]) for r in rows if r.get("eval/reward") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), marker="o", label="train reward (rollout batch)")
    if evals:
        ax.plot(*zip(*evals), marker="s", linestyle="--", label="eval reward (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out_path)
