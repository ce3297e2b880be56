"""``rollout.rollout_path``: a factory of the whole rollout step.

This one is the built-in single-turn rollout with a twist a batch function makes easy: it sees every prompt of the
step at once, so it records the step's prompt count on each sample (a curriculum or a batch-level rejection sampler
would use the same view).
"""

from miles.rollout.generate import ChatRollout


def build_rollout(context):
    """(context: GenerateContext) -> RolloutFn."""
    chat = ChatRollout(context.engine, context.tokenizer, max_prompt_tokens=context.max_prompt_tokens)

    def rollout(prompts, *, n_samples_per_prompt, sampling, seed, on_finished=None):
        samples = chat(
            prompts, n_samples_per_prompt=n_samples_per_prompt, sampling=sampling, seed=seed, on_finished=on_finished
        )
        for sample in samples:
            sample.metadata["prompts_in_step"] = len(prompts)
        return samples

    return rollout
