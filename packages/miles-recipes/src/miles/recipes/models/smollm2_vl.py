"""SmolLM2-VL: SmolLM2-135M-Instruct's language model under a small random vision tower, a Qwen2-VL (``qwen2_vl``).

A vision-language model that already answers in words, built offline (no VLM weights ship with Miles): Qwen2-VL's
language model is Qwen2, which is Llama with q/k/v biases, so SmolLM2's weights load into it unchanged with those
biases zero, and multimodal RoPE (sections [16, 8, 8] of the 32 rotary pairs) reduces to SmolLM2's RoPE on text,
where a token's three position components are equal: on text-only prompts its logits equal SmolLM2's exactly. The
vision tower is random (2 blocks of width 64, 16 px patches, 2 x 2 merged into one token of width 576: 0.38 M
parameters); Qwen-VL's vision tokens are added to SmolLM2's tokenizer (their embeddings start at the vocabulary's
mean), with the ChatML template of the tiny VLM twin and Qwen-VL's image processor for 32-64 px pictures.

It is what vision-language RL on a CPU can learn with: the language model knows the answer words, the vision tower
and the projector must learn to carry what the question asks about. Registered as ``smollm2-vl``; built once into
the model cache by an atomic rename.
"""

from __future__ import annotations

import logging
from pathlib import Path

from miles.recipes.models.cache import ensure_built
from miles.recipes.models.smollm2 import ensure_smollm2

logger = logging.getLogger(__name__)

MODEL_NAME = "smollm2-vl"
VERSION = 1  # bump when the build changes: a new cache directory
SEED = 0
VISION = dict(depth=2, embed_dim=64, num_heads=4, mlp_ratio=2, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2)  # fmt: skip
MROPE_SECTION = [16, 8, 8]  # temporal, height, width rotary pairs; 32 = SmolLM2's head_dim / 2


def build_smollm2_vl(path: Path) -> Path:
    """Write SmolLM2-VL (fp32 safetensors, config, tokenizer with vision tokens, chat template, image processor)
    into ``path``.

    Raises: what ``ensure_smollm2`` raises without its package; RuntimeError if SmolLM2's weights do not all load.
    """
    import torch
    from miles.recipes.models.tiny import IMAGE_PROCESSOR, VISION_TOKENS, VLM_CHAT_TEMPLATE
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    source = ensure_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(source)
    text = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    base_vocab = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    lm = text.config
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=lm.hidden_size,
            intermediate_size=lm.intermediate_size,
            num_hidden_layers=lm.num_hidden_layers,
            num_attention_heads=lm.num_attention_heads,
            num_key_value_heads=lm.num_key_value_heads,
            rms_norm_eps=lm.rms_norm_eps,
            max_position_embeddings=lm.max_position_embeddings,
            rope_parameters=dict(
                rope_type="default", rope_theta=lm.rope_parameters["rope_theta"], mrope_section=MROPE_SECTION
            ),  # fmt: skip
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(**VISION, hidden_size=lm.hidden_size),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    model = Qwen2VLForConditionalGeneration(config)
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in text.state_dict().items()
               if k != "lm_head.weight"}  # fmt: skip
    embed = weights["model.language_model.embed_tokens.weight"]  # [V, H]
    new_rows = embed.mean(dim=0, keepdim=True).expand(len(tokenizer) - base_vocab, -1)
    weights["model.language_model.embed_tokens.weight"] = torch.cat([embed, new_rows])
    missing, unexpected = model.load_state_dict(weights, strict=False)
    biases = ("q_proj.bias", "k_proj.bias", "v_proj.bias")
    unloaded = [
        k for k in missing if not k.startswith("model.visual.") and not k.endswith(biases) and k != "lm_head.weight"
    ]
    if unexpected or unloaded:
        raise RuntimeError(f"SmolLM2 -> Qwen2-VL: unexpected {unexpected[:3]}, not loaded {unloaded[:3]}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.language_model.") and name.endswith(biases):
                param.zero_()  # Llama has none: with zero biases Qwen2 attention is Llama's
    model.tie_weights()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(path)
    return path


def ensure_smollm2_vl(cache_dir: Path | None = None) -> Path:
    """The HF model directory of SmolLM2-VL, built into the cache on first use (atomic rename, ~10 s).

    Raises: what ``build_smollm2_vl`` raises.
    """
    return ensure_built(f"{MODEL_NAME}-v{VERSION}", build_smollm2_vl, logger=logger, cache_dir=cache_dir)
