"""Per-stage costs of a miles.sync weight update on this CPU, in seconds per GiB, as inputs to ``sync_model.py``.

Each stage is timed on its own, on the same sample of weights:

- pack: ``bucket.pack`` of the sample's tensors (identity codec) into preallocated, already-touched buckets;
- encode / decode: each codec (bf16 cast, fp8, mxfp8, nvfp4, int4) on the first ``--codec-mib`` of the sample;
- delta encode / decode: ``DeltaEncoder`` / ``DeltaDecoder`` on a weight change like one RL step, for float32 and
  bfloat16 payloads: the default encoder, and the other kind (forced ``sparse`` or ``xor_zstd``) where it would
  send less than the full bytes; the sub-steps (xxh3 checksum, XOR + count, zstd level 1 compress / decompress);
  and the sent fraction of every kind on every change;
- transfer: ``SharedMemoryTransport`` pushes to an engine process (a tiny update: the fixed cost of one update;
  the sample, engine viewing it: pack into shared memory + control messages; the sample, engine copying it out),
  and a gloo broadcast between two processes on localhost (bandwidth, and the latency of a small control message);
- apply: ``WeightReceiver.receive_bucket`` + ``commit_update`` with an ``apply_fn`` that copies into preallocated
  parameters (identity codec; float32 and bfloat16).

Weights: the first transformer layers of SmolLM2-135M-Instruct (``~/.cache/miles/models``, float32) up to
``--sample-mib``, else synthetic tensors of its shapes (normal, std 0.02). The weight change is synthetic (no
trained checkpoint pair is needed): ``adam1`` is AdamW's first step at the default job's learning rate,
``w - lr * sign(g)`` with lr 3e-5 and a random sign per element; ``rel1e-4`` / ``rel1e-3`` add
``r * rms(tensor) * N(0, 1)`` per element. A checkpoint pair (``--base-dir`` / ``--new-dir``, e.g. two of
``bench_delta.py``'s checkpoints) replaces the synthetic change.

Every timing is the best of at least ``--repeats`` runs after a warm-up (cheap stages run up to 10 times, within
about a second), with ``--threads`` torch threads per process (2: the CI machine's cores); the 1-minute load average
is printed, since other jobs on a shared machine slow the runs. These are CPU numbers of this machine: a GPU
cluster's stages run on other hardware, and ``sync_model.py`` states its assumptions for them.

Usage: ``uv run --no-sync python benchmarks/sync/bench_sync_costs.py [--bucket-mib 64] [--sample-mib 128]
[--out costs.json]`` (about 1-2 min on 2 cores; miles.sync's default bucket is 512 MiB, 64 MiB keeps this machine's
memory use low).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GIB = 2**30
CHECKPOINT = Path.home() / ".cache" / "miles" / "models" / "SmolLM2-135M-Instruct" / "model.safetensors"
CODEC_NAMES = ("bf16", "fp8", "mxfp8", "nvfp4", "int4")
CHANGES = ("adam1", "rel1e-4", "rel1e-3")
STAGES = ("pack", "codecs", "delta", "apply", "transfer")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "sve", "asimd")


def cpu_info(threads: int) -> dict:
    """What this CPU is, detected now: torch's vectorization level, the model name and the relevant ISA flags."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "model": model,
        "logical_cpus": os.cpu_count(),
        "torch_threads": threads,
        "isa_flags": sorted(flag for flag in CPU_FLAGS if flag in flags),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def best_of(fn: Callable[[], object], repeats: int, *, warmup: bool = True, budget_s: float = 1.0) -> float:
    """Minimum wall time of calls of ``fn``: at least ``repeats`` calls, more (up to 10) while they have taken less
    than ``budget_s`` in all, so cheap stages get more tries on a shared machine. One untimed warm-up call first,
    unless ``warmup`` is False (the caller already ran it once)."""
    if warmup:
        fn()
    times: list[float] = []
    while len(times) < repeats or (len(times) < 10 and sum(times) < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---- weights ----


def synthetic_layers(sample_bytes: int) -> dict[str, torch.Tensor]:
    """SmolLM2-135M's layer shapes (hidden 576, MLP 1536, 3 KV heads of 64), normal with std 0.02, float32."""
    hidden, mlp, kv = 576, 1536, 192
    generator = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    layer = 0
    while nbytes(state.values()) < sample_bytes:
        prefix = f"model.layers.{layer}."
        for name, shape in (
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.k_proj.weight", (kv, hidden)),
            ("self_attn.v_proj.weight", (kv, hidden)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.gate_proj.weight", (mlp, hidden)),
            ("mlp.up_proj.weight", (mlp, hidden)),
            ("mlp.down_proj.weight", (hidden, mlp)),
            ("input_layernorm.weight", (hidden,)),
            ("post_attention_layernorm.weight", (hidden,)),
        ):
            state[prefix + name] = torch.randn(*shape, generator=generator) * (1.0 if "norm" in name else 0.02)
        layer += 1
    return state


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state |= load_file(file)
    return {name: tensor.float() for name, tensor in sorted(state.items())}


def layer_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2]), name
    return 10**9, name  # embeddings, final norm: after the layers


def take_sample(state: dict[str, torch.Tensor], sample_bytes: int) -> dict[str, torch.Tensor]:
    """Whole tensors in layer order until ``sample_bytes`` (at least one tensor)."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(state, key=layer_order):
        if out and nbytes(out.values()) >= sample_bytes:
            break
        out[name] = state[name].clone()  # private memory (a loaded file's tensors may map the file)
    return out


def load_weights(args) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, str]:
    """(base weights, the trained next weights or None, a description)."""
    sample_bytes = args.sample_mib * 2**20
    if args.base_dir and args.new_dir:
        base = take_sample(load_safetensors_dir(args.base_dir), sample_bytes)
        new = load_safetensors_dir(args.new_dir)
        return (
            base,
            {name: new[name].clone() for name in base},
            f"checkpoint pair {args.base_dir} -> {args.new_dir}",
        )
    if CHECKPOINT.is_file() and not args.synthetic:
        base = take_sample(load_safetensors_dir(CHECKPOINT), sample_bytes)
        return base, None, f"SmolLM2-135M-Instruct layers from {CHECKPOINT} (float32)"
    return synthetic_layers(sample_bytes), None, "synthetic tensors of SmolLM2-135M's layer shapes (std 0.02)"


def changed(base: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """A synthetic RL-step weight change of ``base`` (see the module docstring)."""
    generator = torch.Generator().manual_seed(1)
    out = {}
    for name, tensor in base.items():
        if kind == "adam1":
            sign = torch.randint(0, 2, tensor.shape, generator=generator).float() * 2 - 1
            out[name] = tensor - 3e-5 * sign
        else:
            relative = float(kind.removeprefix("rel"))
            rms = tensor.pow(2).mean().sqrt()
            out[name] = tensor + relative * rms * torch.randn(tensor.shape, generator=generator)
    return out


# ---- stages ----


def packed_buckets(state: dict[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype, version: int = 1):
    """The state as packed identity-codec buckets of ``dtype`` (a list of ``Bucket``)."""
    from miles.sync.bucket import EncodedTensor, group_into_buckets, pack, packed_nbytes

    entries = (
        EncodedTensor(name, tuple(t.shape), dtype, "identity", (t.to(dtype).contiguous(),)) for name, t in state.items()
    )
    buckets = []
    for index, group in enumerate(group_into_buckets(entries, bucket_bytes=bucket_bytes)):
        out = torch.empty(packed_nbytes(group), dtype=torch.uint8)
        buckets.append(pack(group, out, version=version, index=index))
    return buckets


def measure_pack(state, args, rows: list[dict]) -> None:
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        measure_pack_dtype(state, dtype, label, args, rows)


def measure_pack_dtype(state, dtype: torch.dtype, label: str, args, rows: list[dict]) -> None:
    from miles.sync.bucket import EncodedTensor, group_into_buckets, pack, packed_nbytes

    entries = [EncodedTensor(n, tuple(t.shape), dtype, "identity", (t.to(dtype),)) for n, t in state.items()]
    groups = list(group_into_buckets(entries, bucket_bytes=args.bucket_mib * 2**20))
    outs = [torch.zeros(packed_nbytes(group), dtype=torch.uint8) for group in groups]  # touched

    def run():
        for index, (group, out) in enumerate(zip(groups, outs)):
            pack(group, out, version=1, index=index)

    seconds = best_of(run, args.repeats)
    rows.append(row("pack", label, nbytes(outs), seconds, f"{len(entries)} tensors, {len(groups)} buckets"))


def measure_codecs(state, args, rows: list[dict]) -> None:
    from miles.sync.codecs import get_codec

    tensors = list(take_sample(state, args.codec_mib * 2**20).values())
    for name in CODEC_NAMES:
        measure_codec(get_codec(name), tensors, args, rows)


def measure_codec(codec, tensors: list[torch.Tensor], args, rows: list[dict]) -> None:
    source = nbytes(tensors)
    encoded: list[tuple] = []

    def encode():
        encoded[:] = [codec.encode(t) for t in tensors]

    seconds = best_of(encode, args.repeats)
    wire = sum(nbytes(parts) for parts in encoded)
    rows.append(row("encode", codec.name, source, seconds, f"fp32 in, wire {wire / source:.3f} of fp32"))

    def decode():
        for parts, t in zip(encoded, tensors):
            codec.decode(parts, shape=tuple(t.shape), dtype=t.dtype)

    rows.append(row("decode", codec.name, source, best_of(decode, args.repeats), "to fp32"))


def delta_pair(base_buckets, new_buckets, settings: dict):
    """An encoder and a decoder that hold ``base_buckets`` as version 1, and ``encode(new)`` -> delta buckets."""
    from miles.sync.bucket import Bucket
    from miles.sync.delta import DeltaDecoder, DeltaEncoder

    encoder, decoder = DeltaEncoder(**settings), DeltaDecoder()
    for bucket in base_buckets:  # version 1 in full: the base on both sides
        decoder.decode(Bucket(*encoder.encode(bucket)))
    encoder.commit()
    decoder.commit()
    return encoder, decoder, lambda: [Bucket(*encoder.encode(bucket)) for bucket in new_buckets]


DELTA_KINDS = (
    ("auto", {}),
    ("sparse", {"sparse_fraction": 1.0, "compress_above": 1.0}),
    ("xor_zstd", {"sparse_fraction": 0.0}),
)
"""DeltaEncoder's default choice (the smaller of sparse and xor_zstd), forced sparse (every bucket is sparse, never
compressed) and forced xor_zstd (as ``DeltaEncoder`` settings). A forced kind is
timed only where it differs from the default's choice and sends less than the full bytes."""


def measure_delta(base, new_weights, args, rows: list[dict], fractions: list[dict]) -> None:
    """Times every delta kind on the first change; for the others only the sent fraction."""
    import zstandard
    from miles.sync.delta import checksum

    bucket_bytes = args.bucket_mib * 2**20
    changes = ["checkpoint"] if new_weights is not None else list(CHANGES)
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        base_buckets = packed_buckets(base, bucket_bytes, dtype, version=1)
        full = sum(b.meta.nbytes for b in base_buckets)
        for position, change in enumerate(changes):
            weights = new_weights if new_weights is not None else changed(base, change)
            new_buckets = packed_buckets(weights, bucket_bytes, dtype, version=2)
            auto_kinds = None
            for kind, settings in DELTA_KINDS:
                where = (label, change, kind, settings, auto_kinds)
                fractions.append(measure_delta_kind(base_buckets, new_buckets, where, position == 0, args, rows))
                auto_kinds = auto_kinds or fractions[-1]["kinds"]
            if position == 0:  # the sub-steps of an encode, on the same buckets
                pairs = [(b.payload, n.payload) for b, n in zip(base_buckets, new_buckets)]
                measure_delta_steps(pairs, label, full, args, rows, checksum, zstandard)


def measure_delta_kind(base_buckets, new_buckets, where: tuple, timed: bool, args, rows: list[dict]) -> dict:
    """The sent fraction of one delta kind; with ``timed`` also its encode and decode times (rows).

    ``where``: (wire dtype label, change name, delta kind, the encoder's ``sparse_fraction``, the kinds the default
    encoder chose (None for the default itself)).
    """
    label, change, kind, settings, auto_kinds = where
    _, decoder, encode = delta_pair(base_buckets, new_buckets, settings)
    deltas = encode()
    full = sum(b.meta.nbytes for b in base_buckets)
    sent = sum(d.meta.nbytes for d in deltas)
    kinds = sorted({d.meta.delta.kind for d in deltas})
    entry = {"wire": label, "change": change, "kind": kind, "sent_fraction": sent / full, "kinds": kinds}
    if kind == "sparse":
        entry["changed_word_fraction"] = sum(d.meta.delta.count for d in deltas) / (full / 4)
    if timed and (kind == "auto" or (kinds != auto_kinds and sent < full)):
        detail = f"{change}, sent {sent / full:.3f} of full, {'+'.join(kinds)}"
        rows.append(row("delta_encode", f"{label} {kind}", full, best_of(encode, args.repeats, warmup=False), detail))

        def decode():
            return [decoder.decode(d) for d in deltas]

        rows.append(row("delta_decode", f"{label} {kind}", full, best_of(decode, args.repeats), detail))
    return entry


def measure_delta_steps(pairs, label: str, full: int, args, rows: list[dict], checksum, zstandard) -> None:
    rows.append(row("delta_step", f"{label} xxh3", full, best_of(lambda: [checksum(n) for _, n in pairs], 1)))
    xors: list = []

    def xor_count():
        xors[:] = [torch.bitwise_xor(n.view(torch.int32), b.view(torch.int32)) for b, n in pairs]
        return [int(torch.count_nonzero(x)) for x in xors]

    rows.append(row("delta_step", f"{label} xor+count", full, best_of(xor_count, args.repeats)))
    compressor, decompressor = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    blobs: list = []

    def compress():
        blobs[:] = [compressor.compress(x.view(torch.uint8).numpy()) for x in xors]

    rows.append(row("delta_step", f"{label} zstd-1 compress", full, best_of(compress, 1)))
    sizes = [x.numel() * 4 for x in xors]

    def decompress():
        return [decompressor.decompress(blob, max_output_size=size) for blob, size in zip(blobs, sizes)]

    rows.append(row("delta_step", f"{label} zstd decompress", full, best_of(decompress, 1)))


def measure_apply(state, args, rows: list[dict]) -> None:
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        measure_apply_dtype(state, dtype, label, args, rows)


def measure_apply_dtype(state, dtype: torch.dtype, label: str, args, rows: list[dict]) -> None:
    from miles.sync import WeightReceiver
    from miles.sync.bucket import Bucket

    buckets = packed_buckets(state, args.bucket_mib * 2**20, dtype)
    params = {name: torch.zeros(t.shape, dtype=dtype) for name, t in state.items()}  # touched

    def load(named_tensors):
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    receiver = WeightReceiver(apply_fn=load)
    versions = iter(range(1, 10**6))

    def apply():
        version = next(versions)
        receiver.begin_update(version)
        for bucket in buckets:
            receiver.receive_bucket(Bucket(dataclasses.replace(bucket.meta, version=version), bucket.payload))
        receiver.commit_update(version, len(buckets))

    total = sum(b.meta.nbytes for b in buckets)
    rows.append(row("apply", label, total, best_of(apply, args.repeats), "unpack + copy into params"))


# ---- transfers (child processes) ----


def shm_engine(conn, stats, threads: int) -> None:
    """Serve shared-memory updates. Tensors named ``copy/...`` are copied into a private model, and the seconds that
    copy took go to ``stats``; other tensors are only viewed."""
    from miles.sync import WeightReceiver
    from miles.sync.transports.shared_memory import SharedMemoryEndpoint

    torch.set_num_threads(threads)
    model: dict[str, torch.Tensor] = {}

    def load(named_tensors):
        start = time.perf_counter()
        copied = False
        for name, tensor in named_tensors:
            if name.startswith("copy/"):
                if name not in model:
                    model[name] = torch.zeros_like(tensor)
                model[name].copy_(tensor)
                copied = True
        if copied:
            stats.send(time.perf_counter() - start)

    SharedMemoryEndpoint(WeightReceiver(apply_fn=load), conn).serve()


def measure_shared_memory(state, args, rows: list[dict]) -> None:
    from miles.sync import WeightSender
    from miles.sync.transports.shared_memory import SharedMemoryTransport

    context = mp.get_context("spawn")
    sender_conn, engine_conn = context.Pipe()
    stats_in, stats_out = context.Pipe(duplex=False)
    engine = context.Process(target=shm_engine, args=(engine_conn, stats_out, args.threads))
    engine.start()
    transport = SharedMemoryTransport(sender_conn, timeout_s=300)
    sender = WeightSender(transport, bucket_bytes=args.bucket_mib * 2**20)
    tiny = [("tiny", torch.zeros(1024))]
    views = list(state.items())
    copies = [("copy/" + name, tensor) for name, tensor in state.items()]
    total = nbytes(state.values())
    try:
        # the three updates need different slot sizes: push each once first, so no slot is reallocated when timed
        for update in (views, copies, tiny):
            sender.push(update)
        fixed = best_of(lambda: sender.push(tiny), max(args.repeats, 10))
        rows.append(row("fixed", "shm push of a 4 KiB update", 0, fixed, "begin + 1 bucket + commit round trip"))
        seconds = best_of(lambda: sender.push(views), args.repeats)
        buckets = sender.last_push.num_buckets
        rows.append(row("transfer", "shm push, engine views", total, seconds, f"pack into shm, {buckets} buckets"))
        while stats_in.poll():
            stats_in.recv()
        seconds = best_of(lambda: sender.push(copies), args.repeats, warmup=False)
        rows.append(row("transfer", "shm push, engine copies", total, seconds, "+ the engine's copy out of shm"))
        copy_times = []  # the engine sent each before acknowledging its update, so all are here
        while stats_in.poll():
            copy_times.append(stats_in.recv())
        if copy_times:
            rows.append(
                row("transfer", "shm copy between processes", total, min(copy_times), "engine side, timed there")
            )
    finally:
        transport.close()
        engine.join(timeout=60)


def gloo_peer(init_file: str, bucket_bytes: int, threads: int) -> None:
    """Rank 1: receive broadcasts until rank 0 broadcasts an empty control message."""
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=1, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    try:
        buffer = torch.empty(bucket_bytes, dtype=torch.uint8)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] == "stop":
                break
            if box[0] == "payload":
                dist.broadcast(buffer, src=0)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_gloo(args, rows: list[dict]) -> None:
    bucket_bytes = args.bucket_mib * 2**20
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "init")
        peer = context.Process(target=gloo_peer, args=(init_file, bucket_bytes, args.threads))
        peer.start()
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=0, world_size=2, timeout=datetime.timedelta(seconds=300)
        )
        try:
            payload = torch.ones(bucket_bytes, dtype=torch.uint8)

            def control():
                dist.broadcast_object_list(["control"], src=0)
                dist.barrier()

            def broadcast():
                dist.broadcast_object_list(["payload"], src=0)
                dist.broadcast(payload, src=0)
                dist.barrier()

            latency = best_of(control, max(args.repeats, 10))
            rows.append(row("fixed", "gloo control message", 0, latency, "broadcast_object_list + barrier"))
            seconds = best_of(broadcast, max(args.repeats, 3)) - latency
            rows.append(row("transfer", "gloo broadcast, 2 processes", bucket_bytes, seconds, "localhost TCP"))
            dist.broadcast_object_list(["stop"], src=0)
        finally:
            dist.destroy_process_group()
            peer.join(timeout=60)


# ---- report ----


def row(stage: str, variant: str, size: int, seconds: float, notes: str = "") -> dict:
    gib = size / GIB
    return {
        "stage": stage,
        "variant": variant,
        "gib": gib,
        "seconds": seconds,
        "s_per_gib": seconds / gib if gib else None,
        "gib_per_s": gib / seconds if gib and seconds > 0 else None,
        "notes": notes,
    }


def print_table(rows: list[dict]) -> None:
    print("| stage | variant | GiB | seconds | s/GiB | GiB/s | notes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s_per_gib = f"{r['s_per_gib']:.3f}" if r["s_per_gib"] is not None else "-"
        gib_per_s = f"{r['gib_per_s']:.2f}" if r["gib_per_s"] is not None else "-"
        print(
            f"| {r['stage']} | {r['variant']} | {r['gib']:.3f} | {r['seconds']:.4f} | {s_per_gib} | {gib_per_s} | "
            f"{r['notes']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mib", type=int, default=64, help="bucket size (miles.sync's default is 512)")
    parser.add_argument("--sample-mib", type=int, default=128, help="float32 bytes of weights to measure on")
    parser.add_argument("--codec-mib", type=int, default=32, help="float32 bytes of the sample the codecs run on")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--synthetic", action="store_true", help="synthetic weights even if the checkpoint exists")
    parser.add_argument("--base-dir", type=Path, help="a trained checkpoint pair: weights before a step ...")
    parser.add_argument("--new-dir", type=Path, help="... and after it (safetensors file or directory)")
    parser.add_argument(
        "--stages", nargs="+", choices=STAGES, default=list(STAGES), help="what to measure (default: everything)"
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    info = cpu_info(args.threads)
    print(f"CPU: {info['model']}; torch capability {info['torch_cpu_capability']}; flags {info['isa_flags']}")
    print(f"{info['logical_cpus']} logical CPUs, {args.threads} torch threads per process; torch {info['torch']}")
    base, new_weights, source = load_weights(args)
    print(f"weights: {source}: {len(base)} tensors, {nbytes(base.values()) / 2**20:.0f} MiB float32")
    load_before = os.getloadavg()
    print(
        f"bucket: {args.bucket_mib} MiB; best of >= {args.repeats} after a warm-up; load average {load_before[0]:.2f}\n"
    )

    rows: list[dict] = []
    fractions: list[dict] = []
    if "pack" in args.stages:
        measure_pack(base, args, rows)
    if "codecs" in args.stages:
        measure_codecs(base, args, rows)
    if "delta" in args.stages:
        measure_delta(base, new_weights, args, rows, fractions)
    if "apply" in args.stages:
        measure_apply(base, args, rows)
    if "transfer" in args.stages:  # child processes
        measure_shared_memory(base, args, rows)
        measure_gloo(args, rows)
    print_table(rows)
    print("\n| wire | change | delta kind | sent / full | changed 32-bit words |")
    print("|---|---|---|---|---|")
    for f in fractions:
        words = f"{f['changed_word_fraction']:.4f}" if "changed_word_fraction" in f else "-"
        print(f"| {f['wire']} | {f['change']} | {f['kind']} | {f['sent_fraction']:.4f} | {words} |")
    elapsed = time.perf_counter() - start
    load_after = os.getloadavg()
    print(f"\ntotal {elapsed:.0f} s; 1-min load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    if args.out:
        result = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "cpu": info,
            "weights": source,
            "bucket_mib": args.bucket_mib,
            "sample_mib": args.sample_mib,
            "repeats": args.repeats,
            "stages": args.stages,
            "rows": rows,
            "delta_fractions": fractions,
            "elapsed_s": elapsed,
            "load_average_1min": {"before": load_before[0], "after": load_after[0]},
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
