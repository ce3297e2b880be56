"""WeightSender: versioned, bucketed push of named tensors through a codec and a transport."""

import logging
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch
from miles.sync.bucket import Bucket, EncodedTensor, group_into_buckets, pack, packed_nbytes
from miles.sync.codecs import Codec, get_codec, is_codec_eligible
from miles.sync.delta import NEEDS_FULL_UPDATE
from miles.sync.errors import WeightUpdateError
from miles.sync.transports import Transport
from miles.sync.versions import next_version
from torch import Tensor

logger = logging.getLogger(__name__)

DEFAULT_CODEC_EXCLUDE = (
    r"norm", r"embed", r"lm_head", r"\.bias$", r"router", r"\.gate\.weight$", r"\.gate\.e_score_correction_bias$",
)  # fmt: skip
"""Name patterns kept exact under a lossy codec: norms, embeddings, the LM head, biases and MoE routers (HF's
``mlp.gate``: its weight and DeepSeek-V3's score-correction bias) are small and sensitive to quantization (the usual
choice of FP8 RL recipes, e.g. slime's and DeepSeek-V3's)."""


def uses_codec(name: str, tensor: Tensor, codec: str | Codec, codec_exclude: Iterable[re.Pattern | str] = ()) -> bool:
    """Whether ``WeightSender`` encodes tensor ``name`` with ``codec`` (else it travels exactly): the codec is lossy
    (not identity), the tensor is codec-eligible and its name matches none of ``codec_exclude`` (``re.search``).
    The one rule both sides of a quantized rollout use: the sender, an engine quantizing its initial weights and
    the trainer's fake quantization (QAT)."""
    codec_name = codec if isinstance(codec, str) else codec.name
    return (
        codec_name != "identity"
        and is_codec_eligible(tensor)
        and not any(re.search(pattern, name) for pattern in codec_exclude)
    )


def encode_tensors(
    named_tensors: Iterable[tuple[str, Tensor]], codec: Codec, codec_exclude: Iterable[re.Pattern] = ()
) -> Iterator[EncodedTensor]:
    """Encode each tensor with ``codec``, or exactly (identity) if it is not codec-eligible or its name matches one of
    ``codec_exclude`` (compiled patterns, ``re.search``). Lazy: one tensor is encoded per step of the iterator."""
    codec_exclude = tuple(codec_exclude)
    identity = get_codec("identity")
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        chosen = codec if uses_codec(name, tensor, codec, codec_exclude) else identity
        yield EncodedTensor(name, tuple(tensor.shape), tensor.dtype, chosen.name, chosen.encode(tensor))


@dataclass
class PushStats:
    """What one ``push`` sent (``WeightSender.last_push``).

    Attributes:
        version: the update's weight version.
        num_buckets: buckets in the update.
        nbytes: payload bytes the transport moved (after delta encoding, the last attempt).
        full_nbytes: packed bytes of the update (what a full update moves).
        kinds: buckets per encoding: {"full": n} without delta; with delta also "sparse" / "xor_zstd".
        seconds: wall time of the push, retries included.
        full_resends: updates sent again in full because a receiver lacked a delta's base.
        delta: whether the sender encodes deltas (``WeightSender(delta=True)``).
    """

    version: int = 0
    num_buckets: int = 0
    nbytes: int = 0
    full_nbytes: int = 0
    kinds: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    full_resends: int = 0
    delta: bool = False

    @property
    def sent_fraction(self) -> float:
        """nbytes / full_nbytes (1.0 for a full update)."""
        return self.nbytes / self.full_nbytes if self.full_nbytes else 1.0


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
        delta: send each bucket as its change from the last committed version (``miles.sync.delta``: sparse words
            or zstd-compressed XOR, whichever is smaller, checksummed); a receiver without that base makes the
            update go again in full (needs a re-iterable ``named_tensors``). Holds a host copy of the packed
            weights. Receivers need nothing set: ``WeightReceiver`` decodes delta buckets.
        overlap_send: on a transport whose ``overlap_send`` is True (gloo ``DistributedTransport``), pack bucket
            k+1 on the calling thread while a worker thread sends bucket k (torch copies and gloo collectives
            release the GIL); it gains with several buckets, not with one. False, or a transport without it
            (in-process, shared memory: their send is short Python work), sends each bucket on the calling thread
            before packing the next. Either way the receivers get the same bytes in the same order.

    Attributes:
        version: the last pushed weight version.
        last_push: ``PushStats`` of the last successful push.

    Raises:
        ValueError: on a non-positive ``bucket_bytes``, a negative ``retries`` or an unknown codec.
        ImportError: with ``delta`` and no zstandard / xxhash installed (names the install command).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        bucket_bytes: int = 512 * 2**20,
        codec: str = "identity",
        codec_exclude: Iterable[str] = DEFAULT_CODEC_EXCLUDE,
        retries: int = 0,
        delta: bool = False,
        overlap_send: bool = True,
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
        self.overlap_send = overlap_send
        self.version = 0
        self.last_push = PushStats()
        self._delta = None
        if delta:
            from miles.sync.delta import DeltaEncoder

            self._delta = DeltaEncoder()

    def _encode(self, named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[EncodedTensor]:
        return encode_tensors(named_tensors, self.codec, self.codec_exclude)

    def _prepare(self, entries: list[EncodedTensor], version: int, index: int) -> tuple[Bucket, int]:
        """Pack bucket ``index`` into a transport buffer (delta: pack on the host, encode, copy the change out).
        Returns the bucket and its packed (full) size in bytes."""
        size, device = packed_nbytes(entries), entries[0].parts[0].device
        if self._delta is None:
            return pack(entries, self.transport.allocate(size, device), version=version, index=index), size
        # packed into a fresh host buffer, because it becomes the next base
        packed = pack(entries, torch.zeros(size, dtype=torch.uint8), version=version, index=index)
        meta, data = self._delta.encode(packed)
        return Bucket(meta, self.transport.allocate(data.numel(), device).copy_(data)), size

    @staticmethod
    def _count(stats: PushStats, bucket: Bucket, size: int) -> None:
        """Account a bucket whose send returned."""
        stats.num_buckets += 1
        stats.nbytes += bucket.meta.nbytes
        stats.full_nbytes += size
        stats.kinds[bucket.meta.delta.kind if bucket.meta.delta is not None else "full"] += 1

    def _push_once(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, stats: PushStats) -> None:
        self.transport.begin(version)
        stats.num_buckets, stats.nbytes, stats.full_nbytes, stats.kinds = 0, 0, 0, Counter()
        # transports without the attribute (a user's own) are driven serially
        overlap = self.overlap_send and getattr(self.transport, "overlap_send", False)
        pool = ThreadPoolExecutor(1, thread_name_prefix="miles-sync-send") if overlap else None
        in_flight: tuple[Future, Bucket, int] | None = None  # the previous bucket's send, on the pool's thread
        num_packed = 0
        try:
            for entries in group_into_buckets(self._encode(named_tensors), bucket_bytes=self.bucket_bytes):
                bucket, size = self._prepare(entries, version, num_packed)  # while bucket num_packed - 1 is sent
                num_packed += 1
                if in_flight is not None:
                    in_flight[0].result()  # raises that send's error
                    self._count(stats, *in_flight[1:])
                    in_flight = None
                if pool is None:
                    self.transport.send(bucket)
                    self._count(stats, bucket, size)
                else:
                    in_flight = (pool.submit(self.transport.send, bucket), bucket, size)
            if in_flight is not None:
                in_flight[0].result()
                self._count(stats, *in_flight[1:])
                in_flight = None
        except BaseException as err:
            if in_flight is not None:  # one thread at a time uses the transport: the abort must not race the send
                wait([in_flight[0]])
                if (send_err := in_flight[0].exception()) is not None and send_err is not err:
                    logger.warning("update v%d: the send in flight failed too: %r", version, send_err)
            if self._delta is not None:
                self._delta.discard()
            self.transport.abort(version, f"sender failed after {stats.num_buckets} buckets: {err!r}")
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=False)  # no send is in flight by now
        # A failed commit needs no abort: receivers drop the update when they reject it.
        try:
            self.transport.commit(version, stats.num_buckets)
        except BaseException:
            if self._delta is not None:
                self._delta.discard()
            raise
        if self._delta is not None:
            self._delta.commit()

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
        version = next_version(version, self.version, holder="this sender")
        attempts = self.retries + 1
        if attempts > 1 and iter(named_tensors) is named_tensors:
            logger.warning("retries=%d ignored: named_tensors is a one-shot iterator; pass a list", self.retries)
            attempts = 1
        start = time.perf_counter()
        stats = PushStats(version=version, delta=self._delta is not None)
        attempt = 0
        while True:
            try:
                self._push_once(named_tensors, version, stats)
                break
            except (WeightUpdateError, TimeoutError, ConnectionError) as err:
                if self._delta is not None and NEEDS_FULL_UPDATE in str(err) and stats.full_resends == 0:
                    if iter(named_tensors) is named_tensors:
                        raise WeightUpdateError(
                            f"{err}; a full resend needs a re-iterable named_tensors (a list), not an iterator"
                        ) from err
                    logger.info("update v%d: a receiver lacks the delta base, sending it in full", version)
                    self._delta.reset()
                    stats.full_resends += 1
                    continue
                attempt += 1
                if attempt == attempts:
                    raise
                logger.warning("update v%d failed (attempt %d of %d), retrying: %s", version, attempt, attempts, err)
        self.version = version
        stats.seconds = time.perf_counter() - start
        self.last_push = stats
        logger.debug(  # per step: the run log file has it, the console does not
            "pushed weights v%d in %.3fs (%s, %d buckets, %.1f of %.1f MiB sent: %s)",
            version,
            stats.seconds,
            self.codec.name,
            stats.num_buckets,
            stats.nbytes / 2**20,
            stats.full_nbytes / 2**20,
            ", ".join(f"{n} {kind}" for kind, n in sorted(stats.kinds.items())),
        )
        return version
