"""The plain-torch example runs in a fresh virtual environment holding only torch and miles-sync."""

import glob
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_example_runs_in_a_fresh_venv_with_only_torch_and_miles_sync(tmp_path):
    uv = shutil.which("uv")
    wheels = glob.glob("/opt/wheels/torch-2.13.0*.whl")
    if uv is None or not wheels:
        pytest.skip("needs uv and the local CPU torch wheel in /opt/wheels")
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = [uv, "pip", "install", "--quiet", "--python", python, wheels[0], str(ROOT / "packages" / "miles-sync")]
    subprocess.run(install, check=True, timeout=600)
    probe = "import importlib.util as u; print(u.find_spec('miles.sync') is not None, u.find_spec('miles.core'))"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "None"]  # miles.sync importable; no other Miles package present
    run = subprocess.run(
        [python, str(ROOT / "examples" / "sync" / "train_and_push.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "engine matched the trainer after all 2 updates" in run.stderr
