"""Control messages shared by the cross-process transports, and the endpoint logic that feeds a WeightReceiver.

Sender -> receiver: ``Begin``, ``BucketReady`` (one per bucket), then ``Commit`` or ``Abort``; ``Close`` ends the
endpoint. Receiver -> sender: one ``Ack`` per ``Commit``. Receivers report a rejected bucket at commit time, so a
bucket costs no round trip.
"""

from collections.abc import Callable
from dataclasses import dataclass

from miles.sync.bucket import Bucket, BucketMeta
from miles.sync.errors import WeightUpdateError
from miles.sync.receiver import WeightReceiver
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Begin:
    version: int


@dataclass(frozen=True, slots=True)
class BucketReady:
    """``meta`` describes the payload; ``slot`` names the transport buffer it lives in; ``buffer`` is sent once per
    new or regrown slot (a shared-memory tensor or CUDA IPC handle), None when the receiver already holds it."""

    meta: BucketMeta
    slot: int
    buffer: object = None


@dataclass(frozen=True, slots=True)
class Commit:
    version: int
    num_buckets: int


@dataclass(frozen=True, slots=True)
class Abort:
    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Close:
    pass


@dataclass(frozen=True, slots=True)
class Ack:
    """Answer to ``Commit``: ``error`` is None when the update was applied, else why it was not."""

    version: int
    error: str | None


class UpdateSession:
    """Feeds one update's messages into a ``WeightReceiver`` and turns failures into an ``Ack``.

    A rejected bucket is remembered and the following buckets of that update are skipped, so the sender learns the
    first reason at commit.
    """

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver
        self.error: str | None = None

    def begin(self, version: int) -> None:
        self.error = None
        try:
            self.receiver.begin_update(version)
        except WeightUpdateError as err:
            self.error = str(err)

    def bucket(self, meta: BucketMeta, payload: Tensor) -> None:
        if self.error is not None:
            return
        try:
            self.receiver.receive_bucket(Bucket(meta, payload))
        except WeightUpdateError as err:
            self.error = str(err)

    def commit(self, version: int, num_buckets: int) -> Ack:
        if self.error is None:
            try:
                self.receiver.commit_update(version, num_buckets)
            except WeightUpdateError as err:
                self.error = str(err)
        return Ack(version, self.error)

    def abort(self, version: int, reason: str) -> None:
        self.receiver.abort_update(version, reason)

    def handle(
        self, message: object, *, payload: Callable[[BucketReady], Tensor], send_ack: Callable[[Ack], None], peer: str
    ) -> bool | None:
        """Apply one control message: None = keep reading, True = an update ended (committed or aborted),
        False = the sender closed the transport.

        Args:
            payload: returns the bucket's bytes for a ``BucketReady`` (transport-specific: a slot view, a broadcast).
            send_ack: delivers the ``Ack`` of a ``Commit`` to the sender.
            peer: names the sender in the error for an unknown message.
        Raises: TypeError for a message this protocol does not know.
        """
        match message:
            case Begin(version):
                self.begin(version)
            case BucketReady(meta, _, _):
                self.bucket(meta, payload(message))
            case Commit(version, num_buckets):
                send_ack(self.commit(version, num_buckets))
                return True
            case Abort(version, reason):
                self.abort(version, reason)
                return True
            case Close():
                return False
            case _:
                raise TypeError(f"unexpected message {message!r} from {peer}")
        return None


def serve_until_closed(endpoint) -> None:
    """Run ``endpoint.serve_update()`` until the sender closes the transport."""
    while endpoint.serve_update():
        pass


def raise_on_errors(acks: list[Ack], version: int) -> None:
    """Raise ``WeightUpdateError`` listing every receiver that did not apply ``version``."""
    failures = [f"receiver {rank}: {ack.error}" for rank, ack in enumerate(acks) if ack.error is not None]
    if failures:
        raise WeightUpdateError(f"update v{version} failed on {len(failures)} receiver(s): " + "; ".join(failures))
