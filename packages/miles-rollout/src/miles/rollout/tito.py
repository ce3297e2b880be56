"""Token-in-token-out (TITO) trajectories of multi-turn rollouts.

A trajectory is the exact concatenation of the token ids the engine saw and produced: the rendered prompt, then per
turn the engine's response ids as returned (never decoded and re-tokenized) and, between turns, the environment's
ids (tool results plus the chat template's glue and the next assistant header), rendered by the chat template.

How the environment's ids are rendered (``TurnRenderer.suffix_tokens``): the tokenizer renders a fixed one-message
conversation (the anchor) with and without the new messages (and the generation prompt); the text between the two
renderings is the new messages' part, prefixed by the glue the template writes after an assistant message's end
token (ChatML: ``"\\n"`` after ``<|im_end|>``). Rendering the real history instead would not work for every template:
Qwen3's re-renders an earlier assistant turn without its (empty) ``<think>`` block once it is no longer the last
message, so the longer rendering does not extend the shorter. Since no model text is rendered, what the model wrote
(its reasoning, its exact tool-call JSON) stays in the trajectory as sampled; docs/agentic.md lists where this differs
from re-rendering the whole conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles.core.protocols import GenerateOutput
from miles.core.routing_replay import merge_routing, pad_routing

# Log-prob stored at environment positions (loss_mask 0): a filler the trainer never reads (every use is masked).
ENV_LOG_PROB = 0.0

# The fixed conversation environment turns are rendered after; a user turn, since templates open a tool turn the same
# way after a user or an assistant message (ChatML, Qwen3, Hermes).
ANCHOR_MESSAGES: tuple[dict[str, str], ...] = ({"role": "user", "content": "MILES_ANCHOR"},)
_PROBE = "MILES_PROBE"


class TurnRenderer:
    """Renders the non-model parts of a multi-turn conversation as token ids through a chat template.

    Args:
        tokenizer: an HF tokenizer with a chat template (``apply_chat_template``, ``decode``, ``__call__``).
        tools: OpenAI-style function schemas (``Tool.schema()``), passed as ``tools=`` to every rendering; templates
            with a tools section (Qwen3) describe them in the system prompt, others (SmolLM2's ChatML) ignore them.
        chat_template: a template to use instead of the tokenizer's own (jinja source); None = the tokenizer's.
        chat_template_kwargs: extra template variables for every rendering (e.g. ``enable_thinking``).
    Raises: ValueError when the template does not render a tool turn after the anchor by extending the anchor's
        rendering (such a template cannot be rendered turn by turn).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[dict[str, Any]] = (),
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if tokenizer is None:
            raise ValueError("a multi-turn rollout needs the policy's tokenizer (its chat template renders tool turns)")
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._anchor = self.render(list(ANCHOR_MESSAGES), add_generation_prompt=False)
        probe = [*ANCHOR_MESSAGES, {"role": "assistant", "content": _PROBE}]
        with_probe = self.render(probe, add_generation_prompt=False)
        # What the template writes after an assistant message's content, e.g. "<|im_end|>\n" (ChatML).
        self.message_end = with_probe[with_probe.rindex(_PROBE) + len(_PROBE) :]
        self._new_text([{"role": "tool", "content": _PROBE}])  # fails now, not at the first tool call

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        """The chat template's text for ``messages``."""
        kwargs = {"chat_template": self.chat_template} if self.chat_template is not None else {}
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
            **self.chat_template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text; special tokens written in it (``<|im_start|>``) map to their ids, and no BOS
        is added (the template writes what it needs), as ``miles.rollout.generate.render_prompt`` does."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_tokens(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of the prompt: the messages rendered with the generation prompt (the first assistant header)."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def suffix_tokens(self, messages: Sequence[dict[str, Any]], *, last_token: int) -> list[int]:
        """Token ids that follow a model turn ending in ``last_token`` when ``messages`` (tool results, or any
        non-assistant turns) come next: the template's glue after the turn's end, the messages, the next assistant
        header.

        The glue is the template's text after an assistant message's content (``message_end``) minus the text of
        ``last_token`` when it starts with it (the model wrote the end token itself, as on a "stop" finish), else all
        of it (ChatML: ``"\\n"`` after a sampled ``<|im_end|>``).
        Raises: ValueError as ``TurnRenderer`` (a template that renders these messages by rewriting the anchor).
        """
        end = self.tokenizer.decode([last_token])
        glue = self.message_end[len(end) :] if end and self.message_end.startswith(end) else self.message_end
        return self.encode(glue + self._new_text(messages))

    def _new_text(self, messages: Sequence[dict[str, Any]]) -> str:
        full = self.render([*ANCHOR_MESSAGES, *messages], add_generation_prompt=True)
        if not full.startswith(self._anchor):
            roles = [m.get("role") for m in messages]
            raise ValueError(
                f"the chat template renders {roles} after a user message by changing the rendering before them, so "
                "tool turns cannot be appended token by token; use a template whose renderings of growing "
                "conversations extend each other (ChatML, Qwen3, Hermes), e.g. via the tokenizer's chat_template"
            )
        return full[len(self._anchor) :]


@dataclass
class Trajectory:
    """A multi-turn sample under construction: prompt ids, then model and environment turns appended as ids.

    Invariant: ``len(response_tokens) == len(loss_mask) == len(rollout_log_probs) == len(token_versions)``.

    Attributes:
        prompt_tokens: the rendered prompt (the first request's prompt).
        response_tokens: model and environment ids after the prompt, in order.
        loss_mask: per response token, 1 = sampled by the model (trained), 0 = environment (tool results, glue).
        rollout_log_probs: per response token, the engine's log-prob (float nats) of a model token,
            ``ENV_LOG_PROB`` at environment positions.
        token_versions: per response token, the weight version that sampled it; None for environment tokens and
            where the engine did not say (several versions in a turn without ``segment_lengths``).
        weight_versions: every turn's ``weight_versions``, in order (one entry per generated segment).
        routed_experts: the trajectory's routed experts ([len(tokens), layers, top_k] int32, -1 where nothing
            was recorded: environment ids after the last model turn, a sequence's last token); each position keeps
            the routing of the first request that recorded it (a later turn's prefill routes the earlier tokens
            again, with weights that may have changed since they were sampled); None for dense models.
    """

    prompt_tokens: list[int]
    response_tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    token_versions: list[int | None] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    routed_experts: Any = None

    @property
    def tokens(self) -> list[int]:
        """Prompt + response ids: the next request's prompt."""
        return self.prompt_tokens + self.response_tokens

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    def add_model_turn(self, output: GenerateOutput) -> None:
        """Append an engine output as is: its ids, log-probs, mask 1, versions and routed experts.

        Raises: ValueError when the output has not one log-prob per token (``engine_output_problem`` first).
        """
        tokens, log_probs = output.response_tokens, output.log_probs
        if len(log_probs) != len(tokens):
            raise ValueError(f"engine returned {len(log_probs)} log-probs for {len(tokens)} tokens")
        self.response_tokens += tokens
        self.loss_mask += [1] * len(tokens)
        self.rollout_log_probs += [float(x) for x in log_probs]
        self.token_versions += output.token_versions()
        self.weight_versions += output.weight_versions
        if output.routed_experts is not None or self.routed_experts is not None:
            merged = merge_routing(self.routed_experts, output.routed_experts)
            self.routed_experts = pad_routing(merged, len(self.tokens))

    def add_env_turn(self, tokens: Sequence[int]) -> None:
        """Append environment ids (tool results, template glue): mask 0, log-prob ``ENV_LOG_PROB``."""
        self.response_tokens += list(tokens)
        self.loss_mask += [0] * len(tokens)
        self.rollout_log_probs += [ENV_LOG_PROB] * len(tokens)
        self.token_versions += [None] * len(tokens)
        if self.routed_experts is not None:  # the engine has not routed these ids (yet)
            self.routed_experts = pad_routing(self.routed_experts, len(self.tokens))

    def mask_stale_tokens(self) -> None:
        """Mask (loss_mask 0) the model tokens sampled by weights older than the newest version in the trajectory
        (slime's mask-offpolicy-in-partial-rollout, per token); tokens of unknown version stay trained."""
        known = [v for v in self.token_versions if v is not None]
        if not known:
            return
        newest = max(known)
        self.loss_mask = [0 if v is not None and v < newest else m for m, v in zip(self.loss_mask, self.token_versions)]
