"""The ``miles`` command: ``miles train --recipe NAME [--section.key value ...]``, ``miles train --resume [PATH]``,
``miles export --checkpoint DIR --out DIR``, ``miles recipes list``, ``miles config show NAME``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger("miles")


DEFAULT_RECIPE = "smollm2_grpo_arithmetic"


def resolve_config(recipe: str, override_args: list[str]):
    """Recipe + overrides -> validated ``MilesConfig``. Raises ValueError with a readable message."""
    from miles.recipes.registry import load_recipe

    return _validate(load_recipe(recipe), override_args)


def _validate(raw: dict, override_args: list[str]):
    from miles.recipes.config import MilesConfig
    from miles.recipes.overrides import apply_overrides, format_validation_error, parse_overrides
    from pydantic import ValidationError

    try:
        return MilesConfig.model_validate(apply_overrides(raw, parse_overrides(override_args)))
    except ValidationError as err:
        raise ValueError(format_validation_error(err, MilesConfig)) from None


def resolve_resume(resume: str, recipe: str, override_args: list[str]) -> tuple[Any, Path, Path]:
    """``--resume [PATH]`` -> (config, run directory, checkpoint directory).

    Without PATH the checkpoint is ``latest`` of the run ``--run.dir``/``--run.name``. The config is the one stored
    in the checkpoint with the command line's overrides on top (e.g. a larger ``--loop.num-steps``); the run
    directory is the checkpoint's own unless ``--run.name`` names another (a branch of the run).
    Raises: ValueError naming the flag and the fix.
    """
    from miles.recipes.checkpoint import read_latest
    from miles.recipes.overrides import parse_overrides

    located = resolve_config(recipe, override_args)
    if resume == "latest":
        if not located.run.name:
            raise ValueError("--resume without a path needs --run.name NAME (the run to continue from its latest)")
        checkpoint = read_latest(Path(located.run.dir) / located.run.name / "checkpoints")
        if checkpoint is None:
            raise ValueError(
                f"--resume: run {located.run.name!r} under {located.run.dir!r} has no checkpoint; check --run.name "
                "and --run.dir, or start it without --resume"
            )
    else:
        checkpoint = Path(resume)
    if not (checkpoint / "config.yaml").is_file():
        raise ValueError(
            f"--resume {checkpoint}: no config.yaml there, so it is not a complete Miles checkpoint; pass a "
            "runs/<name>/checkpoints/step_N directory"
        )
    cfg = _validate(yaml.safe_load((checkpoint / "config.yaml").read_text()), override_args)
    named = "run.name" in parse_overrides(override_args)
    run_dir = Path(cfg.run.dir) / cfg.run.name if named else checkpoint.parent.parent
    return cfg, run_dir, checkpoint


def main(argv: list[str] | None = None) -> int:
    # reasoning-gym's dependency cellpylib has `is` comparisons with literals: Python warns at each import.
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=r"cellpylib.*")
    parser = argparse.ArgumentParser(prog="miles", description="Miles: RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train with a recipe; any config key can be overridden: --rollout.n-samples-per-prompt 8"
    )
    train.add_argument("--recipe", default=DEFAULT_RECIPE, help="shipped recipe name or YAML path")
    train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue exactly from a checkpoint: PATH (a step_N dir), or without PATH the latest checkpoint of "
        "--run.name; the checkpoint's config is used, with the given overrides on top",
    )
    export = sub.add_parser("export", help="write a checkpoint's model as a plain HF directory (safetensors)")
    export.add_argument("--checkpoint", required=True, help="runs/<name>/checkpoints/step_N")
    export.add_argument("--out", required=True, help="new directory to create")
    recipes = sub.add_parser("recipes", help="list the shipped recipes")
    recipes.add_argument("action", choices=["list"])
    config = sub.add_parser(
        "config",
        help="print the resolved config of a recipe, every field with its description",
        description="miles config show RECIPE [--section.key value ...]: the resolved config, overrides applied.",
    )
    config.add_argument("action", choices=["show"])
    config.add_argument("recipe")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from miles.recipes.registry import recipe_description, recipe_names

    if args.command == "recipes":
        for name in recipe_names():
            print(f"{name:36s} {recipe_description(name)}")  # noqa: T201 - CLI output
        return 0
    if args.command == "export":
        return _export(args.checkpoint, args.out, rest)
    recipe = args.recipe
    resume = getattr(args, "resume", None)
    try:
        if resume is not None:
            cfg, run_dir, checkpoint = resolve_resume(resume, recipe, rest)
        else:
            cfg, checkpoint = resolve_config(recipe, rest), None
    except ValueError as err:
        print(f"miles: {err}", file=sys.stderr)  # noqa: T201
        return 2
    if args.command == "config":
        from miles.recipes.overrides import documented_yaml

        print(documented_yaml(cfg))  # noqa: T201
        return 0
    from miles.recipes.run import run

    if checkpoint is None:
        name = cfg.run.name or f"{Path(recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(cfg.run.dir) / name
        if (run_dir / "metrics.jsonl").exists():
            print(  # noqa: T201
                f"miles: run directory {run_dir} already has a run; pick another --run.name, or continue it with "
                f"--run.name {name} --resume",
                file=sys.stderr,
            )
            return 2
    final = run(cfg, run_dir, resume_from=checkpoint)
    logger.info("done: run directory %s, final checkpoint %s", run_dir, final)
    return 0


def _export(checkpoint: str, out: str, rest: list[str]) -> int:
    from miles.recipes.checkpoint import export_hf_model

    if rest:
        print(f"miles export: unexpected arguments {rest}", file=sys.stderr)  # noqa: T201
        return 2
    try:
        path = export_hf_model(Path(checkpoint), Path(out))
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"miles: {err}", file=sys.stderr)  # noqa: T201
        return 2
    logger.info("exported %s to %s", checkpoint, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
