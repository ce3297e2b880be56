"""A fixed small TrainBatch over the tiny Llama's 32-token vocabulary (shared by tests and spawned workers)."""

import torch
from miles.core.batch import TrainBatch, build_train_batch
from miles.core.sample import Sample


def make_batch(num: int = 6, seed: int = 0) -> TrainBatch:
    """``num`` samples with prompts of 3-5 tokens, responses of 2-6 tokens, random advantages and log-probs."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num):
        prompt_len = 3 + i % 3
        response_len = 2 + (i * 5) % 5
        tokens = torch.randint(3, 32, (prompt_len + response_len,), generator=gen).tolist()
        samples.append(
            Sample(
                index=i,
                group_index=i // 2,
                prompt="",
                tokens=tokens,
                response_length=response_len,
                rollout_log_probs=(-torch.rand(response_len, generator=gen) * 3).tolist(),
                loss_mask=[1] * (response_len - 1) + [i % 2],
            )
        )
    advantages = torch.randn(num, generator=gen)
    return build_train_batch(samples, advantages, pad_token_id=0)
