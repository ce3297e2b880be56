"""Binary reward for reasoning-gym tasks: the task's own scorer applied to the answer extracted from the response."""

from __future__ import annotations

import re

from miles.core.sample import Sample
from miles.rollout.data.reasoning_gym import import_reasoning_gym

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_answer(text: str) -> str | None:
    """The last ``<answer>...</answer>`` content if present, else the last number (commas removed), else None.

    >>> extract_answer("7 + 8 = 15")
    '15'
    >>> extract_answer("It is 1,024.")
    '1024'
    >>> extract_answer("<answer>12</answer> and 13")
    '12'
    """
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def reasoning_gym_reward(sample: Sample) -> float:
    """1.0 if the extracted answer scores 1.0 under the task's scorer, else 0.0 (no partial format credit).

    ``sample.label`` must be the reasoning-gym entry (``ReasoningGymSource`` sets it).
    Raises: ValueError if the label is not a reasoning-gym entry.
    """
    entry = sample.label
    if not isinstance(entry, dict) or "metadata" not in entry:
        raise ValueError(f"sample {sample.index}: label is not a reasoning-gym entry (got {type(entry).__name__})")
    answer = extract_answer(sample.response_text or "")
    if answer is None:
        return 0.0
    score_fn = import_reasoning_gym().get_score_answer_fn(entry["metadata"]["source_dataset"])
    return 1.0 if score_fn(answer, entry) == 1.0 else 0.0
