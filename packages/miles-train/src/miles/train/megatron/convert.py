"""HF causal LMs <-> Megatron-core ``GPTModel``: the model config, parameter names and layouts, tensor-parallel shards.

Supported HF architectures: the dense decoders ``llama``, ``mistral`` (without a sliding window), ``qwen2`` (q/k/v
biases), ``qwen3`` (per-head q/k RMSNorm), and the MoE decoders ``qwen3_moe`` (softmax top-k router, dense layers
where ``mlp_only_layers`` / ``decoder_sparse_step`` say) and ``deepseek_v3`` (DeepSeek-V3 / Kimi K2: multi-head
latent attention, a sigmoid router with group-limited top-k, score-correction bias and scaling, shared experts, the
first ``first_k_dense_replace`` layers dense). Layouts that differ between the two sides:

- attention: HF ``q_proj`` [H*d, h], ``k_proj``/``v_proj`` [G*d, h] -> Megatron ``linear_qkv`` [G*(H/G + 2)*d, h],
  grouped per query group g as [q heads of g; k_g; v_g] (biases the same way);
- MLP: HF ``gate_proj``/``up_proj`` [f, h] -> ``linear_fc1`` [2f, h] = [gate; up] (Megatron's gated linear unit
  computes act(x W1[:f]) * (x W1[f:]));
- MoE experts: HF ``mlp.experts.gate_up_proj`` [E, 2f, h] / ``down_proj`` [E, h, f] (transformers 5 holds each
  layer's experts fused) -> ``mlp.experts.local_experts.<e>.linear_fc1`` [2f, h] / ``linear_fc2`` [h, f]; the router
  ``mlp.gate`` -> ``mlp.router``;
- vocabulary: padded with zero rows to a multiple of the tensor-parallel size (``padded_vocab_size``); the padding is
  dropped from the logits and from the weights sent back to HF;
- tied embeddings: one ``embedding.word_embeddings.weight``, no ``output_layer`` (HF ``tie_word_embeddings``);
- MLA (DeepSeek-V3): every projection keeps its layout (``q_a_proj`` -> ``linear_q_down_proj``, ``q_b_proj`` ->
  ``linear_q_up_proj``, ``kv_a_proj_with_mqa`` -> ``linear_kv_down_proj``, ``kv_b_proj`` -> ``linear_kv_up_proj``,
  their RMSNorms -> ``q_layernorm`` / ``kv_layernorm``); Megatron's MLA de-interleaves the rotary half of q and k
  before rotating it, which is HF's ``rope_interleave``; the router's ``e_score_correction_bias`` is Megatron's
  ``expert_bias`` buffer (kept fixed: ``moe_router_bias_update_rate`` 0), shared experts' gate/up/down are fused like
  a dense MLP's.

Names are those of Megatron's local layer specs (``get_gpt_decoder_block_spec(use_transformer_engine=False)``:
separate ``input_layernorm`` and ``pre_mlp_layernorm`` modules, ``SequentialMLP`` experts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
MOE_MODEL_TYPES = ("qwen3_moe", "deepseek_v3")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF names inside model.layers.<i>. whose tensor is copied as is -> Megatron names inside decoder.layers.<i>.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
}
# Qwen3's per-head q/k norms; MLA's names (DeepSeek-V3) instead, where q_layernorm is q_a_proj's norm
_QK_NORM_RENAMES = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
_MLA_RENAMES = {
    "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",  # without q_lora_rank
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
}
# a gated MLP's gate/up -> linear_fc1 = [gate; up]
_GATE_UP = {"mlp.gate_proj.weight": "mlp.linear_fc1.weight",
            "mlp.shared_experts.gate_proj.weight": "mlp.shared_experts.linear_fc1.weight"}  # fmt: skip
# Megatron buffers that hold HF weights (the rest of a model's buffers are derived: rotary tables, counters)
WEIGHT_BUFFERS = ("mlp.router.expert_bias",)
_TOP_RENAMES = {"model.norm.weight": "decoder.final_layernorm.weight", "lm_head.weight": "output_layer.weight"}
_EMBEDDING = "embedding.word_embeddings.weight"


def _layer_renames(hf_config: Any) -> dict[str, str]:
    """HF name inside a decoder layer -> Megatron name, for the tensors copied as they are."""
    return _LAYER_RENAMES | (_MLA_RENAMES if is_mla(hf_config) else _QK_NORM_RENAMES)


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "yarn" and is_mla(hf_config):
        _yarn_kwargs(hf_config)
    elif rope_type != "default":
        raise ValueError(
            f"train.backend megatron: rope type {rope_type!r} of this model is not converted yet (only the default "
            "RoPE); use --train.backend fsdp2"
        )
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def _yarn_kwargs(hf_config: Any) -> dict[str, Any]:
    """DeepSeek-V3's YaRN RoPE (``rope_parameters`` type "yarn") as ``MLATransformerConfig`` fields; {} for the
    default RoPE. Megatron's MLA scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the
    softmax by mscale(factor, mscale_all_dim)^2, as HF's DeepSeek-V3 does."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "yarn":
        return {}
    # "type": the legacy name of rope_type, which HF keeps beside it for configs that still write it (DeepSeek-V3's)
    known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor"}  # fmt: skip
    unknown = set(params) - known
    if unknown or params.get("truncate", True) is False or params.get("attention_factor") is not None:
        raise ValueError(
            f"train.backend megatron: YaRN rope_parameters {sorted(unknown) or 'truncate / attention_factor'} are not "
            "converted yet; use --train.backend fsdp2"
        )
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ValueError(
            "train.backend megatron: YaRN rope_parameters without original_max_position_embeddings; add it to the "
            "model's config.json"
        )
    factor = params.get("factor") or hf_config.max_position_embeddings / original  # HF's fallback
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        # cos/sin scale: HF takes mscale(factor, mscale) / mscale(factor, mscale_all_dim) only when both are set,
        # else mscale(factor); Megatron does the same when its mscale is None
        mscale=float(mscale) if mscale and mscale_all_dim else None,
        mscale_all_dim=float(mscale_all_dim or 0.0),  # the softmax scale's: 0 leaves it 1/sqrt(d), as in HF
    )


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
    if model_type == "deepseek_v3":
        _check_deepseek(hf_config)
    _rope_theta(hf_config)


def _check_deepseek(hf_config: Any) -> None:
    """What Megatron's MLA and sigmoid router compute differently from HF's DeepSeek-V3 unless these hold."""
    top_k, groups, group_top_k = hf_config.num_experts_per_tok, hf_config.n_group or 1, hf_config.topk_group or 1
    refusals = (
        # Megatron's MLA always de-interleaves the rotary half (HF's rope_interleave true)
        (not getattr(hf_config, "rope_interleave", True), "rope_interleave false"),
        # Megatron renormalizes a sigmoid router's top-k weights exactly when top_k > 1
        (top_k > 1 and not hf_config.norm_topk_prob, "norm_topk_prob false"),
        (top_k == 1 and hf_config.norm_topk_prob, "norm_topk_prob true with num_experts_per_tok 1"),
        # HF builds zero-width shared experts; Megatron builds none, so their (empty) weights would not map
        (not hf_config.n_shared_experts, "n_shared_experts 0"),
        # group scores: HF sums each group's top 2 scores, Megatron its top (top_k / topk_group)
        (groups > group_top_k and top_k // group_top_k != 2, "num_experts_per_tok / topk_group != 2 with n_group > 1"),
        (num_experts(hf_config) % groups != 0, "n_routed_experts not a multiple of n_group"),
    )
    for refused, what in refusals:
        if refused:
            raise ValueError(
                f"train.backend megatron: this DeepSeek-V3 config has {what}, which Megatron's MLA / router would "
                "compute differently; use --train.backend fsdp2"
            )


def is_moe(hf_config: Any) -> bool:
    return hf_config.model_type in MOE_MODEL_TYPES


def is_mla(hf_config: Any) -> bool:
    """Whether the model's attention is multi-head latent attention (DeepSeek-V3 / Kimi K2)."""
    return hf_config.model_type == "deepseek_v3"


def num_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer (``num_experts``, DeepSeek's ``n_routed_experts``); 0 for a dense model."""
    if not is_moe(hf_config):
        return 0
    return int(getattr(hf_config, "num_experts", None) or hf_config.n_routed_experts)


def moe_layers(hf_config: Any) -> list[int]:
    """1 for each decoder layer with experts, 0 for a dense one (Megatron's ``moe_layer_freq``): Qwen3-MoE's
    ``mlp_only_layers`` / ``decoder_sparse_step``, DeepSeek-V3's first ``first_k_dense_replace`` layers dense."""
    if not is_moe(hf_config):
        return [0] * hf_config.num_hidden_layers
    if hf_config.model_type == "deepseek_v3":
        return [int(i >= hf_config.first_k_dense_replace) for i in range(hf_config.num_hidden_layers)]
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return [int(i not in dense and (i + 1) % step == 0) for i in range(hf_config.num_hidden_layers)]


def check_model_dir(
    path: Any,
    *,
    tensor_parallel: int,
    expert_parallel: int,
    key: str,
    pipeline_parallel: int = 1,
    trust_remote_code: bool = False,
) -> None:
    """Check, from its ``config.json`` alone, that the HF model at ``path`` converts with these parallel sizes, and
    that megatron-core is installed: what would otherwise fail only once the trainer builds. ``trust_remote_code``
    (the model's ``models.*.trust_remote_code``) lets a config class of the checkpoint's own load.

    Raises: ValueError, one line naming ``key`` (the config key of the model) and the fix.
    """
    import importlib.util

    from transformers import AutoConfig

    if importlib.util.find_spec("megatron.core") is None:
        raise ValueError(
            "train.backend megatron needs megatron-core: install the extra (pip install 'miles-train[megatron]'; "
            "the workspace's uv sync has it), or use --train.backend fsdp2"
        )
    from miles.train.megatron.vision import language_config  # (vision imports this module)

    try:
        transformer_config_kwargs(
            language_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)),
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
            pipeline_parallel=pipeline_parallel,
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
    hf_config: Any, *, tensor_parallel: int, dtype: torch.dtype, expert_parallel: int = 1, pipeline_parallel: int = 1
) -> dict[str, Any]:
    """Keyword arguments of Megatron's ``TransformerConfig`` equal to ``hf_config``'s architecture.

    Dropout is 0 (RL log-probs must equal the engine's) and every fused kernel is off: the CPU path has none, and the
    unfused ones compute the same function. Raises: ValueError as ``check_supported``, for a tensor- or
    expert-parallel size that does not divide the heads or the experts, for a pipeline-parallel size that does not
    divide the layers, and for pipeline and expert parallelism together (not wired yet).
    """
    check_supported(hf_config)
    experts = num_experts(hf_config)
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
    layers = hf_config.num_hidden_layers
    if pipeline_parallel > 1 and layers % pipeline_parallel:
        raise ValueError(
            f"train.megatron.pipeline_parallel_size {pipeline_parallel} must divide the model's layers ({layers}): "
            "each stage holds as many; pick a divisor"
        )
    # Megatron's pipeline schedule: the loss the backend hands it is already divided by the global counts (per-token:
    # the schedule divides nothing); see pipeline_config for the micro-batches' lengths
    pipeline = dict(
        pipeline_model_parallel_size=pipeline_parallel, pipeline_dtype=dtype, calculate_per_token_loss=True,
    ) if pipeline_parallel > 1 else {}  # fmt: skip
    return dict(
        num_layers=layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
        if is_mla(hf_config)
        else head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        # Qwen3's per-head q/k norms; MLA's q_a / kv_a norms (Megatron's q_layernorm / kv_layernorm)
        qk_layernorm=hf_config.model_type in ("qwen3", "qwen3_moe") or is_mla(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        **pipeline,
        # Megatron's MoE layers need sequence parallelism at tensor parallelism > 1
        # (and MLA's, whose whole-weight down-projections see each rank's sequence chunk: see cpu.py)
        sequence_parallel=(is_moe(hf_config) or is_mla(hf_config)) and tensor_parallel > 1,
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
        **(_mla_kwargs(hf_config) if is_mla(hf_config) else {}),
    )


def pipeline_config(config: Any) -> Any:
    """``config`` (a built ``TransformerConfig``) set for Megatron's pipeline schedule with micro-batches of any
    length: their activations' shapes travel with them (``variable_seq_lengths``). Set after validation, which
    refuses it with the all-gather token dispatcher (for MoE layers it would gather unequal token counts over the
    expert-parallel ranks; pipelines run at expert parallelism 1, and ``CausalLMView`` pads a forward to equal
    lengths wherever the dispatcher gathers)."""
    if config.pipeline_model_parallel_size > 1:
        config.variable_seq_lengths = True
    return config


def config_class(hf_config: Any) -> type:
    """Megatron's config class for ``hf_config``: ``MLATransformerConfig`` for MLA models, else
    ``TransformerConfig``; call it with ``transformer_config_kwargs``."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if is_mla(hf_config) else TransformerConfig


def _mla_kwargs(hf_config: Any) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention: low-rank q (``q_lora_rank``; None projects q directly) and kv
    (``kv_lora_rank``), per-head ``qk_nope_head_dim`` + ``qk_rope_head_dim`` query/key width, ``v_head_dim`` values,
    softmax scale 1/sqrt(nope + rope) (Megatron's for ``rope_type`` "rope")."""
    return dict(
        multi_latent_attention=True,
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        rotary_base=_rope_theta(hf_config),
        **({"rope_type": "rope"} | _yarn_kwargs(hf_config)),
    )


def _moe_kwargs(hf_config: Any, expert_parallel: int) -> dict[str, Any]:
    """The router and experts in Megatron's terms. Qwen3-MoE: softmax over the top-k logits equals HF's softmax,
    top-k and renormalization (``norm_topk_prob``); without renormalization the softmax runs before the top-k.
    DeepSeek-V3: sigmoid scores, top-k of score + ``e_score_correction_bias`` within the best ``topk_group`` of
    ``n_group`` groups, weights renormalized and times ``routed_scaling_factor``, shared experts beside; the bias is
    not updated by training (``moe_router_bias_update_rate`` 0: the engine routes with the bias it was given).
    No auxiliary load-balancing loss (the RL objective is the whole loss, as in the FSDP2 backend) and no token
    dropping."""
    if hf_config.model_type == "deepseek_v3":
        groups = hf_config.n_group or 1
        router = dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=hf_config.topk_group if groups > 1 else None,
            moe_router_topk_scaling_factor=hf_config.routed_scaling_factor,
            moe_shared_expert_intermediate_size=hf_config.moe_intermediate_size * hf_config.n_shared_experts
            if hf_config.n_shared_experts
            else None,
        )
    else:
        router = dict(moe_router_pre_softmax=not hf_config.norm_topk_prob, moe_router_score_function="softmax")
    return dict(
        num_moe_experts=num_experts(hf_config),
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_layer_freq=moe_layers(hf_config),
        **router,
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
    groups, mla = hf_config.num_key_value_heads, is_mla(hf_config)
    up_names = {f"mlp.{p}up_proj.weight" for p in ("", "shared_experts.")}
    renames = _layer_renames(hf_config)
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
        if rest in renames:
            out[prefix + renames[rest]] = tensor
        elif rest in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            kind = rest.rsplit(".", 1)[1]
            hf = f"model.layers.{layer}.self_attn."
            fused = _fuse_qkv(tensor, hf_state[f"{hf}k_proj.{kind}"], hf_state[f"{hf}v_proj.{kind}"], groups)
            out[prefix + f"self_attention.linear_qkv.{kind}"] = fused
        elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            fc = "linear_fc1" if rest.endswith("gate_up_proj") else "linear_fc2"
            for expert, weight in enumerate(tensor):
                out[prefix + f"mlp.experts.local_experts.{expert}.{fc}.weight"] = weight
        elif rest in _GATE_UP:
            up = hf_state[f"model.layers.{layer}.{rest.replace('gate_proj', 'up_proj')}"]
            out[prefix + _GATE_UP[rest]] = torch.cat([tensor, up])
        elif rest in up_names:
            continue  # fused with its gate_proj above
        elif mla or rest not in (
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.bias",
        ):
            raise ValueError(f"train.backend megatron: no conversion for HF tensor {name!r}")
    return out


def megatron_to_hf(named: Iterable[tuple[str, Tensor]], hf_config: Any) -> Iterator[tuple[str, Tensor]]:
    """HF (name, tensor) pairs from full Megatron (name, tensor) pairs, one Megatron tensor at a time (a fused
    tensor yields its parts as views). Tied embeddings are yielded once, as ``model.embed_tokens.weight``, the way
    HF checkpoints store them. Raises: ValueError for a Megatron name without an HF counterpart."""
    vocab, experts_per_layer = hf_config.vocab_size, num_experts(hf_config)
    hf_layer = {v: k for k, v in _layer_renames(hf_config).items()}
    hf_gate = {v: k for k, v in _GATE_UP.items()}
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
            if len(stacked) == experts_per_layer:
                parts = experts.pop(hf_name)
                yield hf_name, torch.stack([parts[e] for e in range(experts_per_layer)])
        elif rest in hf_layer:
            yield prefix + hf_layer[rest], tensor
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(tensor, hf_config)):
                yield f"{prefix}self_attn.{proj}.{kind}", part
        elif rest in hf_gate:
            gate, up = tensor.chunk(2)
            yield prefix + hf_gate[rest], gate
            yield prefix + hf_gate[rest].replace("gate_proj", "up_proj"), up
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
