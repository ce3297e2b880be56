"""Block views shared by the quantizing codecs: any tensor as rows, padded to whole blocks."""

import torch
from torch import Tensor

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value (OCP OFP8 spec, E4M3 has no infinities)."""


def as_rows(tensor: Tensor) -> Tensor:
    """View ``tensor`` as [R, K] float32 with K its last dimension (a scalar or 1-D tensor becomes one row)."""
    if tensor.dim() == 0:
        return tensor.reshape(1, 1).float()
    return tensor.reshape(-1, tensor.shape[-1]).float()


def pad_to(rows: Tensor, *, row_multiple: int, col_multiple: int) -> Tensor:
    """Zero-pad [R, K] to [ceil(R/row_multiple)*row_multiple, ceil(K/col_multiple)*col_multiple]."""
    pad_rows = -rows.shape[0] % row_multiple
    pad_cols = -rows.shape[1] % col_multiple
    if pad_rows == 0 and pad_cols == 0:
        return rows
    return torch.nn.functional.pad(rows, (0, pad_cols, 0, pad_rows))


def to_fp8_e4m3(values: Tensor) -> Tensor:
    """Round float32 values to float8_e4m3fn (nearest even), saturating at +-448 instead of producing NaN."""
    return values.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def pack_nibbles(codes: Tensor) -> Tensor:
    """Pack 4-bit codes [R, K] (uint8 in [0, 15], K even) two per byte: element 2j in the low nibble -> [R, K/2]."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of ``pack_nibbles``: [R, K/2] uint8 -> [R, K] uint8 codes in [0, 15]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
