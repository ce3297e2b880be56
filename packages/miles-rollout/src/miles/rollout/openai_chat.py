"""The OpenAI chat-completions format of the session endpoint (``miles.rollout.sessions``): which request fields are
honoured, ignored or refused, messages in the canonical form they are rendered and compared in, and the
``chat.completion`` answer (OpenAI API reference, "Create chat completion":
https://platform.openai.com/docs/api-reference/chat/create).

Honoured: ``messages`` (roles system, user, assistant, tool; content a string, null or a list of text parts;
assistant ``tool_calls``; tool ``tool_call_id`` and ``name``), ``tools`` (rendered by the chat template),
``max_completion_tokens`` / ``max_tokens`` (a cap below the session's own limits), ``tool_choice`` "auto".
Ignored: ``model``, ``user``, ``metadata``, ``parallel_tool_calls`` and every sampling setting (``SAMPLING_KEYS``):
the session samples with the rollout's settings, since the log-probs it records must be those of the distribution
the trainer recomputes. Refused (HTTP 400): ``stream``, ``n`` > 1, ``stop``, another ``tool_choice``, ``logprobs``,
a ``response_format`` other than text, content parts other than text.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from miles.rollout.tools import split_tool_calls

ROLES = ("system", "user", "assistant", "tool")
# Request fields that would change how tokens are sampled: ignored (the session's sampling wins).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias")  # fmt: skip


@dataclass(frozen=True)
class ChatRequest:
    """A parsed chat-completions request.

    Attributes:
        messages: the messages in canonical form (``canonical_message``).
        tools: the OpenAI function schemas, as sent ([] when none).
        max_tokens: ``max_completion_tokens`` (else ``max_tokens``); None when neither is given.
        ignored: the ``SAMPLING_KEYS`` the request set (not applied).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    max_tokens: int | None
    ignored: tuple[str, ...]


def parse_chat_request(body: Any) -> ChatRequest:
    """The request a JSON body asks for. Raises: ValueError naming the field for what the endpoint refuses."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of chat messages")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(
            "'tools' must be a list of objects {type: function, function: {name, description, parameters}}"
        )
    if body.get("stream"):
        raise ValueError("'stream' is not supported: the endpoint answers whole completions; send stream false")
    if body.get("n") not in (None, 1):
        raise ValueError(f"'n' is {body['n']!r}: a session records one trajectory, so n must be 1")
    if body.get("stop") not in (None, "", []):
        raise ValueError("'stop' is not supported: a turn ends at the policy's stop tokens or at max_tokens")
    if body.get("tool_choice") not in (None, "auto"):
        raise ValueError(
            f"'tool_choice' {body['tool_choice']!r} cannot be enforced: the policy samples its turn freely; send "
            "'auto' or leave it out"
        )
    if body.get("logprobs"):
        raise ValueError("'logprobs' is not supported: Miles records the log-probs for training; they are not returned")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ValueError("'response_format' must be text (or left out): the policy's output is not constrained")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError(f"'max_completion_tokens' / 'max_tokens' is {max_tokens!r}; it must be an integer >= 1")
    return ChatRequest(
        messages=[canonical_message(m, i) for i, m in enumerate(messages)],
        tools=list(tools),
        max_tokens=max_tokens,
        ignored=tuple(k for k in SAMPLING_KEYS if body.get(k) is not None),
    )


def canonical_message(message: Any, index: int) -> dict[str, Any]:
    """A message as the chat template renders it and the endpoint compares it: ``role``, ``content`` (a string:
    null is "", text parts joined), an assistant's ``tool_calls`` (``{id, type, function: {name, arguments}}``,
    arguments parsed from their JSON string when they are an object), a tool message's ``tool_call_id`` and
    ``name``; other fields dropped. Raises: ValueError naming ``messages[index]``."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} is a {type(message).__name__}, not a message object")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role is {role!r}; the endpoint takes the roles {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [
            _tool_call(call, f"{where}.tool_calls[{k}]") for k, call in enumerate(message["tool_calls"])
        ]
    if role == "tool":
        out |= {key: message[key] for key in ("tool_call_id", "name") if isinstance(message.get(key), str)}
    return out


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ValueError(f"{where}.content must be a string, null or a list of text parts (other parts are not supported)")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be an object {{id, type: function, function: {{name, arguments}}}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments  # templates render objects; keep bad JSON
    return {"id": str(call.get("id", "")), "type": "function", "function": {"name": function["name"],
                                                                              "arguments": arguments}}  # fmt: skip


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What two canonical messages must share to be the same turn: role, content and the tool calls' names and
    arguments (call ids and other fields aside)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in message.get("tool_calls", ())
    )
    return message["role"], message["content"], calls


def first_difference(history: list[dict[str, Any]], messages: list[dict[str, Any]]) -> str | None:
    """Why ``messages`` does not start with ``history`` (both canonical), or None when it does."""
    if len(messages) < len(history):
        return f"the request has {len(messages)} messages, fewer than the {len(history)} of the conversation so far"
    for i, (old, new) in enumerate(zip(history, messages)):
        if message_key(old) != message_key(new):
            recorded = json.dumps({k: old[k] for k in ("role", "content", "tool_calls") if k in old})[:200]
            return f"messages[{i}] ({new['role']}) is not the recorded {recorded}"
    return None


def assistant_message(text: str, *, call_id_prefix: str) -> dict[str, Any]:
    """The OpenAI assistant message of a model turn's text: ``content`` the text outside its tool-call blocks (null
    when only calls remain), ``tool_calls`` one per well-formed ``<tool_call>`` block, arguments as a JSON string,
    ids ``{call_id_prefix}_{k}``."""
    content, calls = split_tool_calls(text)
    if not calls:
        return {"role": "assistant", "content": content}
    tool_calls = [
        {"id": f"{call_id_prefix}_{k}", "type": "function",
         "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
        for k, call in enumerate(calls)
    ]  # fmt: skip
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}


def completion(
    *, completion_id: str, model: str, message: dict[str, Any], finish_reason: str, prompt_tokens: int,
    completion_tokens: int
) -> dict[str, Any]:  # fmt: skip
    """A ``chat.completion`` object with one choice; ``finish_reason`` is "stop", "length" or "tool_calls"."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def error(message: str, *, kind: str) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
