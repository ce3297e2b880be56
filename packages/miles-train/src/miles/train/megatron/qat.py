"""Quantization-aware training (``train.qat``) on the Megatron backend: ``miles.train.qat``'s fake quantization with
a straight-through estimator, on Megatron's parallel linears, MoE experts included.

The engine samples with ``roundtrip(codec, W)`` of each HF tensor the ``WeightSender`` quantizes (``uses_codec``
with ``DEFAULT_CODEC_EXCLUDE``: every linear weight; norms, embeddings, the LM head, biases and routers stay exact).
Megatron holds those weights in other layouts: q/k/v fused and interleaved per query group, gate/up stacked, the
experts one linear each where HF stacks them, each tensor split over the tensor-parallel ranks. A codec whose blocks
lie along one row of the last (input) dimension (int4: groups of 128, mxfp8: blocks of 32) quantizes every row on
its own, so the fake quantization of Megatron's tensors gives exactly the values the engine holds for HF's, as long
as a row-parallel split of the input dimension falls on block boundaries (checked). fp8 (128 x 128 tiles across
rows) and nvfp4 (one scale per whole tensor) would see other neighbours in a fused or split tensor: refused.

Which weights: every ``ColumnParallelLinear`` / ``RowParallelLinear`` weight except the output layer (HF's
``lm_head``), which are the HF tensors ``uses_codec`` picks for the model types ``miles.train.megatron.convert``
supports (tested against the export). The forward reads ``Q(W)`` through a ``weight`` property of the module;
the parameter, its name, the optimizer, checkpoints and pushes keep the full-precision W.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

ROW_BLOCKS = {"int4": 128, "mxfp8": 32}  # the codecs whose blocks lie along one row, and their block length
"""``train.qat`` codecs the Megatron backend fake-quantizes -> elements per block along a row (``miles.sync.codecs``:
``int4.GROUP``, ``mxfp8.BLOCK``)."""


def check_megatron_qat(codec: str) -> None:
    """Raises: ValueError (one line) when ``codec`` is not one the Megatron backend can fake-quantize exactly."""
    if codec not in ROW_BLOCKS:
        raise ValueError(
            f"train.qat {codec} on train.backend megatron: {codec}'s blocks span rows or the whole tensor, so "
            f"Megatron's fused and tensor-parallel layouts would quantize other neighbours than the engine's; use "
            f"--train.qat {' or '.join(ROW_BLOCKS)} (with the same --engine.weight-codec), or --train.backend fsdp2"
        )


@functools.cache
def _qat_class(cls: type) -> type:
    """``cls`` with ``weight`` read as its fake quantization (``Q(W)`` forward, identity backward)."""
    from miles.train.qat import fake_quantize

    def weight(self: Any) -> Tensor:
        return fake_quantize(self._parameters["weight"], self._miles_qat_codec)

    return type(f"FakeQuantized{cls.__name__}", (cls,), {"weight": property(weight)})


def apply_megatron_qat(model: torch.nn.Module, codec: str, *, tensor_parallel: int) -> list[str]:
    """Fake-quantize, in place, the linear weights of a Megatron ``GPTModel`` (one rank's shards) that the engine
    receives through ``codec``: each module's class becomes a subclass whose ``weight`` is ``fake_quantize(W, codec)``.

    Args:
        model: a ``GPTModel`` (or a pipeline stage of one) built with Megatron's local (non-TE) linears.
        codec: a key of ``ROW_BLOCKS``.
        tensor_parallel: the tensor-parallel size the model is split over (experts: the same, Megatron's default).
    Returns: the (local) names of the fake-quantized weights, in model order.
    Raises: ValueError (one line) for a codec not in ``ROW_BLOCKS``, or when a row-parallel shard's input
        dimension is not a multiple of the codec's block (the blocks would straddle the split).
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    check_megatron_qat(codec)
    block = ROW_BLOCKS[codec]
    quantized = []
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear) or name.endswith("output_layer"):
            continue
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        in_features = weight.shape[-1]
        split = isinstance(module, RowParallelLinear) and getattr(weight, "tensor_model_parallel", False)
        if split and tensor_parallel > 1 and in_features % block:
            raise ValueError(
                f"train.qat {codec} on train.backend megatron: {name} holds {in_features} of its input features per "
                f"tensor-parallel rank, not a multiple of {codec}'s block of {block}, so the engine's blocks would "
                "straddle the split; use a train.megatron.tensor_parallel_size that divides it into whole blocks"
            )
        module._miles_qat_codec = codec
        module.__class__ = _qat_class(type(module))
        quantized.append(f"{name}.weight")
    if not quantized:
        raise ValueError(f"train.qat {codec}: no weight of this model would be quantized; drop --train.qat")
    return quantized


__all__ = ["ROW_BLOCKS", "apply_megatron_qat", "check_megatron_qat"]
