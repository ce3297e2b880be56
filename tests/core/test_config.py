"""Config sections of miles-core: the training-rollout sampling rule and the group-size rule shared with the root."""

import pytest
from miles.core.config import (
    AdvantageConfig,
    AlgorithmConfig,
    EvalConfig,
    LossConfig,
    RolloutConfig,
    SamplingConfig,
    check_group_size,
)


@pytest.mark.parametrize(
    "sampling, key",
    [
        pytest.param(SamplingConfig(top_p=0.9), "top_p is 0.9", id="top_p"),
        pytest.param(SamplingConfig(top_k=20), "top_k is 20", id="top_k"),
    ],
)
def test_training_rollouts_refuse_truncated_sampling_naming_the_key_the_reason_and_the_fix(sampling, key):
    with pytest.raises(ValueError, match=f"rollout.sampling.{key}") as err:
        RolloutConfig(sampling=sampling)
    message = str(err.value)
    assert "PPO ratio and the TIS/MIS corrections" in message and "untruncated" in message
    assert "--rollout.sampling.top-" in message and "--eval.sampling" in message


def test_eval_sampling_may_truncate_and_training_sampling_defaults_to_the_full_distribution():
    assert EvalConfig(sampling=SamplingConfig(top_p=0.95, top_k=20)).sampling.top_p == 0.95
    assert (RolloutConfig().sampling.top_p, RolloutConfig().sampling.top_k) == (1.0, 0)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_baseline_estimators_refuse_one_sample_per_prompt(estimator):
    with pytest.raises(ValueError, match=f"is 1, but advantage '{estimator}' needs at least 2.*--rollout.n-samples"):
        check_group_size(
            RolloutConfig(n_samples_per_prompt=1), AlgorithmConfig(advantage=AdvantageConfig(estimator=estimator))
        )


@pytest.mark.parametrize(
    "algorithm",
    [
        pytest.param(
            AlgorithmConfig(advantage=AdvantageConfig(estimator="reinforce_plus_plus")), id="no_group_baseline"
        ),
        pytest.param(AlgorithmConfig(loss=LossConfig(policy_loss="sft")), id="sft_ignores_advantages"),
    ],
)
def test_estimators_without_a_group_accept_one_sample_per_prompt(algorithm):
    check_group_size(RolloutConfig(n_samples_per_prompt=1), algorithm)


def test_changed_fields_compares_a_default_factory_field_with_the_factorys_value():
    from miles.core.algorithms.config import changed_fields
    from pydantic import BaseModel, Field

    class Section(BaseModel):
        scale: float = 1.0
        tags: list[str] = Field(default_factory=list)

    names = ("scale", "tags")
    assert changed_fields(Section(scale=1.0, tags=[]), names) == []  # set, but to the defaults
    assert changed_fields(Section(tags=["a"]), names) == ["tags"]
    assert changed_fields(Section(scale=2.0), names) == ["scale"]


def test_the_longest_response_is_the_multi_turn_budget_in_multi_turn_mode():
    # Dr.GRPO's normalizer (loop.train's PolicyObjective) was rollout.sampling.max_new_tokens, a per-turn bound.
    from miles.core.config import MultiTurnConfig, RolloutConfig

    sampling = SamplingConfig(max_new_tokens=32)
    assert RolloutConfig(sampling=sampling).max_response_tokens == 32
    multi = RolloutConfig(sampling=sampling, mode="multi_turn", multi_turn=MultiTurnConfig(max_response_tokens=200))
    assert multi.max_response_tokens == 200
