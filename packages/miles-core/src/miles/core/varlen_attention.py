"""Packed-sequence attention at the cost of the sequences, not of the packed row: SDPA per sequence.

With ``attn_implementation="sdpa"`` transformers attends over a packed row of N tokens with an N x N block-diagonal
mask (``find_packed_sequence_indices``); SDPA's CPU kernels compute every block of it, masked or not, so a row of 16
sequences of ~77 tokens costs ~16x the attention FLOPs of its sequences, and the attention backward was 27% of a bf16
train step here (docs/performance.md). ``varlen_sdpa_attention`` runs causal SDPA on each sequence's slice of the
row (the ``cu_seq_lens_q`` boundaries ``packed_model_response_log_probs`` passes, as flash varlen kernels read
them): sum(L_b^2) instead of N^2, with no mask to build. Calls without those boundaries (padded rows, decoding)
are plain SDPA. On CPU, bf16 inputs attend in fp32 (faster there, see below). Registered with transformers as
``VARLEN_SDPA``; its mask builder is SDPA's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VARLEN_SDPA = "miles_varlen_sdpa"


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``sdpa_attention_forward``, per sequence when the row is packed.

    Args:
        query: [1, Hq, N, D]; key, value: [1, Hkv, N, D] (Hq a multiple of Hkv: grouped-query attention).
        attention_mask: ignored for a packed row (its boundaries are ``cu_seq_lens_q``), else as for SDPA.
        cu_seq_lens_q: [S + 1] int cumulative sequence lengths of the packed row, or None (not packed).
        cu_seq_lens_k: must equal ``cu_seq_lens_q`` (self-attention without a cache).
    Returns: attn_output [1, N, Hq, D] (transformers' layout, ``query``'s dtype), None (no weights).
    Raises: ValueError for a packed call with a batch of more than one row or different key boundaries.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if query.shape[0] != 1 or (cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError("varlen_sdpa_attention: a packed call needs one row and the same query and key boundaries")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # repeat once here, not in every per-sequence call
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out_dtype = query.dtype
    if query.device.type == "cpu" and out_dtype != torch.float32:
        # CPU's bf16 SDPA backward ran ~10x its forward here (4x in fp32): fp32 attention took ~1.4 s off a 10 s
        # bf16 train step, and is the more exact of the two
        query, key, value = query.float(), key.float(), value.float()
    bounds = cu_seq_lens_q.tolist()
    dropout = dropout if module.training else 0.0
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
        )  # fmt: skip
        for start, end in zip(bounds[:-1], bounds[1:])
        if end > start
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous().to(out_dtype), None


def register_varlen_sdpa() -> str:
    """Register ``VARLEN_SDPA`` with transformers (idempotent); returns the name for ``set_attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    if VARLEN_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
    return VARLEN_SDPA
