"""Evaluation between training steps: the default eval set and the named ``eval.sets``, each with its own prompts
and sampling; mean reward, response length and pass@k per set (``evaluate``, the built-in ``eval.path``)."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles.core.buffer import generate_samples
from miles.core.config import EvalConfig
from miles.core.sample import Sample, SampleStatus, group_samples

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from miles.core.config import EvalSetConfig
    from miles.core.loop import Components


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt: the probability that at least one of k samples drawn without replacement from
    the n generated passes, 1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i).

    Args:
        num_samples: n >= 1, samples generated for the prompt.
        num_correct: c in [0, n], those that passed.
        k: 1 <= k <= n.
    Returns: pass@k in [0, 1] (pass@1 = c / n).
    Raises: ValueError for k or c out of range.
    References: Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv:2107.03374, Sec. 2.1.
    """
    if not 1 <= k <= num_samples or not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n; got n={num_samples}, c={num_correct}, k={k}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


def set_metrics(samples: Sequence[Sample], settings: EvalConfig | EvalSetConfig, prefix: str) -> dict[str, float]:
    """Metrics of one scored eval set: ``{prefix}reward`` (mean over scored samples), ``{prefix}response_length``,
    ``{prefix}failed`` and ``{prefix}pass@k`` for each k of ``settings.pass_k``, averaged over prompts. A FAILED or
    ABORTED sample counts as not passing (it still counts in n)."""
    scored = [s for s in samples if s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)]
    rewards = [s.reward for s in scored]
    metrics = {
        f"{prefix}reward": statistics.fmean(rewards) if rewards else float("nan"),
        f"{prefix}response_length": statistics.fmean(s.response_length for s in samples) if samples else 0.0,
        f"{prefix}failed": float(sum(s.status == SampleStatus.FAILED for s in samples)),
    }
    groups = group_samples(samples)

    def passed(sample: Sample) -> bool:
        return (
            sample.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)
            and isinstance(sample.reward, (int, float))
            and sample.reward >= settings.pass_threshold
        )

    for k in settings.pass_k:
        per_prompt = [pass_at_k(len(g), sum(passed(s) for s in g), k) for g in groups if len(g) >= k]
        metrics[f"{prefix}pass@{k}"] = statistics.fmean(per_prompt) if per_prompt else float("nan")
    return metrics


def _generate(c: Components, prompts: Sequence[Sample], settings: EvalConfig | EvalSetConfig) -> list[Sample]:
    bar = c.progress(len(prompts) * settings.n_samples_per_prompt) if c.progress is not None else None
    try:
        return generate_samples(
            list(prompts),
            c.eval_generate_group or c.generate_group,
            n_samples_per_prompt=settings.n_samples_per_prompt,
            sampling=settings.sampling,
            seed=0,  # the same seed every time: evaluations differ only by the weights
            on_group=bar.update if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()


def evaluate(c: Components, evaluation: EvalConfig) -> dict[str, float]:
    """The built-in eval function (``eval.path`` empty): generate on each eval set's fixed prompts with its sampling
    settings and score them (reward, sample hook and group reward of the run).

    The default set (``c.eval_prompts``, ``eval.num_prompts`` of them) reports ``eval/reward``,
    ``eval/response_length``, ``eval/failed`` and ``eval/pass@k``; each named set of ``eval.sets`` the same under
    ``eval/<name>/`` (prompts from ``c.eval_sets[name]``). Also ``eval/weight_version`` (evaluations run between
    steps, on published weights) and ``time/eval`` (seconds).
    Raises: KeyError naming a set of ``eval.sets`` that ``c.eval_sets`` lacks.
    """
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    if c.publisher is not None:
        metrics["eval/weight_version"] = float(c.publisher.version)
    runs: list[tuple[Sequence[Sample], EvalConfig | EvalSetConfig, str]] = []
    if evaluation.num_prompts and c.eval_prompts:
        runs.append((list(c.eval_prompts)[: evaluation.num_prompts], evaluation, "eval/"))
    for eval_set in evaluation.sets:
        if eval_set.name not in c.eval_sets:
            raise KeyError(f"eval.sets names {eval_set.name!r} but the run built no prompts for it")
        runs.append((list(c.eval_sets[eval_set.name])[: eval_set.num_prompts], eval_set, f"eval/{eval_set.name}/"))
    for prompts, settings, prefix in runs:
        samples = _generate(c, prompts, settings)
        c.score(samples)
        metrics.update(set_metrics(samples, settings, prefix))
        failed = [s for s in samples if s.status == SampleStatus.FAILED]
        if samples and len(failed) == len(samples):  # no score at all: most often a reward that does not fit the set
            reason = failed[0].metadata.get("failure", "no reason recorded")
            logger.warning("eval set %s: all %d samples failed, e.g. %s", prefix.rstrip("/"), len(samples), reason)
    metrics["time/eval"] = time.perf_counter() - t0
    return metrics


def has_eval(c: Components, evaluation: EvalConfig) -> bool:
    """True when ``evaluate`` has a set to run (the default one with prompts, or a named one)."""
    return bool((evaluation.num_prompts and c.eval_prompts) or evaluation.sets)
