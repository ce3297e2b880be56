"""The default group-generate function: chat-template prompts, n samples each, token-in-token-out
through an engine, one request per sample."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from typing import Any

from miles.core.config import SamplingConfig
from miles.core.multimodal import MultimodalInputs
from miles.core.protocols import Engine, GenerateOutput, GenerateRequest, RequestFailed
from miles.core.sample import Sample, SampleStatus
from miles.rollout.multimodal import image_data

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


def render_prompt_inputs(tokenizer: Any, sample: Sample) -> tuple[list[int], MultimodalInputs | None]:
    """Token ids and image inputs of a sample's prompt: with ``metadata["images"]``, the vision-language policy's
    ``VisionProcessor`` (``miles.rollout.multimodal``) renders both; otherwise ``render_prompt`` and None.

    Raises: ValueError for an empty prompt, images for a text-only policy, or a prompt and images that disagree.
    """
    if sample.metadata.get("images"):
        if not hasattr(tokenizer, "render_sample"):
            raise ValueError(
                "the prompt has images (metadata['images']) but the policy's tokenizer is not a vision-language "
                "processor (a text-only model, or no tokenizer): use a vision-language model (e.g. the "
                "tiny-qwen3-vl twin)"
            )
        return tokenizer.render_sample(sample)
    return render_prompt(tokenizer, sample.prompt), None


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


async def generate_group(
    engine: Engine,
    tokenizer: Any,
    prompt: Sample,
    *,
    n: int,
    sampling: SamplingConfig,
    seeds: Sequence[int],
    max_prompt_tokens: int = 2048,
    max_resubmits: int = 0,
    mask_stale_segments: bool = False,
) -> list[Sample]:
    """The default group-generate function (``GroupGenerateFn`` once engine and tokenizer are bound): renders the
    prompt once and asks the engine for ``n`` single-turn responses concurrently, sample j with ``seeds[j]``.

    A multi-turn function (tools, environments) has the same signature and returns the same kind of group.

    Args:
        engine: any ``miles.core.Engine``.
        tokenizer: the policy's HF tokenizer (chat template); None if every prompt is given as token ids.
        prompt: a pending sample from a ``DataSource`` (prompt, label, metadata, group_index).
        n: samples in the group.
        sampling: the engine's sampling settings.
        seeds: one sampling seed per sample.
        max_prompt_tokens: a longer prompt fails its samples (counted, not trained) instead of crashing.
        max_resubmits: a response cut off by ``Engine.pause("abort")`` (a weight update) is requested again, from
            the start with the same seed, up to this many times (``metadata["resubmits"]`` counts them); after
            that it stays ABORTED. 0 = keep the partial response.
        mask_stale_segments: a partial rollout (continued after a weight update, several ``weight_versions``) trains
            only its newest segment: the tokens sampled by older weights get ``loss_mask`` 0 (slime's
            mask-offpolicy-in-partial-rollout). Needs an engine that reports ``segment_lengths``; otherwise every
            token is trained.
    A prompt with images (``metadata["images"]``) is rendered by the policy's ``VisionProcessor``; every sample of
    the group carries the same ``multimodal_inputs``, and its requests send them to the engine.

    Returns: n samples, index 0 .. n-1 (the producer renumbers them), status COMPLETED ("stop"), TRUNCATED
        ("length"), ABORTED ("abort": cut off by ``Engine.pause``; the partial response is kept, not trained) or
        FAILED (bad prompt or engine output, or a ``RequestFailed`` request; reason in ``metadata["failure"]``,
        response dropped).
    Raises: ValueError if ``len(seeds) != n``; what the engine raised.
    """
    if len(seeds) != n:
        raise ValueError(f"generate_group got {len(seeds)} seeds for n={n} samples; pass one seed per sample")
    samples = [
        Sample(index=j, group_index=prompt.group_index, prompt=prompt.prompt, label=prompt.label,
               metadata=dict(prompt.metadata))
        for j in range(n)
    ]  # fmt: skip
    try:
        payload = None
        if prompt.metadata.get("images"):  # decoding and processing images: off the event loop
            prompt_tokens, images = await asyncio.to_thread(render_prompt_inputs, tokenizer, prompt)
            payload = image_data(prompt.metadata["images"])  # for servers that process the images themselves
        else:
            prompt_tokens, images = render_prompt_inputs(tokenizer, prompt)
        if len(prompt_tokens) > max_prompt_tokens:
            raise ValueError(f"prompt has {len(prompt_tokens)} tokens > max_prompt_tokens")
    except ValueError as err:
        for sample in samples:
            sample.status = SampleStatus.FAILED
            sample.metadata["failure"] = str(err)
        return samples

    async def generate_one(sample: Sample, seed: int) -> None:
        sample.tokens = list(prompt_tokens)
        sample.multimodal_inputs = images
        for attempt in range(max_resubmits + 1):
            try:
                request = GenerateRequest(
                    prompt_tokens, sampling, seed=seed, multimodal_inputs=images, image_data=payload
                )
                output = await engine.generate(request)
            except RequestFailed as err:
                sample.status = SampleStatus.FAILED
                sample.metadata["failure"] = str(err)
                return
            if output.finish_reason != "abort" or attempt == max_resubmits:
                break
            sample.metadata["resubmits"] = attempt + 1
        _apply_output(sample, output, tokenizer, mask_stale_segments=mask_stale_segments)

    await asyncio.gather(*(generate_one(sample, seed) for sample, seed in zip(samples, seeds)))
    return samples


def known_versions(token_versions: list[int | None]) -> list[int | None] | None:
    """``Sample.token_versions`` from per-token versions: None when no token's version is known."""
    return token_versions if not token_versions or any(v is not None for v in token_versions) else None


def _apply_output(sample: Sample, output: GenerateOutput, tokenizer: Any, *, mask_stale_segments: bool = False) -> None:
    """Append an engine output to a sample holding its prompt tokens; set status, versions, text and (with
    ``mask_stale_segments`` and several segments) a loss mask that trains only the newest segment."""
    sample.tokens = sample.tokens + output.response_tokens
    sample.response_length = len(output.response_tokens)
    sample.rollout_log_probs = list(output.log_probs)
    sample.weight_versions = list(output.weight_versions)
    sample.weight_version = output.weight_version
    sample.token_versions = known_versions(output.token_versions())
    sample.rollout_routed_experts = output.routed_experts
    segments = output.segment_lengths
    if mask_stale_segments and segments is not None and len(segments) > 1:
        sample.loss_mask = [0] * (len(output.response_tokens) - segments[-1]) + [1] * segments[-1]
    sample.status = FINISH_STATUS[output.finish_reason]
    sample.metadata["finish_reason"] = output.finish_reason
    aborted_before_sampling = output.finish_reason == "abort" and not output.response_tokens
    failure = None if aborted_before_sampling else engine_output_problem(output)
    if failure is not None:  # counted in samples/failed, excluded from advantages and the loss
        # Drop the response so no NaN or misaligned log-prob reaches the batch (masked rows still hold it).
        sample.tokens, sample.response_length, sample.rollout_log_probs = sample.tokens[: sample.prompt_length], 0, []
        sample.loss_mask = sample.token_versions = sample.rollout_routed_experts = None
        sample.status = SampleStatus.FAILED
        sample.metadata["failure"] = failure
    elif tokenizer is not None and output.response_tokens:  # token-only rollouts (tokenizer=None) have no text
        sample.response_text = tokenizer.decode(output.response_tokens, skip_special_tokens=True)


FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class ChatRollout:
    """The built-in single-turn rollout as a ``GroupGenerateFn``: ``generate_group`` with this engine, tokenizer and
    settings bound. The producer (``miles.core.buffer``) runs it per prompt for training and eval.

    Args:
        engine: any ``miles.core.Engine``.
        tokenizer: the policy's HF tokenizer (chat template); None if every prompt is given as token ids.
        max_prompt_tokens: longer prompts are marked FAILED (counted, not trained) instead of crashing.
        max_resubmits: times a response cut off by ``pause("abort")`` is requested again.
        mask_stale_segments: train only the newest segment of a partial rollout.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        max_prompt_tokens: int = 2048,
        max_resubmits: int = 0,
        mask_stale_segments: bool = False,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.max_resubmits = max_resubmits
        self.mask_stale_segments = mask_stale_segments

    async def __call__(self, prompt: Sample, *, n: int, sampling: SamplingConfig, seeds: Sequence[int]) -> list[Sample]:
        """``GroupGenerateFn``: the module's ``generate_group`` with this rollout's engine and tokenizer."""
        return await generate_group(
            self.engine,
            self.tokenizer,
            prompt,
            n=n,
            sampling=sampling,
            seeds=seeds,
            max_prompt_tokens=self.max_prompt_tokens,
            max_resubmits=self.max_resubmits,
            mask_stale_segments=self.mask_stale_segments,
        )
