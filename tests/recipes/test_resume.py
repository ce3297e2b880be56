"""Exact resume: `miles train` 4 steps straight equals 2 steps + `--resume` + 2 steps (tiny model, fixed seeds);
resuming at an epoch boundary trains exactly the remaining steps on the next epoch's order; a resumed fully async run
trains each prompt once; `miles export`."""

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
import yaml
from doubles import CountingPublisher, FakeBackend, NullSink
from miles.core.config import AlgorithmConfig, EvalConfig, LoopConfig, RolloutConfig
from miles.core.loop import Components, train
from miles.core.producer import PromptQueue
from miles.core.sample import Sample, SampleStatus
from miles.recipes.checkpoint import read_latest, restore_run_checkpoint, save_run_checkpoint
from miles.recipes.cli import main
from miles.rollout.data import FileSource
from safetensors.torch import load_file

REWARD_MODULE = """
def odd_first_token(sample):
    return float(sample.response_tokens[0] % 2)
"""


@pytest.fixture(scope="module")
def tiny_smollm_dir(tiny_smollm2_dir):
    return tiny_smollm2_dir


def _train(args, tmp_path, monkeypatch):
    (tmp_path / "resume_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", *args]) == 0


def _overrides(model_dir, run_dir, name, num_steps):
    return [
        "--models.policy.path", str(model_dir),
        "--data.size", "6",
        "--reward.type", "custom", "--reward.path", "resume_reward:odd_first_token", "--reward.timeout-s", "10",
        "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "4",
        "--rollout.sampling.max-new-tokens", "3",
        "--train.lr", "1e-2", "--train.micro-batch-size", "8",
        "--eval.num-prompts", "0",
        "--loop.num-steps", str(num_steps), "--loop.save-interval", "1", "--loop.keep-checkpoints", "2",
        "--run.dir", str(run_dir), "--run.name", name, "--run.progress", "false", "--run.num-threads", "1",
    ]  # fmt: skip


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_then_resume_then_two_steps_equal_four_steps_straight(tiny_smollm_dir, tmp_path, monkeypatch):
    _train(_overrides(tiny_smollm_dir, tmp_path, "straight", 4), tmp_path, monkeypatch)
    _train(_overrides(tiny_smollm_dir, tmp_path, "split", 2), tmp_path, monkeypatch)
    # A crashed run may have logged a step past its checkpoint: the resume must drop it.
    with (tmp_path / "split" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 123.0}) + "\n")
    _train(
        ["--run.dir", str(tmp_path), "--run.name", "split", "--resume", "--loop.num-steps", "4"], tmp_path, monkeypatch
    )

    straight, split = _metrics(tmp_path / "straight"), _metrics(tmp_path / "split")
    assert [r["step"] for r in split] == [r["step"] for r in straight] == [1, 2, 3, 4]
    for key in ("loss", "reward/mean", "grad_norm", "weight_version", "response_length/mean", "advantages/mean"):
        assert [r[key] for r in split] == [r[key] for r in straight], key
    assert any(r["grad_norm"] > 0 for r in straight)  # the weights did move, so equality is not vacuous
    a = load_file(tmp_path / "straight" / "checkpoints" / "step_4" / "model" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoints" / "step_4" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    initial = load_file(tiny_smollm_dir / "model.safetensors")
    assert any(not torch.equal(a[k], initial[k]) for k in a)
    # keep-checkpoints 2: only the two newest survive.
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").glob("step_*")) == ["step_3", "step_4"]

    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(tmp_path / "split" / "checkpoints" / "step_4"), "--out", str(out)]) == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], a["model.embed_tokens.weight"])
    assert AutoTokenizer.from_pretrained(out).chat_template
    assert main(["export", "--checkpoint", str(tmp_path / "split" / "checkpoints" / "step_4"), "--out", str(out)]) == 2


def test_miles_train_fully_async_at_staleness_0_resumed_equals_the_sync_run(tiny_smollm_dir, tmp_path, monkeypatch):
    """`miles train --loop.mode fully_async --loop.max-weight-staleness 0`, 2 steps + --resume + 2 steps: the run
    wiring (prompt queue in checkpoints, the producer's start step, the weight version) reproduces 4 sync steps."""
    asynchronous = ["--loop.mode", "fully_async", "--loop.max-weight-staleness", "0"]
    _train(_overrides(tiny_smollm_dir, tmp_path, "sync", 4), tmp_path, monkeypatch)
    _train([*_overrides(tiny_smollm_dir, tmp_path, "async", 2), *asynchronous], tmp_path, monkeypatch)
    state = json.loads((tmp_path / "async" / "checkpoints" / "step_2" / "run_state.json").read_text())
    assert set(state["data_source"]) == {"source", "untrained"}
    _train(
        ["--run.dir", str(tmp_path), "--run.name", "async", "--resume", "--loop.num-steps", "4"], tmp_path, monkeypatch
    )
    sync, resumed = _metrics(tmp_path / "sync"), _metrics(tmp_path / "async")
    for key in ("loss", "reward/mean", "grad_norm", "weight_version", "response_length/mean"):
        assert [r[key] for r in resumed] == [r[key] for r in sync], key
    assert [r["staleness/max"] for r in resumed] == [0.0] * 4


def test_resume_of_a_run_that_does_not_exist_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--resume", "--run.dir", str(tmp_path), "--run.name", "nothing"]) == 2
    assert "there is no run 'nothing' under" in capsys.readouterr().err
    assert main(["train", "--resume"]) == 2
    assert "--resume without a path needs --run.name" in capsys.readouterr().err


# -- epoch boundary, at the loop level (cheap stand-ins for the model-bound components) ------------------------
class RecordingRollout:
    """A group-generate function: one 1-token response per sample; records which data row each prompt came from
    (in prompt order: the producer starts the prompts' calls in order)."""

    def __init__(self):
        self.rows = []

    async def __call__(self, prompt, *, n, sampling, seeds):
        self.rows.append(prompt.metadata["data_index"])
        return [
            Sample(index=k, group_index=prompt.group_index, prompt=prompt.prompt, tokens=[1, 3 + k],
                   response_length=1, rollout_log_probs=[-1.0], status=SampleStatus.COMPLETED)
            for k in range(n)
        ]  # fmt: skip


def _epoch_run(data_file, checkpoints, *, num_steps, resume):
    source = FileSource(data_file, seed=3)
    rollout, backend, pusher = RecordingRollout(), FakeBackend(), CountingPublisher()
    start = 0
    if resume:
        state = restore_run_checkpoint(read_latest(checkpoints), backend=backend, data_source=source)
        start, pusher.version = state.step, state.weight_version

    def save(step):
        save_run_checkpoint(checkpoints, step, backend=backend, data_source=source, weight_version=pusher.version)

    components = Components(
        data_source=source, generate_group=rollout, reward_fn=lambda s: float(s.tokens[-1] % 2), backend=backend,
        publisher=pusher, sink=NullSink(), save_checkpoint=save,
    )  # fmt: skip
    train(
        components,
        loop=LoopConfig(num_steps=num_steps, save_interval=60),
        rollout=RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2),
        algorithm=AlgorithmConfig(),
        evaluation=EvalConfig(num_prompts=0),
        start_step=start,
    )
    return rollout.rows, backend, pusher


def test_resuming_at_an_epoch_boundary_trains_exactly_the_remaining_epoch(tmp_path):
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(60)))
    straight_rows, _, _ = _epoch_run(data_file, tmp_path / "straight", num_steps=120, resume=False)
    first_rows, _, _ = _epoch_run(data_file, tmp_path / "split", num_steps=60, resume=False)
    assert json.loads((tmp_path / "split" / "step_60" / "run_state.json").read_text())["data_source"] == {
        "epoch": 0, "position": 60, "num_prompts": 60, "seed": 3,
    }  # fmt: skip
    second_rows, backend, pusher = _epoch_run(data_file, tmp_path / "split", num_steps=120, resume=True)
    assert len(second_rows) == 60 and backend.steps == 120 and pusher.version == 120
    assert sorted(second_rows) == list(range(60))  # the second epoch: every row exactly once
    assert first_rows + second_rows == straight_rows  # the same order as without the interruption
    assert second_rows != first_rows  # each epoch is reshuffled
    assert read_latest(tmp_path / "split").name == "step_120"


def test_resuming_a_run_an_older_miles_wrote_in_the_flat_layout_is_one_line_naming_the_key(tmp_path, capsys):
    flat = yaml.safe_load((Path(__file__).parent / "flat_resolved_configs.yaml").read_text())["smollm2_ppo_arithmetic"]
    run = tmp_path / "old"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    for where in (run, run / "checkpoints" / "step_2"):
        (where / "config.yaml").write_text(yaml.safe_dump({**flat, "run": {**flat["run"], "name": "old"}}))
    for resume in (["--resume"], ["--resume", str(run / "checkpoints" / "step_2")]):
        assert main(["train", "--run.dir", str(tmp_path), "--run.name", "old", *resume]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("miles: --resume: "), err
        assert "was written by an older Miles (flat config layout: model.path is now models.policy.path)" in err


class TrainedRows(PromptQueue):
    """A ``PromptQueue`` recording the data rows of the prompts each step trained, in order."""

    def __init__(self, source):
        super().__init__(source)
        self.rows = []

    def mark_trained(self, group_indices):
        with self._lock:
            self.rows += [self._untrained[i].metadata["data_index"] for i in group_indices]
        super().mark_trained(group_indices)


def _async_run(data_file, checkpoints, *, num_steps, resume, stop_after=None):
    """fully_async (bound 2) over 60 rows, 2 prompts per step: groups finish out of order (row-dependent delays), so
    a checkpoint meets prompts in flight and in the buffer."""
    queue = TrainedRows(FileSource(data_file, seed=3))
    backend, pusher = FakeBackend(), CountingPublisher()
    start = 0
    if resume:
        state = restore_run_checkpoint(read_latest(checkpoints), backend=backend, data_source=queue)
        start, pusher.version = state.step, state.weight_version

    async def generate_group(prompt, *, n, sampling, seeds):
        await asyncio.sleep(0.002 * (prompt.metadata["data_index"] % 7))
        return [
            Sample(index=k, group_index=prompt.group_index, prompt=prompt.prompt, tokens=[1, 3 + k],
                   response_length=1, rollout_log_probs=[-1.0], status=SampleStatus.COMPLETED,
                   weight_versions=[pusher.version])
            for k in range(n)
        ]  # fmt: skip

    def save(step):
        if step == stop_after:
            # The case under test needs prompts generated ahead at the checkpoint: give the producer (its own
            # thread) time to draw them. Regression: on a loaded machine it sometimes had drawn none yet, and the
            # test's precondition failed (`untrained` empty), though the run itself was right.
            deadline = time.monotonic() + 30
            while queue.num_untrained == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
        save_run_checkpoint(checkpoints, step, backend=backend, data_source=queue, weight_version=pusher.version)

    steps = {"done": start}

    def should_stop():
        return stop_after is not None and steps["done"] >= stop_after

    def count(metrics, step):
        steps["done"] = step

    sink = NullSink()
    sink.log = count
    components = Components(
        data_source=queue, generate_group=generate_group, reward_fn=lambda s: float(s.tokens[-1] % 2),
        backend=backend, publisher=pusher, sink=sink, save_checkpoint=save, should_stop=should_stop,
    )  # fmt: skip
    done = train(
        components,
        loop=LoopConfig(mode="fully_async", max_weight_staleness=2, num_steps=num_steps, save_interval=0),
        rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2),
        algorithm=AlgorithmConfig(),
        evaluation=EvalConfig(num_prompts=0),
        start_step=start,
    )
    return queue, done, pusher


def test_a_resumed_async_run_neither_skips_nor_repeats_prompts_that_sat_in_the_buffer(tmp_path):
    # 80 rows for 60 trained prompts: the 30 steps draw at most 60 + what the bound lets the producer run ahead,
    # all within epoch 0, so a row's data index names one prompt.
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(80)))
    first, done, _ = _async_run(data_file, tmp_path / "split", num_steps=30, resume=False, stop_after=13)
    assert done == 13 and len(first.rows) == 26
    state = json.loads((tmp_path / "split" / "step_13" / "run_state.json").read_text())
    untrained = [p["metadata"]["data_index"] for p in state["data_source"]["untrained"]]
    assert untrained and not set(untrained) & set(first.rows)  # generated ahead, not trained: stored to serve again
    second, done, pusher = _async_run(data_file, tmp_path / "split", num_steps=30, resume=True)
    assert done == 30 and pusher.version == 30  # the weight version continues from the checkpoint's 13
    assert len(second.rows) == 34
    trained = first.rows + second.rows
    assert len(set(trained)) == 60  # nothing trained twice
    # nothing skipped: every prompt drawn was trained or is still untrained (in flight when the run ended; groups
    # finish out of order, so the last steps may train a later prompt first). Regression: with one epoch of 60
    # rows, a later epoch's row trained ahead of an in-flight one looked like a repeat on a loaded machine.
    end = second.state_dict()
    assert end["source"]["epoch"] == 0
    drawn = second.source._order[: end["source"]["position"]]
    in_flight = [p["metadata"]["data_index"] for p in end["untrained"]]
    assert sorted(trained + in_flight) == sorted(drawn), (first.rows, second.rows, in_flight)
