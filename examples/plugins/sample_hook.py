"""``rollout.sample_hook_path``: called on each generated sample before its reward, in the trainer process."""

import re


def tag_answer(sample):
    """Record the last integer of the response as ``metadata["parsed_answer"]`` (None if there is none), for the
    reward and for later analysis of the rollouts."""
    numbers = re.findall(r"-?\d+", sample.response_text or "")
    sample.metadata["parsed_answer"] = int(numbers[-1]) if numbers else None
