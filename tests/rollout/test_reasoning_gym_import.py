"""reasoning-gym imports without the SyntaxWarnings its dependency cellpylib raises when Python compiles it."""

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

# A fresh, empty bytecode cache for what is imported after this point: cellpylib is compiled from source, as on a
# first run or with PYTHONDONTWRITEBYTECODE, which is when the warnings show.
SCRIPT = """
import sys, tempfile, warnings
from miles.rollout.data import ReasoningGymSource
from miles.rollout.rewards import reasoning_gym_reward
from miles.core.sample import Sample

assert "cellpylib" not in sys.modules
sys.pycache_prefix, sys.dont_write_bytecode = tempfile.mkdtemp(), True
filters = list(warnings.filters)
prompt = ReasoningGymSource("basic_arithmetic", size=1, seed=0).next_prompts(1)[0]
sample = Sample(index=0, group_index=0, prompt="", label=prompt.label, response_text="0")
assert reasoning_gym_reward(sample) in (0.0, 1.0)
assert "cellpylib" in sys.modules and warnings.filters == filters
"""


def test_compiling_cellpylib_warns_so_miles_still_needs_its_filter():
    # If this fails, cellpylib no longer writes `is "recursive"`: drop the filter in import_reasoning_gym.
    folder = Path(importlib.util.find_spec("cellpylib").submodule_search_locations[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path in sorted(folder.glob("*.py")):
            compile(path.read_text(), str(path), "exec")
    assert [w for w in caught if issubclass(w.category, SyntaxWarning)]


def test_the_reasoning_gym_source_and_reward_print_no_warning_while_cellpylib_compiles():
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run(
        [sys.executable, "-W", "default", "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SyntaxWarning" not in result.stderr and "UserWarning" not in result.stderr, result.stderr[-3000:]
