"""Process entry points for the multi-process tests (a plain module: spawned children import it by name)."""

import datetime

import torch
import torch.distributed as dist
from miles.sync import WeightReceiver, WeightSender
from miles.sync.transports.distributed import DistributedEndpoint, DistributedTransport
from miles.sync.transports.shared_memory import SharedMemoryEndpoint


def small_state(step: int, *, wide: bool = False) -> dict[str, torch.Tensor]:
    """Deterministic tensors of three dtypes; ``wide`` makes one tensor larger to force a bigger slot."""
    generator = torch.Generator().manual_seed(step)
    return {
        "q_proj.weight": torch.randn(8, 64 if wide else 16, generator=generator),
        "norm.weight": torch.randn(16, generator=generator).to(torch.bfloat16),
        "steps": torch.tensor([step], dtype=torch.int64),
    }


def shared_memory_engine(conn, results) -> None:
    """Serve updates; report each applied update's tensors (cloned) on ``results``; reject a tensor named "bogus"."""

    def load(named_tensors):
        if any(name == "bogus" for name, _ in named_tensors):
            raise KeyError("engine has no parameter 'bogus'")
        results.put({name: tensor.clone() for name, tensor in named_tensors})

    receiver = WeightReceiver(apply_fn=load)
    SharedMemoryEndpoint(receiver, conn).serve()
    results.put(("closed", receiver.weight_version))


def gloo_rank(rank: int, world_size: int, init_file: str, results) -> None:
    """Rank 0 pushes two updates over gloo; the other ranks serve and report what they applied."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        if rank == 0:
            transport = DistributedTransport(src=0)
            sender = WeightSender(transport, bucket_bytes=256)
            versions = [sender.push(small_state(1).items()), sender.push(small_state(2, wide=True).items())]
            transport.close()
            results.put(("sender", versions))
        else:
            received = []

            def load(named_tensors):
                received.append({name: tensor.clone() for name, tensor in named_tensors})

            receiver = WeightReceiver(apply_fn=load)
            DistributedEndpoint(receiver, src=0).serve()
            expected = [small_state(1), small_state(2, wide=True)]
            exact = [
                update.keys() == want.keys()
                and all(update[n].dtype == want[n].dtype and torch.equal(update[n], want[n]) for n in want)
                for update, want in zip(received, expected, strict=True)
            ]
            results.put((f"engine{rank}", receiver.weight_version, exact))  # bools: tensors would die with the child
    finally:
        dist.destroy_process_group()
