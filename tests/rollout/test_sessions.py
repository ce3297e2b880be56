"""SessionServer: an OpenAI chat-completions endpoint per rollout session. Driven over HTTP (httpx), the closed sample
holds exactly the first request's template rendering, the engine's ids and the rendered new messages, with mask 1
and the engine's log-probs on model ids only; a history that diverges gets 400, an unknown session 404; budgets cut
ids, masks and log-probs together; requests run on the event loop that opened the session; the server binds
127.0.0.1 and leaves nothing running.

The main conversation runs on the embedded engine over the tiny random SmolLM2; its expected ids come from replaying
each turn's request on the engine (same ids, seed and settings give the same response) and from ChatML written out
by hand. The other tests script the engine (turn k returns known ids), so every expected id is known."""

import asyncio
import json
import re
import threading
from pathlib import Path

import httpx
import pytest
from miles.core.buffer import sample_seed
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateOutput, GenerateRequest, RequestFailed
from miles.core.sample import Sample, SampleStatus
from miles.rollout.calculator import calculator
from miles.rollout.sessions import SessionServer

QWEN3_TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()
IM_END = 2  # SmolLM2's <|im_end|>, its eos
SYSTEM = {"role": "system", "content": "Use the calculator tool."}
USER = {"role": "user", "content": "Calculate 814 * 707 - 965."}
PROMPT = Sample(index=0, group_index=3, prompt=[SYSTEM, USER], label="574533", metadata={"task": "arith"})
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "814 * 707 - 965"}}</tool_call>'
TOOLS = [calculator.schema()]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def engine(tiny_smollm2_dir):
    from miles.rollout.engines.embedded import EmbeddedEngine

    return EmbeddedEngine(tiny_smollm2_dir, dtype="fp32")


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """Answers request k with ``outputs[k]`` (or ``outputs[k](request)``); records requests and their event loops."""

    weight_version = 0

    def __init__(self, outputs):
        self.outputs, self.requests, self.loops = list(outputs), [], []

    async def generate(self, request):
        self.requests.append(request)
        self.loops.append(asyncio.get_running_loop())
        output = self.outputs[len(self.requests) - 1]
        return output(request) if callable(output) else output


def model_turn(tokenizer, text, *, finish="stop"):
    """What a model writing ``text`` returns: its ids (+ <|im_end|> on a stop), log-probs -0.01 * (position + 1)."""
    ids = encode(tokenizer, text) + ([IM_END] if finish == "stop" else [])
    return GenerateOutput(ids, [-0.01 * (i + 1) for i in range(len(ids))], finish)


def post(server, session_id, messages, **fields):
    body = {"model": "anything", "messages": messages, **fields}
    return httpx.post(f"{server.url}/sessions/{session_id}/v1/chat/completions", json=body, timeout=60)


def assert_aligned(sample):
    assert len(sample.tokens) == sample.prompt_length + sample.response_length
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m)


def test_a_three_turn_conversation_with_a_tool_message_records_the_prompt_the_engine_ids_and_the_new_messages(
    engine, tokenizer
):
    sampling = SamplingConfig(max_new_tokens=6)
    with SessionServer(engine, tokenizer) as server:
        assert server.url.startswith("http://127.0.0.1:")
        session_id = server.open(PROMPT, sampling=sampling, seed=5, max_response_tokens=200)
        messages = [SYSTEM, USER]
        answers = [post(server, session_id, messages, tools=TOOLS, temperature=0.2)]
        tool = {"role": "tool", "tool_call_id": "call_1", "name": "calculator", "content": "574533"}
        messages += [answers[0].json()["choices"][0]["message"], tool]
        answers.append(post(server, session_id, messages, tools=TOOLS))
        follow_up = {"role": "user", "content": "Are you sure?"}
        messages += [answers[1].json()["choices"][0]["message"], follow_up]
        answers.append(post(server, session_id, messages, tools=TOOLS, max_completion_tokens=3))
        sample = server.close_session(session_id)
    assert [a.status_code for a in answers] == [200, 200, 200]

    # Expected, independently: the template's prompt, each turn replayed on the engine, the new messages in ChatML.
    prompt = encode(
        tokenizer, tokenizer.apply_chat_template([SYSTEM, USER], tokenize=False, add_generation_prompt=True)
    )
    new_texts = ["<|im_start|>tool\n574533<|im_end|>\n", "<|im_start|>user\nAre you sure?<|im_end|>\n"]
    tokens, mask, log_probs, outputs = list(prompt), [], [], []
    for k, max_new in enumerate([6, 6, 3]):
        request = GenerateRequest(list(tokens), SamplingConfig(max_new_tokens=max_new), seed=sample_seed(5, k))
        [output] = engine.generate_batch([request])  # temperature 1.0: the request's 0.2 is ignored
        outputs.append(output)
        tokens += output.response_tokens
        mask += [1] * len(output.response_tokens)
        log_probs += output.log_probs
        if k < 2:  # the glue: "\n" after a sampled <|im_end|>, else the whole "<|im_end|>\n"
            glue = "\n" if output.response_tokens[-1] == IM_END else "<|im_end|>\n"
            suffix = encode(tokenizer, glue + new_texts[k] + "<|im_start|>assistant\n")
            tokens += suffix
            mask += [0] * len(suffix)
            log_probs += [0.0] * len(suffix)
    assert sample.tokens == tokens and sample.prompt_length == len(prompt)
    assert sample.loss_mask == mask
    assert sample.rollout_log_probs == pytest.approx(log_probs, abs=1e-6)
    assert_aligned(sample)

    for answer, output in zip(answers, outputs):
        body = answer.json()
        assert body["object"] == "chat.completion" and body["choices"][0]["index"] == 0
        text = tokenizer.decode(output.response_tokens, skip_special_tokens=True)
        assert body["choices"][0]["message"] == {"role": "assistant", "content": text.strip()}
        assert body["choices"][0]["finish_reason"] == output.finish_reason  # "stop" or "length": no tool call
        assert body["usage"]["completion_tokens"] == len(output.response_tokens)
    assert answers[0].json()["usage"]["prompt_tokens"] == len(prompt)
    assert answers[2].json()["usage"]["completion_tokens"] <= 3  # the request's cap below the session's 6
    assert (sample.index, sample.group_index, sample.label, sample.prompt) == (0, 3, "574533", [SYSTEM, USER])
    assert sample.metadata["task"] == "arith" and sample.metadata["num_turns"] == 3
    assert [m["role"] for m in sample.metadata["messages"]] == ["system", "user", "assistant", "tool", "assistant",
                                                                "user", "assistant"]  # fmt: skip
    expected_status = SampleStatus.COMPLETED if outputs[2].finish_reason == "stop" else SampleStatus.TRUNCATED
    assert sample.status == expected_status and sample.weight_versions == [0, 0, 0]
    assert sample.response_text == tokenizer.decode(outputs[2].response_tokens, skip_special_tokens=True)


def test_tool_calls_come_back_as_openai_tool_calls_and_their_results_are_the_next_suffix(tokenizer):
    first, second = model_turn(tokenizer, f"Let me compute.\n{CALL}"), model_turn(tokenizer, "574533")
    engine = ScriptedEngine([first, second])
    with SessionServer(engine, tokenizer) as server:
        session_id = server.open(PROMPT, sampling=SamplingConfig(max_new_tokens=64), seed=0, max_response_tokens=256)
        answer = post(server, session_id, [SYSTEM, USER], tools=TOOLS).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        assert choice["message"]["content"] == "Let me compute."
        assert call["type"] == "function" and call["function"]["name"] == "calculator"
        assert json.loads(call["function"]["arguments"]) == {"expression": "814 * 707 - 965"}
        # As an OpenAI client echoes it: extra fields, arguments re-serialized without spaces.
        echoed = {**choice["message"], "refusal": None, "annotations": []}
        arguments = json.dumps({"expression": "814 * 707 - 965"}, separators=(",", ":"))
        echoed["tool_calls"] = [{**call, "function": {"name": "calculator", "arguments": arguments}}]
        tool = {"role": "tool", "tool_call_id": call["id"], "content": "574533"}
        answer = post(server, session_id, [SYSTEM, USER, echoed, tool], tools=TOOLS).json()
        assert answer["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "574533"},
                                        "finish_reason": "stop", "logprobs": None}  # fmt: skip
        sample = server.close_session(session_id)
    prompt = encode(
        tokenizer, tokenizer.apply_chat_template([SYSTEM, USER], tokenize=False, add_generation_prompt=True)
    )
    suffix = encode(tokenizer, "\n<|im_start|>tool\n574533<|im_end|>\n<|im_start|>assistant\n")
    assert engine.requests[1].prompt_tokens == prompt + first.response_tokens + suffix  # token in, never re-rendered
    assert sample.tokens == prompt + first.response_tokens + suffix + second.response_tokens
    assert sample.loss_mask == [1] * len(first.response_tokens) + [0] * len(suffix) + [1] * len(second.response_tokens)
    assert sample.rollout_log_probs == first.log_probs + [0.0] * len(suffix) + second.log_probs
    assert (sample.status, sample.metadata["stop_reason"], sample.metadata["num_tool_calls"]) == (
        SampleStatus.COMPLETED, "stop", 1)  # fmt: skip
    assert [r.seed for r in engine.requests] == [sample_seed(0, 0), sample_seed(0, 1)]


def test_the_qwen3_template_trajectory_is_its_rendering_of_the_conversation(tokenizer):
    """Qwen3: reasoning and two calls in turn 1; the two results become one user turn of <tool_response> blocks."""
    turn_1 = (
        "<think>\nI need 814 * 707 first.\n</think>\n\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "814 * 707"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "575498 - 965"}}\n</tool_call>'
    )
    turn_2 = "<think>\nBoth are in.\n</think>\n\nThe answer is 574533."
    engine = ScriptedEngine([model_turn(tokenizer, turn_1), model_turn(tokenizer, turn_2)])
    with SessionServer(engine, tokenizer, chat_template=QWEN3_TEMPLATE) as server:
        session_id = server.open(PROMPT, sampling=SamplingConfig(max_new_tokens=128), seed=0, max_response_tokens=512)
        message = post(server, session_id, [SYSTEM, USER], tools=TOOLS).json()["choices"][0]["message"]
        assert message["content"] == "<think>\nI need 814 * 707 first.\n</think>"
        results = [{"role": "tool", "tool_call_id": c["id"], "content": r}
                   for c, r in zip(message["tool_calls"], ["575498", "574533"])]  # fmt: skip
        post(server, session_id, [SYSTEM, USER, message, *results], tools=TOOLS)
        sample = server.close_session(session_id)
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
             for e in ["814 * 707", "575498 - 965"]]  # fmt: skip
    structured = {"role": "assistant", "content": "<think>\nI need 814 * 707 first.\n</think>\n\n", "tool_calls": calls}
    conversation = [SYSTEM, USER, structured, *results, {"role": "assistant", "content": turn_2}]
    text = tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False, chat_template=QWEN3_TEMPLATE)
    assert sample.tokens + encode(tokenizer, "\n") == encode(tokenizer, text)  # but the final "\n", not sampled
    merged = ("\n<|im_start|>user\n<tool_response>\n575498\n</tool_response>\n<tool_response>\n574533\n"
              "</tool_response><|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    assert sample.loss_mask.count(0) == len(encode(tokenizer, merged)) and sample.metadata["num_tool_calls"] == 2


def test_a_history_that_differs_from_the_recorded_one_gets_400_and_changes_nothing(tokenizer):
    engine = ScriptedEngine([model_turn(tokenizer, "About 574533."), model_turn(tokenizer, "574533")])
    with SessionServer(engine, tokenizer) as server:
        session_id = server.open(PROMPT, sampling=SamplingConfig(max_new_tokens=64), seed=0, max_response_tokens=256)
        reply = post(server, session_id, [SYSTEM, USER]).json()["choices"][0]["message"]
        follow_up = {"role": "user", "content": "Only the number."}
        edited = {**reply, "content": "574533."}
        for messages, expected in [
            ([SYSTEM, USER, edited, follow_up], r"messages\[2\] \(assistant\) is not the recorded"),
            ([SYSTEM, {**USER, "content": "Calculate 1 + 1."}, reply, follow_up], r"messages\[1\] \(user\)"),
            ([SYSTEM, USER, follow_up], r"messages\[2\] \(user\) is not the recorded"),
            ([SYSTEM], "fewer than the 3 of the conversation so far"),
            ([SYSTEM, USER, reply], "no new message after the conversation so far"),
            ([SYSTEM, USER, reply, follow_up, {"role": "assistant", "content": "574533"}], r"messages\[4\] is a new"),
        ]:
            answer = post(server, session_id, messages)
            assert answer.status_code == 400
            assert answer.json()["error"]["type"] == "invalid_request_error"
            assert re.search(expected, answer.json()["error"]["message"]), answer.json()
        tools_changed = post(server, session_id, [SYSTEM, USER, reply, follow_up], tools=TOOLS)
        assert tools_changed.status_code == 400 and "'tools' differ" in tools_changed.json()["error"]["message"]
        assert len(engine.requests) == 1  # nothing was generated for a refused request
        assert post(server, session_id, [SYSTEM, USER, reply, follow_up]).status_code == 200
        sample = server.close_session(session_id)
    assert sample.metadata["num_turns"] == 2 and sample.status == SampleStatus.COMPLETED


@pytest.mark.parametrize(
    "fields, message",
    [
        pytest.param({"stream": True}, "'stream' is not supported", id="stream"),
        pytest.param({"n": 2}, "'n' is 2", id="n"),
        pytest.param({"stop": ["\n"]}, "'stop' is not supported", id="stop"),
        pytest.param({"tool_choice": "required"}, "'tool_choice' 'required' cannot be enforced", id="tool_choice"),
        pytest.param({"logprobs": True}, "'logprobs' is not supported", id="logprobs"),
        pytest.param({"max_tokens": 0}, "must be an integer >= 1", id="max_tokens"),
        pytest.param({"messages": [{"role": "developer", "content": "x"}]}, r"messages\[0\].role is 'developer'",
                     id="role"),
        pytest.param({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                     r"messages\[0\].content must be a string", id="image_part"),
        pytest.param({"messages": []}, "'messages' must be a non-empty list", id="no_messages"),
        pytest.param({"messages": [SYSTEM, USER, {"role": "assistant", "content": "574"}]},
                     "continuing a partial assistant turn is not supported", id="assistant_prefill"),
    ],
)  # fmt: skip
def test_what_the_endpoint_cannot_honour_is_refused_with_400_naming_the_field(tokenizer, fields, message):
    engine = ScriptedEngine([])
    with SessionServer(engine, tokenizer) as server:
        session_id = server.open(PROMPT, sampling=SamplingConfig(), seed=0, max_response_tokens=64)
        answer = post(server, session_id, **{"messages": [USER], **fields})
        assert answer.status_code == 400 and engine.requests == []
        assert re.search(message, answer.json()["error"]["message"]), answer.json()
        server.close_session(session_id)


def test_the_budget_cuts_the_last_turn_ends_the_session_with_finish_length_and_keeps_everything_aligned(tokenizer):
    first = model_turn(tokenizer, "Let me think.")
    follow_up = {"role": "user", "content": "Go on."}
    suffix = encode(tokenizer, "\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n")
    budget = len(first.response_tokens) + len(suffix) + 2  # room for exactly two ids of turn 2
    cut = GenerateOutput([28, 29], [-0.3, -0.4], "length")
    engine = ScriptedEngine([first, cut])
    with SessionServer(engine, tokenizer) as server:
        session_id = server.open(PROMPT, sampling=SamplingConfig(max_new_tokens=32), seed=0, max_response_tokens=budget)
        reply = post(server, session_id, [SYSTEM, USER]).json()["choices"][0]["message"]
        second = post(server, session_id, [SYSTEM, USER, reply, follow_up]).json()["choices"][0]
        assert engine.requests[1].sampling.max_new_tokens == 2  # min(max_new_tokens, budget left)
        assert second["finish_reason"] == "length"
        more = [SYSTEM, USER, reply, follow_up, second["message"], follow_up]
        third = post(server, session_id, more).json()
        assert third["choices"][0]["finish_reason"] == "length" and third["choices"][0]["message"]["content"] == ""
        assert third["usage"]["completion_tokens"] == 0 and len(engine.requests) == 2  # nothing more generated
        sample = server.close_session(session_id)
    assert (sample.status, sample.metadata["stop_reason"]) == (SampleStatus.TRUNCATED, "max_response_tokens")
    assert sample.response_length == budget and sample.response_tokens[-2:] == [28, 29]
    assert sample.loss_mask == [1] * len(first.response_tokens) + [0] * len(suffix) + [1, 1]
    assert sample.rollout_log_probs[-2:] == [-0.3, -0.4]
    assert_aligned(sample)


def test_new_messages_that_would_fill_the_budget_are_not_appended_and_max_turns_ends_the_session(tokenizer):
    first = model_turn(tokenizer, "574533")
    long_message = {"role": "user", "content": "word " * 50}
    engine = ScriptedEngine([first, first])
    samples = []
    for max_turns, budget, follow_up in [(4, 30, long_message), (1, 256, {"role": "user", "content": "Sure?"})]:
        with SessionServer(engine, tokenizer, max_turns=max_turns) as server:
            session_id = server.open(PROMPT, sampling=SamplingConfig(), seed=0, max_response_tokens=budget)
            reply = post(server, session_id, [SYSTEM, USER]).json()["choices"][0]["message"]
            answer = post(server, session_id, [SYSTEM, USER, reply, follow_up]).json()["choices"][0]
            assert answer == {"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length",
                              "logprobs": None}  # fmt: skip
            samples.append(server.close_session(session_id))
    assert len(engine.requests) == 2  # one turn per session
    assert [s.metadata["stop_reason"] for s in samples] == ["max_response_tokens", "max_turns"]
    for sample in samples:
        assert sample.status == SampleStatus.TRUNCATED and sample.response_tokens == first.response_tokens
        assert sample.metadata["messages"][-1]["role"] == "user"  # recorded, not rendered into the ids
        assert_aligned(sample)


def test_unknown_and_closed_sessions_get_404_and_a_session_without_a_request_fails(tokenizer):
    with SessionServer(ScriptedEngine([]), tokenizer) as server:
        assert post(server, "nope", [USER]).status_code == 404
        session_id = server.open(PROMPT, sampling=SamplingConfig(), seed=0, max_response_tokens=64)
        sample = server.close_session(session_id)
        answer = post(server, session_id, [USER])
        assert answer.status_code == 404 and "no open session" in answer.json()["error"]["message"]
        with pytest.raises(KeyError):
            server.close_session(session_id)
    assert (sample.status, sample.metadata["failure"]) == (
        SampleStatus.FAILED,
        "the agent made no chat-completion request",
    )
    assert (sample.response_length, sample.loss_mask, sample.rollout_log_probs) == (0, None, [])


def test_a_failed_engine_request_fails_the_session_and_later_requests_get_409(tokenizer):
    def fail(request):
        raise RequestFailed("server answered 500")

    with SessionServer(ScriptedEngine([fail]), tokenizer, max_prompt_tokens=10_000) as server:
        session_id = server.open(PROMPT, sampling=SamplingConfig(), seed=0, max_response_tokens=64)
        assert post(server, session_id, [SYSTEM, USER]).status_code == 502
        later = post(server, session_id, [SYSTEM, USER])
        assert later.status_code == 409 and "server answered 500" in later.json()["error"]["message"]
        sample = server.close_session(session_id)
    assert (sample.status, sample.metadata["failure"]) == (SampleStatus.FAILED, "server answered 500")
    assert sample.tokens == encode(tokenizer, tokenizer.apply_chat_template([SYSTEM, USER], tokenize=False,
                                                                             add_generation_prompt=True))  # fmt: skip
    with SessionServer(ScriptedEngine([]), tokenizer, max_prompt_tokens=4) as server:
        too_long = server.open(PROMPT, sampling=SamplingConfig(), seed=0, max_response_tokens=64)
        answer = post(server, too_long, [SYSTEM, USER])
        assert answer.status_code == 400 and "> max_prompt_tokens 4" in answer.json()["error"]["message"]
        assert server.close_session(too_long).status == SampleStatus.FAILED


def test_an_aborted_turn_is_requested_again_with_the_same_seed_then_the_session_ends_aborted(tokenizer):
    partial = GenerateOutput([28], [-0.2], "abort")
    engine = ScriptedEngine([partial, model_turn(tokenizer, "574533"), partial])
    with SessionServer(engine, tokenizer, max_resubmits=1) as server:
        session_id = server.open(PROMPT, sampling=SamplingConfig(), seed=4, max_response_tokens=256)
        reply = post(server, session_id, [SYSTEM, USER]).json()["choices"][0]["message"]
        assert reply["content"] == "574533"
        follow_up = {"role": "user", "content": "And plus one?"}
        answer = post(server, session_id, [SYSTEM, USER, reply, follow_up]).json()["choices"][0]
        sample = server.close_session(session_id)
    # One resubmit per session: turn 0 uses it; turn 1's abort ends the session with its partial turn.
    assert [r.seed for r in engine.requests] == [sample_seed(4, 0), sample_seed(4, 0), sample_seed(4, 1)]
    assert answer["finish_reason"] == "length"
    assert (sample.status, sample.metadata["stop_reason"], sample.metadata["resubmits"]) == (
        SampleStatus.ABORTED, "abort", 1)  # fmt: skip
    assert sample.response_tokens[-1] == 28 and sample.loss_mask[-1] == 1
    assert_aligned(sample)


def test_a_session_opened_in_an_event_loop_generates_on_that_loop(tokenizer):
    """The engine sees the opening (rollout) loop, where its other requests run, not the server's thread."""
    engine = ScriptedEngine([model_turn(tokenizer, "574533")])

    async def rollout(server):
        session_id = server.open(PROMPT, sampling=SamplingConfig(), seed=0, max_response_tokens=64)
        async with httpx.AsyncClient(base_url=f"{server.url}/sessions/{session_id}/v1", timeout=60) as client:
            answer = await client.post("/chat/completions", json={"messages": [SYSTEM, USER]})
        return asyncio.get_running_loop(), answer, server.close_session(session_id)

    with SessionServer(engine, tokenizer) as server:
        loop, answer, sample = asyncio.run(rollout(server))
    assert answer.status_code == 200 and engine.loops == [loop]
    assert sample.status == SampleStatus.COMPLETED


def test_the_server_binds_loopback_and_nothing_runs_after_close(tokenizer):
    server = SessionServer(ScriptedEngine([]), tokenizer).start()
    url = server.url
    assert url.startswith("http://127.0.0.1:")
    assert any(t.name == "miles-sessions" for t in threading.enumerate())
    server.close()
    assert not any(t.name == "miles-sessions" for t in threading.enumerate())
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"{url}/sessions/x/v1/chat/completions", json={}, timeout=5)
    with pytest.raises(RuntimeError, match="not running"):
        server.url  # noqa: B018
    server.close()  # idempotent
