"""What the trainer and the sampler need from a text-to-image flow model: the tiny CPU twin and diffusers' SD3 /
SD3.5 and Qwen-Image pipelines.

A ``FlowModel`` bundles the trained flow-matching transformer (SD3's or Qwen-Image's, ``miles.diffusion.sampler``)
with the frozen parts around it: a prompt encoder (prompts -> ``Conditioning``) and a decoder (latents -> images in
[-1, 1]), and, for Qwen-Image, its pipeline's sigma schedule. Only the transformer is trained and synced, as in
Flow-GRPO and DDPO, whose text encoders and VAE stay frozen.

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
        return Conditioning(prompt_embeds=tokens.float(), pooled=(pooled @ self.pool).float())


@dataclass
class FlowModel:
    """A text-to-image flow model as the trainer sees it.

    Attributes:
        transformer: the flow-matching transformer (trained; SD3 signature).
        encode: prompts -> ``Conditioning`` (frozen, no grad).
        decode: latents [B, C, H, W] -> images [B, 3, H', W'] float in [-1, 1] (frozen, no grad).
        latent_shape: (C, H, W) of one latent.
        source: what rebuilds ``encode`` / ``decode`` (``miles_flow.json``): {"kind": "tiny", ...},
            {"kind": "sd3", "pipeline": DIR, ...} or {"kind": "qwen_image", "pipeline": DIR, ...}.
        frozen: the modules behind ``encode`` / ``decode`` (moved by ``to``).
        schedule: num_steps -> [num_steps + 1] float32 sigmas from 1 to 0, the model's own schedule (Qwen-Image's
            dynamic shift for its image size); None: SD3's shifted schedule with the algorithm's ``shift``.
    """

    transformer: nn.Module
    encode: Callable[[Sequence[str]], Conditioning]
    decode: Callable[[Tensor], Tensor]
    latent_shape: tuple[int, int, int]
    source: dict = field(default_factory=dict)
    frozen: list[nn.Module] = field(default_factory=list)
    schedule: Callable[[int], Tensor] | None = None

    def to(self, device: torch.device | str) -> FlowModel:
        """Move the transformer and the frozen parts to ``device`` (in place); returns self."""
        self.transformer.to(device)
        for module in self.frozen:
            module.to(device)
        return self

    def cast_frozen(self, dtype: torch.dtype) -> FlowModel:
        """Cast the frozen parts (text encoders, VAE) to ``dtype`` in place, halving their memory in bfloat16;
        ``encode`` / ``decode`` still return float32. Returns self."""
        for module in self.frozen:
            cast_module(module, dtype)
        return self


def cast_module(module: nn.Module, dtype: torch.dtype) -> None:
    """``module`` to ``dtype`` in place, as ``torch.nn.Module.to`` casts: diffusers' ``ModelMixin.to`` warns about
    modules to keep in float32, which SD3's and Qwen-Image's models do not have."""
    nn.Module.to(module, dtype)


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
        transformer, encoder, _pixels, (config.in_channels, config.sample_size, config.sample_size), source,
        frozen=[encoder],
    )  # fmt: skip


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
    from diffusers import StableDiffusion3Pipeline

    pipeline_dir = Path(pipeline_dir)
    index = _pipeline_index(pipeline_dir, "StableDiffusion3Pipeline")
    pipe = StableDiffusion3Pipeline.from_pretrained(pipeline_dir, dtype=torch.float32, **_absent_components(index))
    for part in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        if part is not None:
            part.eval().requires_grad_(False)
    scale = pipe.vae_scale_factor
    size = resolution if resolution is not None else pipe.transformer.config.sample_size * scale
    patch = pipe.transformer.config.patch_size
    if size % (scale * patch):
        raise ValueError(f"resolution {size} must be a multiple of {scale * patch} (VAE scale x patch size), "
                         f"{_nearest(size, scale * patch)}")  # fmt: skip

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


def qwen_image_flow_model(
    pipeline_dir: Path | str, *, resolution: int | None = None, max_sequence_length: int = 512
) -> FlowModel:
    """A diffusers ``QwenImagePipeline`` directory (Qwen-Image) as a ``FlowModel``: its transformer (fp32, the
    master copy), its Qwen2.5-VL text encoder (``encode_prompt``: the last hidden states after the chat template's
    system prefix, with their padding mask; no CFG here, the trainer encodes the empty prompt itself), its VAE
    (latents x std + mean -> ``vae.decode`` of one frame), frozen, and its schedule: ``np.linspace(1, 1/T, T)``
    shifted by the pipeline scheduler's ``mu`` for this image size (``calculate_shift`` of the packed sequence
    length), exactly as ``QwenImagePipeline.__call__`` sets its timesteps.

    Args:
        pipeline_dir: a local pipeline directory (``model_index.json``); nothing is downloaded.
        resolution: image side in pixels; default the pipeline's (``default_sample_size`` x the VAE's scale factor:
            1024 for Qwen-Image).
        max_sequence_length: text tokens per prompt (at most 1024, the pipeline's limit).
    Raises: ValueError when the directory holds no QwenImagePipeline, ``resolution`` does not divide into 2 x 2
        latent patches, or ``max_sequence_length`` exceeds 1024.
    """
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    pipeline_dir = Path(pipeline_dir)
    index = _pipeline_index(pipeline_dir, "QwenImagePipeline")
    if not 0 < max_sequence_length <= 1024:
        raise ValueError(f"max_sequence_length must lie in [1, 1024] (Qwen-Image's limit), got {max_sequence_length}")
    pipe = QwenImagePipeline.from_pretrained(pipeline_dir, dtype=torch.float32, **_absent_components(index))
    for part in (pipe.vae, pipe.text_encoder):
        part.eval().requires_grad_(False)
    scale = pipe.vae_scale_factor
    size = resolution if resolution is not None else pipe.default_sample_size * scale
    if size % (scale * 2):
        raise ValueError(f"resolution {size} must be a multiple of {scale * 2} (VAE scale x the 2 x 2 patches), "
                         f"{_nearest(size, scale * 2)}")  # fmt: skip
    side = size // scale
    vae_config = pipe.vae.config
    mean = torch.tensor(vae_config.latents_mean).view(1, vae_config.z_dim, 1, 1, 1)
    std = torch.tensor(vae_config.latents_std).view(1, vae_config.z_dim, 1, 1, 1)
    scheduler_config = pipe.scheduler.config
    mu = calculate_shift(
        (side // 2) ** 2,
        scheduler_config.get("base_image_seq_len", 256),
        scheduler_config.get("max_image_seq_len", 4096),
        scheduler_config.get("base_shift", 0.5),
        scheduler_config.get("max_shift", 1.15),
    )

    @torch.no_grad()
    def encode(prompts: Sequence[str]) -> Conditioning:
        embeds, mask = pipe.encode_prompt(list(prompts), max_sequence_length=max_sequence_length)
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
        return Conditioning(prompt_embeds=embeds.float(), mask=mask.to(embeds.device))

    @torch.no_grad()
    def decode(latents: Tensor) -> Tensor:
        vae = pipe.vae
        frames = latents[:, :, None].to(vae.dtype)  # as its pipeline: in the VAE's dtype, divided by 1 / std
        frames = frames / (1.0 / std).to(frames) + mean.to(frames)
        return vae.decode(frames, return_dict=False)[0][:, :, 0].float().clamp(-1, 1)

    def schedule(num_steps: int) -> Tensor:
        if num_steps < 2:
            raise ValueError(f"num_steps must be >= 2 (the first step starts at sigma 1), got {num_steps}")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return scheduler.sigmas.to(torch.float32).clone()

    source = {"kind": "qwen_image", "pipeline": str(pipeline_dir.absolute()), "resolution": size,
              "max_sequence_length": max_sequence_length}  # fmt: skip
    latent_shape = (vae_config.z_dim, side, side)
    return FlowModel(pipe.transformer.float(), encode, decode, latent_shape, source, [pipe.vae, pipe.text_encoder],
                     schedule)  # fmt: skip


def _nearest(size: int, multiple: int) -> str:
    """The multiples of ``multiple`` around ``size``, as a suggestion: "e.g. 16 or 20"."""
    below, above = size - size % multiple, size - size % multiple + multiple
    return f"e.g. {below} or {above}" if below > 0 else f"e.g. {above}"


def _pipeline_index(pipeline_dir: Path, class_name: str) -> dict:
    """``model_index.json`` of a diffusers pipeline directory of ``class_name``.
    Raises: ValueError when the directory holds another pipeline or none."""
    found = pipeline_class(pipeline_dir)
    if found != class_name:
        raise ValueError(
            f"{pipeline_dir} is not a diffusers {class_name} directory (model_index.json's _class_name is {found!r})"
        )
    return json.loads((pipeline_dir / "model_index.json").read_text())


def pipeline_class(pipeline_dir: Path | str) -> str | None:
    """The ``_class_name`` of a diffusers pipeline directory's ``model_index.json`` (None without one)."""
    index_path = Path(pipeline_dir) / "model_index.json"
    try:
        return json.loads(index_path.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None


PIPELINES = {"sd3": ("StableDiffusion3Pipeline", sd3_flow_model), "qwen_image": ("QwenImagePipeline",
             qwen_image_flow_model)}  # fmt: skip
"""The pipeline families a flow model is built from: source kind -> (diffusers pipeline class, builder)."""


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
    tiny encoder from its seed; an SD3 or Qwen-Image pipeline's encoders and VAE from its directory, which must
    still exist).

    Raises: FileNotFoundError naming the missing file or pipeline directory.
    """
    from diffusers import SD3Transformer2DModel

    path = Path(path)
    meta_path = path / FLOW_META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a flow model directory: {FLOW_META} is missing")
    source = json.loads(meta_path.read_text())
    if source["kind"] == "tiny":
        return _tiny(SD3Transformer2DModel.from_pretrained(path / "transformer"), source)
    if not Path(source["pipeline"]).is_dir():
        raise FileNotFoundError(
            f"{path}: the pipeline it was trained from, {source['pipeline']}, is gone (its text encoders and VAE "
            "are read from there)"
        )
    build = PIPELINES[source["kind"]][1]
    model = build(
        source["pipeline"], resolution=source["resolution"], max_sequence_length=source["max_sequence_length"]
    )
    trained = type(model.transformer).from_pretrained(path / "transformer")
    model.transformer.load_state_dict(trained.state_dict())
    return model


def export_pipeline(model: FlowModel, out: Path) -> None:
    """Write a pipeline's model (SD3, Qwen-Image) as a whole diffusers pipeline directory (its pipeline with the
    trained transformer), so ``<its pipeline class>.from_pretrained(out)`` samples with it.

    Raises: ValueError for a model that is not a pipeline's (the tiny twin).
    """
    import diffusers

    kind = model.source.get("kind")
    if kind not in PIPELINES:
        raise ValueError("only an SD3 or Qwen-Image pipeline's model exports as a pipeline")
    index = json.loads((Path(model.source["pipeline"]) / "model_index.json").read_text())
    pipe = getattr(diffusers, PIPELINES[kind][0]).from_pretrained(
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
