"""Build the components of a run from a validated ``MilesConfig`` and drive the loop.

Validation is pure; everything that reads the disk or imports user code is checked here, first and cheaply
(``build_inputs``): model paths, data files, reward and algorithm plugins."""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from miles.core.algorithms.config import load_algorithm_plugins
from miles.core.loop import Components, train_sync
from miles.core.plugins import load_plugin
from miles.core.protocols import DataSource, RewardFn
from miles.core.rewards import TimeLimitedReward
from miles.recipes.checkpoint import restore_run_checkpoint, save_run_checkpoint, write_atomic
from miles.recipes.config import MilesConfig
from miles.recipes.interrupts import StopRequest
from miles.recipes.registry import check_model_path, resolve_model_path
from miles.recipes.sinks import ConsoleSink, JsonlSink, MultiSink, plot_rewards
from miles.rollout.config import DataConfig, RewardConfig

logger = logging.getLogger(__name__)

LOG_FILE = "train.log"


class RunSetupError(Exception):
    """A user-caused problem found while building a run (a bad data file, reward plugin, ...): one line that
    names the config key and the fix. Nothing has been written to the run directory when it is raised."""


@dataclass(frozen=True)
class RunResult:
    """How a run ended.

    Attributes:
        run_dir: the run directory.
        steps_done: completed training steps.
        num_steps: ``loop.num_steps`` of the run.
        checkpoint: the newest checkpoint directory, or None if none was written.
        stopped_by: the signal that stopped the run early ("SIGINT", "SIGTERM"), or None.
    """

    run_dir: Path
    steps_done: int
    num_steps: int
    checkpoint: Path | None
    stopped_by: str | None = None


def build_data_sources(data: DataConfig, *, num_eval_prompts: int) -> tuple[DataSource, DataSource | None]:
    """The training data source of a data section and its held-out eval source (None when no eval).

    A reasoning-gym task draws eval entries with ``data.eval_seed``. A file source evaluates on
    ``data.eval_path``, or, without one, on ``num_eval_prompts`` rows of ``data.path`` held out of training.
    Raises: ValueError naming ``data.path`` / ``data.eval_path`` when it is not a file; as ``FileSource`` /
        ``ReasoningGymSource`` (ValueError, FileNotFoundError naming the key).
    """
    from miles.rollout.data import FileSource, ReasoningGymSource

    if data.source == "file":
        for key, value in (("path", data.path), ("eval_path", data.eval_path)):
            if value and not Path(value).expanduser().is_file():
                raise ValueError(
                    f"data.{key} is {value!r}, which is not a file (relative paths start at the current directory "
                    f"{Path.cwd()}); pass --data.{key.replace('_', '-')} /path/to/file.jsonl"
                )
    system_prompt = data.system_prompt or None
    if data.source == "reasoning_gym":

        def task(seed: int) -> ReasoningGymSource:
            return ReasoningGymSource(
                data.task,
                size=data.size,
                seed=seed,
                task_kwargs=data.task_kwargs,
                system_prompt=system_prompt,
                prompt_suffix=data.prompt_suffix,
            )

        return task(data.seed), (task(data.eval_seed) if num_eval_prompts else None)

    def file(path: str, *, seed: int, key: str, num_heldout: int = 0) -> FileSource:
        return FileSource(
            path,
            prompt_key=data.prompt_key,
            label_key=data.label_key,
            seed=seed,
            system_prompt=system_prompt,
            prompt_suffix=data.prompt_suffix,
            bad_rows=data.bad_rows,
            num_heldout=num_heldout,
            key=key,
        )

    if data.eval_path or not num_eval_prompts:
        train = file(data.path, seed=data.seed, key="data.path")
        heldout = file(data.eval_path, seed=data.eval_seed, key="data.eval_path") if num_eval_prompts else None
        return train, heldout
    train = file(data.path, seed=data.seed, key="data.path", num_heldout=num_eval_prompts)
    logger.info(
        "evaluating on %d rows of %s held out of training (set --data.eval-path for a separate eval file)",
        num_eval_prompts,
        Path(data.path).name,
    )
    return train, train.heldout_source(seed=data.eval_seed)


def build_reward(reward: RewardConfig) -> RewardFn:
    """The reward function a reward section names, time-limited if ``reward.timeout_s`` is set."""
    from miles.rollout.rewards import math_reward, reasoning_gym_reward

    if reward.type == "reasoning_gym":
        reward_fn = reasoning_gym_reward
    elif reward.type == "math":
        reward_fn = math_reward
    else:
        reward_fn = load_plugin(reward.path, key="reward.path", num_positional=1)
    return TimeLimitedReward(reward_fn, timeout_s=reward.timeout_s) if reward.timeout_s else reward_fn


def model_paths(cfg: MilesConfig) -> dict[str, str]:
    """The model paths a run loads, by dotted key: the policy and, as the config holds them, reference (a set
    path, while KL is on), critic (a set path) and teacher."""
    models = cfg.models
    paths = {"models.policy.path": models.policy.path}
    if cfg.algorithm.kl is not None and models.reference.path:
        paths["models.reference.path"] = models.reference.path
    if models.critic is not None and models.critic.path:
        paths["models.critic.path"] = models.critic.path
    if models.teacher is not None:
        paths["models.teacher.path"] = models.teacher.path
    return paths


def algorithm_models(cfg: MilesConfig, model_path: Path) -> dict[str, object]:
    """The models the algorithm needs, as backend kwargs: the reference (while ``algorithm.kl`` is on; the initial
    policy unless ``models.reference.path``), the teacher and critic directories (registered names resolved; an
    empty critic path is the policy) and their settings."""
    models = cfg.models

    def resolve(key: str, path: str) -> Path:
        return resolve_model_path(path, key=key) if path else model_path

    kwargs: dict[str, object] = {}
    if cfg.algorithm.kl is not None:
        kwargs["reference_path"] = resolve("models.reference.path", models.reference.path)
    if models.teacher is not None:
        kwargs["teacher_path"] = resolve("models.teacher.path", models.teacher.path)
        kwargs["teacher_temperature"] = models.teacher.temperature
    if models.critic is not None:
        kwargs["critic_path"] = resolve("models.critic.path", models.critic.path)
        kwargs["critic_lr"] = models.critic.lr
    return kwargs


def build_inputs(cfg: MilesConfig) -> tuple[RewardFn, DataSource, list]:
    """The user-supplied parts of a run, checked and built first because they fail cheaply: model paths exist,
    algorithm plugins import with the right signatures; then (reward function, training data source, eval
    prompts).

    Raises: RunSetupError with one line naming the key and the fix (a model path that is neither registered nor
        an HF directory, a bad data file or row, a plugin that does not import or has the wrong signature, ...).
    """
    try:
        for key, path in model_paths(cfg).items():
            check_model_path(path, key=key)
        load_algorithm_plugins(cfg.algorithm)
        reward_fn = build_reward(cfg.reward)
        data_source, eval_source = build_data_sources(cfg.data, num_eval_prompts=cfg.eval.num_prompts)
        eval_prompts = eval_source.next_prompts(cfg.eval.num_prompts) if eval_source is not None else []
    except (ValueError, TypeError, ImportError, AttributeError, OSError) as err:
        raise RunSetupError(" ".join(str(err).split())) from err
    return reward_fn, data_source, eval_prompts


def run(
    cfg: MilesConfig, run_dir: Path, *, resume_from: Path | None = None, replace_existing: bool = False
) -> RunResult:
    """Train per ``cfg``, writing ``config.yaml``, ``metrics.jsonl``, ``train.log``, checkpoints and
    ``reward.png`` to run_dir.

    Nothing is written to ``run_dir`` until every component is built. During the loop the first Ctrl-C/SIGTERM
    finishes the current step, saves a checkpoint and returns; a second one raises KeyboardInterrupt at once
    (the run continues from its last checkpoint).

    Args:
        cfg: the validated config.
        run_dir: the run directory (created if missing).
        resume_from: a checkpoint directory to continue from exactly: weights, optimizer, scheduler, data
            position, RNG states and weight version are restored, and training runs the remaining steps up to
            ``loop.num_steps``; ``metrics.jsonl`` rows after the checkpoint's step are dropped.
        replace_existing: delete what ``run_dir`` holds (once the build succeeded) and start it from step 0.
    Returns: how the run ended (``RunResult``).
    Raises: RunSetupError for a user-caused build problem (see ``build_inputs``); KeyboardInterrupt on a
        second signal.
    """
    from miles.core.publisher import EnginePublisher
    from miles.rollout.engines import EmbeddedEngine
    from miles.rollout.generate import ChatRollout
    from miles.rollout.sft import SFTRollout
    from miles.sync import InProcessTransport, WeightSender
    from miles.train import FSDP2Backend
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Loading weights" bars; the console sink owns the progress bar
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    with _run_log(run_dir) as start_log:
        # Everything is validated; now build (the order puts cheap failures first).
        reward_fn, data_source, eval_prompts = build_inputs(cfg)
        model_path = resolve_model_path(cfg.models.policy.path, key="models.policy.path")
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        engine = EmbeddedEngine(
            model_path,
            dtype=cfg.engine.dtype,
            max_batch_size=cfg.engine.max_batch_size,
            logprob_mode=cfg.engine.logprob_mode,
        )
        backend = FSDP2Backend(
            model_path,
            train=cfg.train,
            temperature=cfg.rollout.sampling.temperature,
            weight_sink=WeightSender(InProcessTransport(engine.receiver)),
            **algorithm_models(cfg, model_path),
        )
        publisher = EnginePublisher(backend, [engine])
        logger.info(
            "loaded %s (engine %s, trainer %s) in %.1fs",
            model_path,
            cfg.engine.dtype,
            cfg.train.dtype,
            time.perf_counter() - t0,
        )
        # Built: from here on the run directory is written.
        if replace_existing:
            _remove_run_dir(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        start_log()
        write_atomic(run_dir / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        checkpoints = run_dir / "checkpoints"
        final: list[Path] = []
        start_step = 0
        if resume_from is not None:  # last: building the models above consumed RNG draws the checkpoint must undo
            state = restore_run_checkpoint(resume_from, backend=backend, data_source=data_source)
            start_step = state.step
            if state.weight_version > 0:  # the engine starts from models.policy.path: give it the checkpoint's weights
                publisher = EnginePublisher(backend, [engine], version=state.weight_version - 1)
                publisher.publish()  # as the checkpoint's version; the next step's publish continues from it
            _drop_metrics_after(run_dir / "metrics.jsonl", start_step)
            final.append(Path(resume_from))
            logger.info("resumed from %s at step %d (weights v%d)", resume_from, start_step, engine.weight_version)
        console = ConsoleSink(cfg.loop.num_steps, initial=start_step, enabled=cfg.run.progress)
        sink = MultiSink(JsonlSink(run_dir / "metrics.jsonl"), console)
        config_dict = cfg.model_dump(mode="json")
        stop = StopRequest()

        def save(step: int) -> None:
            t_save = time.perf_counter()
            with stop.protect():
                final.append(
                    save_run_checkpoint(
                        checkpoints,
                        step,
                        backend=backend,
                        data_source=data_source,
                        weight_version=engine.weight_version,
                        config=config_dict,
                        tokenizer=tokenizer,
                        keep=cfg.loop.keep_checkpoints,
                    )
                )
            logger.info("saved checkpoint %s in %.2fs", final[-1], time.perf_counter() - t_save)

        if cfg.rollout.mode == "sft":  # reference answers, no generation: a batch function is enough
            rollout_fn, generate_group = SFTRollout(tokenizer), None
        else:  # training rollouts per prompt into the buffer; eval through the batch form of the same rollout
            chat = ChatRollout(engine, tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens)
            rollout_fn, generate_group = chat, chat.generate_group
        components = Components(
            data_source=data_source,
            rollout_fn=rollout_fn,
            generate_group=generate_group,
            reward_fn=reward_fn,
            backend=backend,
            publisher=publisher,
            sink=sink,
            eval_prompts=eval_prompts,
            save_checkpoint=save,
            should_stop=stop,
            progress=console.eval_bar if cfg.run.progress else None,
        )
        from tqdm.contrib.logging import logging_redirect_tqdm

        root = logging.getLogger()
        console_level = min(
            (h.level for h in root.handlers if type(h) is logging.StreamHandler), default=logging.NOTSET
        )

        try:
            with stop, logging_redirect_tqdm(), _console_level(console_level):  # log lines print above the bar
                steps_done = train_sync(
                    components,
                    loop=cfg.loop,
                    rollout=cfg.rollout,
                    algorithm=cfg.algorithm,
                    evaluation=cfg.eval,
                    critic=cfg.models.critic,
                    start_step=start_step,
                )
        finally:
            sink.close()
            if (run_dir / "metrics.jsonl").stat().st_size:
                plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png")
        if steps_done < cfg.loop.num_steps:  # the console may be gone (``| tee`` killed by the Ctrl-C): log it too
            logger.info("stopped by %s after step %d of %d", stop.requested, steps_done, cfg.loop.num_steps)
    return RunResult(
        run_dir=run_dir,
        steps_done=steps_done,
        num_steps=cfg.loop.num_steps,
        checkpoint=final[-1] if final else None,
        stopped_by=stop.requested if steps_done < cfg.loop.num_steps else None,
    )


@contextmanager
def _run_log(run_dir: Path) -> Iterator:
    """DEBUG-level log of the ``miles`` loggers into ``run_dir/train.log``; records are buffered in memory until
    the yielded ``start()`` is called (once the run directory may be written), so a failed build writes nothing.
    """
    miles_logger = logging.getLogger("miles")
    previous_level = miles_logger.level
    if miles_logger.getEffectiveLevel() > logging.DEBUG:
        miles_logger.setLevel(logging.DEBUG)  # handlers (the console's is INFO) filter what they show
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    buffer = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    miles_logger.addHandler(buffer)
    file_handler: list[logging.Handler] = []

    def start() -> None:
        handler = logging.FileHandler(run_dir / LOG_FILE, encoding="utf-8")
        handler.setFormatter(formatter)
        handler.setLevel(logging.DEBUG)
        buffer.setTarget(handler)
        buffer.flush()
        miles_logger.removeHandler(buffer)
        miles_logger.addHandler(handler)
        file_handler.append(handler)

    try:
        yield start
    finally:
        miles_logger.removeHandler(buffer)
        buffer.close()
        for handler in file_handler:
            miles_logger.removeHandler(handler)
            handler.close()
        miles_logger.setLevel(previous_level)


@contextmanager
def _console_level(level: int) -> Iterator[None]:
    """Give tqdm's console handlers (``logging_redirect_tqdm`` swaps them in without the level) the level of the
    handlers they replace, so the DEBUG lines meant for ``train.log`` stay off the console."""
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "_TqdmLoggingHandler":
            handler.setLevel(level)
    yield


def _remove_run_dir(run_dir: Path) -> None:
    """Delete a run directory: renamed aside first (atomic), so a crash never leaves half of it."""
    if not run_dir.exists():
        return
    trash = run_dir.with_name(f".{run_dir.name}.trash-{os.getpid()}")
    os.replace(run_dir, trash)
    shutil.rmtree(trash, ignore_errors=True)
    logger.info("removed the previous contents of %s", run_dir)


def _drop_metrics_after(path: Path, step: int) -> None:
    """Keep only the ``metrics.jsonl`` rows up to ``step`` (a crashed run may have logged steps past its
    last checkpoint; the resumed run logs them again)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        write_atomic(path, "".join(kept))
