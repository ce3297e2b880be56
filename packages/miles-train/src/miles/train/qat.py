"""Quantization-aware training (QAT) for quantized rollout weights: fake quantization with a straight-through
estimator (STE) in the policy's linear layers.

With ``engine.weight_codec`` set, the engine samples with ``decode(encode(W))`` of a ``miles.sync`` codec (int4,
fp8, mxfp8, nvfp4) while the trainer's master weights W stay full precision. ``train.qat`` with the same codec makes
the trainer's forward use exactly those values (``y = x @ Q(W).T + b``, ``Q = miles.sync.roundtrip``), so the
trainer's log-probs equal the engine's (no train / rollout mismatch from quantization), and the backward passes the
gradient straight through to W (``dL/dW := dL/dQ(W)``, Bengio et al. 2013, arXiv:1308.3432; the QAT recipe of
e.g. Jacob et al. 2018, arXiv:1712.05877). The optimizer updates W; every push sends W through the same codec.

Which weights: exactly those the ``WeightSender`` quantizes (``miles.sync.uses_codec``: floating point, name not
matching ``DEFAULT_CODEC_EXCLUDE``: norms, embeddings, the LM head, biases and MoE routers stay exact). Only
``nn.Linear`` weights can be fake-quantized here; a model with another quantized parameter (fused MoE expert
tensors, convolutions) is refused with its name, since the two sides would differ there.
"""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from miles.sync import DEFAULT_CODEC_EXCLUDE, roundtrip, uses_codec
from miles.sync.codecs import LOSSY_CODECS
from torch import Tensor, nn

QAT_CODECS = LOSSY_CODECS  # every lossy codec an engine may run
"""The ``miles.sync`` codecs ``train.qat`` can fake-quantize for (the lossy weight codecs)."""


class _FakeQuantize(torch.autograd.Function):
    """Forward: ``roundtrip(codec, w)`` exactly; backward: the gradient unchanged (straight-through)."""

    @staticmethod
    def forward(ctx: object, weight: Tensor, codec: str) -> Tensor:
        with torch.no_grad():
            return roundtrip(codec, weight)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def fake_quantize(weight: Tensor, codec: str) -> Tensor:
    """``Q(weight) = decode(encode(weight))`` with ``codec`` in the forward, identity in the backward (STE).

    Args:
        weight: floating point, any shape (the codec's layout: int4 groups of 128 along the last dim, fp8 128 x 128
            tiles, ...).
        codec: one of ``QAT_CODECS``.
    Returns: a tensor of ``weight``'s shape and dtype holding exactly what an engine receives for it.
    Raises: ValueError for an unknown codec.
    """
    return _FakeQuantize.apply(weight, codec)


def _fake_quant_linear_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x, fake_quantize(self.weight, self._miles_qat_codec), self.bias)


def _linear_weights(model: nn.Module) -> dict[str, nn.Linear]:
    """Each ``nn.Linear`` of ``model`` by its weight's parameter name."""
    return {
        f"{name}.weight" if name else "weight": module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    }


def qat_targets(model: nn.Module, codec: str, *, codec_exclude: Iterable[str] = DEFAULT_CODEC_EXCLUDE) -> list[str]:
    """The names of the weights of ``model`` that ``apply_qat`` fake-quantizes (those a ``WeightSender(codec=codec)``
    would quantize); works on a model built on the meta device, so a run can check its model before loading it.

    Raises: ValueError as ``apply_qat``.
    """
    if codec not in QAT_CODECS:
        raise ValueError(f"train.qat is {codec!r}; choose one of {list(QAT_CODECS)} (or none)")
    exclude = tuple(codec_exclude)
    linear_weights = _linear_weights(model)
    quantized = []
    for name, param in model.named_parameters():  # tied parameters once: the first name, as a state dict push
        if not uses_codec(name, param, codec, exclude):
            continue
        if name not in linear_weights:
            raise ValueError(
                f"train.qat {codec}: {name} would be quantized by engine.weight_codec {codec} but is not an nn.Linear "
                "weight, which is all QAT covers here (fused MoE expert tensors are not), so the trainer and engine "
                "would differ there. Use a dense model, or drop --train.qat (the mismatch then shows in "
                "train_rollout_logprob_abs_diff)"
            )
        quantized.append(name)
    if not quantized:
        raise ValueError(f"train.qat {codec}: no weight of this model would be quantized; drop --train.qat")
    return quantized


def check_qat_model(config: object, codec: str, *, trust_remote_code: bool = False) -> int:
    """``qat_targets`` of the model an HF ``config`` describes, built on the meta device (no weights read, no
    memory): the run's check before anything loads (``trust_remote_code``: the policy's, for a model class of the
    checkpoint's own). Returns: how many weights QAT covers. Raises: ValueError as ``apply_qat``."""
    from miles.core.multimodal import auto_model_class

    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    return len(qat_targets(model, codec))


def apply_qat(model: nn.Module, codec: str, *, codec_exclude: Iterable[str] = DEFAULT_CODEC_EXCLUDE) -> list[str]:
    """Fake-quantize, in place, the weights of ``model`` that a ``WeightSender(codec=codec)`` would quantize.

    Call before sharding (FSDP2 gathers each layer's full weight before its forward, where the fake quantization
    runs, so the groups / tiles are the same as the sender's on the gathered tensor). Parameter names are unchanged,
    so checkpoints and weight pushes are too.

    Args:
        model: an HF model (parameter names as the engine knows them).
        codec: one of ``QAT_CODECS``.
        codec_exclude: the sender's ``codec_exclude`` patterns.
    Returns: the names of the fake-quantized weights, in model order.
    Raises: ValueError for a codec not in ``QAT_CODECS``, or when a parameter the codec would quantize is not an
        ``nn.Linear`` weight (its name in the message), or nothing would be quantized.
    """
    quantized = qat_targets(model, codec, codec_exclude=codec_exclude)
    linear_weights = _linear_weights(model)
    for name in quantized:
        module = linear_weights[name]
        module._miles_qat_codec = codec
        module.forward = types.MethodType(_fake_quant_linear_forward, module)
    return quantized


__all__ = ["QAT_CODECS", "apply_qat", "check_qat_model", "fake_quantize", "qat_targets"]
