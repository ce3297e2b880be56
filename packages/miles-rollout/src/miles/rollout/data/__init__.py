"""Data sources: reasoning-gym tasks and local JSONL/Parquet files."""

from miles.rollout.data.epoch import EpochShuffledSource, make_messages
from miles.rollout.data.files import FileSource
from miles.rollout.data.reasoning_gym import ReasoningGymSource

__all__ = ["EpochShuffledSource", "FileSource", "ReasoningGymSource", "make_messages"]
