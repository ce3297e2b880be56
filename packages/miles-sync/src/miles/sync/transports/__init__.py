"""Transports move buckets from a WeightSender to one or more WeightReceivers.

Every transport implements the sender-side ``Transport`` protocol; the receiving side is a small endpoint that feeds
a ``WeightReceiver``. Transports that need optional packages or CUDA import them lazily, so importing this package
works on any machine.
"""

from typing import Protocol

import torch
from miles.sync.bucket import Bucket
from torch import Tensor


class Transport(Protocol):
    """Sender side of a transport. Calls per update: begin, (allocate, send) per bucket, then commit or abort.

    Attributes:
        overlap_send: True when ``send`` of bucket k may run on a worker thread while the sender calls ``allocate``
            for bucket k+1 and packs it (``WeightSender(overlap_send=True)``): ``allocate`` must count buckets
            itself, not rely on ``send`` having run, and bucket k's buffer must stay untouched until its ``send``
            returned. Sends never overlap each other, and begin / commit / abort run only when no send is in
            flight. A transport without the attribute is driven serially.
    """

    overlap_send: bool

    def begin(self, version: int) -> None:
        """Announce update ``version`` to the receivers."""

    def allocate(self, nbytes: int, device: torch.device) -> Tensor:
        """Return a [nbytes] uint8 buffer the sender packs the next bucket into.

        ``device`` is where the bucket's tensors live; a transport may choose another (e.g. shared memory on CPU).
        """

    def send(self, bucket: Bucket) -> None:
        """Deliver one bucket (its payload is a buffer from ``allocate``)."""

    def commit(self, version: int, num_buckets: int) -> None:
        """Finish the update; returns once every receiver applied it, else raises ``WeightUpdateError``."""

    def abort(self, version: int, reason: str) -> None:
        """Tell receivers to drop the partial update ``version``; never raises."""


__all__ = ["Transport"]
