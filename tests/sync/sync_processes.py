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
    """Rank 0 pushes three updates over gloo (overlapped, overlapped, serial); the others serve and report them."""
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
            sender.overlap_send = False  # the serial path delivers the same bytes as the overlapped default
            versions.append(sender.push(small_state(3).items()))
            transport.close()
            results.put(("sender", versions))
        else:
            received = []

            def load(named_tensors):
                received.append({name: tensor.clone() for name, tensor in named_tensors})

            receiver = WeightReceiver(apply_fn=load)
            DistributedEndpoint(receiver, src=0).serve()
            expected = [small_state(1), small_state(2, wide=True), small_state(3)]
            exact = [
                update.keys() == want.keys()
                and all(update[n].dtype == want[n].dtype and torch.equal(update[n], want[n]) for n in want)
                for update, want in zip(received, expected, strict=True)
            ]
            results.put((f"engine{rank}", receiver.weight_version, exact))  # bools: tensors would die with the child
    finally:
        dist.destroy_process_group()


def weight_group_rank(rank: int, world_size: int, port: int, init_file: str, results) -> None:
    """Like ``gloo_rank`` over a group from ``init_weight_group``: the sender also has a default group of its own
    (a trainer's FSDP world), the engine ranks have none (a server process)."""
    from miles.sync.transports.distributed import init_weight_group

    if rank == 0:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    group = init_weight_group(
        backend="gloo",
        master_address="127.0.0.1",
        master_port=port,
        world_size=world_size,
        rank=rank,
        group_name="miles_weights_test",
        timeout_s=60,
    )
    if rank == 0:
        transport = DistributedTransport(group, src=0)
        sender = WeightSender(transport, bucket_bytes=256)
        versions = [sender.push(small_state(1).items()), sender.push(small_state(2, wide=True).items())]
        transport.close()
        results.put(("sender", versions, dist.get_world_size()))
        dist.destroy_process_group()
        return
    received = []
    receiver = WeightReceiver(apply_fn=lambda named: received.append({n: t.clone() for n, t in named}))
    DistributedEndpoint(receiver, group, src=0).serve()
    expected = [small_state(1), small_state(2, wide=True)]
    exact = [
        update.keys() == want.keys() and all(torch.equal(update[n], want[n]) for n in want)
        for update, want in zip(received, expected, strict=True)
    ]
    results.put((f"engine{rank}", receiver.weight_version, exact, dist.is_initialized()))


def tensor_digests(named_tensors) -> dict[str, int]:
    """Tensor name -> xxh3-64 of its bytes (dtype and values, bit for bit)."""
    from miles.sync.delta import checksum

    return {name: checksum(t.detach().contiguous().view(-1).view(torch.uint8)) for name, t in named_tensors}


def shared_memory_model_engine(name: str, conn, results) -> None:
    """An engine process with a model of its own (starts empty): copies each update into it; after each applied
    update reports ``(name, weight_version, tensor_digests(model))``, at close ``("closed", name, weight_version)``."""
    model: dict[str, torch.Tensor] = {}

    def load(named_tensors):
        for tensor_name, tensor in named_tensors:
            if tensor_name not in model:
                model[tensor_name] = torch.empty_like(tensor)
            model[tensor_name].copy_(tensor)

    receiver = WeightReceiver(apply_fn=load)
    endpoint = SharedMemoryEndpoint(receiver, conn)
    applied = receiver.weight_version
    while endpoint.serve_update():
        if receiver.weight_version != applied:  # a rejected or aborted update ends without a report
            applied = receiver.weight_version
            results.put((name, applied, tensor_digests(model.items())))
    results.put(("closed", name, receiver.weight_version))
