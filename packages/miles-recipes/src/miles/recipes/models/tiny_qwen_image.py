"""``tiny-qwen-image``: a random QwenImagePipeline shaped like Qwen-Image (a dual-stream MMDiT over 2 x 2 packed
latent patches with 3-axis RoPE, a Qwen2.5-VL text encoder read through its chat template, the Wan-style causal 3-D
VAE with per-channel latent mean / std, and the dynamically shifted flow schedule), small enough for a CPU, built
offline: its Qwen2 tokenizer is a byte-level BPE without merges (each UTF-8 byte a token, plus the chat template's
``<|im_start|>`` / ``<|im_end|>``), written here. It runs the Qwen-Image path of ``miles.diffusion``
(``qwen_image_flow_model``) end to end; it has learned nothing (random weights).

Two things differ from the real model beyond size: the byte tokenizer makes the chat template's system prefix much
longer than the 34 tokens the pipeline drops, so the text embeddings also hold the prefix's tail (the pipeline's own
``encode_prompt`` is used either way); and the scheduler's ``max_image_seq_len`` is Qwen-Image's 8192, so at this
twin's 16 patches ``mu`` is near its base value.

Built once into the model cache (``default_cache_dir()/tiny-qwen-image-v1``) by an atomic rename.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from miles.recipes.models.cache import ensure_built

logger = logging.getLogger(__name__)

MODEL_NAME = "tiny-qwen-image"
VERSION = 1
RESOLUTION = 16  # pixels (the pipeline default, 128 latent pixels, is the real model's): latents 4 x 8 x 8, 16 patches
# Qwen-Image's scheduler_config.json (FlowMatchEulerDiscreteScheduler): exponential time shift with mu from the
# image's packed sequence length, the last step stretched to end at 0.02 before the final 0.
SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
                 shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)  # fmt: skip


# QwenImagePipeline's prompt template; it drops the first 34 tokens (up to the user's turn) of its encoding.
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
SPECIAL = ("<|im_start|>", "<|im_end|>")


def byte_qwen_tokenizer(directory: Path):
    """A Qwen2 tokenizer that needs no download: byte-level BPE whose only merges spell the words of Qwen-Image's
    prompt template (so its system prefix is 34 tokens, as with Qwen's own vocabulary, and the pipeline's cut lands at
    the user's turn), every other text one token per UTF-8 byte; ``<|endoftext|>`` (end and padding),
    ``<|im_start|>`` and ``<|im_end|>`` special. vocab.json and merges.txt are written into ``directory`` (created)."""
    import re

    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    def tokenizer(merges: list[tuple[str, str]]):
        vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
        for left, right in merges:
            vocab.setdefault(left + right, len(vocab))
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "vocab.json").write_text(json.dumps(vocab))
        (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        built = Qwen2Tokenizer(
            str(directory / "vocab.json"), str(directory / "merges.txt"), unk_token=None, bos_token=None,
            eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        )  # fmt: skip
        built.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
        return built

    split = tokenizer([]).backend_tokenizer.pre_tokenizer.pre_tokenize_str
    parts = re.split("|".join(map(re.escape, SPECIAL)), TEMPLATE.replace("{}", "\n"))
    merges: list[tuple[str, str]] = []
    for word in (word for part in parts for word, _ in split(part)):
        for end in range(2, len(word) + 1):  # spell the word left to right: word[:end - 1] + word[end - 1]
            if (word[: end - 1], word[end - 1]) not in merges:
                merges.append((word[: end - 1], word[end - 1]))
    return tokenizer(merges)


def build_tiny_qwen_image(out: Path, *, seed: int = 0) -> None:
    """Write the random pipeline into ``out`` (``save_pretrained``; ~2 MB)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from miles.diffusion.models import save_pipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = byte_qwen_tokenizer(Path(out) / ".tokenizer-src")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text = dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3]),
            bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                      fullatt_block_indexes=[0])  # fmt: skip
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False],
            latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 2.0, 1.0, 0.8],
        )  # fmt: skip
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
            joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
        )  # fmt: skip
        pipe = QwenImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=text_encoder,
            tokenizer=tokenizer, transformer=transformer,
        )  # fmt: skip
    save_pipeline(pipe, out)
    for leftover in (Path(out) / ".tokenizer-src").iterdir():
        leftover.unlink()
    (Path(out) / ".tokenizer-src").rmdir()


def ensure_tiny_qwen_image(cache_dir: Path | None = None) -> Path:
    """The pipeline directory of ``tiny-qwen-image``, built into the cache on first use (atomic)."""
    return ensure_built(
        f"{MODEL_NAME}-v{VERSION}", build_tiny_qwen_image, logger=logger, cache_dir=cache_dir,
        marker="model_index.json",
    )  # fmt: skip
