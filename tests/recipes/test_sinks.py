import json
import time

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
