"""Worker of the world-size-2 LoRA test; run as a script: python lora_worker.py RANK WORLD INIT_FILE MODEL OUT.

Each rank trains its half of the batch (global loss counts) for one step, pushes the merged weights, saves a
checkpoint into OUT's directory and loads it into a fresh backend; rank 0 writes what it saw to OUT."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(rank: int, world_size: int, init_file: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    from batch_fixture import make_batch
    from miles.core.algorithms.objective import LossCounts, PolicyObjective
    from miles.core.config import AlgorithmConfig
    from miles.train import FSDP2Backend, TrainConfig
    from miles.train.config import LoraConfig

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    train = TrainConfig(lr=1e-2, micro_batch_size=2, lora=lora)
    backend = FSDP2Backend(model_dir, train=train, temperature=1.0)
    batch = make_batch()
    half = batch.batch_size // world_size
    shard = batch.slice(rank * half, (rank + 1) * half)
    backend.forward_backward(shard, PolicyObjective(AlgorithmConfig(), max_new_tokens=8), LossCounts.of(batch))
    backend.optimizer_step()
    pushed = {name: tensor.clone() for name, tensor in backend.export_weights()}  # collective, every rank reads all
    checkpoint = Path(out).parent / "checkpoint"
    backend.save(checkpoint)  # collective; rank 0 writes
    dist.barrier()
    restored = FSDP2Backend(model_dir, train=train, temperature=1.0)
    restored.load(checkpoint)
    again = {name: tensor.clone() for name, tensor in restored.export_weights()}
    if rank == 0:
        torch.save({"pushed": pushed, "restored": again}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
