"""Image rewards: JPEG (in)compressibility as in DDPO and a colour rule checked on the pixels (no model), and
``ClipScore``, PickScore / CLIP from a local model directory (no network). Each takes a batch of images and returns
one float per image.

Images are [B, H, W, 3] uint8 RGB arrays or tensors (``to_uint8`` converts a decoder's [B, 3, H, W] floats in [-1, 1]).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def to_uint8(images: Tensor) -> np.ndarray:
    """A decoder's images [B, 3, H, W] float in [-1, 1] as [B, H, W, 3] uint8 RGB (clamped, rounded)."""
    pixels = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).cpu().numpy()


def _as_uint8(images: np.ndarray | Tensor) -> np.ndarray:
    array = images.cpu().numpy() if isinstance(images, Tensor) else np.asarray(images)
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"images must be [B, H, W, 3] uint8 RGB, got {array.shape} {array.dtype}")
    return array


def jpeg_size_kb(images: np.ndarray | Tensor, *, quality: int = 95) -> list[float]:
    """Each image's JPEG file size in kB (1000 bytes) at ``quality``, written with PIL."""
    from PIL import Image

    sizes = []
    for pixels in _as_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return sizes


def jpeg_compressibility(images: np.ndarray | Tensor, *, quality: int = 95) -> list[float]:
    """DDPO's compressibility reward (Black et al., arXiv:2305.13301, section 6.1): minus the JPEG size in kB."""
    return [-size for size in jpeg_size_kb(images, quality=quality)]


def jpeg_incompressibility(images: np.ndarray | Tensor, *, quality: int = 95) -> list[float]:
    """DDPO's incompressibility reward: the JPEG size in kB."""
    return jpeg_size_kb(images, quality=quality)


def colour_reward(images: np.ndarray | Tensor, target: Sequence[int]) -> list[float]:
    """How close each image's pixels are to the RGB colour ``target``: 1 - mean over pixels of the Euclidean RGB
    distance / the largest possible (255 sqrt 3). In [0, 1]; 1 = every pixel is the target.

    Raises: ValueError for a target that is not three values in [0, 255].
    """
    if len(target) != 3 or not all(0 <= c <= 255 for c in target):
        raise ValueError(f"target colour must be three values in [0, 255], got {target!r}")
    pixels = _as_uint8(images).astype(np.float64)
    distance = np.linalg.norm(pixels - np.asarray(target, dtype=np.float64), axis=-1)  # [B, H, W]
    return [float(1.0 - d.mean() / (255 * np.sqrt(3))) for d in distance]


# Colour words a prompt may name, as RGB (the tiny colour task's targets).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 215, 40),
    "purple": (140, 50, 180),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}


def prompt_colour(prompt: str) -> tuple[int, int, int]:
    """The RGB of the one colour word of ``COLOURS`` in ``prompt`` (whole words, any case).

    Raises: ValueError when the prompt names no colour of ``COLOURS`` or several different ones.
    """
    words = {word.strip(".,;:!?'\"").lower() for word in prompt.split()}
    named = sorted(words & COLOURS.keys())
    if len(named) != 1:
        raise ValueError(f"prompt {prompt!r} must name exactly one colour of {sorted(COLOURS)}, it names {named}")
    return COLOURS[named[0]]


def named_colour_reward(prompts: Sequence[str], images: np.ndarray | Tensor) -> list[float]:
    """``colour_reward`` of each image against the colour its prompt names (``prompt_colour``): a text-to-image
    reward checked on pixels. Raises: ValueError as ``prompt_colour``, or for a prompt count unequal to the images'."""
    images = _as_uint8(images)
    if len(prompts) != len(images):
        raise ValueError(f"{len(prompts)} prompts for {len(images)} images")
    return [colour_reward(image[None], prompt_colour(prompt))[0] for prompt, image in zip(prompts, images)]


def _ignore_prompts(fn):
    def reward(prompts: Sequence[str], images: np.ndarray | Tensor) -> list[float]:
        return fn(images)

    reward.__doc__ = fn.__doc__
    return reward


# Built-in rewards by name: (prompts, images [B, H, W, 3] uint8) -> one float per image.
IMAGE_REWARDS = {
    "jpeg_compressibility": _ignore_prompts(jpeg_compressibility),
    "jpeg_incompressibility": _ignore_prompts(jpeg_incompressibility),
    "named_colour": named_colour_reward,
}


class ClipScore:
    """A learned text-image reward from a local CLIP-architecture directory: PickScore (Kirstain et al.,
    arXiv:2305.01569; ``yuvalkirstain/PickScore_v1``, Flow-GRPO's main reward) or a plain CLIP model (CLIPScore,
    Hessel et al., arXiv:2104.08718). The reward of image i is CLIP's logit for (image i, prompt i):
    exp(logit_scale) * cos(text embedding, image embedding), as PickScore defines it (about 20-23 for PickScore).

    The model is loaded once, frozen, from ``model_dir`` (``CLIPModel`` + its processor; nothing is downloaded).

    Args: model_dir: the local directory; device: where it runs; batch_size: images per forward.
    Raises: FileNotFoundError / OSError naming the directory when it holds no CLIP model and processor.
    """

    def __init__(self, model_dir: str, *, device: str | torch.device = "cpu", batch_size: int = 32) -> None:
        from transformers import AutoProcessor, CLIPModel

        self.model = CLIPModel.from_pretrained(model_dir).eval().requires_grad_(False).to(device)
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.device, self.batch_size = torch.device(device), batch_size

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], images: np.ndarray | Tensor) -> list[float]:
        from PIL import Image

        pixels = _as_uint8(images)
        if len(prompts) != len(pixels):
            raise ValueError(f"{len(prompts)} prompts for {len(pixels)} images")
        scores: list[float] = []
        for start in range(0, len(pixels), self.batch_size):
            rows = slice(start, start + self.batch_size)
            inputs = self.processor(
                text=list(prompts[rows]), images=[Image.fromarray(p) for p in pixels[rows]], return_tensors="pt",
                padding=True, truncation=True,
            )  # fmt: skip
            out = self.model(**{k: v.to(self.device) for k, v in inputs.items()})
            scores += out.logits_per_image.diagonal().float().cpu().tolist()
        return scores
