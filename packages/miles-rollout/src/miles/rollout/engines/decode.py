"""A slot KV cache and batched prefill / decode steps for Llama-family HF models (the embedded engine's fast path).

The engine keeps one KV cache for every running sequence, preallocated once per run of its worker: per layer a
``[slots, kv_heads, length, head_dim]`` tensor for keys and one for values. A sequence occupies a slot from its
prefill until it finishes; the running sequences always fill slots ``0..B-1`` (a finished one's slot is refilled
by moving the last sequence into it), so a decode step reads the cache through a view, never a gather.

The layers run the HF model's own modules (projections, norms, MLP, rotary embedding, ``apply_rotary_pos_emb``),
so the weights are the model's parameters (weight updates and ``release_weights`` act on them as before) and only
attention and the cache are Miles'. Supported: HF ``llama``, ``qwen2`` (without sliding windows) and ``qwen3``
decoder stacks (``supports``); other models fall back to HF ``generate``.

Decode attention with grouped-query heads: the ``nh / kvh`` query heads that share a kv head are laid out as that
head's query rows (``[B, kvh, nh / kvh, D]``), so SDPA reads the cache without repeating keys.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def supports(model: torch.nn.Module) -> bool:
    """True when ``model`` is an HF causal LM whose decoder stack this module runs (see the module docstring)."""
    config = getattr(model, "config", None)
    if config is None or config.model_type not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "use_sliding_window", False) or getattr(config, "layer_types", None) not in (
        None,
        ["full_attention"] * config.num_hidden_layers,
    ):
        return False
    inner = getattr(model, "model", None)
    return all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")) and hasattr(
        model, "lm_head"
    )


class SlotKVCache:
    """Keys and values of up to ``slots`` sequences of up to ``length`` tokens, per layer.

    Args:
        model: the HF model (its config gives layers, kv heads and head dim; its parameters the dtype/device).
        slots: most sequences held at once.
        length: most tokens (prompt + response) of one sequence; ``ensure_length`` grows it.
    """

    def __init__(self, model: torch.nn.Module, slots: int, length: int) -> None:
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.slots = slots
        self.length = 0
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.ensure_length(length)

    def ensure_length(self, length: int) -> None:
        """Make room for sequences of ``length`` tokens (rounded up to 64), keeping what the cache holds."""
        if length <= self.length:
            return
        new = -(-length // 64) * 64
        shape = (self.slots, self.kv_heads, new, self.head_dim)
        # Zeros, not empty: attention weighs the masked positions by 0, and 0 * a NaN left in fresh memory is NaN.
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for old, fresh in zip(self.keys + self.values, keys + values):
            fresh[:, :, : self.length].copy_(old[:, :, : self.length])
        self.keys, self.values, self.length = keys, values, new

    def copy_slot(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` positions of slot ``src`` into slot ``dst`` (fork a prefix, compact)."""
        if src == dst:
            return
        for cache in self.keys + self.values:
            cache[dst, :, :num_tokens].copy_(cache[src, :, :num_tokens])

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (keys and values of every layer)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def _rotary():
    """``apply_rotary_pos_emb`` of the model family (the same function in llama, qwen2 and qwen3)."""
    return importlib.import_module("transformers.models.llama.modeling_llama").apply_rotary_pos_emb


def _qkv(attn: torch.nn.Module, hidden: Tensor, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Projections of ``hidden`` [B, L, H] to q [B, nh, L, D], k and v [B, kvh, L, D] (Qwen3's q/k norms too)."""
    shape = (*hidden.shape[:-1], -1, head_dim)
    q = attn.q_proj(hidden).view(shape)
    k = attn.k_proj(hidden).view(shape)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q.transpose(1, 2), k.transpose(1, 2), attn.v_proj(hidden).view(shape).transpose(1, 2)


def _layer(layer: torch.nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, head_dim: int, attend) -> Tensor:
    """One decoder layer on ``hidden`` [B, L, H]: pre-norm attention (``attend(attn, q, k, v)`` writes the cache and
    returns [B, L, nh * D]) and pre-norm MLP, each with its residual."""
    attn = layer.self_attn
    q, k, v = _qkv(attn, layer.input_layernorm(hidden), head_dim)
    q, k = _rotary()(q, k, cos, sin)
    hidden = hidden + attn.o_proj(attend(attn, q, k, v))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


@torch.no_grad()
def prefill(model: torch.nn.Module, cache: SlotKVCache, slot: int, tokens: Sequence[int]) -> Tensor:
    """Run ``tokens`` (one sequence, from position 0) through the model, writing their keys and values into
    ``slot``. Returns the logits of the last position, [V] float in the model's dtype.

    Raises: ValueError when the sequence is longer than the cache (call ``ensure_length`` first).
    """
    num = len(tokens)
    if num > cache.length:
        raise ValueError(f"a sequence of {num} tokens does not fit the KV cache's {cache.length}")
    inner = model.model
    ids = torch.tensor([list(tokens)], dtype=torch.int64, device=cache.device)
    positions = torch.arange(num, device=cache.device)[None, :]
    hidden = inner.embed_tokens(ids)  # [1, L, H]
    cos, sin = inner.rotary_emb(hidden, positions)
    for index, layer in enumerate(inner.layers):

        def attend(attn: torch.nn.Module, q: Tensor, k: Tensor, v: Tensor, index: int = index) -> Tensor:
            cache.keys[index][slot, :, :num] = k[0]
            cache.values[index][slot, :, :num] = v[0]
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1]
            )  # [1, nh, L, D]
            return out.transpose(1, 2).reshape(1, num, -1)

        hidden = _layer(layer, hidden, cos, sin, cache.head_dim, attend)
    return model.lm_head(inner.norm(hidden[:, -1]))[0]


@torch.no_grad()
def decode_step(model: torch.nn.Module, cache: SlotKVCache, tokens: Tensor, positions: Tensor) -> Tensor:
    """One token for each of the sequences in slots ``0..B-1``: ``tokens[b]`` at position ``positions[b]``.

    Args:
        tokens: [B] int64, each sequence's newest token (not yet in the cache).
        positions: [B] int64, its position (= tokens already cached); all < ``cache.length``.
    Returns: the next-token logits, [B, V] in the model's dtype.
    """
    batch = tokens.shape[0]
    inner = model.model
    width = int(positions.max()) + 1  # keys to read: the longest sequence's
    rows = torch.arange(batch, device=cache.device)
    visible = (torch.arange(width, device=cache.device)[None, :] <= positions[:, None])[:, None, None, :]  # [B,1,1,W]
    hidden = inner.embed_tokens(tokens[:, None])  # [B, 1, H]
    cos, sin = inner.rotary_emb(hidden, positions[:, None])
    group = model.config.num_attention_heads // cache.kv_heads
    for index, layer in enumerate(inner.layers):

        def attend(attn: torch.nn.Module, q: Tensor, k: Tensor, v: Tensor, index: int = index) -> Tensor:
            keys, values = cache.keys[index], cache.values[index]  # q [B, nh, 1, D]; k, v [B, kvh, 1, D]
            keys[rows, :, positions] = k[:, :, 0]
            values[rows, :, positions] = v[:, :, 0]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(batch, cache.kv_heads, group, cache.head_dim),  # a kv head's query heads as its query rows
                keys[:batch, :, :width],
                values[:batch, :, :width],
                attn_mask=visible,
                scale=attn.scaling,
            )  # [B, kvh, group, D]
            return out.reshape(batch, 1, -1)

        hidden = _layer(layer, hidden, cos, sin, cache.head_dim, attend)
    return model.lm_head(inner.norm(hidden[:, 0]))
