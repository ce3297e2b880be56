"""In-process transport: buckets are handed to a WeightReceiver in the same Python process (no copy beyond packing)."""

import torch
from miles.sync.bucket import Bucket
from miles.sync.receiver import WeightReceiver
from torch import Tensor


class InProcessTransport:
    """Calls the receiver's methods directly; payloads are fresh buffers on the tensors' device.

    Args:
        receiver: the engine-side receiver living in this process.
    """

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver

    def begin(self, version: int) -> None:
        self.receiver.begin_update(version)

    def allocate(self, nbytes: int, device: torch.device) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def send(self, bucket: Bucket) -> None:
        self.receiver.receive_bucket(bucket)

    def commit(self, version: int, num_buckets: int) -> None:
        self.receiver.commit_update(version, num_buckets)

    def abort(self, version: int, reason: str) -> None:
        self.receiver.abort_update(version, reason)
