"""miles.train: training backends (FSDP2 in-process, and its ranks as Ray actors)."""

from miles.train.config import TrainConfig
from miles.train.fsdp2 import FSDP2Backend
from miles.train.ray_group import RayTrainGroup, TrainerRankFailed

__all__ = ["FSDP2Backend", "RayTrainGroup", "TrainConfig", "TrainerRankFailed"]
