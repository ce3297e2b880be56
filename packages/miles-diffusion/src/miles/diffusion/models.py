"""What the trainer and the sampler need from a text-to-image flow model: the tiny CPU twin and diffusers' SD3 /
SD3.5 pipelines.

A ``FlowModel`` bundles the trained flow-matching transformer (SD3's call signature, ``miles.diffusion.sampler``)
with the frozen parts around it: a prompt encoder (prompts -> ``Conditioning``) and a decoder (latents -> images in
[-1, 1]). Only the transformer is trained and synced, as in Flow-GRPO and DDPO, whose text encoders and VAE stay frozen.

``save_flow_model`` writes the transformer (diffusers' layout, ``transformer/``) and ``miles_flow.json``, what
rebuilds the frozen parts (the tiny encoder's seed, or the pipeline directory the run started from);
``load_flow_model`` reads it back.

The tiny twin (``tiny_flow_model``) is random and needs no download: a 3-layer ``SD3Transformer2DModel`` (~0.43 M
parameters) working directly on 16 x 16 RGB pixels (the "latent" is the image, the decoder the identity) and
``ByteTextEncoder``, a frozen random embedding of the prompt's UTF-8 bytes (standing in for SD3's CLIP/T5 encoders).
It is the diffusion counterpart of the random LLM twins: small enough to learn a pixel reward on 2 CPU cores in minutes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from miles.diffusion.sampler import Conditioning
from torch import Tensor, nn

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

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
        ids, mask = ids.to(self.byte_table.device), mask.to(self.byte_table.device)
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
        source: what rebuilds ``encode`` / ``decode`` (``miles_flow.json``): {"kind": "tiny", ...} or
            {"kind": "sd3", "pipeline": DIR, ...}.
        frozen: the modules behind ``encode`` / ``decode`` (moved by ``to``).
    """

    transformer: nn.Module
    encode: Callable[[Sequence[str]], Conditioning]
    decode: Callable[[Tensor], Tensor]
    latent_shape: tuple[int, int, int]
    source: dict = field(default_factory=dict)
    frozen: list[nn.Module] = field(default_factory=list)

    def to(self, device: torch.device | str) -> FlowModel:
        """Move the transformer and the frozen parts to ``device`` (in place); returns self."""
        self.transformer.to(device)
        for module in self.frozen:
            module.to(device)
        return self


def _pixels(latents: Tensor) -> Tensor:
    return latents.float().clamp(-1, 1)


def tiny_flow_model(*, seed: int = 0) -> FlowModel:
    """The random tiny twin (module docstring): its weights depend only on ``seed``."""
    from diffusers import SD3Transformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(**TINY_TRANSFORMER)
    return _tiny(transformer, {"kind": "tiny", "encoder": TINY_ENCODER, "encoder_seed": seed + 1})


def _tiny(transformer: nn.Module, source: dict) -> FlowModel:
    encoder = ByteTextEncoder(**source["encoder"], seed=source["encoder_seed"])
    config = transformer.config
    return FlowModel(
        transformer, encoder, _pixels, (config.in_channels, config.sample_size, config.sample_size), source
    )


def _absent_components(index: dict) -> dict[str, None]:
    """The pipeline components ``model_index.json`` lists as absent (``[null, null]``, e.g. SD3 saved without T5),
    as ``from_pretrained`` keyword arguments that keep them None instead of failing to load them."""
    return {name: None for name, entry in index.items() if isinstance(entry, list) and entry[0] is None}


def sd3_flow_model(
    pipeline_dir: Path | str, *, resolution: int | None = None, max_sequence_length: int = 256
) -> FlowModel:
    """A diffusers ``StableDiffusion3Pipeline`` directory (SD3, SD3.5) as a ``FlowModel``: its transformer (fp32, the
    master copy), its CLIP / T5 encoders (``encode_prompt``, no CFG: the trainer encodes the empty prompt itself)
    and its VAE (latents / scaling_factor + shift_factor -> ``vae.decode``), frozen. A pipeline saved without T5
    (``text_encoder_3`` null) uses zeros for its part, as diffusers does.

    Args:
        pipeline_dir: a local pipeline directory (``model_index.json``); nothing is downloaded.
        resolution: image side in pixels; default the transformer's ``sample_size`` x the VAE's scale factor.
        max_sequence_length: T5 tokens per prompt.
    Raises: ValueError when the directory holds no StableDiffusion3Pipeline or ``resolution`` does not divide into
        patches.
    """
    import json as _json

    from diffusers import StableDiffusion3Pipeline

    pipeline_dir = Path(pipeline_dir)
    index_path = pipeline_dir / "model_index.json"
    index = _json.loads(index_path.read_text()) if index_path.is_file() else {}
    if index.get("_class_name") != "StableDiffusion3Pipeline":
        raise ValueError(
            f"{pipeline_dir} is not a diffusers StableDiffusion3Pipeline directory (model_index.json's _class_name is "
            f"{index.get('_class_name')!r})"
        )
    pipe = StableDiffusion3Pipeline.from_pretrained(pipeline_dir, dtype=torch.float32, **_absent_components(index))
    for part in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        if part is not None:
            part.eval().requires_grad_(False)
    scale = pipe.vae_scale_factor
    size = resolution if resolution is not None else pipe.transformer.config.sample_size * scale
    patch = pipe.transformer.config.patch_size
    if size % (scale * patch):
        raise ValueError(f"resolution {size} must be a multiple of {scale * patch} (VAE scale x patch size)")

    @torch.no_grad()
    def encode(prompts: Sequence[str]) -> Conditioning:
        prompts = list(prompts)
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompts, prompts, prompts, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length
        )
        return Conditioning(prompt_embeds=embeds.float(), pooled=pooled.float())

    @torch.no_grad()
    def decode(latents: Tensor) -> Tensor:
        vae = pipe.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents, return_dict=False)[0].float().clamp(-1, 1)

    source = {"kind": "sd3", "pipeline": str(pipeline_dir.absolute()), "resolution": size,
              "max_sequence_length": max_sequence_length}  # fmt: skip
    latent_shape = (pipe.transformer.config.in_channels, size // scale, size // scale)
    frozen = [m for m in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3) if m is not None]
    return FlowModel(pipe.transformer.float(), encode, decode, latent_shape, source, frozen=frozen)


FLOW_META = "miles_flow.json"


def save_flow_model(model: FlowModel, path: Path) -> None:
    """Write the transformer (diffusers ``save_pretrained``: config + safetensors, under ``transformer/``) and
    ``miles_flow.json`` (``model.source``: what rebuilds the frozen parts).

    The directory is written under a temporary name and renamed, so a reader never sees half of it.
    Raises: FileExistsError if ``path`` exists; ValueError for a model without a ``source``.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists")
    if not model.source:
        raise ValueError("the model has no source (build it with tiny_flow_model or sd3_flow_model)")
    tmp = path.with_name(f".{path.name}.tmp")
    model.transformer.save_pretrained(tmp / "transformer")
    (tmp / FLOW_META).write_text(json.dumps(model.source, indent=2))
    tmp.rename(path)


def load_flow_model(path: Path) -> FlowModel:
    """Read what ``save_flow_model`` wrote: the trained transformer, the frozen parts rebuilt from the source (the
    tiny encoder from its seed; an SD3 pipeline's encoders and VAE from its directory, which must still exist).

    Raises: FileNotFoundError naming the missing file or pipeline directory.
    """
    from diffusers import SD3Transformer2DModel

    path = Path(path)
    meta_path = path / FLOW_META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a flow model directory: {FLOW_META} is missing")
    source = json.loads(meta_path.read_text())
    transformer = SD3Transformer2DModel.from_pretrained(path / "transformer")
    if source["kind"] == "tiny":
        return _tiny(transformer, source)
    if not Path(source["pipeline"]).is_dir():
        raise FileNotFoundError(
            f"{path}: the pipeline it was trained from, {source['pipeline']}, is gone (its text encoders and VAE "
            "are read from there)"
        )
    model = sd3_flow_model(
        source["pipeline"], resolution=source["resolution"], max_sequence_length=source["max_sequence_length"]
    )
    model.transformer.load_state_dict(transformer.state_dict())
    return model


def export_pipeline(model: FlowModel, out: Path) -> None:
    """Write an SD3 model as a whole diffusers pipeline directory (its pipeline with the trained transformer), so
    ``StableDiffusion3Pipeline.from_pretrained(out)`` samples with it.

    Raises: ValueError for a model that is not an SD3 pipeline's.
    """
    from diffusers import StableDiffusion3Pipeline

    if model.source.get("kind") != "sd3":
        raise ValueError("only an SD3 pipeline's model exports as a pipeline")
    index = json.loads((Path(model.source["pipeline"]) / "model_index.json").read_text())
    pipe = StableDiffusion3Pipeline.from_pretrained(
        model.source["pipeline"], transformer=model.transformer, dtype=torch.float32, **_absent_components(index)
    )
    save_pipeline(pipe, out)


class _AbsentComponentNote(logging.Filter):
    """Drops diffusers' "self.NAME=None of type <class 'NoneType'> cannot be saved." for the named components."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__()
        self.prefixes = tuple(f"self.{name}=None of type" for name in names)

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def save_pipeline(pipe: DiffusionPipeline, out: Path) -> None:
    """``pipe.save_pretrained(out)`` without diffusers' warning that each absent component (SD3 without T5:
    ``text_encoder_3`` / ``tokenizer_3`` None) "cannot be saved": ``model_index.json`` records it as absent
    (``[null, null]``), which is what loading needs. Every other message of the save still shows."""
    absent = [name for name in pipe.config if name in pipe.components and pipe.components[name] is None]
    source = logging.getLogger("diffusers.pipelines.pipeline_utils")
    note = _AbsentComponentNote(absent)
    source.addFilter(note)
    try:
        pipe.save_pretrained(out)
    finally:
        source.removeFilter(note)
