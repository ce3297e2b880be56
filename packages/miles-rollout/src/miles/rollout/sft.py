"""Supervised fine-tuning data as samples: the response is the reference answer (teacher forcing), and only the
assistant turns of a multi-turn conversation are trained (the loss mask)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles.core.config import SamplingConfig
from miles.core.sample import Sample, SampleStatus


def multi_turn_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], int, list[int]]:
    """Tokenize a conversation; the prompt ends where the first assistant turn starts.

    Each assistant turn's tokens (after the chat template's generation header, up to and including its end-of-turn
    token) get loss mask 1; user/system/tool turns between them get 0.

    Args:
        tokenizer: HF tokenizer with a chat template whose renderings of growing prefixes extend each other.
        messages: chat messages with at least one "assistant" turn.
    Returns: (tokens, prompt_length, loss_mask of len(tokens) - prompt_length).
    Raises: ValueError if there is no assistant turn or the template does not render prefixes consistently.
    """

    def render(upto: int, generation_prompt: bool) -> list[int]:
        if upto == 0:
            return []
        text = tokenizer.apply_chat_template(messages[:upto], add_generation_prompt=generation_prompt, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ValueError(f"an SFT conversation needs an assistant turn; roles are {roles}")
    tokens: list[int] = []
    mask: list[int] = []
    prompt_length = None
    for k, message in enumerate(messages):
        start = render(k, generation_prompt=message["role"] == "assistant")
        end = render(k + 1, generation_prompt=False)
        if end[: len(tokens)] != tokens or start[: len(tokens)] != tokens:
            raise ValueError("the chat template does not render growing prefixes of the conversation consistently")
        if message["role"] == "assistant":
            if prompt_length is None:
                prompt_length = len(start)
            mask += [0] * (len(start) - len(tokens)) + [1] * (len(end) - len(start))
        else:
            mask += [0] * (len(end) - len(tokens))
        tokens = end
    return tokens, prompt_length, mask[prompt_length:]


def reference_answer(sample: Sample) -> str:
    """The answer text of a prompt: ``label["answer"]`` for task entries (reasoning-gym), else ``str(label)``."""
    label = sample.label
    return str(label["answer"]) if isinstance(label, dict) and "answer" in label else str(label)


class SFTRollout:
    """``GroupGenerateFn`` for supervised fine-tuning: no generation; a prompt's messages plus its reference answer
    as the assistant turn become one COMPLETED sample (n copies), trained on assistant tokens only.

    Args:
        tokenizer: the policy's HF tokenizer (chat template).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    async def __call__(self, prompt: Sample, *, n: int, sampling: SamplingConfig, seeds: Sequence[int]) -> list[Sample]:
        """The group of ``prompt``: n identical samples (``sampling`` and ``seeds`` are not used), index 0 .. n-1.
        Raises: ValueError when the chat template cannot render the conversation consistently."""
        messages = prompt.prompt if isinstance(prompt.prompt, list) else [{"role": "user", "content": prompt.prompt}]
        if not any(m["role"] == "assistant" for m in messages):
            messages = [*messages, {"role": "assistant", "content": reference_answer(prompt)}]
        tokens, prompt_length, loss_mask = multi_turn_tokens(self.tokenizer, messages)
        return [
            Sample(
                index=j,
                group_index=prompt.group_index,
                prompt=prompt.prompt,
                label=prompt.label,
                tokens=list(tokens),
                response_length=len(tokens) - prompt_length,
                loss_mask=list(loss_mask),
                status=SampleStatus.COMPLETED,
                metadata=dict(prompt.metadata),
            )
            for j in range(n)
        ]
