"""The synchronous training loop, as DESIGN.md section 4 states it:
rollout -> reward -> advantages -> train -> push weights -> eval -> save."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from miles.core.algorithms.advantages import compute_advantages
from miles.core.batch import TrainBatch, build_train_batch
from miles.core.config import AlgorithmConfig, EvalConfig, LoopConfig, RolloutConfig
from miles.core.protocols import DataSource, MetricsSink, RewardFn, RolloutFn, TrainBackend, WeightPusher
from miles.core.rewards import score_samples
from miles.core.sample import Sample, SampleStatus

logger = logging.getLogger(__name__)

# Token id written into padding; attention masks hide it, so any valid id works.
PAD_TOKEN_ID = 0


@dataclass
class Components:
    """Everything the loop drives, built by the caller (the recipes CLI or a user script)."""

    data_source: DataSource
    rollout_fn: RolloutFn
    reward_fn: RewardFn
    backend: TrainBackend
    weight_pusher: WeightPusher
    sink: MetricsSink
    eval_prompts: Sequence[Sample] = ()
    save_checkpoint: Callable[[int], None] | None = None  # called with the number of completed steps


def train_sync(
    components: Components,
    *,
    loop: LoopConfig,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    evaluation: EvalConfig,
    start_step: int = 0,
) -> None:
    """Run steps ``start_step .. loop.num_steps - 1``; evaluate before the first and after the last."""
    c = components
    if evaluation.num_prompts and c.eval_prompts and start_step == 0:
        c.sink.log(evaluate(c, evaluation), step=0)
    for step in range(start_step, loop.num_steps):
        metrics = run_step(c, step=step, rollout=rollout, algorithm=algorithm)
        last = step + 1 == loop.num_steps
        if (
            c.eval_prompts
            and evaluation.num_prompts
            and (last or (evaluation.interval and (step + 1) % evaluation.interval == 0))
        ):
            metrics.update(evaluate(c, evaluation))
        c.sink.log(metrics, step=step + 1)
        if c.save_checkpoint is not None and (last or (loop.save_interval and (step + 1) % loop.save_interval == 0)):
            c.save_checkpoint(step + 1)


def run_step(c: Components, *, step: int, rollout: RolloutConfig, algorithm: AlgorithmConfig) -> dict[str, float]:
    """One rollout step: generate, score, compute advantages, train, push weights. Returns its metrics."""
    t0 = time.perf_counter()
    prompts = c.data_source.next_prompts(rollout.rollout_batch_size)
    samples = c.rollout_fn(
        prompts,
        n_samples_per_prompt=rollout.n_samples_per_prompt,
        sampling=rollout.sampling,
        seed=rollout.seed + 1_000_003 * step,
    )
    t_rollout = time.perf_counter() - t0
    num_failed = score_samples(samples, c.reward_fn)
    valid = [s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED) for s in samples]
    if not any(valid):
        reasons = {s.metadata.get("failure", s.status.value) for s in samples}
        raise RuntimeError(f"step {step}: all {len(samples)} samples failed; reasons: {sorted(reasons)[:5]}")
    rewards = torch.tensor([s.reward if v else 0.0 for s, v in zip(samples, valid)], dtype=torch.float32)
    group_index = torch.tensor([s.group_index for s in samples], dtype=torch.int64)
    valid_t = torch.tensor(valid)
    advantages = compute_advantages(
        rewards, group_index, valid_t, estimator=algorithm.advantage_estimator, eps=algorithm.advantage_eps
    )
    batch = build_train_batch(samples, advantages, pad_token_id=PAD_TOKEN_ID, trained=valid)

    t1 = time.perf_counter()
    train_metrics = _train_on(c.backend, batch, rollout.steps_per_rollout)
    t_train = time.perf_counter() - t1

    t2 = time.perf_counter()
    version = c.weight_pusher.push(c.backend.export_weights())
    t_sync = time.perf_counter() - t2

    metrics = rollout_metrics(samples, rewards[valid_t])
    num_response_tokens = sum(s.response_length for s in samples)
    num_tokens = sum(len(s.tokens) for s in samples)
    metrics.update(train_metrics)
    metrics.update(
        {
            "advantages/mean": float(advantages[valid_t].mean()),
            "samples/failed": float(num_failed),
            "weight_version": float(version),
            "time/rollout": t_rollout,
            "time/train": t_train,
            "time/sync": t_sync,
            "time/step": time.perf_counter() - t0,
            "throughput/rollout_tokens_per_s": num_response_tokens / max(t_rollout, 1e-9),
            "throughput/train_tokens_per_s": num_tokens / max(t_train, 1e-9),
        }
    )
    return metrics


def _train_on(backend: TrainBackend, batch: TrainBatch, steps_per_rollout: int) -> dict[str, float]:
    """Split the rollout into ``steps_per_rollout`` optimizer steps; average their metrics."""
    if steps_per_rollout > 1:
        # Several optimizer steps per rollout: the PPO denominator must be the pre-update policy.
        batch = backend.compute_log_probs(batch)
    size = batch.batch_size // steps_per_rollout
    per_step = [backend.train_step(batch.slice(i * size, (i + 1) * size)) for i in range(steps_per_rollout)]
    return {k: statistics.fmean(m[k] for m in per_step) for k in per_step[0]}


def rollout_metrics(samples: Sequence[Sample], valid_rewards: torch.Tensor) -> dict[str, float]:
    """reward/mean, reward/std, response_length/mean, truncated_ratio over one rollout."""
    lengths = [s.response_length for s in samples]
    return {
        "reward/mean": float(valid_rewards.mean()),
        "reward/std": float(valid_rewards.std(unbiased=False)),
        "response_length/mean": statistics.fmean(lengths),
        "truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
    }


def evaluate(c: Components, evaluation: EvalConfig) -> dict[str, float]:
    """Generate on the fixed eval prompts with the eval sampling settings; mean reward as ``eval/reward``."""
    t0 = time.perf_counter()
    samples = c.rollout_fn(
        list(c.eval_prompts)[: evaluation.num_prompts],
        n_samples_per_prompt=evaluation.n_samples_per_prompt,
        sampling=evaluation.sampling,
        seed=0,  # the same seed every time: evaluations differ only by the weights
    )
    num_failed = score_samples(samples, c.reward_fn)
    rewards = [s.reward for s in samples if s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)]
    return {
        "eval/reward": statistics.fmean(rewards) if rewards else float("nan"),
        "eval/response_length": statistics.fmean(s.response_length for s in samples),
        "eval/failed": float(num_failed),
        "time/eval": time.perf_counter() - t0,
    }
