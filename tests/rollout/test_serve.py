"""``miles serve``: SGLang's /generate wire format, the embedded engine's per-request abort and weight release it
relies on, and the real server in a subprocess answering as SGLang does."""

import asyncio
import concurrent.futures
import math
import threading
import time

import httpx
import pytest
import torch
from doubles import hold_sampling_step
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateOutput, GenerateRequest
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.engines.embedded import WeightsReleasedError
from miles.rollout.engines.sglang_api import generate_response, parse_generate_request
from servers import start_miles_serve

LIMITS = {"vocab_size": 32, "context_length": 256, "stop_token_ids": [2]}


def parse(body):
    return parse_generate_request(body, **LIMITS)


# -- the wire format ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampling_params, expected, seed",
    [
        pytest.param({}, SamplingConfig(max_new_tokens=128), None, id="sglang_defaults_max_new_tokens_128"),
        pytest.param(
            {"temperature": 0, "max_new_tokens": 4},
            SamplingConfig(top_k=1, max_new_tokens=4),
            None,
            id="temperature_0_is_greedy_top_k_1",
        ),  # fmt: skip
        pytest.param(
            {"top_k": -1, "top_p": 0.9, "max_new_tokens": 3},
            SamplingConfig(top_p=0.9, max_new_tokens=3),
            None,
            id="top_k_minus_1_is_off",
        ),  # fmt: skip
        pytest.param(
            {"top_k": 1 << 30, "max_new_tokens": 3}, SamplingConfig(max_new_tokens=3), None, id="top_k_all_is_off"
        ),  # fmt: skip
        pytest.param(
            {
                "temperature": 0.7,
                "top_k": 5,
                "max_new_tokens": 9,
                "sampling_seed": 11,
                "stop_token_ids": [2],
                "skip_special_tokens": False,
                "no_stop_trim": True,
                "min_p": 0.0,
            },  # fmt: skip
            SamplingConfig(temperature=0.7, top_k=5, max_new_tokens=9),
            11,
            id="seed_and_neutral_fields",
        ),
    ],
)
def test_sglang_sampling_params_map_to_miles_sampling(sampling_params, expected, seed):
    request, return_logprob = parse(
        {"input_ids": [1, 5], "sampling_params": sampling_params, "rid": "r1", "return_logprob": True}
    )
    assert request.sampling == expected and request.seed == seed
    assert request.prompt_tokens == [1, 5] and request.request_id == "r1" and return_logprob is True


@pytest.mark.parametrize(
    "body, message",
    [
        pytest.param({"input_ids": []}, "input_ids must be a non-empty list", id="empty_input_ids"),
        pytest.param({"input_ids": [1, "x"]}, "non-integer ids", id="non_int_ids"),
        pytest.param({"input_ids": [1, True]}, "non-integer ids", id="bool_is_not_an_id"),
        pytest.param({"input_ids": [[1, 2], [3]]}, "a batch of prompts", id="batch_of_prompts"),
        pytest.param({"input_ids": [1, 40]}, "outside the vocabulary [0, 32)", id="id_out_of_vocab"),
        pytest.param({"text": "hi"}, "token-in-token-out; send input_ids", id="text"),
        pytest.param({"input_ids": [1], "stream": True}, "stream=True is not supported", id="stream"),
        pytest.param({"input_ids": [1], "lora_id": "x"}, "lora_id='x' is not supported", id="lora"),
        pytest.param({"input_ids": [1], "bogus": 1}, "bogus is not a field miles serve knows", id="unknown_field"),
        pytest.param(
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}},
            "max_new_tokens must be an integer >= 1",
            id="max_new_tokens_0",
        ),  # fmt: skip
        pytest.param(
            {"input_ids": [1], "sampling_params": {"top_k": 0}},
            "top_k must be -1 (off) or >= 1",
            id="top_k_0_is_invalid_in_sglang",
        ),  # fmt: skip
        pytest.param({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]", id="top_p_0"),
        pytest.param(
            {"input_ids": [1], "sampling_params": {"temperature": -1}},
            "temperature must be a number >= 0",
            id="negative_temperature",
        ),  # fmt: skip
        pytest.param(
            {"input_ids": [1], "sampling_params": {"min_p": 0.1}}, "min_p=0.1 is not supported", id="min_p"
        ),  # fmt: skip
        pytest.param({"input_ids": [1], "sampling_params": {"n": 2}}, "n=2 is not supported", id="n_2"),
        pytest.param(
            {"input_ids": [1], "sampling_params": {"stop_token_ids": [5]}},
            "stop_token_ids [5] are not among the engine's stop ids [2]",
            id="stop_id_outside_engine_set",
        ),
        pytest.param(
            {"input_ids": [1] * 200, "sampling_params": {"max_new_tokens": 57}},
            "exceed the model's context length 256",
            id="context_length",
        ),  # fmt: skip
        pytest.param({"input_ids": [1], "rid": 5}, "rid must be a string", id="rid_not_a_string"),
        pytest.param(
            {"input_ids": [1], "return_routed_experts": True},
            "return_routed_experts is true but this server records no routing; start miles serve with "
            "--enable-return-routed-experts",
            id="routing_not_recorded",
        ),
    ],
)
def test_bad_generate_bodies_are_rejected_with_one_line_naming_the_field(body, message):
    with pytest.raises(ValueError) as err:
        parse(body)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_answer_has_sglangs_shape_and_writes_non_finite_log_probs_as_null():
    request = GenerateRequest([1, 5], SamplingConfig(max_new_tokens=3), request_id="r7")
    stop = GenerateOutput([4, 2], [-0.5, float("nan")], "stop", weight_versions=[3])
    body = generate_response(stop, request, return_logprob=True, latency_s=0.1)
    assert body["output_ids"] == [4, 2] and body["text"] == ""
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == ("r7", 2, 2, "3")
    assert meta["output_token_logprobs"] == [[-0.5, 4, None], [None, 2, None]]
    length = generate_response(GenerateOutput([4, 4, 4], [-1.0] * 3, "length"), request, return_logprob=False,
                               latency_s=0.1)  # fmt: skip
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert "output_token_logprobs" not in length["meta_info"]


def test_a_continued_request_keeps_every_version_and_segment_through_the_sglang_api():
    """Regression: miles serve answered only the newest version of a request retracted across weight updates, so
    the client saw [2] for tokens sampled by v1 and v2 (staleness undercounted, nothing to mask by)."""
    from miles.rollout.engines.sglang_api import parse_generate_response

    request = GenerateRequest([1, 5], SamplingConfig(max_new_tokens=5), request_id="r8")
    continued = GenerateOutput([4, 4, 4, 6, 2], [-1.0] * 5, "stop", weight_versions=[1, 2], segment_lengths=[3, 2])
    body = generate_response(continued, request, return_logprob=True, latency_s=0.1)
    assert body["meta_info"]["weight_version"] == "2"  # SGLang's own key: the last version
    parsed = parse_generate_response(body, request)
    assert (parsed.weight_versions, parsed.segment_lengths) == ([1, 2], [3, 2])
    assert parsed.token_versions() == [1, 1, 1, 2, 2]
    body["meta_info"]["miles_segment_lengths"] = [3, 1]
    with pytest.raises(ValueError, match=r"miles_segment_lengths \[3, 1\], which do not split its 5 tokens"):
        parse_generate_response(body, request)
    sglang_like = {**body, "meta_info": {k: v for k, v in body["meta_info"].items() if not k.startswith("miles_")}}
    assert parse_generate_response(sglang_like, request).weight_versions == [2]  # real SGLang: the last only


# -- the engine features behind /abort_request and /release_memory_occupation ---------------------
def test_abort_ends_a_queued_request_at_once_with_nothing_sampled(tiny_llama_dir):
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    engine.pause_now("keep")  # nothing runs: the request stays queued
    request = GenerateRequest([1, 4], SamplingConfig(max_new_tokens=4), seed=0)

    async def run():
        task = asyncio.ensure_future(engine.generate(request))
        await asyncio.sleep(0)  # the submitting turn ends: the request is queued
        assert engine.load().num_waiting == 1
        assert engine.abort("unknown") == 0 and engine.abort(request.request_id) == 1
        return await task

    output = asyncio.run(run())
    assert (output.finish_reason, output.response_tokens, output.log_probs) == ("abort", [], [])
    assert engine.load() == (0, 0, 0)


def test_abort_ends_a_running_request_after_the_decode_step_while_its_batch_goes_on(tiny_llama_dir):
    # Stop id 30, and seeds that do not sample it within 8 tokens, so both rows would run to max_new_tokens.
    sampling = SamplingConfig(max_new_tokens=8)
    reference = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[30])
    for seed in range(0, 100, 2):
        reqs = [GenerateRequest([1, 4], sampling, seed=seed), GenerateRequest([1, 9], sampling, seed=seed + 1)]
        alone = reference.generate_batch(reqs)
        if [o.finish_reason for o in alone] == ["length", "length"]:
            break
    assert [o.finish_reason for o in alone] == ["length", "length"]
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[30])
    aborted = threading.Event()
    held, _ = hold_sampling_step(engine, 3, until=aborted.is_set, num_prompts=2)  # the 3rd token is coming

    async def run():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        assert await asyncio.to_thread(held.wait, 30)
        assert engine.load().num_running == 2
        assert engine.abort(reqs[0].request_id) == 1
        aborted.set()
        return await asyncio.gather(*tasks)

    cut, other = asyncio.run(run())
    assert cut.finish_reason == "abort" and cut.response_tokens == alone[0].response_tokens[:3]
    assert cut.log_probs == pytest.approx(alone[0].log_probs[:3], abs=1e-5)
    assert other.finish_reason == "length" and other.response_tokens == alone[1].response_tokens
    assert other.log_probs == pytest.approx(alone[1].log_probs, abs=1e-5)
    assert list(engine.batch_sizes) == [2]


def test_released_weights_free_the_parameters_and_resume_zero_filled(tiny_llama_dir):
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    request = GenerateRequest([1, 5], SamplingConfig(max_new_tokens=3), seed=1)
    before = engine.generate_batch([request])[0]
    engine.release_weights()
    assert all(p.numel() == 0 for p in engine.model.parameters()) and not asyncio.run(engine.health())
    with pytest.raises(WeightsReleasedError, match="resume_weights"):
        engine.generate_batch([request])
    with pytest.raises(WeightsReleasedError, match="resume_weights first"):
        engine.load_weights(original.items())
    engine.resume_weights()
    assert all(torch.count_nonzero(p) == 0 for p in engine.model.parameters())
    zero = engine.generate_batch([request])[0]  # zero weights: uniform over the 32 ids
    assert zero.log_probs == pytest.approx([-math.log(32)] * 3, abs=1e-5)
    engine.load_weights(original.items())
    again = engine.generate_batch([request])[0]
    assert again.response_tokens == before.response_tokens and again.log_probs == pytest.approx(before.log_probs)


def test_weights_cannot_be_released_while_requests_wait(tiny_llama_dir):
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    engine.pause_now("keep")

    async def run():
        task = asyncio.ensure_future(engine.generate(GenerateRequest([1], SamplingConfig(max_new_tokens=2))))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="0 requests running and 1 waiting; abort them first"):
            engine.release_weights()
        engine.abort()
        return await task

    assert asyncio.run(run()).finish_reason == "abort"


# -- the command ----------------------------------------------------------------------------------
def test_miles_serve_takes_the_servers_options_and_refuses_a_directory_without_a_model(tmp_path, capsys):
    from miles.recipes.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0 and "--logprob-mode {prefill,decode}" in capsys.readouterr().out
    assert main(["serve", "--model", str(tmp_path), "--port", "1"]) == 2
    assert f"--model {tmp_path} is not a HF model directory (no config.json)" in capsys.readouterr().err


# -- the server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    server = start_miles_serve(tiny_llama_dir, tmp_path_factory.mktemp("serve"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """An in-process engine with the server's weights and settings."""
    return EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])


def post(server, path, body=None, **kwargs):
    return httpx.post(server.url + path, json=body if body is not None else {}, timeout=60, **kwargs)


def load(server) -> dict:
    return httpx.get(server.url + "/get_load", timeout=10).json()[0]


def wait_for_load(server, condition, timeout_s=30.0) -> dict:
    """Poll ``/get_load`` until ``condition(load)``; fails the test on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        current = load(server)
        if condition(current):
            return current
        time.sleep(0.01)
    raise AssertionError(f"/get_load never met the condition; last {current}")


@pytest.mark.integration
def test_generate_answers_like_sglang_with_the_engines_tokens_and_log_probs(server, reference):
    body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 6, "sampling_seed": 7, "top_k": -1},
            "return_logprob": True, "rid": "req-1"}  # fmt: skip
    first, second = post(server, "/generate", body).json(), post(server, "/generate", body).json()
    assert first["output_ids"] == second["output_ids"]  # same seed, same tokens
    meta = first["meta_info"]
    tokens = [entry[1] for entry in meta["output_token_logprobs"]]
    assert tokens == first["output_ids"] and meta["id"] == "req-1" and meta["weight_version"] == "0"
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["completion_tokens"] == len(tokens)
    expected = reference.generate_batch([GenerateRequest([1, 5, 6], SamplingConfig(max_new_tokens=6), seed=7)])[0]
    assert tokens == expected.response_tokens
    scored = reference.score([[1, 5, 6]], [tokens], temperature=1.0)[0].tolist()
    assert [entry[0] for entry in meta["output_token_logprobs"]] == pytest.approx(scored, abs=1e-5)


@pytest.mark.integration
def test_bad_requests_get_400_with_one_clear_message(server):
    answer = post(server, "/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 2}})
    assert answer.status_code == 400 and answer.json()["message"] == "input_ids must be a non-empty list of token ids"
    answer = post(server, "/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}})
    assert answer.status_code == 400 and "top_k must be -1 (off) or >= 1, got 0" in answer.json()["message"]
    answer = httpx.post(server.url + "/generate", content=b"{not json", timeout=10)
    assert answer.status_code == 400
    answer = post(server, "/pause_generation", {"mode": "freeze"})
    assert answer.status_code == 400 and "pause mode must be one of" in answer.json()["message"]
    answer = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert answer.status_code == 400 and answer.json() == {
        "success": False,
        "message": "update_weights_from_tensor is not supported by miles serve (SGLang passes CUDA IPC handles); "
        "use update_weights_from_distributed",
    }


@pytest.mark.integration
def test_status_endpoints_describe_the_server(server, tiny_llama_dir):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["model_path"] == str(tiny_llama_dir) and info["is_generation"] is True
    server_info = httpx.get(server.url + "/get_server_info").json()
    assert (server_info["tp_size"], server_info["dp_size"], server_info["stop_token_ids"]) == (1, 1, [2])
    assert load(server) == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


@pytest.mark.integration
def test_abort_request_ends_a_queued_request_at_once_and_a_running_one_after_its_step(server, reference):
    # Queued: the server is paused in place, so the request waits until aborted.
    assert post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = {"input_ids": [1, 4], "sampling_params": {"max_new_tokens": 5}, "return_logprob": True, "rid": "q1"}
            answer = pool.submit(client.post, server.url + "/generate", json=body)
            wait_for_load(server, lambda load: load["num_waiting_reqs"] == 1)
            assert httpx.get(server.url + "/health_generate").status_code == 503  # paused
            assert post(server, "/abort_request", {"rid": "q1"}).status_code == 200
            meta = answer.result().json()["meta_info"]
    finally:
        post(server, "/continue_generation")
    assert meta["finish_reason"]["type"] == "abort" and meta["output_token_logprobs"] == []
    # Running: slowed to 50 ms per forward, a 40-token request (a seed that samples no stop id) is cut mid-way.
    sampling = SamplingConfig(max_new_tokens=40)
    seed = next(s for s in range(50) if reference.generate_batch(
        [GenerateRequest([1, 4], sampling, seed=s)])[0].finish_reason == "length")  # fmt: skip
    post(server, "/slow_down", {"forward_sleep_time": 0.05})
    try:
        with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = {"input_ids": [1, 4], "sampling_params": {"max_new_tokens": 40, "sampling_seed": seed},
                    "return_logprob": True, "rid": "r1"}  # fmt: skip
            answer = pool.submit(client.post, server.url + "/generate", json=body)
            wait_for_load(server, lambda load: load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0)
            post(server, "/abort_request", {"rid": "r1"})
            meta = answer.result().json()["meta_info"]
    finally:
        post(server, "/slow_down", {"forward_sleep_time": None})
    tokens = [entry[1] for entry in meta["output_token_logprobs"]]
    full = reference.generate_batch([GenerateRequest([1, 4], sampling, seed=seed)])[0].response_tokens
    assert meta["finish_reason"]["type"] == "abort" and 1 <= len(tokens) < 40 and tokens == full[: len(tokens)]


@pytest.mark.integration
def test_update_weight_version_sets_the_version_the_answers_carry(server):
    answer = post(server, "/update_weight_version", {"new_version": "4", "abort_all_requests": False})
    assert answer.json() == {"success": True, "message": "Weight version updated to 4", "new_version": "4"}
    assert httpx.get(server.url + "/get_weight_version").json() == {"weight_version": "4"}
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    assert post(server, "/generate", body).json()["meta_info"]["weight_version"] == "4"
    answer = post(server, "/update_weight_version", {"new_version": "v5"})
    assert answer.status_code == 400 and "'v5' is not a Miles version (an integer >= 0" in answer.json()["message"]
    assert httpx.get(server.url + "/get_weight_version").json() == {"weight_version": "4"}


@pytest.mark.integration
def test_release_memory_answers_503_until_resumed_and_weights_are_pushed_again(server, tiny_llama_dir):
    # Last in the module: the server's weights are zeros afterwards.
    # Zero weights sample uniformly over the 32 ids, so 1 request in 32 samples the stop id 2 first and ends after one
    # token. A request without sampling_seed takes its seed from the server's generator, seeded at random when the
    # server starts, so the /generate after resume pins its seed: one that samples 2 tokens and one that stops at
    # once, both picked with an in-process engine holding the same zero weights.
    zero = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    zero.release_weights()
    zero.resume_weights()
    sampling = SamplingConfig(max_new_tokens=2)
    outputs = zero.generate_batch([GenerateRequest([1, 2], sampling, seed=seed) for seed in range(256)])
    two_tokens = next(seed for seed, output in enumerate(outputs) if len(output.response_tokens) == 2)
    stops_at_once = next(seed for seed, output in enumerate(outputs) if output.response_tokens == [2])
    released = post(server, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert released.status_code == 200, released.text
    answer = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert answer.status_code == 503 and "weights are released" in answer.json()["message"], answer.text
    assert "/resume_memory_occupation" in answer.json()["message"]
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 503
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # the process is up: the router keeps it
    resumed = post(server, "/resume_memory_occupation", {})
    assert resumed.status_code == 200, resumed.text
    for seed in (two_tokens, stops_at_once):
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "sampling_seed": seed},
                "return_logprob": True}  # fmt: skip
        answer = post(server, "/generate", body)
        tokens = outputs[seed].response_tokens
        assert answer.json()["output_ids"] == tokens, answer.text
        log_probs = [entry[0] for entry in answer.json()["meta_info"]["output_token_logprobs"]]
        assert log_probs == pytest.approx([-math.log(32)] * len(tokens), abs=1e-5), answer.text  # zero-filled: uniform


@pytest.mark.integration
def test_a_moe_server_returns_the_engines_routing_as_sglang_does(tmp_path):
    """miles serve --enable-return-routed-experts on a tiny DeepSeek-V3, read by Miles' SGLang client: the routing
    (and tokens, log-probs) of the in-process engine with the same seed."""
    from miles.rollout.engines.sglang import SGLangEngine
    from moe_models import EOS, save_moe_model

    model_dir = save_moe_model("deepseek_v3", tmp_path / "moe")
    server = start_miles_serve(model_dir, tmp_path, "--enable-return-routed-experts", "--stop-token-ids", str(EOS))
    try:
        client = SGLangEngine([server.url], stop_token_ids=[EOS], routed_experts_shape=(3, 2))
        request = GenerateRequest([5, 9, 11, 3], SamplingConfig(max_new_tokens=6), seed=3)
        output = asyncio.run(client.generate(request))
        client.close()
    finally:
        server.stop()
    reference = EmbeddedEngine(model_dir, stop_token_ids=[EOS], routed_experts=True)
    (expected,) = reference.generate_batch([request])
    reference.close()
    assert output.response_tokens == expected.response_tokens
    assert output.log_probs == pytest.approx(expected.log_probs, abs=1e-5)
    assert output.routed_experts.shape == (4 + len(expected.response_tokens), 3, 2)
    assert output.routed_experts.tolist() == expected.routed_experts.tolist()  # -1 rows included
