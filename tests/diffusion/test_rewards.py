"""Offline image rewards (``miles.diffusion.rewards``): JPEG size from PIL itself, a flat image more compressible
than noise, the colour rule by hand."""

import io

import numpy as np
import pytest
import torch
from miles.diffusion.rewards import colour_reward, jpeg_compressibility, jpeg_incompressibility, jpeg_size_kb, to_uint8
from PIL import Image


def test_jpeg_rewards_are_the_files_size_and_prefer_flat_images():
    rng = np.random.default_rng(0)
    flat = np.full((1, 32, 32, 3), 128, dtype=np.uint8)
    noise = rng.integers(0, 256, size=(1, 32, 32, 3), dtype=np.uint8)
    images = np.concatenate([flat, noise])
    buffer = io.BytesIO()
    Image.fromarray(noise[0]).save(buffer, format="JPEG", quality=95)
    assert jpeg_size_kb(images)[1] == pytest.approx(len(buffer.getvalue()) / 1000)
    compress = jpeg_compressibility(images)
    assert compress[0] > compress[1]  # the flat image is smaller
    assert jpeg_incompressibility(images) == [-c for c in compress]


def test_colour_reward_by_hand():
    red = np.zeros((1, 2, 2, 3), dtype=np.uint8)
    red[..., 0] = 255
    half = red.copy()
    half[0, 0, :] = 0  # top row black: distance 255 from red
    assert colour_reward(red, (255, 0, 0)) == [1.0]
    assert colour_reward(half, (255, 0, 0))[0] == pytest.approx(1 - (2 * 255 / 4) / (255 * np.sqrt(3)))
    with pytest.raises(ValueError, match="three values in"):
        colour_reward(red, (300, 0, 0))
    with pytest.raises(ValueError, match=r"\[B, H, W, 3\] uint8"):
        colour_reward(red.astype(np.float32), (255, 0, 0))


def test_decoder_output_converts_to_pixels():
    images = torch.tensor([[[[-1.0]], [[0.0]], [[1.0]]]])  # [1, 3, 1, 1]
    assert to_uint8(images).tolist() == [[[[0, 128, 255]]]]


def test_named_colour_reads_the_prompts_colour_word():
    from miles.diffusion.rewards import COLOURS, IMAGE_REWARDS, named_colour_reward, prompt_colour

    assert prompt_colour("A RED square.") == COLOURS["red"] and prompt_colour("blue, please") == COLOURS["blue"]
    red = np.broadcast_to(np.array(COLOURS["red"], dtype=np.uint8), (2, 4, 4, 3)).copy()
    assert named_colour_reward(["a red image", "a blue image"], red)[0] == 1.0
    # red (220, 40, 40) vs blue (40, 70, 220): |(180, -30, -180)| = 256.32 of 441.67
    assert named_colour_reward(["a red image", "a blue image"], red)[1] == pytest.approx(1 - 256.3201 / 441.6730, 1e-5)
    assert IMAGE_REWARDS["named_colour"] is named_colour_reward
    assert IMAGE_REWARDS["jpeg_compressibility"](["ignored"], red) == jpeg_compressibility(red)
    with pytest.raises(ValueError, match="must name exactly one colour .* it names \\[\\]"):
        prompt_colour("a reddish dog")
    with pytest.raises(ValueError, match="it names \\['blue', 'red'\\]"):
        prompt_colour("red and blue")
    with pytest.raises(ValueError, match="1 prompts for 2 images"):
        named_colour_reward(["a red image"], red)
