"""pass@k against its definition, and the per-set eval metrics on hand-made samples."""

import itertools
import math

import pytest
from miles.core.config import EvalConfig, EvalSetConfig
from miles.core.evaluation import pass_at_k, set_metrics
from miles.core.sample import Sample, SampleStatus


def _brute_force(n, c, k):
    """The fraction of k-subsets of n samples (c passing) that hold a passing one: pass@k by definition."""
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_pass(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_values_and_range_errors():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    for args in [(4, 1, 0), (4, 1, 5), (4, 5, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*args)


def _samples(rewards_per_prompt):
    samples = []
    for g, rewards in enumerate(rewards_per_prompt):
        for r in rewards:
            s = Sample(index=len(samples), group_index=g, prompt=[1], tokens=[1, 2, 3], response_length=2)
            s.status, s.reward = SampleStatus.COMPLETED, r
            samples.append(s)
    return samples


def test_set_metrics_average_pass_at_k_over_prompts_and_count_failures_as_misses():
    samples = _samples([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0]])
    samples[1].status, samples[1].reward = SampleStatus.FAILED, None
    settings = EvalSetConfig(name="x", n_samples_per_prompt=4, pass_k=[1, 2], pass_threshold=1.0)
    metrics = set_metrics(samples, settings, "eval/x/")
    # prompt 0: c=1 of 4; prompt 1: c=2 of 4 (0.5 is below the threshold).
    assert metrics["eval/x/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert metrics["eval/x/pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 2, 2)) / 2)  # (0.5+5/6)/2
    assert metrics["eval/x/reward"] == pytest.approx(3.5 / 7)  # the 7 scored samples
    assert metrics["eval/x/failed"] == 1.0 and metrics["eval/x/response_length"] == 2.0


def test_eval_config_refuses_a_k_above_the_samples_and_a_name_used_twice():
    with pytest.raises(ValueError, match=r"eval.pass_k holds \[8\], but pass@k needs 1 <= k <= eval.n_samples"):
        EvalConfig(n_samples_per_prompt=4, pass_k=[1, 8])
    with pytest.raises(ValueError, match=r"eval.sets\[1\].pass_k holds \[3\]"):
        EvalConfig(sets=[EvalSetConfig(name="a"), EvalSetConfig(name="b", n_samples_per_prompt=2, pass_k=[3])])
    with pytest.raises(ValueError, match=r"eval.sets\[1\].name 'a' is used twice"):
        EvalConfig(sets=[EvalSetConfig(name="a"), EvalSetConfig(name="a")])
    assert EvalConfig(num_prompts=0, interval=2, sets=[EvalSetConfig(name="a")]).enabled


def test_an_eval_set_whose_samples_all_fail_says_why_in_a_warning(caplog):
    from miles.core.config import EvalConfig
    from miles.core.evaluation import evaluate

    class Components:
        publisher, progress, eval_prompts, eval_generate_group = None, None, [], None
        eval_sets = {"gsm8k": [Sample(index=0, group_index=0, prompt=[1])]}

        @staticmethod
        async def generate_group(prompt, *, n, sampling, seeds):
            return _samples([[0.0] * n])

        def score(self, samples):
            for s in samples:
                s.status, s.reward = SampleStatus.FAILED, None
                s.metadata["failure"] = "reward function raised ValueError: label is not a reasoning-gym entry"
            return len(samples)

    evaluation = EvalConfig(num_prompts=0, sets=[EvalSetConfig(name="gsm8k", n_samples_per_prompt=2, pass_k=[1])])
    metrics = evaluate(Components(), evaluation)
    assert metrics["eval/gsm8k/failed"] == 2.0 and math.isnan(metrics["eval/gsm8k/reward"])
    assert [r.getMessage() for r in caplog.records] == [
        "eval set eval/gsm8k: all 2 samples failed, e.g. reward function raised ValueError: label is not a "
        "reasoning-gym entry"
    ]
