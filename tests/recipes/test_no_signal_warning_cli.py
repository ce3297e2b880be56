"""`miles train` at a step where every group has one reward for all its samples tells the user which case it is:
a solved task (every sample right) is not told to pick an easier task or to sample more."""

import os
import subprocess
import sys

import pytest
from miles.core.loop import SOLVED_WARNING

pytestmark = pytest.mark.integration

REWARD_MODULE = """
def always_right(sample):
    return 1.0
"""


def test_a_step_where_every_sample_is_right_is_called_solved_not_told_to_sample_more(tiny_smollm2_dir, tmp_path):
    (tmp_path / "solved_reward.py").write_text(REWARD_MODULE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    args = [
        "--models.policy.path", str(tiny_smollm2_dir), "--data.size", "4",
        "--reward.type", "custom", "--reward.path", "solved_reward:always_right",
        "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "8",
        "--rollout.sampling.max-new-tokens", "2", "--train.micro-batch-size", "16",
        "--eval.num-prompts", "0", "--loop.num-steps", "1",
        "--run.dir", str(tmp_path), "--run.name", "solved", "--run.progress", "false", "--run.num-threads", "1",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "miles.recipes.cli", "train", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if "zero reward variance" in line]
    assert line.endswith(" WARNING miles.core.loop: " + SOLVED_WARNING % (1, 2, 1.0))
    assert "mean reward 1)" in line and "the policy solves these prompts" in line
    assert "easier task" not in done.stderr and "--rollout.n-samples-per-prompt" not in done.stderr
