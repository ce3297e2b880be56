"""dtype auto: bf16 exactly where the hardware multiplies bf16 fast, decided at run time (miles.core.precision)."""

from __future__ import annotations

import logging

import pytest
import torch
from miles.core import precision


def _cpu(monkeypatch, *, amx: bool, avx512_bf16: bool, capability: str = "AVX512") -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "expected", "reason"),
    [
        (True, True, "bf16", "this CPU has AMX (bf16 matrix tiles)"),
        (False, True, "bf16", "this CPU has AVX512-BF16"),
        (False, False, "fp32", "this CPU (AVX2) has no AVX512-BF16 or AMX, where bf16 matmuls run far slower"),
    ],
)
def test_auto_follows_the_cpu(monkeypatch, amx, avx512_bf16, expected, reason):
    _cpu(monkeypatch, amx=amx, avx512_bf16=avx512_bf16, capability="AVX2")
    assert precision.resolve_dtype("auto") == expected
    assert precision.fast_bf16()[1].startswith(reason)
    assert precision.torch_dtype("auto") == {"bf16": torch.bfloat16, "fp32": torch.float32}[expected]


def test_explicit_dtypes_are_kept_whatever_the_cpu(monkeypatch):
    _cpu(monkeypatch, amx=False, avx512_bf16=False)
    assert precision.resolve_dtype("bf16") == "bf16"
    _cpu(monkeypatch, amx=True, avx512_bf16=True)
    assert precision.resolve_dtype("fp32") == "fp32"
    assert precision.resolve_dtype("fp16") == "fp16"  # never chosen by auto, kept when asked for
    assert precision.torch_dtype("fp16") == torch.float16
    with pytest.raises(ValueError, match=r"dtype must be one of \['auto', 'fp32', 'bf16', 'fp16'\], got 'fp8'"):
        precision.resolve_dtype("fp8")


def test_a_gpu_decides_before_the_cpu(monkeypatch):
    _cpu(monkeypatch, amx=True, avx512_bf16=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert precision.resolve_dtype("auto") == "fp32"
    assert precision.fast_bf16() == (False, "Tesla V100 has no native bf16")


def test_a_run_records_and_logs_what_auto_became(monkeypatch, caplog):
    from miles.recipes.cli import resolve_config
    from miles.recipes.run import resolve_precision

    cfg = resolve_config("smollm2_grpo_arithmetic", ["--train.dtype", "auto", "--engine.dtype", "fp32"])
    _cpu(monkeypatch, amx=False, avx512_bf16=True)
    with caplog.at_level(logging.INFO, logger="miles.recipes.run"):
        resolved = resolve_precision(cfg)
    assert (resolved.train.dtype, resolved.engine.dtype) == ("bf16", "fp32")
    assert cfg.train.dtype == "auto"  # the caller's config is not changed
    assert caplog.messages == ["train.dtype auto -> bf16: this CPU has AVX512-BF16"]
    _cpu(monkeypatch, amx=False, avx512_bf16=False)
    assert resolve_precision(cfg).train.dtype == "fp32"
