import pytest
import torch
from miles.core.algorithms.masking import (
    has_trainable_tokens,
    overlong_filter_keep,
    overlong_penalty,
    response_mask,
)
from miles.core.batch import build_train_batch
from miles.core.sample import Sample, SampleStatus


@pytest.mark.parametrize(
    "length, expected",
    [
        pytest.param(16, 0.0, id="at_max_minus_buffer"),
        pytest.param(17, -0.25, id="one_into_the_buffer"),
        pytest.param(18, -0.5, id="half_way"),
        pytest.param(20, -1.0, id="at_max_length"),
        pytest.param(3, 0.0, id="short"),
    ],
)
def test_overlong_penalty_ramps_linearly_inside_the_buffer(length, expected):
    got = overlong_penalty(torch.tensor([length]), max_length=20, buffer_length=4, factor=1.0)
    assert got.item() == pytest.approx(expected)


def test_overlong_penalty_with_a_buffer_longer_than_the_limit_is_a_clear_error():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([3]), max_length=4, buffer_length=5, factor=1.0)


def test_overlong_filter_decides_by_finish_reason_not_by_the_last_token():
    # eos 2, end-of-turn 9. The first ends in end-of-turn and stopped; the second was cut by length.
    stopped = Sample(0, 0, "", tokens=[1, 5, 6, 7, 9], response_length=4, status=SampleStatus.COMPLETED)
    cut = Sample(1, 0, "", tokens=[1, 5, 6, 7, 8], response_length=4, status=SampleStatus.TRUNCATED)
    # A response ending in the end-of-turn id but cut by length is still filtered.
    cut_on_eot = Sample(2, 0, "", tokens=[1, 5, 6, 7, 9], response_length=4, status=SampleStatus.TRUNCATED)
    samples = [stopped, cut, cut_on_eot]
    keep = overlong_filter_keep(samples)
    batch = build_train_batch(samples, torch.zeros(3), pad_token_id=0, trained=keep)
    assert batch.loss_mask.int().tolist() == [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_response_mask_covers_each_response():
    assert response_mask(torch.tensor([2, 0]), 3).tolist() == [[True, True, False], [False, False, False]]


def test_samples_without_a_trainable_token_of_their_own_are_recognized():
    samples = [
        Sample(0, 0, "", tokens=[1, 5, 6], response_length=2),  # no loss mask: all trained
        Sample(1, 0, "", tokens=[1, 5, 6], response_length=2, loss_mask=[0, 1]),  # a tool token, then a trained one
        Sample(2, 0, "", tokens=[1, 5, 6], response_length=2, loss_mask=[0, 0]),  # only tool tokens
        Sample(3, 0, "", tokens=[1], response_length=0),  # empty response
        # Truncated: the overlong filter is decided separately, it still has trainable tokens of its own.
        Sample(4, 0, "", tokens=[1, 5], response_length=1, status=SampleStatus.TRUNCATED),
    ]
    assert has_trainable_tokens(samples) == [True, True, False, False, True]
