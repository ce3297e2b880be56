"""Codecs: per-tensor encodings applied before packing and undone after unpacking.

A codec turns one tensor into a tuple of *parts* (contiguous tensors, each of any dtype and shape) and back. The
registry below is the one place a codec name is matched. Quantizing codecs apply to floating-point tensors only;
integer and bool tensors, and tensors whose names match the sender's ``codec_exclude`` patterns, always travel with
the identity codec.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from miles.sync.codecs import cast, fp8, identity, int4, mxfp8, nvfp4
from torch import Tensor

# The lossy weight codecs an engine may run (``engine.weight_codec``) and QAT may fake-quantize for (``train.qat``):
# the config fields' types and the QAT check read this one list.
LossyCodecName = Literal["fp8", "mxfp8", "nvfp4", "int4"]
LOSSY_CODECS: tuple[str, ...] = get_args(LossyCodecName)

EncodeFn = Callable[[Tensor], tuple[Tensor, ...]]
DecodeFn = Callable[..., Tensor]


@dataclass(frozen=True, slots=True)
class Codec:
    """A named pair of pure functions.

    Attributes:
        name: registry key, recorded in the bucket metadata of every tensor it encoded.
        encode: ``encode(tensor) -> parts``.
        decode: ``decode(parts, *, shape, dtype) -> tensor`` of the original shape and dtype.
    """

    name: str
    encode: EncodeFn
    decode: DecodeFn


def _registry() -> dict[str, Codec]:
    codecs = [
        Codec("identity", identity.encode, identity.decode),
        Codec("bf16", cast.encode_bf16, cast.decode),
        Codec("fp16", cast.encode_fp16, cast.decode),
        Codec("fp8", fp8.encode, fp8.decode),
        Codec("mxfp8", mxfp8.encode, mxfp8.decode),
        Codec("nvfp4", nvfp4.encode, nvfp4.decode),
        Codec("int4", int4.encode, int4.decode),
    ]
    return {codec.name: codec for codec in codecs}


CODECS: dict[str, Codec] = _registry()


def get_codec(name: str) -> Codec:
    """Look up a codec by name.

    Raises:
        ValueError: if ``name`` is not registered; the message lists the registered names.
    """
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(
            f"codec is {name!r}, which is not a registered codec; choose one of {sorted(CODECS)}"
        ) from None


def is_codec_eligible(tensor: Tensor) -> bool:
    """True when a lossy codec may encode ``tensor``: floating point and non-empty."""
    return tensor.is_floating_point() and tensor.numel() > 0


def roundtrip(codec: str | Codec, tensor: Tensor) -> Tensor:
    """``decode(encode(tensor))``: what a receiver holds after ``tensor`` travelled with ``codec`` (the same shape
    and dtype). Used to emulate a quantized engine's weights and for fake quantization in training (QAT), so that
    both sides compute with exactly the values the wire carries.

    Raises: ValueError for an unknown codec name.
    """
    codec = get_codec(codec) if isinstance(codec, str) else codec
    return codec.decode(codec.encode(tensor), shape=tuple(tensor.shape), dtype=tensor.dtype)


__all__ = ["CODECS", "Codec", "get_codec", "is_codec_eligible", "roundtrip"]
