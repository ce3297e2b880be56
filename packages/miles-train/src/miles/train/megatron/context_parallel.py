"""Context parallelism (CP) for the Megatron backend on the CPU: the stand-in for Transformer Engine's.

With ``train.megatron.context_parallel_size`` CP > 1 the CP ranks of a data-parallel replica get the same rows and
split each sequence: it is right-padded to a multiple of 2 x CP, cut into 2 x CP equal chunks, and CP rank r holds
chunks r and 2 x CP - 1 - r (Megatron's load-balanced split, ``get_batch_on_this_cp_rank``: every rank gets as much
causal-attention work). On the packed layout each sequence of the packed row is padded and split so (as Megatron
splits THD batches). Each rank runs the model on its own tokens only (the model's ``TransformerConfig`` keeps
``context_parallel_size`` 1: its layers see an ordinary, shorter sequence; Megatron's ``parallel_state`` holds the
CP groups, so DDP reduces gradients over the data- and context-parallel ranks):

- rotary embeddings at each token's position in its sequence (the table Megatron's ``RotaryEmbedding`` slices
  with ``get_pos_emb_on_this_cp_rank``, indexed here: that function moves its index to CUDA);
- attention (``ContextParallelAttention``): the keys and values of every CP rank are all-gathered with autograd
  (their gradients return to the rank that owns the tokens) and each local query attends to them under a causal
  mask built from the global positions of the queries and of the gathered keys, padded keys (packed: keys of other
  sequences) masked. This is what
  Transformer Engine computes with ``cp_comm_type`` "all_gather"; Megatron's local ``DotProductAttention`` refuses
  CP ("only supported by TEDotProductAttention") and Transformer Engine has no CPU build. On GPUs with Transformer
  Engine, Megatron's ``TEDotProductAttention`` does CP itself (ring or all-gather, ``TransformerConfig.
  context_parallel_size``): that path is Megatron's and is not replaced (the backend trains on the CPU only today);
- log-probs: the next-token targets are taken from the whole sequence before the split, each rank scores its own
  positions, and the ranks' token log-probs are all-gathered (with autograd) into the whole [B, T] layout, so
  ``forward`` and the objective see exactly what they see without CP.

Gradients: every CP rank computes the same loss on the gathered log-probs, so the gather's backward (a sum over the
ranks) hands each rank CP times its tokens' share; Megatron's DDP averages over the data- and context-parallel
ranks (``gradient_scaling_factor`` 1 / (DP x CP)), which takes that factor back out: the gradient is one rank's.

Covered: dense models (Llama, Mistral, Qwen2, Qwen3), padded and packed layouts, tensor- and pipeline-parallel
size 1. Refused in one line (``context_parallel_refusal``, ``model_refusal``): pipeline or tensor parallelism with
CP, MoE and MLA models (routing replay's token order, MLA's own attention module), vision-language models.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def context_parallel_refusal(*, context_parallel: int, tensor_parallel: int, pipeline_parallel: int) -> str | None:
    """Why ``train.megatron.context_parallel_size`` cannot be ``context_parallel`` with these settings (one line
    naming the setting and the fix), or None."""
    if context_parallel == 1:
        return None
    for key, size in (("pipeline_parallel_size", pipeline_parallel), ("tensor_parallel_size", tensor_parallel)):
        if size > 1:
            return (
                f"train.megatron.context_parallel_size {context_parallel} with train.megatron.{key} {size} is not "
                f"supported yet: use --train.megatron.{key.replace('_', '-')} 1, or "
                "--train.megatron.context-parallel-size 1"
            )
    return None


def model_refusal(hf_config: Any, *, context_parallel: int) -> str | None:
    """Why the HF model of ``hf_config`` cannot train with context parallelism (MoE, MLA, vision-language), or
    None."""
    from miles.train.megatron import convert

    if context_parallel == 1:
        return None
    vision = getattr(hf_config, "vision_config", None) is not None  # images would need splitting with their tokens
    if vision or convert.is_mla(hf_config) or convert.is_moe(hf_config):
        kind = "a vision-language" if vision else "an MLA" if convert.is_mla(hf_config) else "an MoE"
        return (
            f"train.megatron.context_parallel_size {context_parallel}: model type '{hf_config.model_type}' is "
            f"{kind} model, and context parallelism covers dense models only yet; use "
            "--train.megatron.context-parallel-size 1"
        )
    return None


def chunk_positions(length: int, *, cp_rank: int, cp_size: int) -> Tensor:
    """Global positions of CP rank ``cp_rank``'s tokens in Megatron's load-balanced split: of 2 x ``cp_size`` equal
    chunks of ``length``, chunk ``cp_rank`` then chunk 2 x cp_size - 1 - cp_rank.

    Returns: [length / cp_size] int64, increasing. Raises: ValueError when 2 x cp_size does not divide ``length``.
    """
    if length % (2 * cp_size):
        raise ValueError(f"context parallelism: sequence length {length} is not a multiple of 2 x CP {2 * cp_size}")
    chunk = length // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def gather_sequence(local: Tensor, *, dim: int, group: dist.ProcessGroup) -> Tensor:
    """The CP ranks' ``local`` tensors concatenated along ``dim`` in rank order, with autograd: the gradient of each
    rank's part is summed over the ranks and returned to it. Collective over ``group``.

    Args:
        local: any shape and dtype, equal on every rank of ``group``.
    Returns: ``local``'s shape with ``dim`` times the group size.
    """
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(local.contiguous(), group=group), dim=dim)


def _attention_class():
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class ContextParallelAttention(DotProductAttention):
        """Megatron's local ``DotProductAttention`` over the keys and values of every CP rank: ``key`` / ``value``
        [s, b, groups, head_dim] (s this rank's tokens) are all-gathered to [CP x s, ...] in CP-rank order, which the
        caller's ``attention_mask`` ([b, 1, s, CP x s] bool, True = may not attend) is built for
        (``context_parallel_log_probs``); the arithmetic is Megatron's unchanged."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.cp_group = parallel_state.get_context_parallel_group()

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            key = gather_sequence(key, dim=0, group=self.cp_group)
            value = gather_sequence(value, dim=0, group=self.cp_group)
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return ContextParallelAttention


def context_parallel_spec(block_spec):
    """``block_spec`` (Megatron's local ``TransformerBlockSubmodules``) with every self-attention's core attention
    replaced by ``ContextParallelAttention``. Returns the same object."""
    attention_class = _attention_class()
    for layer in block_spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = attention_class
    return block_spec


def _rank_indices(segment_lengths: list[int], *, cp_rank: int, cp_size: int) -> Tensor:
    """Indices into a row of consecutive segments (each a multiple of 2 x cp_size long) of CP rank ``cp_rank``'s
    tokens: each segment's ``chunk_positions``, offset to where the segment starts. Returns: [sum / cp_size] int64."""
    starts = [0, *itertools.accumulate(segment_lengths)][:-1]
    return torch.cat(
        [start + chunk_positions(n, cp_rank=cp_rank, cp_size=cp_size) for start, n in zip(starts, segment_lengths)]
    )


def _split_rows(tokens: Tensor, attention_mask: Tensor, *, multiple: int, packed: bool) -> dict[str, Any]:
    """The rows the CP ranks split, each segment (a sequence) right-padded to a multiple of ``multiple``.

    padded: B rows of one segment each, L' = L rounded up; packed: one row of the B sequences, each rounded up
    (its real tokens only). Returns, R rows of S tokens: ``tokens``, ``positions`` (in the own sequence),
    ``sequence`` (its id), ``real`` (not padding), ``targets`` (the next token of the own sequence, shifted before
    any split), all [R, S]; ``segments`` (segment lengths of a row), ``starts`` ([B] index of each sequence's first
    token in the flattened [R * S] rows).
    """
    batch, length = tokens.shape
    if not packed:
        padded = -(-length // multiple) * multiple
        tokens = torch.nn.functional.pad(tokens, (0, padded - length))
        return {
            "tokens": tokens,
            "positions": torch.arange(padded).expand(batch, padded),
            "sequence": torch.zeros(batch, padded, dtype=torch.long),
            "real": torch.nn.functional.pad(attention_mask.bool(), (0, padded - length)),
            "targets": torch.nn.functional.pad(tokens[:, 1:], (0, 1)),
            "segments": [padded],
            "starts": torch.arange(batch) * padded,
        }
    lengths = attention_mask.bool().sum(dim=1).tolist()  # host sync (one per micro-batch, as packing needs)
    segments = [-(-n // multiple) * multiple for n in lengths]
    rows = [torch.nn.functional.pad(tokens[b, :n], (0, m - n)) for b, (n, m) in enumerate(zip(lengths, segments))]
    return {
        "tokens": torch.cat(rows)[None],
        "positions": torch.cat([torch.arange(m) for m in segments])[None],
        "sequence": torch.cat([torch.full((m,), b) for b, m in enumerate(segments)])[None],
        "real": torch.cat([torch.arange(m) < n for n, m in zip(lengths, segments)])[None],
        "targets": torch.cat([torch.nn.functional.pad(row[1:], (0, 1)) for row in rows])[None],
        "segments": segments,
        "starts": torch.tensor([0, *itertools.accumulate(segments)][:-1]),
    }


def context_parallel_log_probs(
    model: torch.nn.Module,
    gpt: torch.nn.Module,
    tokens: Tensor,
    attention_mask: Tensor,
    prompt_lengths: Tensor,
    *,
    vocab_size: int,
    num_response_columns: int,
    temperature: float,
    with_entropy: bool,
    packed: bool,
    group: dist.ProcessGroup,
) -> tuple[Tensor, Tensor | None]:
    """``miles.core.log_probs.model_response_log_probs`` (``packed``: ``packed_model_response_log_probs``) of a
    Megatron ``GPTModel`` whose sequences are split over the CP ranks of ``group``: each sequence is right-padded to
    a multiple of 2 x CP (padded: the whole rows; packed: each sequence in the one packed row), each rank runs its
    ``chunk_positions`` of every sequence, scores them against the next token of the whole sequence, and the ranks'
    token log-probs are gathered back. Collective over ``group`` (forward and backward: every rank must call it with
    the same rows).

    Args:
        model: the ``GPTModel`` (or its DDP wrapper), built with ``context_parallel_spec``; gpt: the ``GPTModel``.
        tokens: [B, L] int64, right-padded prompt + response ids, the same on every CP rank.
        attention_mask: [B, L] bool/int, 1 on real tokens (a prefix of each row); prompt_lengths: [B] int64, >= 1.
        vocab_size: the HF vocabulary V (Megatron's padding rows dropped).
        num_response_columns, temperature, with_entropy: as in ``miles.core.log_probs.response_log_probs``.
        packed: the packed layout (one row, attention within each sequence, positions restarting).
    Returns: log_probs [B, T] float32 nats (padded: unspecified past each response, mask it; packed: exactly 0
        there); entropy [B, T] float32 or None; both carry grad, the same on every CP rank.
    """
    from miles.core.log_probs import scaled_token_log_probs  # the same per-token arithmetic as without CP

    cp_size, cp_rank = group.size(), group.rank()
    rows = _split_rows(tokens, attention_mask, multiple=2 * cp_size, packed=packed)
    local = _rank_indices(rows["segments"], cp_rank=cp_rank, cp_size=cp_size)  # [l] this rank's queries
    keys = torch.cat([_rank_indices(rows["segments"], cp_rank=r, cp_size=cp_size) for r in range(cp_size)])  # [S]
    positions, sequence = rows["positions"], rows["sequence"]
    masked = (  # [R, 1, l, S], True = may not attend: a later token, another sequence, padding
        (positions[:, None, keys] > positions[:, local, None])
        | (sequence[:, None, keys] != sequence[:, local, None])
        | ~rows["real"][:, None, keys]
    )[:, None]
    rope = getattr(gpt, "rotary_pos_emb", None)
    if rope is not None:  # the table at each token's position (Megatron's CP slicing needs CUDA)
        span = int(positions.max()) + 1
        rope.forward = lambda max_seq_len, *args, **kwargs: rope.get_emb(span)[positions[0, local]]  # [l, 1, 1, d]
    try:
        logits = model(rows["tokens"][:, local], positions[:, local], masked)[..., :vocab_size]  # [R, l, V]
    finally:
        if rope is not None:
            del rope.forward  # the class's forward again
    token_log_probs, token_entropy = scaled_token_log_probs(
        logits, rows["targets"][:, local], temperature=temperature, with_entropy=with_entropy
    )  # [R, l]
    order = torch.argsort(keys)  # gathered (CP-rank) order -> row order
    cols = torch.arange(num_response_columns)
    lengths = attention_mask.bool().sum(dim=1)  # [B]
    # response token t of row b is predicted at p_b - 1 + t (as response_log_probs; padding columns clamped)
    predicting = prompt_lengths[:, None] - 1 + cols[None, :]  # [B, T]
    clamp = lengths[:, None] - 2 if packed else tokens.shape[1] - 2
    index = rows["starts"][:, None] + predicting.clamp(max=clamp)  # [B, T] into the flattened [R * S]
    beyond = predicting > lengths[:, None] - 2 if packed else None  # packed: exactly 0 past each response

    def columns(local_values: Tensor) -> Tensor:
        whole = gather_sequence(local_values, dim=1, group=group)[:, order]  # [R, S]
        values = whole.reshape(-1)[index]  # [B, T]
        return values.masked_fill(beyond, 0.0) if packed else values

    entropy = columns(token_entropy) if token_entropy is not None else None
    return columns(token_log_probs), entropy
