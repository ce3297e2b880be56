"""INT4 group-wise symmetric codec: signed 4-bit integers in groups along the last dim, one float32 scale per group.

Layout, for a tensor viewed as rows [R, K] (K = last dim, padded with zeros to Kp = ceil(K/G)*G, G = group size):
    data:   [R, Kp/2] uint8, two codes per byte, element 2j in the low nibble; code = q + 8 with q in [-7, 7];
    scales: [R, Kp/G] float32, ``amax(group) / 7`` (1.0 for an all-zero group).
Decoding is ``(code - 8) * scale``; q = round(x / scale) (half to even). The range is symmetric ([-7, 7], code 0
unused) so that zero is exact and no group saturates. Error bound per element: ``|x - decode(x)| <= scale / 2 =
amax(group) / 14``. Reference: GPTQ/AWQ-style W4 group quantization (arXiv:2210.17323, arXiv:2306.00978), without
their calibration: plain round to nearest.
"""

import torch
from miles.sync.codecs.blocks import as_rows, pack_nibbles, pad_to, unpack_nibbles
from torch import Tensor

GROUP = 128
QMAX = 7
OFFSET = 8


def encode(tensor: Tensor, *, group: int = GROUP) -> tuple[Tensor, Tensor]:
    """Quantize to signed 4-bit integers with a float32 scale per ``group`` elements of the last dim.

    Args:
        tensor: floating point, any shape (viewed as rows [R, K]).
        group: elements per group, even.

    Returns:
        ``(data [R, Kp/2] uint8, scales [R, Kp/group] float32)``.
    """
    rows = as_rows(tensor)
    num_rows = rows.shape[0]
    groups = pad_to(rows, row_multiple=1, col_multiple=group).view(num_rows, -1, group)  # (R, Kg, G)
    amax = groups.abs().amax(dim=-1)  # (R, Kg)
    scales = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(groups / scales[..., None]).clamp(-QMAX, QMAX)
    codes = (q + OFFSET).to(torch.uint8).view(num_rows, -1)
    return pack_nibbles(codes), scales


def decode(parts: tuple[Tensor, ...], *, shape: tuple[int, ...], dtype: torch.dtype, group: int = GROUP) -> Tensor:
    """Dequantize ``(code - 8) * scale`` and restore ``shape`` and ``dtype``.

    Args:
        parts: ``(data [R, Kp/2] uint8, scales [R, Kp/group] float32)``.
    """
    data, scales = parts
    num_cols = shape[-1] if len(shape) > 0 else 1
    q = unpack_nibbles(data).float().sub_(OFFSET).view(data.shape[0], -1, group)
    return (q * scales[..., None]).view(data.shape[0], -1)[:, :num_cols].to(dtype).reshape(shape)
