"""Shared by the tests: real servers (vLLM: ``default_vllm_python()``: ``$MILES_VLLM_PYTHON``, else the environment
scripts/install_vllm.sh makes, ``~/.cache/miles/vllm-venv``) and the size of the end-to-end runs.

Without vLLM the vLLM tests skip, unless ``MILES_REQUIRE_VLLM=1`` (CI's vLLM step), where they fail instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def vllm_python() -> str:
    """The interpreter with vLLM installed; skips (or fails under MILES_REQUIRE_VLLM=1) when there is none."""
    from miles.rollout.engines.vllm import default_vllm_python

    python = default_vllm_python()
    if Path(python).is_file():
        return python
    message = f"vLLM not installed at {python}: run scripts/install_vllm.sh (or set MILES_VLLM_PYTHON)"
    if os.environ.get("MILES_REQUIRE_VLLM") == "1":
        pytest.fail(message)
    pytest.skip(message)


# The Qwen3-VL twin's text model with head_dim 32 (``build_tiny("qwen3-vl", path, text_overrides=...)``): vLLM's CPU
# attention has no kernel for the twin's 8; mrope_section sums to head_dim / 2. Everything else is the twin's.
VLM_HEAD_DIM_32 = dict(
    head_dim=32, rope_parameters=dict(rope_type="default", mrope_section=[6, 5, 5], mrope_interleaved=True)
)


# Two small steps of the default recipe (2 prompts x 4 samples, 16 tokens, 2 x 2 eval): the end-to-end runs' size.
SMALL_RUN = [
    "--loop.num-steps", "2",
    "--rollout.rollout-batch-size", "2",
    "--rollout.n-samples-per-prompt", "4",
    "--rollout.sampling.max-new-tokens", "16",
    "--eval.num-prompts", "2",
    "--eval.n-samples-per-prompt", "2",
    "--eval.sampling.max-new-tokens", "16",
    "--run.progress", "false",
]  # fmt: skip


def start_miles_serve(model_dir, log_dir, *args):
    """A started ``miles serve`` (``python -m miles.rollout.serve``) for ``model_dir`` on a free port, one OpenMP
    thread, its log in ``log_dir/serve.log``; the caller stops it (``ServerProcess.stop``)."""
    from miles.rollout.engines.server import ServerProcess, free_port

    port = free_port()
    command = [sys.executable, "-m", "miles.rollout.serve", "--model", str(model_dir), "--port", str(port), *args]
    server = ServerProcess("miles serve", command, host="127.0.0.1", port=port, log_path=Path(log_dir) / "serve.log",
                           env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=240)  # fmt: skip
    return server.start()
