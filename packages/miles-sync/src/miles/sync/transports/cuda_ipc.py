"""CUDA IPC transport: a colocated engine process on the same GPU maps the sender's CUDA buckets, no host copy.

Same protocol and slot reuse as the shared-memory transport, with slots on the sender's GPU: ``torch.multiprocessing``
sends each slot's CUDA IPC handle once, and the receiver (``CudaIpcEndpoint``, the shared-memory endpoint) decodes
views of the mapped memory. The sender synchronizes its stream before announcing a bucket, because the receiver's
stream has no ordering with the sender's. Both processes must be started with ``spawn``. Import is safe without CUDA;
constructing the transport without a GPU raises ``RuntimeError``.
"""

import torch
from miles.sync.bucket import Bucket
from miles.sync.transports.shared_memory import SharedMemoryEndpoint, SharedMemoryTransport
from torch import Tensor

CudaIpcEndpoint = SharedMemoryEndpoint


class CudaIpcTransport(SharedMemoryTransport):
    """Sender side; slots live on ``device``.

    Args:
        conn: this side of a ``torch.multiprocessing`` duplex connection.
        device: the sender's GPU, e.g. ``"cuda:0"``.
        timeout_s: seconds to wait for the receiver's acknowledgement of a commit.

    Raises:
        RuntimeError: if CUDA is not available.
    """

    overlap_send = False  # send synchronizes the calling thread's stream, which must be the one that packed

    def __init__(self, conn, *, device: torch.device | str = "cuda", timeout_s: float = 300.0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaIpcTransport needs a CUDA GPU shared by the trainer and the engine, but torch.cuda.is_available() "
                "is False; use SharedMemoryTransport for a CPU engine"
            )
        super().__init__(conn, timeout_s=timeout_s)
        self.device = torch.device(device)

    def _new_buffer(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def send(self, bucket: Bucket) -> None:
        torch.cuda.current_stream(self.device).synchronize()  # the receiver reads on another stream and process
        super().send(bucket)
