"""Compute dtype selection: ``auto`` is bf16 where the hardware multiplies bf16 fast, fp32 elsewhere.

Measured on this project's 2-core CPUs (docs/performance.md, docs/precision.md): with AMX or AVX512-BF16 a bf16 GEMM
runs ~3.6x the fp32 rate and the default job takes ~0.6x the wall time of fp32; without them (AVX2 only) oneDNN
emulates bf16 and matmuls run ~70x slower than fp32. So ``auto`` is decided per machine, at run time, never assumed.
"""

from __future__ import annotations

import torch

DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fast_bf16() -> tuple[bool, str]:
    """Whether bf16 matmuls are fast where this process computes, and why, as one phrase for a log line.

    A visible CUDA device decides (``torch.cuda.is_bf16_supported``: Ampere and newer); otherwise the CPU does: AMX
    tiles or AVX512-BF16 (``torch.cpu._is_amx_tile_supported`` / ``_is_avx512_bf16_supported``, what oneDNN uses).
    """
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported():
            return True, f"{name} supports bf16"
        return False, f"{name} has no native bf16"
    if torch.cpu._is_amx_tile_supported():
        return True, "this CPU has AMX (bf16 matrix tiles)"
    if torch.cpu._is_avx512_bf16_supported():
        return True, "this CPU has AVX512-BF16"
    capability = torch.backends.cpu.get_cpu_capability()
    return False, f"this CPU ({capability}) has no AVX512-BF16 or AMX, where bf16 matmuls run far slower than fp32"


def resolve_dtype(dtype: str) -> str:
    """``dtype`` with ``auto`` decided for this machine (see ``fast_bf16``).

    Args:
        dtype: "auto", "fp32", "bf16" or "fp16" (never chosen by auto).
    Returns: "fp32", "bf16" or "fp16".
    Raises: ValueError for any other value.
    """
    if dtype == "auto":
        return "bf16" if fast_bf16()[0] else "fp32"
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    return dtype


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of "fp32" / "bf16" / "fp16" / "auto" (resolved for this machine)."""
    return TORCH_DTYPES[resolve_dtype(dtype)]
