"""``rollout.generate_path``: a factory of the group-generate function (one prompt -> its n samples), the rollout
used for training (sync and async) and eval.

This one asks the engine for each prompt's group through the built-in single-turn rollout, then tags the samples
with their group size; an agent loop (tools, environments) has the same shape (see ``miles.rollout.multiturn``).
"""

from miles.rollout.generate import ChatRollout


def build_generate(context):
    """(context: GenerateContext) -> GroupGenerateFn."""
    chat = ChatRollout(context.engine, context.tokenizer, max_prompt_tokens=context.max_prompt_tokens)

    async def generate_group(prompt, *, n, sampling, seeds):
        samples = await chat(prompt, n=n, sampling=sampling, seeds=seeds)
        for sample in samples:
            sample.metadata["group_size"] = n
        return samples

    return generate_group
