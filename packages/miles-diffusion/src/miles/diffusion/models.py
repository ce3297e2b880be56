"""What the trainer and the sampler need from a text-to-image flow model, and the tiny CPU twin.

A ``FlowModel`` bundles the trained flow-matching transformer (SD3's call signature, ``miles.diffusion.sampler``)
with the frozen parts around it: a prompt encoder (prompts -> ``Conditioning``) and a decoder (latents -> images in
[-1, 1]). Only the transformer is trained and synced, as in Flow-GRPO and DDPO, whose text encoders and VAE stay frozen.

The tiny twin (``tiny_flow_model``) is random and needs no download: a 3-layer ``SD3Transformer2DModel`` (~0.43 M
parameters) working directly on 16 x 16 RGB pixels (the "latent" is the image, the decoder the identity) and
``ByteTextEncoder``, a frozen random embedding of the prompt's UTF-8 bytes (standing in for SD3's CLIP/T5 encoders).
It is the diffusion counterpart of the random LLM twins: small enough to learn a pixel reward on 2 CPU cores in minutes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from miles.diffusion.sampler import Conditioning
from torch import Tensor, nn

TINY_TRANSFORMER = {
    "sample_size": 16,
    "patch_size": 2,
    "in_channels": 3,
    "out_channels": 3,
    "num_layers": 3,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": 32,
    "caption_projection_dim": 64,
    "pooled_projection_dim": 32,
    "pos_embed_max_size": 16,
}
TINY_ENCODER = {"dim": 32, "pooled_dim": 32, "max_length": 48}


class ByteTextEncoder(nn.Module):
    """A frozen random text encoder over UTF-8 bytes (the tiny twin's stand-in for CLIP / T5).

    Token embeddings are a fixed random table of the 256 byte values plus a fixed random position table; the pooled
    embedding is the mean of the prompt's token embeddings projected by a fixed random matrix. Prompts longer than
    ``max_length`` bytes are cut (as CLIP cuts at 77 tokens); shorter ones are padded with zeros.

    Args: dim: D of the token embeddings; pooled_dim: P; max_length: L bytes; seed: the random tables' seed.
    """

    def __init__(self, *, dim: int, pooled_dim: int, max_length: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.max_length = max_length
        self.register_buffer("byte_table", torch.randn(256, dim, generator=gen))
        self.register_buffer("positions", 0.5 * torch.randn(max_length, dim, generator=gen))
        self.register_buffer("pool", torch.randn(dim, pooled_dim, generator=gen) / dim**0.5)

    @torch.no_grad()
    def forward(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts. Returns ``Conditioning``: prompt_embeds [B, L, D], pooled [B, P], float32."""
        ids = torch.zeros(len(prompts), self.max_length, dtype=torch.long)
        mask = torch.zeros(len(prompts), self.max_length, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            data = list(prompt.encode("utf-8"))[: self.max_length]
            ids[row, : len(data)] = torch.tensor(data, dtype=torch.long)
            mask[row, : len(data)] = True
        tokens = (self.byte_table[ids] + self.positions) * mask[..., None]
        pooled = tokens.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return Conditioning(prompt_embeds=tokens, pooled=pooled @ self.pool)


@dataclass
class FlowModel:
    """A text-to-image flow model as the trainer sees it.

    Attributes:
        transformer: the flow-matching transformer (trained; SD3 signature).
        encode: prompts -> ``Conditioning`` (frozen, no grad).
        decode: latents [B, C, H, W] -> images [B, 3, H', W'] float in [-1, 1] (frozen, no grad).
        latent_shape: (C, H, W) of one latent.
    """

    transformer: nn.Module
    encode: Callable[[Sequence[str]], Conditioning]
    decode: Callable[[Tensor], Tensor]
    latent_shape: tuple[int, int, int]


def _pixels(latents: Tensor) -> Tensor:
    return latents.float().clamp(-1, 1)


def tiny_flow_model(*, seed: int = 0) -> FlowModel:
    """The random tiny twin (module docstring): its weights depend only on ``seed``."""
    from diffusers import SD3Transformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(**TINY_TRANSFORMER)
    encoder = ByteTextEncoder(**TINY_ENCODER, seed=seed + 1)
    size = TINY_TRANSFORMER["sample_size"]
    return FlowModel(transformer, encoder, _pixels, (TINY_TRANSFORMER["in_channels"], size, size))


def save_tiny_flow_model(model: FlowModel, path: Path, *, seed: int) -> None:
    """Write the twin's transformer (diffusers ``save_pretrained``: config + safetensors) and the encoder's seed.

    The directory is written under a temporary name and renamed, so a reader never sees half of it.
    Raises: FileExistsError if ``path`` exists.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists")
    tmp = path.with_name(f".{path.name}.tmp")
    model.transformer.save_pretrained(tmp / "transformer")
    (tmp / "miles_tiny_flow.json").write_text(json.dumps({"encoder": TINY_ENCODER, "encoder_seed": seed + 1}))
    tmp.rename(path)


def load_tiny_flow_model(path: Path) -> FlowModel:
    """Read what ``save_tiny_flow_model`` wrote (the transformer's trained weights, the same frozen encoder).

    Raises: FileNotFoundError naming the missing file.
    """
    from diffusers import SD3Transformer2DModel

    path = Path(path)
    meta_path = path / "miles_tiny_flow.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a tiny flow model directory: {meta_path.name} is missing")
    meta = json.loads(meta_path.read_text())
    transformer = SD3Transformer2DModel.from_pretrained(path / "transformer")
    encoder = ByteTextEncoder(**meta["encoder"], seed=meta["encoder_seed"])
    config = transformer.config
    return FlowModel(transformer, encoder, _pixels, (config.in_channels, config.sample_size, config.sample_size))
