"""torch.distributed transport: the sender broadcasts each bucket to every engine rank of a process group.

Works with gloo (CPU payloads) and NCCL (CUDA payloads). The sender is rank ``src`` of ``group``; every other rank
runs a ``DistributedEndpoint``. Per bucket there are two collectives: the metadata (``broadcast_object_list``) and the
payload (``broadcast`` into a receive buffer that persists across updates, one per bucket position). A commit ends
with ``all_gather_object`` of every rank's ``Ack``, so the sender learns which ranks failed and why.

This mirrors SGLang's ``/init_weights_update_group`` (master_address, master_port, rank_offset, world_size,
group_name, backend) + ``/update_weights_from_distributed`` (names, dtypes, shapes, group_name, flush_cache,
weight_version, load_format) pair: the group is created once, each update sends metadata then broadcasts payloads.
Timeouts are the process group's (``init_process_group(timeout=...)``).
"""

import logging
from datetime import timedelta

import torch
import torch.distributed as dist
from miles.sync.bucket import Bucket
from miles.sync.receiver import WeightReceiver
from miles.sync.transports.messages import (
    Abort,
    Ack,
    Begin,
    BucketReady,
    Close,
    Commit,
    UpdateSession,
    raise_on_errors,
    serve_until_closed,
)
from torch import Tensor

logger = logging.getLogger(__name__)


def init_weight_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join a process group of its own for weight transfer, beside any default group this process has.

    The trainer (rank 0) and the engine ranks (1 .. world_size - 1) each call this with the same address, port,
    world size and name; it returns when all have joined. This is SGLang's ``init_weights_update_group`` / vLLM's
    weight-transfer ``init_transfer_engine`` pattern (OpenRLHF's ``init_process_group``): a TCP rendezvous of its
    own, so the trainer's FSDP world and the engines' tensor-parallel worlds stay untouched. The group's ranks are
    its own (0 .. world_size - 1); use ``group.rank()`` / ``group.size()``, never ``dist.get_rank()``, which
    needs a default group this process may not have.

    Args:
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        master_address, master_port: where rank 0's TCP store listens (rank 0 creates it).
        world_size: trainer + engine ranks.
        rank: this process's rank in the group.
        group_name: unique per group in a process (a second group needs another name).
        timeout_s: how long joining and every collective may wait.
    Raises: RuntimeError / DistStoreError when the others do not join within ``timeout_s``.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    init_method = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # the group's ranks are its own
    return group


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank() if group is None else group.rank()


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size() if group is None else group.size()


def _payload_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_message(message: object, *, src: int, group: dist.ProcessGroup | None) -> object:
    box = [message]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class DistributedTransport:
    """Sender side: rank ``src`` of ``group`` broadcasts updates to all other ranks.

    Args:
        group: a process group containing the sender and every engine rank (None: the default group).
        src: the sender's rank (in ``group``; a group from ``init_weight_group`` numbers its own ranks).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, src: int = 0) -> None:
        if _group_rank(group) != src:
            raise ValueError(
                f"DistributedTransport is the sender, so it must run on rank src={src}, not rank "
                f"{_group_rank(group)}; engine ranks run DistributedEndpoint"
            )
        self.group = group
        self.src = src
        self.device = _payload_device(group)
        # gloo: a worker thread broadcasts bucket k while the sender packs k+1 (the collectives release the GIL).
        # NCCL: the pack is already asynchronous on the GPU, and a worker thread's current stream (which NCCL
        # waits on) would not be the stream the pack ran on.
        self.overlap_send = self.device.type == "cpu"
        self.slots: list[Tensor] = []
        self._next_slot = 0  # the slot the next send broadcasts
        self._next_alloc = 0  # the slot the next allocate returns (ahead of _next_slot while a send is in flight)

    def begin(self, version: int) -> None:
        self._next_slot = self._next_alloc = 0
        _broadcast_message(Begin(version), src=self.src, group=self.group)

    def allocate(self, nbytes: int, device: torch.device) -> Tensor:
        slot = self._next_alloc
        self._next_alloc += 1
        if slot == len(self.slots):
            self.slots.append(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        elif self.slots[slot].numel() < nbytes:
            self.slots[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.slots[slot][:nbytes]

    def send(self, bucket: Bucket) -> None:
        _broadcast_message(BucketReady(bucket.meta, self._next_slot), src=self.src, group=self.group)
        dist.broadcast(bucket.payload, src=self.src, group=self.group)
        self._next_slot += 1

    def commit(self, version: int, num_buckets: int) -> None:
        _broadcast_message(Commit(version, num_buckets), src=self.src, group=self.group)
        acks: list[Ack | None] = [None] * _group_size(self.group)
        dist.all_gather_object(acks, Ack(version, None), group=self.group)
        raise_on_errors([ack for rank, ack in enumerate(acks) if rank != _group_rank(self.group)], version)

    def abort(self, version: int, reason: str) -> None:
        _broadcast_message(Abort(version, reason), src=self.src, group=self.group)

    def close(self) -> None:
        """Stop every endpoint's ``serve`` loop."""
        _broadcast_message(Close(), src=self.src, group=self.group)
        self.slots.clear()


class DistributedEndpoint:
    """Engine-rank side: receives broadcasts from rank ``src`` into persistent buffers and feeds ``receiver``.

    Args:
        receiver: this rank's receiver; ``apply_fn`` gets views of the receive buffers, valid during the call.
        group: the same process group as the sender's.
        src: the sender's rank (in ``group``; a group from ``init_weight_group`` numbers its own ranks).
    """

    def __init__(self, receiver: WeightReceiver, group: dist.ProcessGroup | None = None, *, src: int = 0) -> None:
        self.receiver = receiver
        self.group = group
        self.src = src
        self.device = _payload_device(group)
        self.slots: dict[int, Tensor] = {}
        self._session = UpdateSession(receiver)

    def _receive_payload(self, slot: int, nbytes: int) -> Tensor:
        buffer = self.slots.get(slot)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self.slots[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        payload = buffer[:nbytes]
        dist.broadcast(payload, src=self.src, group=self.group)
        return payload

    def serve_update(self) -> bool:
        """Take part in collectives until one update is committed or aborted; False once the sender closed."""
        while True:
            message = _broadcast_message(None, src=self.src, group=self.group)
            done = self._session.handle(
                message,
                payload=lambda ready: self._receive_payload(ready.slot, ready.meta.nbytes),
                send_ack=lambda ack: dist.all_gather_object([None] * _group_size(self.group), ack, group=self.group),
                peer=f"rank {self.src}",
            )
            if done is False:
                self.slots.clear()
            if done is not None:
                return done

    def serve(self) -> None:
        """Serve updates until the sender closes the transport."""
        serve_until_closed(self)
