"""LoRA adapter-only weight updates (``train.lora.sync adapter``): applied inside the embedded engine, and the peft
directory format server engines load them from.

The trainer sends only the adapters, under its injected names (``<module>.lora_A.default.weight`` [r, in] and
``<module>.lora_B.default.weight`` [out, r]) with the LoRA scaling (alpha / r, or alpha / sqrt(r) with rsLoRA)
already folded into B, so the engine applies ``W x + B' A x`` with scaling 1 and the scaling is applied exactly
once. On the first such update the engine wraps the named modules with peft LoRA layers (rank from A's shape);
every later update must carry every adapter tensor the engine holds, so none is left from an older version. The
base weights stay as loaded: ``W`` is never sent merged while the engine also applies the adapter.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from miles.sync import WeightUpdateError
from miles.sync.layouts import PEFT_ADAPTER as ADAPTER
from miles.sync.layouts import PEFT_PREFIX, from_peft_name, to_peft_name
from miles.sync.versions import version_dir
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

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


def write_adapter_dir(root: Path, version: int, named: Iterable[tuple[str, Tensor]]) -> Path:
    """Write one adapter update as ``root/v{version:06d}`` in peft's format and return that directory.

    Args:
        named: every adapter tensor under the trainer's names (``<module>.lora_A.default.weight`` [r, in],
            ``<module>.lora_B.default.weight`` [out, r], the scaling folded into B).
    Raises: WeightUpdateError (one line) for a name that is no adapter tensor (``train.lora.sync adapter`` sends
        adapters only), an update without adapters or with lora_A of several ranks; OSError when it cannot be
        written. The directory appears whole or not at all (written beside it, then renamed).
    """
    tensors: dict[str, Tensor] = {}
    targets: set[str] = set()
    ranks: set[int] = set()
    for name, tensor in named:
        if not is_adapter_name(name):
            raise WeightUpdateError(
                f"a LoRA adapter update got {name!r}, which is no adapter tensor (with train.lora.sync "
                "adapter the trainer sends lora_A / lora_B only)"
            )
        module = name.split(".lora_", 1)[0]
        targets.add(module.rsplit(".", 1)[-1])
        if ".lora_A." in name:
            ranks.add(tensor.shape[0])
        tensors[to_peft_name(name)] = tensor.detach().float().cpu().contiguous()
    if not tensors or len(ranks) != 1:
        raise WeightUpdateError(f"a LoRA adapter update needs lora_A tensors of one rank, got ranks {sorted(ranks)}")
    (rank,) = ranks
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,  # scaling 1: the trainer folded alpha / r into B
        "use_rslora": False,
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "bias": "none",
    }
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    partial = root / f".{final.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    save_file(tensors, partial / "adapter_model.safetensors")
    (partial / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)  # a retried version replaces its own earlier attempt
    os.replace(partial, final)
    return final


def adapter_layout(
    named: dict[str, Tensor], first: dict[str, tuple[int, ...]] | None, version: int
) -> dict[str, tuple[int, ...]]:
    """The names and shapes of adapter update ``version``, checked against ``first`` (the first update's, None for
    the first): a server engine holds one adapter set, and vLLM accepts an A of the wrong width without complaint.

    Raises: WeightUpdateError (one line, naming a few differing tensors) when they differ.
    """
    layout = {name: tuple(tensor.shape) for name, tensor in named.items()}
    if first is not None and layout != first:
        changed = sorted(set(layout) ^ set(first)) or sorted(name for name in layout if layout[name] != first[name])
        raise WeightUpdateError(
            f"LoRA adapter v{version} differs from the adapters the servers hold in names or shapes, e.g. "
            f"{changed[:3]} (train.lora rank or target_modules changed during the run?); nothing was loaded"
        )
    return layout


def read_adapter_dir(path: str | Path) -> dict[str, Tensor]:
    """A peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) as an adapter update: the
    trainer's names (``<module>.lora_A.default.weight``), fp32, with the directory's scaling (lora_alpha / r, or
    / sqrt(r) with use_rslora) folded into B, so ``apply_adapter_update`` applies it with scaling 1.

    Raises: ValueError (one line naming the path) for a missing file, a peft_type other than LORA, or a tensor name
    that is no LoRA A / B weight.
    """
    path = Path(path)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        saved = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, ValueError) as err:
        raise ValueError(f"no readable peft adapter at {path}: {err}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"the adapter at {path} is {config.get('peft_type')!r}, not LORA")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scaling = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    named = {}
    for name, tensor in saved.items():
        _, dot, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not dot or kind not in ("A.weight", "B.weight"):
            raise ValueError(f"the adapter at {path} holds {name!r}, which is no LoRA A / B weight")
        tensor = tensor.float()
        named[from_peft_name(name)] = tensor * scaling if kind[0] == "B" else tensor
    return named
