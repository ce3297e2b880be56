"""Full (unsharded) state of FSDP2 modules and their optimizers, for checkpoints and weight export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """Unsharded fp32 weights on CPU by HF name (collective: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # An unsharded (world-size-1) model's state holds its live parameters: copy them, once per storage so that
    # tied tensors stay tied, as FSDP2's gathered copies are.
    live = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    copies: dict[int, Tensor] = {}
    for name, tensor in state.items():
        if tensor.data_ptr() in live:
            if tensor.data_ptr() not in copies:
                copies[tensor.data_ptr()] = tensor.detach().clone()
            state[name] = copies[tensor.data_ptr()]
    return state


def gather_module_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, what: str
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Full weights and full optimizer state of a sharded module (collective).

    Args:
        what: name used in errors, e.g. "policy" or "critic".
    Raises: FloatingPointError naming the tensors if any weight is NaN/inf: a NaN checkpoint is never written.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    weights = full_model_state(model)
    optim_state = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    nonfinite = [name for name, tensor in weights.items() if not torch.isfinite(tensor).all()]
    if nonfinite:  # a resume from a NaN checkpoint could not recover
        raise FloatingPointError(
            f"refusing to save a checkpoint: {what} weights {nonfinite[:3]} hold NaN/inf. The previous checkpoint "
            "is intact; resume from it with a lower --train.lr (keep --train.skip-nonfinite-steps true so "
            "non-finite updates are never applied)."
        )
    return weights, optim_state


def write_weights(weights: dict[str, Tensor], path: Path) -> None:
    """Save weights as safetensors, storing tied tensors (embedding = LM head) once."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    unique = {}
    for name, tensor in weights.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor.contiguous()
    save_file(unique, path, metadata={"format": "pt"})


def write_model_dir(weights: dict[str, Tensor], config: Any, source: Path, path: Path) -> None:
    """An HF model directory at ``path``: ``weights`` (HF names) as ``model.safetensors``, ``config`` (an HF
    ``PretrainedConfig``; a copy saved with ``use_cache`` on, which training turns off) and the generation config of
    the model directory ``source`` where it has one."""
    import copy
    import shutil

    write_weights(weights, path / "model.safetensors")
    config = copy.deepcopy(config)
    config.use_cache = True  # turned off for training only; the saved model is for inference
    config.save_pretrained(path)
    if (Path(source) / "generation_config.json").is_file():
        shutil.copy2(Path(source) / "generation_config.json", path / "generation_config.json")


def load_module(model: nn.Module, optimizer: torch.optim.Optimizer, weights_path: Path, optim_state: dict) -> None:
    """Load safetensors weights (tied tensors are re-tied by the model) and a full optimizer state."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights = load_file(weights_path)
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
