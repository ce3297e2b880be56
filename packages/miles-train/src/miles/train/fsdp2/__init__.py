"""FSDP2 training backend."""

from miles.train.fsdp2.backend import FSDP2Backend, ensure_process_group
from miles.train.fsdp2.parallelize import parallelize

__all__ = ["FSDP2Backend", "ensure_process_group", "parallelize"]
