"""SDPA per packed sequence (miles.core.varlen_attention) against attention written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from miles.core.varlen_attention import varlen_sdpa_attention


class _Layer(torch.nn.Module):
    training = False


def _reference(query, key, value, bounds):
    """softmax(q k^T / sqrt(d) + block-causal mask) v over the whole row, grouped-query heads repeated."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    n = query.shape[2]
    seq = torch.zeros(n, dtype=torch.long)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        seq[start:end] = i
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ value).transpose(1, 2)  # [1, N, H, D]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2)])
def test_packed_rows_attend_causally_within_each_sequence(heads):
    gen = torch.Generator().manual_seed(0)
    bounds = [0, 3, 3, 8, 9, 15]  # an empty sequence and a one-token one included
    q = torch.randn(1, heads[0], 15, 8, generator=gen)
    k, v = (torch.randn(1, heads[1], 15, 8, generator=gen) for _ in range(2))
    out, weights = varlen_sdpa_attention(_Layer(), q, k, v, None, cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32))
    assert weights is None and out.shape == (1, 15, heads[0], 8)
    torch.testing.assert_close(out, _reference(q, k, v, bounds), atol=1e-6, rtol=1e-5)


def test_bf16_attends_in_fp32_on_cpu_and_returns_bf16():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=gen).bfloat16() for _ in range(3))
    bounds = torch.tensor([0, 4, 10], dtype=torch.int32)
    out, _ = varlen_sdpa_attention(_Layer(), q, k, v, None, cu_seq_lens_q=bounds)
    assert out.dtype == torch.bfloat16
    expected = _reference(q.float(), k.float(), v.float(), bounds.tolist()).bfloat16()
    assert torch.equal(out, expected) or (out.float() - expected.float()).abs().max() <= 2**-8


def test_unpacked_calls_are_plain_sdpa_and_bad_packed_calls_fail():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=gen) for _ in range(3))
    out, _ = varlen_sdpa_attention(_Layer(), q, k, v, None, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="one row and the same query and key boundaries"):
        varlen_sdpa_attention(_Layer(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 5]))
