"""LoRA on Megatron-core's tensor-parallel linears (``train.lora`` with ``train.backend megatron``).

Megatron fuses HF's q/k/v projections into ``linear_qkv`` and gate/up into ``linear_fc1``, so an adapter sits on the
fused layer: one A [r, in] and one B [out, r] for q, k and v together (equal, as a function, to HF adapters on
q_proj / k_proj / v_proj that share A, with B split by rows). ``train.lora.target_modules`` keeps HF's names and must
list each fused group whole. Each adapter follows its layer's tensor-parallel split so no step gathers a weight:

- column-parallel layer (``linear_qkv``, ``linear_fc1``: output rows split): A replicated, B split like the weight
  (the same rows, ``partition_stride`` included); ``A x`` enters B through Megatron's
  ``copy_to_tensor_model_parallel_region`` (its backward sums A's gradient over the ranks), under sequence
  parallelism ``gather_from_sequence_parallel_region``.
- row-parallel layer (``linear_proj``, ``linear_fc2``: input columns split): A split like the weight's columns, B
  replicated; the partial ``A x`` is summed with ``reduce_from_tensor_model_parallel_region`` (under sequence
  parallelism ``reduce_scatter_to_sequence_parallel_region``).

So each rank's merged shard ``W_local + scaling * B_local A_local`` is exactly its shard of the merged weight, and
the HF conversion (``convert.megatron_to_hf``) turns merged shards into HF tensors as it does plain ones.

peft's own Megatron layer (``peft.tuners.lora.tp_layer.LoraParallelLinear``) was tried first: with megatron-core
0.16 and peft 0.21 its dispatch fails (``KeyError: 'fan_in_fan_out'``) and its forward multiplies the
``(output, bias)`` tuple Megatron's linears return by the scaling, hence this small layer. Hu et al. 2021
(arXiv:2106.09685); rsLoRA scaling alpha / sqrt(r) (Kalajdzievski 2023, arXiv:2312.03732).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

# HF projection -> the Megatron layer that holds it; the fused groups must be targeted whole
MEGATRON_TARGETS = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
    "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
}  # fmt: skip
FUSED = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}


def megatron_targets(target_modules: Sequence[str]) -> list[str]:
    """The Megatron layer names that ``train.lora.target_modules`` (HF names) adapt.

    Raises: ValueError (one line naming the field) for a name with no Megatron layer or a fused group listed in part.
    """
    unknown = sorted(set(target_modules) - set(MEGATRON_TARGETS))
    if unknown:
        raise ValueError(
            f"train.lora.target_modules has {unknown}, which train.backend megatron cannot adapt; it adapts "
            f"{sorted(MEGATRON_TARGETS)}"
        )
    for layer, group in FUSED.items():
        listed = [name for name in group if name in target_modules]
        if listed and len(listed) != len(group):
            raise ValueError(
                f"train.lora.target_modules lists {listed} of {list(group)}: Megatron fuses them into one {layer}, "
                "so list all of them or none (or use --train.backend fsdp2)"
            )
    return sorted({MEGATRON_TARGETS[name] for name in target_modules})


class LoraParallelLinear(nn.Module):
    """A Megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` plus a rank-r LoRA update that follows its split.

    ``forward`` returns the base layer's ``(output, bias)`` with ``scaling * B (A x)`` added to the output (nothing
    added while ``enabled`` is False: the reference policy). Parameters: ``base_layer.*`` (frozen), ``lora_A``
    [r, in_local] and ``lora_B`` [out_local, r] (see the module docstring for which one is split).
    """

    def __init__(self, base_layer: nn.Module, *, rank: int, scaling: float, column: bool) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.column = column
        self.scaling = scaling
        self.enabled = True
        self.sequence_parallel = bool(getattr(base_layer, "sequence_parallel", False))
        weight = base_layer.weight
        out_local, in_local = weight.shape
        self.lora_A = nn.Parameter(torch.empty(rank, in_local, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(out_local, rank, dtype=torch.float32))
        split = self.lora_B if column else self.lora_A  # the one split like the weight
        split.tensor_model_parallel = getattr(weight, "tensor_model_parallel", False)
        split.partition_dim = 0 if column else 1
        split.partition_stride = getattr(weight, "partition_stride", 1) if column else 1
        # the replicated one sees only this rank's tokens under sequence parallelism: finalize_model_grads sums it
        if self.sequence_parallel:
            (self.lora_A if column else self.lora_B).sequence_parallel = True

    @property
    def weight(self) -> Tensor:
        """The base layer's weight (Megatron's attention reads its linears' ``weight``)."""
        return self.base_layer.weight

    def forward(self, x: Tensor, *args, **kwargs):
        """The base layer's ``(output, bias)`` for ``x`` [seq(/tp under sequence parallelism), batch, in_local],
        its output plus ``scaling * B (A x)`` while ``enabled``."""
        from megatron.core.tensor_parallel import mappings

        output, bias = self.base_layer(x, *args, **kwargs)
        if not self.enabled:
            return output, bias
        h = torch.nn.functional.linear(x, self.lora_A)
        if self.column:
            h = (
                mappings.gather_from_sequence_parallel_region(h)
                if self.sequence_parallel
                else mappings.copy_to_tensor_model_parallel_region(h)
            )
        else:
            h = (
                mappings.reduce_scatter_to_sequence_parallel_region(h)
                if self.sequence_parallel
                else mappings.reduce_from_tensor_model_parallel_region(h)
            )
        return output + self.scaling * torch.nn.functional.linear(h, self.lora_B), bias

    def merged_weight(self) -> Tensor:
        """This rank's shard of ``W + scaling * B A`` (fp32, a new tensor; the base stays)."""
        with torch.no_grad():
            return self.base_layer.weight.float() + self.scaling * (self.lora_B @ self.lora_A)


def apply_lora(
    gpt: nn.Module, *, target_modules: Sequence[str], rank: int, alpha: float, use_rslora: bool, init_seed: int,
    tp_rank: int, tp_size: int, whole_name: Callable[[str], str] = str,
) -> dict[str, LoraParallelLinear]:  # fmt: skip
    """Wrap ``gpt``'s targeted linears in place and make the adapters its only trainable parameters.

    A is drawn whole per layer (Kaiming-uniform, a = sqrt(5), as peft's default; a generator seeded with
    ``init_seed`` and the layer's name in the whole model, ``whole_name(name)``: a pipeline stage's layers are
    numbered from its first) and sliced for this rank, so every tensor- and pipeline-parallel layout starts from the
    same adapters; B is zero, so training starts from the base model exactly.

    Returns: the wrapped layers by module name. Raises: ValueError as ``megatron_targets``, or when no layer matches.
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from miles.train.megatron.convert import shard_of

    targets = set(megatron_targets(target_modules))
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    gpt.requires_grad_(False)
    wrapped: dict[str, LoraParallelLinear] = {}
    for name, module in list(gpt.named_modules()):
        parent_name, _, child = name.rpartition(".")
        if child not in targets or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        layer = LoraParallelLinear(module, rank=rank, scaling=scaling, column=isinstance(module, ColumnParallelLinear))
        full_in = module.input_size
        a = torch.empty(rank, full_in)
        bound = 1 / math.sqrt(full_in)  # kaiming_uniform_(a=sqrt(5)) on [r, in]: U(-1/sqrt(in), 1/sqrt(in))
        generator = torch.Generator().manual_seed(init_seed + zlib.crc32(whole_name(name).encode()))
        a.uniform_(-bound, bound, generator=generator)
        with torch.no_grad():
            layer.lora_A.copy_(shard_of(a, layer.lora_A, rank=tp_rank, world=tp_size))
        setattr(gpt.get_submodule(parent_name), child, layer)
        wrapped[name] = layer
    if not wrapped:
        raise ValueError(f"train.lora.target_modules {list(target_modules)} matched no layer of the Megatron model")
    return wrapped


def lora_layers(gpt: nn.Module) -> dict[str, LoraParallelLinear]:
    """``gpt``'s LoRA-wrapped linears by module name."""
    return {name: m for name, m in gpt.named_modules() if isinstance(m, LoraParallelLinear)}


class adapters_disabled:  # noqa: N801 - a context manager, named like one
    """Run ``gpt`` as its base model (the LoRA reference policy) inside the ``with`` block."""

    def __init__(self, gpt: nn.Module) -> None:
        self.layers = list(lora_layers(gpt).values())

    def __enter__(self) -> None:
        for layer in self.layers:
            layer.enabled = False

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            layer.enabled = True


def merged_parameters(gpt: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(Megatron name as without LoRA, this rank's tensor) for every tensor of the merged model, one at a time: a
    wrapped layer's weight merged with its adapters (a new tensor), every other tensor as held."""
    layers = lora_layers(gpt)
    for name, param in gpt.named_parameters():
        module, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            continue
        if module.endswith(".base_layer"):
            owner = module.removesuffix(".base_layer")
            yield f"{owner}.{leaf}", layers[owner].merged_weight() if leaf == "weight" else param
        else:
            yield name, param
