"""The bounded buffer of groups, the producer that fills it, per-sample seeds, and its synchronous form."""

import asyncio

import pytest
from miles.core.buffer import GroupBuffer, collect_groups, generate_samples, produce_groups, sample_seed
from miles.core.config import SamplingConfig
from miles.core.sample import Sample, SampleStatus


def group(name, size=2):
    return [Sample(index=j, group_index=name, prompt=[1]) for j in range(size)]


@pytest.mark.parametrize("seed, index, expected", [
    pytest.param(0, 5, 5, id="step_seed_0_is_the_position"),
    pytest.param(1, 0, 0x1E3779B97F4A7C15, id="multiplier_mod_2_63"),  # 0x9E37... - 2**63
    pytest.param(2, 3, (2 * 0x9E3779B97F4A7C15 + 3) % 2**63, id="seed_2_index_3"),
])  # fmt: skip
def test_sample_seed_is_the_fibonacci_hash_of_the_step_seed_plus_the_position(seed, index, expected):
    assert sample_seed(seed, index) == expected < 2**63


def test_put_waits_while_the_buffer_holds_maxsize_groups_and_get_takes_the_oldest():
    async def run():
        buffer = GroupBuffer(maxsize=2)
        await buffer.put(group(0))
        await buffer.put(group(1))
        third = asyncio.ensure_future(buffer.put(group(2)))
        await asyncio.sleep(0.01)
        assert not third.done() and len(buffer) == 2  # full: the third put waits
        taken = await buffer.get(2)
        await asyncio.wait_for(third, 1)
        return taken, len(buffer)

    taken, left = asyncio.run(run())
    assert [g[0].group_index for g in taken] == [0, 1] and left == 1


def test_get_k_waits_until_k_groups_are_held():
    async def run():
        buffer = GroupBuffer(maxsize=3)
        getting = asyncio.ensure_future(buffer.get(2))
        await buffer.put(group(7))
        await asyncio.sleep(0.01)
        assert not getting.done()  # one group is not enough
        await buffer.put(group(8))
        return await asyncio.wait_for(getting, 1)

    assert [g[0].group_index for g in asyncio.run(run())] == [7, 8]


def test_get_more_than_maxsize_or_a_zero_maxsize_is_refused():
    with pytest.raises(ValueError, match="maxsize"):
        GroupBuffer(0)

    async def run():
        await GroupBuffer(2).get(3)

    with pytest.raises(ValueError, match=r"get\(3\).*maxsize=2"):
        asyncio.run(run())


class DelayedGroups:
    """A group-generate function whose groups complete after ``delays[group_index]`` seconds; each sample's
    response is its seed, so the test sees which seed it got."""

    def __init__(self, delays):
        self.delays = delays
        self.seeds = []

    async def __call__(
        self,
        prompt,
        *,
        n,
        sampling,
        seeds,
    ):
        self.seeds.append(list(seeds))
        await asyncio.sleep(self.delays[prompt.group_index])
        return [Sample(index=-1, group_index=prompt.group_index, prompt=prompt.prompt, tokens=[1, s % 97],
                       response_length=1, status=SampleStatus.COMPLETED) for s in seeds]  # fmt: skip


PROMPTS = [Sample(index=i, group_index=10 + i, prompt=[1]) for i in range(4)]


@pytest.mark.parametrize("delays", [
    pytest.param([0.0, 0.0, 0.0, 0.0], id="in_order"),
    pytest.param([0.04, 0.03, 0.02, 0.0], id="reversed"),
    pytest.param([0.02, 0.0, 0.04, 0.01], id="shuffled"),
])  # fmt: skip
def test_a_steps_groups_come_in_prompt_order_with_position_seeds_whatever_order_they_complete_in(delays):
    generate = DelayedGroups(dict(zip(range(10, 14), delays)))
    groups = asyncio.run(collect_groups(PROMPTS, generate, n_samples_per_prompt=3, sampling=SamplingConfig(), seed=42))
    assert [g[0].group_index for g in groups] == [10, 11, 12, 13]
    samples = [s for g in groups for s in g]
    assert [s.index for s in samples] == list(range(12))
    assert [s.response_tokens[0] for s in samples] == [sample_seed(42, i) % 97 for i in range(12)]


def test_the_producer_keeps_at_most_maxsize_groups_waiting_for_a_slow_consumer():
    held = []

    async def run():
        buffer = GroupBuffer(maxsize=1)
        producer = asyncio.ensure_future(
            produce_groups(
                PROMPTS,
                DelayedGroups(dict.fromkeys(range(10, 14), 0.0)),
                buffer,
                n_samples_per_prompt=2,
                sampling=SamplingConfig(),
                seed=0,
            )
        )
        groups = []
        while len(groups) < len(PROMPTS):
            await asyncio.sleep(0.01)
            held.append(len(buffer))
            groups += await buffer.get(1)
        await producer
        return groups

    groups = asyncio.run(run())
    assert max(held) == 1 and sorted(g[0].group_index for g in groups) == [10, 11, 12, 13]


def test_a_failing_group_function_raises_its_error_from_the_producer():
    async def broken(
        prompt,
        *,
        n,
        sampling,
        seeds,
    ):
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(collect_groups(PROMPTS, broken, n_samples_per_prompt=2, sampling=SamplingConfig(), seed=0))


def test_generate_samples_is_the_step_flattened_with_progress_per_group_as_groups_complete():
    generate = DelayedGroups(dict(zip(range(10, 14), [0.03, 0.0, 0.02, 0.01])))
    done = []
    samples = generate_samples(PROMPTS, generate, n_samples_per_prompt=2, sampling=SamplingConfig(), seed=7,
                               on_group=done.append)  # fmt: skip
    assert [s.index for s in samples] == list(range(8)) and [s.group_index for s in samples[::2]] == [10, 11, 12, 13]
    assert [s.response_tokens[0] for s in samples] == [sample_seed(7, i) % 97 for i in range(8)]
    assert done == [2, 2, 2, 2]


def test_generate_samples_refuses_to_run_inside_an_event_loop():
    async def inside():
        generate_samples(PROMPTS, DelayedGroups({}), n_samples_per_prompt=1, sampling=SamplingConfig(), seed=0)

    with pytest.raises(RuntimeError, match="await collect_groups instead"):
        asyncio.run(inside())
