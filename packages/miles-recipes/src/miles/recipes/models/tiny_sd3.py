"""``tiny-sd3``: a random StableDiffusion3Pipeline shaped like SD3.5 (MMDiT with QK RMS-norm and a dual-attention
block, two CLIP text encoders, a KL VAE), small enough for a CPU, built offline: its CLIP tokenizer is a byte-level BPE
without merges (each UTF-8 byte a token), written here, and it has no T5 (``text_encoder_3`` null: diffusers then
uses zeros for T5's part). It runs the SD3 path of ``miles.diffusion`` (``sd3_flow_model``) end to end; it has learned
nothing (random weights).

Built once into the model cache (``default_cache_dir()/tiny-sd3-v1``) by an atomic rename.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from miles.recipes.models.cache import ensure_built

logger = logging.getLogger(__name__)

MODEL_NAME = "tiny-sd3"
VERSION = 1
RESOLUTION = 32  # pixels; latents 4 x 16 x 16 (VAE scale 2)


def byte_clip_tokenizer(directory: Path):
    """A CLIP tokenizer that needs no download: byte-level BPE without merges (each UTF-8 byte of a word a token, 514
    tokens with start/end), its vocab.json and merges.txt written into ``directory`` (created)."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": len(chars) + i for i, c in enumerate(chars)}
    vocab |= {"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1}
    directory.mkdir(parents=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=77)


def build_tiny_sd3(out: Path, *, seed: int = 0) -> None:
    """Write the random pipeline into ``out`` (``save_pretrained``; 1.9 MB)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from miles.diffusion.models import save_pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tokenizer = byte_clip_tokenizer(Path(out) / ".tokenizer-src")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)

        def clip():
            config = CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=2, projection_dim=32, max_position_embeddings=77,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            return CLIPTextModelWithProjection(config)

        vae = AutoencoderKL(
            sample_size=RESOLUTION, in_channels=3, out_channels=3, block_out_channels=(8, 16),
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            layers_per_block=1, latent_channels=4, norm_num_groups=4, use_quant_conv=False,
            use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
        )  # fmt: skip
        transformer = SD3Transformer2DModel(
            sample_size=RESOLUTION // 2, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=64,
            pooled_projection_dim=64, pos_embed_max_size=16, qk_norm="rms_norm", dual_attention_layers=(0,),
        )  # fmt: skip
        pipe = StableDiffusion3Pipeline(
            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
            text_encoder=clip(), tokenizer=tokenizer, text_encoder_2=clip(), tokenizer_2=tokenizer,
            text_encoder_3=None, tokenizer_3=None,
        )  # fmt: skip
    save_pipeline(pipe, out)  # model_index.json records the absent T5 ([null, null])
    for leftover in (Path(out) / ".tokenizer-src").iterdir():
        leftover.unlink()
    (Path(out) / ".tokenizer-src").rmdir()


def ensure_tiny_sd3(cache_dir: Path | None = None) -> Path:
    """The pipeline directory of ``tiny-sd3``, built into the cache on first use (atomic)."""
    return ensure_built(
        f"{MODEL_NAME}-v{VERSION}", build_tiny_sd3, logger=logger, cache_dir=cache_dir, marker="model_index.json"
    )
