"""Rewards that raise, hang, or return None / NaN / inf / a string fail their sample only; a property test feeds
random malformed rows and reward outputs through data loading, scoring, batching and advantages."""

import json
import math
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from miles.core.algorithms.advantages import AdvantageInputs, AdvantageParams, compute_advantages
from miles.core.algorithms.masking import response_mask
from miles.core.batch import build_train_batch
from miles.core.rewards import RewardTimeoutError, TimeLimitedReward, score_samples
from miles.core.sample import Sample, SampleStatus
from miles.rollout.data import FileSource


def _samples(n, group_size=2):
    return [
        Sample(index=i, group_index=i // group_size, prompt=[1], tokens=[1, 5, 6], response_length=2,
               rollout_log_probs=[-1.0, -1.0], status=SampleStatus.COMPLETED)
        for i in range(n)
    ]  # fmt: skip


def _raise(sample):
    raise KeyError("label")


@pytest.mark.parametrize(
    "reward_fn, reason",
    [
        pytest.param(_raise, "reward function raised KeyError: 'label'", id="raises"),
        pytest.param(lambda s: None, "reward function returned NoneType None, expected a finite float", id="none"),
        pytest.param(lambda s: math.nan, "reward function returned nan", id="nan"),
        pytest.param(lambda s: -math.inf, "reward function returned -inf", id="inf"),
        pytest.param(lambda s: "1.0", "reward function returned str '1.0', expected a finite float", id="string"),
        pytest.param(lambda s: True, "reward function returned bool True, expected a finite float", id="bool"),
    ],
)
def test_a_bad_reward_fails_the_sample_with_its_reason(reward_fn, reason):
    samples = _samples(1)
    assert score_samples(samples, reward_fn) == 1
    assert samples[0].status == SampleStatus.FAILED and samples[0].reward is None
    assert samples[0].metadata["failure"] == reason


def test_numpy_scalars_are_accepted_rewards():
    samples = _samples(2)
    assert score_samples(samples, lambda s: np.float32(0.5) if s.index else np.int64(1)) == 0
    assert [s.reward for s in samples] == [1.0, 0.5]


def test_a_hanging_reward_times_out_and_fails_only_its_sample():
    release = threading.Event()

    def hangs_on_first(sample):
        if sample.index == 0:
            release.wait(30)
        return 1.0

    samples = _samples(3)
    t0 = time.perf_counter()
    assert score_samples(samples, TimeLimitedReward(hangs_on_first, timeout_s=0.2)) == 1
    assert time.perf_counter() - t0 < 5.0
    assert samples[0].metadata["failure"] == (
        "reward function raised RewardTimeoutError: reward function did not return within reward.timeout_s=0.2s"
    )
    assert [s.reward for s in samples[1:]] == [1.0, 1.0]
    release.set()


def test_a_batch_scores_its_samples_at_once_so_a_reward_hanging_on_all_costs_one_timeout():
    # Each call waits for all 4 to be running: only calls made at the same time pass the barrier. One after another
    # (the old behaviour: timeout_s per sample, 64 minutes for the default batch at 60 s) every call would time out.
    barrier = threading.Barrier(4, timeout=20)

    def needs_all_four(sample):
        barrier.wait()
        return float(sample.index)

    samples = _samples(4)
    assert score_samples(samples, TimeLimitedReward(needs_all_four, timeout_s=30)) == 0
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0, 3.0]

    # A batch larger than max_hung runs in chunks of max_hung: 2 chunks of 2 here, each passing its own barrier.
    pairs = threading.Barrier(2, timeout=20)

    def needs_a_pair(sample):
        pairs.wait()
        return 1.0

    samples = _samples(4)
    assert score_samples(samples, TimeLimitedReward(needs_a_pair, timeout_s=30, max_hung=2)) == 0
    assert [s.reward for s in samples] == [1.0] * 4


def test_a_reward_that_keeps_hanging_is_no_longer_called_after_max_hung():
    release = threading.Event()
    calls = []

    def hangs(sample):
        calls.append(sample.index)
        release.wait(30)

    reward = TimeLimitedReward(hangs, timeout_s=0.05, max_hung=2)
    samples = _samples(4)
    assert score_samples(samples, reward) == 4
    assert sorted(calls) == [0, 1]  # the 3rd and 4th calls fail fast (the first two ran at once)
    assert "2 earlier reward calls are still running" in samples[3].metadata["failure"]
    release.set()
    with pytest.raises(ValueError, match="reward.timeout_s"):
        TimeLimitedReward(hangs, timeout_s=0)
    assert issubclass(RewardTimeoutError, TimeoutError)


# -- properties -------------------------------------------------------------------------------------------
REWARD_OUTPUTS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.integers(-3, 3),
    st.none(),
    st.text(max_size=3),
    st.just("raise"),
)


@settings(max_examples=60, deadline=None)
@given(
    outputs=st.lists(REWARD_OUTPUTS, min_size=1, max_size=12),
    group_size=st.integers(1, 4),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
)
def test_random_reward_outputs_give_finite_advantages_only_on_valid_samples(outputs, group_size, estimator):
    samples = _samples(len(outputs), group_size)

    def reward_fn(sample):
        out = outputs[sample.index]
        if out == "raise":
            raise RuntimeError("boom")
        return out

    num_failed = score_samples(samples, reward_fn)
    good = [
        not isinstance(o, str | type(None)) and math.isfinite(o) for o in outputs
    ]  # what a valid reward is, stated independently of score_samples
    assert num_failed == good.count(False)
    assert [s.status != SampleStatus.FAILED for s in samples] == good
    valid = torch.tensor(good)
    rewards = torch.tensor([s.reward if g else 0.0 for s, g in zip(samples, good)], dtype=torch.float32)
    batch = build_train_batch(samples, torch.zeros(len(samples)), pad_token_id=0, trained=good)
    assert batch.loss_mask.shape == (len(samples), 2)
    assert batch.loss_mask.any(dim=1).tolist() == good  # masks aligned: failed rows are never trained
    inputs = AdvantageInputs(
        rewards=rewards,
        group_index=torch.tensor([s.group_index for s in samples]),
        valid=valid,
        loss_mask=batch.loss_mask,
        response_mask=response_mask(batch.response_lengths, batch.loss_mask.shape[1]),
    )
    advantages, _ = compute_advantages(inputs, estimator=estimator, params=AdvantageParams())
    assert advantages.shape == batch.loss_mask.shape
    assert torch.isfinite(advantages).all()
    assert (advantages[~batch.loss_mask] == 0).all()


ROW = st.one_of(
    st.fixed_dictionaries({"question": st.text(max_size=5), "answer": st.one_of(st.text(max_size=3), st.none())}),
    st.dictionaries(st.sampled_from(["question", "answer", "x"]), st.one_of(st.integers(), st.text(max_size=3))),
    st.lists(st.integers(), max_size=2),
    st.integers(),
)
LINE = st.one_of(ROW.map(lambda r: json.dumps(r).encode()), st.binary(min_size=1, max_size=8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINE, min_size=1, max_size=15))
def test_random_malformed_rows_are_counted_and_never_served(tmp_path, lines):
    lines = [line.replace(b"\n", b" ").replace(b"\r", b" ") for line in lines]  # one row per line
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    # a row is any line with a byte other than JSON whitespace (RFC 8259: space, tab, CR, LF); 0x1C, 0x0C,
    # U+00A0 ... lines are rows (bad ones), never silently dropped
    num_rows = sum(1 for line in lines if line.strip(b" \t\r\n"))
    try:
        source = FileSource(path, bad_rows="skip")
    except ValueError as err:
        assert "no usable row" in str(err) or "no row of rows.jsonl has it" in str(err)
        return
    assert source.size + source.num_bad_rows == num_rows
    assert all(reason.startswith("rows.jsonl:") for reason in source.bad_row_reasons)
    for sample in source.next_prompts(source.size):
        assert sample.prompt[-1]["content"].strip() and sample.label is not None


def test_async_rewards_and_group_rewards_are_awaited_wherever_they_are_called():
    # An async def reward returned a coroutine, which counted as "not a number": every sample failed.
    import asyncio

    async def async_reward(sample):
        await asyncio.sleep(0)
        return float(sample.index) / 10

    async def async_group(group):
        await asyncio.sleep(0)
        return [s.reward * 2 for s in group]

    for reward in (async_reward, TimeLimitedReward(async_reward, timeout_s=30)):
        samples = _samples(4)
        assert score_samples(samples, reward, group_reward_fn=async_group) == 0
        assert [s.reward for s in samples] == [0.0, 0.2, 0.4, 0.6]

    async def from_async_code():  # a caller that runs an event loop itself: awaited on a helper thread's loop
        samples = _samples(2)
        assert score_samples(samples, async_reward) == 0
        return [s.reward for s in samples]

    assert asyncio.run(from_async_code()) == [0.0, 0.1]

    async def raises(sample):
        raise ValueError("judge unreachable")

    samples = _samples(2)
    assert score_samples(samples, raises) == 2
    assert samples[0].metadata["failure"] == "reward function raised ValueError: judge unreachable"
