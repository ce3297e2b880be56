"""The narrow seams between Miles packages. Shapes and units are documented here once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from miles.core.batch import TrainBatch
from miles.core.config import SamplingConfig
from miles.core.sample import Sample
from torch import Tensor

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: token ids in (token-in-token-out: the engine never re-tokenizes).

    Attributes:
        prompt_tokens: prompt ids, chat template already applied.
        sampling: temperature / top-p / top-k / max new tokens.
        seed: per-request sampling seed; None = engine's generator state.
    """

    prompt_tokens: list[int]
    sampling: SamplingConfig
    seed: int | None = None


@dataclass
class GenerateOutput:
    """What the engine sampled for one request.

    Attributes:
        response_tokens: sampled ids, the stop token included when finish_reason is "stop".
        log_probs: one float (nats) per response token: log softmax(logits / temperature) of the sampled token,
            before top-p/top-k truncation, i.e. the distribution the trainer recomputes.
        finish_reason: "stop" (a stop token was sampled), "length" (max_new_tokens reached), "abort".
        weight_version: version of the weights that generated it.
        routed_experts: MoE routing decisions for replay (R3); None for dense models.
    """

    response_tokens: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0
    routed_experts: Any = field(default=None, repr=False)


@runtime_checkable
class Engine(Protocol):
    """An inference engine (embedded HF model, vLLM or SGLang server behind an adapter)."""

    @property
    def weight_version(self) -> int:
        """Version of the weights the engine holds: 0 before any update, then the pusher's versions."""
        ...

    def generate(
        self, requests: Sequence[GenerateRequest], *, on_finished: Callable[[int], None] | None = None
    ) -> list[GenerateOutput]:
        """One output per request, in request order. Raises RuntimeError while paused.

        ``on_finished``, for progress display only, is called with the number of requests whose response just
        finished, as they finish; the counts sum to ``len(requests)``. Callers pass it only when they show
        progress, so an engine that is never given one may leave it out.
        """
        ...

    def pause(self) -> None:
        """Stop accepting generation (before a weight update); in-flight work is finished or aborted."""
        ...

    def resume(self) -> None:
        """Accept generation again."""
        ...

    def flush_cache(self) -> None:
        """Drop cached prefixes/KV computed with older weights."""
        ...

    def health(self) -> bool:
        """True when the engine can serve requests."""
        ...


class DataSource(Protocol):
    """Yields prompts as pending ``Sample``s (prompt, label, metadata set); resumable through its state."""

    def next_prompts(self, num: int) -> list[Sample]:
        """The next ``num`` prompts; ``group_index`` counts prompts over the whole run."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position (epoch, index, seed) for checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state_dict`` was taken. Raises ValueError for another data set's state."""
        ...


class RolloutFn(Protocol):
    """Turns prompts into completed samples: n per prompt, sharing the prompt's ``group_index``.

    Returned samples have ``tokens``, ``response_length``, ``rollout_log_probs``, ``status`` (COMPLETED or
    TRUNCATED) and ``weight_version`` set; rewards are not yet computed.

    ``on_finished``, for progress display only, is called with the number of samples that just finished
    (generated, or failed before generation), as they finish; the counts sum to the number of samples returned.
    The loop passes it only when ``Components.progress`` is set, so a rollout function used without one may leave
    it out. It must not change what is sampled.
    """

    def __call__(
        self,
        prompts: Sequence[Sample],
        *,
        n_samples_per_prompt: int,
        sampling: SamplingConfig,
        seed: int,
        on_finished: Callable[[int], None] | None = None,
    ) -> list[Sample]: ...


class ProgressBar(Protocol):
    """A progress display over a known number of items (a ``tqdm`` bar is one)."""

    def update(self, n: int) -> None:
        """Count ``n`` more items as done."""
        ...

    def close(self) -> None:
        """Remove (or finish) the display."""
        ...


class RewardFn(Protocol):
    """Scores one completed sample; returns a finite float (or raises, which marks the sample failed)."""

    def __call__(self, sample: Sample) -> float: ...


class TrainBackend(Protocol):
    """A training backend (FSDP2, Megatron-core) holding the policy (and reference) model and optimizer."""

    def compute_log_probs(self, batch: TrainBatch) -> TrainBatch:
        """Return the batch with ``old_log_probs`` (and ``ref_log_probs`` if a reference is held) set."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over the whole batch (micro-batched inside); returns metrics."""
        ...

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full (unsharded) weights as (HF name, tensor) pairs, for the engines."""
        ...

    def save(self, path: Path) -> None:
        """Write model, optimizer and step into ``path`` (a fresh temp dir; the caller publishes it)."""
        ...

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote."""
        ...


class WeightPusher(Protocol):
    """Pushes named tensors to the engines (a ``miles.sync.WeightSender``); returns the new weight version."""

    def push(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Send a complete update; returns its version (strictly increasing). Raises on a failed update."""
        ...


class MetricsSink(Protocol):
    """Receives flat ``{name: float}`` metrics per step (DESIGN.md section 9 names)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record one step's metrics (step 0 = before training)."""
        ...

    def close(self) -> None:
        """Flush and release resources."""
        ...
