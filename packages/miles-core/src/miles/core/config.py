"""Config sections owned by miles-core: the algorithm (advantages + loss), rollout batch arithmetic and
sampling, evaluation, and the loop. Each is frozen, forbids unknown keys and documents every field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingConfig(_Section):
    """How the engine samples; the trainer scores tokens under the same temperature."""

    temperature: float = Field(1.0, gt=0.0, description="Softmax temperature; log-probs use logits / temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1.0 disables it.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables it.")
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
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling for training rollouts.")
    seed: int = Field(1234, description="Seed of the engine's sampler (each step derives its own).")

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def steps_per_rollout(self) -> int:
        gbs = self.global_batch_size or self.samples_per_rollout
        return self.samples_per_rollout // gbs

    @model_validator(mode="after")
    def _check_batch_arithmetic(self) -> RolloutConfig:
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


AdvantageEstimator = Literal["grpo", "dr_grpo"]


class AlgorithmConfig(_Section):
    """Advantage estimator and policy loss. GRPO, Dr.GRPO and DAPO-style clipping are values of one path."""

    advantage_estimator: AdvantageEstimator = Field(
        "grpo",
        description="grpo: (r - group mean) / group std (arXiv:2402.03300); dr_grpo: r - group mean, no std "
        "(arXiv:2503.20783). Both need n_samples_per_prompt >= 2.",
    )
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO lower clip: ratio >= 1 - clip_low.")
    clip_high: float = Field(
        0.2,
        ge=0.0,
        description="PPO upper clip: ratio <= 1 + clip_high. 0.28 = DAPO clip-higher (arXiv:2503.14476); "
        "equal to clip_low gives plain PPO/GRPO.",
    )
    kl_coef: float = Field(
        0.0, ge=0.0, description="Weight of the KL-to-reference loss term; 0 skips the reference model entirely."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="KL estimator (Schulman 2020): k3 is unbiased and low-variance (GRPO's choice)."
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Entropy bonus weight (loss -= coef * entropy); 0 = entropy is only a metric."
    )
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="Per-token loss -> scalar. token_mean: DAPO; seq_mean_token_mean: GRPO paper; "
        "seq_mean_token_sum_norm: Dr.GRPO (divides by sampling.max_new_tokens).",
    )
    advantage_eps: float = Field(1e-6, gt=0.0, description="Added to the group std before dividing (grpo).")

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.clip_high < self.clip_low:
            raise ValueError(
                f"algorithm.clip_high ({self.clip_high}) is below algorithm.clip_low ({self.clip_low}); clip-higher "
                "(DAPO) raises the upper bound, never lowers it. Set --algorithm.clip-high >= clip_low."
            )
        return self


class LoopConfig(_Section):
    """The training loop: how long, how often to save."""

    num_steps: int = Field(12, ge=1, description="Rollout steps (each: generate, score, train, push weights).")
    save_interval: int = Field(0, ge=0, description="Save a checkpoint every N steps; 0 = only after the last.")
