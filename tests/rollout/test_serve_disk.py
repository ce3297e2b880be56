"""Weight updates through disk: ``SGLangDiskWeightSink`` writes a ``miles.sync.disk`` version and POSTs SGLang's
``/update_weights_from_disk``; a real ``miles serve`` loads it (or a plain HF directory) after checking every
shard, and a corrupt version is refused with the file named, leaving the old weights and version."""

import json

import httpx
import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.engines.sglang import SGLangDiskWeightSink, SGLangEngine
from miles.sync import DiskWeightWriter, WeightUpdateError
from servers import start_miles_serve

PROMPT = [1, 5, 6]


# -- the sink over mocked servers -----------------------------------------------------------------
class FakeServers:
    """``httpx.MockTransport`` handler: records (url, body); ``refuse`` answers SGLang's failure, ``stale`` keeps
    reporting version 0 after a successful load."""

    def __init__(self, refuse=(), stale=()):
        self.calls, self.refuse, self.stale, self.versions = [], set(refuse), set(stale), {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, body = request.url.host, json.loads(request.content) if request.content else {}
        self.calls.append((host, request.url.path, body))
        if request.url.path == "/update_weights_from_disk":
            if host in self.refuse:
                return httpx.Response(400, json={"success": False, "message": "Failed to update weights: no space"})
            if host not in self.stale:
                self.versions[host] = body["weight_version"]
            return httpx.Response(200, json={"success": True, "message": "Succeeded to update model weights."})
        return httpx.Response(200, json={"weight_version": self.versions.get(host, "0")})


def _sink(servers, tmp_path, **kwargs):
    engine = SGLangEngine(["http://w1", "http://w2"], transport=httpx.MockTransport(servers))
    return SGLangDiskWeightSink(engine, root=tmp_path / "weights", **kwargs)


def test_the_sink_writes_the_version_then_asks_every_server_to_load_it_with_its_version(tmp_path):
    servers = FakeServers()
    sink = _sink(servers, tmp_path, server_root="/mnt/shared/weights")
    assert sink.push([("w", torch.ones(2))]) == 1 and sink.version == 1
    assert (tmp_path / "weights" / "v000001" / "manifest.json").is_file()
    loads = [(host, body) for host, path, body in servers.calls if path == "/update_weights_from_disk"]
    body = {"model_path": "/mnt/shared/weights/v000001", "load_format": "safetensors", "abort_all_requests": False,
            "weight_version": "1"}  # fmt: skip
    assert sorted(loads, key=lambda call: call[0]) == [("w1", body), ("w2", body)]
    with pytest.raises(ValueError, match="push version 1 is not newer than this sink's v1"):
        sink.push([("w", torch.ones(2))], version=1)
    sink.close()  # Ray's resync closes rank 0's sink between pushes: the next push opens its connections again
    assert sink.push([("w", torch.ones(2))]) == 2


@pytest.mark.parametrize(
    "servers, message",
    [
        pytest.param(
            FakeServers(refuse={"w2"}),
            "http://w2/update_weights_from_disk: Failed to update weights: no space",
            id="a_server_refuses",
        ),
        pytest.param(
            FakeServers(stale={"w1"}),
            "http://w1/get_weight_version is '0' after loading v000001",
            id="a_server_reports_another_version",
        ),
    ],
)
def test_a_failed_disk_push_raises_naming_the_server_and_keeps_the_sinks_version(tmp_path, servers, message):
    sink = _sink(servers, tmp_path)
    with pytest.raises(WeightUpdateError) as err:
        sink.push([("w", torch.ones(2))])
    assert str(err.value).startswith("weight update v1 from disk failed: ") and message in str(err.value)
    assert sink.version == 0


# -- a real miles serve ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_smollm2_dir, tmp_path_factory):
    server = start_miles_serve(tiny_smollm2_dir, tmp_path_factory.mktemp("serve_disk"))
    yield server
    server.stop()


def _perturbed(model_dir, seed):
    """The model of ``model_dir`` with every parameter moved by N(0, 0.05^2) (tied embeddings stay tied)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def _greedy(server) -> tuple[list[int], list[float]]:
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4}, "return_logprob": True}
    meta = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    return [entry[1] for entry in meta["output_token_logprobs"]], [entry[0] for entry in meta["output_token_logprobs"]]


def _expected(reference, state) -> tuple[list[int], list[float]]:
    """Greedy tokens and log-probs of an in-process engine holding ``state``."""
    reference.load_weights(state.items())
    output = reference.generate_batch([GenerateRequest(PROMPT, SamplingConfig(top_k=1, max_new_tokens=4))])[0]
    return output.response_tokens, output.log_probs


def _version(server) -> str:
    return httpx.get(server.url + "/get_weight_version", timeout=10).json()["weight_version"]


def _first_shard(path) -> str:
    """The first shard file a version's manifest names."""
    return json.loads((path / "manifest.json").read_text())["shards"][0]["file"]


def _update(server, body):
    return httpx.post(server.url + "/update_weights_from_disk", json=body, timeout=120)


@pytest.mark.integration
def test_miles_serve_loads_a_disk_version_or_hf_directory_and_refuses_a_corrupt_one(server, tiny_smollm2_dir, tmp_path):
    reference = EmbeddedEngine(tiny_smollm2_dir, dtype="fp32")
    original = _greedy(server)
    # 1. The sink: a Miles version directory (embeddings 6 MiB: 3 shards), checksums verified by the server.
    state = _perturbed(tiny_smollm2_dir, seed=1).state_dict()
    sink = SGLangDiskWeightSink(SGLangEngine([server.url]), root=tmp_path / "weights", config_from=tiny_smollm2_dir,
                                shard_bytes=2 * 2**20)  # fmt: skip
    assert sink.push(state.items(), version=1) == 1 and _version(server) == "1"
    tokens, log_probs = _greedy(server)
    expected_tokens, expected_log_probs = _expected(reference, state)
    assert tokens == expected_tokens and log_probs == pytest.approx(expected_log_probs, abs=1e-5)
    assert log_probs != pytest.approx(original[1], abs=1e-3)  # the weights did change
    # 2. A plain HF checkpoint directory (no manifest), as SGLang loads one.
    hf_dir = tmp_path / "hf"
    model = _perturbed(tiny_smollm2_dir, seed=2)
    model.save_pretrained(hf_dir)
    answer = _update(server, {"model_path": str(hf_dir), "weight_version": "2"})
    assert answer.status_code == 200 and answer.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 2.",
        "num_paused_requests": 0,
    }
    assert _version(server) == "2"
    loaded = _greedy(server)
    expected = _expected(reference, model.state_dict())
    assert loaded[0] == expected[0] and loaded[1] == pytest.approx(expected[1], abs=1e-5)
    # 3. Corrupt versions: refused with the reason; the server keeps version 2 and its weights.
    writer = DiskWeightWriter(tmp_path / "weights", shard_bytes=2 * 2**20, config_from=tiny_smollm2_dir)
    path = writer.write(_perturbed(tiny_smollm2_dir, seed=3).state_dict().items(), version=3)
    shard = path / _first_shard(path)
    with open(shard, "r+b") as file:
        file.seek(shard.stat().st_size - 1)
        last = file.read(1)
        file.seek(shard.stat().st_size - 1)
        file.write(bytes([last[0] ^ 0x01]))
    answer = _update(server, {"model_path": str(path), "weight_version": "3"})
    assert answer.status_code == 400 and answer.json()["success"] is False
    message = answer.json()["message"]
    assert f"shard {shard} fails its checksum" in message and message.endswith("The weight version stays 2.")
    (path / "manifest.json").write_text("{not json")
    answer = _update(server, {"model_path": str(path), "weight_version": "3"})
    assert answer.json()["success"] is False and "manifest.json cannot be read as JSON" in answer.json()["message"]
    answer = _update(server, {"model_path": str(tmp_path / "weights" / "v000001"), "weight_version": "3"})
    assert "manifest.json holds weight version 1, the request says 3" in answer.json()["message"]
    answer = _update(server, {"weight_version": "3"})
    assert answer.status_code == 400 and "model_path must be a non-empty directory path" in answer.json()["message"]
    assert _version(server) == "2"
    after = _greedy(server)
    assert after[0] == loaded[0] and after[1] == pytest.approx(loaded[1], abs=1e-6)
