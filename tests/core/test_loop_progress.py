"""Evaluation progress: ``Components.progress`` opens a bar over the eval samples, the producer fills it as groups
finish, and nothing sampled changes."""

import asyncio

import pytest
from miles.core.config import EvalConfig, SamplingConfig
from miles.core.loop import Components, evaluate
from miles.core.sample import Sample, SampleStatus


class RecordingBar:
    def __init__(self, total):
        self.total, self.updates, self.closed = total, [], False

    def update(self, n):
        self.updates.append(n)

    def close(self):
        self.closed = True


class RecordingProgress:
    """A ``Components.progress`` factory that keeps the bars it opened."""

    def __init__(self):
        self.bars = []

    def __call__(self, total):
        self.bars.append(RecordingBar(total))
        return self.bars[-1]


def eval_prompts(num):
    return [Sample(index=i, group_index=i, prompt=[1, 3 + i % 8]) for i in range(num)]


def _components(generate_group, progress=None):
    return Components(
        data_source=None,
        generate_group=generate_group,
        reward_fn=lambda s: float(s.response_tokens[0] % 2),
        backend=None,
        publisher=None,
        sink=None,
        eval_prompts=eval_prompts(6),
        progress=progress,
    )


class GroupsInOrder:
    """Answers each prompt with n samples [4, 2]; prompt p's group completes after prompt p - 1's (so the bar's
    updates come in prompt order); raises on prompt ``fail_at``."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    async def __call__(self, prompt, *, n, sampling, seeds):
        for _ in range(prompt.group_index):
            await asyncio.sleep(0)
        if prompt.group_index == self.fail_at:
            raise RuntimeError("engine died")
        return [
            Sample(index=j, group_index=prompt.group_index, prompt=prompt.prompt, tokens=[*prompt.prompt, 4, 2],
                   response_length=2, status=SampleStatus.COMPLETED)
            for j in range(n)
        ]  # fmt: skip


def test_eval_progress_totals_prompts_times_samples_and_counts_each_finished_group():
    progress = RecordingProgress()
    metrics = evaluate(_components(GroupsInOrder(), progress), EvalConfig(num_prompts=3, n_samples_per_prompt=4))
    (bar,) = progress.bars
    assert bar.total == 12  # 3 of the 6 eval prompts x 4 samples
    assert bar.updates == [4, 4, 4] and bar.closed  # one update per group, its size
    assert metrics["eval/reward"] == 0.0  # first response token 4: 4 % 2 = 0


def test_the_eval_bar_is_closed_when_the_rollout_fails():
    progress = RecordingProgress()
    c = _components(GroupsInOrder(fail_at=2), progress)
    with pytest.raises(RuntimeError, match="engine died"):
        evaluate(c, EvalConfig(num_prompts=3, n_samples_per_prompt=4))
    assert progress.bars[0].updates == [4, 4] and progress.bars[0].closed  # the groups before the failure


def test_eval_progress_through_the_real_engine_counts_every_sample_and_changes_no_reward(tiny_llama_dir):
    from miles.rollout.engines import EmbeddedEngine
    from miles.rollout.generate import ChatRollout

    rollout = ChatRollout(EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2]), tokenizer=None)
    evaluation = EvalConfig(num_prompts=6, n_samples_per_prompt=4, sampling=SamplingConfig(max_new_tokens=16))
    progress = RecordingProgress()
    with_bar = evaluate(_components(rollout, progress), evaluation)
    without = evaluate(_components(rollout), evaluation)
    (bar,) = progress.bars
    assert bar.total == 24 and sum(bar.updates) == 24 and bar.closed
    assert bar.updates == [4] * 6  # one update per group as it completed, not one at the end
    for key in ("eval/reward", "eval/response_length", "eval/failed"):
        assert with_bar[key] == without[key]
