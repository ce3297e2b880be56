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
    Returns: log_probs [B, T] float32 nats (garbage past each response; mask it); entropy [B, T] float32 or None.
        Both carry grad if ``logits`` does.
    """
    batch, seq_len, vocab = logits.shape
    cols = torch.arange(num_response_columns, device=logits.device)
    # Predicting positions; clamp keeps padding columns in range (they are masked downstream).
    pred_pos = (prompt_lengths[:, None] - 1 + cols[None, :]).clamp(max=seq_len - 2)  # [B, T]
    resp_logits = logits.gather(1, pred_pos[..., None].expand(batch, num_response_columns, vocab))  # [B, T, V]
    resp_logits = resp_logits.float() / temperature
    log_z = torch.logsumexp(resp_logits, dim=-1)  # [B, T]
    targets = tokens.gather(1, pred_pos + 1)  # [B, T]
    log_probs = resp_logits.gather(-1, targets[..., None]).squeeze(-1) - log_z
    entropy = None
    if with_entropy:
        log_p = resp_logits - log_z[..., None]
        entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return log_probs, entropy
