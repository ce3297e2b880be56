"""Overrides of a small `miles train` run on a tiny random model, shared by the end-to-end tests of a feature
(LoRA, routing replay, the Megatron backend): 2 prompts x 4 samples of up to 6 tokens per step, no eval, and a
response-length reward (``tests/core/reward_plugins.py``, on sys.path via ``TINY_RUN_PATH``) so that every group
has signal on a random model."""

from pathlib import Path

TINY_RUN_PATH = str(Path(__file__).parent / "core")  # where reward_plugins lives


def tiny_run(*, data_size: int, num_steps: int) -> list[str]:
    """The shared overrides; add the feature's own after them."""
    return [
        "--data.size", str(data_size),
        "--loop.num-steps", str(num_steps),
        "--rollout.rollout-batch-size", "2",
        "--rollout.n-samples-per-prompt", "4",
        "--rollout.sampling.max-new-tokens", "6",
        "--eval.num-prompts", "0",
        "--train.micro-batch-size", "8",
        "--train.lr", "1e-2",
        "--reward.type", "custom",
        "--reward.path", "reward_plugins:text_length",
        "--run.progress", "false",
    ]  # fmt: skip
