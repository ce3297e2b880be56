"""launch_engine's sink factories: picklable descriptions of the servers that build their weight sink in another
process (rank 0 of a Ray trainer), and the vLLM engine that then reads its version from the servers."""

import asyncio
import copy
import pickle

import pytest
from miles.rollout.config import EmbeddedEngineConfig, SGLangEngineConfig, VLLMEngineConfig
from miles.rollout.engines.launch import SGLangSinkFactory, VLLMSinkFactory, address_towards, launch_engine
from miles.rollout.engines.sglang import SGLangWeightSink
from miles.rollout.engines.vllm import VLLMEngine, VLLMWeightSink

URLS = ("http://127.0.0.1:30001", "http://127.0.0.1:30002")


def test_the_sglang_sink_factory_pickles_and_builds_a_sink_for_every_server():
    factory = SGLangSinkFactory(URLS, timeout_s=12.0)
    assert pickle.dumps(factory)  # it travels to rank 0's actor (deepcopy below uses the same reduce protocol)
    factory = copy.deepcopy(factory)
    sink = factory()
    assert isinstance(sink, SGLangWeightSink)
    assert (sink.urls, sink.timeout_s, sink.master_address, sink.version) == (list(URLS), 12.0, "127.0.0.1", 0)
    assert sink.group is None  # the weight group is joined on the first push, in the process that pushes


def test_the_sglang_sink_factory_of_one_restarted_server_keeps_the_settings():
    factory = SGLangSinkFactory(URLS, timeout_s=30.0)
    assert pickle.dumps(factory.only(URLS[1]))
    one = copy.deepcopy(factory.only(URLS[1]))
    assert one == SGLangSinkFactory((URLS[1],), timeout_s=30.0) and one().urls == [URLS[1]]
    with pytest.raises(ValueError, match="http://127.0.0.1:9 is not one of the servers"):
        factory.only("http://127.0.0.1:9")


def test_the_vllm_sink_factory_pickles_and_builds_a_sink_with_the_servers_settings():
    factory = VLLMSinkFactory(URLS, model="/m", dtype="bf16", verify=False, timeout_s=9.0)
    assert pickle.dumps(factory)
    factory = copy.deepcopy(factory)
    sink = factory()
    assert isinstance(sink, VLLMWeightSink)
    assert (sink.engine.urls, sink.engine.model, sink.verify, sink.timeout_s) == (list(URLS), "/m", False, 9.0)
    assert str(sink.dtype) == "torch.bfloat16" and sink.sender is None


def test_a_server_is_reached_from_the_address_on_its_route():
    assert address_towards("http://127.0.0.1:30000") == "127.0.0.1"
    assert address_towards("http://localhost:8000/") == "127.0.0.1"


def test_launch_gives_server_engines_a_sink_factory_and_the_embedded_engine_none(tiny_llama_dir, tmp_path):
    sglang = launch_engine(SGLangEngineConfig(urls=list(URLS)), tiny_llama_dir, log_dir=tmp_path)  # running servers
    assert sglang.sink_factory == SGLangSinkFactory(URLS) and isinstance(sglang.weight_sink, SGLangWeightSink)
    vllm = launch_engine(VLLMEngineConfig(urls=list(URLS)), tiny_llama_dir, log_dir=tmp_path, remote_sink=True)
    assert vllm.sink_factory == VLLMSinkFactory(URLS, model=str(tiny_llama_dir), timeout_s=600.0)
    assert vllm.engine.version_from_servers
    local = launch_engine(VLLMEngineConfig(urls=list(URLS)), tiny_llama_dir, log_dir=tmp_path)
    assert not local.engine.version_from_servers  # its own sink sets the version
    embedded = launch_engine(EmbeddedEngineConfig(), tiny_llama_dir, log_dir=tmp_path)
    assert embedded.sink_factory is None


def test_a_vllm_engine_fed_by_another_process_takes_the_servers_lowest_version_on_resume(monkeypatch):
    engine = VLLMEngine(list(URLS), model="m", version_from_servers=True)
    posted = []
    monkeypatch.setattr(engine, "server_versions", lambda: ["3", "2"])

    async def post_all(path, **kwargs):
        posted.append(path)

    monkeypatch.setattr(engine, "_apost_all", post_all)
    asyncio.run(engine.resume())
    assert engine.weight_version == 2 and posted == ["/resume"]


def test_disk_weight_transfer_gives_disk_sinks_and_a_default_directory_that_close_removes(tiny_llama_dir, tmp_path):
    from miles.rollout.engines.sglang import SGLangDiskWeightSink
    from miles.rollout.engines.vllm_disk import VLLMDiskWeightSink

    default = tmp_path / ".run.weights"
    sglang = launch_engine(
        SGLangEngineConfig(urls=list(URLS), weight_transfer="disk"),
        tiny_llama_dir,
        log_dir=tmp_path,
        weight_dir=default,
    )
    assert isinstance(sglang.weight_sink, SGLangDiskWeightSink) and sglang.weight_sink.writer.root == default
    factory = copy.deepcopy(sglang.sink_factory)  # rank 0's actor builds the same sink
    assert factory == SGLangSinkFactory(URLS, disk_root=str(default), config_from=str(tiny_llama_dir))
    assert isinstance(factory(), SGLangDiskWeightSink) and factory.only(URLS[0]).disk_root == str(default)
    assert default.is_dir()
    sglang.close()
    assert not default.exists()  # the run's own directory goes with the run

    shared = tmp_path / "shared"
    vllm = launch_engine(
        VLLMEngineConfig(urls=list(URLS), weight_transfer="disk", weight_dir=str(shared)),
        tiny_llama_dir,
        log_dir=tmp_path,
        weight_dir=default,
        remote_sink=True,
    )
    assert isinstance(vllm.weight_sink, VLLMDiskWeightSink) and vllm.weight_sink.writer.root == shared
    assert isinstance(copy.deepcopy(vllm.sink_factory)(), VLLMDiskWeightSink)
    vllm.close()
    assert shared.is_dir()  # a directory the user named stays


def test_delta_updates_through_disk_are_refused_in_one_line():
    with pytest.raises(ValueError, match="engine.delta_weights is true but engine.weight_transfer is disk"):
        VLLMEngineConfig(weight_transfer="disk", delta_weights=True)


def test_lora_adapter_sync_gives_server_engines_adapter_sinks_here_and_in_another_process(tiny_llama_dir, tmp_path):
    from miles.rollout.engines.sglang_lora import SGLangAdapterSink
    from miles.rollout.engines.vllm_lora import ADAPTER_NAME, VLLMAdapterSink

    weights = tmp_path / ".run.weights"
    cfg = VLLMEngineConfig(urls=list(URLS))
    launched = launch_engine(cfg, tiny_llama_dir, log_dir=tmp_path, remote_sink=True, weight_dir=weights, lora_rank=4)
    assert launched.engine.adapter == ADAPTER_NAME and launched.engine.served_model == str(tiny_llama_dir)
    assert isinstance(launched.weight_sink, VLLMAdapterSink) and launched.weight_sink.root == weights.resolve()
    factory = copy.deepcopy(launched.sink_factory)  # rank 0 of a Ray trainer builds the same sink
    assert factory.lora_rank == 4 and factory.disk_root == str(weights.resolve())
    remote = factory()
    assert isinstance(remote, VLLMAdapterSink) and remote.engine.adapter == ADAPTER_NAME
    assert remote.root == weights.resolve()
    weights.mkdir()
    launched.close()
    assert not weights.exists()  # the adapter versions go with the run
    sglang = launch_engine(SGLangEngineConfig(urls=list(URLS)), tiny_llama_dir, log_dir=tmp_path, lora_rank=4)
    assert isinstance(sglang.weight_sink, SGLangAdapterSink) and sglang.engine.adapter
    assert isinstance(copy.deepcopy(sglang.sink_factory)(), SGLangAdapterSink)
    assert sglang.weight_sink.root == (tmp_path / "weights").resolve()  # beside the logs without a weight_dir
    sglang.close()
