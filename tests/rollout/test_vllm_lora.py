"""LoRA adapter updates into vLLM (``train.lora.sync adapter``): the peft directory each version is written as and
the sink's protocol against fake servers here; a real LoRA-enabled vLLM server (``-m vllm``) applies the adapters
exactly as the embedded engine does, in place, and keeps serving its adapter when an update is refused."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest
from miles.rollout.engines.adapters import read_adapter_dir, write_adapter_dir
from miles.rollout.engines.vllm import VLLMEngine, launch_vllm_servers
from miles.rollout.engines.vllm_lora import ADAPTER_NAME, LORA_ENV, VLLMAdapterSink, lora_server_args
from miles.sync import WeightUpdateError
from safetensors.torch import load_file
from servers import vllm_python

TARGETS = ("q_proj", "v_proj")


def _adapters(hidden: int, kv: int, layers: int, rank: int, seed: int, scale: float = 0.05) -> dict:
    """Trainer-named adapter tensors (``...lora_A.default.weight`` [r, in], ``...lora_B.default.weight`` [out, r])."""
    g = torch.Generator().manual_seed(seed)
    out = {"q_proj": hidden, "v_proj": kv}
    named = {}
    for layer in range(layers):
        for target in TARGETS:
            prefix = f"model.layers.{layer}.self_attn.{target}"
            named[f"{prefix}.lora_A.default.weight"] = torch.randn(rank, hidden, generator=g) / hidden**0.5
            named[f"{prefix}.lora_B.default.weight"] = scale * torch.randn(out[target], rank, generator=g)
    return named


def test_server_args_round_the_rank_up_to_one_vllm_accepts_and_refuse_larger_ones():
    assert lora_server_args(4)[:3] == ["--enable-lora", "--max-lora-rank", "8"]
    assert lora_server_args(16)[2] == "16" and lora_server_args(1)[2] == "1" and lora_server_args(300)[2] == "320"
    with pytest.raises(ValueError, match="train.lora.rank is 600; vLLM serves adapters of rank 1 to 512"):
        lora_server_args(600)


def test_an_adapter_version_is_a_peft_directory_with_the_scaling_already_in_b(tmp_path):
    named = _adapters(hidden=8, kv=4, layers=2, rank=2, seed=0)
    path = write_adapter_dir(tmp_path, 3, named.items())
    assert path == tmp_path / "v000003" and sorted(p.name for p in tmp_path.iterdir()) == ["v000003"]
    config = json.loads((path / "adapter_config.json").read_text())
    # scaling alpha / r = 1: B arrives scaled by the trainer, so the server must not scale it again
    assert config["r"] == 2 and config["lora_alpha"] == 2 and not config["use_rslora"]
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["peft_type"] == "LORA"
    saved = load_file(str(path / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(
        "base_model.model." + name.replace(".default.", ".") for name in named
    )  # peft's saved names, as PeftModel.save_pretrained writes them
    for name, tensor in named.items():
        assert torch.equal(saved["base_model.model." + name.replace(".default.", ".")], tensor)
    back = read_adapter_dir(path)  # what miles serve loads: the same names and tensors
    assert back.keys() == named.keys() and all(torch.equal(back[n], t) for n, t in named.items())
    config["lora_alpha"] = 8  # a peft directory of another scaling (8 / 2): B comes back scaled by it
    (path / "adapter_config.json").write_text(json.dumps(config))
    scaled = read_adapter_dir(path)
    assert all(torch.equal(scaled[n], 4 * t if ".lora_B." in n else t) for n, t in named.items())
    config["use_rslora"] = True  # 8 / sqrt(2)
    (path / "adapter_config.json").write_text(json.dumps(config))
    b = "model.layers.0.self_attn.q_proj.lora_B.default.weight"
    assert torch.allclose(read_adapter_dir(path)[b], named[b] * 8 / 2**0.5)


@pytest.mark.parametrize(
    ("named", "message"),
    [
        ({"model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2)}, "got 'model.layers.0.self_attn.q_proj.weight'"),
        (
            {"a.lora_A.default.weight": torch.ones(2, 3), "b.lora_A.default.weight": torch.ones(4, 3)},
            r"lora_A tensors of one rank, got ranks \[2, 4\]",
        ),
        ({}, r"got ranks \[\]"),
    ],
)
def test_an_update_that_is_not_one_adapter_is_refused_and_nothing_is_published(tmp_path, named, message):
    with pytest.raises(WeightUpdateError, match=message):
        write_adapter_dir(tmp_path, 1, named.items())
    assert not list(tmp_path.glob("v*"))


class FakeLoraServers:
    """Two vLLM servers' LoRA endpoints for ``httpx.MockTransport``: ``refuse`` servers answer a load with 500."""

    def __init__(self, refuse=()):
        self.refuse = set(refuse)
        self.loaded: dict[str, str] = {}  # host -> path
        self.versions: dict[str, str] = {}
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = f"http://{request.url.host}", request.url.path
        if path == "/v1/load_lora_adapter":
            body = json.loads(request.content)
            self.bodies.append(body)
            if host in self.refuse:
                return httpx.Response(500, json={"error": {"message": "Loading lora failed: bad rank"}})
            self.loaded[host] = body["lora_path"]
            return httpx.Response(200, text="Success")
        if path == "/v1/models":
            cards = [{"id": "base", "root": "base", "parent": None}]
            if host in self.loaded:
                cards.append({"id": ADAPTER_NAME, "root": self.loaded[host], "parent": "base"})
            return httpx.Response(200, json={"data": cards})
        if path == "/update_weight_version":
            self.versions[host] = json.loads(request.content)["new_version"]
        return httpx.Response(200, json={})


def test_the_sink_loads_each_version_in_place_on_every_server_and_requests_then_name_the_adapter(tmp_path):
    servers = FakeLoraServers()
    engine = VLLMEngine(
        ["http://s0", "http://s1"], model="base", adapter=ADAPTER_NAME, transport=httpx.MockTransport(servers)
    )
    request = GenerateRequest([1, 2], SamplingConfig(max_new_tokens=1))
    assert engine.request_body(request)["model"] == "base"  # nothing loaded yet: the base model
    sink = VLLMAdapterSink(engine, root=tmp_path, keep=2)
    for version in (1, 2, 3):
        assert sink.push(_adapters(8, 4, 1, 2, seed=version).items()) == version
    assert engine.weight_version == 3 and servers.versions == {"http://s0": "3", "http://s1": "3"}
    assert engine.request_body(request)["model"] == ADAPTER_NAME
    # one name, replaced in place (no adapter piles up on the servers), each version from a directory of its own
    assert {(b["lora_name"], b["load_inplace"]) for b in servers.bodies} == {(ADAPTER_NAME, True)}
    assert servers.loaded == {"http://s0": str(tmp_path / "v000003"), "http://s1": str(tmp_path / "v000003")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003"]  # the last `keep` versions stay
    with pytest.raises(ValueError, match="push version 3 is not newer than the engine's v3"):
        sink.push(_adapters(8, 4, 1, 2, seed=9).items(), version=3)


def test_an_update_with_other_adapters_than_the_first_is_refused_before_anything_is_written(tmp_path):
    servers = FakeLoraServers()
    engine = VLLMEngine(["http://s0"], model="base", adapter=ADAPTER_NAME, transport=httpx.MockTransport(servers))
    sink = VLLMAdapterSink(engine, root=tmp_path)
    sink.push(_adapters(8, 4, 1, 2, seed=1).items())
    narrow = {n: (t[:, :-1] if ".lora_A." in n else t) for n, t in _adapters(8, 4, 1, 2, seed=2).items()}
    with pytest.raises(WeightUpdateError, match=r"v2 differs .* e.g. \['model.layers.0.self_attn.q_proj.lora_A"):
        sink.push(narrow.items())
    fewer = {n: t for n, t in _adapters(8, 4, 1, 2, seed=2).items() if "v_proj" not in n}
    with pytest.raises(WeightUpdateError, match="v2 differs .*v_proj.lora_A.default.weight"):
        sink.push(fewer.items())
    assert engine.weight_version == 1 and [p.name for p in tmp_path.iterdir()] == ["v000001"]


def test_a_version_refused_by_one_server_is_rolled_back_on_the_others_to_the_last_committed_one(tmp_path):
    servers = FakeLoraServers()
    engine = VLLMEngine(
        ["http://s0", "http://s1"], model="base", adapter=ADAPTER_NAME, transport=httpx.MockTransport(servers)
    )
    sink = VLLMAdapterSink(engine, root=tmp_path, keep=2)
    sink.push(_adapters(8, 4, 1, 2, seed=1).items())
    servers.refuse.add("http://s1")
    with pytest.raises(WeightUpdateError, match="LoRA adapter v2 was not loaded: vLLM at http://s1"):
        sink.push(_adapters(8, 4, 1, 2, seed=2).items())
    # s0 had loaded v2 in place (no undo in vLLM): it got v1 back
    assert servers.loaded["http://s0"] == str(tmp_path / "v000001") and engine.weight_version == 1


def test_a_server_that_refuses_an_adapter_fails_the_push_naming_it_and_the_version_stays(tmp_path):
    servers = FakeLoraServers(refuse={"http://s1"})
    engine = VLLMEngine(
        ["http://s0", "http://s1"], model="base", adapter=ADAPTER_NAME, transport=httpx.MockTransport(servers)
    )
    sink = VLLMAdapterSink(engine, root=tmp_path)
    with pytest.raises(WeightUpdateError, match=r"LoRA adapter v1 was not loaded: vLLM at http://s1: .* 500"):
        sink.push(_adapters(8, 4, 1, 2, seed=1).items())
    assert engine.weight_version == 0 and servers.versions == {}
    assert engine.request_body(GenerateRequest([1], SamplingConfig()))["model"] == "base"


# -- a real LoRA-enabled vLLM server --------------------------------------------------------------------------------
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=16)
PROMPTS = [[1, 9690, 314, 253, 1842, 28, 30, 17, 30], [1, 4093, 6, 744, 314, 1701, 47, 198]]


@pytest.fixture(scope="module")
def lora_vllm(smollm2_dir, tmp_path_factory):
    servers = launch_vllm_servers(
        smollm2_dir,
        python=vllm_python(),
        log_dir=tmp_path_factory.mktemp("vllm_lora_logs"),
        max_model_len=512,
        env={"OMP_NUM_THREADS": "2", **LORA_ENV},
        extra_args=lora_server_args(4),
    )
    engine = VLLMEngine(
        [s.url for s in servers], model=str(smollm2_dir), stop_token_ids=[2], servers=servers, adapter=ADAPTER_NAME
    )
    yield engine
    engine.close()
    assert not any(s.running for s in servers)


def _gap(engine, reference, seed: int) -> tuple[float, list]:
    requests = [GenerateRequest(p, SAMPLING, seed=seed + i) for i, p in enumerate(PROMPTS)]

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    outputs = asyncio.run(run())
    scores = reference.score(PROMPTS, [o.response_tokens for o in outputs], temperature=SAMPLING.temperature)
    gap = max(
        (scores[b, : len(o.log_probs)] - torch.tensor(o.log_probs)).abs().max().item() for b, o in enumerate(outputs)
    )
    return gap, outputs


def _push(engine, sink, named):
    asyncio.run(engine.pause("keep"))
    try:
        return sink.push(named.items())
    finally:
        asyncio.run(engine.resume())


@pytest.mark.vllm
def test_vllm_applies_pushed_adapters_as_the_embedded_engine_does_and_keeps_its_adapter_on_a_refused_one(
    lora_vllm, smollm2_dir, tmp_path
):
    from miles.rollout.engines import EmbeddedEngine

    reference = EmbeddedEngine(smollm2_dir, stop_token_ids=[2])  # applies the same adapters over the same base
    config = json.loads((smollm2_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    sink = VLLMAdapterSink(lora_vllm, root=tmp_path / "adapters")
    base_gap, _ = _gap(lora_vllm, reference, seed=1)
    assert base_gap < 2e-4  # version 0: the base model

    first = _adapters(hidden, kv, layers, rank=4, seed=1)
    assert _push(lora_vllm, sink, first) == 1
    reference.load_weights(first.items())
    gap, outputs = _gap(lora_vllm, reference, seed=1)
    print(f"max |vLLM + adapter - embedded + adapter| log-prob: {gap:.2e}")
    assert gap < 2e-4 and all(o.weight_versions == [1] for o in outputs)  # 4.8e-5 here (AVX2)
    base = EmbeddedEngine(smollm2_dir, stop_token_ids=[2])
    shifted = base.score(PROMPTS, [o.response_tokens for o in outputs], temperature=1.0)
    assert (
        max(
            (shifted[b, : len(o.log_probs)] - torch.tensor(o.log_probs)).abs().max().item()
            for b, o in enumerate(outputs)
        )
        > 1e-2
    )  # the adapter matters

    second = _adapters(hidden, kv, layers, rank=4, seed=2)  # replaces the first in place
    assert _push(lora_vllm, sink, second) == 2
    reference.load_weights(second.items())
    assert _gap(lora_vllm, reference, seed=3)[0] < 2e-4

    # rank 16 is above the server's --max-lora-rank 8: vLLM refuses it (a new sink: this one would refuse it first)
    too_large = _adapters(hidden, kv, layers, rank=16, seed=3)
    with pytest.raises(
        WeightUpdateError, match="LoRA adapter v3 was not loaded: .*LoRA rank 16 is greater than max_lora_rank 8"
    ):
        _push(lora_vllm, VLLMAdapterSink(lora_vllm, root=tmp_path / "other"), too_large)
    assert lora_vllm.weight_version == 2 and lora_vllm.server_versions() == ["2"]
    assert _gap(lora_vllm, reference, seed=5)[0] < 2e-4  # still the second adapter
