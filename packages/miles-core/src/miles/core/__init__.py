"""miles.core: Sample and batch types, protocols, RL algorithms, config sections and the training loop."""

from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.batch import TrainBatch, build_train_batch, split_micro_batches
from miles.core.config import AlgorithmConfig, EvalConfig, LoopConfig, RolloutConfig, SamplingConfig
from miles.core.loop import Components, run_step, train, train_step
from miles.core.protocols import (
    DataSource,
    Engine,
    GenerateOutput,
    GenerateRequest,
    GroupGenerateFn,
    MetricsSink,
    RewardFn,
    TrainBackend,
    WeightPublisher,
)
from miles.core.publisher import EnginePublisher
from miles.core.rewards import score_samples
from miles.core.sample import Sample, SampleStatus, group_samples

__all__ = [
    "AlgorithmConfig",
    "Components",
    "DataSource",
    "Engine",
    "EnginePublisher",
    "EvalConfig",
    "GenerateOutput",
    "GenerateRequest",
    "GroupGenerateFn",
    "LossCounts",
    "LoopConfig",
    "MetricsSink",
    "PolicyObjective",
    "RewardFn",
    "RolloutConfig",
    "Sample",
    "SampleStatus",
    "SamplingConfig",
    "TrainBackend",
    "TrainBatch",
    "WeightPublisher",
    "build_train_batch",
    "group_samples",
    "run_step",
    "score_samples",
    "split_micro_batches",
    "train_step",
    "train",
]
