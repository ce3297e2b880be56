"""Worker for the world-size-2 vision-language FSDP2 test; run as a script:
python fsdp2_vlm_worker.py RANK WORLD INIT_FILE MODEL BATCH OUT_PREFIX.

Each rank trains on its own rows of the batch saved in BATCH (rank 0: image rows, rank 1: text rows) and saves its
old log-probs; rank 0 also saves the reduced full gradients."""

import sys

import torch
import torch.distributed as dist


def main(rank: int, world_size: int, init_file: str, model_dir: str, batch_file: str, out_prefix: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    from miles.core.algorithms.objective import LossCounts, PolicyObjective
    from miles.core.config import AlgorithmConfig
    from miles.train import FSDP2Backend, TrainConfig

    batch = torch.load(batch_file, weights_only=False)
    backend = FSDP2Backend(model_dir, train=TrainConfig(dtype="fp32", micro_batch_size=2), temperature=1.0)
    half = batch.batch_size // world_size
    shard = batch.slice(rank * half, (rank + 1) * half)
    old = backend.forward(shard, outputs={"old_log_probs"}).old_log_probs
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=6)
    backend.forward_backward(shard.replace(old_log_probs=old), objective, LossCounts.of(batch))
    grads = backend.full_gradients()
    torch.save({"old_log_probs": old, "grads": grads if rank == 0 else None}, f"{out_prefix}{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
