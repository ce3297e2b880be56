"""Megatron pipeline parallelism on CPU: one training step (forward of the old log-probs, forward_backward, optimizer
step) of two pipeline stages under Megatron's 1F1B schedule against one rank holding the whole model, in one run.

    uv run --no-sync python benchmarks/train/bench_megatron_pipeline.py [--rounds 3] [--layers 8] [--sequences 32]

The model is a random Llama (``--layers`` layers, hidden 256, 8 heads, vocabulary 512, fp32) built here; the batch
``--sequences`` rows of 40-100 tokens (seed 0), packed, in micro-batches of ``--micro-batch-size`` rows. Variants,
each a fresh set of processes per round (load, a warm-up step, then the timed step; variants alternate):

- ``one-rank`` (the baseline): ``MegatronBackend`` on one rank, 1 torch thread;
- ``one-rank-2-threads``: the same with 2 threads (what one process can take of 2 cores);
- ``pp2``: ``--train.megatron.pipeline-parallel-size 2`` on 2 ranks over gloo, 1 thread each: stage 0 holds the first
  half of the layers, stage 1 the rest; the schedule overlaps the stages' micro-batches (1F1B).

Prints the median step time per variant and its ratio to ``one-rank``, and the step's loss (equal losses: the same
step was computed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"one-rank": (1, 1), "one-rank-2-threads": (1, 2), "pp2": (2, 1)}  # name -> (ranks, threads per rank)


def build_model(path: Path, layers: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def make_batch(num: int):
    import torch
    from miles.core.batch import build_train_batch
    from miles.core.sample import Sample

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(num):
        prompt_len = int(torch.randint(20, 41, (1,), generator=gen))
        response_len = int(torch.randint(20, 61, (1,), generator=gen))
        tokens = torch.randint(3, 512, (prompt_len + response_len,), generator=gen).tolist()
        samples.append(Sample(index=i, group_index=i // 4, prompt="", tokens=tokens, response_length=response_len))
    advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(num)])
    batch = build_train_batch(samples, advantages, pad_token_id=0)
    return batch.replace(old_log_probs=torch.zeros_like(batch.loss_mask, dtype=torch.float32))


def worker(rank: int, world: int, init: str, model: str, sequences: int, micro_batch_size: int, out: str) -> None:
    import torch.distributed as dist
    from miles.core.algorithms.objective import LossCounts, PolicyObjective
    from miles.core.config import AlgorithmConfig
    from miles.train import TrainConfig
    from miles.train.megatron import MegatronBackend

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    train = TrainConfig(
        backend="megatron", batch_layout="packed", micro_batch_size=micro_batch_size,
        megatron={"pipeline_parallel_size": world},
    )  # fmt: skip
    backend = MegatronBackend(model, train=train, temperature=1.0)
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=64)
    batch = make_batch(sequences)

    def step() -> float:
        backend.forward(batch, outputs={"old_log_probs"})
        metrics = backend.forward_backward(batch, objective, LossCounts.of(batch))
        backend.optimizer_step()
        return metrics["loss"]

    step()  # warm-up
    dist.barrier()
    start = time.perf_counter()
    loss = step()
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "loss": loss}))
    dist.destroy_process_group()


def run_variant(name: str, model: Path, args, tmp: Path) -> dict:
    ranks, threads = VARIANTS[name]
    init, out = tmp / f"{name}.init", tmp / f"{name}.json"
    init.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MILES_BENCH_THREADS": str(threads)}
    command = [sys.executable, __file__, "--worker"]
    extra = [str(init), str(model), str(args.sequences), str(args.micro_batch_size), str(out)]
    procs = [subprocess.Popen([*command, str(r), str(ranks), *extra], env=env) for r in range(ranks)]
    if any(p.wait(timeout=1800) for p in procs):
        raise SystemExit(f"{name}: a rank failed")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--worker", nargs=7, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(int(os.environ["MILES_BENCH_THREADS"]))
        rank, world, init, model, sequences, micro_batch_size, out = args.worker
        worker(int(rank), int(world), init, model, int(sequences), int(micro_batch_size), out)
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        build_model(tmp / "model", args.layers)
        results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        names = list(VARIANTS)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                results[name].append(run_variant(name, tmp / "model", args, tmp))
    base = statistics.median(r["seconds"] for r in results["one-rank"])
    print(f"{args.layers} layers, {args.sequences} sequences, micro-batches of {args.micro_batch_size}")  # noqa: T201
    print("| variant | step (s, median) | vs one-rank | loss |")  # noqa: T201
    print("|---|---|---|---|")  # noqa: T201
    for name, rows in results.items():
        seconds = statistics.median(r["seconds"] for r in rows)
        print(f"| {name} | {seconds:.2f} | {seconds / base:.2f}x | {rows[0]['loss']:.6f} |")  # noqa: T201


if __name__ == "__main__":
    main()
