"""The RL objective, built once from the ``algorithm`` section and handed to a training backend.

A backend (FSDP2, Megatron-core, the plain-torch reference of the tests) runs forward and backward only:
``TrainBackend.forward_backward(batch, objective, counts)`` computes the policy's log-probs (and entropy) of a
micro-batch and calls ``PolicyObjective.loss`` for the scalar to differentiate; with a critic it calls
``ValueObjective.loss`` on the critic's values. Everything RL (the policy loss of the registry or a plugin, its
aggregation, KL to the reference in the loss, the entropy bonus, TIS/MIS/icepop weights, OPSM, the rollout/training
mismatch metrics, skipping rows without signal) lives here, in ``miles.core``; no backend imports an RL formula.

Denominators are global: ``LossCounts`` holds the trained tokens and sequences of the whole optimizer step (all
micro-batches, all ranks), computed once by the caller from the global batch, so the accumulated gradient does not
depend on the micro-batch size or on how the batch is split over ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from miles.core.algorithms.importance import importance_weights, off_policy_sequence_mask
from miles.core.algorithms.losses import LossParams, aggregate, policy_loss, value_loss, zero_masked
from miles.core.algorithms.registry import BACKEND_OUTPUTS, get_estimator, get_policy_loss
from miles.core.batch import TrainBatch, split_micro_batches
from miles.core.config import AlgorithmConfig, CriticConfig, uses_critic
from miles.core.plugins import load_plugin
from torch import Tensor


@dataclass(frozen=True)
class LossCounts:
    """Loss denominators of one optimizer step, over its whole global batch (every micro-batch and rank).

    Attributes:
        num_tokens: trained tokens (``loss_mask`` True), the token-mean denominator.
        num_sequences: sequences, the denominator of the seq-mean aggregations.
    """

    num_tokens: int
    num_sequences: int

    @classmethod
    def of(cls, batch: TrainBatch) -> LossCounts:
        """The counts of ``batch`` taken as the whole global batch (host sync)."""
        return cls(num_tokens=batch.num_loss_tokens, num_sequences=batch.batch_size)


class ValueObjective:
    """The critic's clipped value loss, token-mean over the global trained tokens.

    Args:
        clip: value clip range around the rollout-time values (reward units), ``models.critic.value_clip``.
    References: PPO2 baselines value clipping; verl ``compute_value_loss``.
    """

    def __init__(self, *, clip: float) -> None:
        self.clip = clip

    def loss(self, values: Tensor, mb: TrainBatch, counts: LossCounts) -> tuple[Tensor, dict[str, Tensor]]:
        """Value loss of one micro-batch, already divided by the global token count.

        Args:
            values: [b, t] float32 critic output with grad, ``TrainBatch`` response columns.
            mb: the micro-batch; needs ``values`` (rollout-time values) and ``returns``.
            counts: the global denominators.
        Returns: (loss scalar with grad, {"loss/value", "value_clipfrac"} detached scalars).
        Raises: ValueError if the batch lacks ``values`` or ``returns`` (advantage 'gae' sets them).
        """
        if mb.values is None or mb.returns is None:
            raise ValueError("the value loss needs batch.values and batch.returns (computed with advantage 'gae')")
        # Selection (not multiplication) by the mask: a NaN/inf at a masked slot must not reach the gradient.
        loss_mask = mb.loss_mask
        values, old_values, returns = (zero_masked(t, loss_mask) for t in (values, mb.values, mb.returns))
        token_loss, clipped = value_loss(values, old_values, returns, clip=self.clip)
        loss = aggregate(token_loss, loss_mask, mode="token_mean", num_tokens=counts.num_tokens)
        clipfrac = aggregate(clipped.float(), loss_mask, mode="token_mean", num_tokens=counts.num_tokens)
        return loss, {"loss/value": loss.detach(), "value_clipfrac": clipfrac}


class PolicyObjective:
    """The policy objective of one algorithm config: loss = agg(w * pg) + kl_coef * agg(kl) - entropy_coef * agg(H).

    Built once (plugins loaded here) and reused for every micro-batch of every step.

    Args:
        algorithm: the algorithm section (loss, clip, KL, entropy, aggregation, rollout corrections).
        max_new_tokens: normalizer of ``seq_mean_token_sum_norm`` (Dr.GRPO): the longest response,
            ``RolloutConfig.max_response_tokens`` (``rollout.multi_turn.max_response_tokens`` with multi_turn).
        critic: the ``models.critic`` section, required by an estimator that trains a critic (gae) and refused
            otherwise; None = no critic.
    Raises: ImportError/AttributeError/TypeError naming the key for an unloadable plugin; ValueError when
        ``critic`` does not match the estimator.
    """

    skipped_rows_metric = "skipped_zero_advantage_samples"  # the count ``select_rows`` dropped
    # Metrics a backend reduces with max over micro-batches and ranks (``combine_metric``); the rest are summed.
    max_metrics = frozenset({"train_rollout_logprob_abs_diff_max"})

    def __init__(self, algorithm: AlgorithmConfig, *, max_new_tokens: int, critic: CriticConfig | None = None) -> None:
        self.algorithm = algorithm
        self.normalizer = float(max_new_tokens)
        loss = algorithm.loss
        if loss.policy_loss_path:
            self.loss_fn = load_plugin(loss.policy_loss_path, key="algorithm.loss.policy_loss_path", num_positional=5)
            self.advantage_weighted = False  # unknown: never skip rows for a custom loss
        else:
            self.loss_fn = get_policy_loss(loss.policy_loss).fn
            self.advantage_weighted = get_policy_loss(loss.policy_loss).advantage_weighted
        self.reducer = (
            load_plugin(loss.reducer_path, key="algorithm.loss.reducer_path", num_positional=4)
            if loss.reducer_path
            else None
        )
        self.params = LossParams(clip_low=loss.clip_low, clip_high=loss.clip_high, dual_clip_c=loss.dual_clip_c)
        kl = algorithm.kl
        self.kl_loss_coef = kl.coef if kl is not None and kl.mode == "loss" else 0.0
        self.kl_estimator = kl.estimator if kl is not None else "k3"  # read only when kl_loss_coef > 0
        estimator = algorithm.advantage.estimator
        if uses_critic(algorithm.advantage) and critic is None:
            raise ValueError(
                f"algorithm.advantage.estimator {estimator!r} trains a critic, but critic is None; pass "
                "critic=CriticConfig() (the models.critic section)"
            )
        if critic is not None and not uses_critic(algorithm.advantage):
            raise ValueError(f"a critic section was given but the estimator {estimator!r} reads no critic values")
        self.value = ValueObjective(clip=critic.value_clip) if critic is not None else None

    # -- what the backend must compute -----------------------------------------------------------
    def advantage_outputs(self, available: Collection[str]) -> frozenset[str]:
        """``TrainBatch`` fields the backend computes before the advantages (``TrainBackend.forward`` outputs).

        The estimator's registry ``needs``, old and reference log-probs for a KL reward penalty, and the
        reference log-probs for a KL loss when a forward pass runs anyway; a custom estimator gets every output
        the backend can give (``available``). Empty = the estimator reads rewards only (GRPO): no pass at all.
        """
        advantage, kl = self.algorithm.advantage, self.algorithm.kl
        if advantage.estimator_path:
            needs = {"old_log_probs"} | (set(available) & BACKEND_OUTPUTS)
        else:
            needs = set(get_estimator(advantage.estimator).needs)
        if kl is not None and (needs or kl.mode == "reward"):
            needs |= {"old_log_probs", "ref_log_probs"}
        return frozenset(needs)

    @property
    def train_outputs(self) -> frozenset[str]:
        """Fields the batch handed to ``forward_backward`` must hold beyond the rollout's (the KL loss' reference)."""
        return frozenset({"ref_log_probs"}) if self.kl_loss_coef > 0.0 else frozenset()

    # -- the loss --------------------------------------------------------------------------------
    def select_rows(self, batch: TrainBatch, *, world_size: int) -> tuple[TrainBatch, int]:
        """Drop samples whose advantages are all 0 when nothing else (KL, entropy bonus) gives them a gradient.

        Exact: such a row adds -ratio * 0 = 0 to the loss and its gradient, and the loss denominators are global
        counts taken before the drop. GRPO groups with equal rewards are all-zero, often most of a batch early on.
        Only at world size 1: FSDP2 ranks must run the same number of backward passes.
        Returns: (the kept rows, number dropped).
        """
        entropy_coef = self.algorithm.loss.entropy_coef
        if world_size > 1 or self.kl_loss_coef > 0.0 or entropy_coef > 0.0 or not self.advantage_weighted:
            return batch, 0
        keep = ((batch.advantages != 0) & batch.loss_mask).any(dim=1)
        if not keep.any():  # keep one row (zero gradient) so that entropy and log-prob metrics are still measured:
            trained = batch.loss_mask.any(dim=1)  # one with a trained token (an aborted empty row measures nothing)
            keep[int(trained.nonzero()[0, 0]) if trained.any() else 0] = True
        num_skipped = int((~keep).sum())  # host sync
        if num_skipped == 0:
            return batch, 0
        return batch.select(keep.nonzero().squeeze(1)), num_skipped

    def loss(
        self,
        mb: TrainBatch,
        log_probs: Tensor,
        entropy: Tensor | None,
        counts: LossCounts,
        *,
        metrics_num_tokens: int | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy loss of one micro-batch, already divided by the global denominators.

        Without ``mb.old_log_probs`` the batch is on-policy: the ratio's denominator is the detached current
        log-prob (ratio 1), which saves a forward pass.

        Args:
            mb: the micro-batch (advantages, loss mask, rollout/old/ref log-probs as available).
            log_probs: [b, t] float32 nats of the current policy with grad (logits / sampling temperature).
            entropy: [b, t] float32 nats, with grad if ``algorithm.loss.entropy_coef`` > 0; None = not measured.
            counts: global denominators of the optimizer step.
            metrics_num_tokens: token denominator of the token-mean metrics when rows were dropped
                (``select_rows``): the trained tokens of the kept rows; default ``counts.num_tokens``.
        Returns: (loss scalar with grad, detached scalar metrics: loss/pg, pg_clipfrac, ppo_kl, entropy, loss/kl,
            train_rollout_logprob_abs_diff, train_rollout_kl, tis_clipfrac, opsm_masked_frac and the ESS terms),
            each a sum over micro-batches and ranks of what this returns, and train_rollout_logprob_abs_diff_max
            (max over the trained tokens, |old - rollout| nats), a max over them (``combine_metric``);
            ``finish_metrics`` completes them.
        Raises: ValueError if a needed input (reference or rollout log-probs) is missing from ``mb``.
        """
        loss_cfg = self.algorithm.loss
        if self.kl_loss_coef > 0.0 and mb.ref_log_probs is None:
            raise ValueError(
                "algorithm.kl is on (mode loss) but the batch has no ref_log_probs; compute them first with "
                "backend.forward(batch, outputs={'ref_log_probs'})"
            )
        old_log_probs = mb.old_log_probs if mb.old_log_probs is not None else log_probs.detach()
        loss_mask, token_weights, correction = self._rollout_correction(mb, log_probs, old_log_probs)
        loss, metrics = policy_loss(
            log_probs,
            old_log_probs,
            mb.advantages,
            loss_mask,
            params=self.params,
            aggregation=loss_cfg.aggregation,
            num_tokens=counts.num_tokens,
            num_sequences=counts.num_sequences,
            loss=self.loss_fn,
            reducer=self.reducer,
            normalizer=self.normalizer,
            token_weights=token_weights,
            ref_log_probs=mb.ref_log_probs,
            kl_coef=self.kl_loss_coef,
            kl_estimator=self.kl_estimator,
            entropy=entropy,
            entropy_coef=loss_cfg.entropy_coef,
            metrics_num_tokens=metrics_num_tokens,
        )
        tok = dict(mode="token_mean", num_tokens=metrics_num_tokens or counts.num_tokens)
        metrics.update({name: aggregate(v, mb.loss_mask, **tok) for name, v in correction.items()})
        if "train_rollout_logprob_abs_diff" in correction:  # the worst token, which a mean hides
            abs_diff = torch.where(mb.loss_mask, correction["train_rollout_logprob_abs_diff"], 0.0)
            # A micro-batch of empty responses (samples aborted before their first token) has no column: max 0.
            metrics["train_rollout_logprob_abs_diff_max"] = abs_diff.amax() if abs_diff.numel() else abs_diff.sum()
        return loss, metrics

    @classmethod
    def combine_metric(cls, name: str, total: Tensor | float | None, value: Tensor | float) -> Tensor | float:
        """Accumulate micro-batch metric ``name``: the max for ``max_metrics``, else the sum (None = first)."""
        if total is None:
            return value
        if name in cls.max_metrics:
            return torch.maximum(torch.as_tensor(total), torch.as_tensor(value))
        return total + value

    @staticmethod
    def finish_metrics(metrics: dict[str, float]) -> dict[str, float]:
        """Turn the summed micro-batch metrics into reported ones (the ESS ratio from its two token means)."""
        if "_is_weight_sq" in metrics:  # ESS ratio = mean(w)^2 / mean(w^2), from token means over the global batch
            sq_mean = metrics.pop("_is_weight_sq")
            ess = metrics.pop("_is_weight") ** 2 / sq_mean if sq_mean > 0 else 1.0
            metrics["ess_ratio"] = min(ess, 1.0)  # <= 1 by Cauchy-Schwarz; rounding can overshoot by ~1e-13
        return metrics

    def _rollout_correction(
        self, mb: TrainBatch, log_probs: Tensor, old_log_probs: Tensor
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
        """Loss mask after OPSM, detached importance weights (TIS/MIS/icepop) and per-token mismatch values.

        The mismatch metrics are measured whenever the batch has the engine's log-probs, with or without
        ``algorithm.rollout_correction``.
        Returns: (loss_mask [b, t] bool, token_weights [b, t] float32 or None, {metric: [b, t] per-token values}
            to be token-averaged: train_rollout_logprob_abs_diff, train_rollout_kl, tis_clipfrac and the ESS terms).
        """
        cfg, loss_mask = self.algorithm.rollout_correction, mb.loss_mask
        if mb.rollout_log_probs is None:
            if cfg is not None:
                raise ValueError(
                    "algorithm.rollout_correction (importance sampling / opsm) needs the engine's rollout_log_probs, "
                    "but the batch has none; use an engine that returns log-probs, or set "
                    "--algorithm.rollout-correction null."
                )
            return loss_mask, None, {}
        diff = (old_log_probs - mb.rollout_log_probs).detach()
        values = {"train_rollout_logprob_abs_diff": diff.abs(), "train_rollout_kl": -diff}
        if cfg is None:
            return loss_mask, None, values
        if cfg.opsm:
            loss_mask = off_policy_sequence_mask(
                log_probs, mb.rollout_log_probs, mb.advantages, loss_mask, threshold=cfg.opsm_threshold
            )
            values["opsm_masked_frac"] = (mb.loss_mask & ~loss_mask).float()
        token_weights = None
        if cfg.importance_sampling != "none":
            token_weights, outside = importance_weights(
                old_log_probs.detach(),
                mb.rollout_log_probs,
                loss_mask,
                mode=cfg.importance_sampling,
                level=cfg.level,
                lower=cfg.lower,
                upper=cfg.upper,
            )
            values.update(
                {"tis_clipfrac": outside.float(), "_is_weight": token_weights, "_is_weight_sq": token_weights**2}
            )
        return loss_mask, token_weights, values


LOCAL_TOKENS_METRIC = "_rank_loss_tokens"  # each rank's trained tokens, summed over ranks to check the counts


def accumulate_policy_loss(
    objective: PolicyObjective,
    batch: TrainBatch,
    counts: LossCounts,
    *,
    world_size: int,
    micro_batch_size: int,
    log_probs_fn: Callable[[TrainBatch], tuple[Tensor, Tensor | None]],
    backward: Callable[[Tensor, int, int], None],
) -> dict[str, Tensor]:
    """One rank's share of a backend's ``forward_backward``, the same for every backend: select the rows with a
    gradient (``select_rows``), split them into micro-batches, and for each compute the policy's log-probs and
    entropy (``log_probs_fn``: [b, t] float32 each, entropy None when not measured), the objective's loss against
    the global ``counts``, and its gradient (``backward(loss, i, num_micro_batches)``: the backend's own scaling and
    gradient-sync policy).

    Returns: this rank's detached metric accumulations (scalar tensors; ``combine_metric``): loss, the skipped-rows
        count, the objective's metrics, and ``LOCAL_TOKENS_METRIC`` (this rank's trained tokens) for
        ``reduce_policy_metrics``'s counts check. A backend may add its own (a critic's) before reducing.
    """
    accumulator = PolicyLossAccumulator(objective, batch, counts, world_size=world_size,
                                        micro_batch_size=micro_batch_size)  # fmt: skip
    for i, mb in enumerate(accumulator.micro_batches):
        log_probs, entropy = log_probs_fn(mb)
        backward(accumulator.loss(mb, log_probs, entropy), i, len(accumulator.micro_batches))
    return accumulator.sums


class PolicyLossAccumulator:
    """``accumulate_policy_loss`` for a backend that drives the micro-batches itself (a pipeline schedule, which runs
    forwards and backwards in its own order): ``micro_batches`` are this rank's (``select_rows``, then split), and
    ``loss(mb, log_probs, entropy)`` returns one micro-batch's loss (scalar, carrying grad) and adds its metrics to
    ``sums``, which ends as ``accumulate_policy_loss``'s return value.

    Args: as ``accumulate_policy_loss``.
    """

    def __init__(
        self, objective: PolicyObjective, batch: TrainBatch, counts: LossCounts, *, world_size: int,
        micro_batch_size: int,
    ) -> None:  # fmt: skip
        self.objective, self.counts = objective, counts
        self.sums: dict[str, Tensor] = {LOCAL_TOKENS_METRIC: torch.tensor(float(batch.num_loss_tokens))}
        trained, num_skipped = objective.select_rows(batch, world_size=world_size)
        self.metrics_num_tokens = trained.num_loss_tokens if num_skipped else None
        self.sums["loss"] = torch.zeros(())
        self.sums[objective.skipped_rows_metric] = torch.tensor(float(num_skipped))
        self.micro_batches = split_micro_batches(trained, micro_batch_size) if trained.batch_size else []

    def loss(self, mb: TrainBatch, log_probs: Tensor, entropy: Tensor | None) -> Tensor:
        """The objective's loss of micro-batch ``mb`` against the global counts; its metrics go into ``sums``."""
        loss, metrics = self.objective.loss(
            mb, log_probs, entropy, self.counts, metrics_num_tokens=self.metrics_num_tokens
        )
        for name, value in metrics.items():
            self.sums[name] = self.objective.combine_metric(name, self.sums.get(name), value.detach())
        self.sums["loss"] = self.sums["loss"] + loss.detach()
        return loss


def reduce_policy_metrics(
    objective: PolicyObjective,
    sums: dict[str, Tensor],
    counts: LossCounts,
    *,
    all_reduce: Callable[[Tensor, str], Tensor] | None = None,
) -> dict[str, float]:
    """Reduce ``accumulate_policy_loss``'s accumulations over ranks (sum; max for ``objective.max_metrics``) and
    finish them (``finish_metrics``); every rank must call it with the same metric names.

    Args:
        all_reduce: ``(float64 tensor, "sum" | "max") -> reduced tensor`` over the ranks (a collective); None = one
            rank.
    Returns: the global metrics (host floats).
    Raises: ValueError when the ranks' trained tokens add up to more than ``counts.num_tokens``: a rank was given
        its own batch's counts instead of the global batch's (``LossCounts.of(global batch)``), which scales its
        loss and gradient up by the number of ranks.
    """
    reduced: dict[str, float] = {}
    for op, names in (
        ("sum", sorted(n for n in sums if n not in objective.max_metrics)),
        ("max", sorted(n for n in sums if n in objective.max_metrics)),
    ):
        if names:  # the same names on every rank (select_rows gives each rank rows)
            totals = torch.stack([torch.as_tensor(sums[n], dtype=torch.float64) for n in names])
            if all_reduce is not None:
                totals = all_reduce(totals, op)
            reduced.update(zip(names, totals.tolist()))  # host sync
    total_tokens = reduced.pop(LOCAL_TOKENS_METRIC, 0.0)
    if total_tokens > counts.num_tokens:
        raise ValueError(
            f"the ranks train {total_tokens:.0f} tokens but the loss counts say the global batch has "
            f"{counts.num_tokens}: a rank was given its own shard's counts; pass LossCounts.of(global batch) to "
            "every rank"
        )
    return objective.finish_metrics(reduced)
