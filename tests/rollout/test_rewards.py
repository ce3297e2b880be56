import json

import pytest
from miles.core.sample import Sample
from miles.rollout.data import ReasoningGymSource
from miles.rollout.rewards import extract_answer, gold_answer, math_reward, reasoning_gym_reward


def _sample(label, text) -> Sample:
    return Sample(index=0, group_index=0, prompt="", label=label, response_text=text)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("7 + 8 = 15", "15"),
        ("It is 1,024.", "1024"),
        ("<answer>12</answer> then 13", "12"),
        ("minus -3.5 here", "-3.5"),
        ("no digits", None),
    ],
)
def test_extract_answer_takes_the_answer_tag_or_the_last_number(text, expected):
    assert extract_answer(text) == expected


def test_reasoning_gym_reward_is_binary_and_uses_the_task_scorer():
    source = ReasoningGymSource(
        "basic_arithmetic",
        size=4,
        seed=1,
        task_kwargs=dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",)),
    )
    prompt = source.next_prompts(1)[0]
    answer = prompt.label["answer"]
    assert reasoning_gym_reward(_sample(prompt.label, f"The sum is {answer}")) == 1.0
    assert reasoning_gym_reward(_sample(prompt.label, f"The sum is {int(answer) + 1}")) == 0.0
    assert reasoning_gym_reward(_sample(prompt.label, "I do not know")) == 0.0


def test_reasoning_gym_reward_rejects_a_label_that_is_not_a_task_entry():
    with pytest.raises(ValueError, match="not a reasoning-gym entry"):
        reasoning_gym_reward(_sample("42", "42"))


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param("So the answer is \\boxed{18}.", 1.0, id="boxed"),
        pytest.param("She makes 9 * 2 = 18 dollars", 1.0, id="last_number"),
        pytest.param("The answer is \\boxed{18.0}", 1.0, id="equivalent_float"),
        pytest.param("The answer is \\boxed{17}", 0.0, id="wrong"),
        pytest.param("", 0.0, id="empty"),
    ],
)
def test_math_reward_checks_the_final_answer_against_the_gsm8k_label(gsm8k_test_file, text, expected):
    first = json.loads(gsm8k_test_file.read_text().splitlines()[0])  # Janet's ducks: #### 18
    assert gold_answer(first["answer"]) == "18"
    assert math_reward(_sample(first["answer"], text)) == expected


def test_rewards_score_the_typed_response_text_and_a_sample_without_text_scores_zero(gsm8k_test_file):
    first = json.loads(gsm8k_test_file.read_text().splitlines()[0])  # Janet's ducks: #### 18
    assert math_reward(Sample(index=0, group_index=0, prompt="", label=first["answer"], response_text="18")) == 1.0
    # The text is a typed field, not a metadata key: a metadata entry of that name is not read.
    stray = Sample(index=0, group_index=0, prompt="", label=first["answer"], metadata={"response_text": "18"})
    assert math_reward(stray) == 0.0
