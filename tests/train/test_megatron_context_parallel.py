"""Context parallelism of the Megatron backend (``miles.train.megatron.context_parallel``): the load-balanced split
and what is refused. The two-rank equality with one rank is ``test_megatron_backend.py::test_two_ranks_equal_one_rank``
(``cp2-*``) and ``test_megatron_lora.py`` (``context_parallel_2``)."""

import pytest
import torch
from miles.train.megatron.context_parallel import chunk_positions, context_parallel_refusal


@pytest.mark.parametrize(
    ("length", "cp_size", "expected"),
    [
        # 8 tokens, CP 2: 4 chunks of 2; rank 0 chunks 0 and 3, rank 1 chunks 1 and 2
        pytest.param(8, 2, [[0, 1, 6, 7], [2, 3, 4, 5]], id="cp2_length8"),
        # 12 tokens, CP 3: 6 chunks of 2; rank r chunks r and 5 - r
        pytest.param(12, 3, [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]], id="cp3_length12"),
        pytest.param(4, 1, [[0, 1, 2, 3]], id="cp1_everything"),
    ],
)
def test_cp_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r(length, cp_size, expected):
    got = [chunk_positions(length, cp_rank=r, cp_size=cp_size).tolist() for r in range(cp_size)]
    assert got == expected
    assert sorted(sum(got, [])) == list(range(length))  # every token on exactly one rank


def test_a_length_that_is_not_a_multiple_of_2cp_is_refused_by_the_split():
    """The backend pads each micro-batch to a multiple of 2 x CP first (padded keys masked, never scored): the
    two-rank test's micro-batches are 6 and 7 tokens long at CP 2."""
    with pytest.raises(ValueError, match="sequence length 7 is not a multiple of 2 x CP 4"):
        chunk_positions(7, cp_rank=0, cp_size=2)
    assert chunk_positions(8, cp_rank=1, cp_size=2).dtype == torch.int64


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            dict(pipeline_parallel=2),
            "with train.megatron.pipeline_parallel_size 2 is not supported yet: use "
            "--train.megatron.pipeline-parallel-size 1, or",
        ),
        (
            dict(tensor_parallel=2),
            "with train.megatron.tensor_parallel_size 2 is not supported yet: use "
            "--train.megatron.tensor-parallel-size 1, or",
        ),
    ],
    ids=["pipeline", "tensor"],
)
def test_what_context_parallelism_does_not_cover_is_refused_in_one_line(settings, message):
    kwargs = dict(context_parallel=2, tensor_parallel=1, pipeline_parallel=1) | settings
    refusal = context_parallel_refusal(**kwargs)
    assert refusal.startswith("train.megatron.context_parallel_size 2 ") and message in refusal
    assert refusal.endswith("or --train.megatron.context-parallel-size 1") and "\n" not in refusal
    assert context_parallel_refusal(**kwargs | dict(context_parallel=1)) is None
    assert context_parallel_refusal(context_parallel=2, tensor_parallel=1, pipeline_parallel=1) is None
