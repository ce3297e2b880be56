"""``SGLangTensorWeightSink``: SGLang's colocated ``/update_weights_from_tensor`` over mocked servers
(``httpx.MockTransport``). The request bodies are checked with a stand-in serializer, so they run on a CPU; the real
CUDA IPC payload needs a GPU (``gpu`` test, skipped without one)."""

import base64
import io
import json
import pickle

import httpx
import pytest
import torch
import torch.multiprocessing as mp
from miles.rollout.engines import sglang
from miles.rollout.engines.sglang import SGLangEngine, SGLangTensorWeightSink
from miles.sync import WeightUpdateError


class FakeServers:
    """``httpx.MockTransport`` handler: records (host, path, body) in order; ``tp_sizes`` per host answer
    ``/get_server_info``; hosts in ``refuse`` answer SGLang's failure (400, ``success`` false) to a bucket."""

    def __init__(self, tp_sizes=None, refuse=()):
        self.calls, self.tp_sizes, self.refuse = [], tp_sizes or {}, set(refuse)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        self.calls.append((host, path, json.loads(request.content) if request.content else None))
        if path == "/get_server_info":
            return httpx.Response(200, json={"tp_size": self.tp_sizes.get(host, 1), "device": "cuda"})
        if path == "/update_weights_from_tensor" and host in self.refuse:
            message = "Failed to update weights: size mismatch for model.embed_tokens.weight"
            return httpx.Response(400, json={"success": False, "message": message})
        return httpx.Response(200, json={"success": True, "message": "Success"})

    def posts(self, path):
        return [(host, body) for host, p, body in self.calls if p == path]


def _sink(servers, **kwargs):
    engine = SGLangEngine(["http://w1", "http://w2"], transport=httpx.MockTransport(servers))
    return SGLangTensorWeightSink(engine, **kwargs)


@pytest.fixture
def readable_payload(monkeypatch):
    """Replace the CUDA IPC serializer with one whose output names each bucket's tensors (name:shape:dtype)."""

    def serialize(named_tensors):
        return ",".join(f"{name}:{list(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for name, t in named_tensors)

    monkeypatch.setattr(sglang, "_serialize_for_ipc", serialize)


def test_each_bucket_goes_to_every_server_once_per_tp_rank_and_the_version_is_set_last(readable_payload):
    servers = FakeServers(tp_sizes={"w1": 2})
    sink = _sink(servers, bucket_bytes=32)  # 32 bytes: two 4-element fp32 tensors per bucket
    named = [("a", torch.zeros(4)), ("b", torch.ones(2, 2)), ("c", torch.zeros(4, dtype=torch.bfloat16)),
             ("d", torch.zeros(8))]  # fmt: skip
    assert sink.push(named) == 1 and sink.version == 1
    # bytes: a 16, b 16 -> bucket 1 (32); c 8 -> bucket 2; d 32 would make 40 > 32 -> bucket 3 alone
    buckets = ["a:[4]:float32,b:[2, 2]:float32", "c:[4]:bfloat16", "d:[8]:float32"]
    loads = servers.posts("/update_weights_from_tensor")
    for host, tp_size in (("w1", 2), ("w2", 1)):
        bodies = [body for h, body in loads if h == host]
        assert bodies == [
            {"serialized_named_tensors": [bucket] * tp_size, "load_format": None, "flush_cache": False,
             "abort_all_requests": False}
            for bucket in buckets
        ]  # fmt: skip
    paths = [path for _, path, _ in servers.calls]
    assert paths.index("/update_weight_version") > max(i for i, p in enumerate(paths) if p.endswith("_tensor"))
    assert sorted(servers.posts("/update_weight_version")) == [
        ("w1", {"new_version": "1", "abort_all_requests": False}),
        ("w2", {"new_version": "1", "abort_all_requests": False}),
    ]
    assert paths.count("/get_server_info") == 2
    assert sink.push([("a", torch.zeros(4))], version=5) == 5
    assert sum(p == "/get_server_info" for _, p, _ in servers.calls) == 2  # asked once, on the first push
    with pytest.raises(ValueError, match="push version 5 is not newer than this sink's v5"):
        sink.push([("a", torch.zeros(4))], version=5)
    with pytest.raises(ValueError, match="push got no tensors"):
        sink.push([])


def test_cpu_tensors_are_refused_in_one_line_naming_the_colocated_requirement_and_the_group_path():
    servers = FakeServers()
    sink = _sink(servers)
    with pytest.raises(ValueError) as err:
        sink.push([("model.embed_tokens.weight", torch.zeros(4, 2))])
    message = str(err.value)
    assert "\n" not in message and "needs CUDA tensors, but 'model.embed_tokens.weight' is on cpu" in message
    assert "share the GPUs (colocated)" in message and "--engine.weight-transfer group" in message
    if not torch.cuda.is_available():
        assert "this machine has no CUDA" in message
    assert servers.calls == [] and sink.version == 0  # refused before any request


def test_a_server_that_fails_to_load_a_bucket_raises_naming_it_and_no_version_is_set(readable_payload):
    servers = FakeServers(refuse={"w2"})
    sink = _sink(servers)
    with pytest.raises(WeightUpdateError) as err:
        sink.push([("model.embed_tokens.weight", torch.zeros(4, 2))])
    assert str(err.value) == (
        "weight update v1 failed: http://w2/update_weights_from_tensor: Failed to update weights: size mismatch for "
        "model.embed_tokens.weight"
    )
    assert servers.posts("/update_weight_version") == [] and sink.version == 0


def test_bad_settings_are_refused():
    engine = SGLangEngine(["http://w1"], transport=httpx.MockTransport(FakeServers()))
    with pytest.raises(ValueError, match="bucket_bytes is 0; it must be > 0"):
        SGLangTensorWeightSink(engine, bucket_bytes=0)
    with pytest.raises(ValueError, match="timeout_s is -1; it must be > 0"):
        SGLangTensorWeightSink(engine, timeout_s=-1)


# -- the real payload (GPU) ----------------------------------------------------------------------------------------
def _load_as_sglang(payload: str, results) -> None:
    """In another process, as SGLang's server does: base64-decode, unpickle (device UUID -> this process's index,
    as ``patch_torch._device_from_maybe_uuid``), copy to the host."""
    from torch.multiprocessing import reductions

    def rebuild(*args):
        uuids = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
        return reductions.rebuild_cuda_tensor(*args[:6], uuids[args[6]], *args[7:])

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            return rebuild if name == "rebuild_cuda_tensor" else super().find_class(module, name)

    named = Unpickler(io.BytesIO(base64.b64decode(payload))).load()
    results.put([(name, tensor.cpu()) for name, tensor in named])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_payload_maps_the_trainers_cuda_tensors_in_another_process_bit_for_bit():
    named = [("w", torch.randn(64, 64, device="cuda")), ("b", torch.randn(64, device="cuda").bfloat16())]
    payload = sglang._serialize_for_ipc(named)
    assert str(torch.cuda.get_device_properties(0).uuid).encode() in base64.b64decode(payload)  # not the index
    context = mp.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_load_as_sglang, args=(payload, results))
    process.start()
    try:
        received = results.get(timeout=120)
    finally:
        process.join(timeout=60)
    assert [name for name, _ in received] == ["w", "b"]
    for (_, sent), (_, got) in zip(named, received):
        assert got.dtype == sent.dtype and torch.equal(got, sent.cpu())
