"""Evaluation progress: ``Components.progress`` opens a bar over the eval samples, the rollout function fills it as
samples finish, and nothing sampled changes."""

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


def _components(rollout_fn, progress=None):
    return Components(
        data_source=None,
        rollout_fn=rollout_fn,
        reward_fn=lambda s: float(s.response_tokens[0] % 2),
        backend=None,
        publisher=None,
        sink=None,
        eval_prompts=eval_prompts(6),
        progress=progress,
    )


class OneByOneRollout:
    """Answers each prompt with n samples [4, 2], reporting each sample as it is made; may raise midway."""

    def __init__(self, fail_after=None):
        self.fail_after = fail_after

    def __call__(self, prompts, *, n_samples_per_prompt, sampling, seed, on_finished=None):
        samples = []
        for prompt in prompts:
            for _ in range(n_samples_per_prompt):
                if len(samples) == self.fail_after:
                    raise RuntimeError("engine died")
                samples.append(
                    Sample(
                        index=len(samples),
                        group_index=prompt.group_index,
                        prompt=prompt.prompt,
                        tokens=[*prompt.prompt, 4, 2],
                        response_length=2,
                        status=SampleStatus.COMPLETED,
                    )
                )
                if on_finished is not None:
                    on_finished(1)
        return samples


def test_eval_progress_totals_prompts_times_samples_and_counts_each_finished_sample():
    progress = RecordingProgress()
    evaluate(_components(OneByOneRollout(), progress), EvalConfig(num_prompts=3, n_samples_per_prompt=4))
    (bar,) = progress.bars
    assert bar.total == 12  # 3 of the 6 eval prompts x 4 samples
    assert bar.updates == [1] * 12 and bar.closed


def test_the_eval_bar_is_closed_when_the_rollout_fails():
    progress = RecordingProgress()
    c = _components(OneByOneRollout(fail_after=5), progress)
    with pytest.raises(RuntimeError, match="engine died"):
        evaluate(c, EvalConfig(num_prompts=3, n_samples_per_prompt=4))
    assert progress.bars[0].updates == [1] * 5 and progress.bars[0].closed


def test_without_progress_a_rollout_function_that_takes_no_callback_still_works():
    def plain_rollout(prompts, *, n_samples_per_prompt, sampling, seed):
        return OneByOneRollout()(prompts, n_samples_per_prompt=n_samples_per_prompt, sampling=sampling, seed=seed)

    metrics = evaluate(_components(plain_rollout), EvalConfig(num_prompts=2, n_samples_per_prompt=2))
    assert metrics["eval/reward"] == 0.0  # first response token 4: 4 % 2 = 0


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
    assert len(bar.updates) > 1  # samples were counted while decoding, not all at the end
    for key in ("eval/reward", "eval/response_length", "eval/failed"):
        assert with_bar[key] == without[key]
