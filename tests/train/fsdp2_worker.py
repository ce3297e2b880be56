"""Worker for the world-size-2 FSDP2 tests; run as a script:
python fsdp2_worker.py RANK WORLD INIT_FILE MODEL OUT [LAYOUT (padded|packed)]."""

import sys

import torch
import torch.distributed as dist


def main(rank: int, world_size: int, init_file: str, model_dir: str, out: str, layout: str = "padded") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    from batch_fixture import make_batch
    from miles.core.algorithms.objective import LossCounts, PolicyObjective
    from miles.core.config import AlgorithmConfig
    from miles.train import FSDP2Backend, TrainConfig

    backend = FSDP2Backend(model_dir, train=TrainConfig(micro_batch_size=2, batch_layout=layout), temperature=1.0)
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
    batch = make_batch()
    with torch.no_grad():
        logits = backend.model(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits
    half = batch.batch_size // world_size
    shard = batch.slice(rank * half, (rank + 1) * half)  # each rank: its own rows, the global batch's counts
    metrics = backend.forward_backward(shard, objective, LossCounts.of(batch))
    grads = backend.full_gradients()
    if rank == 0:
        torch.save({"logits": logits, "grads": grads, "metrics": metrics}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
