"""Reward from a remote reward model (or any scoring service) over HTTP.

For ``reward.type remote``. Each sample is one ``POST`` of JSON to ``reward.remote.url``::

    {"prompt": ..., "response": ..., "label": ..., "metadata": {...}}

(``Sample.prompt`` as it is: text, chat messages or token ids; ``response`` is ``Sample.response_text``), and the
reply is a JSON object whose ``reward.remote.score_key`` field (dots walk into nested objects: ``output.score``)
holds the reward, a finite number.
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

import httpx
from miles.core.rewards import RewardTimeoutError
from miles.core.sample import Sample


def remote_reward(
    sample: Sample,
    *,
    url: str,
    score_key: str = "score",
    timeout_s: float = 30.0,
    max_retries: int = 3,
    backoff_s: float = 0.5,
) -> float:
    """The score the service at ``url`` gives the sample.

    A connection error (refused, reset, DNS), a timeout or a 5xx reply is retried up to ``max_retries`` times,
    waiting ``backoff_s * 2**k`` seconds before retry k + 1 (0.5, 1, 2 s by default); a 4xx reply is not (the
    request itself is wrong). A call takes at most ``(max_retries + 1) * timeout_s`` seconds plus the waits.

    Args:
        sample: posted as ``prompt``, ``response`` (``response_text``), ``label`` and ``metadata``; these must be
            JSON-serialisable.
        url: the endpoint, ``http://`` or ``https://``.
        score_key: the reply field holding the score; dots walk into nested objects.
        timeout_s: seconds each attempt may take (connect, send, each read).
        max_retries: attempts after the first.
        backoff_s: the wait before the first retry, doubled for each further one.
    Returns: the score as a float.
    Raises (after the last attempt; ``score_samples`` then fails the sample with the message, counted as
        ``samples/failed_reward_timeout`` for a timeout, ``samples/failed_reward_error`` otherwise):
        RewardTimeoutError: the last attempt timed out.
        ConnectionError: the last attempt could not connect or got a 5xx reply.
        ValueError: a 4xx reply, a reply that is not JSON, or no finite number at ``score_key``.
        TypeError: a sample field that is not JSON-serialisable.
    """
    payload = {
        "prompt": sample.prompt,
        "response": sample.response_text,
        "label": sample.label,
        "metadata": sample.metadata,
    }
    attempts = max_retries + 1
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            reply = httpx.post(url, json=payload, timeout=timeout_s)
        except httpx.TimeoutException as err:
            error: Exception = RewardTimeoutError(
                f"reward.remote.url {url} did not answer within reward.remote.timeout_s={timeout_s:g}s "
                f"({type(err).__name__}) in {attempts} attempts"
            )
            continue
        except httpx.TransportError as err:
            error = ConnectionError(f"reward.remote.url {url}: {type(err).__name__}: {err} in {attempts} attempts")
            continue
        if reply.status_code >= 500:
            error = ConnectionError(
                f"reward.remote.url {url} answered HTTP {reply.status_code} to {attempts} attempts: "
                f"{_excerpt(reply.text)}"
            )
            continue
        return _score(reply, url=url, score_key=score_key)
    raise error


def _score(reply: httpx.Response, *, url: str, score_key: str) -> float:
    """The finite number at ``score_key`` of a non-5xx reply."""
    if reply.status_code >= 400:
        raise ValueError(f"reward.remote.url {url} answered HTTP {reply.status_code}: {_excerpt(reply.text)}")
    try:
        value: Any = reply.json()
    except ValueError:
        raise ValueError(f"reward.remote.url {url} answered non-JSON: {_excerpt(reply.text)}") from None
    for key in score_key.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ValueError(
                f"reward.remote.url {url} answered without reward.remote.score_key {score_key!r}: "
                f"{_excerpt(reply.text)}"
            )
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"reward.remote.url {url} gave {score_key}={value!r}, expected a finite number")
    return float(value)


def _excerpt(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
