"""Fixtures of the diffusion tests."""

from __future__ import annotations

import sys

import pytest
from miles.rollout.engines.server import ServerProcess, free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real ``miles serve-diffusion`` of the tiny twin (tiny-flow, seed 0) on a free 127.0.0.1 port, one per test
    module (the modules push other weights into it), stopped by its pid's process group afterwards."""
    log_dir = tmp_path_factory.mktemp("serve_diffusion")
    port = free_port()
    command = [sys.executable, "-m", "miles.recipes.serve_diffusion", "--model", "tiny-flow", "--port", str(port),
               "--log-level", "warning"]  # fmt: skip
    process = ServerProcess("miles serve-diffusion", command, host="127.0.0.1", port=port,
                            log_path=log_dir / "serve.log", env={"OMP_NUM_THREADS": "1"},
                            startup_timeout_s=120)  # fmt: skip
    process.start()
    yield process
    process.stop()
