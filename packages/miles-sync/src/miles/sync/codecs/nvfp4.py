"""NVFP4 codec: FP4 E2M1 elements in 16-element blocks, an FP8 E4M3 scale per block and one float32 tensor scale.

Layout, for a tensor viewed as rows [R, K] (K = last dim, padded with zeros to Kp = ceil(K/16)*16):
    data:         [R, Kp/2] uint8, two E2M1 codes per byte, element 2j in the low nibble (the order of
                  ``torch.float4_e2m1fn_x2``); code = sign << 3 | magnitude index into (0, .5, 1, 1.5, 2, 3, 4, 6);
    block_scales: [R, Kp/16] float8_e4m3fn, ``amax(block) / 6 / tensor_scale`` rounded to E4M3;
    tensor_scale: [1] float32, ``amax(tensor) / (448 * 6)`` (1.0 for an all-zero tensor).
Decoding is ``value(code) * block_scale * tensor_scale``. With S = block_scale * tensor_scale, the error per element
is ``|x - decode(x)| <= max(|x| / 4, S / 4) + amax(block) / 15``: E2M1 keeps one mantissa bit (half a step is at most
a quarter of the value) and the last term covers the E4M3 rounding of the block scale, which can push the block's
largest elements past 6 where they saturate. Blocks far below the tensor maximum (amax(block) < 2**-9 * 448 * 6 *
tensor_scale) get a subnormal or zero E4M3 scale and lose relative precision.
Reference: NVIDIA, "Introducing NVFP4 for efficient and accurate low-precision inference" (2025) and the
TensorRT-LLM / ModelOpt NVFP4 weight format; E2M1 is the OCP MX v1.0 FP4 element type.
"""

import torch
from miles.sync.codecs.blocks import FP8_E4M3_MAX, as_rows, pack_nibbles, pad_to, to_fp8_e4m3, unpack_nibbles
from torch import Tensor

BLOCK = 16
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of each 3-bit E2M1 code (1 exponent bit pair, 1 mantissa bit; codes 0 and 1 are subnormal)."""
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_ROUNDING_UP = (0.75, 1.75, 3.5)  # round half to even: these midpoints go to the even (upper) code


def e2m1_codes(values: Tensor) -> Tensor:
    """Round float32 ``values`` (already divided by their scale) to 4-bit E2M1 codes, nearest even, saturating at 6.

    Returns:
        uint8 codes in [0, 15] of the same shape: bit 3 is the sign, bits 0-2 index ``E2M1_VALUES``.
    """
    magnitude = values.abs().clamp(max=E2M1_MAX)
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=values.device)
    index = torch.bucketize(magnitude, midpoints)  # a value equal to a midpoint gets the lower code
    ties_up = torch.isin(magnitude, torch.tensor(_TIES_ROUNDING_UP, dtype=torch.float32, device=values.device))
    index = index + ties_up.to(index.dtype)
    return (index | ((values < 0).to(index.dtype) << 3)).to(torch.uint8)


def e2m1_values(codes: Tensor) -> Tensor:
    """Float32 value of each 4-bit E2M1 code (uint8 in [0, 15])."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def encode(tensor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Quantize to NVFP4 with two-level scaling.

    Args:
        tensor: floating point, any shape (viewed as rows [R, K]).

    Returns:
        ``(data [R, Kp/2] uint8, block_scales [R, Kp/16] float8_e4m3fn, tensor_scale [1] float32)``.
    """
    rows = as_rows(tensor)
    num_rows = rows.shape[0]
    blocks = pad_to(rows, row_multiple=1, col_multiple=BLOCK).view(num_rows, -1, BLOCK)  # (R, Kb, 16)
    tensor_amax = rows.abs().amax()
    tensor_scale = torch.where(tensor_amax > 0, tensor_amax / (FP8_E4M3_MAX * E2M1_MAX), torch.ones_like(tensor_amax))
    block_scales = to_fp8_e4m3(blocks.abs().amax(dim=-1) / E2M1_MAX / tensor_scale)  # (R, Kb)
    scale = block_scales.float() * tensor_scale
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a zero scale means an all-zero block
    codes = e2m1_codes(blocks / safe_scale[..., None]).view(num_rows, -1)
    return pack_nibbles(codes), block_scales, tensor_scale.reshape(1)


def decode(parts: tuple[Tensor, ...], *, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Dequantize ``value(code) * block_scale * tensor_scale`` and restore ``shape`` and ``dtype``.

    Args:
        parts: ``(data [R, Kp/2] uint8, block_scales [R, Kp/16] float8_e4m3fn, tensor_scale [1] float32)``.
    """
    data, block_scales, tensor_scale = parts
    num_cols = shape[-1] if len(shape) > 0 else 1
    values = e2m1_values(unpack_nibbles(data)).view(data.shape[0], -1, BLOCK)
    scale = block_scales.float() * tensor_scale
    return (values * scale[..., None]).view(data.shape[0], -1)[:, :num_cols].to(dtype).reshape(shape)
