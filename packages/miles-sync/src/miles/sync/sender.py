"""WeightSender: versioned, bucketed push of named tensors through a codec and a transport."""

import logging
import re
import time
from collections.abc import Iterable, Iterator

from miles.sync.bucket import EncodedTensor, group_into_buckets, pack, packed_nbytes
from miles.sync.codecs import get_codec, is_codec_eligible
from miles.sync.errors import WeightUpdateError
from miles.sync.transports import Transport
from torch import Tensor

logger = logging.getLogger(__name__)

DEFAULT_CODEC_EXCLUDE = (r"norm", r"embed", r"lm_head", r"\.bias$", r"router", r"\.gate\.weight$")
"""Name patterns kept exact under a lossy codec: norms, embeddings, the LM head, biases and MoE routers are small and
sensitive to quantization (the usual choice of FP8 RL recipes, e.g. slime's and DeepSeek-V3's)."""


class WeightSender:
    """Pushes a model's named tensors to receivers as one versioned update.

    Args:
        transport: where buckets go (``InProcessTransport``, ``SharedMemoryTransport``, ...).
        bucket_bytes: target payload bytes per bucket; larger buckets mean fewer, bigger transfers but more staging
            memory (one bucket per source dtype is held at a time). 512 MiB is a good default for NCCL and shared
            memory; a tensor larger than this travels alone.
        codec: codec name for floating-point tensors (see ``miles.sync.codecs.CODECS``); "identity" is exact.
        codec_exclude: regular expressions; a tensor whose name matches any (``re.search``) is sent with the
            identity codec. Ignored when ``codec`` is "identity".
        retries: how many times a failed update (``WeightUpdateError``, ``TimeoutError``, ``ConnectionError``) is
            sent again from the start; needs a re-iterable ``named_tensors`` (a list or ``dict.items()``).

    Raises:
        ValueError: on a non-positive ``bucket_bytes``, a negative ``retries`` or an unknown codec.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        bucket_bytes: int = 512 * 2**20,
        codec: str = "identity",
        codec_exclude: Iterable[str] = DEFAULT_CODEC_EXCLUDE,
        retries: int = 0,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes is {bucket_bytes}; it must be > 0 (512 * 2**20 is a good default)")
        if retries < 0:
            raise ValueError(f"retries is {retries}; it must be >= 0 (0 sends each update once)")
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.codec = get_codec(codec)
        self.codec_exclude = tuple(re.compile(pattern) for pattern in codec_exclude)
        self.retries = retries
        self.version = 0

    def _encode(self, named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[EncodedTensor]:
        for name, tensor in named_tensors:
            tensor = tensor.detach()
            use_codec = (
                self.codec.name != "identity"
                and is_codec_eligible(tensor)
                and not any(pattern.search(name) for pattern in self.codec_exclude)
            )
            codec = self.codec if use_codec else get_codec("identity")
            yield EncodedTensor(name, tuple(tensor.shape), tensor.dtype, codec.name, codec.encode(tensor))

    def _push_once(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> tuple[int, int]:
        self.transport.begin(version)
        num_buckets, nbytes = 0, 0
        try:
            for entries in group_into_buckets(self._encode(named_tensors), bucket_bytes=self.bucket_bytes):
                size = packed_nbytes(entries)
                out = self.transport.allocate(size, entries[0].parts[0].device)
                self.transport.send(pack(entries, out, version=version, index=num_buckets))
                num_buckets += 1
                nbytes += size
        except BaseException as err:
            self.transport.abort(version, f"sender failed after {num_buckets} buckets: {err!r}")
            raise
        # A failed commit needs no abort: receivers drop the update when they reject it.
        self.transport.commit(version, num_buckets)
        return num_buckets, nbytes

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int:
        """Send one complete update and return its version once every receiver applied it.

        Args:
            named_tensors: ``(name, tensor)`` pairs, e.g. ``model.state_dict().items()``; any dtype, shape and device.
                Tensors are read during the call only.
            version: the update's version, for a caller that owns the counter (a ``WeightPublisher``, a resumed
                run); it must exceed ``self.version``. Default ``self.version + 1``.

        Returns:
            The new weight version: 1 for the first push, then 2, 3, ...

        Raises:
            WeightUpdateError: if a receiver rejected the update (the message names the bucket and why); the
                receivers keep the previous version and ``self.version`` does not advance.
            TimeoutError: if a remote receiver did not answer within the transport's timeout.
            ValueError: if ``version`` is not greater than ``self.version``.
        """
        if version is None:
            version = self.version + 1
        elif version <= self.version:
            raise ValueError(f"push version {version} is not newer than this sender's v{self.version}")
        attempts = self.retries + 1
        if attempts > 1 and iter(named_tensors) is named_tensors:
            logger.warning("retries=%d ignored: named_tensors is a one-shot iterator; pass a list", self.retries)
            attempts = 1
        start = time.perf_counter()
        for attempt in range(attempts):
            try:
                num_buckets, nbytes = self._push_once(named_tensors, version)
                break
            except (WeightUpdateError, TimeoutError, ConnectionError) as err:
                if attempt + 1 == attempts:
                    raise
                logger.warning(
                    "update v%d failed (attempt %d of %d), retrying: %s", version, attempt + 1, attempts, err
                )
        self.version = version
        logger.debug(  # per step: the run log file has it, the console does not
            "pushed weights v%d in %.3fs (%s, %d buckets, %.1f MiB)",
            version,
            time.perf_counter() - start,
            self.codec.name,
            num_buckets,
            nbytes / 2**20,
        )
        return version
