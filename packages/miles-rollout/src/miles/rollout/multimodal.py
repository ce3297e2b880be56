"""Rendering image prompts for vision-language policies: the model's own image processor runs once, at rollout.

A multimodal prompt is chat messages whose content parts include ``{"type": "image"}``; the images travel beside
them in the sample's ``metadata["images"]`` (one per image part, in order: base64 PNG/JPEG text, raw bytes, or a
local file path). ``VisionProcessor.render`` applies the chat template, runs the image processor, expands each
image's placeholder token to the number of tokens its patches merge into, and tokenizes, giving the prompt's token
ids and its ``multimodal_inputs`` (``miles.core.multimodal``). The engine and the trainer then use exactly these
tensors, so the two sides never process an image differently.

This is what transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors do for images, written out because their
processor classes also build a video processor, which needs torchvision (not installable beside the CPU torch
build). The image processor itself is the model's (``AutoImageProcessor``, the PIL backend without torchvision).
Idefics3 / SmolVLM models (``miles.core.multimodal.IDEFICS3_MODEL_TYPES``) are rendered as their processors do:
each image becomes its tiles (``pixel_values`` [N, C, H, W], ``pixel_attention_mask`` [N, H, W]) and its
placeholder the tile layout's text (``<fake_token_around_image><row_1_col_1><image>...<global-img><image>...``,
transformers' ``get_image_prompt_string``), ``image_seq_len`` placeholders per tile.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from miles.core.multimodal import (
    MultimodalInputs,
    idefics3_image_seq_len,
    is_idefics3_config,
    is_multimodal_config,
)
from miles.core.sample import Sample

IMAGE_PART_TYPES = ("image", "image_url")


class VisionProcessor:
    """A vision-language model's tokenizer and image processor; behaves as the tokenizer everywhere else.

    Everything but ``render`` / ``render_sample`` is the tokenizer's (``decode``, ``apply_chat_template``,
    ``eos_token_id``, ...), so code written for a text policy's tokenizer takes it unchanged.

    Args:
        tokenizer: the model's HF tokenizer; its chat template renders an image part as the image placeholder.
        image_processor: the model's HF image processor (Qwen-VL layout: ``pixel_values`` [P, D],
            ``image_grid_thw`` [I, 3]; Idefics3 layout: ``pixel_values`` [1, N, C, H, W], ``pixel_attention_mask``
            [1, N, H, W]).
        image_token: the placeholder token (``config.image_token_id``'s), repeated once per merged patch (per tile
            position for Idefics3).
        merge_size: patches merged per side into one token (``vision_config.spatial_merge_size``); Qwen-VL only.
        layout: "qwen_vl" (the default) or "idefics3" (Idefics3 / SmolVLM tiles).
        image_seq_len: Idefics3 layout: placeholders per tile (``miles.core.multimodal.idefics3_image_seq_len``).
    """

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        *,
        image_token: str,
        merge_size: int,
        layout: Literal["qwen_vl", "idefics3"] = "qwen_vl",
        image_seq_len: int = 0,
    ) -> None:
        if layout == "idefics3" and image_seq_len < 1:
            raise ValueError(
                f"the idefics3 layout needs image_seq_len >= 1 (placeholders per tile), got {image_seq_len}"
            )
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = image_token
        self.merge_size = merge_size
        self.layout = layout
        self.image_seq_len = image_seq_len
        # render runs in worker threads (off the rollout's event loop); an HF fast tokenizer used from two threads at
        # once can fail ("Already borrowed"), so renders take turns
        self._render_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, trust_remote_code: bool = False) -> VisionProcessor:
        """The processor of the VLM at ``path``: its tokenizer, image processor and chat template (the tokenizer's,
        else ``chat_template.jinja`` / ``chat_template.json`` beside it, where Qwen-VL models keep it).
        ``trust_remote_code`` runs the model's own classes (``auto_map``), as ``models.policy.trust_remote_code``.

        Raises: ValueError when the model is not a vision-language model or has no chat template.
        """
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        if not is_multimodal_config(config):
            raise ValueError(f"the model at {path} has no vision tower (no vision_config); it takes text prompts only")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if not tokenizer.chat_template:
            tokenizer.chat_template = _read_chat_template(Path(path))
        if not tokenizer.chat_template:
            raise ValueError(f"the model at {path} has no chat template; a multimodal prompt needs one")
        image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        idefics3 = is_idefics3_config(config)
        return cls(
            tokenizer,
            image_processor,
            image_token=tokenizer.convert_ids_to_tokens(config.image_token_id),
            merge_size=getattr(config.vision_config, "spatial_merge_size", 1),
            layout="idefics3" if idefics3 else "qwen_vl",
            image_seq_len=idefics3_image_seq_len(config) if idefics3 else 0,
        )

    def __getattr__(self, name: str) -> Any:  # only called for names this class does not define
        if name in ("tokenizer", "__setstate__"):  # not set yet (unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_render_lock"}  # a lock does not pickle

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._render_lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def save_pretrained(self, directory: str | Path, **kwargs: Any) -> Any:
        """Save the tokenizer (with its chat template) and the image processor, so ``from_pretrained`` of a
        checkpoint's or export's model directory gives this processor back."""
        self.image_processor.save_pretrained(directory)
        return self.tokenizer.save_pretrained(directory, **kwargs)

    def render(
        self, messages: list[dict[str, Any]], images: Sequence[Any]
    ) -> tuple[list[int], MultimodalInputs | None]:
        """Prompt token ids (chat template, generation prompt appended) and image inputs of ``messages``.

        Args:
            messages: chat messages; a message's content is text or a list of parts, an image part being
                ``{"type": "image"}`` (or ``"image_url"``).
            images: one PIL image per image part, in order.
        Returns: (token ids, ``{"pixel_values": [P, D] float32, "image_grid_thw": [I, 3] int64}`` (Idefics3:
            ``{"pixel_values": [N, C, H, W] float32, "pixel_attention_mask": [N, H, W] bool}``) or None without
            images).
        Raises: ValueError when the number of image parts and images differ.
        """
        with self._render_lock:
            return self._render(messages, images)

    def image_inputs(self, images: Sequence[Any]) -> MultimodalInputs:
        """The model's image processor over ``images`` (RGB PIL images, in order): ``{"pixel_values": [P, D]
        float32, "image_grid_thw": [I, 3] int64}``; each image takes ``prod(grid) / merge_size**2`` placeholders.
        Idefics3 layout: ``{"pixel_values": [N, C, H, W] float32, "pixel_attention_mask": [N, H, W] bool}``, the
        tiles of all images (``idefics3_tiles``)."""
        import torch

        if self.layout == "idefics3":
            return self.idefics3_tiles(images)[0]
        processed = self.image_processor(images=list(images), return_tensors="pt")
        return {
            "pixel_values": processed["pixel_values"].to(torch.float32),
            "image_grid_thw": processed["image_grid_thw"].to(torch.int64),
        }

    def _render(
        self, messages: list[dict[str, Any]], images: Sequence[Any]
    ) -> tuple[list[int], MultimodalInputs | None]:
        num_parts = count_image_parts(messages)
        if num_parts != len(images):
            raise ValueError(
                f"the prompt has {num_parts} image parts but {len(images)} images; give one image per "
                "{'type': 'image'} part in metadata['images']"
            )
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if text.count(self.image_token) != num_parts:
            raise ValueError(
                f"the chat template rendered {text.count(self.image_token)} image placeholders "
                f"({self.image_token!r}) for {num_parts} image parts; the model's template must render each image part"
            )
        inputs = None
        if images and self.layout == "idefics3":
            inputs, expansions = self.idefics3_tiles(images)
            pieces = text.split(self.image_token)
            text = pieces[0] + "".join(expanded + piece for expanded, piece in zip(expansions, pieces[1:]))
        elif images:
            inputs = self.image_inputs(images)
            pieces = text.split(self.image_token)
            counts = [int(n) // self.merge_size**2 for n in inputs["image_grid_thw"].prod(dim=1)]
            text = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], inputs

    def idefics3_tiles(self, images: Sequence[Any]) -> tuple[MultimodalInputs, list[str]]:
        """Idefics3 / SmolVLM: the image processor over ``images`` (RGB PIL images of one prompt, in order) and the
        text each image's placeholder expands to, as transformers' ``Idefics3Processor`` / ``SmolVLMProcessor``
        write it (``get_image_prompt_string``: per tile row and column ``<fake_token_around_image><row_r_col_c>``
        and ``image_seq_len`` placeholders, then the global view's ``<global-img>`` and placeholders).

        Returns: (``{"pixel_values": [N, C, H, W] float32, "pixel_attention_mask": [N, H, W] bool}``, N the tiles
            of all images; one expansion per image).
        """
        import torch
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string  # Idefics3 writes the same

        processed = self.image_processor(images=[list(images)], return_tensors="pt", return_row_col_info=True)
        fake = getattr(self.tokenizer, "fake_image_token", "<fake_token_around_image>")
        global_token = getattr(self.tokenizer, "global_image_token", "<global-img>")
        expansions = [
            get_image_prompt_string(rows, cols, self.image_seq_len, fake, self.image_token, global_token)
            for rows, cols in zip(processed["rows"][0], processed["cols"][0])
        ]
        inputs = {
            "pixel_values": processed["pixel_values"][0].to(torch.float32),  # [N, C, H, W]
            "pixel_attention_mask": processed["pixel_attention_mask"][0].to(torch.bool),  # [N, H, W]
        }
        return inputs, expansions

    def render_sample(self, sample: Sample) -> tuple[list[int], MultimodalInputs | None]:
        """``render`` of a sample's chat prompt with the images of its ``metadata["images"]``; without images, a
        plain string is tokenized as is and token ids pass through (as ``miles.rollout.generate.render_prompt``).

        Raises: ValueError for a prompt that is not chat messages while it has images, or an unreadable image.
        """
        entries = sample.metadata.get("images") or []
        prompt = sample.prompt
        if not entries and isinstance(prompt, str):
            return self(prompt, add_special_tokens=False)["input_ids"], None
        if not entries and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt), None
        if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
            raise ValueError("a sample with metadata['images'] needs a chat-message prompt with image parts")
        return self.render(prompt, [load_image(entry) for entry in entries])


def count_image_parts(messages: list[dict[str, Any]]) -> int:
    """Number of image content parts over all messages."""
    return sum(
        1
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
    )


def load_image(entry: Any) -> Any:
    """An RGB PIL image from a ``metadata["images"]`` entry: a PIL image, raw bytes, base64 text, or a local path.

    A ``data:image/...;base64,`` URI is base64 text. Bytes and PIL images work in memory but are not JSON-able:
    data sources meant for checkpoints and remote rewards store base64 text or paths.

    Raises: ValueError naming what could not be read.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(entry, Image.Image):
        return entry.convert("RGB")
    try:
        if isinstance(entry, bytes | bytearray):
            return Image.open(io.BytesIO(entry)).convert("RGB")
        if isinstance(entry, str | Path):
            text = str(entry)
            if text.startswith("data:") and ";base64," in text[:64]:
                text = text.split(";base64,", 1)[1]
            elif is_file_path(text):
                return Image.open(text).convert("RGB")
            return Image.open(io.BytesIO(base64.b64decode(text, validate=True))).convert("RGB")
    except (OSError, UnidentifiedImageError, binascii.Error) as err:
        raise ValueError(f"metadata['images'] entry is not a readable image ({err})") from None
    raise ValueError(f"metadata['images'] entry of type {type(entry).__name__}: give base64 text, bytes or a file path")


def image_data(entries: Sequence[Any]) -> list[str]:
    """``metadata["images"]`` entries as base64-encoded image files, the form an SGLang-API server's
    ``image_data`` takes: the original file bytes where there are some (base64 text as is, a data URI's payload,
    a file's or raw bytes' base64), a PIL image as PNG; so the server decodes exactly what ``load_image`` decodes.

    Raises: ValueError as ``load_image`` for an entry that is not a readable image.
    """
    from PIL import Image

    payloads = []
    for entry in entries:
        load_image(entry)  # refuse an unreadable entry here, not on the server
        if isinstance(entry, Image.Image):
            buffer = io.BytesIO()
            entry.save(buffer, format="PNG")
            payloads.append(base64.b64encode(buffer.getvalue()).decode())
        elif isinstance(entry, bytes | bytearray):
            payloads.append(base64.b64encode(bytes(entry)).decode())
        elif str(entry).startswith("data:") and ";base64," in str(entry)[:64]:
            payloads.append(str(entry).split(";base64,", 1)[1])
        elif is_file_path(entry):
            payloads.append(base64.b64encode(Path(entry).read_bytes()).decode())
        else:
            payloads.append(str(entry))
    return payloads


def is_file_path(text: str | Path) -> bool:
    """Whether ``text`` names an existing file; False (not an error) for text that cannot be a path, such as
    base64 image data longer than a file name may be (``Path.is_file`` raises ENAMETOOLONG there)."""
    if len(str(text)) > 4096:
        return False
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # ENAMETOOLONG, an embedded NUL
        return False


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> Any:
    """The policy's tokenizer: a ``VisionProcessor`` for a vision-language model, else ``AutoTokenizer``'s.
    ``trust_remote_code`` runs the checkpoint's own classes (``auto_map``), as ``models.policy.trust_remote_code``."""
    from transformers import AutoConfig, AutoTokenizer

    if is_multimodal_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)):
        return VisionProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _read_chat_template(path: Path) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text()).get("chat_template")
    return None
