"""Weight push vs a memcpy of the same bytes, per transport, in one run (SmolLM2-135M, 513 MiB float32).

Timed, each round in a rotated order (so slow moments of a shared machine hit every variant alike):

- memcpy: ``dst.copy_(src)`` of the model's bytes between two preallocated, already-touched flat buffers; the
  baseline every push is divided by;
- in-process push: ``WeightSender(InProcessTransport(receiver))``, "before" emulating the old transport (a fresh
  ``torch.empty`` bucket per push, sends on the calling thread) and "after" (reused slots, ``overlap_send``);
- shared-memory push to an engine process (``SharedMemoryTransport``; its path did not change: slots were already
  reused, and its ``send`` is not overlapped);
- gloo push to an engine process (``DistributedTransport`` over its own 2-rank weight group on localhost), serial
  ("before") and with packing overlapped with the broadcasts ("after"), with the default 512 MiB buckets (2
  buckets, one of them 1 MiB: nothing to overlap) and with ``--small-bucket-mib`` 64 (9 buckets); its bandwidth is
  the packed bytes over the push time.

Every receiver's ``apply_fn`` only views the tensors: a push is pack + delivery + decode + the commit round trip,
not the engine's copy into its model (one more copy of the bytes, the same for every transport). Each variant is
pushed once before timing, so slots exist. After the rounds, raw gloo broadcasts of one bucket-sized buffer as 1, 2,
4 and 8 concurrent chunks (``async_op=True``) show whether splitting a bucket raises bandwidth.

Weights: ``~/.cache/miles/models/SmolLM2-135M-Instruct/model.safetensors`` (272 tensors) when present, else
synthetic tensors of its shapes (``bench_processes.llama_135m_state``). Default bucket 512 MiB: 2 buckets.

Usage: ``uv run --no-sync python benchmarks/sync/bench_push.py [--rounds 7] [--threads 2]`` (about 1 min).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from miles.sync import (
    InProcessTransport,
    SharedMemoryEndpoint,
    SharedMemoryTransport,
    WeightReceiver,
    WeightSender,
)
from miles.sync.transports.distributed import DistributedEndpoint, DistributedTransport, init_weight_group

sys.path.insert(0, str(Path(__file__).parent))
import bench_processes  # noqa: E402

CHECKPOINT = Path.home() / ".cache" / "miles" / "models" / "SmolLM2-135M-Instruct" / "model.safetensors"
PUSH_RATIO_TARGET = 1.5  # push time / memcpy time, at the median
GLOO_GBPS_TARGET = 2.0  # GB/s (1e9 bytes) of a 2-process gloo push
CHUNK_COUNTS = (1, 2, 4, 8)


def load_weights() -> tuple[dict[str, torch.Tensor], str]:
    """The model's tensors (float32) and where they came from."""
    if CHECKPOINT.exists():
        from safetensors.torch import load_file

        # cloned: a trainer's parameters live in allocator memory, not in the checkpoint's file mapping (reading
        # mapped file pages is ~1.6x slower here, which would inflate every push against the memcpy)
        return {name: t.float().clone() for name, t in load_file(CHECKPOINT).items()}, str(CHECKPOINT)
    return bench_processes.llama_135m_state(), "synthetic tensors of SmolLM2-135M's shapes"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _views_only(named_tensors) -> None:
    pass


def shm_engine(conn, threads: int) -> None:
    """Engine process: serve shared-memory updates, viewing the tensors only."""
    torch.set_num_threads(threads)
    SharedMemoryEndpoint(WeightReceiver(apply_fn=_views_only), conn).serve()


def gloo_engine(port: int, threads: int) -> None:
    """Engine rank 1 of the weight group: serve updates, then take part in the raw chunked broadcasts."""
    torch.set_num_threads(threads)
    group = init_weight_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2, rank=1, group_name="bench_push"
    )
    DistributedEndpoint(WeightReceiver(apply_fn=_views_only), group).serve()
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    nbytes, repeats = box[0]
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats):
        for num_chunks in CHUNK_COUNTS:
            _chunked_broadcast(buffer, num_chunks, group)
    dist.destroy_process_group(group)


def _chunked_broadcast(buffer: torch.Tensor, num_chunks: int, group) -> None:
    """Broadcast ``buffer`` from rank 0 as ``num_chunks`` concurrent collectives; barriers fence the timing."""
    dist.barrier(group=group)
    size = -(-buffer.numel() // num_chunks)
    works = [
        dist.broadcast(buffer[i : i + size], src=0, group=group, async_op=True) for i in range(0, len(buffer), size)
    ]
    for work in works:
        work.wait()
    dist.barrier(group=group)


class FreshBuckets(InProcessTransport):
    """The in-process transport before slot reuse: a new host buffer per bucket and push."""

    overlap_send = False

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args) -> None:
    torch.set_num_threads(args.threads)
    state, source = load_weights()
    items = list(state.items())
    total = sum(t.numel() * t.element_size() for t in state.values())
    context = mp.get_context("spawn")

    flat = torch.cat([t.reshape(-1) for t in state.values()])
    copy_dst = torch.empty_like(flat).copy_(flat)

    before_inproc = WeightSender(FreshBuckets(WeightReceiver(apply_fn=_views_only)), bucket_bytes=args.bucket_bytes)
    after_inproc = WeightSender(
        InProcessTransport(WeightReceiver(apply_fn=_views_only)), bucket_bytes=args.bucket_bytes
    )

    sender_conn, engine_conn = context.Pipe()
    shm_process = context.Process(target=shm_engine, args=(engine_conn, args.threads), daemon=True)
    shm_process.start()
    shm_transport = SharedMemoryTransport(sender_conn, timeout_s=300)
    shm = WeightSender(shm_transport, bucket_bytes=args.bucket_bytes)

    port = free_port()
    gloo_process = context.Process(target=gloo_engine, args=(port, args.threads), daemon=True)
    gloo_process.start()
    group = init_weight_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2, rank=0, group_name="bench_push"
    )
    gloo_transport = DistributedTransport(group)
    gloo = WeightSender(gloo_transport, bucket_bytes=args.bucket_bytes)

    def configured(sender: WeightSender, *, overlap: bool, bucket_bytes: int) -> Callable[[], object]:
        def push():
            sender.overlap_send, sender.bucket_bytes = overlap, bucket_bytes
            return sender.push(items)

        return push

    small = args.small_bucket_mib * 2**20
    variants: dict[str, Callable[[], object]] = {
        "memcpy": lambda: copy_dst.copy_(flat),
        "in-process before": lambda: before_inproc.push(items),
        "in-process after": lambda: after_inproc.push(items),
        "shm": lambda: shm.push(items),
        "gloo before": configured(gloo, overlap=False, bucket_bytes=args.bucket_bytes),
        "gloo after": configured(gloo, overlap=True, bucket_bytes=args.bucket_bytes),
        f"gloo before, {args.small_bucket_mib} MiB buckets": configured(gloo, overlap=False, bucket_bytes=small),
        f"gloo after, {args.small_bucket_mib} MiB buckets": configured(gloo, overlap=True, bucket_bytes=small),
    }
    try:
        for fn in variants.values():  # warm-up: slots allocated and touched
            fn()
        num_buckets = after_inproc.last_push.num_buckets
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(timed(variants[name]))
        gloo_transport.close()
        shm_transport.close()
        chunk_times = raw_chunk_times(group, args.bucket_bytes, args.rounds)
        dist.destroy_process_group(group)
    finally:
        shm_process.join(timeout=60)
        gloo_process.join(timeout=60)
    report(times, chunk_times, total=total, num_tensors=len(items), num_buckets=num_buckets, source=source, args=args)


def raw_chunk_times(group, nbytes: int, repeats: int) -> dict[int, list[float]]:
    dist.broadcast_object_list([(nbytes, repeats)], src=0, group=group)
    buffer = torch.ones(nbytes, dtype=torch.uint8)
    times: dict[int, list[float]] = {n: [] for n in CHUNK_COUNTS}
    for _ in range(repeats):
        for num_chunks in CHUNK_COUNTS:
            times[num_chunks].append(timed(lambda: _chunked_broadcast(buffer, num_chunks, group)))  # noqa: B023
    return times


def report(times, chunk_times, *, total: int, num_tensors: int, num_buckets: int, source: str, args) -> None:
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    memcpy = medians["memcpy"]
    load = os.getloadavg()[0]
    print(f"weights: {source}: {num_tensors} tensors, {total / 2**20:.0f} MiB, {num_buckets} buckets")
    print(f"{args.rounds} rounds, {args.threads} torch threads per process, 1-min load average {load:.2f}")
    print()
    print("| variant | median s | min s | x memcpy | GB/s | target | met |")
    print("|---|---|---|---|---|---|---|")
    targets = []
    for name, ts in times.items():
        median, ratio, gbps = medians[name], medians[name] / memcpy, total / medians[name] / 1e9
        target, met = "", ""
        if name.startswith("gloo after"):
            target = f">= {GLOO_GBPS_TARGET} GB/s (and <= {PUSH_RATIO_TARGET}x memcpy)"
            met = (
                "met" if gbps >= GLOO_GBPS_TARGET else "not met"
            ) + f" ({'met' if ratio <= PUSH_RATIO_TARGET else 'not met'})"
            if name == "gloo after":  # the default buckets; the 64 MiB variant is a diagnostic
                targets.append({"name": f"{name} GB/s", "value": gbps, "target": f">= {GLOO_GBPS_TARGET}",
                                "met": gbps >= GLOO_GBPS_TARGET})  # fmt: skip
        elif name in ("in-process after", "shm"):
            target = f"<= {PUSH_RATIO_TARGET}x memcpy"
            met = "met" if ratio <= PUSH_RATIO_TARGET else "not met"
        if name in ("in-process after", "shm", "gloo after"):
            targets.append({"name": f"{name} push vs memcpy", "value": ratio, "target": f"<= {PUSH_RATIO_TARGET}",
                            "met": ratio <= PUSH_RATIO_TARGET})  # fmt: skip
        print(f"| {name} | {median:.4f} | {min(ts):.4f} | {ratio:.2f} | {gbps:.2f} | {target} | {met} |")
    if args.json:
        summary = {"bytes": total, "medians_s": medians, "times_s": times, "targets": targets, "load": load}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print()
    print(f"raw gloo broadcast of one {args.bucket_bytes / 2**20:.0f} MiB buffer as concurrent chunks:")
    print("| chunks | median s | GB/s | x 1 chunk |")
    print("|---|---|---|---|")
    one = statistics.median(chunk_times[1])
    for num_chunks, ts in chunk_times.items():
        median = statistics.median(ts)
        print(f"| {num_chunks} | {median:.4f} | {args.bucket_bytes / median / 1e9:.2f} | {median / one:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed runs per variant (>= 3); medians are reported")
    parser.add_argument("--threads", type=int, default=bench_processes.NUM_THREADS, help="torch threads per process")
    parser.add_argument("--bucket-mib", type=int, default=512, help="WeightSender bucket_bytes in MiB")
    parser.add_argument("--small-bucket-mib", type=int, default=64, help="the gloo runs with several buckets")
    parser.add_argument("--json", type=Path, default=None, help="also write the medians and targets here")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error(f"--rounds is {args.rounds}; the median needs at least 3")
    args.bucket_bytes = args.bucket_mib * 2**20
    run(args)


if __name__ == "__main__":
    main()
