"""The root config tree: each section is owned by its package; this module composes and validates them."""

from __future__ import annotations

from miles.core.config import AlgorithmConfig, EvalConfig, LoopConfig, RolloutConfig
from miles.rollout.config import DataConfig, EngineConfig, RewardConfig
from miles.train.config import TrainConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator

# Advantage estimators whose baseline is the group: a group of one sample has no signal.
GROUP_BASELINE_ESTIMATORS = ("grpo", "dr_grpo")


class ModelConfig(BaseModel):
    """The policy model."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str = Field(
        "smollm2-135m-instruct",
        description="A registered model name (see `miles models`) or a local HF model directory (config.json + "
        "safetensors + tokenizer).",
    )


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
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt source.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Batch arithmetic and sampling.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Inference engine.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages and loss.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training backend.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    loop: LoopConfig = Field(default_factory=LoopConfig, description="Steps and checkpoint cadence.")
    run: RunConfig = Field(default_factory=RunConfig, description="Outputs and process settings.")

    @model_validator(mode="after")
    def _check(self) -> MilesConfig:
        n = self.rollout.n_samples_per_prompt
        if self.algorithm.advantage_estimator in GROUP_BASELINE_ESTIMATORS and n < 2:
            raise ValueError(
                f"rollout.n_samples_per_prompt is {n}, but advantage '{self.algorithm.advantage_estimator}' needs "
                "at least 2: advantages are rewards minus the group mean, so a group of one always gets 0 and "
                "nothing is learned. Set --rollout.n-samples-per-prompt 4 (or more)."
            )
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
