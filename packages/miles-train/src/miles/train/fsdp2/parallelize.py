"""Apply FSDP2 (``fully_shard``) to an HF decoder-only model; a world-size-1 fp32 model is left as it is."""

from __future__ import annotations

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

    A vision-language model (Qwen-VL: ``model.model.language_model.layers`` and ``model.model.visual.blocks``) has
    each decoder layer and each vision block sharded the same way; the root group also holds the patch embedding
    and merger.

    Args:
        model: an HF causal LM whose decoder layers are ``model.model.layers`` (or a Qwen-VL model as above); fp32
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
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (and a VLM's vision blocks) that get their own FSDP2 group."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is not None:
        return list(layers)
    language = getattr(getattr(inner, "language_model", None), "layers", None)
    if language is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers; FSDP2 parallelize supports HF decoder LMs")
    return [*getattr(getattr(inner, "visual", None), "blocks", []), *language]
