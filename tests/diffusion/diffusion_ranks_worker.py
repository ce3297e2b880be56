"""Worker for the several-rank Flow-GRPO / DiffusionNFT tests; run as a script:
python diffusion_ranks_worker.py RANK WORLD INIT_FILE MODE OUT RESUME_STATE.

Each rank builds the tiny twin's trainer on a gloo mesh (FSDP2 over the transformer), runs two steps, evaluates,
and gathers its state; then a fresh trainer loads RESUME_STATE (one process's state after one step) and runs one
step. Rank 0 writes what the test compares with one process."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(rank: int, world_size: int, init_file: str, mode: str, out: str, resume_state: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the settings shared with the test
    from diffusion_ranks import PROMPTS, config, reward
    from miles.diffusion.models import tiny_flow_model
    from miles.diffusion.trainer import FlowGRPOTrainer
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), config(mode), reward, mesh=mesh)
    metrics = [trainer.step(PROMPTS) for _ in range(2)]
    score, images = trainer.evaluate(PROMPTS + ["a dark image"], seed=11)
    state = trainer.state_dict()
    with trainer.trained_transformer() as transformer:
        trained = {name: tensor.clone() for name, tensor in transformer.state_dict().items()}
    resumed = FlowGRPOTrainer(tiny_flow_model(seed=0), config(mode), reward, mesh=mesh)
    resumed.load_state_dict(torch.load(resume_state, weights_only=True))
    resumed_metrics = resumed.step(PROMPTS)
    resumed_state = resumed.state_dict()
    if rank == 0:
        torch.save(
            {
                "metrics": metrics,
                "eval": (score, torch.from_numpy(images)),
                "state": state,
                "trained": trained,
                "resumed_metrics": resumed_metrics,
                "resumed_state": resumed_state,
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6])
