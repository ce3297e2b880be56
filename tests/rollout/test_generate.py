"""ChatRollout and generate_group: failed prompts, response text, statuses, seeds and sample order."""

import asyncio

import pytest
from miles.core.buffer import generate_samples
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateOutput
from miles.core.sample import Sample


class CountingEngine:
    """Answers every request with [5, 2]; counts the requests."""

    weight_version = 0

    def __init__(self):
        self.num_requests = 0

    async def generate(self, request):
        self.num_requests += 1
        return GenerateOutput([5, 2], [-1.0, -1.0], "stop")


def test_bad_prompts_fail_their_samples_without_a_request_and_the_rest_is_generated():
    from miles.rollout.generate import ChatRollout

    engine = CountingEngine()
    rollout = ChatRollout(engine, tokenizer=None, max_prompt_tokens=3)
    # Prompt 1 is empty and prompt 2 too long (4 > 3 tokens): their 2 x 3 samples fail before generation.
    prompts = [Sample(index=0, group_index=0, prompt=[1, 7]), Sample(index=1, group_index=1, prompt=""),
               Sample(index=2, group_index=2, prompt=[1, 2, 3, 4])]  # fmt: skip
    samples = generate_samples(prompts, rollout, n_samples_per_prompt=3, sampling=SamplingConfig(), seed=0)
    assert [s.status.value for s in samples] == ["completed"] * 3 + ["failed"] * 6
    assert "max_prompt_tokens" in samples[-1].metadata["failure"]
    assert len(samples) == 9 and engine.num_requests == 3


class RecordingEngine:
    """Answers every request with [5, 2] and records the requests."""

    weight_version = 0

    def __init__(self):
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        return GenerateOutput([5, 2], [-1.0, -1.0], "stop")


class DigitTokenizer:
    """decode() only: token id k is the text str(k); special tokens (id 2) are skipped when asked."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 2))


def test_the_decoded_response_is_the_typed_response_text_field_that_rewards_read():
    from miles.rollout.generate import ChatRollout
    from miles.rollout.rewards import extract_answer

    prompts = [Sample(index=0, group_index=0, prompt=[1, 7])]
    samples = generate_samples(
        prompts, ChatRollout(RecordingEngine(), DigitTokenizer()), n_samples_per_prompt=1, sampling=SamplingConfig(),
        seed=0,
    )  # fmt: skip
    assert samples[0].response_text == "5" and "response_text" not in samples[0].metadata
    assert extract_answer(samples[0].response_text) == "5"
    token_only = generate_samples(
        prompts, ChatRollout(RecordingEngine(), tokenizer=None), n_samples_per_prompt=1, sampling=SamplingConfig(),
        seed=0,
    )  # fmt: skip
    assert token_only[0].response_text is None  # no tokenizer, no text


class SeedEchoEngine:
    """Answers each request with [seed % 50, 2], the later the earlier it was submitted (reversed completion)."""

    weight_version = 0

    def __init__(self):
        self.num_requests = 0

    async def generate(self, request):
        self.num_requests += 1
        await asyncio.sleep(0.05 / self.num_requests)
        return GenerateOutput([request.seed % 50, 2], [-1.0, -1.0], "stop", weight_versions=[2, 3])


def test_chat_rollout_samples_come_in_prompt_order_each_with_the_seed_of_its_position():
    from miles.core.buffer import sample_seed
    from miles.rollout.generate import ChatRollout

    prompts = [Sample(index=0, group_index=g, prompt=[1, 7 + g]) for g in (4, 5, 6)]
    samples = generate_samples(
        prompts, ChatRollout(SeedEchoEngine(), tokenizer=None), n_samples_per_prompt=2, sampling=SamplingConfig(),
        seed=11,
    )  # fmt: skip
    assert [s.group_index for s in samples] == [4, 4, 5, 5, 6, 6] and [s.index for s in samples] == list(range(6))
    assert [s.response_tokens[0] for s in samples] == [sample_seed(11, i) % 50 for i in range(6)]
    assert samples[0].tokens[:2] == [1, 11] and samples[0].weight_versions == [2, 3]
    assert samples[0].weight_version == 3  # the newest


def test_generate_group_needs_one_seed_per_sample():
    from miles.rollout.generate import generate_group

    with pytest.raises(ValueError, match="2 seeds for n=3"):
        asyncio.run(generate_group(SeedEchoEngine(), None, Sample(index=0, group_index=0, prompt=[1]), n=3,
                                   sampling=SamplingConfig(), seeds=[0, 1]))  # fmt: skip


class AbortingEngine:
    """Aborts the first ``aborts`` requests of each seed with a partial response, then answers [seed, 2]; a seed of
    13 fails on its own (``RequestFailed``)."""

    weight_version = 0

    def __init__(self, aborts):
        self.aborts = aborts
        self.requests = []

    async def generate(self, request):
        from miles.core.protocols import RequestFailed

        self.requests.append(request.seed)
        if request.seed == 13:
            raise RequestFailed("server rejected the request: bad sampling params")
        if self.requests.count(request.seed) <= self.aborts:
            return GenerateOutput([9], [-0.5], "abort")
        return GenerateOutput([request.seed, 2], [-1.0, -1.0], "stop")


@pytest.mark.parametrize("aborts, status", [(1, "completed"), (2, "completed"), (3, "aborted")])
def test_responses_cut_off_by_a_pause_are_requested_again_from_the_start_up_to_the_bound(aborts, status):
    from miles.rollout.generate import generate_group

    engine = AbortingEngine(aborts)
    prompt = Sample(index=0, group_index=4, prompt=[1, 7])
    samples = asyncio.run(
        generate_group(engine, None, prompt, n=2, sampling=SamplingConfig(), seeds=[5, 6], max_resubmits=2)
    )
    assert [s.status.value for s in samples] == [status, status]
    assert sorted(engine.requests) == sorted([5, 6] * min(aborts + 1, 3))  # the same seed each time
    if status == "completed":
        assert [s.response_tokens for s in samples] == [[5, 2], [6, 2]]
        assert [s.metadata["resubmits"] for s in samples] == [aborts, aborts]
    else:  # the bound is used up: the partial response is kept, not trained
        assert [s.response_tokens for s in samples] == [[9], [9]]


def test_a_request_that_fails_on_its_own_fails_only_its_sample():
    from miles.rollout.generate import generate_group

    samples = asyncio.run(
        generate_group(AbortingEngine(0), None, Sample(index=0, group_index=0, prompt=[1, 7]), n=2,
                       sampling=SamplingConfig(), seeds=[13, 6])
    )  # fmt: skip
    assert [s.status.value for s in samples] == ["failed", "completed"]
    assert "bad sampling params" in samples[0].metadata["failure"] and samples[0].response_length == 0
    assert samples[1].response_tokens == [6, 2]
