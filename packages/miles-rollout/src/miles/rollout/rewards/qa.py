"""Short-answer QA rewards: SQuAD exact match and token F1, the max over the acceptable answers.

For ``reward.type exact_match`` and ``reward.type f1``. The formulas are those of the official SQuAD v1.1 evaluation
script (Rajpurkar et al. 2016, arXiv:1606.05250; ``evaluate-v1.1.py``: ``normalize_answer``, ``f1_score``,
``exact_match_score``, ``metric_max_over_ground_truths``), so scores compare with published numbers.

The prediction is the last ``<answer>...</answer>`` of the response if it has one, else the whole response; the
label is one answer or a list of acceptable answers (SQuAD's ``answers["text"]``).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable

from miles.core.sample import Sample

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace.

    >>> normalize_answer("The  Eiffel-Tower!")
    'eiffeltower'
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 if the normalised strings are equal, else 0.0.

    >>> exact_match("the Eiffel Tower.", "Eiffel Tower")
    1.0
    """
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """F1 = 2PR / (P + R) over the normalised tokens (split on whitespace), counted as a multiset:
    P = common / len(prediction tokens), R = common / len(reference tokens), common = sum over tokens of the
    smaller count. 0.0 when no token is common, also when both are empty (as SQuAD v1.1; v2.0 gives 1.0 then).

    >>> token_f1("Paris France", "Paris")  # P = 1/2, R = 1/1: F1 = 2 * 0.5 / 1.5
    0.6666666666666666
    """
    prediction_tokens = normalize_answer(prediction).split()
    reference_tokens = normalize_answer(reference).split()
    common = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction_tokens), common / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def predicted_answer(text: str) -> str:
    """The last ``<answer>...</answer>`` content of ``text``, else ``text`` itself."""
    tags = _ANSWER_TAG.findall(text)
    return tags[-1] if tags else text


def exact_match_reward(sample: Sample) -> float:
    """``exact_match`` of the response's answer, max over the label's answers: 1.0 or 0.0.

    Raises: ValueError for a label that is not a string or a non-empty list of strings.
    """
    return _max_over_references(exact_match, sample)


def f1_reward(sample: Sample) -> float:
    """``token_f1`` of the response's answer, max over the label's answers: in [0, 1].

    Raises: ValueError for a label that is not a string or a non-empty list of strings.
    """
    return _max_over_references(token_f1, sample)


def _max_over_references(metric: Callable[[str, str], float], sample: Sample) -> float:
    label = sample.label
    references = [label] if isinstance(label, str) else label
    if not isinstance(references, list | tuple) or not references or not all(isinstance(r, str) for r in references):
        raise ValueError(
            f"sample {sample.index}: exact_match/f1 rewards need a label that is a string or a non-empty list of "
            f"strings (the acceptable answers), got {str(label)[:120]!r}"
        )
    prediction = predicted_answer(sample.response_text or "")
    return max(metric(prediction, reference) for reference in references)
