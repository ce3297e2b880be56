"""Data sources: reasoning-gym tasks, local JSONL/Parquet files and weighted mixtures of them."""

from miles.rollout.data.epoch import EpochShuffledSource, make_messages
from miles.rollout.data.files import FileSource
from miles.rollout.data.mixture import MixtureSource, mixture_counts, next_component
from miles.rollout.data.reasoning_gym import ReasoningGymSource

__all__ = [
    "EpochShuffledSource",
    "FileSource",
    "MixtureSource",
    "ReasoningGymSource",
    "make_messages",
    "mixture_counts",
    "next_component",
]
