"""final_answer_reward: the number in the last turn against the label, 0 for a sample that ended on a tool call."""

import pytest
from miles.core.sample import Sample
from miles.rollout.rewards.final_answer import final_answer_reward


def scored(text, label, **metadata):
    return final_answer_reward(Sample(index=0, group_index=0, prompt="", label=label, response_text=text,
                                      metadata=metadata))  # fmt: skip


@pytest.mark.parametrize(
    "text, label, stop_reason, expected",
    [
        pytest.param("574533", "574533", "answer", 1.0, id="exact"),
        pytest.param("The answer is 1,226.", {"answer": "1226"}, "answer", 1.0, id="reasoning_gym_entry_commas"),
        pytest.param("<answer>-30</answer> (checked 31)", "-30", "answer", 1.0, id="answer_tag_wins"),
        pytest.param("0.333333", "0.333333333", "answer", 1.0, id="within_1e-6_relative"),
        pytest.param("0.3333", "0.333333333", "answer", 0.0, id="rounded_too_far"),
        pytest.param("574534", "574533", "answer", 0.0, id="off_by_one"),
        pytest.param("no number", "5", "answer", 0.0, id="no_answer"),
        pytest.param("<answer>five</answer>", "5", "answer", 0.0, id="tag_around_text"),
        pytest.param('<tool_call>{"expression": "5"}</tool_call>', "5", "max_turns", 0.0, id="ended_on_a_tool_call"),
    ],
)
def test_the_final_answer_is_compared_numerically_and_only_when_the_sample_answered(text, label, stop_reason, expected):
    assert scored(text, label, stop_reason=stop_reason) == expected


def test_single_turn_samples_without_a_stop_reason_are_scored_and_a_label_without_a_number_is_an_error():
    assert scored("It is 7.", 7) == 1.0
    with pytest.raises(ValueError, match="label 'seven' is not a number"):
        scored("7", "seven")
