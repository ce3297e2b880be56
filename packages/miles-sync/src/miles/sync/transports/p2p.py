"""P2P transport for RDMA transfer engines: the sender writes each bucket one-sidedly into receiver memory.

The receiver (``P2PEndpoint``) allocates and registers one buffer per bucket position when the sender first needs
it and returns its ``RemoteBuffer`` over the control connection; after that, each update is a one-sided write per
bucket plus a small ``BucketReady`` message, and the receiver's CPU never touches the payload. ``P2PEngine`` is the
seam; ``mooncake_engine`` and ``nixl_engine`` build the adapters in ``p2p_engines`` (Mooncake's TransferEngine,
NVIDIA NIXL; each write with a timeout and bounded retry) and raise ``ImportError`` naming the package to install
when it is missing.
"""

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

import torch
from miles.sync.bucket import Bucket
from miles.sync.receiver import WeightReceiver
from miles.sync.transports.messages import Abort, Ack, Begin, BucketReady, Close, Commit, UpdateSession, raise_on_errors
from torch import Tensor


@dataclass(frozen=True, slots=True)
class RemoteBuffer:
    """A registered receiver buffer.

    Attributes:
        session: the peer's name for its engine (Mooncake ``"host:rpc_port"``, a NIXL agent name).
        address: start of the region (device or host pointer), ``nbytes`` its size in bytes.
        device: where the region lives (``"cpu"``, ``"cuda:3"``); NIXL needs its memory type and GPU index.
        metadata: what the writer must load to reach the region (NIXL agent metadata, current as of this buffer's
            registration); empty for engines that need nothing (Mooncake finds peers by ``session``).
    """

    session: str
    address: int
    nbytes: int
    device: str = "cpu"
    metadata: bytes = b""


@dataclass(frozen=True, slots=True)
class AllocateSlot:
    slot: int
    nbytes: int


class P2PEngine(Protocol):
    """What a transfer engine must offer. Both sides create one; ``session`` is this side's address for peers.

    An engine may also have a ``metadata: bytes`` attribute (NIXL): ``P2PEndpoint`` reads it after each
    ``register`` and sends it in the ``RemoteBuffer``, so the writer can load it before writing there.
    """

    session: str

    def register(self, buffer: Tensor) -> None:
        """Pin/register ``buffer`` for RDMA."""

    def write(self, local: Tensor, remote: RemoteBuffer) -> None:
        """Write contiguous ``local`` to the start of ``remote`` and return once it is visible there."""


def mooncake_engine(**kwargs) -> P2PEngine:
    """Build a ``MooncakeEngine`` (``miles.sync.transports.p2p_engines``; ``kwargs`` go to it: hostname,
    metadata_server, protocol, device_name, timeout_s, retries). Raises: ImportError if mooncake is not installed."""
    from miles.sync.transports.p2p_engines import MooncakeEngine

    return MooncakeEngine(**kwargs)


def nixl_engine(**kwargs) -> P2PEngine:
    """Build a ``NixlEngine`` (``miles.sync.transports.p2p_engines``; ``kwargs`` go to it: name, backends,
    timeout_s, retries). Raises: ImportError if nixl is not installed."""
    from miles.sync.transports.p2p_engines import NixlEngine

    return NixlEngine(**kwargs)


class P2PTransport:
    """Sender side: stages each bucket in a local registered slot and writes it into the receiver's slot.

    Args:
        engine: this side's transfer engine.
        conn: control connection to the ``P2PEndpoint``.
        timeout_s: seconds to wait for the receiver's answers (slot allocation, commit).
        device: where local staging slots live (the trainer's GPU for GPUDirect RDMA).
    """

    overlap_send = False  # allocate asks the receiver for a slot on the connection send writes to

    def __init__(self, engine: P2PEngine, conn: Connection, *, timeout_s: float = 300.0, device="cpu") -> None:
        self.engine, self.conn, self.timeout_s, self.device = engine, conn, timeout_s, torch.device(device)
        self.slots: list[Tensor] = []
        self.remote: list[RemoteBuffer] = []
        self._next_slot = 0

    def _answer(self, what: str):
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"the P2P receiver did not answer {what} within {self.timeout_s}s")
        return self.conn.recv()

    def begin(self, version: int) -> None:
        self._next_slot = 0
        self.conn.send(Begin(version))

    def allocate(self, nbytes: int, device: torch.device) -> Tensor:
        slot = self._next_slot
        if slot == len(self.slots) or self.slots[slot].numel() < nbytes:
            self.conn.send(AllocateSlot(slot, nbytes))
            remote = self._answer(f"the allocation of slot {slot} ({nbytes} bytes)")
            local = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.engine.register(local)
            if slot == len(self.slots):
                self.slots.append(local)
                self.remote.append(remote)
            else:
                self.slots[slot], self.remote[slot] = local, remote
        return self.slots[slot][:nbytes]

    def send(self, bucket: Bucket) -> None:
        self.engine.write(bucket.payload, self.remote[self._next_slot])
        self.conn.send(BucketReady(bucket.meta, self._next_slot))
        self._next_slot += 1

    def commit(self, version: int, num_buckets: int) -> None:
        self.conn.send(Commit(version, num_buckets))
        ack: Ack = self._answer(f"the commit of update v{version}")
        raise_on_errors([ack], version)

    def abort(self, version: int, reason: str) -> None:
        self.conn.send(Abort(version, reason))

    def close(self) -> None:
        self.conn.send(Close())


class P2PEndpoint:
    """Receiver side: allocates and registers slots on request, and feeds written buckets to ``receiver``.

    Args:
        receiver: the engine's receiver; ``apply_fn`` gets views of the slots, valid during the call.
        engine: this side's transfer engine.
        conn: control connection from the ``P2PTransport``.
        device: where slots live (the engine's GPU for GPUDirect RDMA).
    """

    def __init__(self, receiver: WeightReceiver, engine: P2PEngine, conn: Connection, *, device="cpu") -> None:
        self.engine, self.conn, self.device = engine, conn, torch.device(device)
        self.slots: dict[int, Tensor] = {}
        self._session = UpdateSession(receiver)

    def serve_update(self) -> bool:
        """Handle messages until one update is committed or aborted; False once the sender closed."""
        while True:
            try:
                message = self.conn.recv()
            except EOFError:
                return False
            if isinstance(message, AllocateSlot):
                buffer = self.slots[message.slot] = torch.empty(message.nbytes, dtype=torch.uint8, device=self.device)
                self.engine.register(buffer)
                metadata = getattr(self.engine, "metadata", b"")  # read after register: it lists the new buffer
                remote = RemoteBuffer(
                    self.engine.session, buffer.data_ptr(), message.nbytes, str(buffer.device), metadata
                )
                self.conn.send(remote)
                continue
            done = self._session.handle(
                message,
                payload=lambda ready: self.slots[ready.slot][: ready.meta.nbytes],
                send_ack=self.conn.send,
                peer="the P2P control connection",
            )
            if done is not None:
                return done
