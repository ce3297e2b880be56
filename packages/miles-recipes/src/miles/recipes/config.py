"""The root config tree: each section is owned by its package; this module composes and validates them."""

from __future__ import annotations

from pathlib import Path

from miles.core.algorithms.registry import POLICY_LOSSES
from miles.core.config import AlgorithmConfig, EvalConfig, LoopConfig, RolloutConfig, check_group_size
from miles.recipes.registry import MODELS
from miles.rollout.config import DataConfig, EngineConfig, RewardConfig
from miles.train.config import TrainConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelConfig(BaseModel):
    """The policy model."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str = Field(
        "smollm2-135m-instruct",
        description="A registered model name (smollm2-135m-instruct) or a local HF model directory (config.json + "
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
        self._check_algorithm()
        if self.reward.type == "reasoning_gym" and self.data.source != "reasoning_gym":
            raise ValueError(
                "reward.type is 'reasoning_gym' but data.source is "
                f"{self.data.source!r}: that scorer needs reasoning-gym entries as labels. "
                "Set --reward.type math (for GSM8K-style answers) or custom."
            )
        path = self.model.path
        if path not in MODELS and not (Path(path).expanduser() / "config.json").is_file():
            raise ValueError(
                f"model.path is {path!r}: not a registered model {sorted(MODELS)} and not a directory with "
                "config.json. Pass --model.path smollm2-135m-instruct or a local HF model directory."
            )
        if self.train.world_size != 1:
            raise ValueError(
                f"train.world_size is {self.train.world_size}; the `miles train` loop runs FSDP2 in-process with "
                "world size 1 (world size 2 is exercised by the backend tests with spawned gloo ranks). "
                "Set --train.world-size 1."
            )
        return self

    def _check_algorithm(self) -> None:
        """Refuse algorithm settings that would silently do nothing with this rollout shape."""
        algorithm = self.algorithm
        check_group_size(self.rollout, algorithm)  # group baselines and dynamic sampling need n >= 2
        if (self.rollout.mode == "sft") != POLICY_LOSSES[algorithm.policy_loss].supervised:
            raise ValueError(
                f"rollout.mode is {self.rollout.mode!r} but algorithm.policy_loss is {algorithm.policy_loss!r}: "
                "supervised fine-tuning needs both (reference answers as responses, trained by likelihood), and "
                "either alone trains on nothing useful. Set --rollout.mode sft --algorithm.policy-loss sft "
                "together, or neither."
            )
        from pathlib import Path

        from miles.recipes.registry import MODELS

        for key, path in (
            ("algorithm.teacher_path", algorithm.teacher_path),
            ("algorithm.critic_path", algorithm.critic_path),
        ):
            if path and path not in MODELS and not (Path(path).expanduser() / "config.json").is_file():
                raise ValueError(
                    f"{key} is {path!r}: not a registered model {sorted(MODELS)} and not a directory with "
                    f"config.json. Pass --{key.replace('_', '-')} with a registered name or a local HF model directory."
                )
        max_len = self.rollout.sampling.max_new_tokens
        if algorithm.overlong_buffer_len > max_len:
            raise ValueError(
                f"algorithm.overlong_buffer_len is {algorithm.overlong_buffer_len}, longer than "
                f"rollout.sampling.max_new_tokens {max_len}: the penalty ramp must fit inside the length limit. "
                f"Set --algorithm.overlong-buffer-len to at most {max_len} (DAPO: a quarter of it)."
            )
