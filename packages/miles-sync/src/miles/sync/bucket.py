"""Buckets: named tensors packed into one flat byte payload with the metadata to unpack them.

Layout of a bucket: ``payload`` is a 1-D uint8 tensor of ``meta.nbytes`` bytes. Every tensor contributes one or more
codec *parts*; each part sits at ``PartMeta.offset`` (a multiple of ``ALIGN_BYTES``) and occupies
``numel * element_size`` bytes in C order. All tensors of one bucket share a source dtype (``BucketMeta.dtype``), so
with the identity codec ``payload[:used].view(dtype)`` is the per-dtype flattened tensor that SGLang's
``load_format="flattened_bucket"`` expects (up to alignment padding).

Buckets are filled in order up to ``bucket_bytes``; a single tensor larger than that gets a bucket of its own.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from miles.sync.delta import DeltaMeta

ALIGN_BYTES = 64
"""Part offsets are multiples of this: any dtype view is aligned, and copies stay on cache-line boundaries."""


def align(nbytes: int) -> int:
    """Round ``nbytes`` up to a multiple of ``ALIGN_BYTES``."""
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True, slots=True)
class PartMeta:
    """Where one codec part lives in a payload.

    Attributes:
        offset: byte offset into the payload, a multiple of ``ALIGN_BYTES``.
        dtype: element dtype of the part.
        shape: shape of the part.
    """

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One named tensor in a bucket.

    Attributes:
        name: the sender's name for the tensor (e.g. an HF parameter name).
        shape: original shape.
        dtype: original dtype, restored by decoding.
        codec: name of the codec that produced ``parts``.
        parts: the encoded parts, in the order the codec's ``decode`` takes them.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    codec: str
    parts: tuple[PartMeta, ...]


@dataclass(frozen=True, slots=True)
class BucketMeta:
    """Everything a receiver needs to unpack a payload; small and picklable.

    Attributes:
        version: weight version of the update this bucket belongs to (1, 2, ...).
        index: position of this bucket in the update, from 0.
        nbytes: payload size in bytes.
        dtype: the source dtype shared by all tensors of the bucket.
        tensors: the tensors, in payload order.
        delta: None when the payload is the packed bytes; else how it encodes them (a delta update, see
            ``miles.sync.delta``), and ``nbytes`` is the encoded payload's size.
    """

    version: int
    index: int
    nbytes: int
    dtype: torch.dtype
    tensors: tuple[TensorMeta, ...]
    delta: "DeltaMeta | None" = None


@dataclass(frozen=True, slots=True)
class Bucket:
    """A payload and its metadata. ``payload``: [meta.nbytes] uint8, on any device."""

    meta: BucketMeta
    payload: Tensor


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """A tensor after encoding, before packing: metadata plus the part tensors (any device)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    codec: str
    parts: tuple[Tensor, ...]


def _layout(entries: list[EncodedTensor]) -> tuple[tuple[TensorMeta, ...], int]:
    offset = 0
    metas = []
    for entry in entries:
        part_metas = []
        for part in entry.parts:
            part_metas.append(PartMeta(offset, part.dtype, tuple(part.shape)))
            offset = align(offset + part.numel() * part.element_size())
        metas.append(TensorMeta(entry.name, entry.shape, entry.dtype, entry.codec, tuple(part_metas)))
    return tuple(metas), offset


def group_into_buckets(entries: Iterable[EncodedTensor], *, bucket_bytes: int) -> Iterator[list[EncodedTensor]]:
    """Group encoded tensors into per-dtype lists whose packed size stays within ``bucket_bytes``.

    One list is open per source dtype; a list is yielded when the next tensor would overflow it, and the open lists
    are yielded at the end, so memory held is at most one bucket per dtype. A tensor larger than ``bucket_bytes``
    alone forms a list.

    Args:
        entries: encoded tensors in sender order.
        bucket_bytes: target payload size in bytes, > 0.
    """
    open_lists: dict[torch.dtype, tuple[list[EncodedTensor], int]] = {}
    for entry in entries:
        size = sum(align(part.numel() * part.element_size()) for part in entry.parts)
        current, used = open_lists.get(entry.dtype, ([], 0))
        if current and used + size > bucket_bytes:
            yield current
            current, used = [], 0
        current.append(entry)
        open_lists[entry.dtype] = (current, used + size)
    for current, _ in open_lists.values():
        if current:
            yield current


def packed_nbytes(entries: list[EncodedTensor]) -> int:
    """Payload bytes needed to pack ``entries`` (parts aligned to ``ALIGN_BYTES``)."""
    return _layout(entries)[1]


def pack(entries: list[EncodedTensor], out: Tensor, *, version: int, index: int) -> Bucket:
    """Copy the parts of ``entries`` into ``out`` and describe them.

    Args:
        entries: non-empty, all of the same source dtype.
        out: [packed_nbytes(entries)] uint8 destination, any device; the copy runs on that device.
        version: weight version recorded in the metadata.
        index: bucket position recorded in the metadata.

    Returns:
        ``Bucket(meta, out)``.
    """
    metas, nbytes = _layout(entries)
    assert out.dtype == torch.uint8 and out.numel() == nbytes, (out.dtype, out.numel(), nbytes)
    for entry, meta in zip(entries, metas, strict=True):
        for part, part_meta in zip(entry.parts, meta.parts, strict=True):
            if part.numel() == 0:
                continue
            region = out[part_meta.offset : part_meta.offset + part_meta.nbytes]
            region.view(part.dtype).view(part.shape).copy_(part)
    bucket_meta = BucketMeta(version=version, index=index, nbytes=nbytes, dtype=entries[0].dtype, tensors=metas)
    return Bucket(bucket_meta, out)


def unpack_parts(bucket: Bucket) -> Iterator[tuple[TensorMeta, tuple[Tensor, ...]]]:
    """Views of each tensor's parts into ``bucket.payload`` (no copy).

    Raises:
        ValueError: if the payload size differs from ``meta.nbytes`` or a part lies outside the payload; the message
            names the bucket and the tensor.
    """
    meta, payload = bucket.meta, bucket.payload
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != meta.nbytes:
        raise ValueError(
            f"bucket {meta.index} of update v{meta.version}: payload is {tuple(payload.shape)} {payload.dtype}, "
            f"but the metadata says [{meta.nbytes}] uint8; the payload was truncated or belongs to another bucket"
        )
    for tensor_meta in meta.tensors:
        parts = []
        for part in tensor_meta.parts:
            end = part.offset + part.nbytes
            if part.offset % ALIGN_BYTES or end > meta.nbytes:
                raise ValueError(
                    f"bucket {meta.index} of update v{meta.version}: tensor {tensor_meta.name!r} has a part at bytes "
                    f"[{part.offset}, {end}), outside the {meta.nbytes}-byte payload or unaligned"
                )
            parts.append(payload[part.offset : end].view(part.dtype).view(part.shape))
        yield tensor_meta, tuple(parts)
