"""Token-in-token-out trajectories equal the chat template's rendering of the same conversation, for two template
families available offline: SmolLM2's ChatML and Qwen3's (tests/rollout/qwen3_chat_template.jinja, applied with
SmolLM2's tokenizer, which has the same <|im_start|>/<|im_end|> special tokens). Where Qwen3 cannot round-trip
(it drops earlier reasoning once a new user turn comes, and empty think blocks of earlier turns), the exact
difference is asserted.

The engine is scripted: turn k returns ``tokenizer(text_k) + [<|im_end|>]`` with log-probs -0.01 * (position + 1),
so every expected id and log-prob is known."""

import asyncio
from pathlib import Path

import pytest
from miles.core.config import MultiTurnConfig, SamplingConfig
from miles.core.protocols import GenerateOutput
from miles.core.sample import Sample, SampleStatus
from miles.rollout.calculator import calculator
from miles.rollout.multiturn import MultiTurnRollout
from miles.rollout.tito import TurnRenderer

QWEN3_TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()
IM_END = 2  # SmolLM2's <|im_end|>, its eos
SYSTEM = {"role": "system", "content": "Use the calculator tool."}
USER = {"role": "user", "content": "Calculate 814 * 707 - 965."}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


class ScriptedEngine:
    """Answers request k with ``outputs[k]``; records the requests."""

    weight_version = 0

    def __init__(self, outputs):
        self.outputs, self.requests = list(outputs), []

    async def generate(self, request):
        self.requests.append(request)
        return self.outputs[len(self.requests) - 1]


def model_turn(tokenizer, text):
    """What a model that writes ``text`` then stops returns: its ids, <|im_end|>, known log-probs."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [IM_END]
    return GenerateOutput(ids, [-0.01 * (i + 1) for i in range(len(ids))], "stop")


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_one(tokenizer, texts, *, chat_template=None, config=None, prompt=(SYSTEM, USER)):
    outputs = [model_turn(tokenizer, t) for t in texts]
    engine = ScriptedEngine(outputs)
    rollout = MultiTurnRollout(engine, tokenizer, config=config or MultiTurnConfig(),
                               tools={"calculator": calculator}, chat_template=chat_template)  # fmt: skip
    [sample] = asyncio.run(
        rollout.generate_group(Sample(index=0, group_index=0, prompt=list(prompt)), n=1,
                               sampling=SamplingConfig(max_new_tokens=128), seeds=[7])
    )  # fmt: skip
    return sample, outputs, engine, rollout


def check_alignment(sample, outputs, suffixes):
    """Response = model turn 0, suffix 0, model turn 1, ...: mask 1/0 and log-probs/0.0 exactly along it."""
    mask, log_probs, response = [], [], []
    for k, output in enumerate(outputs):
        response += output.response_tokens
        mask += [1] * len(output.response_tokens)
        log_probs += output.log_probs
        if k < len(suffixes):
            response += suffixes[k]
            mask += [0] * len(suffixes[k])
            log_probs += [0.0] * len(suffixes[k])
    assert sample.response_tokens == response
    assert sample.loss_mask == mask and sample.rollout_log_probs == log_probs
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length == len(response)


def test_chatml_trajectory_is_the_smollm2_template_rendering_of_the_conversation(tokenizer):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "814 * 707 - 965"}}</tool_call>'
    sample, outputs, engine, rollout = run_one(tokenizer, [call, "The answer is 574533."])
    conversation = [SYSTEM, USER, {"role": "assistant", "content": call}, {"role": "tool", "content": "574533"},
                    {"role": "assistant", "content": "The answer is 574533."}]  # fmt: skip
    rendered = encode(tokenizer, tokenizer.apply_chat_template(conversation, tokenize=False))
    # The trajectory ends at the sampled <|im_end|>; the template's "\n" after the last message is not sampled.
    assert sample.tokens + encode(tokenizer, "\n") == rendered
    suffix = encode(tokenizer, "\n<|im_start|>tool\n574533<|im_end|>\n<|im_start|>assistant\n")
    check_alignment(sample, outputs, [suffix])
    prompt = encode(
        tokenizer, tokenizer.apply_chat_template([SYSTEM, USER], tokenize=False, add_generation_prompt=True)
    )
    assert sample.prompt_length == len(prompt) and sample.tokens[: len(prompt)] == prompt
    # Token in: turn 2's request is exactly turn 1's ids plus the suffix, never re-tokenized text.
    assert engine.requests[1].prompt_tokens == prompt + outputs[0].response_tokens + suffix
    assert (sample.status, sample.metadata["stop_reason"], sample.metadata["num_turns"]) == (
        SampleStatus.COMPLETED, "answer", 2)  # fmt: skip
    assert sample.response_text == "The answer is 574533."
    assert sample.metadata["messages"] == [
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "calculator", "content": "574533"},
        {"role": "assistant", "content": "The answer is 574533."},
    ]


def test_chatml_renders_two_results_of_one_turn_as_two_tool_turns(tokenizer):
    calls = ('<tool_call>{"name": "calculator", "arguments": {"expression": "814 * 707"}}</tool_call>\n'
             '<tool_call>{"name": "calculator", "arguments": {"expression": "575498 - 965"}}</tool_call>')  # fmt: skip
    sample, outputs, _, _ = run_one(tokenizer, [calls, "574533"])
    conversation = [SYSTEM, USER, {"role": "assistant", "content": calls}, {"role": "tool", "content": "575498"},
                    {"role": "tool", "content": "574533"}, {"role": "assistant", "content": "574533"}]  # fmt: skip
    rendered = encode(tokenizer, tokenizer.apply_chat_template(conversation, tokenize=False))
    assert sample.tokens + encode(tokenizer, "\n") == rendered
    suffix = "\n<|im_start|>tool\n575498<|im_end|>\n<|im_start|>tool\n574533<|im_end|>\n<|im_start|>assistant\n"
    check_alignment(sample, outputs, [encode(tokenizer, suffix)])
    assert sample.metadata["num_tool_calls"] == 2


QWEN3_TURN_1 = (
    "<think>\nI need 814 * 707 first, then subtract.\n</think>\n\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "814 * 707"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "575498 - 965"}}\n</tool_call>'
)
QWEN3_TURN_2 = "<think>\nBoth results are in.\n</think>\n\nThe answer is 574533."


def qwen3_assistant_with_calls(reasoning, expressions):
    """Turn 1 as the structured message Qwen3's template renders (reasoning split off, calls as tool_calls)."""
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
             for e in expressions]  # fmt: skip
    return {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n", "tool_calls": calls}


def test_qwen3_trajectory_with_reasoning_and_consecutive_tool_results_is_the_template_rendering(tokenizer):
    sample, outputs, _, rollout = run_one(tokenizer, [QWEN3_TURN_1, QWEN3_TURN_2], chat_template=QWEN3_TEMPLATE)
    conversation = [
        SYSTEM, USER,
        qwen3_assistant_with_calls("I need 814 * 707 first, then subtract.", ["814 * 707", "575498 - 965"]),
        {"role": "tool", "content": "575498"}, {"role": "tool", "content": "574533"},
        {"role": "assistant", "content": QWEN3_TURN_2},
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(conversation, tools=[calculator.schema()], tokenize=False,
                                         chat_template=QWEN3_TEMPLATE)  # fmt: skip
    assert sample.tokens + encode(tokenizer, "\n") == encode(tokenizer, text)
    # Consecutive results are one user turn of <tool_response> blocks.
    merged = ("\n<|im_start|>user\n<tool_response>\n575498\n</tool_response>\n<tool_response>\n574533\n"
              "</tool_response><|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    check_alignment(sample, outputs, [encode(tokenizer, merged)])
    assert "# Tools" in rollout.renderer.render([USER], add_generation_prompt=True)  # the tool list is shown
    assert sample.metadata["stop_reason"] == "answer" and sample.response_text == QWEN3_TURN_2


def test_qwen3_drops_earlier_reasoning_at_a_new_user_turn_which_the_trajectory_keeps_with_the_user_turn(tokenizer):
    """The one difference from re-rendering: the trajectory holds the think block the model wrote before the new
    user turn (the template drops it then); the new user turn itself is rendered in full."""
    renderer = TurnRenderer(tokenizer, tools=[calculator.schema()], chat_template=QWEN3_TEMPLATE)
    first = "<think>\nEasy.\n</think>\n\nThe answer is 574533."
    second = "<think>\nAdd one.\n</think>\n\n574534"
    follow_up = {"role": "user", "content": "Now add 1."}
    prompt = renderer.prompt_tokens([SYSTEM, USER])
    turn_1 = encode(tokenizer, first) + [IM_END]
    suffix = renderer.suffix_tokens([follow_up], last_token=IM_END)
    assert tokenizer.decode(suffix) == "\n<|im_start|>user\nNow add 1.<|im_end|>\n<|im_start|>assistant\n"
    tokens = prompt + turn_1 + suffix + encode(tokenizer, second) + [IM_END]

    conversation = [SYSTEM, USER, {"role": "assistant", "content": first}, follow_up,
                    {"role": "assistant", "content": second}]  # fmt: skip
    text = renderer.render(conversation, add_generation_prompt=False)
    assert "Easy." not in text  # the template dropped the first turn's reasoning
    dropped = "<think>\nEasy.\n</think>\n\n"
    first_header = text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    assert tokens + encode(tokenizer, "\n") == encode(tokenizer, text[:first_header] + dropped + text[first_header:])


def test_qwen3_without_thinking_keeps_the_empty_think_block_of_each_generation_prompt(tokenizer):
    """enable_thinking false: every assistant header the model continued from carries "<think>\\n\\n</think>\\n\\n";
    re-rendering keeps it only on the last assistant turn. And the ids differ where the text does not: the generation
    prompt ends in "\\n\\n", one id when the prompt is tokenized, two ("\\n", "\\n") when the whole text is."""
    config = MultiTurnConfig(chat_template_kwargs={"enable_thinking": False})
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "814 * 707 - 965"}}\n</tool_call>'
    sample, outputs, _, _ = run_one(tokenizer, [call, "574533"], chat_template=QWEN3_TEMPLATE, config=config)
    empty_think = "<think>\n\n</think>\n\n"
    suffix = (
        f"\n<|im_start|>user\n<tool_response>\n574533\n</tool_response><|im_end|>\n<|im_start|>assistant\n{empty_think}"
    )
    check_alignment(sample, outputs, [encode(tokenizer, suffix)])
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "814 * 707 - 965"}}}]
    conversation = [SYSTEM, USER, {"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "tool", "content": "574533"}, {"role": "assistant", "content": "574533"}]  # fmt: skip
    text = tokenizer.apply_chat_template(conversation, tools=[calculator.schema()], tokenize=False,
                                         chat_template=QWEN3_TEMPLATE, enable_thinking=False)  # fmt: skip
    first_header = text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    assert text[first_header:].startswith("<tool_call>")  # re-rendered without the empty block
    expected = text[:first_header] + empty_think + text[first_header:]
    assert tokenizer.decode(sample.tokens) + "\n" == expected
    [blank_line] = encode(tokenizer, "\n\n")  # the end of each generation prompt, before the model's first token
    assert sample.tokens.count(blank_line) == encode(tokenizer, expected).count(blank_line) + 2
    assert len(sample.tokens) + 1 == len(encode(tokenizer, expected)) - 2


def test_the_glue_after_a_turn_that_did_not_write_the_end_token_is_the_whole_message_end(tokenizer):
    renderer = TurnRenderer(tokenizer)
    tool = [{"role": "tool", "content": "5"}]
    assert renderer.message_end == "<|im_end|>\n"
    assert tokenizer.decode(renderer.suffix_tokens(tool, last_token=IM_END)).startswith("\n<|im_start|>tool")
    other = encode(tokenizer, "5")[-1]  # e.g. an <|endoftext|> stop, or any token that is not <|im_end|>
    assert tokenizer.decode(renderer.suffix_tokens(tool, last_token=other)).startswith("<|im_end|>\n<|im_start|>tool")


def test_a_template_that_rewrites_earlier_turns_for_a_tool_message_is_refused_at_construction(tokenizer):
    rewriting = "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.role == 'tool' %}!{% endif %}|{% endfor %}"
    rewriting = "{% if messages[-1].role == 'tool' %}TOOLS {% endif %}" + rewriting
    with pytest.raises(ValueError, match=r"renders \['tool'\] after a user message by changing the rendering before"):
        TurnRenderer(tokenizer, chat_template=rewriting)
