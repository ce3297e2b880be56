"""Vision-language models on the Megatron backend: Qwen2-VL (transformers ``qwen2_vl``), as Megatron-Bridge and slime
build it.

- **Language model**: Megatron's ``GPTModel``, converted from the VLM's text model (``model.language_model.*``,
  a Qwen2: ``language_config``) as ``miles.train.megatron.convert`` converts a text Qwen2, with Qwen2-VL's
  multimodal rotary embedding (``position_embedding_type="mrope"``, the text config's ``mrope_section``). Megatron's
  ``MultimodalRotaryEmbedding`` takes position ids [3, B, T] (temporal, height, width) and builds each rotary
  channel from the component its section names, cycling t, h, w over ``mrope_section * 2`` of cat(freqs, freqs):
  HF's ``apply_multimodal_rotary_pos_emb`` exactly. The positions are HF's own ``Qwen2VLModel.get_rope_index``.
- **Vision tower and patch merger**: the HF module (``model.visual``: ``Qwen2VisionTransformerPretrainedModel``,
  plain torch) held by the ``GPTModel`` as its submodule ``visual`` (``attach_vision_tower``), so its parameters
  are in Megatron's DDP and the optimizer like any parameter replicated over the ranks (no tensor-parallel split).
- **Forward** (``VisionLanguageView``): Megatron's word embedding of the text, the tower's merged features
  scattered into the image-placeholder positions in row-major [B, T] order (HF's ``masked_scatter``), the result
  handed to ``GPTModel`` as ``decoder_input`` ([T, B, H]).
- **Names** (``hf_to_megatron`` / ``megatron_to_hf``): ``model.visual.X`` <-> ``visual.X``; the text model's
  ``model.language_model.X`` <-> ``convert``'s names of ``model.X``; ``lm_head.weight`` as a text model's. Exports
  carry every tensor FSDP2's export of the same model carries, under the same names (a tied head once, as the
  embedding).

Supported: ``qwen2_vl``, tensor-parallel (the language model split as a text Qwen2's, no sequence parallelism for
a dense model, so every rank holds the whole decoder input; the tower replicated, its gradient whole on each rank
because Megatron's column-parallel input all-reduces the decoder input's gradient) and data-parallel, padded and
packed batches; pipeline and expert parallelism, LoRA and QAT are refused in one line (``check_supported``).
Other VLM families (Qwen3-VL's DeepStack and interleaved multimodal RoPE, Qwen3.5, SmolVLM / Idefics3 tiles,
Kimi K2.5) have no Megatron path here.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from miles.train.megatron import convert
from torch import Tensor

SUPPORTED_VLM_TYPES = ("qwen2_vl",)
BLOCK_DIAGONAL_MASK = "miles_block_diagonal_mask"  # as backend.CausalLMView: the attention the packed layout checks
VISUAL = "visual."  # the vision tower's prefix inside the GPTModel (HF: model.visual.)
_HF_VISUAL, _HF_TEXT = "model.visual.", "model.language_model."


def is_vision_language(hf_config: Any) -> bool:
    """Whether ``hf_config`` is a vision-language model's (it has a ``vision_config``)."""
    return getattr(hf_config, "vision_config", None) is not None


def language_config(hf_config: Any) -> Any:
    """The text model's config as the text architecture ``convert`` knows: for ``qwen2_vl`` a ``Qwen2Config`` of its
    ``text_config`` (head tied as the VLM's); a text model's config unchanged.

    Raises: ValueError (one line) for a vision-language model type without a Megatron path here.
    """
    if not is_vision_language(hf_config):
        return hf_config
    if hf_config.model_type not in SUPPORTED_VLM_TYPES:
        raise ValueError(
            f"train.backend megatron: vision-language model type {hf_config.model_type!r} is not supported (only "
            f"{', '.join(SUPPORTED_VLM_TYPES)}: Qwen2-VL, its language model a Qwen2 under multimodal RoPE); use "
            "--train.backend fsdp2"
        )
    from transformers import Qwen2Config

    text = {k: v for k, v in hf_config.text_config.to_dict().items() if k not in ("model_type", "architectures")}
    rope = dict(text.get("rope_parameters") or {})
    rope.pop("mrope_section", None)  # Megatron's mrope takes it from mrope_section (the VLM config's)
    text["rope_parameters"] = rope
    text["tie_word_embeddings"] = bool(getattr(hf_config, "tie_word_embeddings", False))
    return Qwen2Config(**text)


def mrope_section(hf_config: Any) -> list[int]:
    """Qwen2-VL's rotary pairs per position component (temporal, height, width); they sum to head_dim / 2."""
    return list(hf_config.text_config.rope_parameters["mrope_section"])


def check_supported(
    hf_config: Any,
    *,
    pipeline_parallel: int,
    expert_parallel: int,
    lora: bool,
    qat: str,
) -> None:
    """Refuse, one line naming the setting, what the Megatron backend does not run for a vision-language model yet;
    nothing for a text model. Raises: ValueError."""
    if not is_vision_language(hf_config):
        return
    language_config(hf_config)  # the model type
    refusals = {
        f"train.megatron.pipeline_parallel_size {pipeline_parallel}": pipeline_parallel > 1,
        f"train.megatron.expert_parallel_size {expert_parallel}": expert_parallel > 1,
        "train.lora": lora,
        f"train.qat {qat}": qat != "none",
    }
    for what, refused in refusals.items():
        if refused:
            raise ValueError(
                f"train.backend megatron trains vision-language models (Qwen2-VL) with tensor and data parallelism, "
                f"without LoRA or QAT, not with {what} yet; use --train.backend fsdp2"
            )


def attach_vision_tower(gpt: torch.nn.Module, hf_config: Any) -> None:
    """Give ``gpt`` the HF vision tower (with its patch merger) of ``hf_config`` as submodule ``visual`` (fp32;
    its weights are loaded with the language model's, ``hf_to_megatron``). Nothing for a text model."""
    if not is_vision_language(hf_config):
        return
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    gpt.visual = Qwen2VisionTransformerPretrainedModel._from_config(hf_config.vision_config, dtype=torch.float32)


def hf_to_megatron(hf_state: Mapping[str, Tensor], hf_config: Any, *, tensor_parallel: int) -> dict[str, Tensor]:
    """``convert.hf_to_megatron`` for text and vision-language models: a VLM's text tensors converted as its
    language model's, its vision tower's kept as they are under ``visual.``. Raises: as ``convert.hf_to_megatron``."""
    if not is_vision_language(hf_config):
        return convert.hf_to_megatron(hf_state, hf_config, tensor_parallel=tensor_parallel)
    text, vision = {}, {}
    for name, tensor in hf_state.items():
        if name.startswith(_HF_VISUAL):
            vision[VISUAL + name.removeprefix(_HF_VISUAL)] = tensor
        elif name.startswith(_HF_TEXT):
            text["model." + name.removeprefix(_HF_TEXT)] = tensor
        elif name == "lm_head.weight":
            text[name] = tensor
        else:
            raise ValueError(f"train.backend megatron: no conversion for HF tensor {name!r}")
    lm = language_config(hf_config)
    return convert.hf_to_megatron(text, lm, tensor_parallel=tensor_parallel) | vision


def megatron_to_hf(named: Iterable[tuple[str, Tensor]], hf_config: Any) -> Iterator[tuple[str, Tensor]]:
    """``convert.megatron_to_hf`` for text and vision-language models: a VLM's ``visual.*`` tensors as
    ``model.visual.*``, its language model's under the VLM's names (``model.language_model.*``, ``lm_head.weight``).
    One Megatron tensor at a time. Raises: as ``convert.megatron_to_hf``."""
    if not is_vision_language(hf_config):
        yield from convert.megatron_to_hf(named, hf_config)
        return
    lm = language_config(hf_config)
    for name, tensor in named:
        if name.startswith(VISUAL):
            yield _HF_VISUAL + name.removeprefix(VISUAL), tensor
            continue
        for hf_name, part in convert.megatron_to_hf([(name, tensor)], lm):
            yield (_HF_TEXT + hf_name.removeprefix("model.") if hf_name.startswith("model.") else hf_name), part


def rope_positions(hf_config: Any, input_ids: Tensor, attention_mask: Tensor, image_grid_thw: Tensor | None) -> Tensor:
    """Qwen2-VL's multimodal RoPE position ids, HF's own computation (``Qwen2VLModel.get_rope_index`` when the batch
    holds images, else 0..L-1 for each component, as HF's text model counts).

    Args:
        input_ids: [B, L] int64, right-padded; attention_mask: [B, L] 0/1.
        image_grid_thw: [I, 3] int64, the batch's images in row order; None for a text-only batch.
    Returns: [3, B, L] int64 (temporal, height, width).
    """
    batch, length = input_ids.shape
    if image_grid_thw is None:
        return torch.arange(length, device=input_ids.device).view(1, 1, -1).expand(3, batch, -1)
    is_image = (input_ids == hf_config.image_token_id).to(torch.int32)
    positions, _ = hf_rope_index(hf_config, input_ids, is_image, image_grid_thw, attention_mask=attention_mask)
    return positions


def hf_rope_index(
    hf_config: Any,
    input_ids: Tensor,
    mm_token_type_ids: Tensor,
    image_grid_thw: Tensor | None = None,
    video_grid_thw: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Transformers' ``Qwen2VLModel.get_rope_index`` for ``hf_config`` without an HF model (it reads the config and
    one sibling method only). Returns: position ids [3, B, L] int64, rope deltas [B, 1]."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    holder = SimpleNamespace(config=hf_config)
    holder.get_vision_position_ids = functools.partial(Qwen2VLModel.get_vision_position_ids, holder)
    return Qwen2VLModel.get_rope_index(
        holder, input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
        attention_mask=attention_mask,
    )  # fmt: skip


class VisionLanguageView:
    """A Megatron ``GPTModel`` holding a vision tower (``attach_vision_tower``), called as
    ``miles.core.log_probs.model_response_log_probs`` calls an HF vision-language model.

    ``view(input_ids=[B, L], attention_mask=[B, L] | None, position_ids=[4, 1, L] | [1, L] | None,
    logits_to_keep=int | [M], pixel_values=[P, D] | None, image_grid_thw=[I, 3] | None)`` returns an object with
    ``.logits`` [B, K, V] float (V: the HF vocabulary). Padded layout (``attention_mask``): right-padded rows attend
    causally, never to padded keys, at ``rope_positions``. Packed layout (no mask, one row): ``position_ids`` are
    ``miles.core.multimodal.packed_position_ids``' text positions restarting at each sequence (which attends only
    within itself: a block-diagonal causal mask) over its multimodal RoPE positions ([1, L]: a text-only batch, the
    same positions on all three components); ``get_rope_index`` is there for ``packed_position_ids``.
    As HF's embedding (``padding_idx``), the pad token's embedding row gets no gradient from the input side (the tied
    head's still reaches it); its value is unchanged.

    Args:
        model: the ``GPTModel`` (or its DDP wrapper); gpt: the ``GPTModel`` itself.
        hf_config: the VLM's HF config (image token, vision and rope settings; ``config`` of the view, which
            ``multimodal_forward_kwargs`` reads).
        vocab_size: the HF vocabulary.
    """

    def __init__(self, model: torch.nn.Module, hf_config: Any, vocab_size: int, *, gpt: torch.nn.Module) -> None:
        # not .model: packed_position_ids looks for get_rope_index on view.model, else on the view
        self.megatron, self.gpt, self.vocab_size = model, gpt, vocab_size
        # the decoder input is the whole sequence on every tensor-parallel rank (dense Qwen2: no sequence parallelism)
        assert not gpt.config.sequence_parallel, "scattering image features into a sequence-parallel chunk"
        self.config = copy.deepcopy(hf_config)  # (small) with the attention log_probs checks for the packed layout
        self.config._attn_implementation = BLOCK_DIAGONAL_MASK

    def get_rope_index(self, input_ids: Tensor, mm_token_type_ids: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """HF's ``get_rope_index`` (``hf_rope_index``) for this view's model."""
        return hf_rope_index(self.config, input_ids, mm_token_type_ids, **kwargs)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        mm_token_type_ids: Tensor | None = None,
        **_flash_kwargs: Any,
    ) -> SimpleNamespace:
        """See the class docstring. ``mm_token_type_ids`` is ignored: the placeholders are the image tokens."""
        length = input_ids.shape[1]
        steps = torch.arange(length, device=input_ids.device)
        masked = steps[None, :] > steps[:, None]  # [L, L], True = may not attend (Megatron's convention)
        if attention_mask is not None:  # padded
            positions = rope_positions(self.config, input_ids, attention_mask, image_grid_thw)  # [3, B, L]
            masked = masked[None, None] | ~attention_mask.bool()[:, None, None, :]  # [B, 1, L, L]
        else:  # packed: one row, sequences where the text positions restart
            assert position_ids is not None, "the packed layout passes position ids"
            text = position_ids[0] if position_ids.dim() == 3 else position_ids  # [1, L]
            positions = position_ids[1:] if position_ids.dim() == 3 else text[None].expand(3, -1, -1)  # [3, 1, L]
            sequence = (text == 0).cumsum(dim=-1)  # [1, L]
            masked = masked[None, None] | (sequence[:, None, :, None] != sequence[:, None, None, :])  # [1, 1, L, L]
        embeds = self.gpt.embedding(input_ids=input_ids, position_ids=None).transpose(0, 1)  # [B, L, H]
        pad = self.config.text_config.pad_token_id
        if pad is not None:  # HF's nn.Embedding(padding_idx=pad): the pad token's row gets no input gradient
            embeds = torch.where((input_ids == pad)[..., None], embeds.detach(), embeds)
        if pixel_values is not None:
            features = self.gpt.visual(pixel_values.to(embeds.dtype), grid_thw=image_grid_thw).pooler_output
            is_image = (input_ids == self.config.image_token_id)[..., None].expand_as(embeds)  # [B, L, H]
            embeds = embeds.masked_scatter(is_image, features.to(embeds.dtype))  # row-major, as HF's
        logits = self.megatron(input_ids, positions, masked, decoder_input=embeds.transpose(0, 1).contiguous())
        logits = logits[..., : self.vocab_size]  # [B, L, V]
        if isinstance(logits_to_keep, Tensor):
            logits = logits[:, logits_to_keep]
        elif logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)

    __call__ = forward
