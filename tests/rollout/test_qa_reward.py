"""SQuAD v1.1 exact match and token F1 (evaluate-v1.1.py), hand-computed, max over the acceptable answers; and
the last-boxed reading of the math reward that makes it the boxed-answer reward."""

import pytest
from miles.core.sample import Sample
from miles.recipes.run import build_reward
from miles.rollout.config import RewardConfig
from miles.rollout.rewards import exact_match_reward, f1_reward, last_boxed, math_reward, normalize_answer, token_f1


def _sample(label, text) -> Sample:
    return Sample(index=0, group_index=0, prompt="", label=label, response_text=text)


@pytest.mark.parametrize(
    "text, normalized",
    [
        pytest.param("The Eiffel Tower.", "eiffel tower", id="article_case_punctuation"),
        pytest.param("  an   apple,\ta pie ", "apple pie", id="whitespace_collapsed"),
        pytest.param("theatre", "theatre", id="article_only_as_a_word"),
        pytest.param("rock'n'roll", "rocknroll", id="punctuation_inside_a_word_joins_it"),
    ],
)
def test_normalize_answer_is_squads(text, normalized):
    assert normalize_answer(text) == normalized


@pytest.mark.parametrize(
    "prediction, reference, f1",
    [
        # tokens [paris, france] vs [paris]: common 1, P = 1/2, R = 1, F1 = 2 * 1/2 / (3/2) = 2/3
        pytest.param("Paris, France", "Paris", 2 / 3, id="extra_token"),
        # [eiffel, tower] vs [eiffel, tower, in, paris]: P = 1, R = 2/4, F1 = 2 * 1/2 / (3/2) = 2/3
        pytest.param("the Eiffel Tower", "Eiffel Tower in Paris", 2 / 3, id="missing_tokens"),
        # [x, x, y] vs [x, y, y]: common = min(2, 1) + min(1, 2) = 2, P = R = 2/3, F1 = 2/3
        pytest.param("x x y", "x y y", 2 / 3, id="multiset_counts"),
        pytest.param("London", "Paris", 0.0, id="nothing_common"),
        pytest.param("The", "a", 0.0, id="both_empty_after_normalisation_is_0_as_in_v1_1"),
        pytest.param("PARIS!", "paris", 1.0, id="equal_after_normalisation"),
    ],
)
def test_token_f1_matches_hand_computed_values(prediction, reference, f1):
    assert token_f1(prediction, reference) == pytest.approx(f1, abs=1e-12)


def test_rewards_take_the_answer_tag_and_the_best_of_the_acceptable_answers():
    label = ["Denver Broncos", "The Broncos"]
    # "the Broncos!" -> [broncos]: vs [denver, broncos] F1 = 2/3, EM 0; vs "The Broncos" -> [broncos] 1, 1: max 1
    sample = _sample(label, "I think it was... <answer>the Broncos!</answer>")
    assert f1_reward(sample) == 1.0 and exact_match_reward(sample) == 1.0
    partial = _sample(label, "<answer>Denver</answer>")  # [denver] vs [denver, broncos]: P = 1, R = 1/2: F1 = 2/3
    assert f1_reward(partial) == pytest.approx(2 / 3) and exact_match_reward(partial) == 0.0
    # no tag: the whole response; [it, was, denver, broncos] vs [denver, broncos]: P = 1/2, R = 1: F1 = 2/3
    assert f1_reward(_sample("Denver Broncos", "It was Denver Broncos")) == pytest.approx(2 / 3)
    assert exact_match_reward(_sample("Denver Broncos", "It was Denver Broncos")) == 0.0


@pytest.mark.parametrize("label", [None, [], 42, ["ok", 3]])
def test_a_label_that_is_not_answers_is_a_value_error(label):
    with pytest.raises(ValueError, match="sample 0: exact_match/f1 rewards need a label"):
        f1_reward(_sample(label, "x"))


def test_reward_types_f1_and_exact_match_are_built_from_the_config():
    sample = _sample("Paris", "Paris, France")
    assert build_reward(RewardConfig(type="f1"))(sample) == pytest.approx(2 / 3)
    assert build_reward(RewardConfig(type="exact_match"))(sample) == 0.0


@pytest.mark.parametrize(
    "text, content",
    [
        pytest.param(r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}", id="nested_braces"),
        pytest.param(r"draft \boxed{3}, final \boxed{4}.", "4", id="last_one"),
        pytest.param(r"\boxed{\{1, 2\}}", r"\{1, 2\}", id="escaped_braces_are_not_structure"),
        pytest.param(r"\fbox{7}", "7", id="fbox"),
        pytest.param(r"\boxed{\frac{1}{2}", None, id="unclosed"),
        pytest.param("42", None, id="none"),
    ],
)
def test_last_boxed_matches_nested_braces(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize(
    "label, text, expected",
    [
        pytest.param(r"\frac{1}{2}", r"first \boxed{3}, then \boxed{\frac{1}{2}}", 1.0, id="last_boxed_counts"),
        pytest.param("3", r"first \boxed{3}, then \boxed{\frac{1}{2}}", 0.0, id="earlier_boxed_does_not"),
        pytest.param("0.5", r"\boxed{\frac{1}{2}}", 1.0, id="equal_as_math"),
        pytest.param(r"\frac{\sqrt{2}}{2}", r"\boxed{\frac{1}{\sqrt{2}}}", 1.0, id="nested_equal_as_math"),
        pytest.param(r"The area is $\boxed{6\pi}$.", r"so \boxed{6 \pi}", 1.0, id="math_solution_label"),
        pytest.param(r"\text{Paris}", r"\boxed{\text{Paris}}", 1.0, id="text_answer"),
    ],
)
def test_math_reward_compares_the_last_boxed_answer(label, text, expected):
    assert math_reward(_sample(label, text)) == expected


def test_math_reward_scores_alike_in_the_thread_reward_timeout_s_calls_it_in():
    """reward.timeout_s (60 s by default) calls the reward in a thread, where math-verify's own signal-based
    timeouts cannot run: each call raised ValueError there until math_reward turned them off in threads."""
    from miles.core.rewards import TimeLimitedReward

    reward = TimeLimitedReward(math_reward, timeout_s=30)
    assert reward(_sample("0.5", r"\boxed{\frac{1}{2}}")) == 1.0
    assert reward(_sample("3", r"first \boxed{3}, then \boxed{\frac{1}{2}}")) == 0.0
