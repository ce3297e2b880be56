"""Multi-turn group generation with tool calls, token-in-token-out (rollout.mode multi_turn).

Per sample: the prompt is rendered once; each turn sends the whole trajectory so far to the engine; the engine's
ids are appended as they are; when the turn's text calls tools (Hermes ``<tool_call>``), the tools run and their
results are appended as ids the chat template renders (``miles.rollout.tito``); the next turn continues. It ends at
a turn without a tool call (COMPLETED) or at a budget (TRUNCATED). Model ids get loss mask 1, tool results and
template glue 0, so the trainer learns only what the model sampled (the setting of slime's multi-turn examples and
of verl's agent loop; the Hermes format: https://github.com/NousResearch/Hermes-Function-Calling).

A prompt with images (``metadata["images"]``, a vision-language policy) is rendered once by the policy's
``VisionProcessor``: the trajectory starts with its ids (each image's placeholders expanded), and every turn's
request carries the same image inputs (``multimodal_inputs``, and ``image_data`` for servers that process images
themselves), as does the finished sample, so the trainer scores each turn against the images the engine saw. Tool
results are text.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from miles.core.buffer import sample_seed
from miles.core.config import MultiTurnConfig, SamplingConfig
from miles.core.multimodal import MultimodalInputs
from miles.core.protocols import Engine, GenerateOutput, GenerateRequest, GroupGenerateFn, RequestFailed
from miles.core.sample import Sample, SampleStatus
from miles.rollout.generate import engine_output_problem, known_versions, render_prompt_inputs
from miles.rollout.generate_factory import GenerateContext
from miles.rollout.tito import Trajectory, TurnRenderer
from miles.rollout.tools import Tool, ToolCall, load_tools, parse_tool_calls, run_tool_call

logger = logging.getLogger(__name__)

# How a sample ended (metadata["stop_reason"]) -> its status.
STOP_STATUS = {
    "answer": SampleStatus.COMPLETED,  # a turn without a tool call
    "length": SampleStatus.TRUNCATED,  # a turn cut at rollout.sampling.max_new_tokens
    "max_response_tokens": SampleStatus.TRUNCATED,
    "max_turns": SampleStatus.TRUNCATED,  # the last allowed turn still called a tool
    "abort": SampleStatus.ABORTED,  # a turn cut off by Engine.pause("abort") after its resubmits
}


class MultiTurnRollout:
    """Multi-turn tool-calling rollouts; ``generate_group`` is the ``GroupGenerateFn``.

    Args:
        engine: any ``miles.core.Engine``.
        tokenizer: the policy's HF tokenizer (chat template; decodes each turn to find its tool calls).
        config: the ``rollout.multi_turn`` section (budgets, few-shot messages, template variables).
        tools: the tools by name (``miles.rollout.tools.load_tools``).
        max_prompt_tokens: a longer rendered prompt fails its group (counted, not trained) instead of the run.
        max_resubmits: a turn cut off by ``Engine.pause("abort")`` (a weight update in fully_async) is requested
            again from the same trajectory with the same seed, up to this many times per sample (metadata
            ``resubmits``); then the sample stays ABORTED with the partial turn. Earlier turns are kept.
        mask_stale_segments: at the end, give loss mask 0 to model tokens sampled by weights older than the newest
            ones in the sample (``Trajectory.mask_stale_tokens``).
        chat_template: jinja source to render with instead of the tokenizer's template; None = the tokenizer's.
    Raises: ValueError without a tokenizer, or for a template that cannot render tool turns by appending
        (``TurnRenderer``).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        config: MultiTurnConfig,
        tools: Mapping[str, Tool],
        max_prompt_tokens: int = 2048,
        max_resubmits: int = 0,
        mask_stale_segments: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.tools = dict(tools)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_resubmits = max_resubmits
        self.mask_stale_segments = mask_stale_segments
        self.renderer = TurnRenderer(
            tokenizer,
            tools=[tool.schema() for tool in self.tools.values()],
            chat_template=chat_template,
            chat_template_kwargs=config.chat_template_kwargs,
        )
        self.tokenizer = tokenizer

    def prompt_messages(self, prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
        """The chat messages a prompt is rendered from: a string becomes one user message; ``few_shot`` messages
        go after the leading system message(s)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        num_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        return [*messages[:num_system], *self.config.few_shot, *messages[num_system:]]

    def prompt_tokens(self, prompt: str | list[dict[str, str]] | list[int]) -> list[int]:
        """Token ids of a prompt (token-id prompts as they are). Raises: ValueError for an empty or too long one."""
        if not prompt:
            raise ValueError("empty prompt: a prompt needs text, token ids or at least one chat message")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            tokens = list(prompt)
        else:
            tokens = self.renderer.prompt_tokens(self.prompt_messages(prompt))
        if len(tokens) > self.max_prompt_tokens:
            raise ValueError(f"prompt has {len(tokens)} tokens > max_prompt_tokens")
        return tokens

    async def generate_group(
        self,
        prompt: Sample,
        *,
        n: int,
        sampling: SamplingConfig,
        seeds: Sequence[int],
    ) -> list[Sample]:
        """``GroupGenerateFn``: n multi-turn samples of one prompt, run concurrently (the engine batches their turns);
        sample j's turn k is sampled with seed ``sample_seed(seeds[j], k)``.

        Returns: n samples, index 0 .. n-1: ``tokens`` = prompt ids + response ids (model and environment turns in
            order), ``loss_mask`` 1 on model ids and 0 on environment ids, ``rollout_log_probs`` the engine's on
            model ids and 0.0 elsewhere (all three ``response_length`` long), ``weight_versions`` every turn's,
            ``response_text`` the last turn's text (what a reward reads for the final answer) and in ``metadata``:
            ``messages`` (the turns as chat messages: assistant texts, tool results), ``num_turns``,
            ``num_tool_calls``, ``stop_reason`` (a key of ``STOP_STATUS``, which gives the status) and
            ``finish_reason`` (the last engine finish). FAILED samples (bad prompt, bad engine output, a tool that
            raised, a ``RequestFailed`` turn) carry ``metadata["failure"]`` and no response.
        Raises: ValueError if ``len(seeds) != n``; what the engine raised.
        """
        if len(seeds) != n:
            raise ValueError(f"generate_group got {len(seeds)} seeds for n={n} samples; pass one seed per sample")
        samples = [
            Sample(index=j, group_index=prompt.group_index, prompt=prompt.prompt, label=prompt.label,
                   metadata=dict(prompt.metadata))
            for j in range(n)
        ]  # fmt: skip
        images = None
        try:
            if prompt.metadata.get("images"):  # decoding and processing images: off the event loop
                prompt_tokens, images = await asyncio.to_thread(self.image_prompt_inputs, prompt)
            else:
                prompt_tokens = self.prompt_tokens(prompt.prompt)
        except ValueError as err:
            for sample in samples:
                sample.status = SampleStatus.FAILED
                sample.metadata["failure"] = str(err)
            return samples
        await asyncio.gather(
            *(self._generate_sample(s, prompt_tokens, sampling=sampling, seed=seed, images=images)
              for s, seed in zip(samples, seeds))
        )  # fmt: skip
        return samples

    def image_prompt_inputs(self, prompt: Sample) -> tuple[list[int], _Images]:
        """Token ids and image inputs of a prompt with ``metadata["images"]``: its chat messages (few-shot messages
        added as for text prompts) rendered by the policy's ``VisionProcessor``.

        Raises: ValueError for a text-only policy, a prompt and images that disagree, or a too long prompt.
        """
        from miles.rollout.multimodal import image_data

        messages = prompt.prompt if not isinstance(prompt.prompt, list) else self.prompt_messages(prompt.prompt)
        rendered = Sample(index=0, group_index=prompt.group_index, prompt=messages, metadata=prompt.metadata)
        tokens, inputs = render_prompt_inputs(self.tokenizer, rendered)
        if len(tokens) > self.max_prompt_tokens:
            raise ValueError(f"prompt has {len(tokens)} tokens > max_prompt_tokens")
        return tokens, _Images(inputs, image_data(prompt.metadata["images"]))

    async def _generate_sample(self, sample: Sample, prompt_tokens: list[int], *, sampling: SamplingConfig,
                               seed: int, images: _Images | None = None) -> None:  # fmt: skip
        """Run the turns of one sample and fill it (see ``generate_group``); ``images``: the prompt's, sent with every
        turn and kept on the sample."""
        config, trajectory = self.config, Trajectory(list(prompt_tokens))
        sample.multimodal_inputs = images.inputs if images is not None else None
        messages: list[dict[str, Any]] = []
        sample.metadata.update(messages=messages, num_turns=0, num_tool_calls=0)
        stop_reason, text, output = "max_turns", "", None
        for turn in range(config.max_turns):
            budget = config.max_response_tokens - trajectory.response_length
            turn_sampling = sampling
            if budget < sampling.max_new_tokens:  # unchanged otherwise, so the engine batches turns together
                turn_sampling = sampling.model_copy(update={"max_new_tokens": budget})
            try:
                output = await self._generate_turn(
                    sample, trajectory.tokens, turn_sampling, sample_seed(seed, turn), images=images
                )
            except RequestFailed as err:
                return _fail(sample, str(err), prompt_tokens)
            aborted_before_sampling = output.finish_reason == "abort" and not output.response_tokens
            problem = None if aborted_before_sampling else engine_output_problem(output)
            if problem is not None:
                return _fail(sample, problem, prompt_tokens)
            trajectory.add_model_turn(output)
            text = self.tokenizer.decode(output.response_tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
            sample.metadata["num_turns"] = turn + 1
            if output.finish_reason != "stop":  # abort, or cut at the turn's token limit
                at_budget = output.finish_reason == "length" and turn_sampling.max_new_tokens == budget
                stop_reason = output.finish_reason if not at_budget else "max_response_tokens"
                break
            calls = parse_tool_calls(text)
            if not calls:
                stop_reason = "answer"
                break
            if turn + 1 == config.max_turns:
                break  # stop_reason "max_turns": no turn is left to read the results
            results = []
            for call in calls:
                try:
                    results.append(await self._run_tool(call, sample))
                except Exception as err:  # noqa: BLE001 - a tool's own bug fails this sample only, never the run
                    return _fail(sample, f"tool {call.name!r} raised {type(err).__name__}: {err}", prompt_tokens)
            sample.metadata["num_tool_calls"] += len(calls)
            tool_messages = [{"role": "tool", "name": c.name, "content": r} for c, r in zip(calls, results)]
            suffix = self.renderer.suffix_tokens(tool_messages, last_token=output.response_tokens[-1])
            messages.extend(tool_messages)
            if trajectory.response_length + len(suffix) >= config.max_response_tokens:
                stop_reason = "max_response_tokens"  # no room for a model token after the results: not appended
                break
            trajectory.add_env_turn(suffix)
        if self.mask_stale_segments:
            trajectory.mask_stale_tokens()
        _fill(sample, trajectory, response_text=text, stop_reason=stop_reason, finish_reason=output.finish_reason)

    async def _run_tool(self, call: ToolCall, sample: Sample) -> str:
        """``run_tool_call`` in a worker thread, bounded by ``tool_timeout_s`` (past it: an error text for the model,
        counted in ``metadata["num_tool_timeouts"]``). Raises: what the tool raised (see ``run_tool_call``)."""
        limit = self.config.tool_timeout_s
        try:
            return await asyncio.wait_for(in_daemon_thread(run_tool_call, call, self.tools), limit)
        except TimeoutError:
            sample.metadata["num_tool_timeouts"] = sample.metadata.get("num_tool_timeouts", 0) + 1
            return f"Error: the tool {call.name!r} did not answer within {limit:g} s"

    async def _generate_turn(self, sample: Sample, tokens: list[int], sampling: SamplingConfig,
                             seed: int, *, images: _Images | None = None) -> GenerateOutput:  # fmt: skip
        """One turn's engine output, requested again after an abort while the sample has resubmits left.
        Raises: RequestFailed from the engine."""
        extra = {"multimodal_inputs": images.inputs, "image_data": images.payload} if images is not None else {}
        while True:
            output = await self.engine.generate(GenerateRequest(tokens, sampling, seed=seed, **extra))
            resubmits = sample.metadata.get("resubmits", 0)
            if output.finish_reason != "abort" or resubmits == self.max_resubmits:
                return output
            sample.metadata["resubmits"] = resubmits + 1


class _Images:
    """A prompt's image inputs as the engine and trainer take them (``inputs``) and as base64 files (``payload``,
    an SGLang-API server's ``image_data``)."""

    def __init__(self, inputs: MultimodalInputs | None, payload: list[str]) -> None:
        self.inputs, self.payload = inputs, payload


async def in_daemon_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread of its own, awaited. Unlike ``asyncio.to_thread`` (the loop's default
    executor, which ``asyncio.run`` joins on exit), a call that never returns holds neither the round that awaited it
    nor the interpreter's exit: after its caller's timeout it only keeps its own thread (Python cannot stop one).

    Raises: what ``fn`` raises.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # a timed-out caller cancelled it
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except Exception as err:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (None, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop ended meanwhile (the call outlived its round): nobody waits for it
            pass

    threading.Thread(target=work, daemon=True, name=f"miles-tool-{getattr(fn, '__name__', 'call')}").start()
    return await future


def _fill(sample: Sample, trajectory: Trajectory, *, response_text: str, stop_reason: str, finish_reason: str) -> None:
    """Set a finished sample's ids, mask, log-probs, versions, experts, text, status and stop reasons."""
    sample.tokens, sample.response_length = trajectory.tokens, trajectory.response_length
    sample.loss_mask, sample.rollout_log_probs = trajectory.loss_mask, trajectory.rollout_log_probs
    sample.weight_versions, sample.weight_version = trajectory.weight_versions, trajectory.weight_versions[-1]
    sample.token_versions = known_versions(trajectory.token_versions)
    sample.rollout_routed_experts = trajectory.routed_experts
    sample.response_text = response_text
    sample.status = STOP_STATUS[stop_reason]
    sample.metadata.update(stop_reason=stop_reason, finish_reason=finish_reason)


def _fail(sample: Sample, reason: str, prompt_tokens: list[int]) -> None:
    """Mark a sample FAILED, its response dropped (as ``miles.rollout.generate`` does: prompt ids kept, no
    log-prob), so nothing misaligned reaches a batch; counted in samples/failed, never trained."""
    sample.status = SampleStatus.FAILED
    sample.metadata["failure"] = reason
    sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = list(prompt_tokens), 0, None, []
    sample.token_versions = None


def build_multi_turn(context: GenerateContext) -> GroupGenerateFn:
    """``GenerateFactory`` of rollout.mode multi_turn: a ``MultiTurnRollout`` over the context's engine and
    tokenizer with the ``rollout.multi_turn`` section, its ``generate_group``.

    Raises: as ``load_tools`` (a bad ``rollout.multi_turn.tools`` entry) and ``MultiTurnRollout``.
    """
    config = context.rollout.multi_turn
    rollout = MultiTurnRollout(
        context.engine,
        context.tokenizer,
        config=config,
        tools=load_tools(config.tools),
        max_prompt_tokens=context.max_prompt_tokens,
        max_resubmits=context.rollout.max_resubmits,
        mask_stale_segments=context.mask_stale_segments,
    )
    logger.info(
        "multi-turn rollout: tools %s, at most %d turns and %d response tokens per sample",
        ", ".join(rollout.tools),
        config.max_turns,
        config.max_response_tokens,
    )
    return rollout.generate_group
