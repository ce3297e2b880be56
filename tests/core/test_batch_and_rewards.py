import math

import pytest
import torch
from miles.core.batch import build_train_batch, split_micro_batches
from miles.core.rewards import score_samples
from miles.core.sample import Sample, SampleStatus, group_samples


def _sample(i, prompt, response, group=0, **kw):
    return Sample(index=i, group_index=group, prompt="", tokens=prompt + response, response_length=len(response), **kw)


def test_train_batch_right_pads_and_lays_response_columns_from_each_prompt_end():
    samples = [
        _sample(0, [5, 6], [7, 8, 9], rollout_log_probs=[-1.0, -2.0, -3.0]),
        _sample(1, [5, 6, 7, 8], [9], rollout_log_probs=[-0.5], loss_mask=[0]),
    ]
    batch = build_train_batch(samples, torch.tensor([1.0, -2.0]), pad_token_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]
    assert batch.attention_mask.tolist() == [[True] * 5, [True] * 5]
    assert batch.prompt_lengths.tolist() == [2, 4] and batch.response_lengths.tolist() == [3, 1]
    assert batch.loss_mask.tolist() == [[True, True, True], [False, False, False]]
    assert batch.advantages.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]  # 0 wherever the mask is False
    assert batch.rollout_log_probs.tolist() == [[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]]


def test_untrained_samples_are_fully_masked():
    samples = [_sample(0, [1], [2, 3]), _sample(1, [1], [2])]
    batch = build_train_batch(samples, torch.tensor([1.0, 1.0]), pad_token_id=0, trained=[True, False])
    assert batch.loss_mask.tolist() == [[True, True], [False, False]]
    assert batch.num_loss_tokens == 2


def test_nan_and_inf_advantages_at_masked_slots_become_exactly_zero():
    # Per-sample [1.5, NaN] with the second untrained; per-token [B, T] with inf in the padding column of row 0.
    samples = [_sample(0, [1], [2, 3]), _sample(1, [1], [2, 3])]
    batch = build_train_batch(samples, torch.tensor([1.5, math.nan]), pad_token_id=0, trained=[True, False])
    assert batch.advantages.tolist() == [[1.5, 1.5], [0.0, 0.0]]  # NaN * 0 would have left NaN in row 1
    short = [_sample(0, [1], [2]), _sample(1, [1], [2, 3])]
    per_token = torch.tensor([[0.5, math.inf], [-1.0, -math.inf]])
    batch = build_train_batch(short, per_token, pad_token_id=0, trained=[True, False])
    assert batch.advantages.tolist() == [[0.5, 0.0], [0.0, 0.0]]


def test_micro_batches_trim_padding_columns_but_keep_values():
    samples = [_sample(0, [1, 2], [3]), _sample(1, [1, 2, 3, 4], [5, 6, 7])]
    batch = build_train_batch(samples, torch.tensor([1.0, 2.0]), pad_token_id=0)
    first, second = split_micro_batches(batch, 1)
    assert first.tokens.tolist() == [[1, 2, 3]] and first.loss_mask.shape == (1, 1)
    assert torch.equal(second.advantages, batch.advantages[1:])


def test_mismatched_loss_mask_is_a_clear_error():
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        build_train_batch([_sample(0, [1], [2, 3], loss_mask=[1])], torch.tensor([1.0]), pad_token_id=0)


def test_group_samples_keeps_first_seen_order():
    samples = [_sample(i, [1], [2], group=g) for i, g in enumerate([3, 1, 3, 1])]
    assert [[s.index for s in g] for g in group_samples(samples)] == [[0, 2], [1, 3]]


def test_bad_rewards_mark_only_their_sample_failed_with_a_reason():
    outputs = iter([1.0, None, float("nan"), "0.5", math.inf, 0])

    def reward(sample):
        value = next(outputs)
        if sample.index == 5:
            raise KeyError("missing answer")
        return value

    samples = [_sample(i, [1], [2]) for i in range(6)]
    assert score_samples(samples, reward) == 5
    assert samples[0].reward == 1.0 and samples[0].status == SampleStatus.PENDING
    reasons = [s.metadata.get("failure", "") for s in samples[1:]]
    assert "NoneType" in reasons[0] and "nan" in reasons[1] and "str" in reasons[2] and "inf" in reasons[3]
    assert "KeyError" in reasons[4]
    assert all(s.status == SampleStatus.FAILED and s.reward is None for s in samples[1:])
