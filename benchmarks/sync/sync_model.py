"""A model of weight-sync time at cluster scale: full and delta updates of 7B to 1T models (docs/sync-at-scale.md).

An update moves the model's wire bytes from trainer GPUs into every engine replica, bucket by bucket, through
stages: gather (the trainer's shards into whole tensors), pack + encode (cast / quantize into the bucket),
optionally delta encode, transfer, optionally delta decode, and apply (copy into the engine's parameters). Each
stage's time is the bytes its busiest unit handles (one sender GPU, or one engine GPU) over that unit's
throughput. With the stages overlapped across n buckets the update takes

    T_pipelined = max_s T_s + (sum_s T_s - max_s T_s) / n      (the slowest stage, plus filling the pipe)

and without overlap ``T_serial = sum_s T_s``; both add the fixed cost of an update: pause + flush + resume of the
engines, the engines' post-processing after a load, and a control latency per bucket.

Topologies:

- ``broadcast``: ``senders`` broadcast groups (1: one trainer rank gathers everything and broadcasts, as
  miles.sync's ``DistributedTransport`` does today; a PP stage per group in slime/miles' broadcast mode), each
  broadcasting its 1/senders of the model to every engine GPU. A ring or tree relays each byte, so the sender's link
  carries it once, but every engine GPU receives every byte and keeps its slice: transfer = W / link, whatever the
  number of groups or engines.
- ``p2p``: every trainer GPU in ``senders`` writes exactly the shards its target engine GPUs hold (miles' P2P RDMA
  mode, Perplexity's RDMA WRITE schedule; miles.sync's P2P transport with one sender per trainer rank). Engine GPUs
  receive W / (GPUs per replica); the trainer side sends replicas x W in all, spread over the senders. A sender
  prepares the shards of its targets once, also when it writes them to several replicas.

Delta (``delta="gpu"``: XOR / compaction on the GPU at HBM speed, an assumption; ``delta="cpu"``: miles.sync's
``DeltaEncoder`` today, which copies the packed bucket to the host and encodes it on the CPU at the rate measured by
``bench_sync_costs.py``) scales what the transfer moves by ``sent_fraction`` and adds an encode and a decode stage.
``local_delta`` encodes each trainer shard where it lives, before any gather (verl's ``delta_sharded``).

Units: bytes, seconds, GB/s = 1e9 bytes per second. Every throughput is per GPU (or per process on its host) and is
a stated assumption unless its docstring says it was measured; ``python sync_model.py`` prints the tables of
docs/sync-at-scale.md, ``--costs costs.json`` takes the CPU inputs from a ``bench_sync_costs.py --out`` file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9
GIB = 2**30

MEASURED_CPU = {
    # bench_sync_costs.py --repeats 3 on the 2-core AVX2 CI machine, 2026-12-02, after DeltaEncoder's fix to send the
    # smaller of sparse and compressed XOR (docs/sync-at-scale.md), GB/s of the full (packed) payload; the weight
    # change is "adam1" (AdamW's first step at lr 3e-5) on SmolLM2-135M's layers
    "cpu_delta_encode_gbps": 0.20,  # DeltaEncoder, bf16 payload, default choice (xor_zstd here; forced sparse: 0.45)
    "cpu_delta_decode_gbps": 0.29,  # DeltaDecoder of the same (forced sparse: 1.39)
    "per_bucket_s": 0.00105,  # one gloo control message (broadcast_object_list + barrier), localhost
    "sent_fraction_bf16": 0.08,  # DeltaEncoder default on bf16, xor_zstd (forced sparse: 0.32; docs/performance.md's
    # real GRPO step sent 0.330 as sparse, before DeltaEncoder compared the two sizes)
}


@dataclass(frozen=True)
class ModelSpec:
    """What the update moves.

    Attributes:
        name: for tables.
        params: total parameters (an MoE's experts included: every expert is updated).
        wire_bytes_per_param: bytes per parameter on the wire (bf16: 2; FP8 with 128x128 block scales: ~1.0).
        train_bytes_per_param: bytes per parameter the trainer gathers before encoding (bf16 weights: 2).
    """

    name: str
    params: float
    wire_bytes_per_param: float = 2.0
    train_bytes_per_param: float = 2.0

    @property
    def wire_bytes(self) -> float:
        return self.params * self.wire_bytes_per_param

    @property
    def train_bytes(self) -> float:
        return self.params * self.train_bytes_per_param


@dataclass(frozen=True)
class ClusterSpec:
    """Where the update goes.

    Attributes:
        name: for tables.
        trainer_gpus: trainer GPUs (each may send).
        engine_replicas: engine instances that each need the whole model (data-parallel rollout copies).
        engine_gpus_per_replica: GPUs of one engine (TP x EP x PP); each holds 1/this of the weights.
    """

    name: str
    trainer_gpus: int
    engine_replicas: int
    engine_gpus_per_replica: int

    @property
    def engine_gpus(self) -> int:
        return self.engine_replicas * self.engine_gpus_per_replica


@dataclass(frozen=True)
class Assumptions:
    """Per-GPU (or per-process) throughputs in GB/s and fixed costs in seconds.

    Attributes:
        link_gbps: one GPU's network link: a 400 Gb/s InfiniBand NDR port per GPU (8 per H100/H200 node) is 50 GB/s
            per direction, 400 GB/s per node; 0.8 of line rate is assumed achieved by large RDMA / NCCL transfers.
        gather_gbps: all-gather of TP / EP / FSDP shards into whole tensors. Expert-parallel groups span nodes, so
            the NIC rate is assumed (NVLink 4, ~450 GB/s per direction, would apply within a node only).
        pcie_gbps: device <-> host copies, pinned (PCIe Gen5 x16 is ~64 GB/s peak; 0.6 of it assumed).
        gpu_pack_gbps: pack / cast / FP8 quantization on the GPU, HBM-bound (H100: 3.35 TB/s, H200: 4.8 TB/s; a read
            and a write per byte, some kernels; 1 TB/s of input assumed).
        gpu_delta_gbps: delta encode or decode on the GPU (XOR, count, compaction: a few HBM passes; assumed).
        gpu_apply_gbps: copying received tensors into the engine's parameters (HBM-bound; assumed).
        cpu_delta_encode_gbps: miles.sync's ``DeltaEncoder`` on the host (measured here on 2 cores; see
            ``MEASURED_CPU``), GB/s of full payload.
        cpu_delta_decode_gbps: ``DeltaDecoder`` likewise (measured here).
        fixed_s: per update: pause generation, flush caches, resume, commit round trips (assumed; not measured here:
            this machine has no GPU engine).
        post_process_s: per update, the engines' processing after a load (e.g. FP8 re-quantization: miles reports
            ~0.88 s for Kimi-K2 on H100).
        per_bucket_s: control latency per bucket (measured here: one gloo control message).
        bucket_bytes: payload per bucket (miles.sync's default 512 MiB).
    """

    link_gbps: float = 50.0 * 0.8
    gather_gbps: float = 50.0 * 0.8
    pcie_gbps: float = 64.0 * 0.6
    gpu_pack_gbps: float = 1000.0
    gpu_delta_gbps: float = 500.0
    gpu_apply_gbps: float = 1000.0
    cpu_delta_encode_gbps: float = MEASURED_CPU["cpu_delta_encode_gbps"]
    cpu_delta_decode_gbps: float = MEASURED_CPU["cpu_delta_decode_gbps"]
    fixed_s: float = 0.5
    post_process_s: float = 0.0
    per_bucket_s: float = MEASURED_CPU["per_bucket_s"]
    bucket_bytes: float = 512 * 2**20


@dataclass(frozen=True)
class Scenario:
    """How the update is sent.

    Attributes:
        topology: "broadcast" or "p2p" (see the module docstring).
        senders: broadcast groups, or trainer GPUs that write (None: every trainer GPU).
        delta: where deltas are encoded: "none" (full updates), "gpu" or "cpu".
        delta_decode: where they are decoded, "gpu" or "cpu" (None: where they are encoded).
        sent_fraction: delta bytes / full bytes (ignored without delta).
        local_delta: encode each trainer shard before any gather (verl's ``delta_sharded``): the gather moves only
            the delta, and encoding is spread over every trainer GPU.
        host_staging: payloads pass through a pinned host buffer on the sender (a device -> host copy; the NIC
            reads host memory), as in miles' P2P mode.
        label: for tables.
    """

    topology: str = "p2p"
    senders: int | None = None
    delta: str = "none"
    delta_decode: str | None = None
    sent_fraction: float = 1.0
    local_delta: bool = False
    host_staging: bool = False
    label: str = ""


@dataclass
class Prediction:
    """Stage times (seconds, the busiest unit's total over the update) and the totals."""

    stages: dict[str, float]
    fixed: float
    num_buckets: int
    pipelined: float = field(init=False)
    serial: float = field(init=False)

    def __post_init__(self) -> None:
        self.pipelined = pipelined(list(self.stages.values()), self.num_buckets) + self.fixed
        self.serial = sum(self.stages.values()) + self.fixed

    @property
    def slowest(self) -> str:
        return max(self.stages, key=self.stages.__getitem__)


def pipelined(stage_seconds: list[float], num_buckets: int) -> float:
    """Total of stages overlapped across ``num_buckets`` equal buckets: the slowest stage's total, plus the other
    stages' share of one bucket (filling and draining the pipe). One bucket: the plain sum."""
    if not stage_seconds:
        return 0.0
    slowest = max(stage_seconds)
    return slowest + (sum(stage_seconds) - slowest) / max(num_buckets, 1)


def predict(model: ModelSpec, cluster: ClusterSpec, scenario: Scenario, a: Assumptions) -> Prediction:
    """Stage times of one update of ``model`` on ``cluster`` sent as ``scenario`` under assumptions ``a``."""
    if scenario.topology not in ("broadcast", "p2p"):
        raise ValueError(f"topology is {scenario.topology!r}; use 'broadcast' or 'p2p'")
    if scenario.delta not in ("none", "gpu", "cpu") or scenario.delta_decode not in (None, "gpu", "cpu"):
        raise ValueError(f"delta is {scenario.delta!r} / {scenario.delta_decode!r}; use 'none', 'gpu' or 'cpu'")
    wire, train = model.wire_bytes, model.train_bytes
    shard = cluster.engine_gpus_per_replica
    if scenario.topology == "broadcast":
        senders = min(scenario.senders or 1, cluster.trainer_gpus)
        prepared = 1 / senders  # share of the model one group prepares
        egress, ingress = wire / senders, wire  # every engine GPU receives every byte
        rebuilt = wire  # an engine GPU decodes every bucket it received
    else:
        senders = min(scenario.senders or cluster.trainer_gpus, cluster.trainer_gpus, cluster.engine_gpus)
        prepared = 1 / min(senders, shard)  # the shards of a sender's targets, once each
        egress, ingress = cluster.engine_replicas * wire / senders, wire / shard
        rebuilt = wire / shard
    fraction = scenario.sent_fraction if scenario.delta != "none" else 1.0
    stages: dict[str, float] = {}
    if scenario.local_delta and scenario.delta != "none":
        local = wire / cluster.trainer_gpus  # each trainer GPU diffs its own shard
        stages["delta encode"] = _encode_seconds(local, fraction, scenario.delta, a)
        stages["gather"] = wire * fraction * prepared / a.gather_gbps / GB
    else:
        stages["gather"] = train * prepared / a.gather_gbps / GB
        stages["pack/encode"] = train * prepared / a.gpu_pack_gbps / GB
        if scenario.delta != "none":
            stages["delta encode"] = _encode_seconds(wire * prepared, fraction, scenario.delta, a)
    if scenario.host_staging:
        stages["host staging"] = wire * fraction * prepared / a.pcie_gbps / GB
    stages["transfer"] = max(egress, ingress) * fraction / a.link_gbps / GB
    decode = scenario.delta_decode or scenario.delta
    if scenario.delta != "none" and decode == "gpu":
        stages["delta decode"] = rebuilt / a.gpu_delta_gbps / GB
    elif scenario.delta != "none":  # miles.sync's DeltaDecoder: rebuilt on the host from its base, then to the GPU
        stages["delta decode"] = rebuilt / a.cpu_delta_decode_gbps / GB + rebuilt / a.pcie_gbps / GB
    stages["apply"] = wire / shard / a.gpu_apply_gbps / GB
    sent_per_sender = max(wire * prepared, egress * fraction)
    num_buckets = max(1, math.ceil(sent_per_sender / a.bucket_bytes))
    fixed = a.fixed_s + a.post_process_s + num_buckets * a.per_bucket_s
    return Prediction(stages, fixed, num_buckets)


def _encode_seconds(nbytes: float, fraction: float, where: str, a: Assumptions) -> float:
    if where == "gpu":
        return nbytes / a.gpu_delta_gbps / GB
    # miles.sync's DeltaEncoder: the packed bucket to the host, encode there, the (smaller) delta back to the device
    return nbytes / a.pcie_gbps / GB + nbytes / a.cpu_delta_encode_gbps / GB + nbytes * fraction / a.pcie_gbps / GB


# ---- the models, clusters and scenarios of docs/sync-at-scale.md ----

FP8 = 1.0 + 4 / (128 * 128)  # E4M3 plus one float32 scale per 128 x 128 block

MODELS = {
    "7B": ModelSpec("7B dense", 7.0e9),
    "Qwen3-235B": ModelSpec("Qwen3-235B-A22B", 235e9),
    "DeepSeek-V3": ModelSpec("DeepSeek-V3 671B", 671e9, wire_bytes_per_param=FP8),
    "Kimi-K2": ModelSpec("Kimi-K2 1.04T", 1.04e12, wire_bytes_per_param=FP8),
}

CLUSTER_A = {  # trainer 8 nodes x 8 H100, engines on 8 nodes x 8 H100, engine size by model
    "7B": ClusterSpec("8+8 nodes, engines TP1 x 64", 64, 64, 1),
    "Qwen3-235B": ClusterSpec("8+8 nodes, engines EP16 x 4", 64, 4, 16),
    "DeepSeek-V3": ClusterSpec("8+8 nodes, engines EP16 x 4", 64, 4, 16),
    "Kimi-K2": ClusterSpec("8+8 nodes, engines EP32 x 2", 64, 2, 32),
}


def main_scenarios(sent_fraction: float) -> list[Scenario]:
    f = sent_fraction
    return [
        Scenario("broadcast", 1, label="full, broadcast from 1 rank"),
        Scenario("p2p", label="full, p2p from every trainer GPU"),
        Scenario("p2p", delta="gpu", sent_fraction=f, label=f"delta {f:.2f}, GPU encode after the gather, p2p"),
        Scenario(
            "p2p", delta="gpu", sent_fraction=f, local_delta=True, label=f"delta {f:.2f}, GPU encode of shards, p2p"
        ),
        Scenario(
            "p2p", delta="gpu", sent_fraction=0.03, local_delta=True, label="delta 0.03, GPU encode of shards, p2p"
        ),
        Scenario("p2p", delta="cpu", sent_fraction=f, label=f"delta {f:.2f}, miles.sync CPU delta today, p2p"),
    ]


@dataclass(frozen=True)
class Anchor:
    """A published measurement and the model's version of its setup."""

    name: str
    published: str
    source: str
    model: ModelSpec
    cluster: ClusterSpec
    scenario: Scenario
    assumptions: Assumptions = Assumptions()


def anchors(a: Assumptions) -> list[Anchor]:
    """The published numbers, each with the model's version of its setup (what the source states, and where it does
    not, an assumption named in the setup). miles and Perplexity time the transfer after the engines paused, so their
    rows have no pause / resume cost (``fixed_s`` 0)."""
    kimi, dsv3, qwen = MODELS["Kimi-K2"], MODELS["DeepSeek-V3"], MODELS["Qwen3-235B"]
    kimi_bf16 = dataclasses.replace(kimi, wire_bytes_per_param=2.0)
    miles_cluster = ClusterSpec("32+32 nodes H100, engines TP32/EP32 x 8", 256, 8, 32)
    verl_cluster = ClusterSpec("8 trainer nodes (64 ranks), SGLang TP16 on 2 nodes", 64, 1, 16)
    transfer_only = dataclasses.replace(a, fixed_s=0.0)
    miles_doc = "radixark/miles docs/advanced/p2p-weight-transfer.md"
    return [
        Anchor(
            "miles P2P, Kimi-K2",
            "7.23 s (incl. 0.88 s post-process)",
            miles_doc,
            kimi,
            miles_cluster,
            Scenario("p2p", host_staging=True, label="p2p from pinned host buffers, fp8"),
            dataclasses.replace(transfer_only, post_process_s=0.88),
        ),
        Anchor(
            "miles NCCL broadcast, Kimi-K2",
            "53.3 s",
            miles_doc,
            kimi_bf16,
            miles_cluster,
            Scenario("broadcast", 8, label="broadcast, a group per PP stage (PP8), bf16 on the wire (fp8: half)"),
            transfer_only,
        ),
        Anchor(
            "Perplexity RDMA, Kimi-K2",
            "1.3 s",
            "research.perplexity.ai/articles/weight-transfer-for-rl-post-training-in-under-2-seconds",
            kimi,
            ClusterSpec("256 trainer GPUs -> 128 engine GPUs (assumed 4 x 32)", 256, 4, 32),
            Scenario("p2p", label="p2p RDMA WRITE, fp8, FSDP gather within a node (NVLink)"),
            dataclasses.replace(transfer_only, gather_gbps=450 * 0.8),
        ),
        Anchor(
            "NeMo-RL, DeepSeek-V3",
            "2.4 s (as quoted in the issue); 7.65-9.94 s (NCCL-Xfer PR, H100)",
            "github.com/NVIDIA-NeMo/RL/pull/2808",
            dataclasses.replace(dsv3, wire_bytes_per_param=2.0),
            ClusterSpec("PP16xEP16 (256) -> TP32 x 8 (256)", 256, 8, 32),
            Scenario("p2p", label="shard-to-shard reshard, bf16"),
            a,
        ),
        Anchor(
            "verl nccl (full), Qwen3-235B",
            "246-266 s",
            "github.com/verl-project/verl/pull/7085",
            qwen,
            verl_cluster,
            Scenario("broadcast", 1, label="gather to rank 0 + broadcast, bf16"),
            a,
        ),
        Anchor(
            "verl delta_sharded, Qwen3-235B",
            "11.4-14.9 s",
            "github.com/verl-project/verl/pull/7085",
            qwen,
            verl_cluster,
            Scenario(
                "broadcast",
                1,
                delta="cpu",
                delta_decode="gpu",
                sent_fraction=0.001,
                local_delta=True,
                label="shard diffs on the host (measured CPU rate), 0.1% sent, sparse apply on the GPU",
            ),
            a,
        ),
    ]


SENSITIVITY = (
    "link_gbps",
    "gather_gbps",
    "gpu_pack_gbps",
    "gpu_delta_gbps",
    "cpu_delta_encode_gbps",
    "cpu_delta_decode_gbps",
    "pcie_gbps",
    "fixed_s",
)
"""The assumptions ``sensitivity`` varies, and the scenario's sent fraction."""


def sensitivity(model: ModelSpec, cluster: ClusterSpec, scenario: Scenario, a: Assumptions) -> dict[str, float]:
    """Pipelined time with each assumption made 2x worse (a throughput halved, a fixed cost or the delta sent
    fraction doubled), by name."""
    out = {}
    for name in SENSITIVITY:
        value = getattr(a, name)
        worse = value * 2 if name.endswith("_s") else value / 2
        out[name] = predict(model, cluster, scenario, dataclasses.replace(a, **{name: worse})).pipelined
    doubled = dataclasses.replace(scenario, sent_fraction=min(1.0, 2 * scenario.sent_fraction))
    out["sent_fraction"] = predict(model, cluster, doubled, a).pipelined
    return out


def assumptions_from_costs(path: Path, a: Assumptions) -> tuple[Assumptions, float]:
    """``a`` with the CPU inputs measured in a ``bench_sync_costs.py --out`` file; and the bf16 sent fraction."""
    data = json.loads(path.read_text())
    rows = {(r["stage"], r["variant"]): r for r in data["rows"]}

    def gbps(stage: str, variant: str, default: float) -> float:
        r = rows.get((stage, variant))
        return r["gib_per_s"] * GIB / GB if r and r.get("gib_per_s") else default

    # the rate rows are timed on the "adam1" change; the file also has the fractions of other changes
    bf16_auto = [f for f in data["delta_fractions"] if (f["wire"], f["kind"]) == ("bf16", "auto")]
    adam1 = [f for f in bf16_auto if f.get("change") == "adam1"]
    fraction = (adam1 or bf16_auto or [{"sent_fraction": MEASURED_CPU["sent_fraction_bf16"]}])[0]["sent_fraction"]
    control = rows.get(("fixed", "gloo control message"))
    replaced = dataclasses.replace(
        a,
        cpu_delta_encode_gbps=gbps("delta_encode", "bf16 auto", a.cpu_delta_encode_gbps),
        cpu_delta_decode_gbps=gbps("delta_decode", "bf16 auto", a.cpu_delta_decode_gbps),
        per_bucket_s=control["seconds"] if control else a.per_bucket_s,
    )
    return replaced, fraction


def format_predictions(a: Assumptions, sent_fraction: float) -> list[str]:
    lines = [
        "| model | wire GB | cluster | update | transfer s | total s (pipelined) | no overlap s | slowest stage |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, model in MODELS.items():
        cluster = CLUSTER_A[key]
        post = 0.88 if model.wire_bytes_per_param < 2 else 0.0
        assumptions = dataclasses.replace(a, post_process_s=post)
        for scenario in main_scenarios(sent_fraction):
            p = predict(model, cluster, scenario, assumptions)
            lines.append(
                f"| {model.name} | {model.wire_bytes / GB:.0f} | {cluster.name} | {scenario.label} | "
                f"{p.stages['transfer']:.2f} | {p.pipelined:.2f} | {p.serial:.2f} | {p.slowest} "
                f"({p.stages[p.slowest]:.2f} s) |"
            )
    return lines


def format_anchors(a: Assumptions) -> list[str]:
    lines = [
        "| anchor | published | model's setup | predicted s (pipelined) | no overlap s | slowest stage |",
        "|---|---|---|---|---|---|",
    ]
    for anchor in anchors(a):
        p = predict(anchor.model, anchor.cluster, anchor.scenario, anchor.assumptions)
        lines.append(
            f"| {anchor.name} | {anchor.published} | {anchor.cluster.name}; {anchor.scenario.label} | "
            f"{p.pipelined:.2f} | {p.serial:.2f} | {p.slowest} ({p.stages[p.slowest]:.2f} s) |"
        )
    return lines


def format_sensitivity(a: Assumptions, sent_fraction: float) -> list[str]:
    f = sent_fraction
    cases = [
        ("Kimi-K2", Scenario("p2p", label="full, p2p")),
        (
            "Kimi-K2",
            Scenario("p2p", delta="gpu", sent_fraction=f, local_delta=True, label="delta, GPU encode of shards"),
        ),
        ("Kimi-K2", Scenario("p2p", delta="cpu", sent_fraction=f, label="delta, miles.sync CPU today")),
        ("Qwen3-235B", Scenario("broadcast", 1, label="full, broadcast from 1 rank")),
    ]
    names = [*SENSITIVITY, "sent_fraction"]
    lines = ["| case | as assumed | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
    for key, scenario in cases:
        model, cluster = MODELS[key], CLUSTER_A[key]
        assumptions = dataclasses.replace(a, post_process_s=0.88 if model.wire_bytes_per_param < 2 else 0.0)
        base = predict(model, cluster, scenario, assumptions).pipelined
        worse = sensitivity(model, cluster, scenario, assumptions)
        cells = " | ".join(f"{worse[name]:.2f}" for name in names)
        lines.append(f"| {model.name}, {scenario.label} | {base:.2f} | {cells} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--costs", type=Path, help="a bench_sync_costs.py --out file: its CPU inputs replace the defaults"
    )
    parser.add_argument("--sent-fraction", type=float, help="delta sent fraction (default: measured, bf16)")
    args = parser.parse_args()
    a, fraction = Assumptions(), MEASURED_CPU["sent_fraction_bf16"]
    if args.costs:
        a, fraction = assumptions_from_costs(args.costs, a)
    if args.sent_fraction is not None:
        fraction = args.sent_fraction
    print("assumptions:", ", ".join(f"{k}={v:g}" for k, v in dataclasses.asdict(a).items()))
    print(f"delta sent fraction: {fraction:.3f}\n")
    print("\n".join(format_predictions(a, fraction)))
    print()
    print("\n".join(format_anchors(a)))
    print()
    print("\n".join(format_sensitivity(a, fraction)))


if __name__ == "__main__":
    main()
