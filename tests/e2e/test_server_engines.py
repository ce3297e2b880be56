"""End to end: `miles train` on the default recipe for 2 steps with server engines Miles starts itself:
a real vLLM server (`-m vllm`), and two `miles serve` servers behind the real sglang-router (`-m slow`)."""

import json
import re
import subprocess
import sys

import pytest
from miles.rollout.engines.server import port_in_use
from servers import SMALL_RUN, vllm_python


def _train(tmp_path, name: str, engine_overrides: list[str]) -> list[dict]:
    cmd = [
        sys.executable, "-m", "miles.recipes.cli", "train", "--recipe", "smollm2_grpo_arithmetic", *SMALL_RUN,
        "--run.dir", str(tmp_path), "--run.name", name, *engine_overrides,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Pushed in place as v1 and v2 (the push verifies the servers' weights; a mismatch would have failed the run).
    assert [r["weight_version"] for r in rows[1:]] == [1.0, 2.0]
    # Step 2 was sampled by the servers with the weights pushed after step 1: engine and trainer agree.
    assert rows[2]["train_rollout_logprob_abs_diff"] < 1e-4
    assert rows[2]["train_rollout_logprob_abs_diff_max"] < 1e-2  # the worst of the step's ~1000 tokens
    # After each update the engine sampled the probe prompt, and the trainer recomputed its log-probs.
    assert all(r["sync/probe_logprob_max_abs_diff"] < 1e-2 for r in rows[1:])
    assert "eval/reward" in rows[2]
    return rows


@pytest.mark.e2e
@pytest.mark.vllm
def test_two_steps_against_a_vllm_server_that_miles_starts_with_tis_for_its_kernels(tmp_path):
    python = vllm_python()
    engine = ["--engine.type", "vllm", "--engine.python", python, "--engine.max-model-len", "512"]
    # vLLM's CPU kernels are not the trainer's: truncated importance sampling corrects the small mismatch.
    tis = ["--algorithm.rollout-correction.importance-sampling", "tis"]
    rows = _train(tmp_path, "vllm", engine + tis)
    for row in rows[1:]:
        assert 0.99 < row["ess_ratio"] <= 1.0 and row["tis_clipfrac"] == 0.0  # ~3e-5 apart: weights ~1
    log = (tmp_path / "vllm" / "servers" / "vllm_0.log").read_text()
    assert "Creating weight transfer engine: MilesWeightTransferEngine" in log  # the miles.sync plugin loaded
    assert subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai"], capture_output=True).returncode == 1


@pytest.mark.e2e
@pytest.mark.vllm
def test_two_steps_against_a_vllm_server_fed_through_disk_versions(tmp_path):
    """engine.weight_transfer disk: each version written as safetensors + manifest beside the run, loaded by the
    server's miles_reload_weights (checksums, names, shapes checked first), and removed when the run ends."""
    engine = ["--engine.type", "vllm", "--engine.python", vllm_python(), "--engine.max-model-len", "512"]
    tis = ["--algorithm.rollout-correction.importance-sampling", "tis"]
    _train(tmp_path, "disk", [*engine, *tis, "--engine.weight-transfer", "disk"])
    assert "weights through" in (tmp_path / "disk" / "train.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]  # the versions' directory went with the run
    assert (tmp_path / "disk" / "servers" / "vllm_0.log").read_text().count("miles: reloaded") == 2


@pytest.mark.e2e
@pytest.mark.vllm
def test_two_steps_of_lora_against_a_vllm_server_that_applies_the_pushed_adapters(tmp_path):
    """train.lora.sync adapter: the server keeps its base and loads each pushed adapter version in place."""
    engine = ["--engine.type", "vllm", "--engine.python", vllm_python(), "--engine.max-model-len", "512"]
    lora = [
        "--train.lora.rank",
        "4",
        "--train.lora.target-modules",
        '["q_proj", "v_proj"]',
        "--train.lora.sync",
        "adapter",
    ]
    rows = _train(tmp_path, "lora", [*engine, *lora, "--train.lr", "1e-3"])
    assert all(r["grad_norm"] > 0 for r in rows[1:])
    assert "LoRA adapters (rank 4)" in (tmp_path / "lora" / "train.log").read_text()
    log = (tmp_path / "lora" / "servers" / "vllm_0.log").read_text()
    assert log.count("Loaded new LoRA adapter: name 'miles-adapter'") == 2  # v1 and v2, the same name in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]  # the adapter versions went with the run


@pytest.mark.e2e
@pytest.mark.vllm
def test_fully_async_with_partial_rollouts_against_a_vllm_server(tmp_path):
    """The async loop on a real server: the producer keeps vLLM busy while the trainer trains; each update pauses the
    server in place (partial rollouts continue on the new weights), the staleness bound 1 holds on every step, and
    eval runs on the version it reports."""
    engine = ["--engine.type", "vllm", "--engine.python", vllm_python(), "--engine.max-model-len", "512"]
    loop = ["--loop.mode", "fully_async", "--loop.partial-rollout", "true", "--loop.max-weight-staleness", "1"]
    cmd = [
        sys.executable, "-m", "miles.recipes.cli", "train", "--recipe", "smollm2_grpo_arithmetic", *SMALL_RUN,
        "--run.dir", str(tmp_path), "--run.name", "async", *engine, *loop,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["weight_version"] for r in rows[1:]] == [1.0, 2.0]
    assert rows[1]["staleness/max"] == 0.0  # step 1 trains what v0 generated: nothing was published before it
    assert all(0.0 <= r["staleness/max"] <= 1.0 for r in rows[1:])  # the bound, on every sample trained
    assert all(r["samples/failed"] == 0 and "buffer/groups" in r for r in rows[1:])
    assert all(r["sync/probe_logprob_max_abs_diff"] < 1e-2 for r in rows[1:])  # in-place updates landed
    assert (rows[0]["eval/weight_version"], rows[2]["eval/weight_version"]) == (0.0, 2.0)
    assert "Traceback" not in result.stderr
    assert subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai"], capture_output=True).returncode == 1


ROUTER = [
    "--engine.type", "sglang", "--engine.server", "miles", "--engine.num-servers", "2",
    "--engine.router", "true", "--engine.router-policy", "round_robin",
]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.slow  # ~4.5 min here (three servers start): CI's slow step
def test_two_steps_through_sglang_router_in_front_of_two_miles_serve_servers(tmp_path):
    """Through the real sglang-router in front of two `miles serve` servers (the embedded engine behind SGLang's
    native API), all started and stopped by Miles; weights pushed into both over gloo, per tensor."""
    _train(tmp_path, "router", ROUTER)
    run = tmp_path / "router"
    servers = run / "servers"
    assert sorted(p.name for p in servers.iterdir()) == ["miles_0.log", "miles_1.log", "sglang_router.log"]
    for name in ("miles_0.log", "miles_1.log"):  # round robin: the rollout went through the router to both
        assert (servers / name).read_text().count('"POST /generate HTTP/1.1" 200') >= 8, name
    # Everything Miles started was stopped: each "is up at URL" has its "stopped", and nothing listens there now.
    log = (run / "train.log").read_text()
    up = dict(re.findall(r"INFO miles.rollout.engines.server: (.+?) is up at (http://\S+)", log))
    assert sorted(up) == ["miles serve 0", "miles serve 1", "sglang-router"], up
    for name, url in up.items():
        assert f"stopped {name} at {url}" in log
        host, port = url.removeprefix("http://").split(":")
        assert not port_in_use(host, int(port)), url
