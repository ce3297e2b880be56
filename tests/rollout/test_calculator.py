"""The calculator tool: exact arithmetic on literals only (ast-based, nothing eval-ed), bounded work, and errors
worded for the model."""

import pytest
from miles.rollout.calculator import calculate, calculator, evaluate_arithmetic, format_number


@pytest.mark.parametrize(
    "expression, expected",
    [
        pytest.param("814 * 707 - 965", 574533, id="precedence_575498_minus_965"),
        pytest.param("(1 + 2) / 4", 0.75, id="parentheses_then_true_division"),
        pytest.param("7 // 2 + 7 % 2", 4, id="floor_division_3_plus_remainder_1"),
        pytest.param("-2 ** 2", -4, id="power_binds_tighter_than_unary_minus"),
        pytest.param("2 ** -1", 0.5, id="negative_exponent"),
        pytest.param("+3 - -4", 7, id="unary_signs"),
        pytest.param(" 1.5 * 4 ", 6.0, id="floats_and_surrounding_spaces"),
    ],
)
def test_evaluate_arithmetic_computes_python_precedence_exactly(expression, expected):
    value = evaluate_arithmetic(expression)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "expression, message",
    [
        pytest.param("__import__('os').system('ls')", "is not allowed", id="call"),
        pytest.param("x + 1", "'x' is not allowed", id="name"),
        pytest.param("(1).real", "is not allowed", id="attribute"),
        pytest.param("[1, 2]", "is not allowed", id="list"),
        pytest.param("2 ^ 3", "'2 ^ 3' is not allowed", id="xor_is_not_power"),
        pytest.param("True + 1", "only numbers are allowed, not True", id="bool_literal"),
        pytest.param("1j * 2", "only numbers are allowed", id="complex_literal"),
        pytest.param("'a' * 3", "only numbers are allowed", id="string_literal"),
        pytest.param("2 +", "not an arithmetic expression", id="syntax_error"),
        pytest.param("1 / 0", "division by zero", id="division_by_zero"),
        pytest.param("1e99 ** 4", "the result is too large", id="float_power_overflow"),
        pytest.param("5 % 0", "division by zero", id="modulo_by_zero"),
        pytest.param("9 ** 9 ** 9", "the exponent 387420489 is too large", id="power_tower"),
        pytest.param("10 ** 60 * 10 ** 60", "too large (above 1e100", id="value_past_1e100"),
        pytest.param("1e999 - 1", "not a finite number", id="literal_that_parses_to_inf"),
        pytest.param("(-8) ** 0.5", "not a real number", id="complex_result"),
        pytest.param("1 + " * 100 + "1", "has 401 characters; at most 200", id="too_long"),
    ],
)
def test_evaluate_arithmetic_refuses_everything_else_with_a_message_for_the_model(expression, message):
    with pytest.raises(ValueError) as err:
        evaluate_arithmetic(expression)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "value, text",
    [
        (2.0, "2"),
        (2 / 3, "0.666666666667"),
        (-7, "-7"),
        (574533, "574533"),
        (0.1 + 0.2, "0.3"),
        (1e20, "100000000000000000000"),
    ],
)
def test_results_print_integers_without_a_decimal_point_and_floats_with_12_significant_digits(value, text):
    assert format_number(value) == text


def test_the_calculator_tool_takes_an_expression_argument_and_describes_itself():
    assert calculator({"expression": "6 / 3"}) == "2"
    assert calculator.schema() == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": calculator.description,
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression, e.g. 814 * 707 - 965"}},
                "required": ["expression"],
            },
        },
    }
    with pytest.raises(TypeError):  # an argument it does not take: the model is told (run_tool_call)
        calculator({"expr": "1"})
    with pytest.raises(ValueError, match='"expression" must be a string'):
        calculate(12)
