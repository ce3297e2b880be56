"""Build the components of a run from a validated ``MilesConfig`` and drive the loop."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import yaml
from miles.core.loop import Components, train_sync
from miles.core.plugins import load_plugin
from miles.core.protocols import DataSource, RewardFn
from miles.core.rewards import TimeLimitedReward
from miles.recipes.checkpoint import restore_run_checkpoint, save_run_checkpoint, write_atomic
from miles.recipes.config import MilesConfig
from miles.recipes.registry import resolve_model_path
from miles.recipes.sinks import ConsoleSink, JsonlSink, MultiSink, plot_rewards
from miles.rollout.config import DataConfig, RewardConfig

logger = logging.getLogger(__name__)


def build_data_source(data: DataConfig, *, evaluation: bool = False) -> DataSource:
    """The training (or held-out eval, with ``data.eval_seed``) data source of a data section."""
    from miles.rollout.data import FileSource, ReasoningGymSource

    seed = data.eval_seed if evaluation else data.seed
    system_prompt = data.system_prompt or None
    if data.source == "reasoning_gym":
        return ReasoningGymSource(
            data.task,
            size=data.size,
            seed=seed,
            task_kwargs=data.task_kwargs,
            system_prompt=system_prompt,
            prompt_suffix=data.prompt_suffix,
        )
    return FileSource(
        data.path,
        prompt_key=data.prompt_key,
        label_key=data.label_key,
        seed=seed,
        system_prompt=system_prompt,
        prompt_suffix=data.prompt_suffix,
        bad_rows=data.bad_rows,
    )


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


def algorithm_models(cfg: MilesConfig, model_path: Path) -> dict[str, Path | None]:
    """The teacher and critic model directories the algorithm needs (registered names resolved), as backend kwargs."""
    from miles.core.algorithms.advantages import CRITIC_ESTIMATORS

    algorithm = cfg.algorithm
    teacher = resolve_model_path(algorithm.teacher_path) if algorithm.teacher_path else None
    critic = None
    if algorithm.advantage_estimator in CRITIC_ESTIMATORS and not algorithm.advantage_estimator_path:
        critic = resolve_model_path(algorithm.critic_path) if algorithm.critic_path else model_path
    return {"teacher_path": teacher, "critic_path": critic}


def run(cfg: MilesConfig, run_dir: Path, *, resume_from: Path | None = None) -> Path:
    """Train per ``cfg``, writing ``config.yaml``, ``metrics.jsonl``, checkpoints and ``reward.png`` to run_dir.

    Args:
        cfg: the validated config.
        run_dir: the run directory (created if missing).
        resume_from: a checkpoint directory to continue from exactly: weights, optimizer, scheduler, data
            position, RNG states and weight version are restored, and training runs the remaining steps up to
            ``loop.num_steps``; ``metrics.jsonl`` rows after the checkpoint's step are dropped.
    Returns: the final checkpoint directory.
    """
    from miles.rollout.engines import EmbeddedEngine
    from miles.rollout.generate import ChatRollout
    from miles.rollout.sft import SFTRollout
    from miles.sync import InProcessTransport, WeightSender
    from miles.train import FSDP2Backend
    from transformers import AutoTokenizer

    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    # Everything is validated; now build (the order puts cheap failures first).
    reward_fn = build_reward(cfg.reward)
    data_source = build_data_source(cfg.data)
    eval_prompts = build_data_source(cfg.data, evaluation=True).next_prompts(cfg.eval.num_prompts)
    model_path = resolve_model_path(cfg.model.path)
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
        algorithm=cfg.algorithm,
        temperature=cfg.rollout.sampling.temperature,
        max_new_tokens=cfg.rollout.sampling.max_new_tokens,
        **algorithm_models(cfg, model_path),
    )
    sender = WeightSender(InProcessTransport(engine.receiver))
    logger.info(
        "loaded %s (engine %s, trainer %s) in %.1fs",
        model_path,
        cfg.engine.dtype,
        cfg.train.dtype,
        time.perf_counter() - t0,
    )
    checkpoints = run_dir / "checkpoints"
    final: list[Path] = []
    start_step = 0
    if resume_from is not None:  # last: building the models above consumed RNG draws the checkpoint must undo
        state = restore_run_checkpoint(resume_from, backend=backend, data_source=data_source)
        start_step = state.step
        if state.weight_version > 0:  # the engine starts from model.path: give it the checkpoint's weights
            sender.version = state.weight_version - 1  # so this push publishes the checkpoint's version
            sender.push(backend.export_weights())
        _drop_metrics_after(run_dir / "metrics.jsonl", start_step)
        final.append(Path(resume_from))
        logger.info("resumed from %s at step %d (weights v%d)", resume_from, start_step, engine.weight_version)
    sink = MultiSink(
        JsonlSink(run_dir / "metrics.jsonl"),
        ConsoleSink(cfg.loop.num_steps, initial=start_step, enabled=cfg.run.progress),
    )
    config_dict = cfg.model_dump(mode="json")

    def save(step: int) -> None:
        t_save = time.perf_counter()
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

    components = Components(
        data_source=data_source,
        rollout_fn=(
            SFTRollout(tokenizer)
            if cfg.rollout.mode == "sft"
            else ChatRollout(engine, tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens)
        ),
        reward_fn=reward_fn,
        backend=backend,
        weight_pusher=sender,
        sink=sink,
        eval_prompts=eval_prompts,
        save_checkpoint=save,
    )
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        with logging_redirect_tqdm():  # log lines print above the progress bar instead of through it
            train_sync(
                components,
                loop=cfg.loop,
                rollout=cfg.rollout,
                algorithm=cfg.algorithm,
                evaluation=cfg.eval,
                start_step=start_step,
            )
    finally:
        sink.close()
        if (run_dir / "metrics.jsonl").stat().st_size:
            plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png")
    return final[-1]


def _drop_metrics_after(path: Path, step: int) -> None:
    """Keep only the ``metrics.jsonl`` rows up to ``step`` (a crashed run may have logged steps past its
    last checkpoint; the resumed run logs them again)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        write_atomic(path, "".join(kept))
