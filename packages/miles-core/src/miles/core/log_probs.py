"""Log-probs of response tokens from full-sequence logits (the trainer's side of engine/trainer agreement)."""

from __future__ import annotations

import torch
from torch import Tensor


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
    resp_logits = resp_logits.float() / temperature
    log_z = torch.logsumexp(resp_logits, dim=-1)  # [B, T]
    targets = tokens.gather(1, pred_pos + 1)  # [B, T]
    log_probs = resp_logits.gather(-1, targets[..., None]).squeeze(-1) - log_z
    entropy = None
    if with_entropy:
        log_p = resp_logits - log_z[..., None]
        entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return log_probs, entropy


def model_response_log_probs(
    model: torch.nn.Module,
    tokens: Tensor,
    attention_mask: Tensor,
    prompt_lengths: Tensor,
    *,
    num_response_columns: int,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Run an HF causal LM on right-padded ``tokens`` and return ``response_log_probs`` of its output.

    Only positions from the shortest prompt's last token on get logits (HF ``logits_to_keep``): the LM head over
    a 49k vocabulary is a fifth of a small model's compute, and prompt positions are never scored.

    Args:
        model: HF causal LM (or an FSDP2-sharded one) accepting ``logits_to_keep``.
        tokens: [B, L] int64; attention_mask: [B, L] bool/int; prompt_lengths: [B] int64.
        num_response_columns, temperature, with_entropy: as in ``response_log_probs``.
    Returns: as ``response_log_probs``.
    """
    seq_len = tokens.shape[1]
    offset = int(prompt_lengths.min()) - 1  # host sync (one per micro-batch)
    logits = model(
        input_ids=tokens, attention_mask=attention_mask.long(), logits_to_keep=seq_len - offset
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


def warn_if_slow_bf16(dtype: torch.dtype, logger, *, where: str) -> None:
    """Warn when bf16 compute is asked for on a CPU without native bf16 matmul (AVX2-only: ~70x slower)."""
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "NO AVX", "AVX2"):
        logger.warning(
            "%s: bf16 on a CPU reporting %s (no AVX512-BF16/AMX) runs matmuls far slower than fp32; "
            "set dtype fp32 unless this runs on a GPU",
            where,
            torch.backends.cpu.get_cpu_capability(),
        )
