"""FP8 E4M3 block-wise codec (128 x 128 blocks, one float32 scale per block), as in DeepSeek-V3's FP8 weights.

Layout, for a tensor viewed as rows [R, K] (K = last dim; see ``blocks.as_rows``):
    data:   [R, K] float8_e4m3fn, ``round(x / scale)`` of the block the element falls in;
    scales: [ceil(R/128), ceil(K/128)] float32, ``amax(block) / 448`` (1.0 for an all-zero block); the engine-side
            name of this tensor is ``weight_scale_inv`` in DeepSeek/SGLang checkpoints (x = data * scale).
Error bound, per element: ``|x - decode(x)| <= max(2**-4 * |x|, 2**-10 * scale)`` (3 mantissa bits, round to
nearest; the second term covers E4M3 subnormals, spacing 2**-9). Values stay within range by construction.
Reference: DeepSeek-V3 technical report (arXiv:2412.19437) section 3.3; OCP 8-bit Floating Point spec (OFP8).
"""

import torch
from miles.sync.codecs.blocks import FP8_E4M3_MAX, as_rows, pad_to, to_fp8_e4m3
from torch import Tensor

BLOCK = 128


def encode(tensor: Tensor, *, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Quantize to FP8 E4M3 with one scale per ``block x block`` tile.

    Args:
        tensor: floating point, any shape (viewed as rows [R, K]).
        block: tile edge in elements.

    Returns:
        ``(data [R, K] float8_e4m3fn, scales [ceil(R/block), ceil(K/block)] float32)``.
    """
    rows = as_rows(tensor)
    num_rows, num_cols = rows.shape
    tiles = pad_to(rows, row_multiple=block, col_multiple=block)
    grid_rows, grid_cols = tiles.shape[0] // block, tiles.shape[1] // block
    tiles = tiles.view(grid_rows, block, grid_cols, block)  # (Rb, block, Kb, block)
    amax = tiles.abs().amax(dim=(1, 3))  # (Rb, Kb)
    scales = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    data = to_fp8_e4m3(tiles / scales[:, None, :, None]).view(grid_rows * block, grid_cols * block)
    return data[:num_rows, :num_cols].contiguous(), scales


def decode(parts: tuple[Tensor, ...], *, shape: tuple[int, ...], dtype: torch.dtype, block: int = BLOCK) -> Tensor:
    """Dequantize ``data * scale`` per tile and restore ``shape`` and ``dtype``.

    Args:
        parts: ``(data [R, K] float8_e4m3fn, scales [ceil(R/block), ceil(K/block)] float32)``.
        shape: original shape; dtype: original dtype.
    """
    data, scales = parts
    num_rows, num_cols = data.shape
    expanded = scales.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:num_rows, :num_cols]
    return (data.float() * expanded).to(dtype).view(shape)
