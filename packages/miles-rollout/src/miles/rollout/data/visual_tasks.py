"""Bundled procedural visual questions for vision-language RL, drawn offline with PIL from a seed.

Each problem is a small picture (``image_size`` x ``image_size`` RGB, white background, default 64) and a fixed
question of one of ``FAMILIES``: count the circles, name the square's colour, say on which half the red shape is.
The answer is a short lowercase string known by construction (``reward.type exact_match`` scores it). Problem ``i``
of a source is a pure function of (seed, i): the shuffled, resumable order of ``EpochShuffledSource`` is all a
checkpoint needs.

It is for VLM RL: a text-only model cannot see the image, and the VLM rollout/trainer path that feeds it to a model
is being built. The prompt is chat messages in the layout transformers' multimodal chat templates take (a user
message whose content is an ``{"type": "image"}`` part, then a ``{"type": "text"}`` part); the image itself travels
beside it as base64 PNG text in ``metadata["images"]`` (one per image part, in order), so the sample stays plain
JSON-able data (checkpoints of queued prompts and remote rewards serialize metadata as JSON). ``decode_images`` turns
them back into PIL images.

Select it with ``data.source custom`` and ``data.source_path miles.rollout.data.visual_tasks:build_source``;
``data.task_kwargs`` may set ``families`` (a subset of the family names) and ``image_size`` (>= 32).
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles.core.sample import Sample
from miles.rollout.data.epoch import EpochShuffledSource
from miles.rollout.multimodal import load_image
from PIL import Image, ImageDraw

BACKGROUND = (255, 255, 255)
# Clearly distinct colours, far apart in RGB, so a picture's colours are unambiguous to a model and to a test.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "green": (20, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 200, 0),
}
MIN_IMAGE_SIZE = 32  # below this the circles of ``count`` are a few pixels wide
MAX_CIRCLES = 5


@dataclass(frozen=True)
class VisualFamily:
    """One kind of problem: its question, and a drawing of a random instance with that instance's answer."""

    name: str
    question: str
    draw: Callable[[random.Random, int], tuple[Image.Image, str]]


def _canvas(size: int) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (size, size), BACKGROUND)
    return image, ImageDraw.Draw(image)


def _draw_count(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    """1 to ``MAX_CIRCLES`` filled circles of one colour, at least 2 px apart (rejection sampling of the centres)."""
    num = rng.randint(1, MAX_CIRCLES)
    radius = max(3, size // 12)
    colour = PALETTE[rng.choice(sorted(PALETTE))]
    min_distance_sq = (2 * radius + 3) ** 2  # edges >= 2 px apart: the circles never touch
    centres: list[tuple[int, int]] = []
    while len(centres) < num:
        for _ in range(100):
            x, y = rng.randint(radius + 1, size - radius - 2), rng.randint(radius + 1, size - radius - 2)
            if all((x - cx) ** 2 + (y - cy) ** 2 >= min_distance_sq for cx, cy in centres):
                centres.append((x, y))
                break
        else:  # jammed (on a 32 px canvas 4 well-spread circles can leave no room for a 5th): start again
            centres = []
    image, draw = _canvas(size)
    for x, y in centres:
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=colour)
    return image, str(num)


def _draw_colour(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    """One filled square of a palette colour, of side a quarter to a half of the canvas, anywhere on it."""
    name = rng.choice(sorted(PALETTE))
    side = rng.randint(size // 4, size // 2)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    image, draw = _canvas(size)
    draw.rectangle((x, y, x + side - 1, y + side - 1), fill=PALETTE[name])
    return image, name


def _draw_position(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    """A red circle or square wholly inside the left or right half, drawn over 0-2 shapes of other colours."""
    image, draw = _canvas(size)
    others = sorted(set(PALETTE) - {"red"})
    for _ in range(rng.randint(0, 2)):
        side = rng.randint(size // 8, size // 4)
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        draw.rectangle((x, y, x + side - 1, y + side - 1), fill=PALETTE[rng.choice(others)])
    answer = rng.choice(("left", "right"))
    half = size // 2
    side = rng.randint(size // 8, size // 4)
    low = 1 if answer == "left" else half + 1
    x = rng.randint(low, low + half - side - 2)  # x .. x + side - 1 stays within [low, low + half - 2]
    y = rng.randint(0, size - side)
    box = (x, y, x + side - 1, y + side - 1)
    if rng.random() < 0.5:
        draw.ellipse(box, fill=PALETTE["red"])
    else:
        draw.rectangle(box, fill=PALETTE["red"])
    return image, answer


FAMILIES: tuple[VisualFamily, ...] = (
    VisualFamily(
        "count",
        "How many circles are in the image? Answer with a single digit.",
        _draw_count,
    ),
    VisualFamily(
        "colour",
        f"What colour is the square? Answer with one word: {', '.join(PALETTE)}.",
        _draw_colour,
    ),
    VisualFamily(
        "position",
        "Is the red shape on the left or the right half of the image? Answer with one word: left or right.",
        _draw_position,
    ),
)
FAMILY_NAMES: tuple[str, ...] = tuple(family.name for family in FAMILIES)


def make_problem(
    index: int, *, seed: int, image_size: int = 64, families: Sequence[str] = FAMILY_NAMES
) -> tuple[VisualFamily, Image.Image, str]:
    """Problem ``index`` of ``seed``: its family (``index`` mod the number of ``families``, in the given order), its
    RGB image of ``image_size`` x ``image_size`` and its lowercase answer."""
    chosen = [family for name in families for family in FAMILIES if family.name == name]
    family = chosen[index % len(chosen)]
    image, answer = family.draw(random.Random(seed * 1_000_003 + index), image_size)
    return family, image, answer


def encode_png(image: Image.Image) -> str:
    """The PNG file of ``image`` as base64 text: lossless, so ``decode_images`` gives back exactly the drawn pixels,
    and JSON-able."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_images(sample_or_metadata: Sample | dict[str, Any]) -> list[Image.Image]:
    """The RGB images of a sample (or of its ``metadata`` dict), one per image part of its prompt, in order."""
    metadata = sample_or_metadata.metadata if isinstance(sample_or_metadata, Sample) else sample_or_metadata
    return [load_image(entry) for entry in metadata["images"]]


def _validate(families: Sequence[str], image_size: int) -> None:
    if isinstance(families, str) or not families or not set(families) <= set(FAMILY_NAMES):
        raise ValueError(
            f"data.task_kwargs.families is {families!r}; it must be a non-empty list of visual task families, "
            f"from {list(FAMILY_NAMES)} (e.g. --data.task-kwargs '{{families: [count, colour]}}')"
        )
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < MIN_IMAGE_SIZE:
        raise ValueError(
            f"data.task_kwargs.image_size is {image_size!r}; it must be an integer >= {MIN_IMAGE_SIZE}: on a "
            "smaller canvas the shapes are a few pixels wide. The default is 64."
        )


class VisualTaskSource(EpochShuffledSource):
    """``DataSource`` over ``size`` bundled visual problems (``make_problem``), reshuffled every epoch.

    The label is the answer (``reward.type exact_match``); metadata holds ``data_index``, ``family`` and ``images``
    (the base64 PNG of the prompt's one image).

    Raises: ValueError naming ``data.task_kwargs.families`` or ``data.task_kwargs.image_size`` for a bad value.
    """

    def __init__(
        self,
        *,
        size: int,
        seed: int,
        families: Sequence[str] = FAMILY_NAMES,
        image_size: int = 64,
        system_prompt: str | None = None,
        prompt_suffix: str = "",
    ) -> None:
        _validate(families, image_size)
        self.size, self.seed, self.families, self.image_size = size, seed, tuple(families), image_size
        self.system_prompt, self.prompt_suffix = system_prompt, prompt_suffix
        self._start()

    def sample_at(self, index: int, group_index: int) -> Sample:
        family, image, answer = make_problem(index, seed=self.seed, image_size=self.image_size, families=self.families)
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        content = [{"type": "image"}, {"type": "text", "text": family.question + self.prompt_suffix}]
        messages.append({"role": "user", "content": content})
        return Sample(
            index=group_index,
            group_index=group_index,
            prompt=messages,
            label=answer,
            metadata={"data_index": index, "family": family.name, "images": [encode_png(image)]},
        )


def build_source(context: Any) -> VisualTaskSource:
    """``data.source_path`` factory (``miles.core.protocols.DataContext``): ``data.size`` problems of the split's
    seed; ``data.task_kwargs`` may set ``families`` (default all) and ``image_size`` (default 64).

    Raises: ValueError naming ``data.task_kwargs`` for another key or a bad value.
    """
    data = context.data
    unknown = sorted(set(data.task_kwargs) - {"families", "image_size"})
    if unknown:
        raise ValueError(
            f"data.task_kwargs {unknown} are not options of the visual tasks; only families and image_size are"
        )
    return VisualTaskSource(
        size=data.size,
        seed=context.seed,
        families=data.task_kwargs.get("families", FAMILY_NAMES),
        image_size=data.task_kwargs.get("image_size", 64),
        system_prompt=data.system_prompt or None,
        prompt_suffix=data.prompt_suffix,
    )
