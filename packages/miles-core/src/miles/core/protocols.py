"""The narrow seams between Miles packages. Shapes and units are documented here once."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from miles.core.batch import TrainBatch
from miles.core.config import SamplingConfig
from miles.core.sample import Sample

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: token ids in (token-in-token-out: the engine never re-tokenizes).

    Attributes:
        prompt_tokens: prompt ids, chat template already applied; at least one.
        sampling: temperature / top-p / top-k / max new tokens.
        seed: this request's sampling seed: the same seed, prompt, settings and weights give the same response,
            whatever the request is batched with. None = drawn from the engine's own generator state.
        request_id: names the request in the engine (abort, logs) and in its output; a fresh uuid4 hex by default.
        multimodal_inputs: the prompt's image inputs (``miles.core.multimodal``), whose placeholder tokens are in
            ``prompt_tokens``; None for a text-only prompt. Engines that cannot take images refuse them.
        image_data: the same images as base64-encoded image files, one per image in order (what an SGLang-API
            server's ``/generate`` takes as ``image_data`` and processes itself); None for a text-only prompt.
    """

    prompt_tokens: list[int]
    sampling: SamplingConfig
    seed: int | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    multimodal_inputs: dict[str, Any] | None = None
    image_data: list[str] | None = None


@dataclass
class GenerateOutput:
    """What the engine sampled for one request.

    A request interrupted by ``Engine.pause("retract")`` and continued after a weight update is generated in
    segments, one per uninterrupted stretch of decoding; each segment's tokens and log-probs come from the weights
    the engine held while decoding it.

    Attributes:
        response_tokens: sampled ids, the stop token included when finish_reason is "stop".
        log_probs: one float (nats) per response token: log softmax(logits / temperature) of the sampled token,
            before top-p/top-k truncation, under the weights that sampled it (the distribution the trainer
            recomputes).
        finish_reason: "stop" (a stop token was sampled), "length" (max_new_tokens reached), "abort" (ended by
            ``pause("abort")``: the response is the partial one sampled so far, possibly empty).
        weight_version: the newest entry of ``weight_versions``; set from it when ``weight_versions`` is given.
        routed_experts: MoE routing decisions for replay (R3); None for dense models.
        request_id: the request's ``request_id``.
        weight_versions: the weight version of each generated segment, oldest first (one entry for a request that
            was never retracted; an entry repeats if weights did not change between two segments). Default
            ``[weight_version]``.
        segment_lengths: response tokens of each segment, aligned with ``weight_versions`` (they sum to
            ``len(response_tokens)``); None when the engine reports the versions only (server engines).
    """

    response_tokens: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0
    routed_experts: Any = field(default=None, repr=False)
    request_id: str = ""
    weight_versions: list[int] = field(default_factory=list)
    segment_lengths: list[int] | None = None

    def __post_init__(self) -> None:
        if self.weight_versions:
            self.weight_version = self.weight_versions[-1]
        else:
            self.weight_versions = [self.weight_version]

    def token_versions(self) -> list[int | None]:
        """The weight version that sampled each response token (``len(response_tokens)`` entries): every token's
        when one version sampled them all or ``segment_lengths`` says where each segment begins; None for each
        token otherwise (server engines report the versions of a continued request, not where they changed)."""
        num = len(self.response_tokens)
        if len(set(self.weight_versions)) == 1:
            return [self.weight_versions[0]] * num
        if self.segment_lengths is None or sum(self.segment_lengths) != num:
            return [None] * num
        return [v for v, length in zip(self.weight_versions, self.segment_lengths) for _ in range(length)]


PauseMode = Literal["abort", "retract", "keep"]


class RequestFailed(ValueError):
    """One generate request failed on its own: the server rejected it, answered malformed or non-finite output, or
    timed out after its retries. Only that request's sample fails (counted in samples/failed); the run goes on."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine (embedded HF model, vLLM or SGLang server behind an adapter), served per request.

    Callers submit requests one at a time, concurrently (``asyncio.gather``); the engine batches them internally
    (continuous batching in servers). Every call is a coroutine, control included: for a server each is an HTTP
    call, and awaiting one leaves the event loop free for the requests in flight. Weight updates go between
    ``pause`` and ``resume``::

        await engine.pause("retract")  # or "abort" / "keep"
        ... load weights v+1 ...; await engine.flush_cache()
        await engine.resume()          # retracted requests continue under v+1
    """

    @property
    def weight_version(self) -> int:
        """Version of the weights the engine holds: 0 before any update, then the publisher's versions."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample a response for one request; returns when it is complete (or aborted).

        While the engine is paused the request is queued and starts after ``resume``.
        Raises: ValueError for an empty prompt; RequestFailed when this request alone failed (server engines);
            whatever the engine raised while generating the request.
        """
        ...

    async def pause(self, mode: PauseMode = "keep") -> list[GenerateOutput]:
        """Stop generating (before a weight update); returns once no batch is running, so weights may change.

        Requests submitted while paused are held until ``resume``. Modes, for the requests already submitted:
            abort: running and queued requests end now: their ``generate`` returns the partial output (tokens
                and log-probs sampled so far, possibly none) with finish_reason "abort". Returns those outputs.
            retract: running requests stop and go back to the front of the queue with what they sampled so far;
                after ``resume`` they continue from there, so their final output spans two segments (two
                ``weight_versions`` if the weights changed). Returns the partial outputs (their ``generate``
                calls stay pending). Queued requests just wait.
            keep: the running batch finishes normally (its requests return), queued requests wait. Returns [].
        Requests that finished (stop token or max length) in the interrupted batch return normally.
        """
        ...

    async def resume(self) -> None:
        """Generate again: held, queued and retracted requests start (under the weights now loaded)."""
        ...

    async def flush_cache(self) -> None:
        """Drop cached prefixes/KV computed with older weights (call between a weight update and ``resume``)."""
        ...

    async def health(self) -> bool:
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


class GroupGenerateFn(Protocol):
    """Turns one prompt into its group of n samples; may run many turns (tools, environments) per sample.

    Returns exactly ``n`` samples with the prompt's ``group_index``, ``label`` and ``metadata``, and ``tokens``,
    ``response_length``, ``loss_mask``, ``rollout_log_probs``, ``status`` (COMPLETED, TRUNCATED, ABORTED, or FAILED
    with ``metadata["failure"]``) and ``weight_versions`` / ``weight_version`` set; rewards are not yet computed.
    ``index`` is set by the caller (the producer numbers samples by the prompt's position in its step).
    ``seeds`` holds one sampling seed per sample, so a sample's response depends only on its seed, the prompt, the
    settings and the weights, not on what else runs.

    It is the one rollout protocol: training (sync and async), evaluation and SFT all run it per prompt through
    the producer (``miles.core.buffer``), which numbers the samples, buffers the groups and reports progress.
    """

    async def __call__(
        self,
        prompt: Sample,
        *,
        n: int,
        sampling: SamplingConfig,
        seeds: Sequence[int],
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
    """Scores one completed sample; returns a finite float (or raises, which marks the sample failed). It may be
    ``async def`` (an async reward-model or judge client): the coroutine is run to completion where it is called
    (``miles.core.rewards.resolve_reward``), also in reward worker processes."""

    def __call__(self, sample: Sample) -> float: ...


class GroupRewardFn(Protocol):
    """``reward.group_path``: the rewards of one prompt's group, from the group as a whole (rank-based, pairwise
    preference, a diversity bonus, a reward model that compares answers).

    Called after every sample's own reward (``RewardFn``) is set, with the group's samples that are not FAILED or
    ABORTED, in sample order; returns one finite float per sample given, which replaces ``sample.reward``. It may
    be ``async def``.
    Raising, or returning the wrong number of values or a non-finite one, fails those samples
    (``metadata["failure_kind"]`` "reward_error").
    """

    def __call__(self, group: list[Sample]) -> list[float]: ...


class SampleHook(Protocol):
    """``rollout.sample_hook_path``: called on every generated sample (not FAILED/ABORTED) before its reward, in the
    trainer process; may edit ``metadata`` (parse a tool trace, tag the answer) or set ``status`` FAILED with
    ``metadata["failure"]``. Raising fails the sample with the error as its reason."""

    def __call__(self, sample: Sample) -> None: ...


class GroupFilter(Protocol):
    """``algorithm.dynamic_sampling.filter_path``: keep (True) or drop (False) one scored group; may return
    ``(keep, reason)``, and dropped groups are then counted per reason (``dynamic_sampling/filtered/<reason>``)."""

    def __call__(self, group: list[Sample]) -> bool | tuple[bool, str]: ...


class BufferFilter(Protocol):
    """``algorithm.buffer_filter_path``: which of a step's scored groups to train on (after dynamic sampling,
    before advantages; every loop mode). Returns a non-empty subset of ``groups`` (the group objects given); the
    rest are counted in ``buffer/filtered_groups``."""

    def __call__(self, groups: list[list[Sample]]) -> list[list[Sample]]: ...


@dataclass(frozen=True)
class DataContext:
    """What a ``data.source_path`` factory builds from.

    Attributes:
        data: the ``data`` section (``miles.rollout.config.DataConfig``: ``task_kwargs``, ``seed``, ...).
        split: "train" (the training prompts) or "eval" (held-out prompts, asked for when ``eval.num_prompts`` > 0).
        seed: ``data.seed`` for "train", ``data.eval_seed`` for "eval".
    """

    data: Any
    split: Literal["train", "eval"]
    seed: int


class DataSourceFactory(Protocol):
    """``data.source_path``: builds the ``DataSource`` of one split."""

    def __call__(self, context: DataContext) -> DataSource: ...


class EvalFn(Protocol):
    """``eval.path``: one evaluation between steps (and before the first, after the last), on the weights just
    published. Gets the loop's ``Components`` (``generate_group``, ``reward_fn``, ``eval_prompts``, ``publisher``) and
    the ``eval`` section; returns flat metrics (``eval/...`` names by convention) merged into the step's record.
    ``miles.core.evaluation.evaluate`` is the built-in one."""

    def __call__(self, components: Any, evaluation: Any) -> dict[str, float]: ...


@dataclass(frozen=True)
class RunContext:
    """What a ``run.hooks`` / ``run.sinks`` factory builds from.

    Attributes:
        run_dir: the run directory (exists; write your files here).
        config: the resolved config as plain JSON (``MilesConfig.model_dump(mode="json")``).
        start_step: the step the run starts from (> 0 when resumed).
    """

    run_dir: Path
    config: dict[str, Any]
    start_step: int = 0


class TrainHooks(Protocol):
    """``run.hooks``: callbacks of the training loop. Each method is optional (only those the object has are
    called), runs in the trainer process, and must not change what is trained.

    - ``on_rollout_end(step, samples)``: a step's samples, scored and filtered, before advantages (``step`` counts
      from 0).
    - ``on_train_step_end(step, metrics)``: after a step's record is complete (``step`` = steps done, as the
      metrics sinks see it).
    - ``on_save(step, path)``: after a checkpoint of ``step`` completed steps was written to ``path``.
    """

    def on_rollout_end(self, step: int, samples: list[Sample]) -> None: ...

    def on_train_step_end(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_save(self, step: int, path: Path) -> None: ...


class TrainBackend(Protocol):
    """A training backend (FSDP2, Megatron-core) holding the policy (reference, teacher, critic) models and their
    optimizers. It runs forward and backward only: the RL objective is given (``PolicyObjective``, built in
    ``miles.core``), so no backend holds an RL formula. Collective methods are called on every rank.

    Optional capabilities, looked up with ``getattr``: ``offload()`` / ``onload()`` (colocation: free accelerator
    memory for the engines between phases), ``disable_adapters()`` (LoRA: the reference is the adapter-disabled
    policy, not a second model).
    """

    @property
    def available_outputs(self) -> frozenset[str]:
        """The ``forward`` outputs this backend can compute (old_log_probs always; ref_log_probs,
        teacher_log_probs, values when it holds the model)."""
        ...

    def forward(self, batch: TrainBatch, *, outputs: Collection[str]) -> TrainBatch:
        """The batch with exactly the requested ``outputs`` set ([B, T] float32; no grad), nothing else computed.
        Raises ValueError naming an output it cannot compute."""
        ...

    def forward_backward(self, batch: TrainBatch, objective: Any, counts: Any) -> dict[str, float]:
        """Accumulate the gradients of ``objective`` (a ``PolicyObjective``; with a critic also its value
        objective) over micro-batches of this rank's rows; ``counts`` (``LossCounts``) are the global loss
        denominators of the optimizer step. Returns metrics reduced over ranks."""
        ...

    def optimizer_step(self) -> dict[str, float]:
        """Apply the accumulated gradients (guarded against NaN/inf), step the LR schedule, zero gradients;
        returns grad_norm, lr, skipped_steps (and the critic's)."""
        ...

    def push_weights(self, version: int) -> None:
        """Send the full weights as update ``version`` from the ranks that hold them (never through the driver);
        raises if the engines rejected it (they keep their previous version)."""
        ...

    def save(self, path: Path) -> None:
        """Write model, optimizer and step into ``path`` (a fresh temp dir; the caller publishes it)."""
        ...

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote."""
        ...


class WeightPublisher(Protocol):
    """Owns the weight version: moves the trainer's weights into the engines as one new version
    (``miles.core.publisher.EnginePublisher`` is the implementation)."""

    @property
    def version(self) -> int:
        """The version the engines hold: 0 before any publish (or the checkpoint's version after a resume)."""
        ...

    def publish(self) -> int:
        """Publish the trainer's current weights as ``version + 1``; returns it. Raises on a failed update, and
        the version stays."""
        ...


class MetricsSink(Protocol):
    """Receives flat ``{name: float}`` metrics per step (DESIGN.md section 9 names)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record one step's metrics (step 0 = before training)."""
        ...

    def close(self) -> None:
        """Flush and release resources."""
        ...
