"""Config sections owned by miles-core: rollout batch arithmetic and sampling, evaluation, the models an algorithm
trains and reads, execution, the loop, and the rules across them and the algorithm section
(``miles.core.algorithms.config``). Each is frozen, forbids unknown keys and documents every field; validation
reads no file (model paths are checked when a run is built)."""

from __future__ import annotations

from typing import Annotated, Literal

from miles.core.algorithms.config import (
    ON_OFF,
    AdvantageConfig,
    AlgorithmConfig,
    DynamicSamplingConfig,
    KLConfig,
    LossConfig,
    OverlongConfig,
    RolloutCorrectionConfig,
    changed_fields,
)
from miles.core.algorithms.registry import ESTIMATORS, POLICY_LOSSES
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "AdvantageConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DynamicSamplingConfig",
    "EvalConfig",
    "ExecutionConfig",
    "KLConfig",
    "LoopConfig",
    "LossConfig",
    "ModelsConfig",
    "OverlongConfig",
    "PolicyModelConfig",
    "ReferenceModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SamplingConfig",
    "TeacherConfig",
    "check_group_size",
    "check_models",
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingConfig(_Section):
    """How the engine samples; the trainer scores tokens under the same temperature.

    Engines and the trainer report log-probs of the untruncated softmax(logits / temperature), so training
    rollouts (``rollout.sampling``) must sample from it: top_p 1.0 and top_k 0 there (``RolloutConfig`` refuses
    others). Evaluation (``eval.sampling``) may truncate freely: its log-probs are never trained on.
    """

    temperature: float = Field(1.0, gt=0.0, description="Softmax temperature; log-probs use logits / temperature.")
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling mass; 1.0 (the default) disables it. eval.sampling only: rollout.sampling "
        "must keep 1.0, since engine and trainer log-probs are those of the untruncated distribution.",
    )
    top_k: int = Field(
        0,
        ge=0,
        description="Keep the k most likely tokens; 0 (the default) disables it. eval.sampling only: "
        "rollout.sampling must keep 0, since engine and trainer log-probs are those of the untruncated distribution.",
    )
    max_new_tokens: int = Field(48, ge=1, description="Response length limit in tokens; hitting it = truncated.")


class RolloutConfig(_Section):
    """How many prompts and samples each step generates and how they are split into optimizer steps."""

    rollout_batch_size: int = Field(8, ge=1, description="Prompts per rollout step.")
    n_samples_per_prompt: int = Field(
        8, ge=1, description="Samples per prompt (the group size). GRPO needs >= 2; 8 is typical."
    )
    global_batch_size: int = Field(
        0,
        ge=0,
        description="Samples per optimizer step; 0 means all samples of a rollout (one optimizer step per rollout). "
        "Must divide rollout_batch_size * n_samples_per_prompt.",
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig,
        description="Sampling for training rollouts: temperature and max_new_tokens; top_p must stay 1.0 and top_k "
        "0, because the trainer's and the engine's log-probs are those of the untruncated distribution, so a "
        "truncated sampler would make the PPO ratio and the TIS/MIS corrections compare different distributions.",
    )
    mode: Literal["generate", "sft"] = Field(
        "generate",
        description="generate: the engine samples the responses (RL); sft: the response is the data's reference "
        "answer (teacher forcing, no generation), trained on assistant tokens with algorithm.loss.policy_loss sft.",
    )
    seed: int = Field(1234, description="Seed of the engine's sampler (each step derives its own).")

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def steps_per_rollout(self) -> int:
        gbs = self.global_batch_size or self.samples_per_rollout
        return self.samples_per_rollout // gbs

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        for key, value, off, flag in (
            ("top_p", self.sampling.top_p, 1.0, "--rollout.sampling.top-p 1.0"),
            ("top_k", self.sampling.top_k, 0, "--rollout.sampling.top-k 0"),
        ):
            if value != off:
                raise ValueError(
                    f"rollout.sampling.{key} is {value}, but training rollouts must sample the full distribution: "
                    "the engine and the trainer report log-probs of the untruncated softmax(logits / temperature), so "
                    "the PPO ratio and the TIS/MIS corrections would compare log-probs of different distributions. "
                    f"Set {flag} (truncated sampling is fine for evaluation: --eval.sampling.{key.replace('_', '-')})."
                )
        gbs = self.global_batch_size or self.samples_per_rollout
        if self.samples_per_rollout % gbs:
            raise ValueError(
                f"rollout.global_batch_size is {gbs}, but rollout_batch_size x n_samples_per_prompt = "
                f"{self.rollout_batch_size} x {self.n_samples_per_prompt} = {self.samples_per_rollout} samples is not "
                "a multiple of it, so some samples would never be trained. Set --rollout.global-batch-size to a "
                "divisor of that product (or 0 for one optimizer step per rollout)."
            )
        return self


class EvalConfig(_Section):
    """Held-out evaluation on fixed prompts with its own sampling settings."""

    interval: int = Field(0, ge=0, description="Evaluate every N steps; 0 = only before the first and after the last.")
    num_prompts: int = Field(32, ge=0, description="Fixed held-out prompts; 0 disables evaluation.")
    n_samples_per_prompt: int = Field(4, ge=1, description="Samples per eval prompt; eval/reward is their mean.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling used for evaluation.")

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if not self.num_prompts and self.interval:
            raise ValueError(
                f"eval.interval is {self.interval} but eval.num_prompts is 0 (evaluation off), so no evaluation "
                "would run. Set --eval.num-prompts 32 (or more), or drop --eval.interval."
            )
        return self


class PolicyModelConfig(_Section):
    """The policy: the model being trained and served by the engine."""

    path: str = Field(
        "smollm2-135m-instruct",
        description="A model name registered in miles.recipes (smollm2-135m-instruct) or a local HF model directory "
        "(config.json + safetensors + tokenizer). Checked when the run is built.",
    )


class ReferenceModelConfig(_Section):
    """The frozen reference of the KL terms, held only while algorithm.kl is on."""

    path: str = Field(
        "",
        description="Registered name or HF model directory of the reference (same tokenizer as the policy); empty "
        "= the policy's initial weights (models.policy.path), the usual choice. Loaded only when algorithm.kl is on.",
    )


class CriticConfig(_Section):
    """The critic of advantage 'gae': a scalar value head on a causal-LM backbone, trained alongside the policy."""

    path: str = Field(
        "",
        description="Registered name or HF model directory initializing the critic's backbone (a random value head "
        "is added); empty = the policy model (models.policy.path).",
    )
    lr: float = Field(1e-5, gt=0.0, description="AdamW peak learning rate of the critic (train.warmup_steps applies).")
    value_clip: float = Field(
        0.2, gt=0.0, description="Critic value clipping range around the rollout-time values, in reward units."
    )


class TeacherConfig(_Section):
    """The frozen teacher of on-policy distillation (advantage 'opd')."""

    path: str = Field(
        min_length=1,
        description="Registered name or HF model directory of the teacher (required when models.teacher is on); "
        "it must share the policy's tokenizer and vocabulary.",
    )
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="Temperature of the teacher's log-probs: log softmax(teacher_logits / T). The student uses "
        "rollout.sampling.temperature; set both equal to distill the sampled distributions.",
    )


class ModelsConfig(_Section):
    """The models a run holds: the policy and, as the algorithm needs them, reference, critic and teacher."""

    policy: PolicyModelConfig = Field(default_factory=PolicyModelConfig, description="The policy model.")
    reference: ReferenceModelConfig = Field(
        default_factory=ReferenceModelConfig, description="The KL reference (held only while algorithm.kl is on)."
    )
    critic: Annotated[CriticConfig | None, ON_OFF] = Field(
        None,
        description="The critic; required by advantage 'gae' (which trains it) and refused otherwise. null (the "
        "default) = no critic; --models.critic.lr 1e-5 (any key) turns it on with the policy as its backbone.",
    )
    teacher: Annotated[TeacherConfig | None, ON_OFF] = Field(
        None,
        description="The teacher; required by advantage 'opd' (and allowed with a custom estimator, which gets "
        "its log-probs), refused otherwise. null (the default) = no teacher.",
    )


class ExecutionConfig(_Section):
    """Where the components run."""

    mode: Literal["local"] = Field(
        "local",
        description="local: engine, trainer and loop in this one process, no cluster to start (the only mode "
        "today; a Ray mode across processes and machines is planned).",
    )


class LoopConfig(_Section):
    """The training loop: which loop, how long, how often to save."""

    mode: Literal["sync"] = Field(
        "sync",
        description="sync: generate, then train, then push weights, one step at a time (the only loop today; "
        "one-step-off and fully asynchronous loops are planned).",
    )
    num_steps: int = Field(12, ge=1, description="Rollout steps (each: generate, score, train, push weights).")
    save_interval: int = Field(
        5,
        ge=0,
        description="Save a checkpoint every N steps and after the last; 0 = only after the last. A stop by "
        "Ctrl-C/SIGTERM also saves after the step it finishes. A SmolLM2-135M checkpoint (fp32 weights + AdamW "
        "state) is ~1.6 GB and takes a few seconds on CPU.",
    )
    keep_checkpoints: int = Field(
        2,
        ge=0,
        description="Keep only the newest N checkpoints (older ones are deleted after a newer one is published; "
        "the one `latest` names always stays); 0 keeps all. 2 (the default) still leaves a complete previous "
        "checkpoint while the next one is written.",
    )


def check_group_size(rollout: RolloutConfig, algorithm: AlgorithmConfig) -> None:
    """Refuse algorithms that need groups of at least two samples per prompt when ``rollout`` gives one.

    A rule across two sections: the root config (``miles.recipes.config``) applies it at validation, and
    ``train_sync`` again at its start, for loops driven from a user script.
    Raises: ValueError naming the key, the value, why nothing would be learned and the fix.
    """
    n, advantage = rollout.n_samples_per_prompt, algorithm.advantage
    group_baseline = ESTIMATORS[advantage.estimator].group_baseline and not advantage.estimator_path
    if group_baseline and not POLICY_LOSSES[algorithm.loss.policy_loss].supervised and n < 2:
        raise ValueError(
            f"rollout.n_samples_per_prompt is {n}, but advantage '{advantage.estimator}' needs at least 2: its "
            "baseline is the group (the mean of the prompt's samples), so a group of one always gets advantage 0 "
            "and nothing is learned. Set --rollout.n-samples-per-prompt 4 (or more), or pick an estimator without "
            "a group baseline (--algorithm.advantage.estimator reinforce_plus_plus or gae)."
        )
    if algorithm.dynamic_sampling is not None and n < 2:
        raise ValueError(
            f"algorithm.dynamic_sampling is on with rollout.n_samples_per_prompt {n}: a group of one never "
            "has reward variance, so every group would be filtered. Set --rollout.n-samples-per-prompt 4 (or "
            "more), or --algorithm.dynamic-sampling null."
        )


def uses_critic(advantage: AdvantageConfig) -> bool:
    """The built-in estimator trains a critic (a custom ``estimator_path`` never gets one)."""
    return ESTIMATORS[advantage.estimator].critic and not advantage.estimator_path


def check_models(models: ModelsConfig, algorithm: AlgorithmConfig) -> None:
    """Refuse a model the algorithm never reads, and an algorithm without the model it needs (registry-derived).

    Raises: ValueError naming both keys and the fix.
    """
    advantage = algorithm.advantage
    estimator = advantage.estimator
    if uses_critic(advantage) and models.critic is None:
        raise ValueError(
            f"algorithm.advantage.estimator is {estimator!r}, which trains a critic, but models.critic is off. "
            "Turn it on: --models.critic.lr 1e-5 (its backbone defaults to the policy; --models.critic.path "
            "another model), or pick an estimator without a critic."
        )
    if models.critic is not None and not uses_critic(advantage):
        what = "a custom estimator_path" if advantage.estimator_path else f"{estimator!r}"
        raise ValueError(
            f"models.critic is set but algorithm.advantage.estimator is {what}, which never reads critic values, so "
            "the critic would be trained for nothing. Set --algorithm.advantage.estimator gae, or turn it off: "
            "--models.critic null."
        )
    needs_teacher = "teacher_log_probs" in ESTIMATORS[estimator].needs and not advantage.estimator_path
    if needs_teacher and models.teacher is None:
        raise ValueError(
            f"algorithm.advantage.estimator is {estimator!r} but models.teacher is off: on-policy distillation "
            "needs a teacher's log-probs. Set --models.teacher.path /path/to/teacher (same tokenizer)."
        )
    if models.teacher is not None and not needs_teacher and not advantage.estimator_path:
        raise ValueError(
            f"models.teacher is set but algorithm.advantage.estimator is {estimator!r}, which never reads teacher "
            "log-probs, so the teacher would be loaded for nothing. Set --algorithm.advantage.estimator opd, or turn "
            "it off: --models.teacher null."
        )
    if algorithm.kl is None and changed_fields(models.reference, ["path"]):
        raise ValueError(
            f"models.reference.path is {models.reference.path!r} but algorithm.kl is off, so no reference is held. "
            "Turn KL on (--algorithm.kl.coef 0.001), or drop --models.reference.path."
        )
