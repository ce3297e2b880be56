"""Binary reward on the final answer of a (multi-turn) response: the number in the last model turn against the label.

For ``reward.type custom`` with ``reward.path miles.rollout.rewards.final_answer:final_answer_reward``; works on
reasoning-gym entries (their ``answer``) and on plain labels (a number or its text, e.g. a data file's answer).
"""

from __future__ import annotations

import math

from miles.core.sample import Sample
from miles.rollout.rewards.reasoning_gym import extract_answer

# Answers are equal when they differ by at most this, relative to the reference (absolute near 0): exact enough for
# integers, forgiving for decimals the model rounded (0.333333 for 1/3).
TOLERANCE = 1e-6


def final_answer_reward(sample: Sample) -> float:
    """1.0 if the final answer equals the reference answer numerically, else 0.0.

    The final answer is ``extract_answer`` (the last ``<answer>...</answer>``, else the last number) of
    ``sample.response_text``, which a multi-turn rollout sets to the last model turn, so numbers in tool results and
    earlier turns never count. A sample that did not end with an answer (``metadata["stop_reason"]`` other than
    "answer": its last turn called a tool, or a budget cut it) scores 0.0; single-turn samples have no stop_reason.

    >>> final_answer_reward(Sample(index=0, group_index=0, prompt="", label="574533", response_text="574,533"))
    1.0

    Raises: ValueError for a label without a number (a reasoning-gym entry's ``answer``, or the label itself).
    """
    label = sample.label
    reference_text = str(label["answer"]) if isinstance(label, dict) and "answer" in label else str(label)
    try:
        reference = float(reference_text.replace(",", "").strip())
    except ValueError:
        raise ValueError(f"sample {sample.index}: label {reference_text!r} is not a number") from None
    if sample.metadata.get("stop_reason", "answer") != "answer":
        return 0.0
    answer = extract_answer(sample.response_text or "")
    if answer is None:
        return 0.0
    try:
        value = float(answer.replace(",", ""))
    except ValueError:  # an <answer> tag around text
        return 0.0
    return 1.0 if math.isclose(value, reference, rel_tol=TOLERANCE, abs_tol=TOLERANCE) else 0.0
