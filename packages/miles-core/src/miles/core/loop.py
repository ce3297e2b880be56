"""The training loop, as DESIGN.md section 4 states it:
rollout -> reward -> filter -> advantages -> (ref/old log-probs) -> train -> push weights -> eval -> save.

``train`` runs the steps; each step (``run_step``) is one function per stage, like slime's ``train.py``:
``rollout_stage`` (generate and score the step's groups, dynamic sampling, buffer filter) -> ``advantage_stage``
(reward shaping, the train batch, the estimator's backend outputs and advantages) -> ``train_stage`` (optimizer
steps) -> ``publish_stage`` (new weight version to the engines) -> ``step_metrics``; evaluation and checkpoints run
between steps. The algorithm's plugins are loaded once per run (``load_algorithm_plugins``).

``loop.mode`` sync generates each step's rollout after the previous step's weights are published; one_step_off and
fully_async take it from a ``RolloutProducer`` that generates ahead within the staleness bound (``producer.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
from miles.core.algorithms.registry import ESTIMATORS, POLICY_LOSSES
from miles.core.batch import TrainBatch, build_train_batch
from miles.core.buffer import collect_groups
from miles.core.config import AlgorithmConfig, CriticConfig, EvalConfig, LoopConfig, RolloutConfig, check_group_size
from miles.core.evaluation import evaluate, has_eval
from miles.core.logs import one_line, warn_once
from miles.core.plugins import load_plugin
from miles.core.producer import PromptQueue, RolloutProducer, group_staleness
from miles.core.protocols import (
    DataSource,
    EvalFn,
    GroupGenerateFn,
    GroupRewardFn,
    MetricsSink,
    ProgressBar,
    RewardFn,
    SampleHook,
    TrainBackend,
    TrainHooks,
    WeightPublisher,
)
from miles.core.publisher import Colocation
from miles.core.rewards import failure_counts, outcome_counts, score_samples
from miles.core.sample import Sample, SampleStatus, group_samples

logger = logging.getLogger(__name__)

# Token id written into padding; attention masks hide it, so any valid id works.
PAD_TOKEN_ID = 0
_DS_FILTER_KEY = "algorithm.dynamic_sampling.filter_path"


class AllSamplesFailed(RuntimeError):
    """No sample of a step could be trained: each failed (its reward raised, timed out or returned no finite number;
    the engine failed it) or was aborted, so the run stops instead of training on nothing.

    Attributes:
        step: the step, numbered as the progress bar and ``metrics.jsonl`` number it (1 for the first).
        num_samples: the samples of the step.
        reasons: the distinct failure reasons (``metadata["failure"]``, else the status), in sample order.
        kinds: the distinct failure kinds (``metadata["failure_kind"]``, e.g. reward_timeout), in sample order.
    """

    def __init__(self, step: int, samples: Sequence[Sample]) -> None:
        self.step, self.num_samples = step, len(samples)
        self.reasons = list(dict.fromkeys(s.metadata.get("failure", s.status.value) for s in samples))
        self.kinds = list(dict.fromkeys(s.metadata.get("failure_kind", "") for s in samples))
        super().__init__(f"step {step}: all {len(samples)} samples failed; reasons: {self.reasons[:5]}")


class AllSamplesAborted(RuntimeError):
    """Every sample of a step was cut off by weight updates (``SampleStatus.ABORTED``) and stayed so after its
    ``rollout.max_resubmits`` resubmissions: nothing went wrong with the reward or the data, but nothing can be
    trained. The message numbers the step as the progress bar does and names the settings to change."""

    def __init__(self, step: int, num_samples: int, max_resubmits: int) -> None:
        self.step, self.num_samples = step, num_samples
        super().__init__(
            f"step {step}: all {num_samples} samples were cut off by weight updates and were still unfinished after "
            f"rollout.max_resubmits={max_resubmits} resubmissions each, so there is nothing to train; raise "
            "--rollout.max-resubmits, or continue cut-off requests on the new weights with --loop.partial-rollout "
            "true (fully_async)"
        )


class DynamicSamplingExhausted(RuntimeError):
    """``algorithm.dynamic_sampling`` found fewer groups with a learning signal than a step needs within its
    ``max_rounds``: the task is too easy or too hard for the model. The message numbers the step as the progress bar
    and ``metrics.jsonl`` do (1 for the first) and names the settings to change."""


@dataclass
class Components:
    """Everything the loop drives, built by the caller (the recipes CLI or a user script)."""

    data_source: DataSource
    # The rollout, one prompt at a time: training (the producer / buffer path, sync or async), evaluation and SFT.
    generate_group: GroupGenerateFn
    reward_fn: RewardFn
    backend: TrainBackend
    publisher: WeightPublisher  # trainer weights -> engines, one version per step
    sink: MetricsSink
    eval_prompts: Sequence[Sample] = ()
    # The prompts of each named eval set (eval.sets), by name.
    eval_sets: Mapping[str, Sequence[Sample]] = field(default_factory=dict)
    # Called with the number of completed steps; returns the checkpoint directory written (for TrainHooks.on_save).
    save_checkpoint: Callable[[int], Path | None] | None = None
    # Polled between steps; True ends the run early (a Ctrl-C/SIGTERM asked for a clean stop).
    should_stop: Callable[[], bool] = lambda: False
    # Opens a bar over an evaluation's number of samples, advanced by each group as it completes. None: no bar.
    progress: Callable[[int], ProgressBar] | None = None
    # The rollout of evaluations when it is not the training one (SFT trains on reference answers but evaluates by
    # generating); None: generate_group.
    eval_generate_group: GroupGenerateFn | None = None
    # Called after each step: raises if an engine is out of service for good (the run stops there), else returns
    # engine metrics merged into the step's record (the engine supervisor's ``check``: engine/restarts, ...).
    engine_health: Callable[[], dict[str, float]] | None = None
    # Engines and trainer share devices (execution.ray.colocate; sync loop): its to_trainer runs after each rollout,
    # the publisher (given the same object) runs the rest. None: disaggregated.
    colocation: Colocation | None = None
    # Extension points (miles.core.plugins.EXTENSION_POINTS): rollout.sample_hook_path, reward.group_path, eval.path
    # (None: miles.core.evaluation.evaluate) and run.hooks.
    sample_hook: SampleHook | None = None
    group_reward_fn: GroupRewardFn | None = None
    eval_fn: EvalFn | None = None
    hooks: Sequence[TrainHooks] = ()

    def score(self, samples: Sequence[Sample]) -> int:
        """``score_samples`` with this run's reward, sample hook and group reward; returns the failed count."""
        return score_samples(
            samples, self.reward_fn, sample_hook=self.sample_hook, group_reward_fn=self.group_reward_fn
        )

    def call_hooks(self, name: str, *args: object) -> None:
        """Call ``name`` on every train hook that has it."""
        for hook in self.hooks:
            method = getattr(hook, name, None)
            if method is not None:
                method(*args)


def train(
    components: Components,
    *,
    loop: LoopConfig,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    evaluation: EvalConfig,
    critic: CriticConfig | None = None,
    start_step: int = 0,
) -> int:
    """Run steps ``start_step .. loop.num_steps - 1`` in ``loop.mode``; evaluate before the first and after the last.

    Checkpoints are saved every ``loop.save_interval`` steps, after the last, and after the step during which
    ``components.should_stop()`` became True; the run then ends there (without the final eval). ``critic`` is the
    ``models.critic`` section (its value clip), for an estimator that trains a critic.

    In the one_step_off and fully_async modes a ``RolloutProducer`` generates ahead; ``components.data_source``
    should then be a ``PromptQueue`` (what a checkpoint stores of it counts trained prompts only; any other source
    is wrapped in one, fine for runs that never resume). Evaluations run between steps on the weights just
    published (``eval/weight_version``).
    Returns: the number of completed steps (``loop.num_steps`` unless stopped early).
    Raises: before anything runs: ValueError if ``algorithm`` needs groups of >= 2 samples and ``rollout`` has one
        (``check_group_size``, the rule the root config also applies), or for an async mode with dynamic sampling;
        ImportError/AttributeError/TypeError naming the key of a plugin that does not load or has the wrong
        signature.
    """
    check_group_size(rollout, algorithm)
    plugins = load_algorithm_plugins(algorithm)  # once per run; every step's stages use these
    c = components
    producer = None
    if loop.mode != "sync":
        if algorithm.dynamic_sampling is not None:
            raise ValueError(
                f"algorithm.dynamic_sampling is not supported with loop.mode {loop.mode} yet: use --loop.mode sync, "
                "or turn it off with --algorithm.dynamic-sampling null"
            )
        if not isinstance(c.data_source, PromptQueue):
            c.data_source = PromptQueue(c.data_source)
        producer = RolloutProducer(
            c.generate_group,
            c.data_source,
            c.reward_fn,
            sample_hook=c.sample_hook,
            group_reward_fn=c.group_reward_fn,
            rollout=rollout,
            max_weight_staleness=loop.staleness_bound,
            start_step=start_step,
            stale_groups=loop.stale_groups,
        )
    objective = PolicyObjective(algorithm, max_new_tokens=rollout.max_response_tokens, critic=critic)
    run_eval = c.eval_fn or evaluate
    if has_eval(c, evaluation) and start_step == 0:
        c.sink.log(run_eval(c, evaluation), step=0)
    with contextlib.ExitStack() as stack:
        if producer is not None:
            stack.enter_context(producer)
        for step in range(start_step, loop.num_steps):
            if c.should_stop():  # asked before this step began (e.g. during the step-0 eval): nothing new to save
                return step
            metrics = run_step(
                c,
                step=step,
                rollout=rollout,
                algorithm=algorithm,
                objective=objective,
                producer=producer,
                drain=loop.mode == "one_step_off",
                plugins=plugins,
            )
            if c.engine_health is not None:
                metrics.update(c.engine_health())
            last = step + 1 == loop.num_steps
            if has_eval(c, evaluation) and (last or (evaluation.interval and (step + 1) % evaluation.interval == 0)):
                metrics.update(run_eval(c, evaluation))
            c.sink.log(metrics, step=step + 1)
            c.call_hooks("on_train_step_end", step + 1, metrics)
            stop = not last and c.should_stop()
            periodic = loop.save_interval and (step + 1) % loop.save_interval == 0
            if c.save_checkpoint is not None and (last or periodic or stop):
                path = c.save_checkpoint(step + 1)
                if path is not None:
                    c.call_hooks("on_save", step + 1, path)
            if stop:
                return step + 1
    return loop.num_steps


@dataclass
class RolloutResult:
    """What the rollout stage hands on: one step's samples, generated and scored.

    Attributes:
        samples: the step's samples in training order (groups in prompt order), numbered 0.. by ``index``.
        num_failed: samples that failed (FAILED; ABORTED ones are not counted).
        metrics: the stage's metrics (dynamic sampling, buffer filter, producer staleness/buffer).
        taken: group indices the step consumed (marked trained once its weights are published).
        seconds: wall time of the stage.
    """

    samples: list[Sample]
    num_failed: int
    metrics: dict[str, float]
    taken: list[int]
    seconds: float


@dataclass
class AdvantageResult:
    """What the advantage stage hands on: the train batch with advantages, and the rewards behind them.

    Attributes:
        batch: [B, ...] the step's ``TrainBatch`` with advantages, returns and the backend outputs the estimator
            needed (old/ref/teacher log-probs, critic values).
        scores: [B] float32 rewards as scored (0.0 where not scored).
        scored: per sample, True when it has a reward (not FAILED or ABORTED).
        rewards: [B] float32 rewards after shaping (overlong penalty, post-process plugin).
        group_index: [B] int64 each sample's group.
        valid: [B] bool samples in the group statistics (scored, with a trainable token).
    """

    batch: TrainBatch
    scores: torch.Tensor
    scored: list[bool]
    rewards: torch.Tensor
    group_index: torch.Tensor
    valid: torch.Tensor


def run_step(
    c: Components,
    *,
    step: int,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    objective: PolicyObjective | None = None,
    producer: RolloutProducer | None = None,
    drain: bool = False,
    plugins: Mapping[str, Callable[..., object]] | None = None,
) -> dict[str, float]:
    """One rollout step, one function per stage: rollout (generate + score) -> advantages -> train -> publish;
    returns the step's metrics. Evaluation and checkpoints run between steps (``train``).

    ``objective`` is built from ``algorithm`` when not given (``train`` builds it once per run; an estimator
    with a critic needs it given); ``plugins`` are the algorithm's loaded plugins (``load_algorithm_plugins``;
    loaded here when not given). With a ``producer`` the rollout is taken from it (generated ahead, already
    scored), its prompts are marked trained, and the producer may start the groups the published weights allow;
    ``drain`` first waits for every group it is generating (one-step-off).
    Raises: AllSamplesFailed / AllSamplesAborted when no sample of the step can be trained;
        DynamicSamplingExhausted; what the backend, the publisher or a plugin raises.
    """
    if objective is None:
        objective = PolicyObjective(algorithm, max_new_tokens=rollout.max_response_tokens)
    if plugins is None:
        plugins = load_algorithm_plugins(algorithm)
    t0 = time.perf_counter()
    result = rollout_stage(c, step=step, rollout=rollout, algorithm=algorithm, producer=producer, plugins=plugins)
    if c.colocation is not None:  # the engines free their memory before the trainer's first forward
        c.colocation.to_trainer(c.backend)
    advantages = advantage_stage(c, result, rollout=rollout, algorithm=algorithm, objective=objective, plugins=plugins)
    t1 = time.perf_counter()
    train_metrics = train_stage(c.backend, advantages.batch, objective, rollout.steps_per_rollout)
    t_train = time.perf_counter() - t1
    trained_version = c.publisher.version  # the weights this step's samples are trained against
    version, publish_metrics = publish_stage(c, step=step, taken=result.taken, producer=producer, drain=drain)
    metrics = step_metrics(
        step=step,
        result=result,
        advantages=advantages,
        rollout=rollout,
        algorithm=algorithm,
        trained_version=trained_version,
    )
    metrics.update(train_metrics)
    num_response_tokens = sum(s.response_length for s in result.samples)
    num_tokens = sum(len(s.tokens) for s in result.samples)
    metrics.update(publish_metrics)
    metrics.update(
        {
            "weight_version": float(version),
            "time/rollout": result.seconds,
            "time/train": t_train,
            "time/step": time.perf_counter() - t0,
            "throughput/rollout_tokens_per_s": num_response_tokens / max(result.seconds, 1e-9),
            "throughput/train_tokens_per_s": num_tokens / max(t_train, 1e-9),
        }
    )
    return metrics


def rollout_stage(
    c: Components,
    *,
    step: int,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    producer: RolloutProducer | None = None,
    plugins: Mapping[str, Callable[..., object]] | None = None,
) -> RolloutResult:
    """The rollout stage: the step's groups, generated and scored, through the buffer filter, after the
    ``on_rollout_end`` hooks. Sync: generated now (``collect_samples``, with dynamic sampling); with a ``producer``:
    taken from what it generated ahead (scored as each group completed), too-stale groups dropped and redone.

    Raises: AllSamplesAborted when every sample was cut off by weight updates; AllSamplesFailed when no sample
        got a reward; DynamicSamplingExhausted.
    """
    plugins = plugins or {}
    t0 = time.perf_counter()
    if producer is None:
        samples, num_failed, metrics = collect_samples(
            c, step=step, rollout=rollout, algorithm=algorithm, group_filter=plugins.get(_DS_FILTER_KEY)
        )
    else:
        dropped, discarded = producer.num_dropped, producer.num_discarded
        groups = producer.take(step, c.publisher.version)
        samples = [s for group in groups for s in group]
        num_failed = sum(s.status == SampleStatus.FAILED for s in samples)
        metrics = {"staleness/dropped_groups": float(producer.num_dropped - dropped), **producer.stats()}
        if producer.stale_groups == "drop":
            metrics["staleness/discarded_groups"] = float(producer.num_discarded - discarded)
    taken = sorted({s.group_index for s in samples})  # consumed, whether the buffer filter keeps them or not
    if algorithm.buffer_filter_path:
        samples, num_failed = _buffer_filter(
            samples, algorithm.buffer_filter_path, metrics, plugin=plugins.get("algorithm.buffer_filter_path")
        )
    c.call_hooks("on_rollout_end", step, samples)
    if not any(s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED) for s in samples):
        if samples and all(s.status == SampleStatus.ABORTED for s in samples):  # not a failure: say what it is
            raise AllSamplesAborted(step + 1, len(samples), rollout.max_resubmits)
        raise AllSamplesFailed(step + 1, samples)
    if num_failed:  # trained without them: the metric counts them, the log says why
        failed = (s.metadata.get("failure", s.status.value) for s in samples if s.status == SampleStatus.FAILED)
        reasons = list(dict.fromkeys(one_line(reason) for reason in failed))
        more = f"; and {len(reasons) - 3} more" if len(reasons) > 3 else ""
        logger.warning(
            "step %d: %d of %d samples failed (not trained); first reasons: %s%s",
            step + 1, num_failed, len(samples), "; ".join(reasons[:3]), more,
        )  # fmt: skip
    return RolloutResult(samples, num_failed, metrics, taken, time.perf_counter() - t0)


def advantage_stage(
    c: Components,
    result: RolloutResult,
    *,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    objective: PolicyObjective,
    plugins: Mapping[str, Callable[..., object]] | None = None,
) -> AdvantageResult:
    """The advantage stage: rewards shaped (overlong penalty, post-process plugin), the train batch built (failed,
    aborted and overlong-filtered samples untrained), the backend outputs the estimator needs computed
    (``objective.advantage_outputs``), and the advantages and returns of the configured estimator (or plugin)."""
    plugins = plugins or {}
    samples = result.samples
    scored = [s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED) for s in samples]
    scores = torch.tensor([s.reward if v else 0.0 for s, v in zip(samples, scored)], dtype=torch.float32)
    rewards = shape_rewards(
        samples, scores, rollout=rollout, algorithm=algorithm,
        post_process=plugins.get("algorithm.reward_post_process_path"),
    )  # fmt: skip
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
        estimator = plugins.get("algorithm.advantage.estimator_path") or load_plugin(
            advantage.estimator_path, key="algorithm.advantage.estimator_path"
        )
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
    return AdvantageResult(
        batch=batch.replace(advantages=advantages, returns=returns),
        scores=scores,
        scored=scored,
        rewards=rewards,
        group_index=inputs.group_index,
        valid=valid_t,
    )


def publish_stage(
    c: Components, *, step: int, taken: Sequence[int], producer: RolloutProducer | None = None, drain: bool = False
) -> tuple[int, dict[str, float]]:
    """The publish stage: the step's prompts marked trained (producer), its in-flight groups drained first when
    ``drain`` (one-step-off), the weights published as a new version, and the producer told the step is done.

    Returns: (the new weight version, {time/sync, time/drain when draining, the publisher's metrics}).
    Raises: what the publish raises (``WeightUpdateError``, ...).
    """
    t0 = time.perf_counter()
    if producer is not None:
        producer.prompts.mark_trained(list(taken))
        if drain:
            producer.drain()
    t_drain = time.perf_counter() - t0
    version = c.publisher.publish()
    metrics = {"time/sync": time.perf_counter() - t0 - t_drain, **({"time/drain": t_drain} if drain else {})}
    metrics.update(getattr(c.publisher, "metrics", dict)())  # not part of WeightPublisher: optional
    if producer is not None:
        producer.step_done(step + 1)
    return version, metrics


def step_metrics(
    *,
    step: int,
    result: RolloutResult,
    advantages: AdvantageResult,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    trained_version: int,
) -> dict[str, float]:
    """The rollout's metrics of one step (rewards, lengths, failures and outcomes, signal, staleness against
    ``trained_version``, the weights the step trained against, advantages), with the no-signal warning logged
    once when no group has signal."""
    samples, scores, scored = result.samples, advantages.scores, advantages.scored
    metrics = rollout_metrics(samples, scores[torch.tensor(scored)])
    metrics.update(result.metrics)
    metrics.update(failure_counts(samples))
    metrics.update(outcome_counts(samples))
    valid = advantages.valid
    metrics["groups/no_signal_ratio"] = no_signal_ratio(advantages.rewards, advantages.group_index, valid)
    advantage = algorithm.advantage
    entry = ESTIMATORS[advantage.estimator]  # a teacher or a critic gives advantages without reward differences
    from_rewards = advantage.estimator_path or not (entry.critic or "teacher_log_probs" in entry.needs)
    supervised = POLICY_LOSSES[algorithm.loss.policy_loss].supervised  # SFT learns from the answers, not rewards
    if metrics["groups/no_signal_ratio"] == 1.0 and from_rewards and not supervised:
        warning = no_signal_warning(scores[valid], n_samples_per_prompt=rollout.n_samples_per_prompt)
        warn_once(logger, warning, step + 1, int(advantages.group_index.unique().numel()), metrics["reward/mean"])
    # Versions behind the weights this step trained against, from each sample's oldest token.
    staleness = [group_staleness([s], trained_version) for s in samples if s.weight_versions and s.response_length]
    batch = advantages.batch
    metrics.update(
        {
            "advantages/mean": float(batch.advantages[batch.loss_mask].mean()) if batch.num_loss_tokens else 0.0,
            "samples/failed": float(result.num_failed),
            # Weight updates cutting into requests: responses requested again after an abort (their count), samples
            # still ABORTED after their resubmits, and samples whose tokens span several versions (continued).
            "samples/resubmits": float(sum(s.metadata.get("resubmits", 0) for s in samples)),
            "samples/aborted": float(sum(s.status == SampleStatus.ABORTED for s in samples)),
            "samples/multi_version": float(sum(len(set(s.weight_versions)) > 1 for s in samples)),
            "staleness/mean": statistics.fmean(staleness) if staleness else 0.0,
            "staleness/max": float(max(staleness, default=0)),
        }
    )
    return metrics


def collect_samples(
    c: Components,
    *,
    step: int,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    group_filter: Callable[..., object] | None = None,
) -> tuple[list[Sample], int, dict[str, float]]:
    """Generate and score ``rollout_batch_size`` groups; with dynamic sampling, keep only groups that pass the
    filter (default: rewards not all equal) and generate more, for at most ``dynamic_sampling.max_rounds`` rounds.

    Samples come in prompt order, numbered by position (``miles.core.buffer.collect_groups``), and each is sampled
    with the seed of its position in its round, whatever order the groups complete in. ``group_filter`` is the
    loaded ``algorithm.dynamic_sampling.filter_path`` plugin (loaded here when None and the path is set).
    Returns: (samples, number of failed samples (ABORTED ones are not), filter metrics:
        dynamic_sampling/{rounds, filtered_groups}).
    Raises: RuntimeError naming the counts when dynamic sampling cannot fill the batch in its rounds.
    """
    dynamic = algorithm.dynamic_sampling
    if group_filter is None:
        group_filter = _keeps_signal
        if dynamic is not None and dynamic.filter_path:
            group_filter = load_plugin(dynamic.filter_path, key=_DS_FILTER_KEY)
    num_rounds = dynamic.max_rounds if dynamic is not None else 1
    kept: list[list[Sample]] = []
    num_failed = num_filtered = 0
    reasons: dict[str, float] = {}
    for round_index in range(num_rounds):
        missing = rollout.rollout_batch_size - len(kept)
        num_prompts = missing if round_index == 0 else math.ceil(missing * dynamic.over_sample)
        # The parts of the async loop with a buffer of one round: a producer runs the group-generate function per
        # prompt into a bounded buffer; groups come back in prompt order.
        seed = rollout.seed + 1_000_003 * step + 7_919 * round_index
        groups = asyncio.run(
            collect_groups(
                c.data_source.next_prompts(num_prompts),
                c.generate_group,
                n_samples_per_prompt=rollout.n_samples_per_prompt,
                sampling=rollout.sampling,
                seed=seed,
            )
        )
        samples = [s for group in groups for s in group]
        num_failed += c.score(samples)
        if dynamic is None:
            return samples, num_failed, {}
        for group in groups:
            keep, reason = _keep(group_filter(group))
            if len(kept) < rollout.rollout_batch_size and keep:
                kept.append(group)
            else:
                num_filtered += 1
                if not keep and reason:
                    key = f"dynamic_sampling/filtered/{reason}"
                    reasons[key] = reasons.get(key, 0.0) + 1.0
        if len(kept) == rollout.rollout_batch_size:
            samples = [s for group in kept for s in group]
            for i, sample in enumerate(samples):
                sample.index = i
            metrics = {
                "dynamic_sampling/rounds": float(round_index + 1),
                "dynamic_sampling/filtered_groups": num_filtered,
                **reasons,
            }
            return samples, num_failed, metrics
    logger.warning("step %d: dynamic sampling kept %d groups, filtered %d", step + 1, len(kept), num_filtered)
    raise DynamicSamplingExhausted(
        f"step {step + 1}: dynamic sampling kept {len(kept)} of "
        f"rollout.rollout_batch_size={rollout.rollout_batch_size} groups after "
        f"algorithm.dynamic_sampling.max_rounds={num_rounds} generation rounds ({num_filtered} groups filtered: "
        "all rewards equal, so no learning signal). The task is too easy or too hard for the model: raise "
        "--algorithm.dynamic-sampling.max-rounds or --algorithm.dynamic-sampling.over-sample, raise "
        "--rollout.n-samples-per-prompt, or pick a task of fitting difficulty."
    )


def _keep(result: bool | tuple[bool, str]) -> tuple[bool, str]:
    """(keep, reason) of a dynamic-sampling filter's answer (a bool, or a (bool, reason) pair).

    Raises: TypeError naming the key for anything else."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], str):
        return bool(result[0]), result[1]
    if isinstance(result, bool):
        return result, ""
    raise TypeError(
        f"algorithm.dynamic_sampling.filter_path returned {result!r}; expected a bool or (bool, reason: str)"
    )


def _buffer_filter(
    samples: list[Sample], path: str, metrics: dict[str, float], *, plugin: Callable[..., object] | None = None
) -> tuple[list[Sample], int]:
    """The samples of the groups ``algorithm.buffer_filter_path`` (``plugin``, its loaded callable, or loaded
    here) keeps, renumbered 0..; (samples, failed count). Adds ``buffer/filtered_groups`` to ``metrics``.

    Raises: ValueError naming the key when it returns no group or a group it was not given."""
    buffer_filter = plugin or load_plugin(path, key="algorithm.buffer_filter_path")
    given = group_samples(samples)
    kept = buffer_filter(given)
    known = {id(g) for g in given}
    if not kept or any(id(g) not in known for g in kept):
        raise ValueError(
            f"algorithm.buffer_filter_path {path!r} returned {len(kept or [])} groups: it must return a non-empty "
            "subset of the groups it was given (the same list objects)"
        )
    samples = [s for group in kept for s in group]
    for i, sample in enumerate(samples):
        sample.index = i
    metrics["buffer/filtered_groups"] = float(len(given) - len(kept))
    return samples, sum(s.status == SampleStatus.FAILED for s in samples)


def _keeps_signal(group: Sequence[Sample]) -> bool:
    """Default dynamic-sampling filter: at least two valid samples with different rewards."""
    rewards = {s.reward for s in group if s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)}
    return len(rewards) > 1


def shape_rewards(
    samples: Sequence[Sample],
    scores: torch.Tensor,
    *,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    post_process: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Scores [B] float32 -> rewards [B] float32: DAPO overlong penalty, then the reward post-process plugin
    (``post_process``, its loaded callable, or loaded here from ``algorithm.reward_post_process_path``)."""
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
        if post_process is None:
            post_process = load_plugin(algorithm.reward_post_process_path, key="algorithm.reward_post_process_path")
        rewards = post_process(list(samples), rewards)
    return rewards


def train_stage(
    backend: TrainBackend, batch: TrainBatch, objective: PolicyObjective, steps_per_rollout: int
) -> dict[str, float]:
    """The train stage: the outputs the objective needs (reference log-probs; old log-probs for several optimizer
    steps) computed once, then ``steps_per_rollout`` optimizer steps on equal slices of the batch; their metrics
    averaged (the max of ``objective.max_metrics``)."""
    outputs = {name for name in objective.train_outputs if getattr(batch, name) is None}
    if steps_per_rollout > 1 and batch.old_log_probs is None:
        # Several optimizer steps per rollout: the PPO denominator must be the pre-update policy.
        outputs.add("old_log_probs")
    if outputs:  # once per rollout (the reference is frozen), not once per optimizer step
        batch = backend.forward(batch, outputs=outputs)
    size = batch.batch_size // steps_per_rollout
    per_step = [train_step(backend, batch.slice(i * size, (i + 1) * size), objective) for i in range(steps_per_rollout)]
    return {
        k: max(m[k] for m in per_step) if k in objective.max_metrics else statistics.fmean(m[k] for m in per_step)
        for k in per_step[0]
    }


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


# Samples per prompt below which more of them is advised when no group has signal: with 8, a prompt the policy
# answers right 1 time in 10 yields a group with signal more often than not (1 - 0.9^8 = 0.57).
ENOUGH_SAMPLES_PER_PROMPT = 8
_NO_SIGNAL = "step %d: all %d groups have zero reward variance (groups/no_signal_ratio 1.0; mean reward %.3g): "
_ONCE = " Shown once; metrics.jsonl has groups/no_signal_ratio and reward/mean for every step."
SOLVED_WARNING = (
    _NO_SIGNAL + "every sample got reward 1 or more: the policy solves these prompts, so every advantage is 0 and "
    "the step learns nothing. The task is solved at this difficulty: stop here (the checkpoints hold the result) or "
    "train on a harder task (a harder --data.task-kwargs, another dataset); more steps or more samples per prompt "
    "will not help." + _ONCE
)
ALL_WRONG_WARNING = (
    _NO_SIGNAL + "no sample got a positive reward, so every advantage is 0 and the step learns nothing. Fixes: an "
    "easier task or a larger model;{more_samples} a longer --rollout.sampling.max-new-tokens if answers are cut off "
    "(see truncated_ratio); check the reward function and the answer format it expects (miles config show RECIPE)."
    + _ONCE
)
NO_SIGNAL_WARNING = (
    _NO_SIGNAL + "every valid sample of a prompt got the same reward, so every advantage is 0 and the step learns "
    "nothing. Fixes: an easier task or a larger model;{more_samples} a longer --rollout.sampling.max-new-tokens if "
    "answers are cut off (see truncated_ratio); check the reward function and the answer format it expects (miles "
    "config show RECIPE); or keep only groups with signal (--algorithm.dynamic-sampling.max-rounds 3)." + _ONCE
)


def no_signal_warning(valid_rewards: torch.Tensor, *, n_samples_per_prompt: int) -> str:
    """The warning (a ``%``-template taking step, groups, mean reward) for a step in which no group has signal.

    Tells a solved task (every sample got reward >= 1, the reward of a right answer) from one the policy fails
    (no reward above 0) and from groups that are each uniform but differ; advises more samples per prompt only
    below ``ENOUGH_SAMPLES_PER_PROMPT``.

    Args:
        valid_rewards: [V] float32, the reward function's values of the samples entering the group statistics
            (``AdvantageInputs.valid``); may be empty.
        n_samples_per_prompt: the run's ``rollout.n_samples_per_prompt``.
    Returns: one of ``SOLVED_WARNING``, ``ALL_WRONG_WARNING``, ``NO_SIGNAL_WARNING``, the last two with the advice
        on samples per prompt filled in or left out.
    """
    if valid_rewards.numel() and bool((valid_rewards >= 1.0).all()):
        return SOLVED_WARNING
    more_samples = ""
    if n_samples_per_prompt < ENOUGH_SAMPLES_PER_PROMPT:
        more_samples = (
            f" more samples per prompt (--rollout.n-samples-per-prompt {ENOUGH_SAMPLES_PER_PROMPT}; now "
            f"{n_samples_per_prompt});"
        )
    all_wrong = valid_rewards.numel() and bool((valid_rewards <= 0.0).all())
    return (ALL_WRONG_WARNING if all_wrong else NO_SIGNAL_WARNING).format(more_samples=more_samples)


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
    """reward/mean, reward/std, response_length/mean, truncated_ratio over one rollout; with samples tagged
    ``metadata["dataset"]`` (``data.mixture``) also reward/mean/<dataset> over each dataset's scored samples.

    ``valid_rewards`` holds one reward per scored sample (not FAILED or ABORTED), in sample order.
    """
    lengths = [s.response_length for s in samples]
    metrics = {
        "reward/mean": float(valid_rewards.mean()),
        "reward/std": float(valid_rewards.std(unbiased=False)),
        "response_length/mean": statistics.fmean(lengths),
        "truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
    }
    scored = [s for s in samples if s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)]
    by_dataset: dict[str, list[float]] = {}
    for sample, reward in zip(scored, valid_rewards.tolist(), strict=True):
        if "dataset" in sample.metadata:
            by_dataset.setdefault(sample.metadata["dataset"], []).append(reward)
    metrics.update({f"reward/mean/{name}": statistics.fmean(values) for name, values in sorted(by_dataset.items())})
    return metrics
