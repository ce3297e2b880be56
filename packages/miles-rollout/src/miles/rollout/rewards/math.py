"""Math answer checking with math-verify: GSM8K ``#### N`` labels and ``\\boxed{}`` answers."""

from __future__ import annotations

from miles.core.sample import Sample


def gold_answer(label: str) -> str:
    """The reference answer: the text after GSM8K's ``####`` marker if present, else the label itself.

    >>> gold_answer("Natalia sold 48/2 = 24 clips ... #### 72")
    '72'
    """
    return label.rsplit("####", 1)[-1].strip().replace(",", "") if "####" in label else label.strip()


def math_reward(sample: Sample) -> float:
    """1.0 if the response's final answer equals the label mathematically (math-verify), else 0.0.

    The response answer is the last ``\\boxed{...}`` or, failing that, the last number in the text.
    Raises: ValueError if the label is not a string.
    """
    from math_verify import parse, verify

    if not isinstance(sample.label, str):
        raise ValueError(f"sample {sample.index}: math reward needs a string label, got {type(sample.label).__name__}")
    gold = parse(f"${gold_answer(sample.label)}$")
    response = sample.response_text or ""
    predicted = parse(response)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted) else 0.0
