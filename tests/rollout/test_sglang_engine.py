"""``SGLangEngine`` and ``SGLangWeightSink``: the Engine protocol and SGLang's per-tensor weight update over HTTP,
against mocked answers and a real ``miles serve`` subprocess."""

import asyncio
import json
import sys
import time

import httpx
import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import Engine, GenerateOutput, GenerateRequest, RequestFailed
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.engines.server import ServerProcess, free_port
from miles.rollout.engines.sglang import SGLangEngine, SGLangWeightSink, launch_command
from miles.rollout.engines.sglang_api import generate_payload, generate_response, parse_generate_response
from miles.sync import WeightUpdateError
from servers import start_miles_serve


# -- launch command and wire format ---------------------------------------------------------------
def test_launch_command_builds_sglangs_argv_and_strips_the_sglang_prefix_of_extra_args():
    argv = launch_command(
        "/models/qwen", host="0.0.0.0", port=31000, python="/venv/bin/python",
        extra_args=["--sglang-mem-fraction-static", "0.7", "--sglang-enable-deterministic-inference", "--tp=2"],
    )  # fmt: skip
    assert argv == ["/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/qwen",
                    "--host", "0.0.0.0", "--port", "31000", "--mem-fraction-static", "0.7",
                    "--enable-deterministic-inference", "--tp=2"]  # fmt: skip
    assert launch_command("m", python=None)[0] == sys.executable
    assert launch_command("m", extra_args=["--sglang-dp-size=2"])[-1] == "--dp-size=2"
    with pytest.raises(ValueError, match="extra_args sets --port; pass model_path, host and port as arguments"):
        launch_command("m", extra_args=["--sglang-port", "1"])
    # engine.dtype reaches SGLang under its own names; setting it twice is refused
    assert launch_command("m", dtype="bf16", extra_args=["--tp=2"])[-3:] == ["--dtype", "bfloat16", "--tp=2"]
    assert launch_command("m", dtype="fp32")[-2:] == ["--dtype", "float32"]
    with pytest.raises(ValueError, match=r"engine.extra_args sets --dtype; set engine.dtype \(fp32, bf16, fp16\)"):
        launch_command("m", dtype="fp32", extra_args=["--sglang-dtype=half"])
    from miles.rollout.config import SGLangEngineConfig

    for args in (["--sglang-dtype", "half"], ["--dtype=float16"]):  # refused in the config, before anything starts
        with pytest.raises(ValueError, match=r"engine.extra_args sets --dtype; set engine.dtype"):
            SGLangEngineConfig(extra_args=args)


def test_the_payload_is_token_in_with_sglangs_top_k_and_the_seed_only_when_set():
    request = GenerateRequest([1, 2, 3], SamplingConfig(temperature=0.7, max_new_tokens=5), seed=9, request_id="a")
    assert generate_payload(request, stop_token_ids=[2]) == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_new_tokens": 5,
                            "sampling_seed": 9, "stop_token_ids": [2]},
        "return_logprob": True, "rid": "a", "stream": False,
    }  # fmt: skip
    unseeded = GenerateRequest([1], SamplingConfig(top_k=4), request_id="b")
    params = generate_payload(unseeded, stop_token_ids=None)["sampling_params"]
    assert params["top_k"] == 4 and "sampling_seed" not in params and "stop_token_ids" not in params


REQUEST = GenerateRequest([1, 5], SamplingConfig(max_new_tokens=3), request_id="r1")


def answer(tokens, log_probs, finish="length", version="2", **meta_extra):
    meta = {"id": "r1", "finish_reason": {"type": finish}, "completion_tokens": len(tokens), "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(log_probs, tokens)], **meta_extra}  # fmt: skip
    return {"text": "", "output_ids": tokens, "meta_info": meta}


def test_an_answer_becomes_tokens_log_probs_finish_reason_and_version():
    output = parse_generate_response(answer([4, 2], [-0.5, -1.5], "stop"), REQUEST)
    assert (output.response_tokens, output.log_probs, output.finish_reason) == ([4, 2], [-0.5, -1.5], "stop")
    assert output.weight_versions == [2] and output.request_id == "r1"
    assert parse_generate_response(answer([4], [-1.0], version="default"), REQUEST).weight_version == 0
    aborted = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}
    assert parse_generate_response(aborted, REQUEST).response_tokens == []  # aborted before its first token


@pytest.mark.parametrize(
    "body, message",
    [
        pytest.param({"text": "hi"}, "has no meta_info object", id="no_meta_info"),
        pytest.param(answer([4], [-1.0], finish="eos"), "finish_reason {'type': 'eos'}", id="unknown_finish"),
        pytest.param(answer([4], [None]), "null or non-finite log-prob", id="null_log_prob"),
        pytest.param(answer([4], [float("nan")]), "null or non-finite log-prob", id="nan_log_prob"),
        pytest.param(answer([4.5], [-1.0]), "non-integer token ids", id="float_token"),
        pytest.param(
            {"meta_info": {"finish_reason": {"type": "length"}}},
            "no meta_info.output_token_logprobs",
            id="no_log_probs",
        ),  # fmt: skip
        pytest.param(answer([4], [-1.0], completion_tokens=2), "completion_tokens=2 but carries 1", id="count"),
        pytest.param(answer([4], [-1.0], version="v2"), "'v2' is not a Miles version", id="foreign_version"),
    ],
)
def test_a_malformed_answer_raises_a_value_error_naming_the_request(body, message):
    with pytest.raises(ValueError, match="request r1") as err:
        parse_generate_response(body, REQUEST)
    assert message in str(err.value)


def _encoded(values):
    import base64

    import numpy as np

    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode("ascii")


def test_routed_experts_are_asked_for_and_decoded_one_block_per_token_the_last_one_unrouted():
    # Prompt [1, 5, 9] + response [4, 2] = 5 tokens; SGLang routes the 4 it ran through the model (not the last
    # sampled token): 4 x 2 layers x top-2 ids, in token-major order, as slime reads them.
    assert "return_routed_experts" not in generate_payload(REQUEST, stop_token_ids=None)
    assert generate_payload(REQUEST, stop_token_ids=None, return_routed_experts=True)["return_routed_experts"] is True
    request = GenerateRequest([1, 5, 9], SamplingConfig(max_new_tokens=4), request_id="r1")
    ids = list(range(16))
    body = answer([4, 2], [-0.5, -1.5], "stop")
    body["meta_info"]["routed_experts"] = _encoded(ids)
    routed = parse_generate_response(body, request, routed_experts_shape=(2, 2)).routed_experts
    assert routed.shape == (5, 2, 2) and routed.dtype.name == "int32"
    assert routed[0].tolist() == [[0, 1], [2, 3]] and routed[3].tolist() == [[12, 13], [14, 15]]
    assert routed[4].tolist() == [[-1, -1], [-1, -1]]  # the last token: no routing recorded
    assert parse_generate_response(body, request).routed_experts is None  # not asked: not read
    unscheduled = answer([], [], "abort")  # aborted before it ran: no routing sent, none recorded
    routed = parse_generate_response(unscheduled, request, routed_experts_shape=(2, 2)).routed_experts
    assert routed.shape == (3, 2, 2) and (routed == -1).all()

    for bad, message in [
        (None, "no meta_info.routed_experts string.*--enable-return-routed-experts"),
        ("not base64!", "not base64"),
        (_encoded(ids[:12]), r"12 routed-expert ids; expected .* 4 x 2 x 2 = 16"),
    ]:
        body["meta_info"]["routed_experts"] = bad
        with pytest.raises(ValueError, match=f"request r1.*{message}"):
            parse_generate_response(body, request, routed_experts_shape=(2, 2))


def test_the_moe_routing_shape_comes_from_the_models_config_and_a_dense_model_is_one_line(tmp_path):
    from miles.rollout.config import SGLangEngineConfig
    from miles.rollout.engines.launch import _server_command, moe_routing_shape
    from miles.rollout.engines.server import ServerStartError

    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"num_hidden_layers": 48, "num_experts_per_tok": 8}))
    assert moe_routing_shape(moe) == (48, 8)
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    with pytest.raises(ServerStartError, match="no num_hidden_layers / num_experts_per_tok .*drop --engine.routed"):
        moe_routing_shape(dense)
    command, _ = _server_command(SGLangEngineConfig(routed_experts=True), moe, 30000, 0)
    assert "--enable-return-routed-experts" in command
    assert "--enable-return-routed-experts" not in _server_command(SGLangEngineConfig(), moe, 30000, 0)[0]
    miles_serve = _server_command(SGLangEngineConfig(routed_experts=True, server="miles"), moe, 30000, 0)[0]
    assert "--enable-return-routed-experts" in miles_serve  # miles serve records routing with the same flag


# -- the client over mocked servers ---------------------------------------------------------------
class FakeServers:
    """``httpx.MockTransport`` handler: records (url, body); /generate times out ``timeouts`` times first."""

    def __init__(self, timeouts=0):
        self.calls, self.timeouts = [], timeouts

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((str(request.url), body))
        if request.url.path == "/generate":
            if self.timeouts:
                self.timeouts -= 1
                raise httpx.ReadTimeout("slow", request=request)
            if body["input_ids"] == [0]:
                return httpx.Response(400, json={"object": "error", "message": "input_ids has ids [0] outside"})
            parsed = GenerateRequest(body["input_ids"], SamplingConfig(max_new_tokens=2), request_id=body["rid"])
            output = GenerateOutput([7, 2], [-0.25, -0.5], "stop", weight_versions=[3])
            return httpx.Response(200, json=generate_response(output, parsed, return_logprob=True, latency_s=0.0))
        return httpx.Response(200, json={"success": True, "message": "ok"})

    def paths(self, path):
        return [(url, body) for url, body in self.calls if url.endswith(path)]


def test_an_engine_asked_for_routed_experts_sends_the_flag_and_returns_them():
    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["return_routed_experts"] is True
        tokens = len(body["input_ids"]) + 2 - 1  # [7, 2] answered; all but the last token routed
        answer_body = answer([7, 2], [-0.25, -0.5], "stop")
        answer_body["meta_info"]["routed_experts"] = _encoded([3] * tokens * 4 * 1)
        return httpx.Response(200, json=answer_body)

    engine = SGLangEngine(["http://w1"], routed_experts_shape=(4, 1), transport=httpx.MockTransport(server))
    output = asyncio.run(engine.generate(GenerateRequest([1, 5], SamplingConfig(max_new_tokens=2))))
    assert output.routed_experts.shape == (4, 4, 1)
    assert output.routed_experts[:3].tolist() == [[[3]] * 4] * 3 and output.routed_experts[3].tolist() == [[-1]] * 4


def test_a_timed_out_request_is_aborted_everywhere_and_retried_with_the_same_rid_and_seed():
    servers = FakeServers(timeouts=1)
    engine = SGLangEngine(["http://w1", "http://w2"], max_retries=1, transport=httpx.MockTransport(servers))
    request = GenerateRequest([1, 5], SamplingConfig(max_new_tokens=2), seed=11)
    output = asyncio.run(engine.generate(request))
    assert (output.response_tokens, output.log_probs, output.weight_version) == ([7, 2], [-0.25, -0.5], 3)
    attempts = servers.paths("/generate")
    assert [url for url, _ in attempts] == ["http://w1/generate", "http://w2/generate"]  # round-robin
    assert attempts[0][1] == attempts[1][1] and attempts[0][1]["rid"] == request.request_id
    assert attempts[0][1]["sampling_params"]["sampling_seed"] == 11
    assert sorted(url for url, _ in servers.paths("/abort_request")) == ["http://w1/abort_request",
                                                                         "http://w2/abort_request"]  # fmt: skip
    assert all(body == {"rid": request.request_id} for _, body in servers.paths("/abort_request"))


def test_a_request_still_timing_out_after_its_retries_raises_timeout_error():
    engine = SGLangEngine(["http://w1"], max_retries=2, transport=httpx.MockTransport(FakeServers(timeouts=3)))
    with pytest.raises(RequestFailed, match="got no answer in 3 attempts"):
        asyncio.run(engine.generate(GenerateRequest([1], SamplingConfig())))


def test_a_rejected_request_raises_value_error_for_that_request_only():
    engine = SGLangEngine(["http://w1"], transport=httpx.MockTransport(FakeServers()))

    async def run():
        bad, good = GenerateRequest([0], SamplingConfig()), GenerateRequest([1], SamplingConfig())
        return await asyncio.gather(engine.generate(bad), engine.generate(good), return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, ValueError) and "http://w1/generate rejected request" in str(bad)
    assert good.response_tokens == [7, 2]


def test_memory_release_and_resume_go_to_every_worker_with_sglangs_tags():
    servers = FakeServers()
    engine = SGLangEngine(["http://w1", "http://w2"], transport=httpx.MockTransport(servers))
    engine.release_memory(["weights"])
    engine.resume_memory()
    assert sorted(servers.paths("/release_memory_occupation")) == [
        ("http://w1/release_memory_occupation", {"tags": ["weights"]}),
        ("http://w2/release_memory_occupation", {"tags": ["weights"]}),
    ]
    assert [body for _, body in servers.paths("/resume_memory_occupation")] == [{"tags": None}] * 2  # None: all
    assert engine.health_generate() == {"http://w1": True, "http://w2": True}


def test_generate_goes_to_the_router_and_control_calls_to_every_worker_with_sglangs_pause_modes():
    servers = FakeServers()
    engine = SGLangEngine(["http://w1", "http://w2"], router_url="http://router",
                          transport=httpx.MockTransport(servers))  # fmt: skip
    asyncio.run(engine.generate(GenerateRequest([1], SamplingConfig())))
    assert [url for url, _ in servers.paths("/generate")] == ["http://router/generate"]
    for mode in ("keep", "retract", "abort"):
        assert asyncio.run(engine.pause(mode)) == []
    asyncio.run(engine.resume())
    asyncio.run(engine.flush_cache())
    bodies = [body["mode"] for _, body in servers.paths("/pause_generation")]
    assert sorted(bodies) == sorted(["in_place", "retract", "abort"] * 2)
    assert {url for url, _ in servers.paths("/pause_generation")} == {"http://w1/pause_generation",
                                                                      "http://w2/pause_generation"}  # fmt: skip
    assert len(servers.paths("/continue_generation")) == len(servers.paths("/flush_cache")) == 2
    with pytest.raises(ValueError, match="pause mode must be one of"):
        asyncio.run(engine.pause("in_place"))


# -- a real miles serve ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    server = start_miles_serve(tiny_llama_dir, tmp_path_factory.mktemp("sglang_engine"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """An in-process engine with the server's weights and settings."""
    return EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])


@pytest.fixture
def client(server):
    engine = SGLangEngine([server.url], stop_token_ids=[2], request_timeout_s=60, max_retries=0)
    yield engine
    httpx.post(server.url + "/slow_down", json={"forward_sleep_time": None})
    asyncio.run(engine.resume())
    engine.close()


def generate_all(engine, requests):
    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return asyncio.run(run())


def long_seeds(reference, prompt, sampling, count):
    """Seeds whose responses run to max_new_tokens (no stop id), so a pause always finds them running."""
    outputs = reference.generate_batch([GenerateRequest(prompt, sampling, seed=s) for s in range(32)])
    seeds = [s for s, out in enumerate(outputs) if out.finish_reason == "length"]
    assert len(seeds) >= count
    return seeds[:count]


def current_load(server) -> dict:
    """The server's ``/get_load``: num_reqs (running + waiting), num_waiting_reqs."""
    return httpx.get(server.url + "/get_load", timeout=10).json()[0]


def wait_for_load(server, condition, timeout_s=30.0) -> dict:
    """Poll ``/get_load`` until ``condition(load)``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = current_load(server)
        if condition(load):
            return load
        time.sleep(0.01)
    raise AssertionError(f"/get_load never met the condition; last {load}")


def slow_down(server, seconds):
    httpx.post(server.url + "/slow_down", json={"forward_sleep_time": seconds}).raise_for_status()


@pytest.mark.integration
def test_the_clients_log_probs_are_the_embedded_engines_prefill_scores_of_the_same_tokens(client, reference):
    assert isinstance(client, Engine) and asyncio.run(client.health()) and client.weight_version == 0
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=10)
    requests = [GenerateRequest([1, 3 + i], sampling, seed=20 + i) for i in range(4)]
    outputs, again = generate_all(client, requests), generate_all(client, requests)
    assert [o.response_tokens for o in outputs] == [o.response_tokens for o in again]  # same seed, same tokens
    expected = reference.generate_batch(requests)
    scores = reference.score([r.prompt_tokens for r in requests], [o.response_tokens for o in outputs],
                             temperature=0.8)  # fmt: skip
    for out, want, score, request in zip(outputs, expected, scores, requests):
        assert out.response_tokens == want.response_tokens and out.finish_reason == want.finish_reason
        assert out.log_probs == pytest.approx(score[: len(out.log_probs)].tolist(), abs=1e-5)
        assert out.request_id == request.request_id and out.weight_versions == [0]


@pytest.mark.integration
def test_pause_abort_ends_every_in_flight_request_with_abort_and_loses_none(client, server, reference):
    sampling = SamplingConfig(max_new_tokens=30)
    cold = SamplingConfig(temperature=0.8, max_new_tokens=30)  # another setting: it decodes beside the others
    requests = [GenerateRequest([1, 4], sampling, seed=s) for s in long_seeds(reference, [1, 4], sampling, 3)]
    requests.append(GenerateRequest([1, 4], cold, seed=long_seeds(reference, [1, 4], cold, 1)[0]))
    slow_down(server, 0.05)

    async def run():
        tasks = [asyncio.ensure_future(client.generate(r)) for r in requests]
        await asyncio.to_thread(
            wait_for_load, server, lambda load: load["num_reqs"] == 4 and not load["num_waiting_reqs"]
        )
        assert await client.pause("abort") == []
        return await asyncio.gather(*tasks)

    outputs = asyncio.run(run())
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    assert [o.finish_reason for o in outputs] == ["abort"] * 4
    for out, request in zip(outputs, requests):
        assert 1 <= len(out.response_tokens) < 30
        if out.response_tokens:  # the running batch's partial responses, scored as the trainer would
            score = reference.score([request.prompt_tokens], [out.response_tokens],
                                    temperature=request.sampling.temperature)[0]  # fmt: skip
            assert out.log_probs == pytest.approx(score.tolist(), abs=1e-5)


@pytest.mark.integration
def test_pause_retract_then_resume_completes_every_request_once_as_if_never_paused(client, server, reference):
    sampling = SamplingConfig(max_new_tokens=12)
    requests = [GenerateRequest([1, 6], sampling, seed=s) for s in long_seeds(reference, [1, 6], sampling, 3)]
    uninterrupted = reference.generate_batch(requests)
    slow_down(server, 0.05)

    async def run():
        tasks = [asyncio.ensure_future(client.generate(r)) for r in requests]
        await asyncio.to_thread(wait_for_load, server, lambda load: load["num_reqs"] == 3 > load["num_waiting_reqs"])
        await client.pause("retract")
        load = await asyncio.to_thread(current_load, server)
        assert (load["num_reqs"], load["num_waiting_reqs"]) == (3, 3)  # retracted, waiting, none finished
        assert not any(task.done() for task in tasks)
        slow_down(server, 0)
        await client.resume()
        return await asyncio.gather(*tasks)

    outputs = asyncio.run(run())
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    for out, want in zip(outputs, uninterrupted):
        assert out.finish_reason == "length" and out.response_tokens == want.response_tokens
        assert out.log_probs == pytest.approx(want.log_probs, abs=1e-5)


@pytest.mark.integration
def test_pause_keep_lets_running_requests_finish_and_holds_the_rest_until_resume(client, server, reference):
    sampling = SamplingConfig(max_new_tokens=6)
    requests = [GenerateRequest([1, 7], sampling, seed=s) for s in range(3)]
    late = GenerateRequest([1, 8], sampling, seed=5)
    expected = reference.generate_batch([*requests, late])
    # 0.2 s per forward: the three requests run together for ~1 s, long enough for the 10 ms load poll to see it on
    # a loaded machine (regression: with 0.05 s they once all finished unseen and the poll timed out)
    slow_down(server, 0.2)

    async def run():
        tasks = [asyncio.ensure_future(client.generate(r)) for r in requests]
        await asyncio.to_thread(wait_for_load, server, lambda load: load["num_reqs"] == 3 > load["num_waiting_reqs"])
        await client.pause("keep")  # returns once the running batch has finished
        held = (await asyncio.to_thread(current_load, server))["num_waiting_reqs"]
        assert held < 3  # the running batch finished; the others (if any) wait
        late_task = asyncio.ensure_future(client.generate(late))
        await asyncio.to_thread(wait_for_load, server, lambda load: load["num_waiting_reqs"] == held + 1)
        assert not late_task.done()
        slow_down(server, 0)
        await client.resume()
        return await asyncio.gather(*tasks, late_task)

    outputs = asyncio.run(run())
    assert [o.request_id for o in outputs] == [r.request_id for r in [*requests, late]]
    assert [o.response_tokens for o in outputs] == [o.response_tokens for o in expected]
    assert all(o.finish_reason in ("stop", "length") for o in outputs)


def perturbed(state, seed):
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in state.items()}


@pytest.mark.integration
def test_a_weight_push_gives_exactly_the_outputs_of_an_engine_loaded_with_the_new_weights(
    client, server, reference, tiny_llama_dir
):
    # Last in the module: the server holds other weights afterwards.
    new = perturbed(reference.model.state_dict(), seed=1)
    updated = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    updated.load_weights(new.items())
    sampling = SamplingConfig(max_new_tokens=8)
    requests = [GenerateRequest([1, 2 + i], sampling, seed=40 + i) for i in range(3)]
    before = generate_all(client, requests)
    assert [o.response_tokens for o in before] == [o.response_tokens for o in reference.generate_batch(requests)]
    sink = SGLangWeightSink(client, bucket_bytes=32 * 2**10)  # several buckets of the ~0.3 MB model
    try:
        assert sink.push(new.items()) == 1
        assert client.weight_version == 1
        expected = updated.generate_batch(requests)
        after = generate_all(client, requests)
        assert [o.response_tokens for o in after] == [o.response_tokens for o in expected]
        for out, want in zip(after, expected):
            assert out.log_probs == pytest.approx(want.log_probs, abs=1e-5) and out.weight_versions == [1]
        assert [o.response_tokens for o in after] != [o.response_tokens for o in before]

        # A wrong shape fails the push; its bucket (with the changed norm beside it) loads nothing.
        bad = dict(new)
        bad["model.norm.weight"] = new["model.norm.weight"] * 3
        bad["lm_head.weight"] = torch.zeros(31, 64)
        with pytest.raises(WeightUpdateError, match=f"v2 failed: {server.url}/update_weights_from_distributed"
                                                    r": .*'lm_head.weight' arrived with shape \[31, 64\]"):  # fmt: skip
            sink.push(bad.items(), version=2)
        assert client.weight_version == 1 and sink.version == 1
        assert [o.response_tokens for o in generate_all(client, requests)] == [o.response_tokens for o in expected]
        assert sink.push(new.items(), version=2) == 2  # the same group goes on

        # A server that lost the group fails the push at once; the next push joins a new group.
        httpx.post(server.url + "/destroy_weights_update_group", json={"group_name": sink.group_name})
        started = time.monotonic()
        with pytest.raises(WeightUpdateError, match="no weight update group"):
            sink.push(new.items(), version=3)
        assert time.monotonic() - started < 20  # not the group's 300 s timeout
        assert sink.push(new.items(), version=3) == 3 and client.weight_version == 3
    finally:
        sink.close()


@pytest.mark.integration
def test_released_weights_fail_health_generate_until_resumed_and_pushed_again(
    client, server, reference, tiny_llama_dir
):
    # After the weight push test: the server holds perturbed(seed=1) weights at version 3. Colocated training frees
    # the engine's memory between rollouts: release -> (trainer runs) -> resume -> push -> generate.
    new = perturbed(reference.model.state_dict(), seed=1)
    expected_engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    expected_engine.load_weights(new.items())
    requests = [GenerateRequest([1, 2 + i], SamplingConfig(max_new_tokens=8), seed=60 + i) for i in range(2)]
    assert client.health_generate() == {server.url: True}
    asyncio.run(client.pause("abort"))
    try:
        client.release_memory(["weights"])
        asyncio.run(client.resume())
        assert client.health_generate() == {server.url: False}  # no weights: it cannot generate a token
        client.resume_memory(["weights"])  # zero-filled until a push
        sink = SGLangWeightSink(client)
        try:
            assert sink.push(new.items(), version=4) == 4
        finally:
            sink.close()
    finally:
        asyncio.run(client.resume())
    assert client.health_generate() == {server.url: True}
    outputs = generate_all(client, requests)
    expected = expected_engine.generate_batch(requests)
    assert [o.response_tokens for o in outputs] == [o.response_tokens for o in expected]
    with pytest.raises(ValueError, match=r"memory tags must be 'weights' and/or 'kv_cache', got \['gpu'\]"):
        client.release_memory(["gpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real SGLang servers need a CUDA GPU (none here)")
def test_a_real_sglang_server_samples_and_takes_an_in_place_update(smollm2_dir, tmp_path):
    """The same client and sink against real SGLang (``pip install sglang``), on a GPU machine."""
    pytest.importorskip("sglang", reason="SGLang is not installed (pip install sglang)")
    from safetensors.torch import load_file

    port = free_port()
    command = launch_command(smollm2_dir, port=port, extra_args=["--sglang-mem-fraction-static", "0.3"])
    with ServerProcess("SGLang", command, host="127.0.0.1", port=port, log_path=tmp_path / "sglang.log",
                       health_path="/health_generate", startup_timeout_s=900):  # fmt: skip
        engine = SGLangEngine([f"http://127.0.0.1:{port}"], stop_token_ids=[2])
        request = GenerateRequest([1, 504, 3458, 282, 4649], SamplingConfig(max_new_tokens=16), seed=3)
        out = asyncio.run(engine.generate(request))
        assert out.response_tokens and len(out.log_probs) == len(out.response_tokens)
        state = {k: v.float().cuda() * 1.01 for k, v in load_file(str(smollm2_dir / "model.safetensors")).items()}
        asyncio.run(engine.pause("keep"))
        try:
            assert SGLangWeightSink(engine).push(state.items(), version=1) == 1
            asyncio.run(engine.flush_cache())
        finally:
            asyncio.run(engine.resume())
        assert asyncio.run(engine.generate(request)).weight_version == 1
