"""LoRA adapters inside the embedded engine: adapter-only weight updates (``train.lora.sync adapter``).

The trainer sends only the adapters, under its injected names (``<module>.lora_A.default.weight`` [r, in] and
``<module>.lora_B.default.weight`` [out, r]) with the LoRA scaling (alpha / r, or alpha / sqrt(r) with rsLoRA)
already folded into B, so the engine applies ``W x + B' A x`` with scaling 1 and the scaling is applied exactly
once. On the first such update the engine wraps the named modules with peft LoRA layers (rank from A's shape);
every later update must carry every adapter tensor the engine holds, so none is left from an older version. The
base weights stay as loaded: ``W`` is never sent merged while the engine also applies the adapter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

ADAPTER = "default"  # peft's adapter name, as in the trainer's names
_BASE = ".base_layer."


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a LoRA adapter tensor (``...lora_A.default.weight`` / ``...lora_B.default.weight``)."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def adapter_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's LoRA-wrapped modules by name (empty before the first adapter update)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is needed only once adapters arrive
        return {}
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def apply_adapter_update(model: nn.Module, named: Iterable[tuple[str, Tensor]]) -> None:
    """Copy an adapter update into ``model``, wrapping its target modules with LoRA layers on the first one.

    Args:
        model: the engine's HF causal LM.
        named: every adapter tensor of the policy (A [r, in], B [out, r] with the scaling folded in), trainer names.
    Raises: ValueError (one line) when a name's module is no Linear layer of the model, A's rank differs between
        modules or from the adapters held, shapes differ, or the update leaves out an adapter the engine holds
        (it would apply a stale one). Nothing is loaded then.
    """
    updates = dict(named)
    targets = sorted({name.split(".lora_", 1)[0] for name in updates})
    held = adapter_modules(model)
    if not held:
        _inject(model, targets, updates)
        held = adapter_modules(model)
    state = model.state_dict()
    expected = {name for name in state if is_adapter_name(name)}
    missing, unknown = sorted(expected - set(updates)), sorted(set(updates) - expected)
    if missing or unknown:
        raise ValueError(
            f"an adapter update must carry exactly the adapters the engine holds: missing {missing[:3]}, unknown "
            f"{unknown[:3]} (the trainer's train.lora target_modules changed during the run?); nothing was loaded"
        )
    for name, tensor in updates.items():
        if state[name].shape != tensor.shape:
            raise ValueError(
                f"adapter {name!r} has shape {tuple(tensor.shape)}, the engine's is {tuple(state[name].shape)} "
                "(another train.lora.rank?); nothing was loaded"
            )
    with torch.no_grad():
        for name, tensor in updates.items():
            state[name].copy_(tensor)


def _inject(model: nn.Module, targets: list[str], updates: dict[str, Tensor]) -> None:
    """Wrap ``targets`` (full module names) with rank-r LoRA layers of scaling 1 (lora_alpha = r)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ValueError("adapter weight updates need peft: pip install peft") from None
    modules = dict(model.named_modules())
    ranks = {updates[name].shape[0] for name in updates if f".lora_A.{ADAPTER}." in name}
    for target in targets:
        if not isinstance(modules.get(target), nn.Linear):
            raise ValueError(
                f"an adapter update names {target!r}, which is not a Linear layer of the engine's model; "
                "nothing was loaded"
            )
    if len(ranks) != 1:
        raise ValueError(f"an adapter update has lora_A tensors of ranks {sorted(ranks)}; one rank is expected")
    (rank,) = ranks
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]):  # peft draws A from the global RNG; it is overwritten right away
        inject_adapter_in_model(config, model)
    model.requires_grad_(False)


def base_name(state: dict[str, Tensor], name: str) -> str:
    """``name`` as the model's state dict holds it: an HF weight name of an adapter-wrapped module
    (``X.weight``) is ``X.base_layer.weight`` there; any other name is returned as is."""
    if name in state:
        return name
    prefix, _, last = name.rpartition(".")
    wrapped = f"{prefix}{_BASE}{last}"
    return wrapped if wrapped in state else name
