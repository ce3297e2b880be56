"""MultiTurnRollout: budgets (turns, response tokens) cut tokens, masks and log-probs together; aborted turns are
requested again; failures stay in their sample; seeds, versions, stale-token masks, routed experts and progress."""

import asyncio
import math

import pytest
from miles.core.buffer import sample_seed
from miles.core.config import MultiTurnConfig, SamplingConfig
from miles.core.protocols import GenerateOutput, RequestFailed
from miles.core.sample import Sample, SampleStatus
from miles.rollout.calculator import calculator
from miles.rollout.multiturn import MultiTurnRollout
from miles.rollout.tools import Tool

IM_END = 2
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
PROMPT = [{"role": "user", "content": "Calculate 2 + 3."}]
TOOL_SUFFIX = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Engine:
    """Answers each request with ``respond(request, k)`` (k: the request's number); records the requests."""

    weight_version = 0

    def __init__(self, respond):
        self.respond, self.requests = respond, []

    async def generate(self, request):
        self.requests.append(request)
        return self.respond(request, len(self.requests) - 1)


def turn(tokenizer, text, *, finish="stop", versions=(0,), segments=None, experts=None, log_prob=-0.5):
    ids = encode(tokenizer, text) + ([IM_END] if finish == "stop" else [])
    return GenerateOutput(ids, [log_prob] * len(ids), finish, weight_versions=list(versions),
                          segment_lengths=segments, routed_experts=experts)  # fmt: skip


def scripted(outputs):
    return Engine(lambda request, k: outputs[k])


def generate(engine, tokenizer, *, n=1, seeds=None, max_new_tokens=64, prompt=PROMPT, **kwargs):
    config_keys = {"max_turns", "max_response_tokens", "few_shot", "tool_timeout_s"}
    config = MultiTurnConfig(**{k: v for k, v in kwargs.items() if k in config_keys})
    tools = kwargs.pop("tools", {"calculator": calculator})
    options = {k: v for k, v in kwargs.items() if k not in config_keys}
    rollout = MultiTurnRollout(engine, tokenizer, config=config, tools=tools, **options)
    return asyncio.run(
        rollout.generate_group(Sample(index=0, group_index=3, prompt=prompt, label="5"), n=n,
                               sampling=SamplingConfig(max_new_tokens=max_new_tokens), seeds=seeds or list(range(n)))
    )  # fmt: skip


def assert_aligned(sample):
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m)


def test_the_response_budget_caps_the_next_turn_and_the_cut_turn_ends_truncated(tokenizer):
    first = turn(tokenizer, CALL)
    suffix = encode(tokenizer, TOOL_SUFFIX)
    engine = scripted([first, turn(tokenizer, "The", finish="length")])
    budget = len(first.response_tokens) + len(suffix) + 1  # room for exactly one token of turn 2
    [sample] = generate(engine, tokenizer, max_response_tokens=budget, max_new_tokens=budget - 1)
    assert [r.sampling.max_new_tokens for r in engine.requests] == [budget - 1, 1]  # min(max_new_tokens, left)
    assert (sample.status, sample.metadata["stop_reason"]) == (SampleStatus.TRUNCATED, "max_response_tokens")
    assert sample.response_length == budget
    assert sample.loss_mask == [1] * len(first.response_tokens) + [0] * len(suffix) + [1]
    assert_aligned(sample)


def test_tool_results_that_leave_no_room_for_a_model_token_are_not_appended(tokenizer):
    first = turn(tokenizer, CALL)
    engine = scripted([first])
    budget = len(first.response_tokens) + len(encode(tokenizer, TOOL_SUFFIX))  # the results would fill it
    [sample] = generate(engine, tokenizer, max_response_tokens=budget)
    assert len(engine.requests) == 1
    assert (sample.status, sample.metadata["stop_reason"]) == (SampleStatus.TRUNCATED, "max_response_tokens")
    assert sample.response_tokens == first.response_tokens and sample.loss_mask == [1] * len(first.response_tokens)
    assert sample.metadata["messages"][-1] == {"role": "tool", "name": "calculator", "content": "5"}


def test_a_tool_call_in_the_last_allowed_turn_ends_truncated_without_running_it(tokenizer):
    first = turn(tokenizer, CALL)
    [sample] = generate(scripted([first]), tokenizer, max_turns=1)
    assert (sample.status, sample.metadata["stop_reason"], sample.metadata["num_tool_calls"]) == (
        SampleStatus.TRUNCATED, "max_turns", 0)  # fmt: skip
    assert sample.response_tokens == first.response_tokens and sample.response_text == CALL


def test_a_turn_cut_at_max_new_tokens_with_budget_left_ends_truncated_by_length(tokenizer):
    [sample] = generate(scripted([turn(tokenizer, "Let me think", finish="length")]), tokenizer)
    assert (sample.status, sample.metadata["stop_reason"], sample.metadata["finish_reason"]) == (
        SampleStatus.TRUNCATED, "length", "length")  # fmt: skip


def test_an_aborted_turn_is_requested_again_from_the_same_trajectory_with_the_same_seed(tokenizer):
    first, partial = turn(tokenizer, CALL), turn(tokenizer, "Th", finish="abort", versions=(1,))
    final = turn(tokenizer, "5", versions=(2,))
    engine = scripted([first, partial, final])
    [sample] = generate(engine, tokenizer, max_resubmits=1)
    assert engine.requests[1].prompt_tokens == engine.requests[2].prompt_tokens
    assert engine.requests[1].seed == engine.requests[2].seed == sample_seed(0, 1)
    assert sample.metadata["resubmits"] == 1 and sample.status == SampleStatus.COMPLETED
    assert sample.response_tokens[-len(final.response_tokens) :] == final.response_tokens
    assert sample.weight_versions == [0, 2] and sample.weight_version == 2  # the aborted attempt left nothing


def test_without_resubmits_left_an_aborted_turn_ends_the_sample_aborted_with_its_partial_tokens(tokenizer):
    first, partial = turn(tokenizer, CALL), turn(tokenizer, "Th", finish="abort")
    [sample] = generate(scripted([first, partial]), tokenizer, max_resubmits=0)
    assert (sample.status, sample.metadata["stop_reason"]) == (SampleStatus.ABORTED, "abort")
    assert sample.response_tokens[-len(partial.response_tokens) :] == partial.response_tokens
    assert_aligned(sample)


def test_stale_tokens_are_masked_by_the_weight_version_that_sampled_them(tokenizer):
    first = turn(tokenizer, CALL, versions=(0, 1), segments=None)  # versions without boundaries: kept
    first = GenerateOutput(first.response_tokens, first.log_probs, "stop", weight_versions=[0, 1],
                           segment_lengths=[2, len(first.response_tokens) - 2])  # fmt: skip
    second = turn(tokenizer, "5", versions=(1,))
    [sample] = generate(scripted([first, second]), tokenizer, mask_stale_segments=True)
    num_suffix = len(encode(tokenizer, TOOL_SUFFIX))
    model_1 = len(first.response_tokens)
    assert sample.loss_mask == [0, 0] + [1] * (model_1 - 2) + [0] * num_suffix + [1] * len(second.response_tokens)
    assert sample.weight_versions == [0, 1, 1]
    unmasked = generate(scripted([first, second]), tokenizer)
    assert unmasked[0].loss_mask[:model_1] == [1] * model_1


def test_routed_experts_cover_every_token_and_a_later_turn_keeps_what_an_earlier_recorded(tokenizer):
    first = turn(tokenizer, CALL)
    prompt_length = len(encode(tokenizer, tokenizer.apply_chat_template(PROMPT, tokenize=False,
                                                                        add_generation_prompt=True)))  # fmt: skip

    def respond(request, k):
        ids = first.response_tokens if k == 0 else [encode(tokenizer, "5")[0], IM_END]
        rows = [[[k]]] * (len(request.prompt_tokens) + len(ids))  # [prompt + response, layers 1, top_k 1]
        return GenerateOutput(ids, [-0.5] * len(ids), "stop", routed_experts=rows)

    [sample] = generate(Engine(respond), tokenizer)
    routed = sample.rollout_routed_experts[:, 0, 0].tolist()
    first_request = prompt_length + len(first.response_tokens)  # what the first turn's engine call routed
    # the second request's prefill routed those tokens again (as 1); the routing recorded first (0) is kept
    assert routed == [0] * first_request + [1] * (len(sample.tokens) - first_request)
    assert sample.prompt_length == prompt_length


def test_a_bad_tool_call_gets_an_error_result_and_the_model_continues(tokenizer):
    bad = turn(tokenizer, '<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    [sample] = generate(scripted([bad, turn(tokenizer, "5")]), tokenizer)
    error = "Error: unknown tool 'search'; the tools are calculator"
    assert sample.metadata["messages"][1] == {"role": "tool", "name": "search", "content": error}
    assert f"<|im_start|>tool\n{error}<|im_end|>" in tokenizer.decode(sample.response_tokens)
    assert sample.status == SampleStatus.COMPLETED


def test_a_tool_past_its_time_limit_answers_an_error_and_slow_tools_do_not_block_other_samples(tokenizer):
    import threading

    release, together = threading.Event(), threading.Barrier(4, timeout=20)

    def slow(expression):
        if expression == "hang":
            release.wait(30)  # a tool that does not return (released at the end of the test)
            return "late"
        together.wait()  # passes only once 4 calls run at the same time; raises (fails the sample) otherwise
        return "5"

    hang = turn(tokenizer, '<tool_call>{"name": "calculator", "arguments": {"expression": "hang"}}</tool_call>')
    tools = {"calculator": Tool("calculator", "", {}, slow)}
    try:
        [sample] = generate(scripted([hang, turn(tokenizer, "5")]), tokenizer, tools=tools, tool_timeout_s=0.2)
        # the rollout (its asyncio.run included) ended while the tool still hangs: a hung tool holds only its thread
        assert not release.is_set() and any(t.name == "miles-tool-run_tool_call" for t in threading.enumerate())
        error = "Error: the tool 'calculator' did not answer within 0.2 s"
        assert sample.metadata["messages"][1]["content"] == error and sample.metadata["num_tool_timeouts"] == 1
        assert sample.status == SampleStatus.COMPLETED and sample.response_text == "5"
        # 4 samples, each calling the tool once: their calls run at once, in threads, off the event loop.
        engine = Engine(lambda request, k: turn(tokenizer, CALL if k < 4 else "5"))
        samples = generate(engine, tokenizer, n=4, tools=tools)
        assert all(s.status == SampleStatus.COMPLETED and "num_tool_timeouts" not in s.metadata for s in samples)
    finally:
        release.set()


@pytest.mark.parametrize(
    "outputs, options, failure",
    [
        pytest.param(
            lambda t: [turn(t, CALL)],
            {"tools": {"calculator": Tool("calculator", "", {}, lambda **_: 1 / 0)}},
            "tool 'calculator' raised ZeroDivisionError: division by zero",
            id="tool_bug",
        ),
        pytest.param(
            lambda t: [turn(t, CALL), GenerateOutput([5, 2], [-1.0, math.nan], "stop")],
            {},
            "engine returned non-finite log-probs (NaN/inf logits)",
            id="non_finite_second_turn",
        ),
        pytest.param(
            lambda t: [turn(t, CALL), GenerateOutput([], [], "stop")],
            {},
            "engine returned an empty response",
            id="empty_second_turn",
        ),  # fmt: skip
    ],
)
def test_a_failure_in_any_turn_fails_only_its_sample_and_drops_the_response(tokenizer, outputs, options, failure):
    [sample] = generate(scripted(outputs(tokenizer)), tokenizer, **options)
    assert (sample.status, sample.metadata["failure"]) == (SampleStatus.FAILED, failure)
    assert (sample.response_length, sample.loss_mask, sample.rollout_log_probs) == (0, None, [])
    assert sample.prompt_length > 0


def test_a_failed_request_fails_its_sample(tokenizer):
    def respond(request, k):
        raise RequestFailed("server answered 500")

    [sample] = generate(Engine(respond), tokenizer)
    assert (sample.status, sample.metadata["failure"]) == (SampleStatus.FAILED, "server answered 500")


def test_each_sample_and_turn_has_its_own_seed_and_progress_counts_samples(tokenizer):
    engine = Engine(lambda request, k: turn(tokenizer, CALL if request.seed in (sample_seed(10, 0),) else "5"))
    samples = generate(engine, tokenizer, n=2, seeds=[10, 20])
    assert sorted(r.seed for r in engine.requests) == sorted(
        [sample_seed(10, 0), sample_seed(10, 1), sample_seed(20, 0)]
    )
    assert [s.metadata["num_turns"] for s in samples] == [2, 1]
    assert [(s.index, s.group_index, s.label) for s in samples] == [(0, 3, "5"), (1, 3, "5")]


def test_a_prompt_too_long_fails_the_group_at_once_without_a_request(tokenizer):
    engine = scripted([])
    samples = generate(engine, tokenizer, n=3, max_prompt_tokens=4)
    assert [s.status for s in samples] == [SampleStatus.FAILED] * 3 and engine.requests == []
    assert (
        samples[0].metadata["failure"].startswith("prompt has ")
        and "> max_prompt_tokens" in samples[0].metadata["failure"]
    )


def test_few_shot_messages_go_after_the_system_message_and_token_prompts_stay_as_they_are(tokenizer):
    example = [{"role": "user", "content": "Calculate 1 + 1."}, {"role": "assistant", "content": "2"}]
    engine = scripted([turn(tokenizer, "5"), turn(tokenizer, "5")])
    system = {"role": "system", "content": "Use the calculator."}
    generate(engine, tokenizer, few_shot=example, prompt=[system, *PROMPT])
    expected = tokenizer.apply_chat_template([system, *example, *PROMPT], tokenize=False, add_generation_prompt=True)
    assert engine.requests[0].prompt_tokens == encode(tokenizer, expected)
    generate(engine, tokenizer, few_shot=example, prompt=[1, 7, 9])
    assert engine.requests[1].prompt_tokens == [1, 7, 9]


def test_wrong_seed_count_and_a_missing_tokenizer_are_errors(tokenizer):
    with pytest.raises(ValueError, match="got 1 seeds for n=2"):
        generate(scripted([]), tokenizer, n=2, seeds=[1])
    with pytest.raises(ValueError, match="needs the policy's tokenizer"):
        MultiTurnRollout(scripted([]), None, config=MultiTurnConfig(), tools={})
