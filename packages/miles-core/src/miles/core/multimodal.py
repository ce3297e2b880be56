"""Multimodal model inputs (images) carried beside token ids, and the forward kwargs that feed them to a VLM.

A sample's image inputs are what the policy's processor produced once at rollout (``miles.rollout.multimodal``),
token-in-token-out: the engine and the trainer run the model on exactly these tensors and the sample's token ids,
never re-processing the images. Two layouts, told apart by their keys:

Qwen-VL (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; transformers ``qwen2_vl`` / ``qwen2_5_vl`` / ``qwen3_vl``):

- ``pixel_values``: [P, D] float32, the flattened patches of every image of the sample in prompt order
  (P = sum over images of t * h * w; D = channels * temporal_patch_size * patch_size**2);
- ``image_grid_thw``: [I, 3] int64, each image's (t, h, w) patch grid.

Image ``i`` fills ``prod(image_grid_thw[i]) // spatial_merge_size**2`` consecutive placeholder tokens
(``config.image_token_id``) of the prompt. Several rows' inputs concatenate along dim 0 in row order, which is the
order the model scatters image features into the placeholder tokens of a batch.

Idefics3 (Idefics3, SmolVLM / SmolVLM2; transformers ``idefics3`` / ``smolvlm``; ``IDEFICS3_MODEL_TYPES``):

- ``pixel_values``: [N, C, H, W] float32, the N tiles of every image of the sample in prompt order (each image's
  row x col crops, then its global view; H = W = the image processor's ``max_image_size``);
- ``pixel_attention_mask``: [N, H, W] bool, True on real pixels (the processor pads tiles to a common size).

The processor's own output is [1, N, C, H, W] for one sample; a sample keeps it without the batch axis. Each tile
fills ``image_seq_len = (image_size // patch_size)**2 // scale_factor**2`` placeholder tokens. Several rows' tiles
concatenate along N in row order into one [1, sum N, C, H, W] input: the model flattens its batch and tile axes
and scatters tile features into the placeholder tokens of the whole batch in order, so this is the order of a
batch of separately rendered rows.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

MultimodalInputs = dict[str, Tensor]
KEYS = ("pixel_values", "image_grid_thw")  # the Qwen-VL layout
IDEFICS3_KEYS = ("pixel_values", "pixel_attention_mask")  # the Idefics3 / SmolVLM layout
IDEFICS3_MODEL_TYPES = ("idefics3", "smolvlm")
"""Vision-language model types whose processors give the Idefics3 layout (tiles [N, C, H, W] and their pixel mask)."""


def is_multimodal_config(config: Any) -> bool:
    """Whether an HF config is a vision-language model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config: Any) -> Any:
    """The transformers auto class that loads a policy of this config: ``AutoModelForImageTextToText`` for a
    vision-language model (its causal-LM head over text and images), else ``AutoModelForCausalLM``."""
    import transformers

    if is_multimodal_config(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def load_policy_model(path: Any, *, trust_remote_code: bool = False, **kwargs: Any) -> torch.nn.Module:
    """``from_pretrained`` of the HF model at ``path`` through ``auto_model_class`` (text or vision-language).

    Args:
        trust_remote_code: run the model's own code (``auto_map`` in its config.json), as
            ``models.*.trust_remote_code``.
    Raises: what transformers raises for a directory without a model.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return auto_model_class(config).from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)


VISION_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_token_ids(config: Any) -> list[int]:
    """A vision-language config's placeholder and marker token ids (image, video, vision start / end): tokens the
    processor writes into prompts and a response must never hold. [] for a text model."""
    if not is_multimodal_config(config):
        return []
    return sorted({tid for f in VISION_TOKEN_FIELDS if isinstance(tid := getattr(config, f, None), int)})


def is_idefics3_config(config: Any) -> bool:
    """Whether an HF config is an Idefics3-layout vision-language model's (``IDEFICS3_MODEL_TYPES``)."""
    return getattr(config, "model_type", None) in IDEFICS3_MODEL_TYPES


def is_idefics3_inputs(inputs: MultimodalInputs) -> bool:
    """Whether one sample's inputs are in the Idefics3 layout (``pixel_attention_mask`` instead of a grid)."""
    return "pixel_attention_mask" in inputs


def validate_multimodal(inputs: MultimodalInputs, *, where: str = "multimodal_inputs") -> None:
    """Check one sample's inputs in either layout. Qwen-VL: both keys, ``pixel_values`` [P, D] float,
    ``image_grid_thw`` [I, 3] integer with sum of t * h * w == P. Idefics3: ``pixel_values`` [N, C, H, W] float,
    ``pixel_attention_mask`` [N, H, W] bool.

    Raises: ValueError naming ``where`` and what is wrong.
    """
    if is_idefics3_inputs(inputs):
        _validate_idefics3(inputs, where=where)
        return
    missing = [key for key in KEYS if key not in inputs]
    if missing or set(inputs) - set(KEYS):
        raise ValueError(
            f"{where} must hold exactly {list(KEYS)} (Qwen-VL) or {list(IDEFICS3_KEYS)} (Idefics3 / SmolVLM), "
            f"got {sorted(inputs)}"
        )
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    if pixels.dim() != 2 or not pixels.is_floating_point():
        raise ValueError(
            f"{where}: pixel_values must be a [patches, dim] float tensor, got {tuple(pixels.shape)} {pixels.dtype}"
        )
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point():
        raise ValueError(f"{where}: image_grid_thw must be an [images, 3] integer tensor, got {tuple(grid.shape)}")
    if int(grid.prod(dim=1).sum()) != pixels.shape[0]:
        raise ValueError(
            f"{where}: image_grid_thw covers {int(grid.prod(dim=1).sum())} patches but pixel_values has "
            f"{pixels.shape[0]}; they must come from one processor call"
        )


def _validate_idefics3(inputs: MultimodalInputs, *, where: str) -> None:
    if set(inputs) != set(IDEFICS3_KEYS):
        raise ValueError(f"{where} must hold exactly {list(IDEFICS3_KEYS)} (Idefics3 / SmolVLM), got {sorted(inputs)}")
    pixels, pixel_mask = inputs["pixel_values"], inputs["pixel_attention_mask"]
    if pixels.dim() != 4 or not pixels.is_floating_point():
        raise ValueError(
            f"{where}: pixel_values must be a [tiles, channels, height, width] float tensor (one sample's, without "
            f"the processor's batch axis), got {tuple(pixels.shape)} {pixels.dtype}"
        )
    if pixel_mask.dtype != torch.bool or tuple(pixel_mask.shape) != (pixels.shape[0], *pixels.shape[2:]):
        raise ValueError(
            f"{where}: pixel_attention_mask must be a [tiles, height, width] bool tensor matching pixel_values "
            f"{tuple(pixels.shape)}, got {tuple(pixel_mask.shape)} {pixel_mask.dtype}"
        )


def concat_multimodal(rows: Sequence[MultimodalInputs | None]) -> MultimodalInputs | None:
    """The inputs of several rows as one batch's, rows without images skipped; None when no row has images.

    Qwen-VL: each key concatenated along dim 0 in row order. Idefics3: the rows' tiles concatenated along the tile
    axis in row order, ``pixel_values`` [1, sum N, C, H, W] and ``pixel_attention_mask`` [1, sum N, H, W].

    Raises: ValueError when rows mix the two layouts, or Idefics3 rows' tiles differ in size (rendered by different
        image processors: the model's connector takes one tile size).
    """
    present = [row for row in rows if row is not None]
    if not present:
        return None
    idefics3 = {is_idefics3_inputs(row) for row in present}
    if len(idefics3) > 1:
        raise ValueError("the batch's rows mix Qwen-VL and Idefics3 image inputs; one policy renders every row")
    if not idefics3.pop():
        return {key: torch.cat([row[key] for row in present]) for key in KEYS}
    sizes = sorted({tuple(row["pixel_values"].shape[1:]) for row in present})
    if len(sizes) > 1:
        raise ValueError(
            f"the batch's rows hold image tiles of different sizes {sizes}: each row's images must come from the "
            "policy's own image processor (one max_image_size)"
        )
    return {key: torch.cat([row[key] for row in present])[None] for key in IDEFICS3_KEYS}


def num_image_tokens(inputs: MultimodalInputs, merge_size: int) -> list[int]:
    """Placeholder tokens of each image: t * h * w // merge_size**2 (the vision tower merges merge_size x
    merge_size patches into one token). Qwen-VL layout."""
    return [int(n) // merge_size**2 for n in inputs["image_grid_thw"].prod(dim=1)]


def idefics3_image_seq_len(config: Any) -> int:
    """Placeholder tokens of one tile of an Idefics3 / SmolVLM model: (image_size // patch_size)**2 // scale_factor**2
    (the vision tower's patches of a tile, pixel-shuffled by the connector, as the model's ``image_seq_len``)."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2


def num_placeholder_tokens(config: Any, inputs: MultimodalInputs) -> int:
    """Image placeholder tokens one sample's inputs fill in a model of ``config``.

    Qwen-VL: sum over images of t * h * w // spatial_merge_size**2. Idefics3: ``idefics3_image_seq_len`` per tile,
    tiles whose pixels are all exactly 0 not counted (the model drops them as padding tiles).

    Raises: ValueError when the inputs' layout is not the model's.
    """
    if is_idefics3_config(config) != is_idefics3_inputs(inputs):
        model_layout = "Idefics3" if is_idefics3_config(config) else "Qwen-VL"
        raise ValueError(
            f"the model ({config.model_type}) takes {model_layout}-layout image inputs but a row carries "
            f"{sorted(inputs)}: render the prompts with this policy's processor (miles.rollout.multimodal)"
        )
    if is_idefics3_inputs(inputs):
        pixels = inputs["pixel_values"]
        real_tiles = int((pixels != 0).flatten(1).any(dim=1).sum())
        return real_tiles * idefics3_image_seq_len(config)
    return sum(num_image_tokens(inputs, getattr(config.vision_config, "spatial_merge_size", 1)))


def multimodal_forward_kwargs(
    model: torch.nn.Module, input_ids: Tensor, rows: Sequence[MultimodalInputs | None] | None
) -> dict[str, Tensor]:
    """The extra keyword arguments of a VLM forward (or ``generate``) over ``input_ids`` whose rows carry ``rows``.

    Args:
        model: the HF vision-language model (its ``config.image_token_id`` and vision ``spatial_merge_size``).
        input_ids: [B, L] int64 token ids, any padding.
        rows: per row, its inputs or None (a text-only row); None or all-None for a text-only batch.
    Returns: {} for a text-only batch; else (on ``input_ids``' device) for Qwen-VL ``pixel_values`` [P, D],
        ``image_grid_thw`` [I, 3], and ``mm_token_type_ids`` [B, L] int32 (1 at image placeholders) where the model's
        forward takes it (Qwen3-VL computes its multimodal RoPE positions from it); for Idefics3 / SmolVLM
        ``pixel_values`` [1, sum N, C, H, W] float32 and ``pixel_attention_mask`` [1, sum N, H, W] bool
        (``concat_multimodal``).
    Raises: ValueError when the placeholder tokens of a row do not match its images (a prompt rendered by one
        processor, images processed by another; image placeholders without images, e.g. a prompt rendered by the
        chat template alone), or when a model without vision takes images.
    """
    config = model.config
    no_images = rows is None or all(row is None for row in rows)
    if no_images and not is_multimodal_config(config):
        return {}
    if not is_multimodal_config(config):
        raise ValueError(f"samples carry images but the model ({type(model).__name__}) has no vision tower")
    is_image = input_ids == config.image_token_id  # [B, L]
    if no_images:
        if bool(is_image.any()):
            row = int(is_image.any(dim=1).nonzero()[0])
            raise ValueError(
                f"row {row} has image placeholder tokens but no images: render image prompts with "
                "miles.rollout.multimodal.VisionProcessor, which carries their pixel inputs"
            )
        return {}
    rows = list(rows)
    for b, row in enumerate(rows):
        expected = 0 if row is None else num_placeholder_tokens(config, row)
        found = int(is_image[b].sum())
        if found != expected:
            raise ValueError(
                f"row {b} has {found} image placeholder tokens but its images fill {expected}: prompt tokens and "
                "pixel inputs must come from the same processor call (miles.rollout.multimodal)"
            )
    inputs = concat_multimodal(rows)
    device = input_ids.device
    if is_idefics3_config(config):
        return {
            "pixel_values": inputs["pixel_values"].to(device),  # the model casts them to its own dtype
            "pixel_attention_mask": inputs["pixel_attention_mask"].to(device),
        }
    kwargs = {
        "pixel_values": inputs["pixel_values"].to(device),  # the vision tower casts them to its own dtype
        "image_grid_thw": inputs["image_grid_thw"].to(device=device, dtype=torch.int64),
    }
    if _takes_mm_token_type_ids(type(model)):
        kwargs["mm_token_type_ids"] = is_image.to(torch.int32)
    return kwargs


@functools.cache
def _takes_mm_token_type_ids(model_class: type) -> bool:
    return "mm_token_type_ids" in inspect.signature(model_class.forward).parameters


def packed_position_ids(
    model: torch.nn.Module, rows: Sequence[Tensor], inputs: Sequence[MultimodalInputs | None]
) -> Tensor:
    """Position ids of the packed layout for a Qwen-VL model: each row's multimodal RoPE positions (the model's own
    ``get_rope_index`` on the row alone, so an image's tokens get its grid positions) behind text positions that
    restart at every row (from which transformers builds the block-diagonal causal mask of packed sequences).

    Args:
        model: the HF vision-language model (``model.model.get_rope_index``).
        rows: B int64 [L_b] token ids, each row's real tokens.
        inputs: per row, its image inputs or None.
    Returns: [4, 1, sum L_b] int64: text positions, then the temporal / height / width positions.
    Raises: ValueError for a model without ``get_rope_index`` (not a Qwen-VL model).
    """
    inner = getattr(model, "model", model)
    if not hasattr(inner, "get_rope_index"):
        raise ValueError(f"{type(model).__name__} has no get_rope_index: the packed layout takes Qwen-VL models only")
    image_token_id = model.config.image_token_id
    columns = []
    for tokens, row in zip(rows, inputs):
        ids = tokens[None]  # [1, L]
        grid = None if row is None else row["image_grid_thw"].to(device=ids.device, dtype=torch.int64)
        rope, _ = inner.get_rope_index(ids, (ids == image_token_id).to(torch.int32), image_grid_thw=grid)  # [3, 1, L]
        text = torch.arange(ids.shape[1], device=ids.device)[None, None]  # [1, 1, L]
        columns.append(torch.cat([text, rope.to(text.dtype)]))
    return torch.cat(columns, dim=2)
