"""Metric sinks: JSONL file, TensorBoard event files, a Weights & Biases run, console progress bar, and the plots
of ``metrics.jsonl`` (reward; all key metrics)."""

from __future__ import annotations

import json
import logging
import math
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from miles.recipes.config import WandbConfig

logger = logging.getLogger(__name__)

CONSOLE_KEYS = ("reward/mean", "eval/reward", "loss", "grad_norm", "response_length/mean", "time/step")
WANDB_RUN_ID_FILE = "wandb_run_id"  # in the run directory: a resumed run continues the same W&B run
WANDB_MISSING = (
    "run.wandb is on but the wandb package is not installed: pip install 'miles-recipes[wandb]', or drop "
    "--run.wandb (--run.wandb null)"
)


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


class TensorBoardSink:
    """Writes each metric as a TensorBoard scalar (tag = the metric name, x = the step) with torch's
    ``SummaryWriter`` into ``log_dir``; non-finite values are written as they are (TensorBoard shows NaN).

    Args:
        log_dir: the event files' directory (created if missing).
        purge_step: a resumed run's first step that is logged again: TensorBoard hides the earlier events of
            that step and later ones (``SummaryWriter(purge_step=...)``), as the run drops their metrics.jsonl rows.
    Raises: ImportError naming the install command when ``tensorboard`` is missing.
    """

    def __init__(self, log_dir: Path, *, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "run.tensorboard needs the tensorboard package: pip install 'miles-recipes[tensorboard]', or drop "
                "--run.tensorboard"
            ) from err
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()  # one step at a time: a killed run keeps what it logged

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Logs each metric to a Weights & Biases run (key = the metric name, step = the loop step; NaN stays NaN) and
    the resolved config as the run's config. Offline mode writes the run's files only (``<dir>/wandb/offline-run-*``,
    uploaded later with ``wandb sync``); no network or account is needed.

    The W&B run id is kept in ``run_dir/wandb_run_id``: a resumed run reads it and continues the same W&B run
    (``resume="allow"``). W&B keeps a step once: a step below the last one the W&B run has is dropped with W&B's
    own warning (online, the steps a crashed run logged past its checkpoint keep their first values).

    Args:
        config: the ``run.wandb`` section (project, name, group, mode, dir).
        run_dir: the run directory: the run id file lives there, and W&B's ``wandb/`` folder too unless
            ``config.dir`` names another directory; an empty ``config.name`` becomes its name.
        run_config: the resolved config (``MilesConfig.model_dump(mode="json")``), stored as the W&B config.
        resume: continue the W&B run whose id ``run_dir`` holds (a new run if it holds none).
    Raises: ImportError naming the install command when ``wandb`` is missing.
    """

    def __init__(
        self, config: WandbConfig, *, run_dir: Path, run_config: dict[str, Any] | None = None, resume: bool = False
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(WANDB_MISSING) from err
        run_dir = Path(run_dir)
        self.run_id = wandb_run_id(run_dir, resume=resume)
        self.dir = Path(config.dir) if config.dir else run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=config.project,
            name=config.name or run_dir.name,
            group=config.group or None,
            mode=config.mode,
            dir=str(self.dir),
            id=self.run_id,
            resume="allow",
            config=run_config,
            # console off: train.log and the console sink own the output, and W&B's capture would split tqdm's bar
            settings=wandb.Settings(console="off", silent=True),
        )
        logger.info("logging to W&B run %s (project %s, %s) in %s", self.run_id, config.project, config.mode, self.dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        # No commit: W&B writes a step's row when a later step starts (an eval logs at its train step) or at close.
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        """Finish the W&B run and wait until its files are complete: W&B's service process writes them after
        ``finish()`` returns, and ``wandb.teardown()`` waits for it (and ends it; W&B starts a new one for a later
        run in this process)."""
        import wandb

        self._run.finish()
        wandb.teardown()


def wandb_run_id(run_dir: Path, *, resume: bool) -> str:
    """The W&B run id of the run in ``run_dir``: the one ``run_dir/wandb_run_id`` holds when ``resume`` is set and
    the file exists, else a new random one, written there (atomically) for the runs that resume this one."""
    path = Path(run_dir) / WANDB_RUN_ID_FILE
    if resume and path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)  # W&B ids: lowercase letters and digits, unique within the project
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(run_id + "\n")
    tmp.replace(path)
    return run_id


class ConsoleSink:
    """A tqdm progress bar over the run's steps, showing the key metrics of the last step; ``eval_bar`` opens a
    second, transient one while an evaluation runs (as ``Components.progress``).

    A console that goes away (the terminal closed, ``| tee`` killed by the same Ctrl-C) turns the bars off instead
    of failing the run: a write error (``OSError``, e.g. ``BrokenPipeError``) disables them, and the run goes on to
    its checkpoint.
    """

    def __init__(self, total_steps: int, *, initial: int = 0, enabled: bool = True, file=None) -> None:
        from tqdm import tqdm

        self._stream = _ConsoleStream(file if file is not None else sys.stderr)
        file = self._file = self._stream
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
        return _GuardedBar(bar, on_error=self._console_lost, stream=self._stream)

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
        self._check_stream()

    def close(self) -> None:
        try:
            self.bar.close()
        except OSError as err:
            self._console_lost(err)

    def _check_stream(self) -> None:
        if self._stream.error is not None and not self.bar.disable:
            self._console_lost(self._stream.error)

    def _console_lost(self, err: OSError) -> None:
        self.bar.disable = True
        logger.debug("console progress bar off: %s", err)


class _ConsoleStream:
    """The console file the bars draw on: a write error (``OSError``) is recorded in ``error`` and later writes are
    dropped, instead of raising out of tqdm. tqdm's ``refresh`` holds its process-wide write lock across the write
    without try/finally, so a raise there leaves the lock taken by this thread; the next log line another thread
    writes through tqdm (``logging_redirect_tqdm``: a reward or session thread) would then wait forever.

    It compares equal to the stream it wraps, so that tqdm's ``write`` (log lines) still clears and redraws the bars
    drawn on that stream."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.error = stream, None

    def write(self, text: str) -> int:
        if self.error is None:
            try:
                return self._stream.write(text)
            except OSError as err:
                self.error = err
        return 0

    def flush(self) -> None:
        if self.error is None:
            try:
                self._stream.flush()
            except OSError as err:
                self.error = err

    def __eq__(self, other: object) -> bool:
        return other is self or other is self._stream

    def __hash__(self) -> int:
        return id(self._stream)

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno, ... of the real stream
        return getattr(self._stream, name)


class _GuardedBar:
    """A tqdm bar whose write errors (``OSError``) switch the console off instead of propagating."""

    def __init__(self, bar, *, on_error, stream: _ConsoleStream | None = None) -> None:
        self.bar, self._on_error, self._stream = bar, on_error, stream

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
        if self._stream is not None and self._stream.error is not None and not self.bar.disable:
            self.bar.disable = True
            self._on_error(self._stream.error)

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


def reward_figure(rows: list[dict[str, Any]], *, ylim: tuple[float, float] | None = (-0.05, 1.05)) -> Figure:
    """Train reward per step as a line with markers, eval reward as markers only (evals are sparse: a line would
    invent values for the steps between them), integer step ticks.

    Args:
        rows: ``metrics.jsonl`` rows, ``{"step": k, "reward/mean": ..., "eval/reward": ...}`` (keys optional).
        ylim: the reward axis' range; None fits the data (rewards outside [0, 1], e.g. JPEG sizes in kB).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    series = [(TRAIN_LINE, "reward/mean", "train reward (rollout batch)")]
    series.append((EVAL_POINTS, "eval/reward", "eval reward (held-out)"))
    _draw_panel(ax, rows, series)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    if ylim is not None:
        ax.set_ylim(*ylim)
    fig.tight_layout()
    return fig


def plot_rewards(metrics_path: Path, out_path: Path, *, ylim: tuple[float, float] | None = (-0.05, 1.05)) -> None:
    """Write ``reward_figure`` of a ``metrics.jsonl`` as a PNG, atomically (a temp file, then renamed)."""
    _save_atomic(reward_figure(read_metrics(metrics_path), ylim=ylim), Path(out_path))


# Line styles: a per-step metric as a line with markers; an eval metric as markers only (evals are sparse).
TRAIN_LINE = {"marker": "o"}
EVAL_POINTS = {"marker": "s", "markersize": 8, "linestyle": "None"}

# The panels of ``metrics_figure``, top to bottom: (title, y label, ((style, metric name), ...)). The legend labels
# are the metric names, as in metrics.jsonl, TensorBoard and W&B.
METRIC_PANELS = (
    ("reward", "reward", ((TRAIN_LINE, "reward/mean"), (EVAL_POINTS, "eval/reward"))),
    ("response length", "tokens", ((TRAIN_LINE, "response_length/mean"), (EVAL_POINTS, "eval/response_length"))),
    ("staleness (policy versions behind)", "versions", ((TRAIN_LINE, "staleness/mean"), (TRAIN_LINE, "staleness/max"))),
    (
        "train-rollout log-prob mismatch",
        "nats per token",
        ((TRAIN_LINE, "train_rollout_logprob_abs_diff"), (TRAIN_LINE, "train_rollout_kl")),
    ),
)


def metrics_figure(rows: list[dict[str, Any]]) -> Figure:
    """The run's key metrics per step, one panel each, stacked over a shared step axis: reward (train line, eval
    markers), response length (train, eval), staleness (mean, max), and the train-rollout log-prob mismatch
    (``train_rollout_logprob_abs_diff``, ``train_rollout_kl``). A panel is drawn only when a row has one of its
    metrics (a run without engine log-probs has no mismatch panel); null (non-finite) values are left out.

    Args:
        rows: ``metrics.jsonl`` rows, ``{"step": k, metric: value, ...}`` (every metric optional).
    Returns: the figure; its axes are the drawn panels in ``METRIC_PANELS`` order, each titled and with one line
        per metric present, labelled with the metric name. No axes when no row has any of the metrics.
    """
    from matplotlib.figure import Figure

    panels = [p for p in METRIC_PANELS if any(r.get(name) is not None for r in rows for _, name in p[2])]
    fig = Figure(figsize=(7, 2.4 * max(len(panels), 1)))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0] if panels else []
    for ax, (title, ylabel, series) in zip(axes, panels):
        _draw_panel(ax, rows, [(style, name, name) for style, name in series])
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
    if panels:
        axes[-1].set_xlabel("step")
        fig.tight_layout()
    return fig


def plot_metrics(metrics_path: Path, out_path: Path) -> None:
    """Write ``metrics_figure`` of a ``metrics.jsonl`` as a PNG, atomically (a temp file, then renamed)."""
    _save_atomic(metrics_figure(read_metrics(metrics_path)), Path(out_path))


def read_metrics(metrics_path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (blank lines skipped)."""
    return [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]


def _draw_panel(ax: Axes, rows: list[dict[str, Any]], series) -> None:
    """One line per ``(style, metric, label)`` that has a value in ``rows``, integer step ticks, grid, legend."""
    from matplotlib.ticker import MaxNLocator

    for style, name, label in series:
        points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
        if points:
            ax.plot(*zip(*points), label=label, **style)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, also on short runs
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a panel with no values (a run whose every step failed) has no legend
        ax.legend()


def _save_atomic(fig: Figure, out_path: Path) -> None:
    """Save ``fig`` as a PNG at ``out_path`` through a temp file renamed over it: a reader never sees half a file."""
    tmp = out_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)  # a bare Figure: no pyplot state, no backend switch
    tmp.replace(out_path)
