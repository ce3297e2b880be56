import json
import math
import sys
import threading
import time

import pytest
from miles.recipes.sinks import ConsoleSink, JsonlSink, plot_rewards


def test_jsonl_sink_writes_one_row_per_step_with_non_finite_values_as_null(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log({"eval/reward": 0.25}, step=0)
    sink.log({"reward/mean": 0.5, "loss": float("nan")}, step=1)
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "eval/reward": 0.25}, {"step": 1, "reward/mean": 0.5, "loss": None}]
    plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "reward.png")
    assert (tmp_path / "reward.png").read_bytes()[:4] == b"\x89PNG"


def test_console_bar_time_starts_after_the_step_zero_eval():
    sink = ConsoleSink(10)
    created = sink.bar.start_t
    time.sleep(0.01)
    sink.log({"eval/reward": 0.2}, step=0)
    assert sink.bar.n == 0 and sink.bar.start_t > created
    sink.log({"reward/mean": 0.3}, step=1)
    assert sink.bar.n == 1 and sink.bar.postfix and "eval/reward" in sink.bar.postfix
    sink.close()


def test_disabled_console_bar_accepts_the_same_calls():
    sink = ConsoleSink(2, enabled=False)
    sink.log({"eval/reward": 0.2}, step=0)
    sink.log({"reward/mean": 0.3}, step=1)
    sink.close()


def test_the_eval_bar_counts_samples_under_the_step_bar_and_is_erased_when_closed():
    sink = ConsoleSink(10)
    bar = sink.eval_bar(12)  # e.g. 3 eval prompts x 4 samples
    bar.update(5)
    assert (bar.n, bar.total, bar.desc, bar.leave, bar.disable) == (5, 12, "eval", False, False)
    bar.close()
    assert sink.bar.n == 0  # the step bar did not move
    sink.close()


def test_a_disabled_console_shows_no_eval_bar_either():
    sink = ConsoleSink(2, enabled=False)
    bar = sink.eval_bar(4)
    bar.update(4)
    assert bar.disable
    bar.close()
    sink.close()


def _write_metrics(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_reward_plot_draws_eval_as_markers_only_train_as_a_line_and_integer_step_ticks(tmp_path):
    from miles.recipes.sinks import reward_figure

    # A 4-step run evaluated at steps 0 and 4: a line would invent eval values at steps 1-3.
    rows = [{"step": 0, "eval/reward": 0.1}]
    rows += [{"step": k, "reward/mean": 0.2 * k} for k in (1, 2, 3)]
    rows += [{"step": 4, "reward/mean": 0.8, "eval/reward": 0.6}]
    fig = reward_figure(rows)
    (ax,) = fig.axes
    train, evals = ax.get_lines()
    assert train.get_xdata().tolist() == [1, 2, 3, 4] and train.get_linestyle() == "-" and train.get_marker() == "o"
    assert evals.get_xdata().tolist() == [0, 4] and evals.get_ydata().tolist() == [0.1, 0.6]
    assert evals.get_linestyle() == "None" and evals.get_marker() == "s"
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert len(ticks) >= 2 and all(t == int(t) for t in ticks), ticks  # default ticks here: 0, 0.5, 1, ...


def test_plot_rewards_writes_the_png_atomically_leaving_no_temp_file(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl", [{"step": 0, "eval/reward": 0.1}, {"step": 1, "reward/mean": 0.3}])
    (tmp_path / "reward.png").write_bytes(b"old")  # a plot from an earlier run is replaced
    plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "reward.png")
    assert (tmp_path / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "reward.png"]


class ClosedPipe:
    """A console whose reader is gone (``| tee`` killed by the same Ctrl-C): every write raises."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_console_that_goes_away_turns_the_bars_off_instead_of_failing_the_run():
    sink = ConsoleSink(3, file=ClosedPipe())
    sink.log({"eval/reward": 0.5}, step=0)  # would raise BrokenPipeError from tqdm
    bar = sink.eval_bar(4)
    bar.update(2)
    bar.close()
    sink.log({"reward/mean": 0.3}, step=1)
    sink.close()
    assert sink.bar.disable and bar.disable


def test_a_lost_console_leaves_tqdms_write_lock_free_for_other_threads():
    # tqdm's refresh() holds its process-wide lock across the write without try/finally: a BrokenPipeError there
    # left the lock taken by the main thread, and the first log line another thread wrote through
    # logging_redirect_tqdm (the session server's) then waited forever (a hung test run).
    from tqdm import tqdm

    sink = ConsoleSink(3, file=ClosedPipe())
    sink.log({"eval/reward": 0.5}, step=0)
    bar = sink.eval_bar(4)
    bar.update(2)
    sink.log({"reward/mean": 0.3}, step=1)
    got_lock = threading.Event()

    def other_thread():
        with tqdm.get_lock():
            got_lock.set()

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    thread.join(timeout=10)
    bar.close()
    sink.close()
    assert got_lock.is_set() and sink.bar.disable


def _scalars(log_dir):
    """TensorBoard's own reader: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), purge_orphaned_data=True)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_scalars_read_back_and_a_resumed_run_hides_what_it_logs_again(tmp_path):
    from miles.recipes.sinks import TensorBoardSink

    sink = TensorBoardSink(tmp_path / "tb")
    for step in range(4):
        sink.log({"reward/mean": 0.25 * step, "loss": 1.0 - 0.125 * step}, step)
    sink.close()
    assert _scalars(tmp_path / "tb") == {
        "reward/mean": [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75)],
        "loss": [(0, 1.0), (1, 0.875), (2, 0.75), (3, 0.625)],
    }
    resumed = TensorBoardSink(tmp_path / "tb", purge_step=2)  # resumed from the step-1 checkpoint
    resumed.log({"reward/mean": 0.5, "loss": 0.5}, 2)
    resumed.close()
    assert _scalars(tmp_path / "tb")["loss"] == [(0, 1.0), (1, 0.875), (2, 0.5)]


def _wandb_runs(wandb_dir):
    """W&B's offline run files under ``wandb_dir``, read with W&B's own protobuf schema: each as (run record,
    {metric: [(step, value)]}), ordered by their first logged step (directory names do not sort by start: a run
    started in the same second as the last gets a ``-1`` suffix). A ``.wandb`` file is a LevelDB-style log: a
    7-byte header (``:W&B``, magic, version), then 32 KiB blocks of chunks, each ``crc32 (4) | length (2,
    little-endian) | type (1)`` and data; types 1 = a whole record, 2/3/4 = its first/middle/last piece."""
    import struct

    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        data, pos, pending, run, history = path.read_bytes(), 7, b"", None, {}
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
                pos += 32768 - pos % 32768
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind not in (1, 4):
                continue
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "run":
                run = record.run
            elif record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                for key, value in items.items():
                    if not key.startswith("_"):  # _step, _runtime, _timestamp: W&B's own
                        history.setdefault(key, []).append((items["_step"], value))
        runs.append((run, history))
    return sorted(runs, key=lambda r: min(step for points in r[1].values() for step, _ in points))


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B's settings, cache and artifact folders inside the test's directory."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)


def test_an_offline_wandb_run_holds_the_logged_scalars_and_a_resumed_run_continues_its_id(tmp_path, wandb_home):
    from miles.recipes.config import WandbConfig
    from miles.recipes.sinks import WandbSink

    run_dir = tmp_path / "run"
    sink = WandbSink(
        WandbConfig(project="tests", group="sweep"), run_dir=run_dir, run_config={"loop": {"num_steps": 3}}
    )
    sink.log({"eval/reward": 0.25}, step=0)
    for step in (1, 2):
        sink.log({"reward/mean": 0.5 * step, "loss": float("nan") if step == 1 else 0.75}, step)
    sink.log({"eval/reward": 0.5}, step=2)  # the final eval, at the last train step
    sink.close()
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    ((run, history),) = _wandb_runs(run_dir / "wandb")
    assert (run.run_id, run.project, run.display_name, run.run_group) == (run_id, "tests", "run", "sweep")
    assert history["reward/mean"] == [(1, 0.5), (2, 1.0)] and history["eval/reward"] == [(0, 0.25), (2, 0.5)]
    (nan_step, nan), last = history["loss"]
    assert nan_step == 1 and math.isnan(nan) and last == (2, 0.75)  # NaN logged as NaN, as TensorBoard shows it

    resumed = WandbSink(WandbConfig(project="tests"), run_dir=run_dir, resume=True)  # from the step-2 checkpoint
    resumed.log({"reward/mean": 0.25}, step=3)
    resumed.close()
    _, (run2, history2) = _wandb_runs(run_dir / "wandb")  # a second offline part; wandb sync joins them
    assert resumed.run_id == run2.run_id == run_id and history2 == {"reward/mean": [(3, 0.25)]}
    fresh = WandbSink(WandbConfig(project="tests"), run_dir=tmp_path / "other")
    fresh.close()
    assert fresh.run_id != run_id


def test_run_wandb_without_the_wandb_package_is_one_line_naming_the_key_and_the_install(tmp_path, monkeypatch):
    from miles.recipes.config import WandbConfig
    from miles.recipes.sinks import WandbSink

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match=r"^run.wandb is on but .* pip install 'miles-recipes\[wandb\]', or drop"):
        WandbSink(WandbConfig(), run_dir=tmp_path)
    assert not (tmp_path / "wandb_run_id").exists()


def test_run_wandb_is_off_by_default_and_any_key_or_on_turns_it_on():
    from miles.recipes.cli import resolve_config

    assert resolve_config("smollm2_grpo_arithmetic", []).run.wandb is None
    on = resolve_config("smollm2_grpo_arithmetic", ["--run.wandb", "on"]).run.wandb
    assert (on.project, on.name, on.group, on.mode, on.dir) == ("miles", "", "", "offline", "")
    online = resolve_config("smollm2_grpo_arithmetic", ["--run.wandb.mode", "online"]).run.wandb
    assert online.mode == "online" and online.project == "miles"


def _lines(ax):
    return {line.get_label(): (line.get_xdata().tolist(), line.get_ydata().tolist()) for line in ax.get_lines()}


def test_the_metrics_figure_draws_one_panel_per_metric_group_with_the_logged_points():
    from miles.recipes.sinks import metrics_figure

    # A 2-step async run, evaluated at steps 0 and 2; step 1's mismatch metric was non-finite (null in the file).
    rows = [{"step": 0, "eval/reward": 0.1, "eval/response_length": 30.0}]
    rows += [
        {"step": 1, "reward/mean": 0.2, "response_length/mean": 25.0, "staleness/mean": 0.5, "staleness/max": 1.0,
         "train_rollout_logprob_abs_diff": 0.01, "train_rollout_kl": None},
        {"step": 2, "reward/mean": 0.4, "response_length/mean": 20.0, "staleness/mean": 1.0, "staleness/max": 2.0,
         "train_rollout_logprob_abs_diff": 0.03, "train_rollout_kl": 0.002, "loss": 0.5},
        {"step": 2, "eval/reward": 0.6, "eval/response_length": 18.0},
    ]  # fmt: skip
    fig = metrics_figure(rows)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [
        "reward",
        "response length",
        "staleness (policy versions behind)",
        "train-rollout log-prob mismatch",
    ]
    reward, length, staleness, mismatch = (_lines(ax) for ax in fig.axes)
    assert reward == {"reward/mean": ([1, 2], [0.2, 0.4]), "eval/reward": ([0, 2], [0.1, 0.6])}
    assert length == {"response_length/mean": ([1, 2], [25.0, 20.0]), "eval/response_length": ([0, 2], [30.0, 18.0])}
    assert staleness == {"staleness/mean": ([1, 2], [0.5, 1.0]), "staleness/max": ([1, 2], [1.0, 2.0])}
    assert mismatch == {"train_rollout_logprob_abs_diff": ([1, 2], [0.01, 0.03]), "train_rollout_kl": ([2], [0.002])}
    eval_line = fig.axes[0].get_lines()[1]
    assert eval_line.get_linestyle() == "None" and eval_line.get_marker() == "s"  # sparse evals: markers only
    assert fig.axes[-1].get_xlabel() == "step"


def test_the_metrics_figure_leaves_out_panels_without_metrics():
    from miles.recipes.sinks import metrics_figure

    # A sync run whose engine returns no log-probs: no mismatch panel; no eval yet: only the train reward line.
    rows = [{"step": 1, "reward/mean": 0.3, "staleness/mean": 0.0, "staleness/max": 0.0}]
    fig = metrics_figure(rows)
    assert [ax.get_title() for ax in fig.axes] == ["reward", "staleness (policy versions behind)"]
    assert _lines(fig.axes[0]) == {"reward/mean": ([1], [0.3])}
    assert metrics_figure([{"step": 0, "time/eval": 1.0}]).axes == []


def test_plot_metrics_writes_the_png_atomically_leaving_no_temp_file(tmp_path):
    from miles.recipes.sinks import plot_metrics

    _write_metrics(tmp_path / "metrics.jsonl", [{"step": 0, "eval/reward": 0.1}, {"step": 1, "reward/mean": 0.3}])
    (tmp_path / "metrics.png").write_bytes(b"old")  # a resumed run redraws the whole file's plot
    plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "metrics.png")
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "metrics.png"]
