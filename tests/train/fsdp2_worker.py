"""Worker for the world-size-2 FSDP2 tests; run as a script:
python fsdp2_worker.py RANK WORLD INIT_FILE MODEL OUT [LAYOUT (padded|packed)]."""

import sys
import weakref

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
    pushed, alive = push_twice(backend, rank)
    state = backend.full_state_dict()  # one more collective: the ranks are still in step after the failed push
    if rank == 0:
        torch.save(
            {"logits": logits, "grads": grads, "metrics": metrics, "pushed": pushed, "alive": alive, "state": state},
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


class RecordingSink:
    """Rank 0's sink: copies what it receives and counts, at each tensor, how many received before it are still
    alive (weak references); with ``fail_after`` it raises part-way, as a server dying mid-push would."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.received: dict[str, torch.Tensor] = {}
        self.alive: list[int] = []

    def push(self, named_tensors, *, version=None):
        refs = []
        for name, tensor in named_tensors:
            self.alive.append(sum(ref() is not None for ref in refs))
            refs.append(weakref.ref(tensor))
            self.received[name] = tensor.clone()
            del tensor
            if self.fail_after is not None and len(self.received) == self.fail_after:
                raise RuntimeError("server died mid-push")
        return version


def push_twice(backend, rank: int) -> tuple[dict, list[int]]:
    """A full push, then one whose sink fails after 2 tensors (rank 0 must see the error, no rank may hang)."""
    sink = RecordingSink() if rank == 0 else None
    backend.weight_sink = sink
    backend.push_weights(1)
    backend.weight_sink = RecordingSink(fail_after=2) if rank == 0 else None
    try:
        backend.push_weights(2)
        assert rank != 0, "rank 0's failing sink did not fail the push"
    except RuntimeError as err:
        assert rank == 0 and "mid-push" in str(err), err
    return (sink.received, sink.alive) if sink is not None else ({}, [])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
