"""The loop's per-sample and per-group extension points, on hand-made samples: the sample hook, the group reward,
the dynamic-sampling filter's reasons and the buffer filter (their end-to-end runs: tests/recipes/
test_extension_points.py)."""

import math

import pytest
from miles.core.loop import _buffer_filter, _keep
from miles.core.rewards import failure_counts, score_samples
from miles.core.sample import Sample, SampleStatus


def _samples(n, group_size=2):
    return [
        Sample(index=i, group_index=i // group_size, prompt=[1], tokens=[1, 5, 6], response_length=2,
               rollout_log_probs=[-1.0, -1.0], status=SampleStatus.COMPLETED)
        for i in range(n)
    ]  # fmt: skip


def test_the_sample_hook_runs_before_the_reward_and_a_raising_hook_fails_only_its_sample():
    def hook(sample):
        if sample.index == 1:
            raise KeyError("no answer")
        sample.metadata["doubled"] = 2 * sample.index

    samples = _samples(4)
    samples[3].status = SampleStatus.ABORTED  # neither hooked nor scored
    num_failed = score_samples(samples, lambda s: float(s.metadata["doubled"]), sample_hook=hook)
    assert num_failed == 1
    assert [s.reward for s in samples] == [0.0, None, 4.0, None]
    assert samples[1].metadata["failure"] == "sample hook raised KeyError: 'no answer'"
    assert "doubled" not in samples[3].metadata
    assert failure_counts(samples)["samples/failed_sample_hook"] == 1.0


def test_the_group_reward_replaces_each_groups_rewards_after_the_per_sample_ones():
    seen = []

    def centred(group):
        seen.append([(s.index, s.reward) for s in group])
        mean = sum(s.reward for s in group) / len(group)
        return [s.reward - mean for s in group]

    samples = _samples(6, group_size=3)
    samples[4].status = SampleStatus.FAILED  # left out of its group
    assert score_samples(samples, lambda s: float(s.index), group_reward_fn=centred) == 1
    assert seen == [[(0, 0.0), (1, 1.0), (2, 2.0)], [(3, 3.0), (5, 5.0)]]
    assert [s.reward for s in samples] == [-1.0, 0.0, 1.0, -1.0, None, 1.0]


@pytest.mark.parametrize(
    "group_reward, reason",
    [
        (lambda g: [1.0], "returned [1.0] for 2 samples, expected one finite float each"),
        (lambda g: [1.0, math.nan], "returned [1.0, nan] for 2 samples"),
        (lambda g: 1 / 0, "ZeroDivisionError: division by zero"),
    ],
)
def test_a_bad_group_reward_fails_its_group_only(group_reward, reason):
    calls = []

    def first_group_bad(group):
        calls.append(group[0].group_index)
        return group_reward(group) if group[0].group_index == 0 else [0.5] * len(group)

    samples = _samples(4)
    assert score_samples(samples, lambda s: 1.0, group_reward_fn=first_group_bad) == 2
    assert calls == [0, 1]
    assert [s.status for s in samples[:2]] == [SampleStatus.FAILED] * 2 and reason in samples[0].metadata["failure"]
    assert [s.reward for s in samples] == [None, None, 0.5, 0.5]
    assert failure_counts(samples)["samples/failed_reward_error"] == 2.0


def test_a_dynamic_filter_answer_is_a_bool_or_a_bool_and_a_reason():
    assert _keep(True) == (True, "") and _keep(False) == (False, "")
    assert _keep((False, "too_easy")) == (False, "too_easy")
    with pytest.raises(TypeError, match="algorithm.dynamic_sampling.filter_path returned 'yes'; expected a bool"):
        _keep("yes")


def test_the_buffer_filter_keeps_whole_groups_renumbered_and_counts_the_rest(tmp_path, monkeypatch):
    (tmp_path / "buffer_filters.py").write_text(
        "def odd_groups(groups):\n    return [g for g in groups if g[0].group_index % 2]\n"
        "def none(groups):\n    return []\n"
        "def copies(groups):\n    return [list(g) for g in groups]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = _samples(6)
    samples[3].status = SampleStatus.FAILED
    metrics = {}
    kept, num_failed = _buffer_filter(samples, "buffer_filters:odd_groups", metrics)
    assert [(s.group_index, s.index) for s in kept] == [(1, 0), (1, 1)]
    assert num_failed == 1 and metrics == {"buffer/filtered_groups": 2.0}
    for path in ("buffer_filters:none", "buffer_filters:copies"):
        with pytest.raises(ValueError, match="algorithm.buffer_filter_path .* must return a non-empty subset"):
            _buffer_filter(_samples(4), path, {})
