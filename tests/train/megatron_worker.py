"""Worker for the two-rank Megatron tests; run as a script:
python megatron_worker.py RANK WORLD INIT_FILE MODEL OUT
TENSOR_PARALLEL[xEXPERT_PARALLEL][cCONTEXT_PARALLEL][pPIPELINE_PARALLEL] LAYOUT [BATCH_FILE]
(e.g. ``2``, ``1x2``, ``1c2``, ``1p2``, ``1x2p2`` on 4 ranks).

Every rank: log-probs of the whole batch, forward_backward of its replica's rows with the global loss counts, full
gradients, one optimizer step, a push into rank 0's recording sink, the full state, a checkpoint and its load (the
full state again); rank 0 saves
what it saw into OUT (and the checkpoint into OUT.ckpt). ``MEGATRON_WORKER_LORA=R``: LoRA adapters of rank R
(alpha 2R) on every targeted layer, so the gradients are the adapters' (Megatron names)."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(
    rank: int,
    world: int,
    init_file: str,
    model_dir: str,
    out: str,
    parallel: str,
    layout: str,
    batch_file: str | None = None,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from batch_fixture import make_batch
    from fsdp2_worker import RecordingSink
    from miles.core.algorithms.objective import LossCounts, PolicyObjective
    from miles.core.config import AlgorithmConfig
    from miles.train import TrainConfig
    from miles.train.megatron import MegatronBackend

    parallel, _, pipeline = parallel.partition("p")
    pipeline_parallel = int(pipeline or 1)
    parallel, _, context = parallel.partition("c")
    context_parallel = int(context or 1)
    tensor_parallel, expert_parallel = (int(size) for size in (parallel + "x1").split("x")[:2])
    train = TrainConfig(
        backend="megatron",
        megatron={
            "tensor_parallel_size": tensor_parallel,
            "expert_parallel_size": expert_parallel,
            "pipeline_parallel_size": pipeline_parallel,
            "context_parallel_size": context_parallel,
        },
        micro_batch_size=2,
        batch_layout=layout,
        lr=1e-2,
        adam_eps=1e-4,  # see test_log_probs_gradients_and_a_step_equal_the_fsdp2_backend
        lora={"rank": int(rank_), "alpha": 2.0 * int(rank_)}
        if (rank_ := os.environ.get("MEGATRON_WORKER_LORA"))
        else None,
    )
    sink = RecordingSink() if rank == 0 else None
    # a pipeline also runs a frozen reference (the same model) through its stages
    reference = model_dir if pipeline_parallel > 1 else None
    backend = MegatronBackend(model_dir, train=train, temperature=1.0, weight_sink=sink, reference_path=reference)
    if train.lora is not None:
        from megatron_models import set_lora_b

        set_lora_b(backend)  # the adapters act from the start: A's gradients and the forward are tested too
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
    batch = make_batch()
    if batch_file is not None:  # the TrainBatch's tensors (no pickled objects: see tests/test_security.py)
        from miles.core.batch import TrainBatch

        batch = TrainBatch(**torch.load(batch_file, weights_only=True))
    outputs = {"old_log_probs"} | ({"ref_log_probs"} if reference else set())
    forwarded = backend.forward(batch, outputs=outputs)
    log_probs = forwarded.old_log_probs
    replicas = world // (tensor_parallel * context_parallel * pipeline_parallel)
    replica = train.megatron.replica_of(rank, world)  # Megatron's rank order: tp-cp-ep-dp-pp
    rows = batch.batch_size // replicas
    shard = batch.slice(replica * rows, (replica + 1) * rows)
    # two accumulations before the step (the global counts in both): Megatron's gradient finalization must run once
    half = shard.batch_size // 2
    first = backend.forward_backward(shard.slice(0, half), objective, LossCounts.of(batch))
    second = backend.forward_backward(shard.slice(half, shard.batch_size), objective, LossCounts.of(batch))
    metrics = {key: first[key] + second[key] for key in ("loss", "loss/pg")}
    grads = backend.full_gradients()
    step = backend.optimizer_step()
    # after a (clipped) step: a tied embedding's copy on the last pipeline stage must have moved as the embedding did
    log_probs_after = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    backend.push_weights(1)
    state = backend.full_state_dict()
    adapters = dict(backend._hf_adapters()) if train.lora is not None else None  # what adapter sync would send
    backend.save(Path(out + ".ckpt"))
    backend.load(Path(out + ".ckpt"))  # every rank its part back (the weights, LoRA: the adapters onto the base)
    reloaded = backend.full_state_dict()
    if rank == 0:
        torch.save(
            {
                "log_probs": log_probs,
                "log_probs_after": log_probs_after,
                "ref_log_probs": forwarded.ref_log_probs if reference else None,
                "metrics": metrics,
                "grads": grads,
                "step": step,
                "pushed": sink.received,
                "state": state,
                "adapters": adapters,
                "reloaded": reloaded,
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, init_file, model_dir, out, parallel, layout = sys.argv[1:8]
    main(int(rank), int(world), init_file, model_dir, out, parallel, layout, *sys.argv[8:9])
