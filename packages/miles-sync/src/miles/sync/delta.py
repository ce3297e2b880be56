"""Delta weight updates: send each bucket as the change from the version the receivers already hold.

Consecutive RL steps change weights little, so a bucket's packed bytes (after the codec: a delta of FP8 or INT4
weights is a delta of their encoded bytes) are mostly equal to the previous version's. The sender keeps the last
committed payload of every bucket index (its *base*) and sends, per bucket, the smallest of (chosen by size):

- ``sparse``: the 32-bit words that changed, as int32 indices plus their new values (8 bytes per changed word):
  for bf16 weights, whose small updates round to no change at all in most elements;
- ``xor_zstd``: the XOR of new and base words, compressed with zstd: unchanged high bits (sign, exponent, leading
  mantissa) are zero bytes, so fp32 weights with every element changed still shrink;
- ``full``: the payload itself, when neither is smaller (and always for the first update, a new layout, or after
  a receiver lost its base).

Every bucket carries the xxh3-64 checksum of its full payload, and a delta also that of its base: the receiver
rebuilds the payload only on top of the exact version it was made against and verifies the result, so the
engine's weights are bit-identical to the trainer's after every update. A receiver without that base (an engine
restarted mid-run, a missed update) rejects the update with ``NEEDS_FULL_UPDATE`` in the message;
``WeightSender`` then forgets its bases and sends the update again in full. This follows slime's XOR delta with
checksums and verl's delta sync (changed-bytes-only updates, full fallback).

Both sides hold one host copy of the packed weights (the bases); encoding and decoding run on the CPU.
Needs the ``zstandard`` and ``xxhash`` packages (``pip install miles-sync[delta]``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

import torch
from miles.sync.bucket import ALIGN_BYTES, Bucket, BucketMeta, TensorMeta, align
from torch import Tensor

DeltaKind = Literal["full", "sparse", "xor_zstd"]

NEEDS_FULL_UPDATE = "the receiver needs a full update"
"""In a rejected update's message when a receiver lacks a delta's base; the sender resends in full."""


@dataclass(frozen=True, slots=True)
class DeltaMeta:
    """How a bucket's payload encodes its packed bytes (``BucketMeta.delta``).

    Attributes:
        kind: "full" (the payload is the packed bytes), "sparse" or "xor_zstd" (a change from the base).
        nbytes: size of the packed bytes the payload rebuilds (a multiple of ``ALIGN_BYTES``).
        checksum: xxh3-64 of the packed bytes.
        length: bytes of the payload that hold the encoding (the rest is alignment padding).
        count: "sparse": how many 32-bit words changed.
        base_version: the weight version of the base a delta applies to; 0 for "full".
        base_checksum: xxh3-64 of that base; 0 for "full".
    """

    kind: DeltaKind
    nbytes: int
    checksum: int
    length: int
    count: int = 0
    base_version: int = 0
    base_checksum: int = 0


@dataclass(frozen=True, slots=True)
class _Base:
    version: int
    payload: Tensor  # [nbytes] uint8, CPU, owned
    checksum: int
    tensors: tuple[TensorMeta, ...]


@functools.cache
def _libs():
    try:
        import xxhash
        import zstandard
    except ImportError as err:
        raise ImportError(
            f"delta weight updates need zstandard and xxhash ({err.name} is missing): pip install 'miles-sync[delta]'"
        ) from err
    return zstandard, xxhash


def checksum(payload: Tensor) -> int:
    """xxh3-64 of a contiguous CPU uint8 tensor's bytes."""
    return _libs()[1].xxh3_64_intdigest(payload.numpy())


def _padded(data: Tensor) -> Tensor:
    """``data`` (1-D uint8) zero-padded to a non-empty multiple of ``ALIGN_BYTES`` (transports move whole buffers)."""
    out = torch.zeros(align(max(data.numel(), 1)), dtype=torch.uint8)
    out[: data.numel()] = data
    return out


def as_full(bucket: Bucket, *, payload_checksum: int | None = None) -> tuple[BucketMeta, Tensor]:
    """A packed bucket as a "full" delta bucket: its own payload, checksummed, which a ``DeltaDecoder`` records as its
    base (a plain packed bucket would not, so the next delta would need a full update again).

    Args:
        bucket: a packed bucket (``meta.delta`` None; ``payload``: [meta.nbytes] uint8 on the CPU).
        payload_checksum: the payload's xxh3-64 if already known (e.g. from ``DeltaEncoder.encode``), else computed.
    Returns:
        (meta with ``delta`` kind "full", the same payload tensor).
    """
    meta = bucket.meta
    assert meta.delta is None, "as_full takes a packed bucket"
    if payload_checksum is None:
        payload_checksum = checksum(bucket.payload.contiguous())
    full = DeltaMeta("full", meta.nbytes, payload_checksum, length=meta.nbytes)
    return dataclasses.replace(meta, delta=full), bucket.payload


class DeltaEncoder:
    """Sender side: turns packed buckets into delta buckets against the last committed version.

    Call ``encode`` for each bucket of an update, then ``commit`` once the receivers applied it (or ``discard`` if
    they did not); ``reset`` forgets every base, so the next update is sent in full.

    Args:
        zstd_level: zstd compression level (1: fastest; higher levels gain little on XOR words).
        sparse_fraction: "sparse" is tried only when at most this fraction of words changed (beyond it, the XOR
            compresses better and the index costs more).
        compress_above: the XOR is compressed (and the smaller form sent) unless the sparse form is at most this
            fraction of the payload already: zstd could save little there, at ~3 s/GiB of CPU time.
    Raises: ImportError naming the install command without zstandard / xxhash.
    """

    def __init__(self, *, zstd_level: int = 1, sparse_fraction: float = 0.25, compress_above: float = 1 / 32) -> None:
        zstandard, _ = _libs()
        self._compressor = zstandard.ZstdCompressor(level=zstd_level)
        self.sparse_fraction = sparse_fraction
        self.compress_above = compress_above
        self._bases: dict[int, _Base] = {}
        self._pending: dict[int, _Base] = {}

    def reset(self) -> None:
        """Forget every base: the next update goes out in full."""
        self._bases.clear()
        self._pending.clear()

    def commit(self) -> None:
        """The update whose buckets were encoded since the last commit was applied: they are the new bases."""
        self._bases.update(self._pending)
        self._pending.clear()

    def discard(self) -> None:
        """The update was not applied: the bases stay those of the last committed one."""
        self._pending.clear()

    def encode(self, bucket: Bucket) -> tuple[BucketMeta, Tensor]:
        """The delta form of one packed bucket.

        Args:
            bucket: a packed bucket (``payload``: [meta.nbytes] uint8, any device; copied to the host).
        Returns:
            (meta with ``delta`` set and ``nbytes`` the encoded payload's size, encoded payload: 1-D uint8 CPU
            tensor, a multiple of ``ALIGN_BYTES`` bytes).
        """
        meta = bucket.meta
        current = bucket.payload.detach().to("cpu", copy=True).contiguous()
        current_sum = checksum(current)
        base = self._bases.get(meta.index)
        self._pending[meta.index] = _Base(meta.version, current, current_sum, meta.tensors)
        full = DeltaMeta("full", meta.nbytes, current_sum, length=meta.nbytes)
        if base is None or base.tensors != meta.tensors or meta.nbytes % 4:
            return self._meta(meta, full, current)
        new_words, base_words = current.view(torch.int32), base.payload.view(torch.int32)
        xor = torch.bitwise_xor(new_words, base_words)
        count = int(torch.count_nonzero(xor))
        common = {"nbytes": meta.nbytes, "checksum": current_sum, "base_version": base.version}
        common["base_checksum"] = base.checksum
        sparse = None
        if count <= self.sparse_fraction * new_words.numel():
            index = torch.nonzero(xor).squeeze(1)  # words < 2**31: a bucket is far below 8 GiB
            data = torch.cat([index.to(torch.int32), new_words[index]]).view(torch.uint8)
            sparse = self._meta(meta, DeltaMeta("sparse", length=data.numel(), count=count, **common), _padded(data))
            if data.numel() <= self.compress_above * meta.nbytes:
                return sparse
        compressed = self._compressor.compress(xor.view(torch.uint8).numpy())
        if sparse is not None and sparse[1].numel() <= align(len(compressed)):  # both go padded; a tie: sparse
            return sparse
        if len(compressed) >= meta.nbytes:
            return self._meta(meta, full, current)
        data = torch.frombuffer(bytearray(compressed), dtype=torch.uint8)
        return self._meta(meta, DeltaMeta("xor_zstd", length=data.numel(), **common), _padded(data))

    @staticmethod
    def _meta(meta: BucketMeta, delta: DeltaMeta, payload: Tensor) -> tuple[BucketMeta, Tensor]:
        return dataclasses.replace(meta, nbytes=payload.numel(), delta=delta), payload


class DeltaBaseError(ValueError):
    """A delta bucket's base is not the one this receiver holds (its message contains ``NEEDS_FULL_UPDATE``)."""


class DeltaDecoder:
    """Receiver side: rebuilds packed buckets from delta buckets on top of the last applied version.

    ``decode`` each bucket of an update, then ``commit`` once the update was applied (``discard`` otherwise).
    """

    def __init__(self) -> None:
        self._decompressor = _libs()[0].ZstdDecompressor()
        self._bases: dict[int, _Base] = {}
        self._pending: dict[int, _Base] = {}

    def commit(self) -> None:
        """The update decoded since the last commit was applied: its buckets are the new bases."""
        self._bases.update(self._pending)
        self._pending.clear()

    def discard(self) -> None:
        """The update was dropped: the bases stay those of the last applied one."""
        self._pending.clear()

    def decode(self, bucket: Bucket) -> Bucket:
        """The packed bucket a delta bucket stands for (``meta.delta`` None, the full payload on the CPU).

        Raises:
            DeltaBaseError: if this receiver has no base for the bucket or a different one (version or checksum),
                or the rebuilt bytes fail their checksum: the message says ``NEEDS_FULL_UPDATE``.
            ValueError: if the payload is malformed.
        """
        meta, delta = bucket.meta, bucket.meta.delta
        assert delta is not None, "decode takes delta buckets (BucketMeta.delta set)"
        where = f"bucket {meta.index} of update v{meta.version}"
        data = bucket.payload.detach().to("cpu")[: delta.length]
        if delta.kind == "full":
            if delta.length != delta.nbytes:
                raise ValueError(f"{where}: a full delta bucket holds {delta.length} of {delta.nbytes} bytes")
            payload = data.clone()  # the transport reuses its buffer; a base must outlive it
        else:
            base = self._bases.get(meta.index)
            if base is None or base.version != delta.base_version or base.checksum != delta.base_checksum:
                held = "no base" if base is None else f"v{base.version} (checksum {base.checksum:016x})"
                raise DeltaBaseError(
                    f"{where} is a delta on v{delta.base_version} (checksum {delta.base_checksum:016x}), but this "
                    f"receiver holds {held}: {NEEDS_FULL_UPDATE}"
                )
            if base.payload.numel() != delta.nbytes:
                raise DeltaBaseError(f"{where}: its base has {base.payload.numel()} bytes, not {delta.nbytes}")
            payload = base.payload.clone()
            words = payload.view(torch.int32)
            if delta.kind == "sparse":
                if delta.length != 8 * delta.count:
                    raise ValueError(f"{where}: a sparse delta of {delta.count} words holds {delta.length} bytes")
                index_and_values = data.view(torch.int32)
                words[index_and_values[: delta.count].long()] = index_and_values[delta.count :]
            elif delta.kind == "xor_zstd":
                raw = self._decompressor.decompress(data.numpy().tobytes(), max_output_size=delta.nbytes)
                if len(raw) != delta.nbytes:
                    raise ValueError(f"{where}: the XOR delta decompressed to {len(raw)} of {delta.nbytes} bytes")
                words.bitwise_xor_(torch.frombuffer(bytearray(raw), dtype=torch.int32))
            else:
                raise ValueError(f"{where}: unknown delta kind {delta.kind!r}")
        if checksum(payload) != delta.checksum:  # a corrupt base or payload: the full bytes repair it
            raise DeltaBaseError(f"{where}: the rebuilt bytes fail their checksum: {NEEDS_FULL_UPDATE}")
        self._pending[meta.index] = _Base(meta.version, payload, delta.checksum, meta.tensors)
        return Bucket(dataclasses.replace(meta, nbytes=delta.nbytes, delta=None), payload)


assert ALIGN_BYTES % 4 == 0  # packed payloads are whole 32-bit words
