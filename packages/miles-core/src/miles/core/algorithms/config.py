"""The ``algorithm`` config section, one nested section per feature: ``advantage``, ``loss``, ``kl``,
``rollout_correction``, ``dynamic_sampling``, ``overlong``.

An optional feature is a section that is ``None`` (off, the default) or set; a field of a feature that is off, or one
the chosen estimator or loss never reads (the registry entry's ``params``), is an error naming both keys when it is
set explicitly to a value other than its default. A field left at its default does nothing either way, and a full
dump of a config (a run's ``config.yaml``, ``miles config show``) lists every field, so such a dump validates again.

Validation is pure: no file is read and no plugin imported. ``load_algorithm_plugins`` imports the ``module:attr``
plugins and checks their signatures; the run builder (``miles.recipes.run``) and ``train`` call it before
anything is allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

from miles.core.algorithms.registry import ESTIMATORS, POLICY_LOSSES
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

# The choices come from the registry (miles.core.algorithms.registry), the only place a name is matched.
AdvantageEstimator = Literal[tuple(ESTIMATORS)]  # type: ignore[valid-type]
PolicyLoss = Literal[tuple(POLICY_LOSSES)]  # type: ignore[valid-type]


def section_switch(value: Any) -> Any:
    """An optional section given as a switch: ``none`` / ``null`` / ``false`` / ``off`` (``--algorithm.kl none``)
    -> None (off); ``true`` / ``on`` -> ``{}`` (on, every field at its default); anything else unchanged."""
    if value is False or (isinstance(value, str) and value.strip().lower() in ("none", "null", "false", "off")):
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in ("true", "on")):
        return {}
    return value


ON_OFF = BeforeValidator(section_switch)  # on every ``Section | None`` field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def changed_fields(section: BaseModel, names: Iterable[str]) -> list[str]:
    """The fields among ``names`` set explicitly (``model_fields_set``) to a value other than their default (a
    ``default_factory``'s value for fields that have one)."""
    fields = type(section).model_fields
    return [
        n
        for n in names
        if n in section.model_fields_set and getattr(section, n) != fields[n].get_default(call_default_factory=True)
    ]


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def refuse_unread_params(
    section: BaseModel, names: Iterable[str], *, prefix: str, choice_key: str, registry: dict, what: str
) -> None:
    """Refuse a parameter among ``names`` that was changed but that the chosen registry entry never reads.

    Args:
        section: the config section (``algorithm.advantage`` or ``algorithm.loss``).
        names: its parameters that registry entries declare in ``params``.
        prefix: the section's key, e.g. "algorithm.loss".
        choice_key: the field naming the registry entry, e.g. "policy_loss".
        registry: ``ESTIMATORS`` or ``POLICY_LOSSES`` (entries with ``params``).
        what: the kind, for the fix ("an estimator", "a policy loss").
    Raises: ValueError naming the parameter, the choice, the entries that read it and the fix.
    """
    choice = getattr(section, choice_key)
    for name in changed_fields(section, names):
        if name not in registry[choice].params:
            readers = sorted(key for key, entry in registry.items() if name in entry.params)
            raise ValueError(
                f"{prefix}.{name} is {getattr(section, name)} but {prefix}.{choice_key} {choice!r} never reads it "
                f"(read by: {', '.join(readers)}), so it would do nothing. Drop {_flag(prefix + '.' + name)}, or "
                f"pick {what} that reads it."
            )


class AdvantageConfig(_Section):
    """How rewards become per-token advantages (the registry's estimators, or a plugin)."""

    estimator: AdvantageEstimator = Field(
        "grpo",
        description="grpo: (r - group mean) / group std (arXiv:2402.03300); dr_grpo: r - group mean "
        "(arXiv:2503.20783); rloo: r - mean of the other samples (arXiv:2402.14740); reinforce_plus_plus: returns "
        "whitened over the batch, reinforce_plus_plus_baseline: minus the group mean first (arXiv:2501.03262); "
        "gae: PPO with a critic (arXiv:1506.02438, needs models.critic); opd: on-policy distillation, per-token "
        "teacher_log_prob - student_log_prob (needs models.teacher). Group estimators (grpo, dr_grpo, rloo, "
        "reinforce_plus_plus_baseline) need rollout.n_samples_per_prompt >= 2.",
    )
    estimator_path: str = Field(
        "",
        description="module:attr of a custom estimator fn(inputs: AdvantageInputs, params: AdvantageParams) -> "
        "(advantages [B, T], returns [B, T] or None); replaces estimator and receives every backend output "
        "(old, reference, teacher log-probs) the run holds. Empty = the built-in estimator.",
    )
    eps: float = Field(1e-6, gt=0.0, description="Added to a std before dividing (grpo, reinforce_plus_plus*).")
    gamma: float = Field(
        1.0, ge=0.0, le=1.0, description="Discount of token rewards (gae, reinforce_plus_plus*); 1.0 = none."
    )
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (gae): 1.0 = Monte-Carlo, 0.0 = one-step TD.")

    @model_validator(mode="after")
    def _check(self) -> AdvantageConfig:
        if self.estimator_path:
            if changed_fields(self, ["estimator"]):
                raise ValueError(
                    f"algorithm.advantage.estimator is {self.estimator!r} but algorithm.advantage.estimator_path "
                    f"({self.estimator_path!r}) replaces it, so the name does nothing. Drop "
                    "--algorithm.advantage.estimator, or --algorithm.advantage.estimator-path to use the built-in."
                )
            return self  # a custom estimator gets every parameter
        refuse_unread_params(
            self,
            ["eps", "gamma", "lam"],
            prefix="algorithm.advantage",
            choice_key="estimator",
            registry=ESTIMATORS,
            what="an estimator",
        )
        return self


class LossConfig(_Section):
    """The per-token policy loss, its clip bounds, the entropy bonus and the aggregation to a scalar."""

    policy_loss: PolicyLoss = Field(
        "ppo",
        description="ppo: clipped token ratio (GRPO/DAPO/PPO); gspo: clipped length-normalized sequence ratio, use "
        "clip 3e-4/4e-4 and seq_mean_token_mean (arXiv:2507.18071); cispo: clipped stop-gradient IS weight times "
        "log-prob (arXiv:2506.13585); sft: negative log-likelihood of the loss-masked tokens (advantages unused; "
        "with rollout.mode sft).",
    )
    policy_loss_path: str = Field(
        "",
        description="module:attr of a custom policy loss fn(log_probs, old_log_probs, advantages, loss_mask, "
        "params: LossParams) -> (token_loss [B, T], clipped [B, T] bool); replaces policy_loss and receives every "
        "clip parameter. Empty = the built-in loss.",
    )
    reducer_path: str = Field(
        "",
        description="module:attr of a custom aggregation fn(token_loss, loss_mask, num_tokens, num_sequences) -> "
        "scalar, with global counts; replaces aggregation. Empty = the built-in aggregation.",
    )
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO lower clip: ratio >= 1 - clip_low.")
    clip_high: float = Field(
        0.2,
        ge=0.0,
        description="PPO upper clip: ratio <= 1 + clip_high. 0.28 = DAPO clip-higher (arXiv:2503.14476); "
        "equal to clip_low gives plain PPO/GRPO.",
    )
    dual_clip_c: float = Field(
        0.0,
        ge=0.0,
        description="Dual-clip constant c (> 1, typically 3): caps the loss of negative-advantage tokens at "
        "c * |A| (arXiv:1912.09729); 0 disables. policy_loss ppo only.",
    )
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="Per-token loss -> scalar. token_mean: DAPO; seq_mean_token_mean: GRPO paper, GSPO; "
        "seq_mean_token_sum_norm: Dr.GRPO (divides by the longest response: rollout.sampling.max_new_tokens, "
        "rollout.multi_turn.max_response_tokens with rollout.mode multi_turn).",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Entropy bonus weight (loss -= coef * entropy); 0 = entropy is only a metric."
    )

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.clip_high < self.clip_low:
            raise ValueError(
                f"algorithm.loss.clip_high ({self.clip_high}) is below algorithm.loss.clip_low ({self.clip_low}); "
                "clip-higher (DAPO) raises the upper bound, never lowers it. Set --algorithm.loss.clip-high >= "
                "clip_low."
            )
        if self.dual_clip_c and self.dual_clip_c <= 1.0:
            raise ValueError(
                f"algorithm.loss.dual_clip_c is {self.dual_clip_c}; dual clip caps ppo's loss at c*|A| and needs "
                "c > 1 to leave the clipped objective intact. Set --algorithm.loss.dual-clip-c 3, or 0 to disable."
            )
        if self.reducer_path and changed_fields(self, ["aggregation"]):
            raise ValueError(
                f"algorithm.loss.aggregation is {self.aggregation!r} but algorithm.loss.reducer_path "
                f"({self.reducer_path!r}) replaces it, so it does nothing. Drop --algorithm.loss.aggregation, or "
                "--algorithm.loss.reducer-path to use the built-in aggregation."
            )
        if self.policy_loss_path:
            return self  # a custom loss gets every parameter
        refuse_unread_params(
            self,
            ["clip_low", "clip_high", "dual_clip_c"],
            prefix="algorithm.loss",
            choice_key="policy_loss",
            registry=POLICY_LOSSES,
            what="a policy loss",
        )
        return self


class KLConfig(_Section):
    """KL divergence to the frozen reference model (``models.reference``), as a loss term or a reward penalty."""

    coef: float = Field(
        gt=0.0,
        description="Weight of the KL to the reference (required when algorithm.kl is on). Typical: 0.001 as a "
        "reward penalty (PPO, REINFORCE++), 0.001-0.04 as a loss term (GRPO arXiv:2402.03300 used 0.04).",
    )
    estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3",
        description="KL estimator (Schulman 2020): k3 is unbiased and low-variance (GRPO's choice); low_var_kl "
        "is k3 clamped to [-10, 10]; k1 is the usual choice for a reward penalty.",
    )
    mode: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: differentiable KL term added to the loss (GRPO); reward: per-token penalty "
        "-coef * KL(old || ref) added to the rewards before advantages (PPO/REINFORCE++).",
    )


class RolloutCorrectionConfig(_Section):
    """Corrections for the mismatch between the engine's sampling policy and the trainer's (pi_rollout vs pi_old).

    The ``train_rollout_*`` mismatch metrics are measured whenever the engine returns log-probs, with or without
    this section.
    """

    importance_sampling: Literal["none", "tis", "mis", "icepop"] = Field(
        "tis",
        description="Weight from rho = pi_old / pi_rollout (no grad): tis clamps rho to [lower, upper], mis zeroes "
        "it outside, icepop = mis per token (arXiv:2510.18855); none: no weight (for opsm alone).",
    )
    level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="Where rho is measured (tis/mis): token, sequence (product of token ratios) or geometric "
        "(per-token geometric mean of the sequence). icepop is always per token.",
    )
    lower: float = Field(0.0, ge=0.0, le=1.0, description="Lower bound of rho (tis/mis/icepop).")
    upper: float = Field(2.0, ge=1.0, description="Upper bound of rho (tis/mis/icepop); TIS uses ~2, IcePop [0.5, 5].")
    opsm: bool = Field(
        False,
        description="Off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556): drop negative-advantage "
        "sequences whose mean log(pi_rollout / pi_theta) exceeds opsm_threshold.",
    )
    opsm_threshold: float = Field(0.05, ge=0.0, description="OPSM divergence threshold delta, nats per token (opsm).")

    @model_validator(mode="after")
    def _check(self) -> RolloutCorrectionConfig:
        if self.importance_sampling == "none" and not self.opsm:
            raise ValueError(
                "algorithm.rollout_correction is on but algorithm.rollout_correction.importance_sampling is 'none' "
                "and opsm is false, so it corrects nothing. Set --algorithm.rollout-correction.importance-sampling "
                "tis (or --algorithm.rollout-correction.opsm true), or turn it off: "
                "--algorithm.rollout-correction null."
            )
        off = {"level", "lower", "upper"} if self.importance_sampling == "none" else set()
        if self.importance_sampling == "icepop":
            off = {"level"}
        for name in changed_fields(self, ["level", "lower", "upper"]):
            if name in off:
                raise ValueError(
                    f"algorithm.rollout_correction.{name} is {getattr(self, name)!r} but "
                    f"algorithm.rollout_correction.importance_sampling is {self.importance_sampling!r}, which never "
                    f"reads it. Drop {_flag('algorithm.rollout_correction.' + name)}, or set "
                    "--algorithm.rollout-correction.importance-sampling tis (or mis)."
                )
        if not self.opsm and changed_fields(self, ["opsm_threshold"]):
            raise ValueError(
                f"algorithm.rollout_correction.opsm_threshold is {self.opsm_threshold} but "
                "algorithm.rollout_correction.opsm is false, so it does nothing. Set "
                "--algorithm.rollout-correction.opsm true, or drop --algorithm.rollout-correction.opsm-threshold."
            )
        return self


class DynamicSamplingConfig(_Section):
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and generate more prompts
    until rollout.rollout_batch_size groups are kept (arXiv:2503.14476)."""

    max_rounds: int = Field(
        3,
        ge=1,
        description="Generation rounds per step (the first included); if the batch is still short after them the "
        "step fails with an error naming the filtered counts.",
    )
    over_sample: float = Field(
        1.0,
        ge=1.0,
        description="Extra rounds ask for this factor times the missing groups (DAPO over-samples, since many "
        "groups are filtered again); 1.0 = exactly the missing ones.",
    )
    filter_path: str = Field(
        "",
        description="module:attr of a custom group filter fn(group: list[Sample]) -> bool (True = keep) "
        "replacing the zero-variance test. Empty = the built-in test.",
    )


class OverlongConfig(_Section):
    """DAPO's treatment of responses cut at ``rollout.sampling.max_new_tokens`` (arXiv:2503.14476)."""

    filter: bool = Field(
        False,
        description="Overlong filtering: samples cut at max_new_tokens (finish reason 'length') are not trained "
        "(loss mask 0) but still count in their group's reward statistics.",
    )
    buffer_len: int = Field(
        0,
        ge=0,
        description="Soft overlong punishment (Eq. 13): the last N tokens before max_new_tokens ramp a reward "
        "penalty from 0 to -penalty_factor; 0 disables.",
    )
    penalty_factor: float = Field(
        1.0, ge=0.0, description="Penalty at max_new_tokens (soft overlong punishment, buffer_len > 0)."
    )

    @model_validator(mode="after")
    def _check(self) -> OverlongConfig:
        if not self.buffer_len and changed_fields(self, ["penalty_factor"]):
            raise ValueError(
                f"algorithm.overlong.penalty_factor is {self.penalty_factor} but algorithm.overlong.buffer_len is 0 "
                "(soft overlong punishment off), so it does nothing. Set --algorithm.overlong.buffer-len N (DAPO: a "
                "quarter of max_new_tokens), or drop --algorithm.overlong.penalty-factor."
            )
        return self


class AlgorithmConfig(_Section):
    """Advantage estimator, policy loss and their optional terms. GRPO, Dr.GRPO and DAPO are values of one path;
    see docs/algorithms.md for the config of each algorithm."""

    advantage: AdvantageConfig = Field(
        default_factory=AdvantageConfig, description="Advantage estimator and its parameters."
    )
    loss: LossConfig = Field(default_factory=LossConfig, description="Policy loss, clip bounds, entropy, aggregation.")
    kl: Annotated[KLConfig | None, ON_OFF] = Field(
        None,
        description="KL to the reference model; null (the default) = off, and no reference model is held. Any "
        "--algorithm.kl.KEY turns it on (coef is required); --algorithm.kl null turns it off.",
    )
    rollout_correction: Annotated[RolloutCorrectionConfig | None, ON_OFF] = Field(
        None,
        description="TIS/MIS/icepop weights and OPSM against the engine/trainer mismatch; null (the default) = off "
        "(the train_rollout_* metrics still measure the mismatch).",
    )
    dynamic_sampling: Annotated[DynamicSamplingConfig | None, ON_OFF] = Field(
        None, description="DAPO dynamic sampling; null (the default) = off: every generated group is trained."
    )
    overlong: OverlongConfig = Field(
        default_factory=OverlongConfig, description="DAPO overlong filtering and soft overlong punishment."
    )
    reward_post_process_path: str = Field(
        "",
        description="module:attr of fn(samples, rewards [B] float32) -> rewards [B] float32, applied after "
        "scoring and overlong shaping, before advantages. Empty = none.",
    )
    buffer_filter_path: str = Field(
        "",
        description="module:attr of fn(groups: list[list[Sample]]) -> list[list[Sample]] choosing which of a step's "
        "scored groups to train on (after dynamic sampling, before advantages; every loop mode); the dropped ones "
        "count in buffer/filtered_groups. Empty = train on all.",
    )


# Plugin keys and the positional arguments their callables must accept.
PLUGIN_ARITY = {
    "algorithm.advantage.estimator_path": 2,  # (inputs: AdvantageInputs, params: AdvantageParams) -> (adv, returns)
    "algorithm.loss.policy_loss_path": 5,  # (log_probs, old_log_probs, advantages, loss_mask, params) -> (loss, clip)
    "algorithm.loss.reducer_path": 4,  # (token_loss, loss_mask, num_tokens, num_sequences) -> scalar
    "algorithm.reward_post_process_path": 2,  # (samples, rewards [B] float32) -> rewards [B] float32
    "algorithm.dynamic_sampling.filter_path": 1,  # (group: list[Sample]) -> bool keep | (keep, reason)
    "algorithm.buffer_filter_path": 1,  # (groups: list[list[Sample]]) -> the groups to train on
}


def plugin_paths(algorithm: AlgorithmConfig) -> dict[str, str]:
    """The ``module:attr`` plugins an algorithm section names, by dotted key (set ones only)."""
    ds = algorithm.dynamic_sampling
    paths = {
        "algorithm.advantage.estimator_path": algorithm.advantage.estimator_path,
        "algorithm.loss.policy_loss_path": algorithm.loss.policy_loss_path,
        "algorithm.loss.reducer_path": algorithm.loss.reducer_path,
        "algorithm.reward_post_process_path": algorithm.reward_post_process_path,
        "algorithm.dynamic_sampling.filter_path": ds.filter_path if ds is not None else "",
        "algorithm.buffer_filter_path": algorithm.buffer_filter_path,
    }
    return {key: path for key, path in paths.items() if path}


def load_algorithm_plugins(algorithm: AlgorithmConfig) -> dict[str, Callable[..., Any]]:
    """Import every plugin the section names and check its signature (build time, not validation).

    Returns: the callables by dotted key.
    Raises: ValueError for a malformed path; ImportError / AttributeError / TypeError naming the key.
    """
    from miles.core.plugins import load_plugin

    return {
        key: load_plugin(path, key=key, num_positional=PLUGIN_ARITY[key])
        for key, path in plugin_paths(algorithm).items()
    }
