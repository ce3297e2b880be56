"""Reward functions for tests/core/test_reward_pool.py, imported by module path in spawned worker processes.

``behaved`` does what the sample's label says, so one pool covers every fault: a number is the reward, "hang"
sleeps 60 s, "exit3" calls os._exit(3), "segfault" dereferences NULL, "allocate:<MiB>" allocates that much,
"raise" raises, "nan"/"none" return a bad value.
"""

import ctypes
import math
import os
import time


def behaved(sample) -> float:
    label = sample.label
    if isinstance(label, int | float):
        return label
    if label == "hang":
        time.sleep(60)
    elif label == "exit3":
        os._exit(3)
    elif label == "segfault":
        ctypes.string_at(0)
    elif label.startswith("allocate:"):
        block = bytearray(int(label.removeprefix("allocate:")) * 2**20)
        return float(len(block) // 2**20)
    elif label == "raise":
        raise KeyError("label")
    elif label == "nan":
        return math.nan
    elif label == "none":
        return None
    raise AssertionError(f"unknown label {label!r}")


def text_length(sample) -> float:
    """A good reward: the response length over 10, so each sample gets its own value."""
    return len(sample.response_text) / 10


async def async_index(sample) -> float:
    """An ``async def`` reward (an async judge client): awaits, then scores the sample's index."""
    import asyncio

    await asyncio.sleep(0)
    return float(sample.index)
