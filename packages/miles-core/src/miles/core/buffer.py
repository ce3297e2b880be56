"""A bounded buffer of groups and the producer that fills it: the parts the sync loop and an async loop share.

The producer runs one group-generate function per prompt, all concurrently (so the engine batches their
requests), and puts each group into the buffer as it completes; the consumer takes k groups at a time. The sync
loop is these parts with a buffer of one step (``collect_groups``); a fully async loop keeps the producer running
ahead of the trainer, and ``maxsize`` bounds how far.

A sample's seed depends only on the step seed and its position in the step (``sample_seed``), and the groups of a
step are returned in prompt order, so a step's rollout is the same whatever order its groups complete in.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

from miles.core.config import SamplingConfig
from miles.core.protocols import GroupGenerateFn
from miles.core.sample import Sample

# 2**64 / golden ratio (Fibonacci hashing): consecutive step seeds land far apart in the per-sample seed space.
SEED_MULTIPLIER = 0x9E3779B97F4A7C15


def sample_seed(seed: int, index: int) -> int:
    """Sampling seed of the sample at position ``index`` of a step with seed ``seed``:
    ``(seed * 0x9E3779B97F4A7C15 + index) mod 2**63`` (a valid ``torch.Generator`` seed).

    It depends on nothing else, so a sample's response does not depend on batching or completion order.
    """
    return (seed * SEED_MULTIPLIER + index) % 2**63


class GroupBuffer:
    """A bounded FIFO of groups (``list[Sample]``, the n samples of one prompt) between producers and a consumer.

    Groups come out in the order they were put (completion order); ``collect_groups`` sorts a step's groups.
    Use it from one event loop.

    Args:
        maxsize: most groups held; ``put`` waits while the buffer is full.
    Raises: ValueError if ``maxsize`` < 1.
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"GroupBuffer maxsize is {maxsize}; it counts groups and must be >= 1")
        self.maxsize = maxsize
        self._groups: deque[list[Sample]] = deque()
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._groups)

    async def put(self, group: list[Sample]) -> None:
        """Add one group; waits while ``maxsize`` groups are held."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._groups) < self.maxsize)
            self._groups.append(group)
            self._changed.notify_all()

    async def get(self, k: int) -> list[list[Sample]]:
        """Take the ``k`` oldest groups, waiting until ``k`` are held (all at once: a cancelled get takes none).

        Raises: ValueError unless 1 <= k <= maxsize (more could never be held at once).
        """
        if not 1 <= k <= self.maxsize:
            raise ValueError(f"GroupBuffer.get({k}): k must be in [1, maxsize={self.maxsize}]")
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._groups) >= k)
            groups = [self._groups.popleft() for _ in range(k)]
            self._changed.notify_all()
        return groups


async def produce_groups(
    prompts: Sequence[Sample],
    generate_group: GroupGenerateFn,
    buffer: GroupBuffer,
    *,
    n_samples_per_prompt: int,
    sampling: SamplingConfig,
    seed: int,
    on_group: Callable[[int], None] | None = None,
) -> None:
    """Run ``generate_group`` for every prompt concurrently and put each group into ``buffer`` as it completes.

    Sample j of the prompt at position p gets seed ``sample_seed(seed, p * n + j)`` (n = ``n_samples_per_prompt``)
    and ``index`` p * n + j, which orders the groups by prompt (a group of another size than n is passed on as
    it is; ``collect_groups`` renumbers). ``on_group`` (progress only) is called with a group's size as it
    completes. Returns once every group is in the buffer, so a buffer smaller than ``len(prompts)`` needs a
    consumer running meanwhile.
    Raises: ValueError for an empty group; the first error of a ``generate_group`` call, after cancelling the
        others.
    """
    n = n_samples_per_prompt

    async def one(position: int, prompt: Sample) -> None:
        indices = range(position * n, (position + 1) * n)
        seeds = [sample_seed(seed, i) for i in indices]
        group = await generate_group(prompt, n=n, sampling=sampling, seeds=seeds)
        if not group:
            raise ValueError(
                f"the group-generate function returned no sample for prompt {prompt.group_index}, expected "
                f"n_samples_per_prompt={n} (a sample that cannot be generated is returned FAILED)"
            )
        for j, sample in enumerate(group):
            sample.index = position * n + j
        if on_group is not None:
            on_group(len(group))
        await buffer.put(group)

    tasks = [asyncio.ensure_future(one(p, prompt)) for p, prompt in enumerate(prompts)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # after an error, stop the rest (no-op for finished tasks)
            task.cancel()


async def collect_groups(
    prompts: Sequence[Sample],
    generate_group: GroupGenerateFn,
    *,
    n_samples_per_prompt: int,
    sampling: SamplingConfig,
    seed: int,
    on_group: Callable[[int], None] | None = None,
) -> list[list[Sample]]:
    """One step of the sync loop: the producer fills a buffer of ``len(prompts)`` groups, the step takes them all.

    Returns: one group per prompt, in prompt order, samples numbered 0, 1, ... in that order (0 .. P * n - 1 when
        every group has n), whatever order they completed in.
    """
    if not prompts:
        return []
    buffer = GroupBuffer(len(prompts))
    await produce_groups(
        prompts,
        generate_group,
        buffer,
        n_samples_per_prompt=n_samples_per_prompt,
        sampling=sampling,
        seed=seed,
        on_group=on_group,
    )
    groups = sorted(await buffer.get(len(prompts)), key=lambda group: group[0].index)  # index: p * n + j
    for index, sample in enumerate(s for group in groups for s in group):
        sample.index = index
    return groups


def generate_samples(
    prompts: Sequence[Sample],
    generate_group: GroupGenerateFn,
    *,
    n_samples_per_prompt: int,
    sampling: SamplingConfig,
    seed: int,
    on_group: Callable[[int], None] | None = None,
) -> list[Sample]:
    """``collect_groups`` for synchronous callers (evaluation, scripts, an ``eval.path`` function): the samples of
    every prompt, in prompt order, index 0 .. len(prompts) * n - 1. Runs its own event loop.

    Raises: RuntimeError when called from a running event loop (await ``collect_groups`` there); what
        ``collect_groups`` raises.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("generate_samples runs its own event loop; from async code await collect_groups instead")
    groups = asyncio.run(
        collect_groups(
            prompts,
            generate_group,
            n_samples_per_prompt=n_samples_per_prompt,
            sampling=sampling,
            seed=seed,
            on_group=on_group,
        )
    )
    return [sample for group in groups for sample in group]
