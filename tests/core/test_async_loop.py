"""The asynchronous loops: the rollout producer's staleness gate and drop rule, the prompt queue that makes
checkpoints count trained prompts, and whole runs of one_step_off and fully_async on a tiny model (embedded
engine, FSDP2, miles-sync in-process), compared with the sync loop."""

import asyncio
import threading
import time

import pytest
import torch
from doubles import ListSink, TokenPrompts, first_token_reward
from miles.core.config import AlgorithmConfig, EvalConfig, LoopConfig, RolloutConfig, SamplingConfig
from miles.core.loop import Components, train
from miles.core.producer import PromptQueue, RolloutProducer, group_staleness
from miles.core.publisher import EnginePublisher
from miles.core.sample import Sample, SampleStatus

ROLLOUT = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, sampling=SamplingConfig(max_new_tokens=2))


class VersionedGroups:
    """A group-generate function whose samples carry ``self.version`` (set by the test as the 'engine weights'),
    recording the seeds and prompt of every call."""

    def __init__(self):
        self.version = 0
        self.calls = []

    async def __call__(self, prompt, *, n, sampling, seeds):
        self.calls.append((prompt.group_index, list(seeds), self.version))
        await asyncio.sleep(0)
        return [
            Sample(index=j, group_index=prompt.group_index, prompt=prompt.prompt, tokens=[1, 5], response_length=1,
                   rollout_log_probs=[-1.0], status=SampleStatus.COMPLETED, weight_versions=[self.version],
                   weight_version=self.version)
            for j in range(n)
        ]  # fmt: skip


def test_a_sample_aborted_before_its_first_token_makes_its_group_no_staler():
    """Regression: the embedded engine reports version 0 for a request aborted before its first token, which made
    the group look as stale as the trainer's version (dropped and generated again, staleness/max inflated)."""
    aborted = Sample(0, 0, "p", weight_versions=[0], response_length=0, status=SampleStatus.ABORTED)
    assert group_staleness([aborted, Sample(1, 0, "p", weight_versions=[3], response_length=2)], 3) == 0
    assert group_staleness([aborted], 3) == 0


def test_group_staleness_counts_from_the_oldest_segment_of_any_sample():
    group = [
        Sample(0, 0, "p", weight_versions=[3], response_length=2),
        Sample(1, 0, "p", weight_versions=[1, 4], response_length=5),
    ]
    assert group_staleness(group, 5) == 4
    assert group_staleness([Sample(0, 0, "p")], 5) == 0  # nothing generated (failed before sampling)


def test_the_prompt_queue_serves_untrained_prompts_again_after_a_resume():
    queue = PromptQueue(TokenPrompts())
    drawn = queue.next_prompts(6)
    assert [p.group_index for p in drawn] == [0, 1, 2, 3, 4, 5]
    queue.mark_trained([0, 1, 3])
    state = queue.state_dict()
    resumed = PromptQueue(TokenPrompts())
    resumed.load_state_dict(state)
    again = resumed.next_prompts(4)
    # 2, 4, 5 sat in the buffer (drawn, never trained): served first, in draw order, then new prompts.
    assert [p.group_index for p in again] == [2, 4, 5, 6]
    assert [p.prompt for p in again[:3]] == [drawn[2].prompt, drawn[4].prompt, drawn[5].prompt]
    plain = PromptQueue(TokenPrompts())
    plain.load_state_dict({"count": 4})  # a sync run's checkpoint: the inner source's state alone
    assert [p.group_index for p in plain.next_prompts(2)] == [4, 5]


def test_the_gate_starts_a_step_only_within_the_staleness_bound_and_seeds_follow_the_sync_loop():
    fn = VersionedGroups()
    with RolloutProducer(fn, PromptQueue(TokenPrompts()), first_token_reward, rollout=ROLLOUT,
                         max_weight_staleness=1) as producer:  # fmt: skip
        groups = producer.take(0, version=0)
        assert [g[0].group_index for g in groups] == [0, 1]
        assert [s.index for g in groups for s in g] == [0, 1, 2, 3]
        producer.drain()
        # Bound 1: step 1's groups started (during step 0), step 2's wait for step 1 to finish.
        assert sorted(c[0] for c in fn.calls) == [0, 1, 2, 3]
        fn.version = 1
        producer.step_done(1)
        producer.take(1, version=1)
        producer.drain()
        assert sorted(c[0] for c in fn.calls) == [0, 1, 2, 3, 4, 5]
    from miles.core.buffer import sample_seed

    # Group 3 is step 1, position 1: the sync loop's seeds for that step and position.
    seeds = {c[0]: c[1] for c in fn.calls}
    step_seed = ROLLOUT.seed + 1_000_003 * 1
    assert seeds[3] == [sample_seed(step_seed, 2), sample_seed(step_seed, 3)]


def test_a_group_staler_than_the_bound_is_dropped_and_its_prompt_generated_again():
    fn = VersionedGroups()
    with RolloutProducer(fn, PromptQueue(TokenPrompts()), first_token_reward, rollout=ROLLOUT,
                         max_weight_staleness=1) as producer:  # fmt: skip
        producer.take(0, version=0)
        producer.drain()  # groups 2, 3 (step 1) generated on version 0
        fn.version = 3
        groups = producer.take(1, version=3)  # the trainer jumped to version 3: they are 3 stale > 1
        assert producer.num_dropped == 2
        assert [g[0].group_index for g in groups] == [2, 3]  # the same prompts, generated again ...
        assert all(s.weight_versions == [3] for g in groups for s in g)  # ... on the new weights
        # Generated again in the same step and position: the same seeds, the newer weights.
        assert [(c[1], c[2]) for c in fn.calls if c[0] == 2] == [(c[1], v) for c in fn.calls[2:3] for v in (0, 3)]


def test_a_dropped_group_s_prompt_can_be_given_up_for_a_new_one_with_its_seeds():
    fn = VersionedGroups()
    queue = PromptQueue(TokenPrompts())
    with RolloutProducer(fn, queue, first_token_reward, rollout=ROLLOUT, max_weight_staleness=1,
                         stale_groups="drop") as producer:  # fmt: skip
        producer.take(0, version=0)
        queue.mark_trained([0, 1])
        producer.drain()  # groups 2, 3 (prompts 2, 3; step 1) generated on version 0
        fn.version = 3
        groups = producer.take(1, version=3)  # 3 stale > 1: given up
        assert (producer.num_dropped, producer.num_discarded) == (2, 2)
        assert [g[0].group_index for g in groups] == [4, 5]  # new prompts in their places ...
        assert all(s.weight_versions == [3] for g in groups for s in g)  # ... on the new weights
        # ... with the seeds of group numbers 2 and 3 (step 1, positions 0 and 1).
        assert {c[0]: c[1] for c in fn.calls}[4] == {c[0]: c[1] for c in fn.calls}[2]
        untrained = {p["group_index"] for p in queue.state_dict()["untrained"]}
        assert not {2, 3} & untrained and {4, 5} <= untrained  # 2, 3 consumed: a resumed run does not serve them
    with pytest.raises(ValueError, match="loop.stale_groups is 'skip'; choose regenerate or drop"):
        RolloutProducer(fn, queue, first_token_reward, rollout=ROLLOUT, max_weight_staleness=1, stale_groups="skip")
    with pytest.raises(ValueError, match="loop.stale_groups is 'drop' but loop.mode is 'sync'"):
        LoopConfig(stale_groups="drop")


def test_an_error_in_the_producer_reaches_the_trainer():
    async def broken(prompt, *, n, sampling, seeds):
        raise KeyError("tool server down")

    with RolloutProducer(broken, PromptQueue(TokenPrompts()), first_token_reward, rollout=ROLLOUT,
                         max_weight_staleness=0) as producer:  # fmt: skip
        with pytest.raises(RuntimeError, match="rollout producer failed.*tool server down"):
            producer.take(0, version=0, timeout_s=30)


# -- whole runs on the tiny model --------------------------------------------------------------------


class RecordingQueue(PromptQueue):
    def __init__(self, source):
        super().__init__(source)
        self.trained = []

    def mark_trained(self, group_indices):
        self.trained.append(list(group_indices))
        super().mark_trained(group_indices)


def _run(tiny_llama_dir, loop: LoopConfig, *, max_resubmits=2, cut_by_update=False):
    """The tiny model's whole loop (4 prompts x 4 samples per step, up to 4 tokens); checks every sample's length and
    version invariants. ``cut_by_update``: step 2's prompts start generating only once step 1 is taken, and the
    engine then holds its second forward after that until the publisher's pause interrupts it, so the weight
    update after step 1 is certain to cut into generation (rows holding 1 token of v0)."""
    from miles.rollout.engines import EmbeddedEngine
    from miles.rollout.generate import ChatRollout
    from miles.sync import InProcessTransport, WeightSender
    from miles.train import FSDP2Backend, TrainConfig

    torch.manual_seed(0)
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    backend = FSDP2Backend(
        tiny_llama_dir,
        train=TrainConfig(lr=3e-3, micro_batch_size=32),
        temperature=1.0,
        weight_sink=WeightSender(InProcessTransport(engine.receiver)),
    )
    chat = ChatRollout(
        engine, tokenizer=None, max_resubmits=max_resubmits, mask_stale_segments=loop.mask_stale_segments
    )
    seen = []  # (group_index, weight_versions of each sample) per generated group, in completion order
    samples = []
    training = threading.Event()  # step 1's samples were taken: its training is next
    hooks = []
    if cut_by_update:

        class StepOneTaken:
            def on_rollout_end(self, step, step_samples):
                training.set()

        hooks.append(StepOneTaken())
        forwards = []

        def hold_until_paused(module, args):  # in the engine's worker thread
            if training.is_set():
                forwards.append(1)
                deadline = time.monotonic() + 30
                while len(forwards) == 2 and not engine._interrupt.is_set() and time.monotonic() < deadline:
                    time.sleep(0.005)

        engine.model.lm_head.register_forward_pre_hook(hold_until_paused)

    async def generate_group(prompt, **kwargs):
        while cut_by_update and prompt.group_index >= 4 and not training.is_set():
            await asyncio.sleep(0.005)
        group = await chat(prompt, **kwargs)
        seen.append((prompt.group_index, [s.weight_versions for s in group]))
        samples.extend(group)
        return group

    queue = RecordingQueue(TokenPrompts())
    sink = ListSink()
    components = Components(
        data_source=queue,
        generate_group=generate_group,
        reward_fn=first_token_reward,
        backend=backend,
        publisher=EnginePublisher(backend, [engine], pause_mode=loop.pause_mode or "keep"),
        sink=sink,
        hooks=hooks,
    )
    rollout = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=4, sampling=SamplingConfig(max_new_tokens=4))
    train(components, loop=loop, rollout=rollout, algorithm=AlgorithmConfig(), evaluation=EvalConfig(num_prompts=0))
    for sample in samples:  # after every abort, retract and truncation
        assert len(sample.tokens) == sample.prompt_length + sample.response_length
        assert len(sample.rollout_log_probs) == sample.response_length
        assert sample.loss_mask is None or len(sample.loss_mask) == sample.response_length
        # The embedded engine says which version sampled each token: all of them, within the sample's versions.
        assert len(sample.token_versions) == sample.response_length
        assert set(sample.token_versions) <= set(sample.weight_versions)
        if sample.response_length:
            assert sample.token_versions[0] == sample.weight_versions[0]
            assert sample.token_versions[-1] == sample.weight_versions[-1]
        if loop.mask_stale_segments:  # trained exactly where the newest version sampled
            newest = sample.weight_versions[-1]
            assert (sample.loss_mask or [1] * sample.response_length) == [
                int(v == newest) for v in sample.token_versions
            ]
    return sink.rows, backend.full_state_dict(), queue.trained, seen, samples


@pytest.fixture(scope="module")
def sync_run(tiny_llama_dir):
    return _run(tiny_llama_dir, LoopConfig(num_steps=3, save_interval=0))


def test_fully_async_with_staleness_0_reproduces_the_sync_loop_exactly(tiny_llama_dir, sync_run):
    rows, weights, trained, _, _ = _run(
        tiny_llama_dir, LoopConfig(mode="fully_async", max_weight_staleness=0, num_steps=3, save_interval=0)
    )
    sync_rows, sync_weights, _, _, _ = sync_run
    for key in ("loss", "reward/mean", "grad_norm", "response_length/mean", "train_rollout_logprob_abs_diff"):
        assert [r[key] for r in rows] == [r[key] for r in sync_rows], key
    assert all(torch.equal(weights[k], sync_weights[k]) for k in weights)
    assert trained == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(r["staleness/max"] == 0 for r in rows)


def test_one_step_off_trains_step_k_on_weights_k_minus_1(tiny_llama_dir):
    rows, _, trained, seen, _ = _run(tiny_llama_dir, LoopConfig(mode="one_step_off", num_steps=3, save_interval=0))
    versions = {g: {v for sample in vs for v in sample} for g, vs in seen}
    # Step 0 on v0; step 1's prompts (4..7) generated on v0 while step 0 trained; step 2's on v1; step 3's (the
    # producer runs one step ahead of the last) on v2.
    assert [versions[g] for g in range(16)] == [{0}] * 8 + [{1}] * 4 + [{2}] * 4
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["staleness/mean"] for r in rows] == [0.0, 1.0, 1.0]
    assert trained == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_fully_async_keeps_the_bound_and_trains_every_prompt_once(tiny_llama_dir):
    rows, _, trained, seen, _ = _run(
        tiny_llama_dir, LoopConfig(mode="fully_async", max_weight_staleness=2, num_steps=4, save_interval=0)
    )
    flat = [g for step in trained for g in step]
    assert len(flat) == 16 and len(set(flat)) == 16  # no prompt trained twice
    assert all(r["staleness/max"] <= 2 for r in rows)
    assert [r["weight_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert all(len(vs) == 1 for _, group in seen for vs in group)  # abort + resubmit: one version per sample
    assert all(r["samples/multi_version"] == 0.0 for r in rows)  # nothing is continued in abort mode
    assert all("buffer/groups" in r and 0.0 <= r["engine/idle_fraction"] <= 1.0 for r in rows)


def test_partial_rollouts_keep_the_bound_and_masks_aligned(tiny_llama_dir):
    loop = LoopConfig(
        mode="fully_async", max_weight_staleness=1, partial_rollout=True, mask_stale_segments=True, num_steps=3,
        save_interval=0,
    )  # fmt: skip
    rows, _, trained, seen, _ = _run(tiny_llama_dir, loop)
    assert all(r["staleness/max"] <= 1 for r in rows)
    flat = [g for step in trained for g in step]
    assert len(flat) == len(set(flat)) == 12


def test_an_update_that_cuts_into_generation_resubmits_it_from_scratch_on_the_new_weights(tiny_llama_dir):
    loop = LoopConfig(mode="fully_async", max_weight_staleness=1, num_steps=2, save_interval=0)
    rows, _, trained, _, samples = _run(tiny_llama_dir, loop, cut_by_update=True)
    step_two = [s for s in samples if 4 <= s.group_index < 8]
    assert trained == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(step_two) == 16
    # The pause aborted step 2's requests (the running ones with 1 token of v0, the queued ones with none); each was
    # requested again from the start, and every token of every trained sample comes from v1.
    # Exactly once each: a resubmission that reaches the engine while the pause still waits for the running batch
    # is held until the resume, not aborted with the queue a second time (it was, before: 1 or 2 resubmits).
    resubmits = [s.metadata.get("resubmits", 0) for s in step_two]
    assert resubmits == [1] * 16 and rows[1]["samples/resubmits"] == 16
    assert rows[1]["samples/aborted"] == 0
    assert all(s.weight_versions == [1] and s.token_versions == [1] * s.response_length for s in step_two)
    assert rows[1]["staleness/max"] == 0.0 and rows[1]["samples/multi_version"] == 0.0


def test_an_update_that_cuts_into_generation_continues_it_on_the_new_weights_with_partial_rollouts(tiny_llama_dir):
    loop = LoopConfig(mode="fully_async", max_weight_staleness=1, partial_rollout=True, num_steps=2, save_interval=0)
    rows, _, trained, _, samples = _run(tiny_llama_dir, loop, cut_by_update=True)
    step_two = [s for s in samples if 4 <= s.group_index < 8]
    assert trained == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(step_two) == 16
    # Retracted mid-generation: the rows that held tokens of v0 kept them and went on under v1.
    continued = [s for s in step_two if s.weight_versions == [0, 1]]
    assert continued and rows[1]["samples/multi_version"] == len(continued)
    for s in continued:
        k = s.token_versions.count(0)
        assert k >= 1 and s.token_versions == [0] * k + [1] * (s.response_length - k)
    assert rows[1]["staleness/max"] == 1.0 and rows[1]["samples/resubmits"] == 0.0


def test_async_settings_outside_fully_async_are_one_clear_error():
    with pytest.raises(ValueError, match="loop.max_weight_staleness is 2 but loop.mode is 'sync'.*fully_async"):
        LoopConfig(max_weight_staleness=2)
    with pytest.raises(ValueError, match="loop.partial_rollout is True but loop.mode is 'one_step_off'"):
        LoopConfig(mode="one_step_off", partial_rollout=True)
    assert LoopConfig(mode="fully_async").staleness_bound == 1
    assert LoopConfig(mode="fully_async", partial_rollout=True).pause_mode == "retract"
    assert LoopConfig().pause_mode is None
    with pytest.raises(ValueError, match="loop.mask_stale_segments is True but loop.partial_rollout is False"):
        LoopConfig(mode="fully_async", mask_stale_segments=True)


def test_the_producer_thread_ends_with_the_run(tiny_llama_dir, sync_run):
    before = {t.name for t in threading.enumerate()}
    _run(tiny_llama_dir, LoopConfig(mode="one_step_off", num_steps=1, save_interval=0))
    assert "rollout-producer" not in {t.name for t in threading.enumerate()} - before
