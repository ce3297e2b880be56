"""miles.train: training backends (FSDP2)."""

from miles.train.config import TrainConfig
from miles.train.fsdp2 import FSDP2Backend

__all__ = ["FSDP2Backend", "TrainConfig"]
