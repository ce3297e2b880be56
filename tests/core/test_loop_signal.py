"""The loop says when a step cannot learn: groups/no_signal_ratio per step, and one warning per run when every
group's rewards are equal (every advantage 0)."""

import logging

import pytest
import torch
from doubles import CountingPublisher, FakeBackend, ListSink
from miles.core import logs
from miles.core.config import AlgorithmConfig, EvalConfig, LoopConfig, RolloutConfig
from miles.core.loop import (
    ALL_WRONG_WARNING,
    NO_SIGNAL_WARNING,
    SOLVED_WARNING,
    Components,
    no_signal_ratio,
    no_signal_warning,
    train,
)
from miles.core.sample import Sample, SampleStatus

DONE, FAILED = SampleStatus.COMPLETED, SampleStatus.FAILED


@pytest.fixture(autouse=True)
def fresh_warn_once(monkeypatch):
    """Each test is its own run: forget what earlier tests in this process were warned about."""
    monkeypatch.setattr(logs, "_warned", set())


@pytest.mark.parametrize(
    "rewards, group_index, valid, expected",
    [
        pytest.param([1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1], 1.0, id="both_groups_flat"),
        pytest.param([1, 0, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1], 0.5, id="one_of_two_flat"),
        pytest.param([1, 0, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1], 0.0, id="both_with_signal"),
        # Group 0: [1, 0] but the 0 failed, so its valid rewards are [1]: flat. Group 1 [0, 1] has signal.
        pytest.param([1, 0, 0, 1], [0, 0, 1, 1], [1, 0, 1, 1], 0.5, id="failed_sample_left_out"),
        # Three groups of three: [0.5, 0.5, 0.5] flat; [0.5, 0.5, 1] signal; [1, 1, 1] flat -> 2/3.
        pytest.param([0.5, 0.5, 0.5, 0.5, 0.5, 1, 1, 1, 1], [4, 4, 4, 7, 7, 7, 9, 9, 9], [1] * 9, 2 / 3,
                     id="two_of_three_flat"),
        pytest.param([1, 0], [3, 3], [0, 0], 1.0, id="all_failed_group_has_no_signal"),
    ],
)  # fmt: skip
def test_no_signal_ratio_counts_groups_whose_valid_rewards_are_all_equal(rewards, group_index, valid, expected):
    ratio = no_signal_ratio(
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(group_index, dtype=torch.int64),
        torch.tensor(valid, dtype=torch.bool),
    )
    assert ratio == pytest.approx(expected, abs=1e-12)


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
    """A group-generate function: each prompt gets the next scripted group (prompts start in order), a list of
    (first response token, status); the reward is the token."""

    def __init__(self, groups):
        self.groups = iter(groups)

    async def __call__(self, prompt, *, n, sampling, seeds):
        return [
            Sample(
                index=j,
                group_index=prompt.group_index,
                prompt=prompt.prompt,
                tokens=[1, 3, token],
                response_length=1,
                rollout_log_probs=[-1.0],
                status=status,
            )
            for j, (token, status) in enumerate(next(self.groups))
        ]


def test_a_run_whose_steps_have_no_reward_variance_warns_once_and_logs_the_ratio_every_step(caplog):
    flat0, flat1, mixed = [(0, DONE), (0, DONE)], [(1, DONE), (1, DONE)], [(0, DONE), (1, DONE)]
    with_failure = [(1, DONE), (0, FAILED)]  # the failed 0 is left out: [1] alone is flat
    steps = [
        [flat0, flat1],  # 2/2 flat -> warns
        [mixed, flat0],  # 1/2
        [flat0, with_failure],  # 2/2 flat again -> already warned
        [mixed, mixed],  # 0/2
    ]
    sink = ListSink()
    components = Components(
        data_source=Prompts(),
        generate_group=ScriptedRollout([group for step in steps for group in step]),
        reward_fn=lambda s: float(s.response_tokens[0]),
        backend=FakeBackend(),
        publisher=CountingPublisher(),
        sink=sink,
    )
    with caplog.at_level(logging.WARNING, logger="miles.core.loop"):
        train(
            components,
            loop=LoopConfig(num_steps=4),
            rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2),
            algorithm=AlgorithmConfig(),
            evaluation=EvalConfig(num_prompts=0),
        )
    assert [row["groups/no_signal_ratio"] for row in sink.rows] == [1.0, 0.5, 1.0, 0.0]
    warnings = [r for r in caplog.records if "zero reward variance" in r.getMessage()]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert message.startswith("step 1: all 2 groups have zero reward variance")  # metrics.jsonl step 1
    assert "mean reward 0.5" in message  # rewards [0, 0, 1, 1]
    for fix in ("--rollout.n-samples-per-prompt", "--rollout.sampling.max-new-tokens", "miles config show",
                "--algorithm.dynamic-sampling.max-rounds 3", "larger model"):  # fmt: skip
        assert fix in message


def test_supervised_fine_tuning_does_not_warn_about_reward_variance(caplog):
    """SFT trains the reference answers (one per prompt): its groups never have reward variance, and need none."""
    from miles.core.config import LossConfig

    sink = ListSink()
    components = Components(
        data_source=Prompts(),
        generate_group=ScriptedRollout([[(0, DONE)], [(1, DONE)]] * 2),
        reward_fn=lambda s: float(s.response_tokens[0]),
        backend=FakeBackend(),
        publisher=CountingPublisher(),
        sink=sink,
    )
    with caplog.at_level(logging.WARNING, logger="miles.core.loop"):
        train(
            components,
            loop=LoopConfig(num_steps=2),
            rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=1),
            algorithm=AlgorithmConfig(loss=LossConfig(policy_loss="sft")),
            evaluation=EvalConfig(num_prompts=0),
        )
    assert [row["groups/no_signal_ratio"] for row in sink.rows] == [1.0, 1.0]  # still logged
    assert not [r.getMessage() for r in caplog.records if r.name == "miles.core.loop"]


def test_a_step_with_signal_in_some_group_does_not_warn(caplog):
    sink = ListSink()
    components = Components(
        data_source=Prompts(),
        generate_group=ScriptedRollout([[(0, DONE), (0, DONE)], [(0, DONE), (1, DONE)]]),
        reward_fn=lambda s: float(s.response_tokens[0]),
        backend=FakeBackend(),
        publisher=CountingPublisher(),
        sink=sink,
    )
    with caplog.at_level(logging.WARNING, logger="miles.core.loop"):
        train(
            components,
            loop=LoopConfig(num_steps=1),
            rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2),
            algorithm=AlgorithmConfig(),
            evaluation=EvalConfig(num_prompts=0),
        )
    assert sink.rows[0]["groups/no_signal_ratio"] == 0.5
    assert not caplog.records


MORE_SAMPLES = " more samples per prompt (--rollout.n-samples-per-prompt 8; now {n});"


@pytest.mark.parametrize(
    "rewards, n, template, more_samples",
    [
        pytest.param([1.0] * 8, 8, SOLVED_WARNING, False, id="all_right_is_solved"),
        pytest.param([1.0, 1.0], 2, SOLVED_WARNING, False, id="all_right_with_2_samples_is_solved_too"),
        pytest.param([0.0] * 8, 8, ALL_WRONG_WARNING, False, id="all_wrong_with_8_samples"),
        pytest.param([0.0] * 4, 4, ALL_WRONG_WARNING, True, id="all_wrong_with_4_samples_advises_8"),
        pytest.param([-1.0, 0.0], 2, ALL_WRONG_WARNING, True, id="negative_rewards_are_wrong"),
        pytest.param([0.0, 0.0, 1.0, 1.0], 2, NO_SIGNAL_WARNING, True, id="uniform_groups_that_differ"),
        pytest.param([0.5] * 8, 8, NO_SIGNAL_WARNING, False, id="partial_reward_everywhere"),
        pytest.param([], 8, NO_SIGNAL_WARNING, False, id="no_valid_sample"),
    ],
)  # fmt: skip
def test_the_no_signal_warning_tells_solved_from_all_wrong_and_advises_more_samples_only_below_8(
    rewards, n, template, more_samples
):
    warning = no_signal_warning(torch.tensor(rewards, dtype=torch.float32), n_samples_per_prompt=n)
    assert warning == template.format(more_samples=MORE_SAMPLES.format(n=n) if more_samples else "")
    text = warning % (3, 2, 1.0)  # the loop fills in step, groups, mean reward
    assert text.startswith("step 3: all 2 groups have zero reward variance (groups/no_signal_ratio 1.0; mean reward 1)")
    assert ("easier task" in text) == (template is not SOLVED_WARNING)
    assert ("harder task" in text) == (template is SOLVED_WARNING)
    assert ("--rollout.n-samples-per-prompt" in text) == more_samples


class TeacherBackend(FakeBackend):
    """Gives teacher log-probs too: -1 at every token, the old log-probs being 0, so OPD advantages of -1."""

    def __init__(self):
        super().__init__()
        self.available_outputs = frozenset({"old_log_probs", "teacher_log_probs"})

    def forward(self, batch, *, outputs):
        batch = super().forward(batch, outputs=outputs)
        return batch.replace(teacher_log_probs=torch.full(batch.loss_mask.shape, -1.0))


def test_on_policy_distillation_is_not_warned_about_equal_rewards(caplog):
    """Its advantages are teacher minus student log-probs: equal rewards take nothing from them."""
    sink = ListSink()
    backend = TeacherBackend()
    components = Components(
        data_source=Prompts(),
        generate_group=ScriptedRollout([[(0, DONE), (0, DONE)], [(0, DONE), (0, DONE)]]),
        reward_fn=lambda s: float(s.response_tokens[0]),
        backend=backend,
        publisher=CountingPublisher(),
        sink=sink,
    )
    with caplog.at_level(logging.WARNING, logger="miles.core.loop"):
        train(
            components,
            loop=LoopConfig(num_steps=1),
            rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2),
            algorithm=AlgorithmConfig(advantage={"estimator": "opd"}),
            evaluation=EvalConfig(num_prompts=0),
        )
    assert sink.rows[0]["groups/no_signal_ratio"] == 1.0
    assert backend.batches[0].advantages[backend.batches[0].loss_mask].tolist() == [-1.0] * 4
    assert not caplog.records
