"""P2P transport for RDMA transfer engines: the sender writes each bucket one-sidedly into receiver memory.

The receiver (``P2PEndpoint``) allocates and registers one buffer per bucket position when the sender first needs
it and returns its ``RemoteBuffer`` over the control connection; after that, each update is a one-sided write per
bucket plus a small ``BucketReady`` message, and the receiver's CPU never touches the payload. ``P2PEngine`` is the
seam; ``mooncake_engine`` and ``nixl_engine`` adapt Mooncake's TransferEngine and NVIDIA NIXL when installed and
raise ``ImportError`` naming the package otherwise.
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
    """A registered receiver buffer: ``session`` identifies the peer to the engine; ``address`` and ``nbytes`` the
    memory region (device or host)."""

    session: str
    address: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class AllocateSlot:
    slot: int
    nbytes: int


class P2PEngine(Protocol):
    """What a transfer engine must offer. Both sides create one; ``session`` is this side's address for peers."""

    session: str

    def register(self, buffer: Tensor) -> None:
        """Pin/register ``buffer`` for RDMA."""

    def write(self, local: Tensor, remote: RemoteBuffer) -> None:
        """Write contiguous ``local`` to the start of ``remote`` and return once it is visible there."""


def mooncake_engine(**kwargs) -> P2PEngine:
    """Build a P2PEngine on Mooncake's TransferEngine. Raises: ImportError if mooncake is not installed."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "the Mooncake P2P transport needs Mooncake's TransferEngine: pip install mooncake-transfer-engine"
        ) from err
    raise NotImplementedError("the Mooncake adapter is not written yet; implement P2PEngine.register/write on it")


def nixl_engine(**kwargs) -> P2PEngine:
    """Build a P2PEngine on NVIDIA NIXL. Raises: ImportError if nixl is not installed."""
    try:
        import nixl  # noqa: F401
    except ImportError as err:
        raise ImportError("the NIXL P2P transport needs NVIDIA NIXL: pip install nixl") from err
    raise NotImplementedError("the NIXL adapter is not written yet; implement P2PEngine.register/write on it")


class P2PTransport:
    """Sender side: stages each bucket in a local registered slot and writes it into the receiver's slot.

    Args:
        engine: this side's transfer engine.
        conn: control connection to the ``P2PEndpoint``.
        timeout_s: seconds to wait for the receiver's answers (slot allocation, commit).
        device: where local staging slots live (the trainer's GPU for GPUDirect RDMA).
    """

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
                self.conn.send(RemoteBuffer(self.engine.session, buffer.data_ptr(), message.nbytes))
                continue
            done = self._session.handle(
                message,
                payload=lambda ready: self.slots[ready.slot][: ready.meta.nbytes],
                send_ack=self.conn.send,
                peer="the P2P control connection",
            )
            if done is not None:
                return done
