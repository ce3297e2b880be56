"""Build the components of a run from a validated ``MilesConfig`` and drive the loop."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import yaml
from miles.core.loop import Components, train_sync
from miles.core.plugins import load_plugin
from miles.core.protocols import DataSource, RewardFn
from miles.recipes.checkpoint import save_run_checkpoint
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
    )


def build_reward(reward: RewardConfig) -> RewardFn:
    """The reward function a reward section names."""
    from miles.rollout.rewards import math_reward, reasoning_gym_reward

    if reward.type == "reasoning_gym":
        return reasoning_gym_reward
    if reward.type == "math":
        return math_reward
    return load_plugin(reward.path, key="reward.path", num_positional=1)


def algorithm_models(cfg: MilesConfig, model_path: Path) -> dict[str, Path | None]:
    """The teacher and critic model directories the algorithm needs (registered names resolved), as backend kwargs."""
    from miles.core.algorithms.advantages import CRITIC_ESTIMATORS

    algorithm = cfg.algorithm
    teacher = resolve_model_path(algorithm.teacher_path) if algorithm.teacher_path else None
    critic = None
    if algorithm.advantage_estimator in CRITIC_ESTIMATORS and not algorithm.advantage_estimator_path:
        critic = resolve_model_path(algorithm.critic_path) if algorithm.critic_path else model_path
    return {"teacher_path": teacher, "critic_path": critic}


def run(cfg: MilesConfig, run_dir: Path) -> Path:
    """Train per ``cfg``, writing ``config.yaml``, ``metrics.jsonl``, checkpoints and ``reward.png`` to run_dir.

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
    _write_atomic(run_dir / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
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
    sink = MultiSink(JsonlSink(run_dir / "metrics.jsonl"), ConsoleSink(cfg.loop.num_steps, enabled=cfg.run.progress))
    checkpoints = run_dir / "checkpoints"
    final: list[Path] = []

    def save(step: int) -> None:
        final.append(
            save_run_checkpoint(
                checkpoints, step, backend=backend, data_source=data_source, weight_version=engine.weight_version
            )
        )
        logger.info("saved checkpoint %s", final[-1])

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
    try:
        train_sync(components, loop=cfg.loop, rollout=cfg.rollout, algorithm=cfg.algorithm, evaluation=cfg.eval)
    finally:
        sink.close()
        if (run_dir / "metrics.jsonl").stat().st_size:
            plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png")
    tokenizer.save_pretrained(final[-1] / "model")
    return final[-1]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
