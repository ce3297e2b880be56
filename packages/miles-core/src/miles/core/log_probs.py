"""Log-probs of response tokens from full-sequence logits (the trainer's side of engine/trainer agreement).

Two forward layouts give the same [B, T] result: ``model_response_log_probs`` runs the padded [B, L] rows,
``packed_model_response_log_probs`` the N real tokens packed into one row (no compute on padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from miles.core.batch import pack_sequences
from miles.core.multimodal import (
    MultimodalInputs,
    is_idefics3_config,
    multimodal_forward_kwargs,
    packed_position_ids,
)
from torch import Tensor

# Attention implementations that keep packed sequences apart (transformers 5.x). eager/sdpa/flex: the causal mask
# is built from ``position_ids`` when ``attention_mask`` is None and there is no cache (masking_utils.py,
# ``_preprocess_mask_arguments`` -> ``find_packed_sequence_indices`` -> ``packed_sequence_mask_function``).
# flash_attention_*: varlen kernels over the ``cu_seq_lens_*`` kwargs (modeling_flash_attention_utils.py);
# miles_varlen_sdpa (``miles.core.varlen_attention``): SDPA per sequence over the same kwargs.
# miles_block_diagonal_mask: a Megatron model seen through ``miles.train.megatron``'s ``CausalLMView``, which builds
# the block-diagonal causal mask from the restarting ``position_ids``.
_PACKED_MASK_ATTENTION = ("eager", "sdpa", "flex_attention", "miles_varlen_sdpa", "miles_block_diagonal_mask")


def packing_refusal(config) -> str | None:
    """Why an HF model of ``config`` cannot run on the packed layout (one row of several sequences), or None.

    Position ids keep packed sequences apart in attention layers only. Refused: Gated DeltaNet linear attention
    (Qwen3.5, Qwen3-Next: ``layer_types`` holding "linear_attention") without flash-linear-attention, whose
    varlen kernels are the only ones that restart the recurrent state per sequence (transformers' reference
    implementation raises mid-forward); DeepSeek-V4, whose compressed attention in transformers mixes
    sequences of one row (measured on tiny models: the second sequence of a row 5e-4 to 5e-2 nats off the padded
    layout, growing with depth; the first exact).
    """
    config = getattr(config, "text_config", None) or config
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):
        import importlib.util

        if importlib.util.find_spec("fla") is None:
            return (
                f"{config.model_type}'s linear-attention (Gated DeltaNet) layers keep packed sequences apart only "
                "with flash-linear-attention, which is not installed"
            )
    if getattr(config, "model_type", None) == "deepseek_v4":  # (Megatron passes a bare namespace)
        return "transformers' DeepSeek-V4 compressed attention does not keep packed sequences apart"
    return None


def scaled_token_log_probs(
    logits: Tensor, targets: Tensor, *, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / temperature)[target] over the last axis, and optionally the entropy.

    Args:
        logits: [..., V] float (any dtype; upcast to float32), one row per scored token.
        targets: [...] int64 token ids to score.
    Returns: log_probs [...] float32 nats; entropy [...] float32 or None. Both carry grad if ``logits`` does.
    """
    scaled = logits.float() / temperature
    log_z = torch.logsumexp(scaled, dim=-1)
    log_probs = scaled.gather(-1, targets[..., None]).squeeze(-1) - log_z
    entropy = None
    if with_entropy:
        log_p = scaled - log_z[..., None]
        entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return log_probs, entropy


def response_log_probs(
    logits: Tensor,
    tokens: Tensor,
    prompt_lengths: Tensor,
    *,
    num_response_columns: int,
    temperature: float,
    with_entropy: bool = False,
    logits_offset: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / temperature) of each response token, laid out as ``TrainBatch`` [B, T] columns.

    Response token t of row b sits at ``tokens[b, p_b + t]`` and is predicted by ``logits[b, p_b + t - 1]``.

    Args:
        logits: [B, L, V] float (any dtype; upcast to float32), the model output for ``tokens``.
        tokens: [B, L] int64, right-padded prompt + response ids.
        prompt_lengths: [B] int64, p_b >= 1.
        num_response_columns: T, the batch's response width.
        temperature: the sampling temperature; the engine's log-probs use the same scaling.
        with_entropy: also return per-token entropy of the scaled distribution.
        logits_offset: column of ``tokens`` that ``logits[:, 0]`` belongs to (the model was asked for the last
            L - offset positions only, see ``model_response_log_probs``).
    Returns: log_probs [B, T] float32 nats (garbage past each response; mask it); entropy [B, T] float32 or None.
        Both carry grad if ``logits`` does.
    """
    batch, num_logits, vocab = logits.shape
    seq_len = tokens.shape[1]
    cols = torch.arange(num_response_columns, device=logits.device)
    # Predicting positions; clamp keeps padding columns in range (they are masked downstream).
    pred_pos = (prompt_lengths[:, None] - 1 + cols[None, :]).clamp(max=seq_len - 2)  # [B, T]
    logit_pos = (pred_pos - logits_offset).clamp(min=0, max=num_logits - 1)
    resp_logits = logits.gather(1, logit_pos[..., None].expand(batch, num_response_columns, vocab))  # [B, T, V]
    targets = tokens.gather(1, pred_pos + 1)  # [B, T]
    return scaled_token_log_probs(resp_logits, targets, temperature=temperature, with_entropy=with_entropy)


def model_response_log_probs(
    model: torch.nn.Module,
    tokens: Tensor,
    attention_mask: Tensor,
    prompt_lengths: Tensor,
    *,
    num_response_columns: int,
    temperature: float,
    with_entropy: bool = False,
    multimodal: Sequence[MultimodalInputs | None] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Run an HF causal LM on right-padded ``tokens`` and return ``response_log_probs`` of its output.

    Only positions from the shortest prompt's last token on get logits (HF ``logits_to_keep``): the LM head over
    a 49k vocabulary is a fifth of a small model's compute, and prompt positions are never scored.

    Args:
        model: HF causal LM (or an FSDP2-sharded one) accepting ``logits_to_keep``; a vision-language model when
            rows carry images.
        tokens: [B, L] int64; attention_mask: [B, L] bool/int; prompt_lengths: [B] int64.
        num_response_columns, temperature, with_entropy: as in ``response_log_probs``.
        multimodal: per row, its image inputs (``miles.core.multimodal``) or None; None for a text-only batch.
    Returns: as ``response_log_probs``.
    Raises: ValueError from ``multimodal_forward_kwargs`` (placeholders and images disagree).
    """
    seq_len = tokens.shape[1]
    offset = int(prompt_lengths.min()) - 1  # host sync (one per micro-batch)
    logits = model(
        input_ids=tokens,
        attention_mask=attention_mask.long(),
        logits_to_keep=seq_len - offset,
        **multimodal_forward_kwargs(model, tokens, multimodal),
    ).logits  # [B, L - offset, V]
    return response_log_probs(
        logits,
        tokens,
        prompt_lengths,
        num_response_columns=num_response_columns,
        temperature=temperature,
        with_entropy=with_entropy,
        logits_offset=offset,
    )


def packed_model_response_log_probs(
    model: torch.nn.Module,
    tokens: Tensor,
    attention_mask: Tensor,
    prompt_lengths: Tensor,
    *,
    num_response_columns: int,
    temperature: float,
    with_entropy: bool = False,
    multimodal: Sequence[MultimodalInputs | None] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``model_response_log_probs`` with the forward on the packed (varlen) layout: same inputs, same [B, T] outputs.

    The B right-padded rows become one row of their N real tokens (``pack_sequences``) with per-sequence
    ``position_ids``, so no compute goes to padding; attention stays within each sequence (see
    ``_PACKED_MASK_ATTENTION``). Only the M = sum(response_lengths) predicting positions reach the LM head.

    Args:
        model: HF causal LM (or an FSDP2-sharded one) accepting ``position_ids``, ``logits_to_keep`` as a 1-D
            index tensor, and the flash varlen kwargs; its ``config._attn_implementation`` must be eager, sdpa,
            flex_attention or a flash_attention variant.
        tokens: [B, L] int64, right-padded; attention_mask: [B, L] bool/int, a prefix of True per row;
        prompt_lengths: [B] int64, p_b >= 1.
        num_response_columns, temperature, with_entropy: as in ``response_log_probs``.
    Returns: log_probs [B, T] float32 nats; entropy [B, T] float32 or None; both equal to
        ``model_response_log_probs`` within float rounding on each row's first ``response_lengths[b]`` columns and
        exactly 0 past them (the padded path leaves unspecified values there; mask them either way). Carry grad.
        multimodal: per row, its image inputs or None (Qwen-VL models: each row's multimodal RoPE positions are
            computed on the row alone and packed behind restarting text positions, ``packed_position_ids``;
            Idefics3 / SmolVLM: the text positions, the rows' tiles concatenated as ``concat_multimodal``).
    Raises: ValueError for another attention implementation (it would attend across sequences), a model
        ``packing_refusal`` names, left padding, or what ``multimodal_forward_kwargs`` / ``packed_position_ids``
        raise.
    """
    if (refusal := packing_refusal(model.config)) is not None:
        raise ValueError(f"train.batch_layout 'packed': {refusal}; set --train.batch-layout padded")
    attn_impl = model.config._attn_implementation
    if attn_impl not in _PACKED_MASK_ATTENTION and "flash" not in attn_impl:
        raise ValueError(
            f"train.batch_layout 'packed' needs an attention implementation that keeps packed sequences apart "
            f"(eager, sdpa, flex_attention, flash_attention_*, miles_varlen_sdpa), but the model uses {attn_impl!r}, "
            "whose mask transformers would not build from position_ids: tokens would attend across sequences. "
            "Load the model with attn_implementation='sdpa' or set --train.batch-layout padded."
        )
    packed = pack_sequences(tokens, attention_mask)
    batch = tokens.shape[0]
    seq_starts = packed.cu_seqlens[:-1].long()  # [B]
    response_lengths = packed.cu_seqlens.diff().long() - prompt_lengths  # [B]
    cols = torch.arange(num_response_columns, device=tokens.device)
    is_response = cols[None, :] < response_lengths[:, None]  # [B, T], the columns with a real response token
    # Response token t of row b sits at packed index start_b + p_b + t and is predicted by the index before it.
    pred_pos = (seq_starts + prompt_lengths - 1)[:, None] + cols[None, :]  # [B, T]
    keep = pred_pos[is_response]  # [M], ascending (row-major), so [M] results scatter back in the same order
    position_ids, images = packed.position_ids, {}
    if multimodal is not None and any(row is not None for row in multimodal):
        images = multimodal_forward_kwargs(model, tokens, multimodal)  # checks each row's placeholders first
        if "mm_token_type_ids" in images:  # [B, L] -> the packed row's [1, N]
            images["mm_token_type_ids"] = (packed.tokens == model.config.image_token_id).to(torch.int32)
        if not is_idefics3_config(model.config):  # Idefics3's language model takes the plain restarting positions
            lengths = packed.cu_seqlens.diff().tolist()
            rows = [tokens[b, :n] for b, n in enumerate(lengths)]
            position_ids = packed_position_ids(model, rows, multimodal)  # [4, 1, N]
    # attention_mask=None and use_cache=False are what make transformers derive the block-diagonal causal mask from
    # the restarting position_ids (a 2-D mask or a cache disables that detection). The cu_seq_lens/max_length
    # kwargs are what flash varlen kernels read (else they re-derive them with a host sync per layer); eager/sdpa
    # ignore them. The top module is called, so FSDP2's pre/post-forward hooks run as usual.
    logits = model(
        input_ids=packed.tokens,
        position_ids=position_ids,
        attention_mask=None,
        use_cache=False,
        logits_to_keep=keep,
        cu_seq_lens_q=packed.cu_seqlens,
        cu_seq_lens_k=packed.cu_seqlens,
        max_length_q=packed.max_seqlen,
        max_length_k=packed.max_seqlen,
        **images,
    ).logits  # [1, M, V]
    targets = packed.tokens[0, keep + 1]  # [M]
    token_log_probs, token_entropy = scaled_token_log_probs(
        logits[0], targets, temperature=temperature, with_entropy=with_entropy
    )  # [M] each
    log_probs = token_log_probs.new_zeros(batch, num_response_columns).masked_scatter(is_response, token_log_probs)
    entropy = None
    if with_entropy:
        entropy = token_entropy.new_zeros(batch, num_response_columns).masked_scatter(is_response, token_entropy)
    return log_probs, entropy


def warn_if_slow_bf16(dtype: torch.dtype, logger, *, where: str) -> None:
    """Warn when bf16 compute is asked for on a CPU without native bf16 matmul (AVX2-only: ~70x slower), or fp16
    compute on a machine without a GPU or AMX-FP16 (measured ~24x slower than fp32 on an AVX2 CPU)."""
    if dtype == torch.float16 and not torch.cuda.is_available() and not torch.cpu._is_amx_fp16_supported():
        logger.warning(
            "%s: fp16 on a CPU without AMX-FP16 runs matmuls far slower than fp32; fp16 is for GPUs without bf16",
            where,
        )
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "NO AVX", "AVX2"):
        logger.warning(
            "%s: bf16 on a CPU reporting %s (no AVX512-BF16/AMX) runs matmuls far slower than fp32; "
            "set dtype fp32 unless this runs on a GPU",
            where,
            torch.backends.cpu.get_cpu_capability(),
        )
