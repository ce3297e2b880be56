"""LoRA adapter updates through SGLang's API (``train.lora.sync adapter`` with ``engine.type sglang``): the sink's
protocol against fake servers (a name per version, the one before kept, older ones unloaded), the client naming the
version the servers hold, and a real ``miles serve`` applying loaded adapters exactly as the embedded engine does.
No SGLang runs here (no GPU): ``miles serve`` speaks SGLang's API, it is not SGLang."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest, RequestFailed
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.engines.sglang import SGLangEngine
from miles.rollout.engines.sglang_lora import SGLangAdapterSink, adapter_name, lora_server_args
from miles.sync import WeightUpdateError
from servers import start_miles_serve


def _adapters(config: dict, rank: int, seed: int, scale: float = 0.3) -> dict:
    """Trainer-named adapters on every layer's q_proj and v_proj of a model with HF ``config``."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads) * config.get("head_dim", hidden // heads)
    g = torch.Generator().manual_seed(seed)
    named = {}
    for layer in range(config["num_hidden_layers"]):
        for target, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"model.layers.{layer}.self_attn.{target}"
            named[f"{prefix}.lora_A.default.weight"] = torch.randn(rank, hidden, generator=g) / hidden**0.5
            named[f"{prefix}.lora_B.default.weight"] = scale * torch.randn(out, rank, generator=g)
    return named


SMALL = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1}


class FakeServers:
    """SGLang's LoRA endpoints for ``httpx.MockTransport``; ``refuse`` servers answer a load with its failure."""

    def __init__(self, refuse=()):
        self.refuse, self.calls = set(refuse), []
        self.loaded: dict[str, set[str]] = {}
        self.versions: dict[str, str] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        body = json.loads(request.content) if request.content else {}
        self.calls.append((host, path, body))
        held = self.loaded.setdefault(host, set())
        if path == "/load_lora_adapter":
            if host in self.refuse:
                return httpx.Response(400, json={"success": False, "error_message": "LoRA rank 16 > max_lora_rank"})
            if body["lora_name"] in held:  # as SGLang: a name is loaded once
                return httpx.Response(400, json={"success": False, "error_message": "already loaded"})
            held.add(body["lora_name"])
            loaded = {name: {"lora_name": name} for name in held}
            return httpx.Response(200, json={"success": True, "loaded_adapters": loaded})
        if path == "/unload_lora_adapter":
            if body["lora_name"] not in held:
                return httpx.Response(400, json={"success": False, "error_message": "not loaded"})
            held.discard(body["lora_name"])
            return httpx.Response(200, json={"success": True})
        if path == "/update_weight_version":
            self.versions[host] = body["new_version"]
            return httpx.Response(200, json={"success": True})
        if path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": self.versions.get(host, "0")})
        return httpx.Response(200, json={})


def test_server_args_enable_runtime_lora_with_two_adapters_held():
    args = lora_server_args(4)
    assert args[:3] == ["--enable-lora", "--max-lora-rank", "4"] and "--max-loras-per-batch" in args
    with pytest.raises(ValueError, match="train.lora.rank is 0"):
        lora_server_args(0)


def test_each_version_loads_under_its_own_name_the_previous_stays_and_older_ones_are_unloaded(tmp_path):
    servers = FakeServers()
    sink = SGLangAdapterSink(["http://w1", "http://w2"], root=tmp_path, transport=httpx.MockTransport(servers))
    for version in (1, 2, 3):
        assert sink.push(_adapters(SMALL, 2, seed=version).items()) == version
    sink.close()  # waits for the background unloads
    assert servers.loaded == {
        "w1": {"miles-adapter-v2", "miles-adapter-v3"},
        "w2": {"miles-adapter-v2", "miles-adapter-v3"},
    }
    loads = [body for host, path, body in servers.calls if path == "/load_lora_adapter" and host == "w1"]
    assert loads == [{"lora_name": adapter_name(v), "lora_path": str(tmp_path / f"v{v:06d}")} for v in (1, 2, 3)]
    assert servers.versions == {"w1": "3", "w2": "3"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003"]


def test_a_restarted_trainer_loads_its_version_again_and_what_an_earlier_run_left_is_unloaded(tmp_path):
    servers = FakeServers()
    first = SGLangAdapterSink(["http://w1"], root=tmp_path, transport=httpx.MockTransport(servers))
    for version in (1, 2):
        first.push(_adapters(SMALL, 2, seed=version).items())
    first.close()
    servers.loaded["w1"].add("miles-adapter-v7")  # left by an earlier run against the same server
    again = SGLangAdapterSink(["http://w1"], root=tmp_path, transport=httpx.MockTransport(servers))
    assert again.push(_adapters(SMALL, 2, seed=2).items(), version=2) == 2  # from its checkpoint: v2 again
    again.close()
    assert servers.loaded["w1"] == {"miles-adapter-v1", "miles-adapter-v2"} and servers.versions["w1"] == "2"
    # a closed sink pushes again, opening its connections anew (Ray's resync closes rank 0's sink between pushes)
    assert again.push(_adapters(SMALL, 2, seed=3).items()) == 3


def test_a_refused_adapter_fails_the_push_naming_the_server_and_is_unloaded_where_it_loaded(tmp_path):
    servers = FakeServers(refuse={"w2"})
    sink = SGLangAdapterSink(["http://w1", "http://w2"], root=tmp_path, transport=httpx.MockTransport(servers))
    with pytest.raises(WeightUpdateError, match=r"v1 \(LoRA adapter\) failed: http://w2/load_lora_adapter"):
        sink.push(_adapters(SMALL, 2, seed=1).items())
    assert sink.version == 0 and servers.versions == {} and servers.loaded["w1"] == set()
    servers.refuse.clear()
    assert sink.push(_adapters(SMALL, 2, seed=1).items()) == 1  # the same version loads on a retry
    narrow = {n: (t[:, :-1] if ".lora_A." in n else t) for n, t in _adapters(SMALL, 2, seed=2).items()}
    with pytest.raises(WeightUpdateError, match=r"v2 differs from the adapters the servers hold"):
        sink.push(narrow.items())


def test_the_client_names_the_adapter_of_the_version_the_servers_reported_on_the_last_resume():
    servers = FakeServers()
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/generate":
            return servers(request)
        sent.append(json.loads(request.content).get("lora_path"))
        meta = {"id": "r", "finish_reason": {"type": "length"}, "weight_version": servers.versions.get("w1", "0"),
                "output_token_logprobs": [[-0.5, 4, None]]}  # fmt: skip
        return httpx.Response(200, json={"text": "", "output_ids": [4], "meta_info": meta})

    engine = SGLangEngine(["http://w1"], transport=httpx.MockTransport(handler), adapter=True)
    request = GenerateRequest([1, 2], SamplingConfig(max_new_tokens=1))
    asyncio.run(engine.generate(request))
    servers.versions["w1"] = "4"  # a push landed ...
    asyncio.run(engine.generate(request))  # ... requests sent before the resume name the adapter before
    asyncio.run(engine.resume())
    asyncio.run(engine.generate(request))
    assert sent == [None, None, "miles-adapter-v4"] and engine.adapter_version == 4


# -- a real miles serve ---------------------------------------------------------------------------
PROMPTS = [[1, 5, 6, 7], [1, 9, 3]]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8)


def _generate(engine, seed: int):
    async def run():
        return await asyncio.gather(
            *(engine.generate(GenerateRequest(p, SAMPLING, seed=seed + i)) for i, p in enumerate(PROMPTS))
        )

    return asyncio.run(run())


def _gap(reference, outputs) -> float:
    scores = reference.score(PROMPTS, [o.response_tokens for o in outputs], temperature=1.0)
    return max(
        (scores[b, : len(o.log_probs)] - torch.tensor(o.log_probs)).abs().max().item() for b, o in enumerate(outputs)
    )


def _push(engine, sink, named, version=None):
    asyncio.run(engine.pause("abort"))
    try:
        return sink.push(named.items(), version=version)
    finally:
        asyncio.run(engine.resume())


def test_miles_serve_applies_loaded_adapters_like_the_embedded_engine_and_refuses_requests_that_name_none(
    tiny_llama_dir, tmp_path
):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    server = start_miles_serve(tiny_llama_dir, tmp_path / "logs")
    try:
        engine = SGLangEngine([server.url], stop_token_ids=[2], adapter=True, max_retries=0)
        sink = SGLangAdapterSink([server.url], root=tmp_path / "adapters")
        reference = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
        assert _gap(reference, _generate(engine, 1)) < 1e-5  # version 0: the base, no lora_path sent

        for version in (1, 2, 3):
            named = _adapters(config, rank=4, seed=version)
            assert _push(engine, sink, named) == version
            reference.load_weights(named.items())
            outputs = _generate(engine, 10 * version)
            assert all(o.weight_versions == [version] for o in outputs)
            assert _gap(reference, outputs) < 1e-5  # the same engine code: the same adapters applied
        sink.close()
        base = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
        assert _gap(base, outputs) > 1e-2  # the adapters matter
        info = httpx.post(server.url + "/unload_lora_adapter", json={"lora_name": "nope"}, timeout=30).json()
        assert info["success"] is False and set(info["loaded_adapters"]) == {"miles-adapter-v2", "miles-adapter-v3"}

        body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
        answer = httpx.post(server.url + "/generate", json=body, timeout=30)
        assert answer.status_code == 400 and "name it in lora_path" in answer.json()["message"]
        answer = httpx.post(server.url + "/generate", json={**body, "lora_path": "miles-adapter-v1"}, timeout=30)
        assert answer.status_code == 400 and "'miles-adapter-v1' is not loaded" in answer.json()["message"]

        bad = _adapters(config, rank=8, seed=9)  # another rank: refused whole (a new sink lets it through)
        with pytest.raises(WeightUpdateError, match=r"v4 \(LoRA adapter\) failed: .*another train.lora.rank"):
            _push(engine, SGLangAdapterSink([server.url], root=tmp_path / "other"), bad, version=4)
        assert engine.weight_version == 3 and _gap(reference, _generate(engine, 50)) < 1e-5  # still v3's adapter

        def unload(name):
            answer = httpx.post(server.url + "/unload_lora_adapter", json={"lora_name": name}, timeout=30).json()
            assert answer["success"], answer

        unload("miles-adapter-v3")  # a rolled-back version: the newest that remains applies again
        with pytest.raises(RequestFailed, match="'miles-adapter-v3' is not loaded"):
            _generate(engine, 60)
        engine.adapter_version = 2
        reference.load_weights(_adapters(config, rank=4, seed=2).items())
        assert _gap(reference, _generate(engine, 70)) < 1e-5
        unload("miles-adapter-v2")  # none left: the base model
        engine.adapter_version = 0  # what a client of the base model sends: no lora_path
        assert _gap(base, _generate(engine, 80)) < 1e-5
    finally:
        server.stop()
