"""HF causal LMs <-> Megatron-core ``GPTModel``: the model config, parameter names and layouts, tensor-parallel shards.

Supported HF architectures: the dense decoders ``llama``, ``mistral`` (without a sliding window), ``qwen2`` (q/k/v
biases), ``qwen3`` (per-head q/k RMSNorm), and the MoE decoder ``qwen3_moe`` (softmax top-k router, dense layers
where ``mlp_only_layers`` / ``decoder_sparse_step`` say). Layouts that differ between the two sides:

- attention: HF ``q_proj`` [H*d, h], ``k_proj``/``v_proj`` [G*d, h] -> Megatron ``linear_qkv`` [G*(H/G + 2)*d, h],
  grouped per query group g as [q heads of g; k_g; v_g] (biases the same way);
- MLP: HF ``gate_proj``/``up_proj`` [f, h] -> ``linear_fc1`` [2f, h] = [gate; up] (Megatron's gated linear unit
  computes act(x W1[:f]) * (x W1[f:]));
- MoE experts: HF ``mlp.experts.gate_up_proj`` [E, 2f, h] / ``down_proj`` [E, h, f] (transformers 5 holds each
  layer's experts fused) -> ``mlp.experts.local_experts.<e>.linear_fc1`` [2f, h] / ``linear_fc2`` [h, f]; the router
  ``mlp.gate`` -> ``mlp.router``;
- vocabulary: padded with zero rows to a multiple of the tensor-parallel size (``padded_vocab_size``); the padding is
  dropped from the logits and from the weights sent back to HF;
- tied embeddings: one ``embedding.word_embeddings.weight``, no ``output_layer`` (HF ``tie_word_embeddings``).

Names are those of Megatron's local layer specs (``get_gpt_decoder_block_spec(use_transformer_engine=False)``:
separate ``input_layernorm`` and ``pre_mlp_layernorm`` modules, ``SequentialMLP`` experts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF names inside model.layers.<i>. whose tensor is copied as is -> Megatron names inside decoder.layers.<i>.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
}
_TOP_RENAMES = {"model.norm.weight": "decoder.final_layernorm.weight", "lm_head.weight": "output_layer.weight"}
_EMBEDDING = "embedding.word_embeddings.weight"


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"train.backend megatron: rope type {rope_type!r} of this model is not converted yet (only the default "
            "RoPE); use --train.backend fsdp2"
        )
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def check_supported(hf_config: Any) -> None:
    """Raise ValueError (one line naming the field and the fix) if ``hf_config`` has no Megatron conversion here."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"train.backend megatron: model type {model_type!r} has no Megatron conversion yet (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); use --train.backend fsdp2"
        )
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True):
        raise ValueError(
            "train.backend megatron: sliding-window attention is not converted yet; use --train.backend fsdp2"
        )
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("train.backend megatron: MLP biases are not converted yet; use --train.backend fsdp2")
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):  # Llama's also biases o_proj
        raise ValueError(
            "train.backend megatron: attention biases (attention_bias) are not converted yet; use --train.backend fsdp2"
        )
    _rope_theta(hf_config)


def is_moe(hf_config: Any) -> bool:
    return hf_config.model_type == "qwen3_moe"


def moe_layers(hf_config: Any) -> list[int]:
    """1 for each decoder layer with experts, 0 for a dense one (Qwen3-MoE's rule; Megatron's ``moe_layer_freq``)."""
    if not is_moe(hf_config):
        return [0] * hf_config.num_hidden_layers
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return [int(i not in dense and (i + 1) % step == 0) for i in range(hf_config.num_hidden_layers)]


def check_model_dir(path: Any, *, tensor_parallel: int, expert_parallel: int, key: str) -> None:
    """Check, from its ``config.json`` alone, that the HF model at ``path`` converts with these parallel sizes, and
    that megatron-core is installed: what would otherwise fail only once the trainer builds.

    Raises: ValueError, one line naming ``key`` (the config key of the model) and the fix.
    """
    import importlib.util

    from transformers import AutoConfig

    if importlib.util.find_spec("megatron.core") is None:
        raise ValueError(
            "train.backend megatron needs megatron-core: install the extra (pip install 'miles-train[megatron]'; "
            "the workspace's uv sync has it), or use --train.backend fsdp2"
        )
    try:
        transformer_config_kwargs(
            AutoConfig.from_pretrained(path),
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
            dtype=torch.float32,
        )
    except ValueError as err:
        raise ValueError(f"{key} ({path}): {err}") from None


def head_dim(hf_config: Any) -> int:
    """d, the per-head width (``head_dim`` where the config has one, else hidden / heads)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def has_qkv_bias(hf_config: Any) -> bool:
    """Qwen2 always has q/k/v biases (and no output-projection bias)."""
    return hf_config.model_type == "qwen2"


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """The vocabulary rounded up to a multiple of ``tensor_parallel`` (each rank holds an equal slice)."""
    return -(-vocab_size // tensor_parallel) * tensor_parallel


def transformer_config_kwargs(
    hf_config: Any, *, tensor_parallel: int, dtype: torch.dtype, expert_parallel: int = 1
) -> dict[str, Any]:
    """Keyword arguments of Megatron's ``TransformerConfig`` equal to ``hf_config``'s architecture.

    Dropout is 0 (RL log-probs must equal the engine's) and every fused kernel is off: the CPU path has none, and the
    unfused ones compute the same function. Raises: ValueError as ``check_supported``, and for a tensor- or
    expert-parallel size that does not divide the heads or the experts.
    """
    check_supported(hf_config)
    experts = hf_config.num_experts if is_moe(hf_config) else 0
    if expert_parallel > 1 and (not experts or experts % expert_parallel):
        raise ValueError(
            f"train.megatron.expert_parallel_size {expert_parallel} must divide the model's experts per MoE layer "
            f"({experts or 'none: a dense model'}); use a divisor, or 1"
        )
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % tensor_parallel or groups % tensor_parallel:
        raise ValueError(
            f"train.megatron.tensor_parallel_size {tensor_parallel} must divide the model's attention heads ({heads}) "
            f"and key/value heads ({groups}); pick a divisor of both"
        )
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        qk_layernorm=hf_config.model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        # Megatron's MoE layers need sequence parallelism at tensor parallelism > 1
        sequence_parallel=is_moe(hf_config) and tensor_parallel > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **(_moe_kwargs(hf_config, expert_parallel) if is_moe(hf_config) else {}),
    )


def _moe_kwargs(hf_config: Any, expert_parallel: int) -> dict[str, Any]:
    """Qwen3-MoE's router and experts in Megatron's terms: softmax over the top-k logits equals HF's softmax, top-k
    and renormalization (``norm_topk_prob``); without renormalization the softmax runs before the top-k. No auxiliary
    load-balancing loss (the RL objective is the whole loss, as in the FSDP2 backend) and no token dropping."""
    return dict(
        num_moe_experts=hf_config.num_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_layer_freq=moe_layers(hf_config),
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        # all-gather (the all-to-all dispatcher needs CUDA streams); it gathers equal token counts, which
        # CausalLMView makes so under expert parallelism by padding each forward to the longest rank's length
        moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=expert_parallel,
    )


def gpt_model_kwargs(hf_config: Any, *, tensor_parallel: int) -> dict[str, Any]:
    """Keyword arguments of ``GPTModel`` (besides config and layer spec) for ``hf_config``; logits are gathered over
    the tensor-parallel ranks (``parallel_output=False``), so every rank sees the whole (padded) vocabulary."""
    return dict(
        vocab_size=padded_vocab_size(hf_config.vocab_size, tensor_parallel),
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        parallel_output=False,
    )


# -- full (unsharded) tensors ---------------------------------------------------------------------------------------
def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, groups: int) -> Tensor:
    """[H*d, ...], [G*d, ...], [G*d, ...] -> [G*(H/G + 2)*d, ...], per group [q_g; k_g; v_g]."""
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1
    ).reshape(-1, *rest)


def _split_qkv(qkv: Tensor, hf_config: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``_fuse_qkv``."""
    groups, d = hf_config.num_key_value_heads, head_dim(hf_config)
    per_group = hf_config.num_attention_heads // groups * d
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_rows(tensor: Tensor, rows: int) -> Tensor:
    return torch.nn.functional.pad(tensor, (0, 0, 0, rows - tensor.shape[0])) if rows > tensor.shape[0] else tensor


def hf_to_megatron(hf_state: Mapping[str, Tensor], hf_config: Any, *, tensor_parallel: int) -> dict[str, Tensor]:
    """Full Megatron tensors (name -> tensor, unsharded) from an HF state dict of a supported architecture.

    Raises: KeyError naming an HF tensor the conversion needs but ``hf_state`` lacks; ValueError for a tensor the
        conversion does not know (it would be silently dropped).
    """
    vocab = padded_vocab_size(hf_config.vocab_size, tensor_parallel)
    groups = hf_config.num_key_value_heads
    out: dict[str, Tensor] = {_EMBEDDING: _pad_rows(hf_state["model.embed_tokens.weight"], vocab)}
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    for name, tensor in hf_state.items():
        if name in ("model.embed_tokens.weight",) or (tied and name == "lm_head.weight"):
            continue
        if name in _TOP_RENAMES:
            out[_TOP_RENAMES[name]] = _pad_rows(tensor, vocab) if name == "lm_head.weight" else tensor
            continue
        match = _LAYER.match(name)
        if match is None:
            raise ValueError(f"train.backend megatron: no conversion for HF tensor {name!r}")
        layer, rest = match.groups()
        prefix = f"decoder.layers.{layer}."
        if rest in _LAYER_RENAMES:
            out[prefix + _LAYER_RENAMES[rest]] = tensor
        elif rest in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            kind = rest.rsplit(".", 1)[1]
            hf = f"model.layers.{layer}.self_attn."
            fused = _fuse_qkv(tensor, hf_state[f"{hf}k_proj.{kind}"], hf_state[f"{hf}v_proj.{kind}"], groups)
            out[prefix + f"self_attention.linear_qkv.{kind}"] = fused
        elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            fc = "linear_fc1" if rest.endswith("gate_up_proj") else "linear_fc2"
            for expert, weight in enumerate(tensor):
                out[prefix + f"mlp.experts.local_experts.{expert}.{fc}.weight"] = weight
        elif rest == "mlp.gate_proj.weight":
            up = hf_state[f"model.layers.{layer}.mlp.up_proj.weight"]
            out[prefix + "mlp.linear_fc1.weight"] = torch.cat([tensor, up])
        elif rest not in (
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.bias",
            "mlp.up_proj.weight",
        ):
            raise ValueError(f"train.backend megatron: no conversion for HF tensor {name!r}")
    return out


def megatron_to_hf(named: Iterable[tuple[str, Tensor]], hf_config: Any) -> Iterator[tuple[str, Tensor]]:
    """HF (name, tensor) pairs from full Megatron (name, tensor) pairs, one Megatron tensor at a time (a fused
    tensor yields its parts as views). Tied embeddings are yielded once, as ``model.embed_tokens.weight``, the way
    HF checkpoints store them. Raises: ValueError for a Megatron name without an HF counterpart."""
    vocab = hf_config.vocab_size
    hf_layer = {v: k for k, v in _LAYER_RENAMES.items()}
    hf_top = {v: k for k, v in _TOP_RENAMES.items()}
    experts: dict[str, dict[int, Tensor]] = {}  # HF name -> the layer's experts so far (yielded once all are there)
    for name, tensor in named:
        if name == _EMBEDDING:
            yield "model.embed_tokens.weight", tensor[:vocab]
            continue
        if name in hf_top:
            yield hf_top[name], tensor[:vocab] if name == "output_layer.weight" else tensor
            continue
        match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
        if match is None:
            raise ValueError(f"train.backend megatron: no HF name for Megatron tensor {name!r}")
        layer, rest = match.groups()
        prefix = f"model.layers.{layer}."
        expert = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$", rest)
        if expert is not None:
            hf_name = prefix + ("mlp.experts.gate_up_proj" if expert[2] == "linear_fc1" else "mlp.experts.down_proj")
            stacked = experts.setdefault(hf_name, {})
            stacked[int(expert[1])] = tensor
            if len(stacked) == hf_config.num_experts:
                parts = experts.pop(hf_name)
                yield hf_name, torch.stack([parts[e] for e in range(hf_config.num_experts)])
        elif rest in hf_layer:
            yield prefix + hf_layer[rest], tensor
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(tensor, hf_config)):
                yield f"{prefix}self_attn.{proj}.{kind}", part
        elif rest == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2)
            yield prefix + "mlp.gate_proj.weight", gate
            yield prefix + "mlp.up_proj.weight", up
        else:
            raise ValueError(f"train.backend megatron: no HF name for Megatron tensor {name!r}")
    if experts:
        raise ValueError(f"train.backend megatron: incomplete experts of {sorted(experts)[:2]}")


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def is_expert_name(name: str) -> bool:
    """Whether a Megatron name is one expert's weight (``...mlp.experts.local_experts.<e>...``)."""
    return _LOCAL_EXPERT.match(name) is not None


def global_expert_name(name: str, offset: int) -> str:
    """A rank's local expert name with its index shifted by ``offset`` (the first expert that rank holds under
    expert parallelism: ``ep_rank * experts / expert_parallel_size``); other names unchanged."""
    match = _LOCAL_EXPERT.match(name)
    return name if match is None else f"{match[1]}{int(match[2]) + offset}{match[3]}"


# -- tensor-parallel shards -----------------------------------------------------------------------------------------
def shard_of(full: Tensor, param: Tensor, *, rank: int, world: int) -> Tensor:
    """This tensor-parallel rank's slice of ``full`` for Megatron parameter ``param``.

    A parameter with ``tensor_model_parallel`` is split along ``partition_dim`` into ``world * stride`` chunks and
    rank r holds chunks r, r + world, ... (``partition_stride``: 2 for the fused gate/up of a gated MLP, so each
    rank holds [gate_r; up_r]); any other parameter is replicated. Raises: ValueError on a shape mismatch.
    """
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        shard = full
    else:
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
        shard = torch.cat(full.chunk(world * stride, dim=dim)[rank::world], dim=dim)
    if shard.shape != param.shape:
        raise ValueError(f"Megatron shard shape {tuple(shard.shape)} != parameter shape {tuple(param.shape)}")
    return shard


def full_from_shards(shards: list[Tensor], param: Tensor) -> Tensor:
    """Inverse of ``shard_of``: the full tensor from every rank's shard of ``param`` (in rank order)."""
    if not getattr(param, "tensor_model_parallel", False) or len(shards) == 1:
        return shards[0]
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)
