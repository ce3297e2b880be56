"""The synchronous training loop, as DESIGN.md section 4 states it:
rollout -> reward -> filter -> advantages -> (ref/old log-probs) -> train -> push weights -> eval -> save."""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from miles.core.algorithms.advantages import AdvantageInputs, AdvantageParams, compute_advantages
from miles.core.algorithms.config import load_algorithm_plugins
from miles.core.algorithms.masking import (
    has_trainable_tokens,
    overlong_filter_keep,
    overlong_penalty,
    response_mask,
)
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.batch import TrainBatch, build_train_batch
from miles.core.buffer import RolloutGroups, collect_groups
from miles.core.config import AlgorithmConfig, CriticConfig, EvalConfig, LoopConfig, RolloutConfig, check_group_size
from miles.core.logs import warn_once
from miles.core.plugins import load_plugin
from miles.core.protocols import (
    DataSource,
    GroupGenerateFn,
    MetricsSink,
    ProgressBar,
    RewardFn,
    RolloutFn,
    TrainBackend,
    WeightPublisher,
)
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
    publisher: WeightPublisher  # trainer weights -> engines, one version per step
    sink: MetricsSink
    eval_prompts: Sequence[Sample] = ()
    save_checkpoint: Callable[[int], None] | None = None  # called with the number of completed steps
    # Polled between steps; True ends the run early (a Ctrl-C/SIGTERM asked for a clean stop).
    should_stop: Callable[[], bool] = lambda: False
    # Opens a bar over an evaluation's number of samples; the rollout function then gets ``on_finished`` (it must
    # accept it). None: no eval progress, and the rollout function is called without it.
    progress: Callable[[int], ProgressBar] | None = None
    # Training rollouts one prompt at a time (the producer / buffer path an async loop uses); None: ``rollout_fn``
    # serves them too, adapted to groups (``RolloutGroups``: one batch call per round). Evaluation uses rollout_fn.
    generate_group: GroupGenerateFn | None = None


def train_sync(
    components: Components,
    *,
    loop: LoopConfig,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    evaluation: EvalConfig,
    critic: CriticConfig | None = None,
    start_step: int = 0,
) -> int:
    """Run steps ``start_step .. loop.num_steps - 1``; evaluate before the first and after the last.

    Checkpoints are saved every ``loop.save_interval`` steps, after the last, and after the step during which
    ``components.should_stop()`` became True; the run then ends there (without the final eval). ``critic`` is the
    ``models.critic`` section (its value clip), for an estimator that trains a critic.
    Returns: the number of completed steps (``loop.num_steps`` unless stopped early).
    Raises: before anything runs: ValueError if ``algorithm`` needs groups of >= 2 samples and ``rollout`` has one
        (``check_group_size``, the rule the root config also applies); ImportError/AttributeError/TypeError naming
        the key of a plugin that does not load or has the wrong signature.
    """
    check_group_size(rollout, algorithm)
    load_algorithm_plugins(algorithm)
    c = components
    objective = PolicyObjective(algorithm, max_new_tokens=rollout.sampling.max_new_tokens, critic=critic)
    if evaluation.num_prompts and c.eval_prompts and start_step == 0:
        c.sink.log(evaluate(c, evaluation), step=0)
    for step in range(start_step, loop.num_steps):
        if c.should_stop():  # asked before this step began (e.g. during the step-0 eval): nothing new to save
            return step
        metrics = run_step(c, step=step, rollout=rollout, algorithm=algorithm, objective=objective)
        last = step + 1 == loop.num_steps
        if (
            c.eval_prompts
            and evaluation.num_prompts
            and (last or (evaluation.interval and (step + 1) % evaluation.interval == 0))
        ):
            metrics.update(evaluate(c, evaluation))
        c.sink.log(metrics, step=step + 1)
        stop = not last and c.should_stop()
        periodic = loop.save_interval and (step + 1) % loop.save_interval == 0
        if c.save_checkpoint is not None and (last or periodic or stop):
            c.save_checkpoint(step + 1)
        if stop:
            return step + 1
    return loop.num_steps


def run_step(
    c: Components,
    *,
    step: int,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    objective: PolicyObjective | None = None,
) -> dict[str, float]:
    """One rollout step: generate (+ dynamic sampling), score, shape, advantages, train, publish weights.

    ``objective`` is built from ``algorithm`` when not given (``train_sync`` builds it once per run; an estimator
    with a critic needs it given).
    """
    if objective is None:
        objective = PolicyObjective(algorithm, max_new_tokens=rollout.sampling.max_new_tokens)
    t0 = time.perf_counter()
    samples, num_failed, filter_metrics = collect_samples(c, step=step, rollout=rollout, algorithm=algorithm)
    t_rollout = time.perf_counter() - t0
    scored = [s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED) for s in samples]
    if not any(scored):
        reasons = {s.metadata.get("failure", s.status.value) for s in samples}
        raise RuntimeError(f"step {step}: all {len(samples)} samples failed; reasons: {sorted(reasons)[:5]}")
    scores = torch.tensor([s.reward if v else 0.0 for s, v in zip(samples, scored)], dtype=torch.float32)
    rewards = shape_rewards(samples, scores, rollout=rollout, algorithm=algorithm)
    # Valid = enters the group statistics of the advantages (see AdvantageInputs.valid): scored and with a
    # trainable token of its own, so that a sample of only tool tokens does not shift its siblings' advantages.
    valid = [v and t for v, t in zip(scored, has_trainable_tokens(samples))]
    trained = scored
    if algorithm.overlong.filter:  # truncated samples stay in their group's statistics but are not trained
        trained = [v and keep for v, keep in zip(scored, overlong_filter_keep(samples))]
    valid_t = torch.tensor(valid)
    batch = build_train_batch(samples, torch.zeros(len(samples)), pad_token_id=PAD_TOKEN_ID, trained=trained)
    advantage, kl = algorithm.advantage, algorithm.kl
    estimator = advantage.estimator
    if advantage.estimator_path:
        estimator = load_plugin(advantage.estimator_path, key="algorithm.advantage.estimator_path")
    kl_in_reward = kl is not None and kl.mode == "reward"
    outputs = objective.advantage_outputs(c.backend.available_outputs)
    if outputs:  # old/ref/teacher log-probs and critic values, as the estimator needs them
        batch = c.backend.forward(batch, outputs=outputs)
    inputs = AdvantageInputs(
        rewards=rewards,
        group_index=torch.tensor([s.group_index for s in samples], dtype=torch.int64),
        valid=valid_t,
        loss_mask=batch.loss_mask,
        response_mask=response_mask(batch.response_lengths, batch.loss_mask.shape[1]),
        old_log_probs=batch.old_log_probs,
        ref_log_probs=batch.ref_log_probs,
        teacher_log_probs=batch.teacher_log_probs,
        values=batch.values,
    )
    params = AdvantageParams(
        eps=advantage.eps,
        gamma=advantage.gamma,
        lam=advantage.lam,
        kl_coef_in_reward=kl.coef if kl_in_reward else 0.0,
        kl_estimator=kl.estimator if kl is not None else "k3",  # read only when kl_coef_in_reward > 0
    )
    advantages, returns = compute_advantages(inputs, estimator=estimator, params=params)
    batch = batch.replace(advantages=advantages, returns=returns)

    t1 = time.perf_counter()
    train_metrics = _train_on(c.backend, batch, objective, rollout.steps_per_rollout)
    t_train = time.perf_counter() - t1

    t2 = time.perf_counter()
    version = c.publisher.publish()
    t_sync = time.perf_counter() - t2

    metrics = rollout_metrics(samples, scores[torch.tensor(scored)])
    metrics.update(filter_metrics)
    metrics["groups/no_signal_ratio"] = no_signal_ratio(rewards, inputs.group_index, valid_t)
    if metrics["groups/no_signal_ratio"] == 1.0:
        warn_once(logger, NO_SIGNAL_WARNING, step + 1, int(inputs.group_index.unique().numel()), metrics["reward/mean"])
    num_response_tokens = sum(s.response_length for s in samples)
    num_tokens = sum(len(s.tokens) for s in samples)
    metrics.update(train_metrics)
    metrics.update(
        {
            "advantages/mean": float(advantages[batch.loss_mask].mean()) if batch.num_loss_tokens else 0.0,
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


def collect_samples(
    c: Components, *, step: int, rollout: RolloutConfig, algorithm: AlgorithmConfig
) -> tuple[list[Sample], int, dict[str, float]]:
    """Generate and score ``rollout_batch_size`` groups; with dynamic sampling, keep only groups that pass the
    filter (default: rewards not all equal) and generate more, for at most ``dynamic_sampling.max_rounds`` rounds.

    Samples come in prompt order, numbered by position (``miles.core.buffer.collect_groups``), and each is sampled
    with the seed of its position in its round, whatever order the groups complete in.
    Returns: (samples, number of failed samples (ABORTED ones are not), filter metrics:
        dynamic_sampling/{rounds, filtered_groups}).
    Raises: RuntimeError naming the counts when dynamic sampling cannot fill the batch in its rounds.
    """
    dynamic = algorithm.dynamic_sampling
    group_filter = _keeps_signal
    if dynamic is not None and dynamic.filter_path:
        group_filter = load_plugin(dynamic.filter_path, key="algorithm.dynamic_sampling.filter_path")
    num_rounds = dynamic.max_rounds if dynamic is not None else 1
    kept: list[list[Sample]] = []
    num_failed = num_filtered = 0
    for round_index in range(num_rounds):
        missing = rollout.rollout_batch_size - len(kept)
        num_prompts = missing if round_index == 0 else math.ceil(missing * dynamic.over_sample)
        # The parts of the async loop with a buffer of one round: a producer runs the group-generate function per
        # prompt (or the batch rollout function, adapted: one call per round) into a bounded buffer; groups come back
        # in prompt order.
        seed = rollout.seed + 1_000_003 * step + 7_919 * round_index
        groups = asyncio.run(
            collect_groups(
                c.data_source.next_prompts(num_prompts),
                c.generate_group or RolloutGroups(c.rollout_fn, seed=seed),
                n_samples_per_prompt=rollout.n_samples_per_prompt,
                sampling=rollout.sampling,
                seed=seed,
            )
        )
        samples = [s for group in groups for s in group]
        num_failed += score_samples(samples, c.reward_fn)
        if dynamic is None:
            return samples, num_failed, {}
        for group in groups:
            if len(kept) < rollout.rollout_batch_size and group_filter(group):
                kept.append(group)
            else:
                num_filtered += 1
        if len(kept) == rollout.rollout_batch_size:
            samples = [s for group in kept for s in group]
            for i, sample in enumerate(samples):
                sample.index = i
            metrics = {
                "dynamic_sampling/rounds": float(round_index + 1),
                "dynamic_sampling/filtered_groups": num_filtered,
            }
            return samples, num_failed, metrics
    logger.warning("step %d: dynamic sampling kept %d groups, filtered %d", step, len(kept), num_filtered)
    raise RuntimeError(
        f"step {step}: dynamic sampling kept {len(kept)} of rollout.rollout_batch_size={rollout.rollout_batch_size} "
        f"groups after algorithm.dynamic_sampling.max_rounds={num_rounds} generation rounds ({num_filtered} groups "
        "filtered: all rewards equal, so no learning signal). The task is too easy or too hard for the model: raise "
        "--algorithm.dynamic-sampling.max-rounds or --algorithm.dynamic-sampling.over-sample, raise "
        "--rollout.n-samples-per-prompt, or pick a task of fitting difficulty."
    )


def _keeps_signal(group: Sequence[Sample]) -> bool:
    """Default dynamic-sampling filter: at least two valid samples with different rewards."""
    rewards = {s.reward for s in group if s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)}
    return len(rewards) > 1


def shape_rewards(
    samples: Sequence[Sample], scores: torch.Tensor, *, rollout: RolloutConfig, algorithm: AlgorithmConfig
) -> torch.Tensor:
    """Scores [B] float32 -> rewards [B] float32: DAPO overlong penalty, then the reward post-process plugin."""
    rewards, overlong = scores, algorithm.overlong
    if overlong.buffer_len:
        lengths = torch.tensor([s.response_length for s in samples], dtype=torch.int64)
        rewards = rewards + overlong_penalty(
            lengths,
            max_length=rollout.sampling.max_new_tokens,
            buffer_length=overlong.buffer_len,
            factor=overlong.penalty_factor,
        )
    if algorithm.reward_post_process_path:
        post_process = load_plugin(algorithm.reward_post_process_path, key="algorithm.reward_post_process_path")
        rewards = post_process(list(samples), rewards)
    return rewards


def _train_on(
    backend: TrainBackend, batch: TrainBatch, objective: PolicyObjective, steps_per_rollout: int
) -> dict[str, float]:
    """Split the rollout into ``steps_per_rollout`` optimizer steps; average their metrics."""
    outputs = {name for name in objective.train_outputs if getattr(batch, name) is None}
    if steps_per_rollout > 1 and batch.old_log_probs is None:
        # Several optimizer steps per rollout: the PPO denominator must be the pre-update policy.
        outputs.add("old_log_probs")
    if outputs:  # once per rollout (the reference is frozen), not once per optimizer step
        batch = backend.forward(batch, outputs=outputs)
    size = batch.batch_size // steps_per_rollout
    per_step = [train_step(backend, batch.slice(i * size, (i + 1) * size), objective) for i in range(steps_per_rollout)]
    return {k: statistics.fmean(m[k] for m in per_step) for k in per_step[0]}


def train_step(
    backend: TrainBackend, batch: TrainBatch, objective: PolicyObjective, counts: LossCounts | None = None
) -> dict[str, float]:
    """One optimizer step on ``batch``: ``forward_backward`` then ``optimizer_step``; returns their metrics.

    ``counts`` default to the batch's own (``batch`` is the whole global batch); a rank holding a shard passes
    the global batch's.
    """
    metrics = backend.forward_backward(batch, objective, counts or LossCounts.of(batch))
    metrics.update(backend.optimizer_step())
    return metrics


NO_SIGNAL_WARNING = (
    "step %d: all %d groups have zero reward variance (groups/no_signal_ratio 1.0; mean reward %.3g): every valid "
    "sample of a prompt got the same reward, so every advantage is 0 and the step learns nothing. Fixes: an easier "
    "task or a larger model; more samples per prompt (--rollout.n-samples-per-prompt 8); a longer "
    "--rollout.sampling.max-new-tokens if answers are cut off (see truncated_ratio); check the reward function and "
    "the answer format it expects (miles config show RECIPE); or keep only groups with signal "
    "(--algorithm.dynamic-sampling.max-rounds 3). Shown once; metrics.jsonl has groups/no_signal_ratio for every step."
)


def no_signal_ratio(rewards: torch.Tensor, group_index: torch.Tensor, valid: torch.Tensor) -> float:
    """Fraction of groups whose valid samples all have the same reward (fewer than two valid counts too): their
    group-relative advantages are 0, so they add nothing to the policy gradient.

    Args:
        rewards: [B] float32, shaped rewards (what the advantages see); any value where not valid.
        group_index: [B] int64, the prompt each sample answers.
        valid: [B] bool, ``AdvantageInputs.valid``: False for FAILED/ABORTED samples and samples without a
            trainable token (left out of the comparison).
    Returns: groups without signal / groups, in [0, 1].
    """
    groups = group_index.unique()
    num_no_signal = 0
    for group in groups:
        group_rewards = rewards[(group_index == group) & valid]
        num_no_signal += bool(group_rewards.numel() < 2 or (group_rewards == group_rewards[0]).all())
    return num_no_signal / len(groups)


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
    prompts = list(c.eval_prompts)[: evaluation.num_prompts]
    bar = c.progress(len(prompts) * evaluation.n_samples_per_prompt) if c.progress is not None else None
    progress = {"on_finished": bar.update} if bar is not None else {}  # rollout fns never given a bar may lack it
    try:
        samples = c.rollout_fn(
            prompts,
            n_samples_per_prompt=evaluation.n_samples_per_prompt,
            sampling=evaluation.sampling,
            seed=0,  # the same seed every time: evaluations differ only by the weights
            **progress,
        )
    finally:
        if bar is not None:
            bar.close()
    num_failed = score_samples(samples, c.reward_fn)
    rewards = [s.reward for s in samples if s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)]
    return {
        "eval/reward": statistics.fmean(rewards) if rewards else float("nan"),
        "eval/response_length": statistics.fmean(s.response_length for s in samples),
        "eval/failed": float(num_failed),
        "time/eval": time.perf_counter() - t0,
    }
