"""PolicyObjective on edge-case micro-batches."""

import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.batch import build_train_batch
from miles.core.config import AlgorithmConfig
from miles.core.sample import Sample, SampleStatus


def test_a_micro_batch_of_empty_responses_has_a_max_mismatch_of_0_not_an_error():
    """Regression: a micro-batch holding only samples aborted before their first token has no response column, and
    ``amax()`` of it raised (a fully_async run whose resubmitted requests were aborted again, CI of c98cebf)."""
    samples = [
        Sample(index=i, group_index=0, prompt=[1], tokens=[1, 2], response_length=0, rollout_log_probs=[],
               status=SampleStatus.ABORTED)
        for i in range(2)
    ]  # fmt: skip
    batch = build_train_batch(samples, torch.zeros(2), pad_token_id=0).slice(0, 2)  # a micro-batch: trimmed columns
    assert batch.loss_mask.shape == (2, 0) and batch.rollout_log_probs is not None
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=4)
    loss, metrics = objective.loss(batch, torch.zeros(2, 0, requires_grad=True), None, LossCounts(4, 2))
    assert metrics["train_rollout_logprob_abs_diff_max"].item() == 0.0
    assert metrics["train_rollout_logprob_abs_diff"].item() == 0.0 and loss.item() == 0.0


def test_a_batch_without_signal_keeps_a_row_that_has_trained_tokens_for_the_metrics():
    """Regression (same run): the one row kept when no row has a non-zero advantage was row 0, there a sample aborted
    before its first token, so the step's only micro-batch had no column to measure."""
    empty = Sample(index=0, group_index=0, prompt=[1], tokens=[1, 2], response_length=0, rollout_log_probs=[],
                   status=SampleStatus.ABORTED)  # fmt: skip
    done = Sample(index=1, group_index=0, prompt=[1], tokens=[1, 2, 5, 6], response_length=2,
                  rollout_log_probs=[-1.0, -1.0], status=SampleStatus.COMPLETED)  # fmt: skip
    batch = build_train_batch([empty, done], torch.zeros(2), pad_token_id=0, trained=[False, True])
    kept, skipped = PolicyObjective(AlgorithmConfig(), max_new_tokens=4).select_rows(batch, world_size=1)
    assert skipped == 1 and kept.response_lengths.tolist() == [2]
