"""Shared-memory transport for a colocated receiver in another process on the same machine.

The sender packs each bucket straight into a shared-memory slot; the receiver maps the same pages and decodes views
of them, so an identity update costs one copy (model -> shared memory) plus what ``apply_fn`` copies. Slots persist
across updates: slot i holds bucket i of every update and is reallocated only when a bucket outgrows it, so after the
first update no memory is allocated or faulted in. Control messages travel over a ``multiprocessing`` connection;
``torch.multiprocessing`` passes each slot's file descriptor once.

Usage::

    sender_conn, receiver_conn = torch.multiprocessing.Pipe()
    # engine process:  SharedMemoryEndpoint(WeightReceiver(apply_fn=load), receiver_conn).serve()
    # trainer process: WeightSender(SharedMemoryTransport(sender_conn)).push(model.state_dict().items())
"""

import logging
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing  # noqa: F401  (registers the reductions that share tensor storage over a connection)
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


class SharedMemoryTransport:
    """Sender side. Holds the persistent shared-memory slots.

    Args:
        conn: this side of a ``multiprocessing`` duplex connection; the other end goes to ``SharedMemoryEndpoint``.
        timeout_s: seconds to wait for the receiver's acknowledgement of a commit (decode + ``apply_fn``).
    """

    # allocate and send count slots separately, so a worker thread could send; but send only pickles a control
    # message (the receiver decodes in its own process meanwhile anyway), which gains nothing on a thread
    overlap_send = False

    def __init__(self, conn: Connection, *, timeout_s: float = 300.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s is {timeout_s}; it must be > 0 seconds (300 suits large models)")
        self.conn = conn
        self.timeout_s = timeout_s
        self.slots: list[Tensor] = []
        self._next_slot = 0  # the slot the next send announces
        self._next_alloc = 0  # the slot the next allocate returns (ahead of _next_slot while a send is in flight)
        self._new_slots: set[int] = set()

    def begin(self, version: int) -> None:
        self._next_slot = self._next_alloc = 0
        self.conn.send(Begin(version))

    def _new_buffer(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()

    def allocate(self, nbytes: int, device: torch.device) -> Tensor:
        slot = self._next_alloc
        self._next_alloc += 1
        if slot == len(self.slots) or self.slots[slot].numel() < nbytes:
            buffer = self._new_buffer(nbytes)
            if slot == len(self.slots):
                self.slots.append(buffer)
            else:
                self.slots[slot] = buffer
            self._new_slots.add(slot)
            logger.debug("shared-memory slot %d: %.1f MiB", slot, nbytes / 2**20)
        return self.slots[slot][:nbytes]

    def send(self, bucket: Bucket) -> None:
        slot = self._next_slot
        new_buffer = self.slots[slot] if slot in self._new_slots else None
        self._new_slots.discard(slot)
        self.conn.send(BucketReady(bucket.meta, slot, new_buffer))
        self._next_slot += 1

    def commit(self, version: int, num_buckets: int) -> None:
        self.conn.send(Commit(version, num_buckets))
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(
                f"the shared-memory receiver did not acknowledge update v{version} within {self.timeout_s}s; "
                "is its endpoint serving? Raise timeout_s if apply_fn is slow"
            )
        try:
            ack: Ack = self.conn.recv()
        except EOFError as err:
            raise ConnectionError(f"the shared-memory receiver closed the connection during update v{version}") from err
        raise_on_errors([ack], version)

    def abort(self, version: int, reason: str) -> None:
        try:
            self.conn.send(Abort(version, reason))
        except (OSError, ValueError):
            logger.warning("could not tell the receiver to abort update v%d: connection closed", version)

    def close(self) -> None:
        """Stop the receiver's ``serve`` loop and release the slots."""
        self.conn.send(Close())
        self.slots.clear()


class SharedMemoryEndpoint:
    """Receiver side: turns messages and shared-memory slots into ``WeightReceiver`` calls.

    Args:
        receiver: the engine's receiver; its ``apply_fn`` gets views of the shared slots, valid during the call.
        conn: the other end of the sender's connection.
    """

    def __init__(self, receiver: WeightReceiver, conn: Connection) -> None:
        self.receiver = receiver
        self.conn = conn
        self.slots: dict[int, Tensor] = {}
        self._session = UpdateSession(receiver)

    def serve_update(self) -> bool:
        """Handle messages until one update is committed or aborted.

        Returns:
            False when the sender closed the transport (or the connection), True otherwise.
        """
        while True:
            try:
                message = self.conn.recv()
            except EOFError:
                return False
            if isinstance(message, BucketReady) and message.buffer is not None:
                self.slots[message.slot] = message.buffer  # first use of this slot: its storage arrives once
            done = self._session.handle(
                message,
                payload=lambda ready: self.slots[ready.slot][: ready.meta.nbytes],
                send_ack=self.conn.send,
                peer="the shared-memory connection",
            )
            if done is False:
                self.slots.clear()
            if done is not None:
                return done

    def serve(self) -> None:
        """Serve updates until the sender closes the transport."""
        serve_until_closed(self)
