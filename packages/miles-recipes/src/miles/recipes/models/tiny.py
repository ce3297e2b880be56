"""Tiny random-init twins of the model families Miles' recipes target, for running a recipe's whole loop on a CPU.

A twin has its family's HF architecture (``model_type``, attention and MoE layout: Qwen3's q/k norms, Qwen3-MoE's
softmax router, DeepSeek-V3 / Kimi K2's multi-head latent attention and sigmoid group-limited router with shared
experts, GLM-5's DSA attention, Qwen3.5's hybrid Gated DeltaNet + gated attention, DeepSeek-V4's compressed
attention and hash-routed first layer) at toy sizes: 3 decoder layers of width 32, 8 experts of which 2 per token,
layer 0 dense where the family has dense layers. Its tokenizer and chat template are SmolLM2-135M-Instruct's
(shipped offline with Miles; the families' own tokenizers are not), so the vocabulary (49,152) dominates its
~1.6-1.8 M parameters (tied embeddings). Weights are drawn from a fixed seed, routers with std 1 (HF initializes
them near zero, where every token's experts would tie).
A twin learns nothing useful; it shows the recipe's loop, conversions and routing replay run for that architecture.

The vision-language twin (``qwen3-vl``, transformers' ``qwen3_vl``) adds a 2-block vision tower (16 px patches, 2 x 2
merged into one token, DeepStack features from block 1) to a Qwen3 text model, SmolLM2's tokenizer with Qwen-VL's
vision tokens added (``<|vision_start|>``, ``<|image_pad|>``, ...), a ChatML chat template that renders an image part
as ``<|vision_start|><|image_pad|><|vision_end|>`` (as Qwen3-VL's does), and Qwen-VL's image processor sized for
small pictures (32 x 32 to 64 x 64 pixels: a 64 px image becomes 4 tokens). The Qwen3.5 and Kimi K2.5 twins (Kimi
K2.5 / K2.6: transformers' ``kimi_k25``, a 2-layer MoonViT-style tower and ``mm_projector`` over the DeepSeek-V3
twin's language model) carry the same tokens, template and image processor; their recipes train on text. Kimi's
own tokenizer (tiktoken, remote code) and image processor (torchvision) are not available offline, and Miles' image
inputs (``pixel_values`` [P, D]) are not the [P, 3, p, p] patches Kimi's tower takes: image prompts on that twin are
not supported.

Each twin is built once into the model cache (``default_cache_dir()/tiny-<family>-v1``) and published by an atomic
rename; ``miles train --recipe NAME --tiny`` (the recipe's ``tiny`` section) and ``--models.policy.path
tiny-<family>`` use them.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.recipes.models.cache import ensure_built
from miles.recipes.models.smollm2 import ensure_smollm2

logger = logging.getLogger(__name__)

VERSION = 1  # bump when a twin's config or init changes: a new cache directory, old ones untouched
SEED = 0
_COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
_MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)
_MLA = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8)  # fmt: skip
_DEEPSEEK_ROUTER = dict(n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1)
_DEEPSEEK_V3 = dict(**_MLA, **_MOE, **_DEEPSEEK_ROUTER, routed_scaling_factor=2.5)  # also Kimi K2.5's language model
# Qwen3.5's hybrid layout at 3 layers: Gated DeltaNet linear attention, then gated full attention (3:1 in the models)
_QWEN3_5 = dict(num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention", "linear_attention", "full_attention"],
                rope_parameters=dict(rope_type="default", partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
                                     mrope_interleaved=True))  # fmt: skip
# Vision-language twins: the released checkpoints of these families hold a vision tower (Qwen3.5, Qwen3.6 and Kimi
# K2.5 are natively multimodal), so their twins do too; text recipes train them on text prompts.
VISION_MODEL_TYPES = ("qwen3_vl", "qwen3_5", "qwen3_5_moe", "kimi_k25")


@dataclass(frozen=True)
class TinyFamily:
    """One family's twin: the HF ``model_type`` and its config fields, and the public models it stands for."""

    model_type: str
    config: dict[str, Any]
    twin_of: str


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=_COMMON["hidden_size"],
    num_position_embeddings=64,
    deepstack_visual_indexes=[1],
)
_QWEN3_5_VISION = {k: v for k, v in _VISION.items() if k != "deepstack_visual_indexes"}  # no DeepStack in Qwen3.5
# Kimi K2.5's MoonViT-style tower (kimi_k25_vision: learned 2-D position grid, 2 x 2 patch merger, then a projector
# into the DeepSeek-V3 language model), at the same toy sizes
_KIMI_K25_VISION = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                        patch_size=16, pos_emb_height=4, pos_emb_width=4, merge_kernel_size=[2, 2])  # fmt: skip
_VISION_CONFIGS = {"qwen3_vl": _VISION, "qwen3_5": _QWEN3_5_VISION, "qwen3_5_moe": _QWEN3_5_VISION,
                   "kimi_k25": _KIMI_K25_VISION}  # fmt: skip
_VISION_EXTRA = {"kimi_k25": dict(projection_hidden_size=_KIMI_K25_VISION["hidden_size"])}  # the projector's norm
IMAGE_PROCESSOR = dict(patch_size=16, merge_size=2, temporal_patch_size=2,
                        size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64})  # fmt: skip
# ChatML as SmolLM2's, with Qwen-VL's rendering of image parts (no default system prompt, as Qwen's).
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

FAMILIES: dict[str, TinyFamily] = {
    "qwen3": TinyFamily("qwen3", dict(num_key_value_heads=2, head_dim=8), "Qwen3 dense (Qwen/Qwen3-0.6B ... 32B)"),
    "qwen3-vl": TinyFamily(
        "qwen3_vl",
        dict(
            num_key_value_heads=2,
            head_dim=8,
            rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1], mrope_interleaved=True),
        ),
        "Qwen3-VL (Qwen/Qwen3-VL-2B-Instruct ... 235B-A22B; transformers qwen3_vl)",
    ),  # fmt: skip
    "qwen3-moe": TinyFamily(
        "qwen3_moe",
        dict(num_key_value_heads=2, head_dim=8, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0], **_MOE),
        "Qwen3-MoE (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B)",
    ),
    "deepseek-v3": TinyFamily(
        "deepseek_v3",
        dict(_DEEPSEEK_V3),
        "DeepSeek-V3 / Kimi K2 (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct)",
    ),
    "kimi-k2.5": TinyFamily(
        "kimi_k25",
        dict(_DEEPSEEK_V3),
        "Kimi K2.5 / K2.6 (moonshotai/Kimi-K2.5, moonshotai/Kimi-K2.6; kimi_k25: a vision tower over deepseek_v3)",
    ),
    "glm-5": TinyFamily(
        "glm_moe_dsa",
        dict(
            **_MLA,
            **_MOE,
            **_DEEPSEEK_ROUTER,
            head_dim=8,
            index_topk=8,
            index_head_dim=8,
            index_n_heads=2,
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),  # fmt: skip
        "GLM-5 / GLM-5.1 (glm_moe_dsa: DSA attention, the DeepSeek-V3 router)",
    ),
    "qwen3.5": TinyFamily(
        "qwen3_5",
        dict(_QWEN3_5),
        "Qwen3.5 / Qwen3.6 dense (Qwen/Qwen3.5-27B, Qwen/Qwen3.6-27B; qwen3_5: a vision tower over qwen3_5_text)",
    ),
    "qwen3.5-moe": TinyFamily(
        "qwen3_5_moe",
        dict(**_QWEN3_5, **_MOE, num_experts=8, shared_expert_intermediate_size=16),
        "Qwen3.5 / Qwen3.6 MoE (Qwen/Qwen3.5-35B-A3B ... 397B-A17B, Qwen/Qwen3.6-35B-A3B; qwen3_5_moe)",
    ),
    "deepseek-v4": TinyFamily(
        "deepseek_v4",
        dict(
            **_MOE,
            num_key_value_heads=1,
            head_dim=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            n_routed_experts=8,
            n_shared_experts=1,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=2,
            index_head_dim=8,
            index_topk=8,
            sliding_window=8,
            num_nextn_predict_layers=0,  # no multi-token-prediction layer (transformers does not run it)
            mlp_layer_types=["hash_moe", "moe", "moe"],
            layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        ),
        "DeepSeek-V4 (deepseek_v4: compressed sparse attention, hash-routed first layers, sqrt(softplus) router)",
    ),
}


def model_name(family: str) -> str:
    """The registered model name of a family's twin: ``tiny-<family>``."""
    return f"tiny-{family}"


def tiny_config(family: str, tokenizer: Any, *, text_overrides: dict[str, Any] | None = None) -> Any:
    """The HF config of ``family``'s twin sized for ``tokenizer`` (vocabulary, special ids); ``text_overrides``
    replace fields of the (text model's) config, e.g. a wider ``head_dim`` for an engine whose attention kernels
    need one (vLLM's CPU attention takes head_dim 32, 64, 80, ...; the twins' is 8). The registered twins use none.

    Raises: ValueError naming the known families.
    """
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"no tiny twin of family {family!r}; families: {sorted(FAMILIES)}")
    spec = FAMILIES[family]
    if spec.model_type in VISION_MODEL_TYPES:
        ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
        text = dict(**_COMMON, **spec.config, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        text.update(text_overrides or {})
        return AutoConfig.for_model(
            spec.model_type,
            text_config=text,
            vision_config=_VISION_CONFIGS[spec.model_type],
            **_VISION_EXTRA.get(spec.model_type, {}),
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=True,
        )
    fields = dict(**_COMMON, **spec.config, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return AutoConfig.for_model(spec.model_type, **{**fields, **(text_overrides or {})})


def build_tiny(family: str, path: Path, *, text_overrides: dict[str, Any] | None = None) -> Path:
    """Write ``family``'s twin (fp32 safetensors, config, SmolLM2's tokenizer and chat template; for the VLM twin
    the vision tokens, its chat template and image processor too) into ``path``; ``text_overrides``: see
    ``tiny_config`` (a variant for a test, not a registered twin)."""
    import torch
    from miles.core.multimodal import auto_model_class
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    vision = FAMILIES[family].model_type in VISION_MODEL_TYPES
    if vision:
        tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
        tokenizer.chat_template = VLM_CHAT_TEMPLATE
    torch.manual_seed(SEED)
    config = tiny_config(family, tokenizer, text_overrides=text_overrides)
    model = auto_model_class(config).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # routers: far enough from 0 that tokens pick distinct experts
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash routing table: top_k distinct experts per token id
                experts = torch.rand(buffer.shape[0], config.n_routed_experts).argsort(-1)
                buffer.copy_(experts[:, : buffer.shape[1]])
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if vision:
        from transformers import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(path)
    return path


def ensure_tiny(family: str, cache_dir: Path | None = None) -> Path:
    """The HF model directory of ``family``'s twin, built into the cache on first use (a temporary sibling
    directory, then an atomic rename: a crash never leaves a half-written model).

    Raises: ValueError naming the known families; what ``ensure_smollm2`` raises without its package.
    """
    if family not in FAMILIES:
        raise ValueError(f"no tiny twin of family {family!r}; families: {sorted(FAMILIES)}")
    build = functools.partial(build_tiny, family)
    return ensure_built(f"{model_name(family)}-v{VERSION}", build, logger=logger, cache_dir=cache_dir)
