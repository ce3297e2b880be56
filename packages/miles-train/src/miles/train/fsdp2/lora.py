"""LoRA adapters on the policy (peft), sent to the engines merged or alone, and saved alone for the checkpoint.

The adapters are injected into the HF model in place (``peft.inject_adapter_in_model``: each targeted
``nn.Linear`` becomes a ``peft.tuners.lora.Linear`` holding the original as ``base_layer``), so the model keeps its
class, ``model.model.layers`` (what FSDP2 shards) and call signature. Names in its state dict:
``X.base_layer.weight`` (frozen base), ``X.lora_A.default.weight`` [r, in], ``X.lora_B.default.weight`` [out, r].

Merged weight (what the engines get and ``model/`` holds): ``W' = W + scaling * B @ A`` with
``scaling = alpha / r`` (rsLoRA ``alpha / sqrt(r)``), computed in fp32 from the full tensors; every other tensor is
sent exactly as held (the untouched base). With ``train.lora.sync adapter`` the engines apply the adapters
themselves and get only A and scaling * B (``adapter_weights``). Hu et al. 2021 (arXiv:2106.09685).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from miles.sync.layouts import PEFT_ADAPTER as ADAPTER
from miles.sync.layouts import from_peft_name, to_peft_name
from miles.train.config import LoraConfig
from torch import Tensor, nn

_BASE = ".base_layer."


def apply_lora(model: nn.Module, cfg: LoraConfig, *, key: str = "train.lora") -> None:
    """Inject ``cfg``'s adapters into ``model`` in place (A seeded by ``cfg.init_seed``, B zeros) and make them its
    only trainable parameters.

    Args:
        key: the config field ``cfg`` came from, for the messages (``algorithm.lora`` in diffusion runs).
    Raises: ValueError (one line naming ``<key>.target_modules``) when no module of the model matches, or a matched
        one is not an ``nn.Linear`` or shares its weight with the input embedding.
    """
    from peft import inject_adapter_in_model

    _check_targets(model, cfg, key)
    peft_cfg = _peft_config(cfg)
    try:
        # A is drawn from the global RNG: seeded here so every rank and every run (a resumed one too) start alike,
        # without moving the run's own RNG stream
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            inject_adapter_in_model(peft_cfg, model)
    except ValueError:
        raise ValueError(
            f"{key}.target_modules {list(cfg.target_modules)} match no Linear layer of this model; its Linear "
            f"layers' names end in {_linear_suffixes(model)}"
        ) from None
    from peft.tuners.lora import Linear as LoraLinear

    tied = getattr(model.config, "tie_word_embeddings", False) and model.get_input_embeddings() is not None
    for name, layer in adapter_layers(model).items():
        base = layer.get_base_layer()
        if not isinstance(layer, LoraLinear) or layer.fan_in_fan_out:
            raise ValueError(
                f"{key}.target_modules: {name} is a {type(base).__name__}; adapters go on nn.Linear layers "
                "only (their merge is W + scale * B A)"
            )
        if tied and base.weight is model.get_input_embeddings().weight:
            raise ValueError(
                f"{key}.target_modules: {name} shares its weight with the input embedding "
                "(tie_word_embeddings), so its merged weight could not be sent apart from it; leave it out"
            )
        layer.lora_dropout.eval()  # dropout only inside ``adapter_dropout`` (the training forward)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)


def _linear_suffixes(model: nn.Module) -> list[str]:
    """The names a target may give the model's Linear layers: the last path component, or the last two where the
    last is a list index (``attn.to_out.0`` -> ``to_out.0``)."""
    suffixes = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            parts = name.split(".")
            suffixes.add(".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1])
    return sorted(suffixes)


def _check_targets(model: nn.Module, cfg: LoraConfig, key: str) -> None:
    """Refuse a target that names no Linear layer (peft would adapt the others and drop it without a word, or fail
    on a module list). The default targets may miss some layers of a model (an MoE's fused experts).

    Raises: ValueError naming the target, what it matched and the model's Linear layers.
    """
    modules = dict(model.named_modules())
    for target in cfg.target_modules:
        hits = [name for name in modules if name == target or name.endswith("." + target)]
        if any(isinstance(modules[name], nn.Linear) for name in hits):
            continue
        if not hits and "target_modules" not in cfg.model_fields_set:
            continue
        found = f"names a {type(modules[hits[0]]).__name__} ({hits[0]})" if hits else "matches no module"
        raise ValueError(
            f"{key}.target_modules: {target!r} {found}, not a Linear layer; this model's Linear layers' names end in "
            f"{_linear_suffixes(model)}"
        )


def _peft_config(cfg: LoraConfig, **extra):
    """peft's ``LoraConfig`` for ``cfg`` (``extra``: fields only a saved config carries)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        use_rslora=cfg.use_rslora,
        bias="none",
        **extra,
    )


def _merged(weight: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """``W + scaling * B @ A``, the product in fp32, in ``W``'s dtype."""
    with torch.no_grad():
        return weight + ((b.float() @ a.float()) * scaling).to(weight.dtype)


def adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA-wrapped layers by module name (empty for a model without adapters)."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA adapters."""
    return bool(adapter_layers(model))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's forward (every adapter off) inside the block: the KL reference of a LoRA policy."""
    layers = list(adapter_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@contextmanager
def adapter_dropout(model: nn.Module) -> Iterator[None]:
    """The adapters' dropout on inside the block (the training forward/backward), off elsewhere: log-probs for
    the ratio's denominator, the reference and the weight probe stay deterministic, like the engine's."""
    layers = list(adapter_layers(model).values())
    for layer in layers:
        layer.lora_dropout.train()
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_dropout.eval()


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole of ``tensor`` (detached): a DTensor all-gathered (collective: every rank calls it), else itself."""
    with torch.no_grad():  # per tensor: DTensor.full_tensor is collective on a sharded model
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


def merged_weights(
    model: nn.Module, named: Iterable[tuple[str, Tensor]], *, adapters: Mapping[str, Tensor] | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) pairs of the merged model from ``named`` (``model``'s state-dict items, possibly
    sharded), in order: adapters folded into their base weights, adapter tensors dropped, ``.base_layer`` removed
    from names. Collective on a sharded model (every rank must read the whole stream).

    Args:
        adapters: A and B to merge instead of the layers' own, by the model's names
            (``<module>.lora_A.default.weight``; e.g. an EMA of them); None merges the live adapters.
    Returns: merged weights in fp32 for LoRA layers (``W + scaling * B @ A``), every other tensor as held.
    """
    layers = adapter_layers(model)
    for name, tensor in named:
        if ".lora_" in name:
            continue
        if _BASE not in name:
            yield name, full_tensor(tensor)
            continue
        prefix, suffix = name.split(_BASE, 1)
        full = full_tensor(tensor)
        if suffix == "weight":
            layer = layers[prefix]
            a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
            if adapters is not None:
                a, b = adapters[f"{prefix}.lora_A.{ADAPTER}.weight"], adapters[f"{prefix}.lora_B.{ADAPTER}.weight"]
            full = _merged(full, full_tensor(a), full_tensor(b), layer.scaling[ADAPTER])
        yield f"{prefix}.{suffix}", full


def adapter_weights(model: nn.Module, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) pairs of the adapters for an engine that applies them itself (``train.lora.sync
    adapter``): A [r, in] as held, B [out, r] times the layer's scaling (alpha / r, rsLoRA alpha / sqrt(r)) in
    fp32, so the engine applies ``W x + B' A x`` with scaling 1 and the scaling is applied exactly once. Names are
    the model's (``<module>.lora_A.default.weight``). Collective on a sharded model, like ``merged_weights``.

    Args:
        named: ``model``'s state-dict items (possibly sharded); only the adapter tensors are read.
    """
    layers = adapter_layers(model)
    for name, tensor in named:
        if ".lora_" not in name:
            continue
        full = full_tensor(tensor)
        if f".lora_B.{ADAPTER}." in name:
            prefix = name.split(".lora_B.", 1)[0]
            with torch.no_grad():
                full = full.float() * layers[prefix].scaling[ADAPTER]
        yield name, full


def merge_state(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The merged model (a checkpoint's ``model/``: plain HF names) from a full state dict holding the adapters
    (``gather_module_state``'s). Reads only ``state`` and the layers' scalings: no collective, so rank 0 alone may
    call it after the gather."""
    scalings = {name: layer.scaling[ADAPTER] for name, layer in adapter_layers(model).items()}
    merged = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        if _BASE not in name:
            merged[name] = tensor
            continue
        prefix, suffix = name.split(_BASE, 1)
        if suffix == "weight":
            a, b = state[f"{prefix}.lora_A.{ADAPTER}.weight"], state[f"{prefix}.lora_B.{ADAPTER}.weight"]
            tensor = _merged(tensor, a, b, scalings[prefix])
        merged[f"{prefix}.{suffix}"] = tensor
    return merged


def adapter_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter tensors of a full state dict under peft's saved names (``PeftModel.save_pretrained``:
    ``base_model.model.<module>.lora_A.weight``), so ``PeftModel.from_pretrained(base, dir)`` loads them."""
    return {to_peft_name(name): tensor for name, tensor in state.items() if ".lora_" in name}


def adapter_state_to_model(saved: dict[str, Tensor]) -> dict[str, Tensor]:
    """``adapter_state``'s names back to the injected model's (``<module>.lora_A.default.weight``)."""
    return {from_peft_name(name): tensor for name, tensor in saved.items()}


def load_adapters(model: nn.Module, optimizer: torch.optim.Optimizer, path, optim_state: dict, cfg: LoraConfig) -> None:
    """Load ``adapter_state``'s file into ``model``'s adapters (the base stays as loaded) and the optimizer state.

    Raises: ValueError naming the first difference when the checkpoint's adapters were made with other settings
        (``adapter_config.json`` beside the file: r, alpha, rsLoRA, target modules) or other tensors.
    """
    import json
    from pathlib import Path

    saved_cfg = json.loads((Path(path).parent / "adapter_config.json").read_text())
    for key, want in (("r", cfg.rank), ("lora_alpha", cfg.alpha), ("use_rslora", cfg.use_rslora)):
        if saved_cfg.get(key) != want:
            raise ValueError(
                f"{path.parent} was trained with {key} {saved_cfg.get(key)!r}, this run has {want!r}: resume with "
                "the run's own train.lora settings"
            )
    if sorted(saved_cfg.get("target_modules") or []) != sorted(cfg.target_modules):
        raise ValueError(
            f"{path.parent} was trained with target_modules {sorted(saved_cfg.get('target_modules') or [])}, this run "
            f"has {sorted(cfg.target_modules)}: resume with the run's own train.lora settings"
        )
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights = adapter_state_to_model(load_file(path))
    expected = {name: p.shape for name, p in model.named_parameters() if ".lora_" in name}
    wrong = sorted(set(weights) ^ set(expected)) or [n for n in weights if weights[n].shape != expected[n]]
    if wrong:
        raise ValueError(
            f"{path} holds other adapters than train.lora makes here (first: {wrong[0]}): resume with the run's "
            "own train.lora settings (rank, target_modules)"
        )
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))


def write_peft_config(cfg: LoraConfig, base_model_path: str, directory) -> None:
    """Write peft's ``adapter_config.json`` for ``cfg`` into ``directory`` (what ``PeftModel.from_pretrained``
    reads beside ``adapter_model.safetensors``)."""
    _peft_config(cfg, task_type="CAUSAL_LM", base_model_name_or_path=base_model_path).save_pretrained(str(directory))
