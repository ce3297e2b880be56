"""In-process transport: buckets are handed to a WeightReceiver in the same Python process (no copy beyond packing).

Host buckets are packed into slots that persist across updates (slot i holds bucket i of every update, reallocated
only when a bucket outgrows it): a fresh 256 MiB host buffer costs a page fault per 4 KiB on
first touch, 5-20x the copy itself here. CUDA buckets are allocated per update: the caching allocator already recycles
those blocks, and between updates the trainer can use the memory.
"""

import torch
from miles.sync.bucket import Bucket
from miles.sync.receiver import WeightReceiver
from torch import Tensor


class InProcessTransport:
    """Calls the receiver's methods directly; host payloads are reused slots, CUDA payloads fresh buffers.

    The receiver's ``apply_fn`` gets views of the slots, valid during the call (as with the other transports).

    Args:
        receiver: the engine-side receiver living in this process.

    Attributes:
        slots: the persistent host buffers ([capacity] uint8 each), one per host bucket position.
    """

    # send is the receiver's decode: Python holding the GIL, so on a worker thread it only trades GIL hand-offs with
    # the packing (measured 1.46x vs 1.33x memcpy with 64 MiB buckets, benchmarks/sync/bench_push.py)
    overlap_send = False

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver
        self.slots: list[Tensor] = []
        self._next_slot = 0

    def begin(self, version: int) -> None:
        self._next_slot = 0
        self.receiver.begin_update(version)

    def allocate(self, nbytes: int, device: torch.device) -> Tensor:
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        slot = self._next_slot
        self._next_slot += 1
        if slot == len(self.slots):
            self.slots.append(torch.empty(nbytes, dtype=torch.uint8))
        elif self.slots[slot].numel() < nbytes:
            self.slots[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return self.slots[slot][:nbytes]

    def send(self, bucket: Bucket) -> None:
        self.receiver.receive_bucket(bucket)

    def commit(self, version: int, num_buckets: int) -> None:
        self.receiver.commit_update(version, num_buckets)
        del self.slots[self._next_slot :]  # an update with fewer host buckets than before frees the rest

    def abort(self, version: int, reason: str) -> None:
        self.receiver.abort_update(version, reason)

    def close(self) -> None:
        """Release the slots (the next update allocates them again)."""
        self.slots.clear()
