"""The ``miles`` command: ``miles train --recipe NAME [--section.key value ...]``, ``miles train --resume [PATH]``,
``miles export --checkpoint DIR --out DIR``, ``miles recipes list``, ``miles config show NAME``,
``miles serve --model PATH [--port N ...]``, ``miles serve-diffusion --model NAME_OR_DIR [--port N ...]``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger("miles")


DEFAULT_RECIPE = "smollm2_grpo_arithmetic"


def resolve_config(recipe: str, override_args: list[str], *, tiny: bool = False):
    """Recipe (its bases merged; with ``tiny``, its ``tiny`` sections on top) + overrides -> validated
    ``MilesConfig``; reads the recipe files only.

    Raises: ValueError with a readable message.
    """
    from miles.recipes.registry import load_recipe

    return _validate(load_recipe(recipe, tiny=tiny), override_args)


def _recorded(path: Path) -> dict:
    """The config a run recorded (its or its checkpoint's ``config.yaml``).

    Raises: ValueError in one line when an older Miles wrote it in the flat layout, naming the key.
    """
    from miles.recipes.config import RENAMED_KEYS, flat_layout_key
    from miles.recipes.diffusion import is_diffusion

    raw = yaml.safe_load(path.read_text()) or {}
    key = None if is_diffusion(raw) else flat_layout_key(raw)
    if key is not None:
        raise ValueError(
            f"--resume: {path} was written by an older Miles (flat config layout: {key} is now {RENAMED_KEYS[key]}), "
            "so this Miles cannot continue that run. Start a new run (without --resume), or continue it with the "
            "Miles version that wrote it."
        )
    return raw


def _validate(raw: dict, override_args: list[str]):
    """A recipe's raw mapping + overrides -> ``MilesConfig``, or ``DiffusionConfig`` for ``kind: diffusion``."""
    from miles.recipes.config import MilesConfig
    from miles.recipes.diffusion import DiffusionConfig, is_diffusion
    from miles.recipes.overrides import apply_overrides, format_validation_error, parse_overrides
    from pydantic import ValidationError

    schema = DiffusionConfig if is_diffusion(raw) else MilesConfig
    try:
        return schema.model_validate(apply_overrides(raw, parse_overrides(override_args, schema)))
    except ValidationError as err:
        raise ValueError(format_validation_error(err, schema)) from None


def resolve_resume(resume: str, recipe: str, override_args: list[str]) -> tuple[Any, Path, Path | None]:
    """``--resume [PATH]`` -> (config, run directory, checkpoint directory or None).

    Without PATH the checkpoint is ``latest`` of the run ``--run.dir``/``--run.name``; a run without a checkpoint
    yet (stopped or crashed before its first save) gives None: it starts again from step 0 with its recorded
    ``config.yaml``. The config is the run's ``config.yaml`` (its latest settings, e.g. a ``--loop.num-steps``
    raised by an earlier resume), or for PATH the one stored in the checkpoint with the command
    line's overrides on top (e.g. a larger ``--loop.num-steps``); the run directory is the checkpoint's own unless
    ``--run.name`` names another (a branch of the run).
    Raises: ValueError naming the flag and the fix.
    """
    from miles.recipes.checkpoint import checkpoint_in, read_latest
    from miles.recipes.overrides import parse_overrides

    # Where the run is: the overrides' run.name / run.dir over the recipe's; the overrides are validated against the
    # run's own recorded config below (a diffusion run's keys are not the default recipe's).
    parsed = parse_overrides(override_args)
    located = resolve_config(recipe, []).run
    run_name, parent = str(parsed.get("run.name", located.name) or ""), str(parsed.get("run.dir", located.dir))
    if resume == "latest":
        if not run_name:
            raise ValueError("--resume without a path needs --run.name NAME (the run to continue from its latest)")
        run_dir = Path(parent) / run_name
        checkpoint = read_latest(run_dir / "checkpoints")
        recorded = run_dir / "config.yaml"
        if checkpoint is None and not recorded.is_file():
            raise ValueError(
                f"--resume: there is no run {run_name!r} under {parent!r} (no config.yaml, no "
                "checkpoint); check --run.name and --run.dir, or start it without --resume"
            )
        if checkpoint is None:  # built and started, stopped before its first checkpoint: again from step 0
            return _validate(_recorded(recorded), override_args), run_dir, None
        if recorded.is_file():  # the run's latest settings, e.g. a --loop.num-steps raised by an earlier resume
            return _validate(_recorded(recorded), override_args), run_dir, checkpoint
    else:
        try:  # a step_N directory, or a run directory: its latest checkpoint
            checkpoint = checkpoint_in(Path(resume), flag="--resume")
        except FileNotFoundError as err:
            raise ValueError(str(err)) from None
    if not (checkpoint / "config.yaml").is_file():
        raise ValueError(
            f"--resume {checkpoint}: no config.yaml there, so it is not a complete Miles checkpoint; pass a "
            "runs/<name>/checkpoints/step_N directory"
        )
    cfg = _validate(_recorded(checkpoint / "config.yaml"), override_args)
    named = "run.name" in parsed
    run_dir = Path(cfg.run.dir) / cfg.run.name if named else checkpoint.parent.parent
    return cfg, run_dir, checkpoint


TRAIN_EPILOG = """\
common options of LLM recipes (any config key works as --section.key VALUE; dashes or underscores):
  --loop.num-steps N                    rollout steps (each: generate, score, train, push weights)
  --loop.save-interval N                checkpoint every N steps (and after the last; Ctrl-C also saves)
  --rollout.rollout-batch-size N        prompts per step
  --rollout.n-samples-per-prompt N      samples per prompt (the GRPO group size)
  --rollout.sampling.max-new-tokens N   response length limit
  --train.lr LR                         learning rate
  --algorithm.advantage.estimator NAME  grpo, dr_grpo, rloo, reinforce_plus_plus, gae, opd, ...
  --algorithm.loss.policy-loss NAME     ppo, gspo, cispo, sft
  --algorithm.kl.coef C                 KL to the reference (turns algorithm.kl on; --algorithm.kl null: off)
  --models.policy.path PATH             a registered model name or a local HF model directory
  --data.source file --data.path F      train on a JSONL/Parquet file (--data.eval-path for its eval file)
  --reward.type math|custom             math-verify, or --reward.path module:function
  --eval.num-prompts N                  held-out eval prompts (0 = no eval)
  --run.name NAME  --run.dir DIR        where the run directory goes (default runs/<recipe>-<time>)
  --run.num-threads N                   torch threads (1 when another job shares the cores)
  --train.backend megatron              Megatron-core instead of FSDP2; its layout: --train.megatron.X-parallel-size N
                                        for X = tensor, pipeline, expert (several ranks: --train.world-size N
                                        --execution.mode ray, with a server engine)
a key inside an optional section turns it on (the rest at defaults); --SECTION null turns it off.
a list takes a comma list or YAML: --eval.pass-k 1,8 or '[1, 8]' (YAML for items that hold a comma).

diffusion recipes (kind: diffusion: tiny_flow_grpo_compressibility, tiny_flow_nft_compressibility,
sd35_medium_flow_grpo_compressibility, qwen_image_flow_grpo_compressibility; docs/diffusion.md) have their own keys:
  --model.path PATH                     tiny-flow, tiny-sd3, tiny-qwen-image, or a local diffusers SD3 / SD3.5 /
                                        Qwen-Image pipeline directory
  --model.resolution PX  --model.max-sequence-length N  --model.device auto|cpu|cuda
  --model.frozen-dtype bfloat16         text encoders and VAE in bf16 (--algorithm.rollout-dtype bfloat16: the
                                        sampling copy; old log-probs are then the trainer's fp32 recompute)
  --run.world-size N                    N rank processes (FSDP2 over the transformer)
  --engine.type sglang --engine.urls URL  rollouts on SGLang-Diffusion servers (miles serve-diffusion on a CPU)
  --algorithm.loss NAME                 flow_grpo or diffusion_nft
  --algorithm.lr LR  --algorithm.prompts-per-step N  --algorithm.group-size N (images per prompt)
  --algorithm.num-steps N               denoising steps sampled (--algorithm.train-steps K: train on K of them)
  --algorithm.lora.rank R               train LoRA adapters only (--algorithm.lora.target-modules to_q,to_k)
  --reward.name NAME | --reward.path module:function
  --data.prompts 'a cat,a dog'  --eval.prompts ...  --eval.interval N  --loop.num-steps N  --loop.save-interval N
  every key of a diffusion recipe:      miles config show tiny_flow_grpo_compressibility

every key, its default and its description:  miles config show RECIPE
shipped recipes:                             miles recipes list
continue a run exactly:                      miles train --run.name NAME --resume
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="miles", description="Miles: RL post-training for LLMs (and text-to-image flow models)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train with a recipe; any config key can be overridden: --rollout.n-samples-per-prompt 8",
        description="Train with a recipe. The config is validated as a whole before anything loads.",
        usage="miles train [--recipe NAME] [--resume [PATH]] [--overwrite] [--section.key VALUE ...]",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"shipped recipe name or YAML path ({DEFAULT_RECIPE})")
    train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue exactly from a checkpoint: PATH (a step_N dir, or a run directory: its latest), or without "
        "PATH the latest checkpoint of --run.name (a run without a checkpoint starts again from step 0); the "
        "checkpoint's config is used, with the given overrides on top",
    )
    train.add_argument(
        "--tiny",
        action="store_true",
        help="run the recipe on its model family's tiny random-init twin on the CPU (its `tiny` section: a few "
        "steps, small batches, offline data); `miles recipes list` marks the recipes that have one",
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="print what the run would start (Ray placement groups, engine server commands, trainer ranks, the "
        "weight path) and exit without starting, loading or downloading anything",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start --run.name over: delete its checkpoints and metrics (once the new run is built)",
    )
    evaluation = sub.add_parser(
        "eval",
        help="evaluate a checkpoint (or a recipe's model) on the eval sets, without training",
        description="Evaluate a checkpoint's policy, or a recipe's models.policy.path, on the default eval set and "
        "every eval.sets entry, with the run's reward; prints the metrics as JSON. With --checkpoint the config is "
        "the one stored in the checkpoint (unless --recipe is given), overrides on top.",
        usage="miles eval [--checkpoint runs/NAME/checkpoints/step_N] [--recipe NAME] [--out FILE.json] "
        "[--section.key VALUE ...]",
    )
    evaluation.add_argument(
        "--checkpoint", default=None, help="runs/<name>/checkpoints/step_N, or runs/<name> (its latest checkpoint)"
    )
    evaluation.add_argument("--recipe", default=None, help=f"shipped recipe name or YAML path ({DEFAULT_RECIPE})")
    evaluation.add_argument("--out", default=None, help="also write the metrics to this JSON file")
    export = sub.add_parser("export", help="write a checkpoint's model as a plain HF directory (safetensors)")
    export.add_argument(
        "--checkpoint", required=True, help="runs/<name>/checkpoints/step_N, or runs/<name> (its latest checkpoint)"
    )
    export.add_argument("--out", required=True, help="new directory to create")
    recipes = sub.add_parser(
        "recipes",
        help="list the shipped recipes, or show one",
        usage="miles recipes list | miles recipes show NAME [--tiny]",
    )
    recipes.add_argument("action", choices=["list", "show"])
    recipes.add_argument("name", nargs="?", default=None, help="the recipe to show")
    recipes.add_argument("--tiny", action="store_true", help="show it with its tiny twin's overrides applied")
    config = sub.add_parser(
        "config",
        help="print the resolved config of a recipe, every field with its description",
        description="Print the resolved config of a recipe (its base chain merged, overrides applied), every field "
        "with its description; nothing is loaded. Any config key can be overridden as --section.key VALUE "
        "(e.g. --algorithm.kl.coef 0.05; --algorithm.kl null turns a section off).",
        usage="miles config show [RECIPE | --recipe NAME_OR_PATH] [--section.key VALUE ...]",
    )
    config.add_argument("action", choices=["show"])
    config.add_argument("recipe", nargs="?", default=None, help=f"shipped recipe name or YAML path ({DEFAULT_RECIPE})")
    config.add_argument("--recipe", dest="recipe_flag", default=None, help="the same as the positional RECIPE")
    config.add_argument(
        "--tiny", action="store_true", help="with the recipe's tiny-twin overrides (miles train --tiny)"
    )
    # Its options are miles.rollout.serve's own (miles serve --help), handed over unparsed.
    sub.add_parser(
        "serve",
        help="serve a model with the embedded engine behind SGLang's HTTP API (miles serve --help)",
        add_help=False,
    )
    # Its options are miles.recipes.serve_diffusion's own (miles serve-diffusion --help), handed over unparsed.
    sub.add_parser(
        "serve-diffusion",
        help="serve a text-to-image flow model behind SGLang-Diffusion's post-training HTTP API "
        "(miles serve-diffusion --help)",
        add_help=False,
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve":
        from miles.rollout.serve import main as serve

        return serve(rest)
    if args.command == "serve-diffusion":
        from miles.recipes.serve_diffusion import main as serve_diffusion

        return serve_diffusion(rest)
    _setup_logging()

    from miles.recipes.registry import recipe_description, recipe_names, tiny_recipe_names

    if args.command == "recipes":
        if args.action == "show":
            return _show_recipe(args.name, tiny=args.tiny)
        with_tiny = set(tiny_recipe_names())
        for name in recipe_names():
            mark = " [--tiny]" if name in with_tiny else ""
            print(f"{name:36s} {recipe_description(name)}{mark}")  # noqa: T201 - CLI output
        return 0
    if args.command == "export":
        return _export(args.checkpoint, args.out, rest)
    if args.command == "eval":
        return _eval(args.checkpoint, args.recipe, args.out, rest)
    recipe = args.recipe
    if args.command == "config":
        if args.recipe is not None and args.recipe_flag is not None:
            return _fail(ValueError("miles config show: give the recipe once, as RECIPE or as --recipe"))
        recipe = args.recipe or args.recipe_flag or DEFAULT_RECIPE
    resume = getattr(args, "resume", None)
    overwrite = getattr(args, "overwrite", False)
    try:
        if resume is not None and overwrite:
            raise ValueError("--resume continues a run and --overwrite deletes it: pass one of them")
        if resume is not None and getattr(args, "tiny", False):
            raise ValueError("--tiny starts a new run on a tiny twin; --resume continues a run with its own config")
        if resume is not None:
            cfg, run_dir, checkpoint = resolve_resume(resume, recipe, rest)
        else:
            cfg, checkpoint = resolve_config(recipe, rest, tiny=getattr(args, "tiny", False)), None
    except ValueError as err:
        return _fail(err)
    if args.command == "config":
        from miles.recipes.overrides import documented_yaml

        print(documented_yaml(cfg))  # noqa: T201
        return 0
    from miles.recipes.run_dir import RunDirError, RunDirLock

    if resume is None:
        name = cfg.run.name or f"{Path(recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(cfg.run.dir) / name
    if getattr(args, "dry_run", False):
        return _dry_run(cfg, run_dir, checkpoint)
    # One writer per run directory: locked before anything in it is read to decide, deleted or written.
    try:
        lock = RunDirLock.acquire(run_dir, busy_hint=_busy_hint(resume, overwrite))
    except RunDirError as err:
        return _fail(err)
    with lock:
        if resume is not None:  # again under the lock: a run that ended meanwhile may have moved its latest
            try:
                cfg, run_dir, checkpoint = resolve_resume(resume, recipe, rest)
            except ValueError as err:
                return _fail(err)
        return _train(cfg, run_dir, checkpoint, resumed=resume is not None, overwrite=overwrite)


def _dry_run(cfg: Any, run_dir: Path, checkpoint: Path | None) -> int:
    """``miles train --dry-run``: print the launch plan (``miles.recipes.plan``) of an LLM run, then where it would
    write and what it would resume from; a diffusion run's plan is ``miles.recipes.diffusion.dry_run_plan``. Nothing
    is locked, created or started."""
    from miles.recipes.config import MilesConfig
    from miles.recipes.plan import launch_plan

    resume = f"; resuming from {checkpoint}" if checkpoint is not None else ""
    if not isinstance(cfg, MilesConfig):
        from miles.recipes.diffusion import dry_run_plan

        print(dry_run_plan(cfg) + f"run directory: {run_dir}{resume}")  # noqa: T201 - CLI output
        return 0
    print(launch_plan(cfg) + f"run directory: {run_dir}{resume}")  # noqa: T201 - CLI output
    return 0


def _show_recipe(name: str | None, *, tiny: bool) -> int:
    """``miles recipes show NAME``: its description, the bases it composes, the comments of its files (the recipe's
    and its bases', each with the line it sits on or above), and the recipe with its bases merged (and, with
    ``tiny``, its tiny-twin overrides) as YAML; all but the merged recipe are comments, so the output loads as it.
    Exit 2 with one line for an unknown recipe."""
    from miles.recipes.registry import commented_lines, load_recipe, recipe_bases, recipe_description, recipe_files

    if name is None:
        return _fail(ValueError("recipes show needs a recipe name (miles recipes list shows them)"))
    try:
        merged = load_recipe(name, tiny=tiny)
        bases = recipe_bases(name)
        description = recipe_description(name) if Path(name).suffix not in (".yaml", ".yml") else ""
        files = recipe_files(name)
    except ValueError as err:
        return _fail(err)
    lines = [f"# {name}: {description}" if description else f"# {name}"]
    lines += [f"# composes: {' + '.join(bases)}"] if bases else []
    notes = [(label, commented_lines(text)) for label, text in files]
    for label, commented in notes:
        lines += ["#", f"# {label}, its comments:", *(f"#   {line}" for line in commented)] if commented else []
    if bases or any(commented for _, commented in notes):
        lines += ["#", "# merged (what miles train starts from):"]
    lines += ["# with its tiny twin's overrides (--tiny)"] if tiny else []
    print("\n".join(lines))  # noqa: T201 - CLI output
    print(yaml.safe_dump(merged, sort_keys=False, default_flow_style=None, width=120), end="")  # noqa: T201
    return 0


def _busy_hint(resume: str | None, overwrite: bool) -> str:
    """The fix a refused second writer is told (``RunDirLock.acquire``)."""
    stop = "stop that run first (Ctrl-C in its terminal, or kill -INT with its pid, saves a checkpoint)"
    if resume is not None:
        return f"{stop}, then --resume continues it"
    if overwrite:
        return f"{stop}, then --overwrite starts it over; or pick another --run.name"
    return "pick another --run.name, or wait for that run to end"


def _train(cfg: Any, run_dir: Path, checkpoint: Path | None, *, resumed: bool, overwrite: bool) -> int:
    """``miles train`` once the run directory is locked: refuse a directory holding another run, then ``run``.

    A run directory in which no training step completed (no checkpoint, no ``metrics.jsonl`` row past step 0: a
    run that failed or was stopped in its first step) holds nothing to continue: a plain start replaces it.
    """
    from miles.recipes.checkpoint import load_run_state, read_latest
    from miles.recipes.diffusion import DiffusionConfig, run_diffusion
    from miles.recipes.run import RunFailed, RunInputError, RunSetupError, run
    from miles.recipes.run_dir import completed_steps
    from miles.rollout.engines.server import ServerStartError

    replace = overwrite
    if not resumed and not overwrite and ((run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()):
        saved = read_latest(run_dir / "checkpoints")
        if saved is None and completed_steps(run_dir) == 0:
            logger.info("run directory %s holds a run that completed no training step: starting it over", run_dir)
            replace = True
        else:
            how = f"its latest checkpoint is {saved.name}" if saved else "it has no checkpoint: it starts from step 0"
            return _fail(
                f"run directory {run_dir} already has a run; continue it with --run.name {run_dir.name} --resume "
                f"({how}), start it over with --overwrite, or pick another --run.name"
            )
    cfg = _with_run_name(cfg, run_dir.name)
    continue_cmd = f"{command_prefix()}miles train --run.name {run_dir.name}{_dir_flag(run_dir)} --resume"
    if checkpoint is not None:
        done = load_run_state(checkpoint)["step"]
        if done >= cfg.loop.num_steps:
            print(  # noqa: T201
                f"miles: run {run_dir.name} already finished: {checkpoint.name} has {done} of loop.num_steps "
                f"{cfg.loop.num_steps} steps; to train on, add --loop.num-steps {done + cfg.loop.num_steps} to "
                f"`{continue_cmd}`"
            )
            return 0
    elif resumed:
        logger.info("run %s has no checkpoint yet: starting it from step 0", run_dir.name)
        replace = True  # a previous attempt without a checkpoint is replaced
    try:
        runner = run_diffusion if isinstance(cfg, DiffusionConfig) else run
        result = runner(cfg, run_dir, resume_from=checkpoint, replace_existing=replace)
    except RunSetupError as err:
        return _fail(err)
    except ServerStartError as err:  # an engine server that did not start: its line, the fix and its log's path
        return _fail(_server_start_line(err))
    except RunInputError as err:  # one line, exit 2: the user's reward (train.log has the line too)
        saved = read_latest(run_dir / "checkpoints")
        if saved is not None:
            then = f"Then continue from {saved.name} with: {continue_cmd}"
        elif completed_steps(run_dir):
            then = f"Then start it again from step 0 with: {continue_cmd}"
        else:
            then = "No step was completed, so the same command starts the run again"
        return _fail(f"{err}. {then}")
    except RunFailed as err:  # one line, no traceback (train.log has it); status 1: not a usage error
        _print_safely(f"miles: {err}. Continue with: {continue_cmd}")
        return 1
    except KeyboardInterrupt:
        if not (run_dir / "config.yaml").is_file():  # still building: nothing was written
            _print_safely("\nmiles: interrupted before the run started; nothing was written")
            return 130
        saved = read_latest(run_dir / "checkpoints")
        where = (
            f"the last checkpoint is {saved.name}" if saved else "no checkpoint was written, so it starts from step 0"
        )
        _print_safely(f"\nmiles: interrupted; {where}. Continue with: {continue_cmd}")
        return 130
    if result.stopped_by is not None:
        saved = (
            f"checkpoint {result.checkpoint}" if result.checkpoint else "no checkpoint yet, so it starts from step 0"
        )
        _print_safely(
            f"miles: stopped by {result.stopped_by} after step {result.steps_done} of {result.num_steps}; {saved}. "
            f"Continue with: {continue_cmd}"
        )
        return 130
    logger.info("done: run directory %s, final checkpoint %s", run_dir, result.checkpoint)
    return 0


def _setup_logging() -> None:
    """Console: INFO from Miles (lifecycle lines), WARNING from everything else; per-step DEBUG lines go to the
    run's ``train.log`` only (see ``miles.recipes.run``)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.INFO)
    logging.getLogger("miles").setLevel(logging.INFO)


def command_prefix() -> str:
    """``"uv run "`` when this process was started by ``uv run`` (so a printed command works as typed), else ""."""
    return "uv run " if os.environ.get("UV_RUN_RECURSION_DEPTH") else ""


def _print_safely(line: str) -> None:
    """The last line of an interrupted run, on stderr; a console that went away (``| tee`` killed by the same
    Ctrl-C) is no error: ``train.log`` says how the run ended."""
    try:
        print(line, file=sys.stderr)  # noqa: T201
    except OSError:
        pass


def _server_start_line(err: Exception) -> str:
    """A ``ServerStartError`` (what failed, its log's last lines, the fix) as one line: what failed, the fix, and
    where the log is (kept beside the run directory)."""
    lines = str(err).splitlines()
    parts = [lines[0], *(line for line in lines if line.startswith("Fix: "))]
    logs = [line for line in lines if line.startswith("--- last lines of ")]
    if logs:
        parts.append(f"(server log: {logs[0].removeprefix('--- last lines of ').removesuffix(' ---')})")
    return " ".join(parts)


def _fail(err: Exception | str) -> int:
    """Print a user error as one ``miles:`` line on stderr; exit status 2."""
    print(f"miles: {' '.join(str(err).split())}", file=sys.stderr)  # noqa: T201
    return 2


def _with_run_name(cfg: Any, name: str) -> Any:
    """The config with ``run.name`` set, so the run's ``config.yaml`` records its (generated) name."""
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name})})


def _dir_flag(run_dir: Path) -> str:
    return "" if run_dir.parent == Path("runs") else f" --run.dir {run_dir.parent}"


def resolve_eval_config(checkpoint: str | None, recipe: str | None, override_args: list[str]) -> Any:
    """The config ``miles eval`` evaluates: the checkpoint's stored one (or ``recipe``'s, when given) with the
    overrides on top, and with a checkpoint its ``model/`` as ``models.policy.path``.

    Raises: ValueError naming the flag and the fix.
    """
    from miles.recipes.checkpoint import checkpoint_in

    diffusion = ValueError(
        "miles eval evaluates LLM runs; a diffusion run evaluates itself: eval/reward in its metrics.jsonl, the "
        "images in its samples/ (--eval.interval N sets how often)"
    )
    if checkpoint is None:
        cfg = resolve_config(recipe or DEFAULT_RECIPE, override_args)
        if not hasattr(cfg, "models"):
            raise diffusion
        return cfg
    try:
        path = checkpoint_in(Path(checkpoint), flag="--checkpoint")
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None
    model = path / "model"
    if (model / "miles_flow.json").is_file():
        raise diffusion
    if not (model / "config.json").is_file():
        raise ValueError(
            f"--checkpoint {checkpoint}: no model/config.json there; pass a runs/<name>/checkpoints/step_N directory"
        )
    if recipe is not None:
        cfg = resolve_config(recipe, override_args)
    elif (path / "config.yaml").is_file():
        cfg = _validate(_recorded(path / "config.yaml"), override_args)
    else:
        raise ValueError(f"--checkpoint {checkpoint}: no config.yaml there; pass --recipe NAME with it")
    models = cfg.models.model_copy(update={"policy": cfg.models.policy.model_copy(update={"path": str(model)})})
    return cfg.model_copy(update={"models": models})


def _eval(checkpoint: str | None, recipe: str | None, out: str | None, rest: list[str]) -> int:
    import json
    import math
    import tempfile

    from miles.recipes.checkpoint import write_atomic
    from miles.recipes.run import RunSetupError, evaluate_model

    try:
        cfg = resolve_eval_config(checkpoint, recipe, rest)
    except ValueError as err:
        return _fail(err)
    with tempfile.TemporaryDirectory(prefix="miles-eval-") as logs:
        try:
            metrics = evaluate_model(cfg, log_dir=Path(logs))
        except RunSetupError as err:
            return _fail(err)
    finite = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
    text = json.dumps({"model": cfg.models.policy.path, **finite}, indent=2)  # NaN (nothing scored) as null
    print(text)  # noqa: T201 - CLI output
    if out is not None:
        write_atomic(Path(out), text + "\n")
    return 0


def _export(checkpoint: str, out: str, rest: list[str]) -> int:
    from miles.recipes.checkpoint import checkpoint_in, export_hf_model

    if rest:
        return _fail(f"export: unexpected arguments {rest}")
    try:
        source = checkpoint_in(Path(checkpoint), flag="--checkpoint")
        path = export_hf_model(source, Path(out))
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        return _fail(err)
    logger.info("exported %s to %s", source, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
