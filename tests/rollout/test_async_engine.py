"""The embedded engine per request: per-request seeds, internal batching of concurrent calls, and pause modes
(abort, retract, keep) around a weight update."""

import asyncio
import math
import threading

import pytest
import torch
from doubles import hold_sampling_step
from miles.core.buffer import generate_samples
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
    assert list(engine.batch_sizes) == [6, 1, 1, 1, 1, 1, 1, 6]  # requests started together
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
        # Inverse transform sampling: the first token whose cumulative probability exceeds u (float64 draw).
        u = torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        expected = int((probs.double().cumsum(0) <= u * probs.double().sum()).sum())
        assert out.response_tokens == [expected]  # HF's greedy step kept exactly the row sampler's draw
        assert out.log_probs[0] == pytest.approx(math.log(probs[expected]), abs=1e-5)


def test_generate_batches_concurrent_calls_by_sampling_settings_up_to_max_batch_size(tiny_llama_dir):
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2], max_batch_size=4, continuous=False)
    assert not engine.continuous
    cold = SamplingConfig(temperature=0.5, max_new_tokens=3)
    reqs = requests(10, SamplingConfig(max_new_tokens=3)) + requests(2, cold)

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    outputs = asyncio.run(run())
    # 10 requests of one setting in batches of 4, 4, 2; the 2 of the other setting in their own batch.
    assert sorted(engine.batch_sizes) == [2, 2, 4, 4]
    assert [o.request_id for o in outputs] == [r.request_id for r in reqs]


def test_continuous_batching_admits_queued_requests_as_running_ones_finish(tiny_llama_dir):
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2], max_batch_size=4)
    assert engine.continuous
    short, long = SamplingConfig(max_new_tokens=2), SamplingConfig(max_new_tokens=12)
    cold = SamplingConfig(temperature=0.5, max_new_tokens=12)
    # 2 short + 2 long fill the 4 slots; as the short ones end after 2 tokens, the queued 2 (another temperature:
    # settings share a step) join while the long ones still run.
    reqs = requests(2, short) + requests(2, long) + requests(2, cold)
    outputs = engine.generate_batch(reqs)
    sizes = list(engine.decode_batch_sizes)
    assert list(engine.batch_sizes)[0] == 4 and sum(engine.batch_sizes) == 6
    assert max(sizes) == 4  # never more rows than slots, and full again after the short ones left
    assert sizes.index(4, 1) > 0 and len(sizes) < 2 + 12 + 12  # the queued ones overlapped the long ones
    assert [o.request_id for o in outputs] == [r.request_id for r in reqs]
    # A request's output does not depend on what it was batched with, nor on when it joined.
    alone = [EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2]).generate_batch([r])[0] for r in reqs]
    for batched, single in zip(outputs, alone):
        assert batched.response_tokens == single.response_tokens
        assert batched.log_probs == pytest.approx(single.log_probs, abs=1e-5)


def test_the_n_samples_of_a_prompt_share_one_prefill(tiny_llama_dir):
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2], logprob_mode="decode")
    prefills = []
    engine.model.lm_head.register_forward_pre_hook(lambda module, args: prefills.append(args[0].shape))
    sampling = SamplingConfig(max_new_tokens=1)
    reqs = [GenerateRequest([1, 5, 6], sampling, seed=s) for s in range(6)] + [
        GenerateRequest([1, 7], sampling, seed=0)
    ]
    outputs = engine.generate_batch(reqs)
    assert len(prefills) == 2  # one prefill per distinct prompt
    assert len({o.response_tokens[0] for o in outputs[:6]}) > 1  # forked caches, each row its own draws


def test_a_rollout_does_not_depend_on_the_engines_batch_size(tiny_llama_dir):
    prompts = [Sample(index=i, group_index=i, prompt=[1, 3 + i]) for i in range(3)]
    sampling = SamplingConfig(max_new_tokens=6)
    samples = {}
    for size in (1, 64):
        engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2], max_batch_size=size)
        rollout = ChatRollout(engine, tokenizer=None)
        samples[size] = generate_samples(prompts, rollout, n_samples_per_prompt=4, sampling=sampling, seed=5)
    assert [s.tokens for s in samples[1]] == [s.tokens for s in samples[64]]
    assert [s.index for s in samples[64]] == list(range(12))


def test_pause_abort_ends_running_and_queued_requests_with_their_partial_outputs(tiny_llama_dir):
    # Stop id 30: not among the first 3 tokens these seeds sample, so both running requests are cut off.
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[30], max_batch_size=2)
    # Released once pause has interrupted; 2 run (2 prompts prefilled), 1 waits in the queue.
    held, _ = hold_sampling_step(engine, 3, until=engine._interrupt.is_set, num_prompts=2)
    reqs = requests(3)

    async def run():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        assert await asyncio.to_thread(held.wait, 30)
        partial = await engine.pause("abort")
        return partial, await asyncio.gather(*tasks)

    partial, outputs = asyncio.run(run())
    running, queued = outputs[:2], outputs[2]
    assert [o.finish_reason for o in outputs] == ["abort"] * 3
    assert [len(o.response_tokens) for o in running] == [3, 3]  # stopped right after the held decode step
    assert all(len(o.log_probs) == 3 and all(lp <= 0 for lp in o.log_probs) for o in running)
    assert queued.response_tokens == [] and queued.log_probs == []
    assert sorted(o.request_id for o in partial) == sorted(r.request_id for r in reqs)
    engine.resume_now()
    assert engine.generate_batch(requests(1, SamplingConfig(max_new_tokens=4)))[0].finish_reason in ("stop", "length")


def test_a_request_submitted_while_an_abort_pause_waits_is_held_until_resume_not_aborted(tiny_llama_dir):
    """The async loop resubmits an aborted request at once; if it arrives while the pause still waits for the
    running batch, it must wait for the new weights, not be aborted a second time (SGLang holds it too)."""
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[30], max_batch_size=2)
    late_submitted = threading.Event()
    held, _ = hold_sampling_step(engine, 3, until=late_submitted.is_set, num_prompts=2)
    reqs, late_request = requests(2), GenerateRequest([1, 9, 4], SamplingConfig(max_new_tokens=4), seed=3)

    async def run():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        assert await asyncio.to_thread(held.wait, 30)
        pause = asyncio.ensure_future(engine.pause("abort"))
        assert await asyncio.to_thread(engine._interrupt.wait, 30)  # the pause began and waits for the batch
        late = asyncio.ensure_future(engine.generate(late_request))
        for _ in range(3):  # submitted (and moved into the queue)
            await asyncio.sleep(0)
        late_submitted.set()  # the held batch may stop now
        partial = await pause
        outputs = await asyncio.gather(*tasks)
        held_late = not late.done()
        engine.resume_now()
        return partial, outputs, held_late, await late

    partial, outputs, held_late, late = asyncio.run(run())
    assert [o.finish_reason for o in outputs] == ["abort", "abort"]
    assert sorted(o.request_id for o in partial) == sorted(r.request_id for r in reqs)  # not the late one
    assert held_late
    assert late.finish_reason in ("stop", "length") and len(late.response_tokens) >= 1


def test_close_mid_generation_aborts_the_running_requests_and_ends_the_worker_thread(tiny_llama_dir):
    """A run stopped at once mid-generation (a second Ctrl-C) closes the engine: no worker thread may be left in
    torch when the process exits (CPython ends such a daemon thread with pthread_exit, whose unwinding through C++
    frames called std::terminate: exit 134)."""
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[30], max_batch_size=2)
    held, _ = hold_sampling_step(engine, 3, until=engine._interrupt.is_set, num_prompts=2)
    reqs = requests(2)

    async def run():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        assert await asyncio.to_thread(held.wait, 30)
        worker = engine._worker
        await asyncio.to_thread(engine.close)
        return worker, await asyncio.gather(*tasks)

    worker, outputs = asyncio.run(run())
    assert worker is not None and not worker.is_alive()  # joined by close, not left to the interpreter's exit
    assert [o.finish_reason for o in outputs] == ["abort", "abort"]
    assert [len(o.response_tokens) for o in outputs] == [3, 3]  # stopped right after the held decode step
    engine.close()  # idempotent: nothing runs


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


@pytest.mark.parametrize("mask", [False, True])
def test_a_partial_rollout_trains_its_older_segments_only_when_asked(mask):
    class ContinuedEngine:  # one request, continued after an update: 3 tokens on v1, then 2 on v2
        async def generate(self, request):
            return GenerateOutput([5, 6, 7, 8, 2], [-0.5] * 5, "stop", weight_versions=[1, 2], segment_lengths=[3, 2])

    prompt = Sample(index=0, group_index=0, prompt=[1, 4, 9])
    (sample,) = asyncio.run(
        generate_group(ContinuedEngine(), None, prompt, n=1, sampling=SamplingConfig(), seeds=[0],
                       mask_stale_segments=mask)
    )  # fmt: skip
    assert len(sample.tokens) == 3 + 5 and sample.response_length == len(sample.rollout_log_probs) == 5
    assert sample.weight_versions == [1, 2] and sample.status == SampleStatus.COMPLETED
    assert sample.token_versions == [1, 1, 1, 2, 2]  # where the weights changed, kept on the sample
    assert sample.loss_mask == ([0, 0, 0, 1, 1] if mask else None)


def test_a_server_engine_s_continued_request_has_versions_but_no_token_versions():
    class ServerLikeEngine:  # vLLM / SGLang: the versions of a continued request, not where they changed
        async def generate(self, request):
            return GenerateOutput([5, 6, 7, 2], [-0.5] * 4, "stop", weight_versions=[1, 2])

    prompt = Sample(index=0, group_index=0, prompt=[1, 4, 9])
    (sample,) = asyncio.run(
        generate_group(ServerLikeEngine(), None, prompt, n=1, sampling=SamplingConfig(), seeds=[0],
                       mask_stale_segments=True)
    )  # fmt: skip
    assert sample.weight_versions == [1, 2] and sample.token_versions is None
    assert sample.loss_mask is None  # nothing to mask by: every token is trained


@pytest.mark.parametrize("new_weights", [pytest.param(False, id="same_weights"), pytest.param(True, id="updated")])
def test_pause_retract_continues_after_resume_with_one_segment_per_weight_version(tiny_llama_dir, new_weights):
    from miles.sync import InProcessTransport, WeightSender

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    reqs = [GenerateRequest([1, 4], sampling, seed=3), GenerateRequest([1, 9], sampling, seed=4)]
    uninterrupted = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[31]).generate_batch(reqs)
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[31])
    held, _ = hold_sampling_step(engine, 3, until=engine._interrupt.is_set, num_prompts=2)

    async def run():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        assert await asyncio.to_thread(held.wait, 30)
        partial = await engine.pause("retract")
        assert not any(task.done() for task in tasks)  # retracted requests wait for resume
        if new_weights:  # a zero LM head: every next token is uniform over the 32 ids
            state = engine.model.state_dict()
            zeros = {k: torch.zeros_like(v) if k == "lm_head.weight" else v.clone() for k, v in state.items()}
            WeightSender(InProcessTransport(engine.receiver)).push(zeros.items())
        await engine.resume()
        return partial, await asyncio.gather(*tasks)

    partial, outputs = asyncio.run(run())
    assert [p.finish_reason for p in partial] == ["abort", "abort"]
    for part, out, before in zip(partial, outputs, uninterrupted):
        assert len(part.response_tokens) == 3 and out.response_tokens[:3] == part.response_tokens
        assert out.log_probs[:3] == pytest.approx(part.log_probs, abs=1e-6)
        assert len(out.response_tokens) == len(out.log_probs) > 3
        assert out.finish_reason == "stop" or len(out.response_tokens) == 8  # the 8-token budget spans both segments
        assert out.segment_lengths == [3, len(out.response_tokens) - 3]  # where the weights changed
        if new_weights:
            assert out.weight_versions == [0, 1] and out.weight_version == 1
            assert out.log_probs[3:] == pytest.approx([-math.log(32)] * (len(out.log_probs) - 3), abs=1e-5)  # v1
        else:  # the request's generator carried on: the same response as without the pause
            assert out.weight_versions == [0, 0]
            assert out.response_tokens == before.response_tokens
            assert out.log_probs == pytest.approx(before.log_probs, abs=1e-5)


def test_pause_keep_lets_the_running_batch_finish_and_holds_new_requests_until_resume(engine):
    held, _ = hold_sampling_step(engine, 3, until=lambda: engine._paused, num_prompts=2)
    reqs = requests(2, SamplingConfig(max_new_tokens=6))

    async def run():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        assert await asyncio.to_thread(held.wait, 30)
        interrupted = await engine.pause("keep")
        assert interrupted == [] and all(task.done() for task in tasks)  # the batch ran to its end
        late = asyncio.ensure_future(engine.generate(requests(1, SamplingConfig(max_new_tokens=2))[0]))
        await asyncio.sleep(0.2)
        assert not late.done()  # held while paused
        await engine.resume()
        return [task.result() for task in tasks], await late

    outputs, late = asyncio.run(run())
    assert all(o.finish_reason in ("stop", "length") for o in outputs)
    assert all(len(o.response_tokens) == 6 for o in outputs if o.finish_reason == "length")
    assert late.finish_reason in ("stop", "length") and list(engine.batch_sizes) == [2, 1]


def test_sample_rows_draws_each_row_by_inverse_transform_with_its_own_generator():
    from miles.rollout.engines.embedded import sample_rows

    logits = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.25, 0.25, 0.25, 0.25]]))  # token 1 excluded in row 0
    # Seeds whose first float64 draws are known: row 0 at u, row 1 at v.
    u = float(torch.rand((), generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    v = float(torch.rand((), generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    tokens = sample_rows(logits, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]).tolist()
    cumulative0 = [0.1, 0.1, 0.7, 1.0]
    assert tokens[0] == next(i for i, c in enumerate(cumulative0) if c > u) and tokens[0] != 1
    assert tokens[1] == int(v // 0.25)
    # Frequencies follow the probabilities, and an excluded token is never drawn.
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_rows(logits[:1], [g]) for _ in range(4000)])
    counts = torch.bincount(draws, minlength=4) / 4000
    assert counts[1] == 0 and counts.tolist() == pytest.approx([0.1, 0.0, 0.6, 0.3], abs=0.03)
