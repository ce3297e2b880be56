"""miles-sync benchmarks. Run: uv run pytest benchmarks/sync --benchmark-enable -p no:cacheprovider

Not collected by the default run (``testpaths = ["tests"]``). Ratios go to packages/miles-sync/README.md.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from miles.sync import WeightSender
from miles.sync.codecs import CODECS
from miles.sync.transports.shared_memory import SharedMemoryTransport

sys.path.insert(0, str(Path(__file__).parent))
import bench_processes  # noqa: E402

torch.set_num_threads(bench_processes.NUM_THREADS)
STATE = bench_processes.llama_135m_state()
STATE_BYTES = sum(t.numel() * t.element_size() for t in STATE.values())


def test_memcpy_of_the_135m_model_bytes(benchmark):
    """Baseline: one copy of the same bytes between two preallocated, already-touched flat buffers."""
    source = torch.cat([t.reshape(-1) for t in STATE.values()])
    destination = torch.empty_like(source)
    destination.copy_(source)
    benchmark.extra_info["bytes"] = STATE_BYTES
    benchmark.pedantic(destination.copy_, args=(source,), rounds=10, warmup_rounds=1)


@pytest.mark.parametrize("copy_into_model", [False, True], ids=["receiver_views", "receiver_copies_into_model"])
def test_shared_memory_update_of_the_135m_model(benchmark, copy_into_model):
    context = mp.get_context("spawn")
    sender_conn, engine_conn = context.Pipe()
    engine = context.Process(target=bench_processes.shared_memory_engine, args=(engine_conn, copy_into_model))
    engine.start()
    transport = SharedMemoryTransport(sender_conn, timeout_s=120)
    sender = WeightSender(transport, bucket_bytes=512 * 2**20)
    try:
        benchmark.extra_info["bytes"] = STATE_BYTES
        benchmark.pedantic(sender.push, args=(STATE.items(),), rounds=10, warmup_rounds=1)
    finally:
        transport.close()
        engine.join(timeout=60)


def test_gloo_broadcast_between_two_processes(benchmark, tmp_path):
    payload_mib = 256
    context = mp.get_context("spawn")
    commands, done = context.Queue(), context.Queue()
    ranks = [
        context.Process(
            target=bench_processes.gloo_rank, args=(rank, str(tmp_path / "init"), commands, done, payload_mib)
        )
        for rank in range(2)
    ]
    for process in ranks:
        process.start()

    def push() -> None:
        commands.put("push")
        done.get(timeout=120)

    try:
        benchmark.extra_info["bytes"] = payload_mib * 2**20
        benchmark.pedantic(push, rounds=5, warmup_rounds=1)
    finally:
        commands.put("close")
        for process in ranks:
            process.join(timeout=60)
    if benchmark.stats is not None:  # None under --benchmark-disable (the repo's addopts): ran once, untimed
        benchmark.extra_info["GB_per_s"] = payload_mib * 2**20 / benchmark.stats.stats.mean / 1e9


@pytest.mark.parametrize("codec", ["bf16", "fp8", "mxfp8", "nvfp4", "int4"])
def test_codec_encode_throughput(benchmark, codec):
    weight = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))  # 64 MiB float32
    benchmark.extra_info["bytes"] = weight.numel() * 4
    benchmark.pedantic(CODECS[codec].encode, args=(weight,), rounds=5, warmup_rounds=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["GB_per_s"] = weight.numel() * 4 / benchmark.stats.stats.mean / 1e9
