"""The default rollout function: chat-template prompts, n samples each, token-in-token-out through an engine."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from miles.core.config import SamplingConfig
from miles.core.protocols import Engine, GenerateOutput, GenerateRequest
from miles.core.sample import Sample, SampleStatus

logger = logging.getLogger(__name__)


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, str]] | list[int]) -> list[int]:
    """Token ids of a prompt: chat messages go through the tokenizer's chat template (with the generation
    prompt appended); a plain string is tokenized as is; a list of ints is already token ids (token-in).
    Raises ValueError for an empty prompt."""
    if not prompt:
        raise ValueError("empty prompt: a prompt needs text, token ids or at least one chat message")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, str):
        text = prompt
    else:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def engine_output_problem(output: GenerateOutput) -> str | None:
    """Why an engine output cannot be trained on, or None.

    An empty response has no token to train; log-probs that are NaN/inf (overflowing logits) or do not match the
    response length would poison the importance ratio and the rollout/trainer mismatch metrics. A response that
    is only a stop token, or that hit max_new_tokens (TRUNCATED), is a legitimate sample and is kept.
    """
    if not output.response_tokens:
        return "engine returned an empty response"
    if len(output.log_probs) != len(output.response_tokens):
        return f"engine returned {len(output.log_probs)} log-probs for {len(output.response_tokens)} tokens"
    if not all(math.isfinite(x) for x in output.log_probs):
        return "engine returned non-finite log-probs (NaN/inf logits)"
    return None


class ChatRollout:
    """``RolloutFn``: renders each prompt once, asks the engine for n samples, returns completed ``Sample``s.

    Args:
        engine: any ``miles.core.Engine``.
        tokenizer: the policy's HF tokenizer (chat template); None if every prompt is given as token ids.
        max_prompt_tokens: longer prompts are marked FAILED (counted, not trained) instead of crashing.
    """

    def __init__(self, engine: Engine, tokenizer: Any, *, max_prompt_tokens: int = 2048) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens

    def __call__(
        self,
        prompts: Sequence[Sample],
        *,
        n_samples_per_prompt: int,
        sampling: SamplingConfig,
        seed: int,
        on_finished: Callable[[int], None] | None = None,
    ) -> list[Sample]:
        """``RolloutFn``; ``on_finished`` counts failed prompts' samples at once and is handed to the engine."""
        samples: list[Sample] = []
        requests: list[GenerateRequest] = []
        pending: list[Sample] = []
        for prompt in prompts:
            try:
                prompt_tokens = render_prompt(self.tokenizer, prompt.prompt)
                if len(prompt_tokens) > self.max_prompt_tokens:
                    raise ValueError(f"prompt has {len(prompt_tokens)} tokens > max_prompt_tokens")
                failure = None
            except ValueError as err:
                prompt_tokens, failure = [], str(err)
            for _ in range(n_samples_per_prompt):
                sample = Sample(
                    index=len(samples),
                    group_index=prompt.group_index,
                    prompt=prompt.prompt,
                    label=prompt.label,
                    tokens=list(prompt_tokens),
                    metadata=dict(prompt.metadata),
                )
                samples.append(sample)
                if failure is not None:
                    sample.status = SampleStatus.FAILED
                    sample.metadata["failure"] = failure
                    continue
                pending.append(sample)
                # One seed per request batch keeps a step reproducible; the engine's RNG varies the samples.
                requests.append(GenerateRequest(prompt_tokens=prompt_tokens, sampling=sampling, seed=seed))
        if on_finished is not None and len(samples) > len(pending):  # prompts that failed to render
            on_finished(len(samples) - len(pending))
        # The callback goes to the engine only when given, so engines without progress support keep working.
        progress = {"on_finished": on_finished} if on_finished is not None else {}
        outputs = self.engine.generate(requests, **progress) if requests else []
        for sample, output in zip(pending, outputs):
            sample.tokens = sample.tokens + output.response_tokens
            sample.response_length = len(output.response_tokens)
            sample.rollout_log_probs = list(output.log_probs)
            sample.weight_version = output.weight_version
            sample.rollout_routed_experts = output.routed_experts
            sample.status = {
                "stop": SampleStatus.COMPLETED,
                "length": SampleStatus.TRUNCATED,
                "abort": SampleStatus.ABORTED,
            }[output.finish_reason]
            sample.metadata["finish_reason"] = output.finish_reason
            failure = engine_output_problem(output)
            if failure is not None:  # counted in samples/failed, excluded from advantages and the loss
                # Drop the response so no NaN or misaligned log-prob reaches the batch (masked rows still hold it).
                prompt_tokens = sample.tokens[: sample.prompt_length]
                sample.tokens, sample.response_length, sample.rollout_log_probs = prompt_tokens, 0, []
                sample.status = SampleStatus.FAILED
                sample.metadata["failure"] = failure
                continue
            if self.tokenizer is not None:  # token-only rollouts (tokenizer=None) have no text
                sample.response_text = self.tokenizer.decode(output.response_tokens, skip_special_tokens=True)
        return samples
