"""Delta vs full weight updates on the weights of real GRPO steps of the default job, to 1, 2 and 4 engines.

1. Runs the default job (``miles train``, recipe smollm2_grpo_arithmetic: its model, data, lr 3e-5, AdamW, clip)
   for ``--steps`` steps with a checkpoint after each (and no evals, to save time); the trainer's fp32 weights after
   each step are the updates.
2. For each wire dtype (fp32: identity codec; bf16: the bf16 cast codec) and 1, 2, 4 engine processes in one gloo
   group (``DistributedTransport``: one broadcast reaches every engine), pushes the initial weights then each
   step's, once with a full sender and once with ``delta=True``. Each engine copies every update into its own
   model and checks it, by xxh3 of every tensor's bytes, against what the trainer sent (bit-identical).
3. Prints per step the fraction of the full bytes the delta sent, and per setting the median push time of steps
   1..n, delta / full.
4. With ``--topology fanout`` (or ``both``), the same through the fan-out topology instead (or as well): one
   ``MultiEngineSender`` with a ``SharedMemoryTransport`` per engine process, sending to the engines concurrently
   (each delta encoded once); the bytes column is per engine.

Usage: ``uv run python benchmarks/sync/bench_delta.py [--steps 3] [--work-dir /tmp/miles-bench-delta]
[--topology broadcast|fanout|both|none] [--restart-at 2]`` (about 6 min on 2 cores: ~4 for the training run).
Results are tabled in docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUM_THREADS = 2


def train_checkpoints(work_dir: Path, steps: int) -> tuple[Path, list[Path]]:
    """Run the default job for ``steps`` steps; (initial model directory, model directory after each step)."""
    run_dir = work_dir / "runs"
    name = "delta"
    if not (run_dir / name / "checkpoints" / f"step_{steps}").is_dir():
        cmd = [
            sys.executable, "-m", "miles.recipes.cli", "train",
            "--loop.num-steps", str(steps), "--loop.save-interval", "1", "--loop.keep-checkpoints", str(steps),
            "--eval.num-prompts", "0", "--run.dir", str(run_dir), "--run.name", name, "--overwrite",
            "--run.progress", "false",
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
    from miles.recipes.registry import resolve_model_path

    initial = Path(resolve_model_path("smollm2-135m-instruct", key="models.policy.path"))
    return initial, [run_dir / name / "checkpoints" / f"step_{s}" / "model" for s in range(1, steps + 1)]


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state |= load_file(path)
    return {name: tensor.float() for name, tensor in sorted(state.items())}


def digest(named_tensors) -> dict[str, int]:
    from miles.sync.delta import checksum

    return {name: checksum(t.detach().contiguous().view(-1).view(torch.uint8)) for name, t in named_tensors}


def rank_main(rank: int, world: int, init_file: str, updates: list[Path], codec: str, delta: bool, results) -> None:
    """Rank 0 sends every update; ranks 1.. are engines that load and check each one."""
    from miles.sync import WeightReceiver, WeightSender
    from miles.sync.transports.distributed import DistributedEndpoint, DistributedTransport

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    try:
        if rank == 0:
            transport = DistributedTransport(src=0)
            sender = WeightSender(transport, codec=codec, codec_exclude=(), delta=delta)
            rows = []
            for path in updates:
                named = list(load_weights(path).items())
                t0 = time.perf_counter()
                sender.push(named)
                seconds = time.perf_counter() - t0
                stats = sender.last_push
                rows.append((seconds, stats.nbytes, stats.full_nbytes, dict(stats.kinds)))
                dist.barrier()
            transport.close()
            results.put(("sender", rows))
        else:
            model: dict[str, torch.Tensor] = {}
            digests = []

            def load(named_tensors):
                for name, tensor in named_tensors:
                    if name not in model:
                        model[name] = torch.empty_like(tensor)
                    model[name].copy_(tensor)

            receiver = WeightReceiver(apply_fn=load)
            endpoint = DistributedEndpoint(receiver, src=0)
            for _ in updates:
                endpoint.serve_update()
                digests.append(digest(model.items()))  # outside the timed push
                dist.barrier()
            endpoint.serve_update()  # the close
            results.put(("engine", rank, digests))
    finally:
        dist.destroy_process_group()


def expected_digests(updates: list[Path], codec: str) -> list[dict[str, int]]:
    """What an engine must hold after each update: the sent weights through the codec (identity or bf16 cast)."""
    from miles.sync.codecs import get_codec

    out = []
    for path in updates:
        wire = get_codec(codec)
        decoded = [
            (name, wire.decode(wire.encode(tensor), shape=tuple(tensor.shape), dtype=tensor.dtype))
            for name, tensor in load_weights(path).items()
        ]
        out.append(digest(decoded))
    return out


def measure(updates: list[Path], codec: str, engines: int, delta: bool, work_dir: Path) -> list[tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.NamedTemporaryFile(dir=work_dir, delete=True) as f:
        init_file = f.name
    world = engines + 1
    procs = [
        ctx.Process(target=rank_main, args=(r, world, init_file, updates, codec, delta, results)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=1200) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    expected = expected_digests(updates, codec)
    for item in got:
        if item[0] == "engine":
            assert item[2] == expected, f"engine {item[1]} does not hold the trainer's weights bit for bit"
    return next(item[1] for item in got if item[0] == "sender")


def fanout_engine(index: int, conn, results) -> None:
    """An engine process of the fan-out topology: copies every update into its own model, then reports its digest."""
    from miles.sync import WeightReceiver
    from miles.sync.transports.shared_memory import SharedMemoryEndpoint

    torch.set_num_threads(1)
    model: dict[str, torch.Tensor] = {}

    def load(named_tensors):
        for name, tensor in named_tensors:
            if name not in model:
                model[name] = torch.empty_like(tensor)
            model[name].copy_(tensor)

    endpoint = SharedMemoryEndpoint(WeightReceiver(apply_fn=load), conn)
    while endpoint.serve_update():
        results.put((index, digest(model.items())))


def measure_fanout(
    updates: list[Path], codec: str, engines: int, delta: bool, work_dir: Path, restart_at: int = 0
) -> list[tuple]:
    """Like ``measure`` through a ``MultiEngineSender`` to ``engines`` shared-memory engine processes; rows are
    (push seconds, bytes sent to one engine, full bytes, encodings of one engine's buckets). With ``restart_at``
    (and 2+ engines) the last engine's process is killed before update ``restart_at`` and a new, empty one takes its
    place (``reset_engine``): it must get that update in full, the others the delta, all bit-identical."""
    from miles.sync import MultiEngineSender
    from miles.sync.transports.shared_memory import SharedMemoryTransport

    ctx = mp.get_context("spawn")
    results = [ctx.Queue() for _ in range(engines)]  # one each: a killed engine could leave a shared queue locked

    def start(index: int):
        sender_conn, engine_conn = ctx.Pipe()
        process = ctx.Process(target=fanout_engine, args=(index, engine_conn, results[index]))
        process.start()
        engine_conn.close()
        return process, SharedMemoryTransport(sender_conn, timeout_s=1200)

    procs, transports = [], {}
    for index in range(engines):
        process, transports[f"engine{index}"] = start(index)
        procs.append(process)
    sender = MultiEngineSender(transports, codec=codec, codec_exclude=(), delta=delta)
    rows, digests = [], [[] for _ in range(engines)]
    last = f"engine{engines - 1}"
    try:
        for step, path in enumerate(updates):
            named = list(load_weights(path).items())
            restarted = bool(restart_at) and step == restart_at and engines > 1
            if restarted:  # outside the timed push
                procs[-1].kill()
                procs[-1].join(timeout=60)
                procs[-1], transport = start(engines - 1)
                sender.reset_engine(last, transport)
            t0 = time.perf_counter()
            sender.push(named)
            seconds = time.perf_counter() - t0
            stats = sender.last_push
            rows.append(
                (seconds, stats.engines["engine0"].nbytes, stats.full_nbytes, dict(stats.engines["engine0"].kinds))
            )
            if restarted:
                got, others = stats.engines[last], stats.engines["engine0"]
                assert got.nbytes == stats.full_nbytes and others.nbytes < stats.full_nbytes, (got, others)
                print(
                    f"| {codec} | {engines} | {step} | {last} restarted: full ({got.nbytes / 2**20:.0f} MiB); "
                    f"the others {others.nbytes / stats.full_nbytes:.3f} of it as a delta |"
                )
            for index in range(engines):  # the engines' digests, outside the timed push
                reported, engine_digests = results[index].get(timeout=1200)
                digests[reported].append(engine_digests)
        sender.close()
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    expected = expected_digests(updates, codec)
    for index, engine_digests in enumerate(digests):
        assert engine_digests == expected, f"engine {index} does not hold the trainer's weights bit for bit"
    return rows


def report(updates: list[Path], engine_counts: list[int], measure_fn, work_dir: Path) -> None:
    """Print the per-step and summary tables of one topology."""
    print("| wire dtype | engines | step | delta bytes / full bytes | delta encodings |")
    print("|---|---|---|---|---|")
    summary = []
    for label, codec in (("fp32", "identity"), ("bf16", "bf16")):
        for engines in engine_counts:
            full = measure_fn(updates, codec, engines, delta=False, work_dir=work_dir)
            delta = measure_fn(updates, codec, engines, delta=True, work_dir=work_dir)
            for step, row in enumerate(delta[1:], start=1):
                if engines == engine_counts[0]:
                    kinds = ", ".join(f"{n} {k}" for k, n in sorted(row[3].items()))
                    print(f"| {label} | {engines} | {step} | {row[1] / row[2]:.3f} | {kinds} |")
            t_full = statistics.median(r[0] for r in full[1:])
            t_delta = statistics.median(r[0] for r in delta[1:])
            fraction = sum(r[1] for r in delta[1:]) / sum(r[2] for r in delta[1:])
            summary.append((label, engines, t_full, t_delta, fraction))
    print("\n| wire dtype | engines | full push s | delta push s | delta / full time | bytes / full |")
    print("|---|---|---|---|---|---|")
    for label, engines, t_full, t_delta, fraction in summary:
        print(f"| {label} | {engines} | {t_full:.2f} | {t_delta:.2f} | {t_delta / t_full:.2f}x | {fraction:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "miles-bench-delta")
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--topology",
        choices=["broadcast", "fanout", "both", "none"],
        default="broadcast",
        help="broadcast: one gloo group (DistributedTransport); fanout: MultiEngineSender over shared memory; "
        "none: only the --restart-at check",
    )
    parser.add_argument(
        "--restart-at",
        type=int,
        default=0,
        help="also: fan-out delta pushes with the last engine killed and replaced by an empty one before this "
        "update (1..steps; 0: not run)",
    )
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(NUM_THREADS)
    initial, steps = train_checkpoints(args.work_dir, args.steps)
    updates = [initial, *steps]

    print(f"\nweights: the default job's initial model, then after each of {args.steps} GRPO steps")
    if args.topology in ("broadcast", "both"):
        report(updates, args.engines, measure, args.work_dir)
    if args.topology in ("fanout", "both"):
        print("\nfan-out: MultiEngineSender, one SharedMemoryTransport per engine process (bytes per engine)")
        report(updates, args.engines, measure_fanout, args.work_dir)
    if args.restart_at:
        print(f"\nfan-out with a restart: the last engine killed and replaced before update {args.restart_at}")
        print("| codec | engines | update | what each engine got |\n|---|---|---|---|")
        for codec in ("identity", "bf16"):
            for engines in (n for n in args.engines if n > 1):
                measure_fanout(updates, codec, engines, True, args.work_dir, restart_at=args.restart_at)
        print("every engine, the restarted one included, held the trainer's weights bit for bit after every update")


if __name__ == "__main__":
    main()
