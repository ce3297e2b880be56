"""Hermes tool-call parsing, running calls (errors go back to the model) and loading tools from module:attr paths."""

import pytest
from miles.rollout.calculator import calculator
from miles.rollout.tools import Tool, ToolCall, load_tools, parse_tool_calls, run_tool_call

TOOLS = {"calculator": calculator}


@pytest.mark.parametrize(
    "text, calls",
    [
        pytest.param(
            'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>',
            [ToolCall("calculator", {"expression": "2+3"})],
            id="chatml_one_line",
        ),
        pytest.param(
            '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
            '{"x": 1}}\n</tool_call>',
            [ToolCall("a", {}), ToolCall("b", {"x": 1})],
            id="qwen3_two_calls_on_their_own_lines",
        ),
        pytest.param(
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>',
            [ToolCall("calculator", {"expression": "1"})],
            id="arguments_as_a_json_string",
        ),
        pytest.param(
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}',
            [ToolCall("calculator", {"expression": "1"})],
            id="unclosed_at_the_end",
        ),
        pytest.param("The answer is 5.", [], id="no_call"),
    ],
)
def test_tool_calls_are_parsed_in_order(text, calls):
    assert parse_tool_calls(text) == calls


@pytest.mark.parametrize(
    "text, error",
    [
        pytest.param(
            "<tool_call>{name: calculator}</tool_call>", "not valid JSON (Expecting property name", id="bad_json"
        ),
        pytest.param('<tool_call>["calculator"]</tool_call>', 'must be a JSON object {"name"', id="a_list"),
        pytest.param('<tool_call>{"name": "calculator", "arguments": 3}</tool_call>', "must be", id="bad_arguments"),
    ],
)
def test_a_malformed_call_is_kept_with_its_error_so_the_model_is_told(text, error):
    [call] = parse_tool_calls(text)
    assert error in call.error
    assert run_tool_call(call, TOOLS).startswith("Error: ")


def test_running_a_call_returns_the_result_or_an_error_message():
    assert run_tool_call(ToolCall("calculator", {"expression": "81 * 7 - 5"}), TOOLS) == "562"
    assert run_tool_call(ToolCall("calculator", {"expression": "1 / 0"}), TOOLS) == "Error: division by zero"
    assert run_tool_call(ToolCall("search", {}), TOOLS) == "Error: unknown tool 'search'; the tools are calculator"
    assert run_tool_call(ToolCall("calculator", {"x": 1}), TOOLS).startswith("Error: calculate() got an unexpected")


def test_a_tool_bug_is_raised_not_reported_to_the_model():
    def broken(**_):
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError, match="bug"):
        run_tool_call(ToolCall("broken", {}), {"broken": Tool("broken", "", {}, broken)})


def test_tools_load_by_module_attr_with_the_key_in_every_error():
    assert load_tools(["miles.rollout.calculator:calculator"]) == {"calculator": calculator}
    with pytest.raises(TypeError, match=r"rollout.multi_turn.tools\[1\]: .*calculate.* is a function, not a miles"):
        load_tools(["miles.rollout.calculator:calculator", "miles.rollout.calculator:calculate"])
    with pytest.raises(ValueError, match=r"tools\[1\]: .* a second tool named 'calculator'"):
        load_tools(["miles.rollout.calculator:calculator"] * 2)
    with pytest.raises(ImportError, match=r"rollout.multi_turn.tools\[0\]: cannot import module 'nope'"):
        load_tools(["nope:tool"])
    with pytest.raises(ValueError, match=r"rollout.multi_turn.tools\[0\] is 'calculator'; expected 'module:attr'"):
        load_tools(["calculator"])
