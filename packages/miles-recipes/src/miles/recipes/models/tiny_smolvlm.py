"""Tiny random-init SmolVLM twin (transformers' ``smolvlm``, the Idefics3 input layout), built offline.

SmolVLM / Idefics3 take each image as tiles: the image is resized so its longest side is ``size["longest_edge"]``,
cut into ``max_image_size`` squares (rows x cols) plus one global view of the whole image, and every tile goes
through a SigLIP-style vision tower; a connector pixel-shuffles each tile's patches (``scale_factor`` per side) into
``image_seq_len`` tokens of the language model's width. The processor's pixels are ``pixel_values`` [B, N, C, H, W]
with ``pixel_attention_mask`` [B, N, H, W] (N tiles, H = W = ``max_image_size``), not Qwen-VL's flat patches.

The twin at toy sizes: a 2-layer Llama of width 16 (2 heads of 8, tied embeddings), a 2-layer vision tower of
width 16 (8 px patches on 32 px tiles), scale factor 2, so a tile is 4 tokens; the image processor (PIL backend, no
torchvision) resizes pictures to a longest side of 64 px and splits them into 32 px tiles: a 64 x 64 picture is 2 x 2
tiles plus the global view, 5 tiles, 20 image tokens. SmolLM2-135M-Instruct's tokenizer (SmolVLM's own is SmolLM2's
too) with SmolVLM's image tokens added (``<image>``, ``<fake_token_around_image>``, ``<global-img>``, ``<row_R_col_C>``
for up to 2 x 2 tiles, ``<end_of_utterance>``, the end-of-turn token the engine stops on) and SmolVLM's chat template
(``User:<image>...<end_of_utterance>\\nAssistant:``). About 0.8 M parameters, nearly all the 49 k x 16 embedding.
Registered as ``tiny-smolvlm``; built once into the model cache by an atomic rename.
"""

from __future__ import annotations

import logging
from pathlib import Path

from miles.recipes.models.cache import ensure_built
from miles.recipes.models.smollm2 import ensure_smollm2

logger = logging.getLogger(__name__)

MODEL_NAME = "tiny-smolvlm"
VERSION = 1  # bump when the build changes: a new cache directory
SEED = 0
TILE = 32  # max_image_size: the side of every tile, in pixels
LONGEST_EDGE = 64  # pictures are resized to this longest side, then split into TILE squares (at most 2 x 2)
MAX_TILES_PER_SIDE = LONGEST_EDGE // TILE
IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
TEXT = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, max_position_embeddings=2048, tie_word_embeddings=True)  # fmt: skip
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
              patch_size=8)  # fmt: skip
SCALE_FACTOR = 2  # the connector merges 2 x 2 patches: (32 / 8)**2 / 2**2 = 4 tokens per tile
# SmolVLM's chat template (transformers' processing_smolvlm DEFAULT_CHAT_TEMPLATE, images only), with Miles'
# "image_url" parts rendered as images too.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] in ('image', 'image_url') %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def image_tokens() -> list[str]:
    """The tokens SmolVLM's processor writes around images (the placeholder, its markers, the tile positions)."""
    tiles = [f"<row_{r}_col_{c}>" for r in range(1, MAX_TILES_PER_SIDE + 1) for c in range(1, MAX_TILES_PER_SIDE + 1)]
    return [FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN, *tiles]


def build_tiny_smolvlm(path: Path) -> Path:
    """Write the tiny SmolVLM (fp32 safetensors, config, tokenizer with SmolVLM's image tokens and chat template,
    the PIL image processor) into ``path``.

    Raises: what ``ensure_smollm2`` raises without its package.
    """
    import torch
    from transformers import AutoTokenizer, SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [*image_tokens(), END_OF_UTTERANCE], "eos_token": END_OF_UTTERANCE}
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = SmolVLMConfig(
        text_config=dict(
            model_type="llama",
            **TEXT,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=VISION,
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    model = SmolVLMForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    SmolVLMImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}, do_image_splitting=True
    ).save_pretrained(path)
    return path


def ensure_tiny_smolvlm(cache_dir: Path | None = None) -> Path:
    """The HF model directory of the tiny SmolVLM, built into the cache on first use (atomic rename, ~2 s).

    Raises: what ``build_tiny_smolvlm`` raises.
    """
    return ensure_built(f"{MODEL_NAME}-v{VERSION}", build_tiny_smolvlm, logger=logger, cache_dir=cache_dir)
