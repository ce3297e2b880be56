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
