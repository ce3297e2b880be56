"""The loop's algorithm stages (dynamic sampling, failed rewards, overlong filtering and shaping, plugins, eval
sampling) with scripted rollouts and a recording backend; the eval test drives the tiny model's real engine."""

import logging
import sys
import textwrap

import pytest
from doubles import CountingPublisher, FakeBackend, NullSink
from miles.core.algorithms.config import load_algorithm_plugins
from miles.core.config import (
    AdvantageConfig,
    AlgorithmConfig,
    DynamicSamplingConfig,
    EvalConfig,
    LoopConfig,
    LossConfig,
    OverlongConfig,
    RolloutConfig,
    SamplingConfig,
)
from miles.core.loop import (
    AllSamplesAborted,
    AllSamplesFailed,
    Components,
    DynamicSamplingExhausted,
    evaluate,
    run_step,
    train,
)
from miles.core.sample import Sample, SampleStatus


class Prompts:
    def __init__(self):
        self.count = 0

    def next_prompts(self, num):
        prompts = [Sample(index=i, group_index=self.count + i, prompt=[1, 3]) for i in range(num)]
        self.count += num
        return prompts

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class ScriptedRollout:
    """A group-generate function: each prompt gets the next scripted group, (response tokens, finish status[, loss
    mask]) per sample, in prompt order (the producer starts the prompts' calls in order). ``calls`` records the
    group index of every call."""

    def __init__(self, groups):
        self.groups = iter(groups)
        self.calls = []

    async def __call__(self, prompt, *, n, sampling, seeds):
        self.calls.append(prompt.group_index)
        return [
            Sample(
                index=j,
                group_index=prompt.group_index,
                prompt=prompt.prompt,
                tokens=[1, 3, *response],
                response_length=len(response),
                loss_mask=loss_mask[0] if loss_mask else None,
                rollout_log_probs=[-1.0] * len(response),
                status=status,
            )
            for j, (response, status, *loss_mask) in enumerate(next(self.groups))
        ]


def _components(generate_group, reward_fn):
    return Components(
        data_source=Prompts(),
        generate_group=generate_group,
        reward_fn=reward_fn,
        backend=FakeBackend(),
        publisher=CountingPublisher(),
        sink=NullSink(),
    )


def reward_is_first_token(sample):
    return float(sample.response_tokens[0])


DONE = SampleStatus.COMPLETED


def test_dynamic_sampling_without_any_signal_stops_after_exactly_the_round_bound(caplog):
    equal_groups = [[([0], DONE), ([0], DONE)], [([1], DONE), ([1], DONE)]] * 10
    scripted = ScriptedRollout(equal_groups)
    algorithm = AlgorithmConfig(dynamic_sampling=DynamicSamplingConfig(max_rounds=3))
    rollout = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2)
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(
            DynamicSamplingExhausted, match=r"^step 1: .*kept 0 of .*max_rounds=3 generation rounds \(6 groups filtered"
        ),
    ):
        run_step(_components(scripted, reward_is_first_token), step=0, rollout=rollout, algorithm=algorithm)
    assert scripted.calls == [0, 1, 2, 3, 4, 5]  # 3 rounds of 2 new prompts
    assert "step 1: dynamic sampling kept 0 groups, filtered 6" in caplog.text  # numbered as the bar numbers it


def test_dynamic_sampling_keeps_groups_with_signal_and_over_samples_the_missing_ones():
    flat, mixed = [([1], DONE), ([1], DONE)], [([0], DONE), ([1], DONE)]
    # Round 1: [flat, mixed] keeps 1 group; round 2 asks ceil(1 * 2.0) = 2 prompts: [flat, mixed] fills the batch.
    scripted = ScriptedRollout([flat, mixed, flat, mixed])
    c = _components(scripted, reward_is_first_token)
    algorithm = AlgorithmConfig(dynamic_sampling=DynamicSamplingConfig(over_sample=2.0))
    metrics = run_step(
        c, step=0, rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2), algorithm=algorithm
    )
    assert scripted.calls == [0, 1, 2, 3]  # 2 rounds of 2 new prompts
    assert metrics["dynamic_sampling/rounds"] == 2 and metrics["dynamic_sampling/filtered_groups"] == 2
    (batch,) = c.backend.batches
    assert batch.advantages[:, 0].tolist() == pytest.approx([-0.70711, 0.70711, -0.70711, 0.70711], abs=1e-5)


@pytest.mark.parametrize("bad_token", [pytest.param(7, id="reward_raises"), pytest.param(8, id="reward_is_none")])
def test_a_failing_reward_in_one_group_leaves_the_other_group_and_the_rest_of_its_own_trained(bad_token, caplog):
    # Group 1: rewards [x, 1, 0] where x raises (or is None); group 2: [0, 1, 0, 1].
    def reward(sample):
        if sample.response_tokens[0] == 7:
            raise KeyError("no answer")
        if sample.response_tokens[0] == 8:
            return None
        return float(sample.response_tokens[0])

    group1 = [([bad_token], DONE), ([1], DONE), ([0], DONE)]
    group2 = [([0], DONE), ([1], DONE), ([0], DONE), ([1], DONE)]
    c = _components(ScriptedRollout([group1, group2]), reward)
    with caplog.at_level(logging.WARNING, logger="miles.core.loop"):
        metrics = run_step(
            c,
            step=0,
            rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=3),
            algorithm=AlgorithmConfig(advantage=AdvantageConfig(eps=1e-12)),
        )
    # the reason is logged, not only counted
    (line,) = [r.getMessage() for r in caplog.records if "samples failed" in r.getMessage()]
    reason = (
        "reward function raised KeyError: 'no answer'"
        if bad_token == 7
        else "reward function returned NoneType None, expected a finite float"
    )
    assert line == f"step 1: 1 of 7 samples failed (not trained); first reasons: {reason}"
    (batch,) = c.backend.batches
    advantages = batch.advantages[:, 0].tolist()
    # Group 1 over the two valid samples [1, 0]: +-0.7071; the failed sample gets 0 and no loss mask.
    assert advantages[:3] == pytest.approx([0.0, 0.70711, -0.70711], abs=1e-5)
    assert advantages[3:] == pytest.approx([-0.86603, 0.86603, -0.86603, 0.86603], abs=1e-5)
    assert batch.loss_mask[:, 0].tolist() == [False, True, True, True, True, True, True]
    assert metrics["samples/failed"] == 1.0
    assert metrics["samples/failed_reward_error"] == 1.0 and metrics["samples/failed_reward_timeout"] == 0.0


def test_overlong_filter_masks_length_truncated_samples_by_finish_reason():
    # eos 2, end-of-turn 9: [5, 6, 7, 9] stopped; [5, 6, 7, 8] hit the length limit.
    group = [([5, 6, 7, 9], DONE), ([5, 6, 7, 8], SampleStatus.TRUNCATED)]
    c = _components(ScriptedRollout([group]), lambda s: float(s.response_tokens[-1] == 9))
    rollout = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, sampling=SamplingConfig(max_new_tokens=4))
    run_step(c, step=0, rollout=rollout, algorithm=AlgorithmConfig(overlong=OverlongConfig(filter=True)))
    (batch,) = c.backend.batches
    assert batch.loss_mask.int().tolist() == [[1, 1, 1, 1], [0, 0, 0, 0]]
    # The truncated sample still counts in the group statistics: rewards [1, 0] -> +0.7071 on the kept one.
    assert batch.advantages[0, 0].item() == pytest.approx(0.70711, abs=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_sample_without_trainable_tokens_leaves_its_group_statistics(estimator):
    # Rewards = first token: [1 (only tool tokens, loss mask [0, 0]), 1, 0]. Over the two trainable samples [1, 0]:
    # grpo (1 - 0.5) / std 0.7071 = +-0.70711; rloo 1 - 0 = +-1. Counting the tool-only sample, [1, 1, 0] would
    # give grpo (1 - 2/3) / 0.57735 = 0.57735 and -1.1547, rloo 1 - 0.5 = 0.5 and 0 - 1 = -1.
    group = [([1, 5], DONE, [0, 0]), ([1, 6], DONE), ([0, 6], DONE)]
    c = _components(ScriptedRollout([group]), reward_is_first_token)
    rollout = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=3)
    eps = {"eps": 1e-12} if estimator == "grpo" else {}  # rloo divides by no std: it reads no eps
    algorithm = AlgorithmConfig(advantage=AdvantageConfig(estimator=estimator, **eps))
    metrics = run_step(c, step=0, rollout=rollout, algorithm=algorithm)
    (batch,) = c.backend.batches
    expected = {"grpo": [0.0, 0.70711, -0.70711], "rloo": [0.0, 1.0, -1.0]}[estimator]
    assert batch.advantages[:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert batch.loss_mask.int().tolist() == [[0, 0], [1, 1], [1, 1]]
    assert metrics["reward/mean"] == pytest.approx(2 / 3)  # it was scored: it counts in the reward metrics


def test_an_overlong_filtered_sample_stays_in_its_group_statistics_but_a_tool_only_one_does_not():
    # DAPO: truncated samples count in the group statistics, untrained. Rewards = last token == 9:
    # [0 (truncated, filtered), 1 (only tool tokens), 1, 0]. The statistics cover [0, 1, 0] (truncated kept,
    # tool-only left out): mean 1/3, sample std sqrt((1/9 + 4/9 + 1/9) / 2) = 0.57735, so the trained ones get
    # (1 - 1/3) / 0.57735 = 1.1547 and (0 - 1/3) / 0.57735 = -0.57735.
    group = [
        ([5, 6, 7, 8], SampleStatus.TRUNCATED),
        ([5, 6, 9], DONE, [0, 0, 0]),
        ([5, 6, 9], DONE),
        ([5, 6, 7], DONE),
    ]
    c = _components(ScriptedRollout([group]), lambda s: float(s.response_tokens[-1] == 9))
    rollout = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=4, sampling=SamplingConfig(max_new_tokens=4))
    run_step(
        c,
        step=0,
        rollout=rollout,
        algorithm=AlgorithmConfig(overlong=OverlongConfig(filter=True), advantage=AdvantageConfig(eps=1e-12)),
    )
    (batch,) = c.backend.batches
    assert batch.loss_mask.int().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
    assert batch.advantages[:, 0].tolist() == pytest.approx([0.0, 0.0, 1.1547, -0.57735], abs=1e-4)


def test_train_refuses_a_group_baseline_with_one_sample_per_prompt_before_generating():
    scripted = ScriptedRollout([])
    c = _components(scripted, reward_is_first_token)
    with pytest.raises(ValueError, match=r"rollout.n_samples_per_prompt is 1, but advantage 'rloo' needs at least 2"):
        train(
            c,
            loop=LoopConfig(num_steps=1),
            rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=1),
            algorithm=AlgorithmConfig(advantage=AdvantageConfig(estimator="rloo")),
            evaluation=EvalConfig(num_prompts=0),
        )
    assert scripted.calls == []  # refused once, at the start: nothing was generated


def test_train_runs_one_sample_per_prompt_with_an_estimator_that_needs_no_group():
    c = _components(ScriptedRollout([[([1], DONE)], [([0], DONE)]]), reward_is_first_token)
    steps = train(
        c,
        loop=LoopConfig(num_steps=1, save_interval=0),
        rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=1),
        algorithm=AlgorithmConfig(advantage=AdvantageConfig(estimator="reinforce_plus_plus", eps=1e-12)),
        evaluation=EvalConfig(num_prompts=0),
    )
    # Whitened over the batch: rewards [1, 0], mean 0.5, population std 0.5 -> [+1, -1].
    assert steps == 1 and c.backend.batches[0].advantages[:, 0].tolist() == pytest.approx([1.0, -1.0], abs=1e-6)


def test_overlong_shaping_and_a_reward_post_process_plugin_change_the_advantages(tmp_path, monkeypatch):
    (tmp_path / "my_shaping.py").write_text(
        textwrap.dedent(
            """
            def double(samples, rewards):
                return rewards * 2
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_shaping", None)
    # Both score 1; lengths 2 and 4 with max 4, buffer 2: penalties 0 and -1 -> rewards [1, 0] -> doubled [2, 0].
    group = [([1, 2], DONE), ([1, 2, 3, 4], SampleStatus.TRUNCATED)]
    c = _components(ScriptedRollout([group]), lambda s: 1.0)
    rollout = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, sampling=SamplingConfig(max_new_tokens=4))
    algorithm = AlgorithmConfig(
        advantage=AdvantageConfig(estimator="dr_grpo"),
        overlong=OverlongConfig(buffer_len=2),
        reward_post_process_path="my_shaping:double",
    )
    run_step(c, step=0, rollout=rollout, algorithm=algorithm)
    (batch,) = c.backend.batches
    assert batch.advantages[:, 0].tolist() == [1.0, -1.0]


def test_a_custom_advantage_estimator_plugin_is_used(tmp_path, monkeypatch):
    (tmp_path / "my_estimator.py").write_text(
        textwrap.dedent(
            """
            import torch

            def constant(inputs, params):
                return torch.full(inputs.loss_mask.shape, 0.5), None
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    c = _components(ScriptedRollout([[([1], DONE), ([1], DONE)]]), lambda s: 1.0)
    algorithm = AlgorithmConfig(advantage=AdvantageConfig(estimator_path="my_estimator:constant"))
    run_step(c, step=0, rollout=RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2), algorithm=algorithm)
    assert c.backend.batches[0].advantages.tolist() == [[0.5], [0.5]]


def test_a_plugin_path_with_the_wrong_signature_fails_when_the_run_is_built_not_when_validated():
    algorithm = AlgorithmConfig(loss=LossConfig(policy_loss_path="miles.core.algorithms.losses:sft_loss"))  # pure
    with pytest.raises(TypeError, match="algorithm.loss.policy_loss_path.*5 positional"):
        load_algorithm_plugins(algorithm)
    c = _components(ScriptedRollout([]), reward_is_first_token)
    with pytest.raises(TypeError, match="algorithm.loss.policy_loss_path.*5 positional"):  # and before any rollout
        train(
            c,
            loop=LoopConfig(num_steps=1),
            rollout=RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2),
            algorithm=algorithm,
            evaluation=EvalConfig(num_prompts=0),
        )


class RecordingEngine:
    """Wraps a real engine and records the sampling settings of every request."""

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    async def generate(self, request):
        self.requests.append(request)
        return await self.engine.generate(request)


def test_eval_uses_its_own_sampling_settings_and_training_keeps_its_own(tiny_llama_dir):
    from miles.rollout.engines import EmbeddedEngine
    from miles.rollout.generate import ChatRollout

    engine = RecordingEngine(EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2]))
    c = _components(ChatRollout(engine, tokenizer=None), lambda s: float(s.response_tokens[0] % 2))
    c.eval_prompts = Prompts().next_prompts(5)
    train_sampling = SamplingConfig(temperature=1.0, max_new_tokens=2)
    eval_sampling = SamplingConfig(temperature=0.6, top_p=0.95, max_new_tokens=2)
    evaluate(c, EvalConfig(num_prompts=5, n_samples_per_prompt=4, sampling=eval_sampling))
    assert len(engine.requests) == 20
    assert {(r.sampling.temperature, r.sampling.top_p) for r in engine.requests} == {(0.6, 0.95)}
    engine.requests.clear()
    rollout = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=8, sampling=train_sampling)
    run_step(
        c,
        step=0,
        rollout=rollout,
        algorithm=AlgorithmConfig(advantage=AdvantageConfig(estimator="reinforce_plus_plus")),
    )
    assert len(engine.requests) == 8
    assert {(r.sampling.temperature, r.sampling.top_p) for r in engine.requests} == {(1.0, 1.0)}


def test_a_step_whose_samples_were_all_cut_off_by_weight_updates_is_not_reported_as_failed():
    # Every sample ABORTED (pause "abort" during a weight update, resubmissions spent): it said "all 4 samples
    # failed" and the CLI advised fixing the reward function.
    aborted = [([5], SampleStatus.ABORTED), ([5], SampleStatus.ABORTED)]
    rollout = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_resubmits=3)
    components = _components(ScriptedRollout([aborted, aborted]), reward_is_first_token)
    with pytest.raises(AllSamplesAborted) as err:
        run_step(components, step=0, rollout=rollout, algorithm=AlgorithmConfig())
    assert not isinstance(err.value, AllSamplesFailed) and (err.value.step, err.value.num_samples) == (1, 4)
    assert str(err.value).startswith(
        "step 1: all 4 samples were cut off by weight updates and were still unfinished after "
        "rollout.max_resubmits=3 resubmissions each, so there is nothing to train; raise --rollout.max-resubmits"
    )
    # One failed sample among the aborted ones: a failure after all, reported as one.
    mixed = [([5], SampleStatus.ABORTED), ([5], SampleStatus.FAILED)]
    components = _components(ScriptedRollout([mixed, mixed]), reward_is_first_token)
    with pytest.raises(AllSamplesFailed, match="step 1: all 4 samples failed"):
        run_step(components, step=0, rollout=rollout, algorithm=AlgorithmConfig())
