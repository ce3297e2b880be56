import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "sync" / "train_and_push.py"


@pytest.mark.integration
def test_example_engine_generates_exactly_what_the_trained_model_generates():
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "3"], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr.count(": match") == 3
    assert "engine matched the trainer after all 3 updates" in run.stderr
