"""Group-generate factories for tests/rollout/test_generate_factory.py (imported by their module:attr paths)."""

from miles.core.sample import Sample, SampleStatus


def build_echo(context):
    """A factory whose function answers every prompt with its n samples of response [7], trained."""

    async def echo(prompt, *, n, sampling, seeds):
        return [
            Sample(index=j, group_index=prompt.group_index, prompt=prompt.prompt, tokens=[1, 7], response_length=1,
                   rollout_log_probs=[-0.5], status=SampleStatus.COMPLETED, metadata={"seed": seed})
            for j, seed in enumerate(seeds)
        ]  # fmt: skip

    return echo


def build_sync(context):
    return lambda prompt, *, n, sampling, seeds: []


def build_without_seeds(context):
    async def generate(prompt, *, n, sampling):
        return []

    return generate


def two_arguments(context, other):
    return None
