"""One trajectory (``Sample``) and its lifecycle status; field names follow slime so users feel at home."""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class SampleStatus(enum.StrEnum):
    """Where a sample is in its life. ``TRUNCATED`` = the engine stopped at max length, not at a stop token.
    ``ABORTED`` = its generation was cut off (``Engine.pause("abort")``, e.g. for a weight update): neither scored
    nor trained, and not counted as failed (nothing went wrong with it). ``FAILED`` = bad input, engine output or
    reward (``metadata["failure"]`` says which); counted in ``samples/failed``."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One trajectory: a prompt and one sampled response, with everything the trainer needs from the rollout.

    Plain data: it pickles (to Ray actors, buffers on disk) as long as ``label`` and ``metadata`` do.

    Attributes:
        index: position of this sample in its rollout batch.
        group_index: index of the prompt; the ``n_samples_per_prompt`` samples of one prompt share it.
        prompt: the prompt as text, chat messages (``[{"role": ..., "content": ...}]``; a multimodal message's
            content is a list of parts, ``{"type": "image"}`` / ``{"type": "text", "text": ...}``) or token ids.
        label: the reference answer (or a task entry) the reward function scores against.
        tokens: prompt + response token ids; the response is the last ``response_length`` ids.
        response_length: number of response tokens, tool/environment tokens included.
        loss_mask: ``response_length`` ints, 1 = trained, 0 = tool/environment output; None = all 1.
        rollout_log_probs: ``response_length`` float nats, log-prob of each response token under the engine
            at sampling time (temperature-scaled, before top-p/top-k truncation).
        reward: scalar reward, or a dict of named rewards; None until scored.
        status: lifecycle status, see ``SampleStatus``.
        weight_version: the newest weight version its tokens came from (``weight_versions[-1]``; 0 before
            generation); kept for code that reads one version.
        weight_versions: every weight version its tokens came from, one per generated segment, oldest first:
            one entry, or several for a partial rollout continued after a weight update (``pause("retract")``);
            staleness is measured from the oldest. Empty before generation.
        token_versions: ``response_length`` entries: the weight version that sampled each response token, None
            for a tool/environment token; None as a whole where no token's version is known (a server engine's
            partial rollout: it reports the versions, not where they changed) and before generation.
        rollout_routed_experts: MoE experts chosen at rollout, for routing replay (R3); None for dense models.
        multimodal_inputs: the processor's image inputs for ``tokens`` (``miles.core.multimodal``: ``pixel_values``
            [P, D] float32, ``image_grid_thw`` [I, 3] int64; Idefics3 / SmolVLM: ``pixel_values`` [N, C, H, W]
            float32, ``pixel_attention_mask`` [N, H, W] bool), produced once at rollout and given unchanged to the
            engine and the trainer; None for a text-only sample.
        teacher_log_probs: per response token, from a teacher model (on-policy distillation); else None.
        response_text: the response decoded by the policy's tokenizer (special tokens skipped), what rewards
            score; set by the rollout function, None before generation, for a failed sample and for token-only
            rollouts (no tokenizer).
        metadata: free-form extras (task entry, failure reason, ...).
    """

    index: int
    group_index: int
    prompt: str | list[dict[str, Any]] | list[int]
    label: Any = None
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    reward: float | dict[str, float] | None = None
    status: SampleStatus = SampleStatus.PENDING
    weight_version: int = 0
    weight_versions: list[int] = field(default_factory=list)
    token_versions: list[int | None] | None = None
    rollout_routed_experts: Any = None
    multimodal_inputs: dict[str, Any] | None = None
    teacher_log_probs: list[float] | None = None
    response_text: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens at the start of ``tokens``."""
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        """The last ``response_length`` token ids."""
        return self.tokens[self.prompt_length :]


def group_samples(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Split samples into groups by ``group_index``, groups in first-seen order, samples in input order."""
    groups: dict[int, list[Sample]] = defaultdict(list)
    for sample in samples:
        groups[sample.group_index].append(sample)
    return list(groups.values())
