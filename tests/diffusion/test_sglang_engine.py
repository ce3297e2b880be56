"""Flow-GRPO with its rollouts on an SGLang-Diffusion API server (``engine.type sglang``): ``miles
serve-diffusion`` on a free local port, a Miles server speaking that API (not SGLang-Diffusion, which needs a GPU).

The trainer samples through ``/rollout/generate``, recomputes the old log-probs (equal to the server's: the same
weights, over HTTP), pushes each version through ``/update_weights_from_disk`` and has it verified tensor by tensor
(``/update_weights_from_tensor_checker``); ``miles train`` runs, resumes, and says in one line when the server is
not there.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import httpx
import pytest
import torch
from miles.diffusion.config import FlowGRPOConfig
from miles.diffusion.models import tiny_flow_model
from miles.diffusion.sglang import SGLangDiffusionEngine, SGLangDiffusionWeightSink
from miles.diffusion.sglang_api import tensor_sha256
from miles.diffusion.trainer import FlowGRPOTrainer
from miles.rollout.engines.server import free_port
from miles.sync.errors import WeightUpdateError

PROMPTS = ["a red image", "a blue image"]
SMALL = dict(prompts_per_step=2, group_size=2, num_steps=4, micro_batch_size=8, lr=1e-3, seed=3)


def brightness(prompts, images):
    return [float(image.mean()) / 255 for image in images]


def perturbed_tiny_flow():
    """The server's model (tiny-flow, seed 0: the same text encoder) with another transformer, which only the
    trainer's first push can give the server."""
    model = tiny_flow_model(seed=0)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.transformer.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def checker(url: str, named: dict[str, torch.Tensor]) -> dict:
    body = {"target_module": "transformer", "expected_named_tensors_sha256": {n: tensor_sha256(t) for n, t in
                                                                             named.items()}}  # fmt: skip
    return httpx.post(url + "/update_weights_from_tensor_checker", json=body, timeout=60).json()


def test_a_step_samples_on_the_server_and_trains_on_what_it_sent(server, tmp_path):
    engine = SGLangDiffusionEngine([server.url])
    sink = SGLangDiffusionWeightSink(engine, root=tmp_path / "weights")
    trainer = FlowGRPOTrainer(perturbed_tiny_flow(), FlowGRPOConfig(**SMALL), brightness, engine=engine,
                              weight_sink=sink)  # fmt: skip
    assert trainer.recompute_old_log_probs and sink.version == 1  # auto: an engine's kernels are not the trainer's
    start = {n: t.detach().clone() for n, t in trainer.policy.state_dict().items()}
    assert checker(server.url, start)["success"]  # the first push replaced the server's transformer
    rollout = trainer.rollout(PROMPTS, step=0)
    assert rollout.trajectories.latents.shape == (4, 5, *trainer.model.latent_shape)
    assert rollout.images.shape == (4, 16, 16, 3) and rollout.weight_version == 1
    # The server's log-probs are the trainer's own recompute from the latents it sent (same weights, fp32).
    _, gap = trainer._recompute_old_log_probs(rollout, *trainer._conditions(rollout.prompts), step=0)
    assert gap < 1e-4
    # Its images are its final latents decoded (the tiny twin decodes pixels as they are, [-1, 1] -> uint8).
    expected = ((rollout.trajectories.latents[:, -1].clamp(-1, 1) + 1) / 2 * 255).round().permute(0, 2, 3, 1)
    assert (torch.from_numpy(rollout.images).float() - expected).abs().max() <= 1
    metrics = trainer.train(rollout, step=0)
    assert metrics["weight_version"] == 2 and sink.version == 2 and metrics["train_rollout_logprob_max_abs_diff"] < 1e-4
    trained = trainer.policy.state_dict()
    assert not checker(server.url, start)["success"]  # the server holds the trained weights now, verified
    assert checker(server.url, trained)["success"]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000001", "v000002"]
    engine.close()


def test_a_push_the_server_loads_otherwise_fails_naming_the_server_and_what_differs(server, tmp_path):
    engine = SGLangDiffusionEngine([server.url])
    named = tiny_flow_model(seed=0).transformer.state_dict()
    # The sink checksums bfloat16 tensors; the server casts them to its float32 transformer: the checker sees it.
    sink = SGLangDiffusionWeightSink(engine, root=tmp_path / "a", dtype=torch.bfloat16)
    checked = rf"^weights v1: {server.url}/update_weights_from_tensor_checker answered 400: Module 'transformer' "
    with pytest.raises(WeightUpdateError, match=checked + "update weight check failed: checksum mismatch"):
        sink.push(named.items())
    assert sink.version == 0
    sink = SGLangDiffusionWeightSink(engine, root=tmp_path / "b")
    with pytest.raises(WeightUpdateError, match=rf"^weights v1: {server.url}/update_weights_from_disk answered 400"):
        sink.push([("not_a_parameter.weight", torch.zeros(2))])
    assert sink.push(named.items()) == 1  # a good push after both
    engine.close()


def _train(tmp_path, url: str, *extra: str) -> int:
    from miles.recipes.cli import main

    args = [
        "train",
        "--recipe",
        "tiny_flow_grpo_compressibility",
        "--engine.type",
        "sglang",
        "--engine.urls",
        url,
        "--algorithm.prompts-per-step",
        "2",
        "--algorithm.group-size",
        "2",
        "--algorithm.num-steps",
        "4",
        "--eval.interval",
        "0",
        "--run.dir",
        str(tmp_path),
        "--run.name",
        "e",
        "--run.progress",
        "false",
        *extra,
    ]
    return main(args)  # fmt: skip


def test_miles_train_runs_and_resumes_on_the_server_and_leaves_no_weights_behind(server, tmp_path):
    before = set(Path(tempfile.gettempdir()).glob("miles-engine-weights-*"))
    assert _train(tmp_path, server.url, "--loop.num-steps", "2") == 0
    assert _train(tmp_path, server.url, "--loop.num-steps", "3", "--resume") == 0
    rows = [json.loads(line) for line in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/weight_version"] for r in rows] == [1, 2, 3] and [r["weight_version"] for r in rows] == [2, 3, 4]
    assert all(r["train_rollout_logprob_max_abs_diff"] < 1e-4 and r["grad_norm"] > 0 for r in rows)
    assert set(Path(tempfile.gettempdir()).glob("miles-engine-weights-*")) == before


def test_miles_train_without_the_server_says_so_in_one_line(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert _train(tmp_path, url, "--loop.num-steps", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"miles: engine.urls: weights v1: {url}/update_weights_from_disk: ")
    assert "is the server up?" in err[0] and not (tmp_path / "e").exists()


def _rewards(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r}


@pytest.mark.parametrize("where", ["push", "rollout"])
def test_a_server_failing_mid_run_leaves_a_checkpoint_the_run_resumes_from(server, tmp_path, monkeypatch, where):
    """The trainer is healthy when a server fails: the run saves where it stands (after the step whose push failed,
    its metrics lost; before the step whose rollout failed, its prompts given back) and a resume samples and trains
    exactly what an uninterrupted run does."""
    from miles.diffusion.sglang import SGLangDiffusionEngine, SGLangDiffusionWeightSink

    assert _train(tmp_path / "a", server.url, "--loop.num-steps", "4") == 0
    expected = _rewards(tmp_path / "a" / "e")
    if where == "push":  # v3 is the push after step 2's update
        real = SGLangDiffusionWeightSink.push

        def push(self, named, *, version=None):
            if (version or self.version + 1) == 3:
                raise WeightUpdateError(f"weights v3: {server.url}/update_weights_from_disk: ConnectError (down)")
            return real(self, named, version=version)

        monkeypatch.setattr(SGLangDiffusionWeightSink, "push", push)
    else:  # step 3's rollout
        real, calls = SGLangDiffusionEngine.generate, []

        def generate(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise ConnectionError(f"{server.url}/rollout/generate: RemoteProtocolError: Server disconnected")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(SGLangDiffusionEngine, "generate", generate)
    assert _train(tmp_path / "b", server.url, "--loop.num-steps", "4") == 1
    run = tmp_path / "b" / "e"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_2"]
    monkeypatch.undo()
    assert _train(tmp_path / "b", server.url, "--loop.num-steps", "4", "--resume") == 0
    lost = {2} if where == "push" else set()
    assert _rewards(run) == {step: reward for step, reward in expected.items() if step not in lost}


def test_engine_settings_without_the_engine_or_a_scheme_are_refused_in_one_line(tmp_path, capsys):
    from miles.recipes.cli import main

    base = ["train", "--recipe", "tiny_flow_grpo_compressibility", "--run.dir", str(tmp_path), "--dry-run"]
    assert main([*base, "--engine.urls", "http://127.0.0.1:1"]) == 2
    assert "engine.urls is set but engine.type is embedded" in capsys.readouterr().err
    assert main([*base, "--engine.type", "sglang", "--engine.urls", "127.0.0.1:30000"]) == 2
    assert "engine.urls: '127.0.0.1:30000' has no scheme; write http://127.0.0.1:30000" in capsys.readouterr().err


def test_a_large_gap_between_the_servers_and_the_trainer_is_warned_once(server, tmp_path, monkeypatch, caplog):
    """A server serving another text encoder gave a 5e-3 gap (a fresh user's trial) where the same model gives
    < 1e-6: above 1e-3 (float32 servers) the run says what to check."""
    real = FlowGRPOTrainer.train

    def train(self, rollout, *, step):
        metrics = real(self, rollout, step=step)
        return {**metrics, "train_rollout_logprob_max_abs_diff": 5e-3}

    monkeypatch.setattr(FlowGRPOTrainer, "train", train)
    with caplog.at_level("WARNING", logger="miles.recipes.diffusion"):
        assert _train(tmp_path, server.url, "--loop.num-steps", "2") == 0
    warnings = [r.getMessage() for r in caplog.records if "log-probs differ" in r.getMessage()]
    assert len(warnings) == 1 and "by up to 0.005 (expected below 0.001 with float32 servers)" in warnings[0]
