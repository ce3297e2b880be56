"""MXFP8 codec: OCP Microscaling FP8 E4M3 elements in 32-element blocks sharing one E8M0 (power of two) scale.

Layout, for a tensor viewed as rows [R, K] (K = last dim):
    data:   [R, K] float8_e4m3fn, ``x / 2**e`` rounded to nearest even;
    scales: [R, ceil(K/32)] uint8, the E8M0 biased exponent ``e + 127`` of each block (255 = NaN is never written).
The block exponent is ``e = ceil(log2(amax / 448))``, clamped to [-127, 127] (0 for an all-zero block), so the
largest element maps to (224, 448] and nothing saturates. The OCP spec's example rule ``floor(log2(amax)) - 8``
can saturate up to 12.5% of the block maximum; rounding the scale up (NVIDIA's "RCEIL") trades at most one bit of
range for no clipping.
Error bound, per element: ``|x - decode(x)| <= max(2**-4 * |x|, 2**-10 * 2**e)``.
Reference: OCP Microscaling Formats (MX) v1.0 spec, sections 5.2 (MXFP8) and 5.4 (E8M0).
"""

import torch
from miles.sync.codecs.blocks import FP8_E4M3_MAX, as_rows, pad_to, to_fp8_e4m3
from torch import Tensor

BLOCK = 32
E8M0_BIAS = 127


def block_exponents(amax: Tensor) -> Tensor:
    """``ceil(log2(amax / 448))`` exactly (via frexp), clamped to [-127, 127]; 0 where ``amax == 0``.

    Args:
        amax: [...] float32, non-negative block maxima.

    Returns:
        [...] int32 exponents.
    """
    mantissa, exponent = torch.frexp(amax / FP8_E4M3_MAX)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    ceil_log2 = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two needs no rounding up
    return torch.where(amax > 0, ceil_log2, torch.zeros_like(ceil_log2)).clamp(-E8M0_BIAS, E8M0_BIAS)


def encode(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize to MXFP8 (E4M3 elements, E8M0 scale per 32 elements along the last dim).

    Args:
        tensor: floating point, any shape (viewed as rows [R, K]).

    Returns:
        ``(data [R, K] float8_e4m3fn, scales [R, ceil(K/32)] uint8 biased exponents)``.
    """
    rows = as_rows(tensor)
    num_rows, num_cols = rows.shape
    blocks = pad_to(rows, row_multiple=1, col_multiple=BLOCK).view(num_rows, -1, BLOCK)  # (R, Kb, 32)
    exponents = block_exponents(blocks.abs().amax(dim=-1))  # (R, Kb)
    scaled = torch.ldexp(blocks, -exponents[..., None].float())
    data = to_fp8_e4m3(scaled).view(num_rows, -1)[:, :num_cols].contiguous()
    return data, (exponents + E8M0_BIAS).to(torch.uint8)


def decode(parts: tuple[Tensor, ...], *, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Dequantize ``data * 2**(scale - 127)`` and restore ``shape`` and ``dtype``.

    Args:
        parts: ``(data [R, K] float8_e4m3fn, scales [R, ceil(K/32)] uint8)``.
    """
    data, scales = parts
    exponents = scales.to(torch.int32) - E8M0_BIAS
    expanded = exponents.repeat_interleave(BLOCK, dim=1)[:, : data.shape[1]]
    return torch.ldexp(data.float(), expanded.float()).to(dtype).view(shape)
