"""Tools a multi-turn rollout lets the model call, and the Hermes tool-call format they are called in.

A tool call is a JSON object ``{"name": ..., "arguments": {...}}`` inside ``<tool_call>...</tool_call>`` tags in
the model's text: the format of NousResearch's Hermes function calling, which Qwen2.5/Qwen3 chat templates render
(https://github.com/NousResearch/Hermes-Function-Calling). The result goes back as a ``{"role": "tool"}`` message,
which the chat template renders (ChatML: a ``tool`` turn; Qwen3: ``<tool_response>`` inside a user turn).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles.core.plugins import load_plugin

# An unclosed call at the end of the text (the model stopped before "</tool_call>") is parsed too.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


@dataclass(frozen=True)
class Tool:
    """A function the model may call by name.

    Attributes:
        name: what the model writes as ``"name"`` in its call.
        description: one sentence, shown to the model by chat templates with a tools section (Qwen3's system prompt;
            SmolLM2's ChatML shows none, so describe the tool in the system prompt there).
        parameters: JSON schema of the arguments object.
        fn: called with the arguments as keywords; returns the result text. ValueError or TypeError (bad or missing
            arguments) go back to the model as ``"Error: ..."``; any other exception fails the sample.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str] = field(repr=False)

    def schema(self) -> dict[str, Any]:
        """The tool as an OpenAI-style function schema, what ``apply_chat_template(tools=...)`` expects."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        """``fn(**arguments)``. Raises: what ``fn`` raises (TypeError for arguments it does not take)."""
        return self.fn(**arguments)


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call. ``error`` says why a call could not be parsed (then name and arguments may be empty)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in a model turn, in order: each ``<tool_call>{"name": str, "arguments": object}</tool_call>``.

    ``arguments`` may also be a JSON string holding the object (some models write it so). A block that is not such
    an object becomes a call with ``error`` set, so the model is told what was wrong instead of being ignored.

    >>> parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    [ToolCall(name='calculator', arguments={'expression': '2+3'}, error=None)]
    >>> parse_tool_calls("The answer is 5.")
    []
    """
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({err.msg} at character {err.pos})"))
            continue
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # reported below: not an object
        if not isinstance(name, str) or not isinstance(arguments, dict):
            error = 'a tool call must be a JSON object {"name": <tool name>, "arguments": {...}}'
            calls.append(ToolCall(name if isinstance(name, str) else "", {}, error))
            continue
        calls.append(ToolCall(name, arguments))
    return calls


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A model turn as an OpenAI assistant message's parts: the text outside its well-formed tool-call blocks
    (stripped), and those blocks' calls in order. A block that does not parse (``ToolCall.error``) stays in the text
    as written, so whoever reads the message sees what the model wrote.

    >>> split_tool_calls('Let me look.\\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>')
    ('Let me look.', [ToolCall(name='weather', arguments={'city': 'Oslo'}, error=None)])
    """
    parts, calls, end = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        [call] = parse_tool_calls(match.group(0))
        if call.error is None:
            parts.append(text[end : match.start()])
            calls.append(call)
            end = match.end()
    parts.append(text[end:])
    return "".join(parts).strip(), calls


def run_tool_call(call: ToolCall, tools: Mapping[str, Tool]) -> str:
    """The text a tool call returns to the model: the tool's result, or ``"Error: ..."`` for a call that could not
    be parsed, names no tool, or whose arguments the tool refused (ValueError/TypeError).

    Raises: any other exception of the tool (a bug in it, not a bad call): the caller fails the sample.
    """
    if call.error is not None:
        return f"Error: {call.error}"
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}; the tools are {', '.join(sorted(tools))}"
    try:
        return tool(call.arguments)
    except (ValueError, TypeError) as err:
        return f"Error: {err}"


def load_tools(paths: Sequence[str], *, key: str = "rollout.multi_turn.tools") -> dict[str, Tool]:
    """Import the tools named by ``module:attr`` paths, by name.

    Raises: ValueError for a malformed path or two tools with one name; ImportError/AttributeError naming the key;
        TypeError for an object that is not a ``Tool``.
    """
    tools: dict[str, Tool] = {}
    for i, path in enumerate(paths):
        item_key = f"{key}[{i}]"
        tool = load_plugin(path, key=item_key)
        if not isinstance(tool, Tool):
            raise TypeError(
                f"{item_key}: {path!r} is a {type(tool).__name__}, not a miles.rollout.tools.Tool; wrap the function: "
                "Tool(name=..., description=..., parameters={JSON schema}, fn=my_function)"
            )
        if tool.name in tools:
            raise ValueError(f"{item_key}: {path!r} is a second tool named {tool.name!r}; tool names must be unique")
        tools[tool.name] = tool
    return tools
