"""The ``miles`` command: ``miles train --recipe NAME [--section.key value ...]``, ``miles recipes list``,
``miles config show NAME``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import yaml

logger = logging.getLogger("miles")


def resolve_config(recipe: str, override_args: list[str]):
    """Recipe + overrides -> validated ``MilesConfig``. Raises ValueError with a readable message."""
    from miles.recipes.config import MilesConfig
    from miles.recipes.overrides import apply_overrides, format_validation_error, parse_overrides
    from miles.recipes.registry import load_recipe
    from pydantic import ValidationError

    raw = apply_overrides(load_recipe(recipe), parse_overrides(override_args))
    try:
        return MilesConfig.model_validate(raw)
    except ValidationError as err:
        raise ValueError(format_validation_error(err)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles", description="Miles: RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train with a recipe; any config key can be overridden: --rollout.n-samples-per-prompt 8"
    )
    train.add_argument("--recipe", default="smollm2_grpo_arithmetic", help="shipped recipe name or YAML path")
    recipes = sub.add_parser("recipes", help="list the shipped recipes")
    recipes.add_argument("action", choices=["list"])
    config = sub.add_parser("config", help="print the resolved config of a recipe (with overrides)")
    config.add_argument("action", choices=["show"])
    config.add_argument("recipe")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from miles.recipes.registry import recipe_description, recipe_names

    if args.command == "recipes":
        for name in recipe_names():
            print(f"{name:36s} {recipe_description(name)}")  # noqa: T201 - CLI output
        return 0
    recipe = args.recipe
    try:
        cfg = resolve_config(recipe, rest)
    except ValueError as err:
        print(f"miles: {err}", file=sys.stderr)  # noqa: T201
        return 2
    if args.command == "config":
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))  # noqa: T201
        return 0
    from miles.recipes.run import run

    name = cfg.run.name or f"{Path(recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.run.dir) / name
    if (run_dir / "metrics.jsonl").exists():
        print(f"miles: run directory {run_dir} already has a run; pick another --run.name", file=sys.stderr)  # noqa: T201
        return 2
    final = run(cfg, run_dir)
    logger.info("done: run directory %s, final checkpoint %s", run_dir, final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
