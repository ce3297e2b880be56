"""Apply FSDP2 (``fully_shard``) to an HF decoder-only model; a world-size-1 fp32 model is left as it is."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def parallelize(model: nn.Module, *, mesh: DeviceMesh, param_dtype: torch.dtype) -> nn.Module:
    """Shard each decoder layer, then the root (embeddings, final norm, LM head) with FSDP2.

    Order matters: inner modules are sharded first so that each layer gets its own all-gather/reduce-scatter
    group, and the root group holds only what is left (tied embedding + LM head share one parameter there).

    On a 1-rank mesh with fp32 compute there is nothing to shard and nothing to cast, and FSDP2 would still
    all-gather every layer into freshly allocated buffers for each micro-batch (twice: forward, and backward
    after resharding) and copy the gradients through a reduce-scatter; the model is returned unwrapped instead
    (same numerics; ``docs/performance.md``, trainer section). bf16 keeps FSDP2 for its mixed-precision policy.

    A vision-language model (Qwen-VL: ``model.model.language_model.layers`` and ``model.model.visual.blocks``;
    Idefics3 / SmolVLM: ``model.model.text_model.layers`` and ``model.model.vision_model.encoder.layers``) has each
    decoder layer and each vision block sharded the same way; the root group also holds the patch embedding and
    merger (connector).

    Args:
        model: an HF causal LM whose decoder layers are ``model.model.layers`` (or a VLM as above); fp32
            parameters (the master copy).
        mesh: 1-D data-parallel mesh (gloo on CPU, NCCL on GPU).
        param_dtype: dtype of the all-gathered parameters used in forward/backward; gradients are reduced and
            stored in fp32.
    Returns: the same module, sharded in place (or untouched: 1 rank, fp32).
    Raises: ValueError if the model has no decoder layers where expected.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = _blocks(model)
    if mesh.size() == 1 and param_dtype == torch.float32:
        return model
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if mesh.size() > 1:
        keep_vision_tower_in_step(model)
    return model


def keep_vision_tower_in_step(model: nn.Module) -> bool:
    """Make every forward of a sharded vision-language model run its vision tower, on a blank image when no row has
    one (Qwen-VL: ``model.model.visual``; Idefics3 / SmolVLM: ``model.model.vision_model`` and ``connector``).

    FSDP2 all-gathers each vision block as it runs and reduce-scatters the tower's gradients after backward: a rank
    whose micro-batch has no image (text rows of a mixture) would skip those collectives while the other ranks wait
    in them. When the tower has not run by the time the language model is called, this runs it on one smallest
    blank image (Qwen-VL: grid 1 x merge x merge; Idefics3: one tile, every pixel real) and adds
    ``0 * sum(outputs)`` to ``inputs_embeds``: the forward's values are unchanged (x + 0 = x) and every tower
    parameter gets a zero gradient, as verl does for Qwen2-VL.

    Args:
        model: an HF Qwen-VL model (``model.model.visual`` and ``model.model.language_model``) or Idefics3 / SmolVLM
            model (``model.model.vision_model``, ``.connector`` and ``.text_model``), already sharded.
    Returns: True when the hooks were installed, False for a model without either layout (text models).
    """
    blank = _blank_vision_forward(getattr(model, "model", model))
    if blank is None:
        return False
    tower, language, run_blank = blank
    ran = [False]

    def reset(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ran[0] = False

    def mark(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        ran[0] = True

    def fill(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        embeds = kwargs.get("inputs_embeds")
        if ran[0] or embeds is None:
            return None
        total = sum(t.float().sum() for t in _float_tensors(run_blank(embeds.device)))
        return args, {**kwargs, "inputs_embeds": embeds + 0.0 * total.to(embeds.dtype)}

    model.register_forward_pre_hook(reset, with_kwargs=True)
    tower.register_forward_hook(mark, with_kwargs=True)
    language.register_forward_pre_hook(fill, with_kwargs=True)
    return True


def _blank_vision_forward(inner: nn.Module) -> tuple[nn.Module, nn.Module, Callable[[torch.device], object]] | None:
    """(vision tower, language model, a function of the device running the tower, and the connector where it is a
    sibling, on one blank image) of a Qwen-VL or Idefics3 model's inner module; None for other models."""
    tower, language = getattr(inner, "visual", None), getattr(inner, "language_model", None)
    proj = getattr(getattr(tower, "patch_embed", None), "proj", None)
    if tower is not None and language is not None and proj is not None:
        merge = int(getattr(tower, "spatial_merge_size", 1))
        patch_dim = math.prod(proj.weight.shape[1:])  # channels x temporal patch x patch x patch (global shape)

        def qwen_vl(device: torch.device) -> object:
            pixels = torch.zeros(merge * merge, patch_dim, device=device)
            grid = torch.tensor([[1, merge, merge]], device=device)
            return tower(pixels, grid_thw=grid, return_dict=True)

        return tower, language, qwen_vl
    tower, language, connector = (getattr(inner, n, None) for n in ("vision_model", "text_model", "connector"))
    if tower is None or language is None or connector is None:
        return None
    vision = tower.config
    side = vision.image_size

    def idefics3(device: torch.device) -> object:
        pixels = torch.zeros(1, vision.num_channels, side, side, device=device)
        patches = torch.ones(1, side // vision.patch_size, side // vision.patch_size, dtype=torch.bool, device=device)
        return connector(tower(pixel_values=pixels, patch_attention_mask=patches).last_hidden_state)

    return tower, language, idefics3


def _float_tensors(output: object) -> list[torch.Tensor]:
    """Every floating-point tensor in a module's output (a tensor, a ModelOutput / dict, or nested lists)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _float_tensors(item)]
    return []


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (and a VLM's vision blocks) that get their own FSDP2 group."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is not None:
        return list(layers)
    language = getattr(getattr(inner, "language_model", None), "layers", None)
    if language is None:  # Idefics3 / SmolVLM: model.model.text_model.layers, model.model.vision_model.encoder.layers
        language = getattr(getattr(inner, "text_model", None), "layers", None)
    if language is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers; FSDP2 parallelize supports HF decoder LMs")
    vision = getattr(getattr(inner, "visual", None), "blocks", None)
    if vision is None:
        vision = getattr(getattr(getattr(inner, "vision_model", None), "encoder", None), "layers", [])
    return [*vision, *language]
