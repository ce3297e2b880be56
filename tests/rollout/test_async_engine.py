"""The embedded engine per request: per-request seeds, internal batching of concurrent calls, and pause modes
(abort, retract, keep) around a weight update."""

import asyncio
import math
import threading

import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateOutput, GenerateRequest
from miles.core.rewards import score_samples
from miles.core.sample import Sample, SampleStatus
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.generate import ChatRollout, generate_group

LONG = SamplingConfig(temperature=1.0, max_new_tokens=40)


@pytest.fixture
def engine(tiny_llama_dir):
    return EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])


def requests(num, sampling=LONG):
    return [GenerateRequest([1, 3 + i % 7], sampling, seed=100 + i) for i in range(num)]


def test_a_requests_output_is_the_same_alone_batched_with_others_and_in_another_order(engine):
    reqs = requests(6, SamplingConfig(max_new_tokens=12))
    batched = engine.generate_batch(reqs)
    alone = [engine.generate_batch([r])[0] for r in reqs]
    reversed_order = engine.generate_batch(reqs[::-1])[::-1]
    assert list(engine.batch_sizes) == [6, 1, 1, 1, 1, 1, 1, 6]
    for b, a, r in zip(batched, alone, reversed_order):
        assert b.response_tokens == a.response_tokens == r.response_tokens
        assert b.log_probs == pytest.approx(a.log_probs, abs=1e-5)
    assert len({tuple(o.response_tokens) for o in batched}) == 6  # different seeds, different samples
    assert [o.request_id for o in batched] == [r.request_id for r in reqs]


def test_the_first_token_is_drawn_with_a_generator_seeded_by_the_request(engine, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).requires_grad_(False)
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=1)
    outputs = engine.generate_batch([GenerateRequest([1, 5, 6], sampling, seed=s) for s in range(8)])
    probs = torch.softmax(model(input_ids=torch.tensor([[1, 5, 6]])).logits[0, -1] / 0.8, -1)
    for seed, out in enumerate(outputs):
        expected = int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)))
        assert out.response_tokens == [expected]  # HF's greedy step kept exactly the row sampler's draw
        assert out.log_probs[0] == pytest.approx(math.log(probs[expected]), abs=1e-5)


def test_concurrent_generate_calls_are_batched_by_sampling_settings_up_to_max_batch_size(tiny_llama_dir):
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2], max_batch_size=4)
    cold = SamplingConfig(temperature=0.5, max_new_tokens=3)
    reqs = requests(10, SamplingConfig(max_new_tokens=3)) + requests(2, cold)

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    outputs = asyncio.run(run())
    # 10 requests of one setting in batches of 4, 4, 2; the 2 of the other setting in their own batch.
    assert sorted(engine.batch_sizes) == [2, 2, 4, 4]
    assert [o.request_id for o in outputs] == [r.request_id for r in reqs]


def test_a_rollout_does_not_depend_on_the_engines_batch_size(tiny_llama_dir):
    prompts = [Sample(index=i, group_index=i, prompt=[1, 3 + i]) for i in range(3)]
    sampling = SamplingConfig(max_new_tokens=6)
    samples = {}
    for size in (1, 64):
        engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2], max_batch_size=size)
        samples[size] = ChatRollout(engine, tokenizer=None)(prompts, n_samples_per_prompt=4, sampling=sampling, seed=5)
    assert [s.tokens for s in samples[1]] == [s.tokens for s in samples[64]]
    assert [s.index for s in samples[64]] == list(range(12))


def block_third_forward(engine, until):
    """Hold the engine's 3rd model forward (prefill, then 2 decode steps) until ``until()``; returns an Event set
    once it is held: the batch has sampled 2 tokens and will sample a 3rd before it can stop."""
    held = threading.Event()
    calls = []

    def hook(module, args, kwargs):
        calls.append(1)
        if len(calls) == 3:
            held.set()
            for _ in range(3000):
                if until():
                    return
                threading.Event().wait(0.01)

    engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    return held


def test_pause_abort_ends_running_and_queued_requests_with_their_partial_outputs(tiny_llama_dir):
    # Stop id 30: not among the first 3 tokens these seeds sample, so both running requests are cut off.
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[30], max_batch_size=2)
    held = block_third_forward(engine, until=engine._interrupt.is_set)  # released once pause has interrupted
    reqs = requests(3)  # 2 run, 1 waits in the queue

    async def run():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        assert await asyncio.to_thread(held.wait, 30)
        partial = await asyncio.to_thread(engine.pause, "abort")
        return partial, await asyncio.gather(*tasks)

    partial, outputs = asyncio.run(run())
    running, queued = outputs[:2], outputs[2]
    assert [o.finish_reason for o in outputs] == ["abort"] * 3
    assert [len(o.response_tokens) for o in running] == [3, 3]  # stopped right after the held decode step
    assert all(len(o.log_probs) == 3 and all(lp <= 0 for lp in o.log_probs) for o in running)
    assert queued.response_tokens == [] and queued.log_probs == []
    assert sorted(o.request_id for o in partial) == sorted(r.request_id for r in reqs)
    engine.resume()
    assert engine.generate_batch(requests(1, SamplingConfig(max_new_tokens=4)))[0].finish_reason in ("stop", "length")


def test_aborted_samples_are_aborted_not_failed_and_keep_their_partial_response():
    class AbortingEngine:
        weight_version = 1

        def __init__(self):
            self.outputs = iter(
                [
                    GenerateOutput([5, 6], [-1.0, -2.0], "abort", weight_version=1),
                    GenerateOutput([], [], "abort"),
                    GenerateOutput([5, 2], [-1.0, -1.0], "stop"),
                ]
            )

        async def generate(self, request):
            return next(self.outputs)

    prompt = Sample(index=0, group_index=4, prompt=[1, 7])
    samples = asyncio.run(
        generate_group(AbortingEngine(), None, prompt, n=3, sampling=SamplingConfig(), seeds=[0, 1, 2])
    )
    assert [s.status for s in samples] == [SampleStatus.ABORTED, SampleStatus.ABORTED, SampleStatus.COMPLETED]
    assert samples[0].response_tokens == [5, 6] and samples[0].weight_versions == [1]
    assert samples[1].response_length == 0 and "failure" not in samples[1].metadata
    assert score_samples(samples, lambda s: 1.0) == 0  # not failed
    assert [s.reward for s in samples] == [None, None, 1.0]  # and not scored


@pytest.mark.parametrize("new_weights", [pytest.param(False, id="same_weights"), pytest.param(True, id="updated")])
def test_pause_retract_continues_after_resume_with_one_segment_per_weight_version(tiny_llama_dir, new_weights):
    from miles.sync import InProcessTransport, WeightSender

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    reqs = [GenerateRequest([1, 4], sampling, seed=3), GenerateRequest([1, 9], sampling, seed=4)]
    uninterrupted = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[31]).generate_batch(reqs)
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[31])
    held = block_third_forward(engine, until=engine._interrupt.is_set)

    async def run():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        assert await asyncio.to_thread(held.wait, 30)
        partial = await asyncio.to_thread(engine.pause, "retract")
        assert not any(task.done() for task in tasks)  # retracted requests wait for resume
        if new_weights:  # a zero LM head: every next token is uniform over the 32 ids
            state = engine.model.state_dict()
            zeros = {k: torch.zeros_like(v) if k == "lm_head.weight" else v.clone() for k, v in state.items()}
            WeightSender(InProcessTransport(engine.receiver)).push(zeros.items())
        engine.resume()
        return partial, await asyncio.gather(*tasks)

    partial, outputs = asyncio.run(run())
    assert [p.finish_reason for p in partial] == ["abort", "abort"]
    for part, out, before in zip(partial, outputs, uninterrupted):
        assert len(part.response_tokens) == 3 and out.response_tokens[:3] == part.response_tokens
        assert out.log_probs[:3] == pytest.approx(part.log_probs, abs=1e-6)
        assert len(out.response_tokens) == len(out.log_probs) > 3
        assert out.finish_reason == "stop" or len(out.response_tokens) == 8  # the 8-token budget spans both segments
        if new_weights:
            assert out.weight_versions == [0, 1] and out.weight_version == 1
            assert out.log_probs[3:] == pytest.approx([-math.log(32)] * (len(out.log_probs) - 3), abs=1e-5)  # v1
        else:  # the request's generator carried on: the same response as without the pause
            assert out.weight_versions == [0, 0]
            assert out.response_tokens == before.response_tokens
            assert out.log_probs == pytest.approx(before.log_probs, abs=1e-5)


def test_pause_keep_lets_the_running_batch_finish_and_holds_new_requests_until_resume(engine):
    held = block_third_forward(engine, until=lambda: engine._paused)
    reqs = requests(2, SamplingConfig(max_new_tokens=6))

    async def run():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        assert await asyncio.to_thread(held.wait, 30)
        interrupted = await asyncio.to_thread(engine.pause, "keep")
        assert interrupted == [] and all(task.done() for task in tasks)  # the batch ran to its end
        late = asyncio.ensure_future(engine.generate(requests(1, SamplingConfig(max_new_tokens=2))[0]))
        await asyncio.sleep(0.2)
        assert not late.done()  # held while paused
        engine.resume()
        return [task.result() for task in tasks], await late

    outputs, late = asyncio.run(run())
    assert all(o.finish_reason in ("stop", "length") for o in outputs)
    assert all(len(o.response_tokens) == 6 for o in outputs if o.finish_reason == "length")
    assert late.finish_reason in ("stop", "length") and list(engine.batch_sizes) == [2, 1]
