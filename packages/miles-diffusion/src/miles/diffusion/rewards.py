"""Image rewards that need no model and no network: JPEG (in)compressibility as in DDPO, and a colour rule checked
on the pixels. Each takes a batch of images and returns one float per image.

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
