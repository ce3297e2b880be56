"""Inference engines behind the ``miles.core.Engine`` protocol."""

from miles.rollout.engines.embedded import EmbeddedEngine

__all__ = ["EmbeddedEngine"]
