"""Cast codecs: send a floating-point tensor as bfloat16 or float16 and cast back on decode.

Layout: one part, ``tensor.to(wire_dtype)`` with the original shape.
Error bound (round to nearest even): relative error <= 2**-8 for bf16 (8 significand bits) and <= 2**-11 for fp16
(11 significand bits) for values in the normal range; fp16 overflows to inf above 65504 and loses precision below
6.1e-5 (subnormals), bf16 has float32's range. A tensor already in the wire dtype is sent exactly.
"""

import torch
from torch import Tensor


def encode_bf16(tensor: Tensor) -> tuple[Tensor, ...]:
    """Cast to bfloat16. Args: tensor: any shape, floating dtype. Returns: ``(tensor.to(torch.bfloat16),)``."""
    return (tensor.to(torch.bfloat16),)


def encode_fp16(tensor: Tensor) -> tuple[Tensor, ...]:
    """Cast to float16. Args: tensor: any shape, floating dtype. Returns: ``(tensor.to(torch.float16),)``."""
    return (tensor.to(torch.float16),)


def decode(parts: tuple[Tensor, ...], *, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Cast the single part back to the original dtype.

    Args:
        parts: ``(data,)``, data of ``shape`` in bfloat16 or float16.
        shape: original shape.
        dtype: original floating dtype.

    Returns:
        Tensor of ``shape`` and ``dtype``.
    """
    (data,) = parts
    return data.to(dtype).view(shape)
