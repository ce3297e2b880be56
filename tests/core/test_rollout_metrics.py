"""rollout_metrics: the per-dataset reward means of a data.mixture run, next to the unchanged overall metrics."""

import pytest
import torch
from miles.core.loop import rollout_metrics
from miles.core.sample import Sample, SampleStatus


def _sample(dataset, status=SampleStatus.COMPLETED):
    return Sample(index=0, group_index=0, prompt=[1], response_length=2, status=status, metadata={"dataset": dataset})


def test_reward_mean_per_dataset_counts_only_the_scored_samples_of_each():
    samples = [_sample("sums"), _sample("gsm8k"), _sample("sums", SampleStatus.FAILED), _sample("sums")]
    valid_rewards = torch.tensor([1.0, 0.25, 0.0])  # one per scored sample: sums, gsm8k, sums
    metrics = rollout_metrics(samples, valid_rewards)
    # sums: (1.0 + 0.0) / 2; gsm8k: 0.25 alone; overall: 1.25 / 3.
    assert metrics["reward/mean/sums"] == 0.5 and metrics["reward/mean/gsm8k"] == 0.25
    assert metrics["reward/mean"] == pytest.approx(1.25 / 3)


def test_samples_without_a_dataset_add_no_per_dataset_metric():
    samples = [Sample(index=0, group_index=0, prompt=[1], response_length=1, status=SampleStatus.COMPLETED)]
    metrics = rollout_metrics(samples, torch.tensor([1.0]))
    assert sorted(metrics) == ["response_length/mean", "reward/mean", "reward/std", "truncated_ratio"]
