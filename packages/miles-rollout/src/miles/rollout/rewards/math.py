"""Math answer checking with math-verify: GSM8K ``#### N`` labels, MATH solutions and ``\\boxed{}`` answers."""

from __future__ import annotations

import logging
import re
import threading

from miles.core.sample import Sample

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _not_own_timeout_notice(record: logging.LogRecord) -> bool:
    """Drop math-verify's warning that its own timeouts are off: ``math_reward`` turns them off in threads, where
    ``reward.timeout_s`` limits the call instead."""
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_not_own_timeout_notice)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, nested braces matched
    (``\\{``/``\\}`` are escaped, not structure); None without one or when it is not closed.

    >>> last_boxed(r"\\boxed{3} no, \\boxed{\\frac{\\sqrt{2}}{2}} at last")
    '\\\\frac{\\\\sqrt{2}}{2}'
    """
    openings = list(_BOXED.finditer(text))
    if not openings:
        return None
    opening = openings[-1]
    depth, i = 1, opening.end()
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return text[opening.end() : i]
        i += 1
    return None


def gold_answer(label: str) -> str:
    """The reference answer: the text after GSM8K's ``####`` marker if present, else the last ``\\boxed{}``
    content (a MATH solution), else the label itself.

    >>> gold_answer("Natalia sold 48/2 = 24 clips ... #### 72")
    '72'
    >>> gold_answer(r"so the area is $\\boxed{6\\pi}$.")
    '6\\\\pi'
    """
    if "####" in label:
        return label.rsplit("####", 1)[-1].strip().replace(",", "")
    boxed = last_boxed(label)
    return boxed.strip() if boxed is not None else label.strip()


def math_reward(sample: Sample) -> float:
    """1.0 if the response's final answer equals the label mathematically (math-verify), else 0.0.

    The response answer is the content of the last ``\\boxed{...}`` (``last_boxed``: an earlier boxed draft does not
    count, where math-verify alone would read all of them as a set) or, without one, math-verify's own pick from
    the whole text (the last number). So this is also the boxed-answer reward: both sides are compared as math
    (``0.5`` equals ``\\frac{1}{2}``, ``\\{1, 2\\}`` equals ``\\{2,1\\}``), and text answers (``\\text{Paris}``,
    a choice letter) as strings.

    math-verify times its own parsing and comparison (5 s each) with ``signal.alarm``, which works in the main
    thread only; called in another thread (``reward.timeout_s``'s, the default) it runs without them, and
    ``reward.timeout_s`` is the limit.
    Raises: ValueError if the label is not a string.
    """
    from math_verify import parse, verify

    if not isinstance(sample.label, str):
        raise ValueError(f"sample {sample.index}: math reward needs a string label, got {type(sample.label).__name__}")
    own_timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${gold_answer(sample.label)}$", parsing_timeout=own_timeout)
    response = sample.response_text or ""
    boxed = last_boxed(response)
    predicted = parse(f"${boxed}$" if boxed is not None else response, parsing_timeout=own_timeout)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=own_timeout) else 0.0
