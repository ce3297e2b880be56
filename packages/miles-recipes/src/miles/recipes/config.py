"""The root config tree: each section is owned by its package; this module composes them and checks the rules
across sections. Validation is pure (no file read, no plugin imported, no model resolved), so a cluster recipe
validates on a laptop; ``miles.recipes.run.build_inputs`` checks files, models and plugins when a run is built."""

from __future__ import annotations

from typing import Any

from miles.core.algorithms.registry import POLICY_LOSSES
from miles.core.config import (
    AlgorithmConfig,
    EvalConfig,
    ExecutionConfig,
    LoopConfig,
    ModelsConfig,
    RolloutConfig,
    check_group_size,
    check_models,
)
from miles.rollout.config import DataConfig, EmbeddedEngineConfig, EngineConfig, RewardConfig
from miles.train.config import TrainConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator


class RunConfig(BaseModel):
    """Where outputs go and how the process runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field("", description="Run directory name under run.dir; empty = '<recipe>-<timestamp>'.")
    dir: str = Field("runs", description="Parent directory of run directories.")
    num_threads: int = Field(
        0, ge=0, description="torch intra-op threads; 0 = one per core. Use 1 when another job shares the cores."
    )
    progress: bool = Field(True, description="Show a console progress bar with the key metrics.")


class MilesConfig(BaseModel):
    """Everything a run needs; validated as a whole before anything is loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    models: ModelsConfig = Field(default_factory=ModelsConfig, description="Policy, reference, critic, teacher.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt source.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Batch arithmetic and sampling.")
    engine: EngineConfig = Field(
        default_factory=EmbeddedEngineConfig, description="Inference engine, chosen by engine.type."
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages, loss and terms.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training backend.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig, description="Where the components run.")
    loop: LoopConfig = Field(default_factory=LoopConfig, description="Loop kind, steps and checkpoint cadence.")
    run: RunConfig = Field(default_factory=RunConfig, description="Outputs and process settings.")

    @model_validator(mode="after")
    def _check(self) -> MilesConfig:
        self._check_algorithm()
        if self.reward.type == "reasoning_gym" and self.data.source != "reasoning_gym":
            raise ValueError(
                "reward.type is 'reasoning_gym' but data.source is "
                f"{self.data.source!r}: that scorer needs reasoning-gym entries as labels. "
                "Set --reward.type math (for GSM8K-style answers) or custom."
            )
        if self.train.world_size != 1:
            raise ValueError(
                f"train.world_size is {self.train.world_size}; the `miles train` loop runs FSDP2 in-process with "
                "world size 1 (world size 2 is exercised by the backend tests with spawned gloo ranks). "
                "Set --train.world-size 1."
            )
        return self

    def _check_algorithm(self) -> None:
        """Refuse algorithm settings that would silently do nothing with this rollout shape or these models."""
        algorithm = self.algorithm
        check_group_size(self.rollout, algorithm)  # group baselines and dynamic sampling need n >= 2
        check_models(self.models, algorithm)  # critic, teacher and reference exactly as the algorithm reads them
        policy_loss = algorithm.loss.policy_loss
        if (self.rollout.mode == "sft") != POLICY_LOSSES[policy_loss].supervised:
            raise ValueError(
                f"rollout.mode is {self.rollout.mode!r} but algorithm.loss.policy_loss is {policy_loss!r}: "
                "supervised fine-tuning needs both (reference answers as responses, trained by likelihood), and "
                "either alone trains on nothing useful. Set --rollout.mode sft --algorithm.loss.policy-loss sft "
                "together, or neither."
            )
        max_len, buffer_len = self.rollout.sampling.max_new_tokens, algorithm.overlong.buffer_len
        if buffer_len > max_len:
            raise ValueError(
                f"algorithm.overlong.buffer_len is {buffer_len}, longer than rollout.sampling.max_new_tokens "
                f"{max_len}: the penalty ramp must fit inside the length limit. Set --algorithm.overlong.buffer-len "
                f"to at most {max_len} (DAPO: a quarter of it)."
            )


# Keys of the flat layout (Miles before the nested config) -> where they live now; for the messages that meet an
# old run's config.yaml or an old recipe/flag.
RENAMED_KEYS = {
    "model": "models.policy (model.path is now models.policy.path)",
    "model.path": "models.policy.path",
    **{
        f"algorithm.{old}": f"algorithm.{new}"
        for old, new in {
            "advantage_estimator": "advantage.estimator",
            "advantage_estimator_path": "advantage.estimator_path",
            "advantage_eps": "advantage.eps",
            "gamma": "advantage.gamma",
            "lam": "advantage.lam",
            "policy_loss": "loss.policy_loss",
            "policy_loss_path": "loss.policy_loss_path",
            "loss_reducer_path": "loss.reducer_path",
            "clip_low": "loss.clip_low",
            "clip_high": "loss.clip_high",
            "dual_clip_c": "loss.dual_clip_c",
            "aggregation": "loss.aggregation",
            "entropy_coef": "loss.entropy_coef",
            "kl_coef": "kl.coef",
            "kl_estimator": "kl.estimator",
            "kl_mode": "kl.mode",
            "importance_sampling": "rollout_correction.importance_sampling",
            "importance_level": "rollout_correction.level",
            "importance_lower": "rollout_correction.lower",
            "importance_upper": "rollout_correction.upper",
            "opsm": "rollout_correction.opsm",
            "opsm_threshold": "rollout_correction.opsm_threshold",
            "dynamic_sampling": "dynamic_sampling (a section: null = off)",
            "dynamic_sampling_max_rounds": "dynamic_sampling.max_rounds",
            "dynamic_sampling_over_sample": "dynamic_sampling.over_sample",
            "dynamic_sampling_filter_path": "dynamic_sampling.filter_path",
            "overlong_filter": "overlong.filter",
            "overlong_buffer_len": "overlong.buffer_len",
            "overlong_penalty_factor": "overlong.penalty_factor",
        }.items()
    },
    "algorithm.critic_path": "models.critic.path",
    "algorithm.critic_lr": "models.critic.lr",
    "algorithm.value_clip": "models.critic.value_clip",
    "algorithm.teacher_path": "models.teacher.path",
    "algorithm.teacher_temperature": "models.teacher.temperature",
}


def flat_layout_key(raw: dict[str, Any]) -> str | None:
    """The first key of ``raw`` that belongs to the flat layout of an older Miles (see ``RENAMED_KEYS``), or None."""
    if isinstance(raw.get("model"), dict):
        return "model.path" if "path" in raw["model"] else "model"
    algorithm = raw.get("algorithm")
    if isinstance(algorithm, dict):
        for key in algorithm:
            if f"algorithm.{key}" in RENAMED_KEYS and key not in AlgorithmConfig.model_fields:
                return f"algorithm.{key}"
    return None
