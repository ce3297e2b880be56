"""miles.recipes: model recipes, the config tree and the ``miles`` command line."""

from miles.recipes.config import MilesConfig
from miles.recipes.registry import load_recipe, recipe_names, resolve_model_path

__all__ = ["MilesConfig", "load_recipe", "recipe_names", "resolve_model_path"]
