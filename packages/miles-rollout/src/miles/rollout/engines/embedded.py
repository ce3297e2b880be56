"""The embedded engine: an in-process HF transformers model that serves requests one by one and batches them.

It is the CPU default and the reference for engine/trainer numerics: log-probs are log softmax(logits / T) of the
sampled token, computed from the same model the trainer holds, before top-p/top-k truncation.

Requests are queued; a worker thread runs them with continuous batching on Llama-family models (``decode``): a
slot KV cache preallocated for the run, each distinct prompt prefilled once and its cache forked to the samples
that share it, finished sequences leaving and queued ones joining between decode steps, and the decode-step
logits giving the log-probs. Other models run in batches of up to ``max_batch_size`` requests with equal sampling
settings through HF ``generate``. Every row samples with its own ``torch.Generator`` (seeded from its request's
seed), so a request's response does not depend on what it was batched with.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import torch
from miles.core.config import SamplingConfig
from miles.core.log_probs import model_response_log_probs, warn_if_slow_bf16
from miles.core.multimodal import (
    MultimodalInputs,
    is_multimodal_config,
    load_policy_model,
    multimodal_forward_kwargs,
    validate_multimodal,
    vision_token_ids,
)
from miles.core.protocols import FinishReason, GenerateOutput, GenerateRequest, PauseMode
from miles.core.routing_replay import NOT_RECORDED, RoutingRecorder, merge_routing, pad_routing, routing_layout
from miles.rollout.engines import adapters, decode
from miles.sync import WeightReceiver
from torch import Tensor

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PAUSE_MODES = ("abort", "retract", "keep")


class WeightsReleasedError(RuntimeError):
    """The engine's weights are released (``release_weights``): it cannot generate or load until ``resume_weights``."""


class EngineLoad(NamedTuple):
    """What the engine holds now: requests in the running batch, requests waiting (queued, held by a pause or
    retracted), and the tokens (prompt + response so far) of both."""

    num_running: int
    num_waiting: int
    num_tokens: int


@dataclass(eq=False)
class _Job:
    """One request inside the engine: its generator and what its earlier segments generated (after a retract)."""

    request: GenerateRequest
    future: concurrent.futures.Future
    generator: torch.Generator
    response_tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    segment_lengths: list[int] = field(default_factory=list)
    routed: np.ndarray | None = None  # [len(context), layers, top_k] int32 MoE routing (R3), when recorded
    started: bool = False
    aborted: bool = False  # by ``EmbeddedEngine.abort``: ends with finish_reason "abort", never retracted

    @property
    def context(self) -> list[int]:
        """Prompt plus the response so far: what the next segment continues."""
        return self.request.prompt_tokens + self.response_tokens

    @property
    def sampling(self) -> SamplingConfig:
        """The request's settings with ``max_new_tokens`` reduced by what earlier segments generated."""
        sampling = self.request.sampling
        if not self.response_tokens:
            return sampling
        return sampling.model_copy(update={"max_new_tokens": sampling.max_new_tokens - len(self.response_tokens)})

    def add_segment(
        self, tokens: list[int], log_probs: list[float], version: int, routed: np.ndarray | None = None
    ) -> None:
        self.routed = merge_routing(self.routed, routed)  # an earlier segment's routing stays as recorded
        self.response_tokens += tokens
        self.log_probs += log_probs
        self.weight_versions.append(version)
        self.segment_lengths.append(len(tokens))

    def output(self, finish_reason: FinishReason) -> GenerateOutput:
        return GenerateOutput(
            response_tokens=list(self.response_tokens),
            log_probs=list(self.log_probs),
            finish_reason=finish_reason,
            request_id=self.request.request_id,
            weight_versions=list(self.weight_versions),
            segment_lengths=list(self.segment_lengths) if self.segment_lengths else None,
            routed_experts=None if self.routed is None else pad_routing(self.routed, len(self.context)),
        )


@dataclass(eq=False)
class _Row:
    """A sequence of the continuous-batching loop: its job, the segment it is sampling and its cache position.

    The row's newest token (``segment_tokens[-1]``) is sampled but not yet in the KV cache; ``position`` is how many
    tokens of the context are (and so the newest token's position).
    """

    job: _Job
    version: int  # the weight version the open segment is sampled with
    position: int = 0
    segment_tokens: list[int] = field(default_factory=list)
    segment_log_probs: list[float] = field(default_factory=list)

    @property
    def budget(self) -> int:
        """Tokens the request may still sample."""
        return self.job.request.sampling.max_new_tokens - len(self.job.response_tokens) - len(self.segment_tokens)

    def close_segment(self) -> None:
        """Move the open segment into the job (a weight version change, a retract, the end)."""
        if self.segment_tokens:
            self.job.add_segment(self.segment_tokens, self.segment_log_probs, self.version)
        self.segment_tokens, self.segment_log_probs = [], []


class EmbeddedEngine:
    """An ``Engine`` over an HF causal LM in this process, batching concurrent requests.

    Args:
        model_path: HF model directory (config.json + safetensors).
        dtype: "fp32", "bf16" or "fp16" for the engine's weights and compute; "auto" is bf16 where this machine has fast
            bf16 (``miles.core.precision``), else fp32.
        max_batch_size: most requests decoded together (the KV cache's slots).
        stop_token_ids: ids that end a response (finish_reason "stop"); default the model's eos ids.
        logprob_mode: "prefill" (default) rescores prompt + response with the trainer's forward (continuous
            batching: each response alone, so the scores do not depend on its batch; fp32 engine and trainer
            log-probs ~1.5e-5 apart on SmolLM2); "decode" keeps the logits of the KV-cached decode steps (what
            server engines return; ~2e-5 apart in fp32) and costs no second pass.
        continuous: run Llama-family models with Miles' continuous-batching loop (``decode``); False, or another
            model, runs batches through HF ``generate``.
        routed_experts: record the experts every MoE router chose for each token (routing replay, R3;
            ``miles.core.routing_replay``): ``GenerateOutput.routed_experts`` [prompt + response tokens, num_layers,
            top_k] int32, -1 for dense layers and the last token. They come from the forward that produced the
            returned log-probs: the rescoring forward in "prefill" mode, the prefill and decode steps of
            ``generate`` in "decode" mode; a continued request keeps each token's routing from its first segment.
            MoE models run through HF ``generate`` (the continuous loop runs dense Llama-family models).
        weight_codec: a ``miles.sync`` codec the weight updates travel with ("identity": exact); a lossy one
            (fp8, mxfp8, nvfp4, int4) also quantizes the weights loaded from ``model_path`` the same way
            (``miles.sync.roundtrip`` of what ``uses_codec`` selects), so that every version the engine samples with
            holds the codec's values: a quantized-weight engine emulated by dequantized weights.
        trust_remote_code: run the model's own code (``auto_map`` in its config.json), as
            ``models.policy.trust_remote_code``.
    Raises: ValueError for an unknown dtype, logprob_mode or weight_codec, max_batch_size < 1, a path without a
        model, or routed_experts for a model without MoE routers.

    With continuous batching, weights may also change between two decode steps of running requests (a
    ``load_weights`` without a pause): their open segments close there, so every token is tagged with the weights
    that sampled it, while the cache keeps the keys and values computed with the old ones (as vLLM does when it
    updates weights under a "keep" pause).

    Requests with ``seed`` None draw their seed from the engine's generator, seeded once from torch's global RNG
    at construction (``torch.manual_seed`` before building makes them reproducible too). Weights change only
    between batches (``load_weights`` waits for a running one); update them between ``pause`` and ``resume`` so
    that no batch starts in the middle of an update and every segment is tagged with the version that made it.

    Beyond the ``Engine`` protocol (for ``miles serve``): ``abort`` ends single requests, ``load`` counts them,
    ``set_weight_version`` sets the version of weights loaded without the receiver, and ``release_weights`` /
    ``resume_weights`` free and re-allocate the parameters' memory.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: Literal["auto", "fp32", "bf16", "fp16"] = "fp32",
        max_batch_size: int = 64,
        stop_token_ids: Sequence[int] | None = None,
        logprob_mode: Literal["prefill", "decode"] = "prefill",
        continuous: bool = True,
        routed_experts: bool = False,
        weight_codec: str = "identity",
        trust_remote_code: bool = False,
    ) -> None:
        from miles.core.precision import resolve_dtype
        from miles.sync import DEFAULT_CODEC_EXCLUDE, get_codec, roundtrip, uses_codec

        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"engine dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
        dtype = resolve_dtype(dtype)
        if logprob_mode not in ("prefill", "decode"):
            raise ValueError(f"logprob_mode must be 'prefill' or 'decode', got {logprob_mode!r}")
        if max_batch_size < 1:
            raise ValueError(f"engine max_batch_size is {max_batch_size}; it must be >= 1")
        codec = get_codec(weight_codec)
        warn_if_slow_bf16(DTYPES[dtype], logger, where="engine.dtype")
        self.model = load_policy_model(model_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code).eval()
        self.model.requires_grad_(False)
        self.weight_codec = codec.name
        with torch.no_grad():  # the loaded weights as the codec carries them, as every later update is
            for name, param in self.model.named_parameters():
                if uses_codec(name, param, codec, DEFAULT_CODEC_EXCLUDE):
                    param.copy_(roundtrip(codec, param))
        if stop_token_ids is None:
            eos = self.model.generation_config.eos_token_id
            stop_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not stop_token_ids:
            raise ValueError(f"model at {model_path} declares no eos token; pass stop_token_ids")
        self.stop_token_ids = list(stop_token_ids)
        self.max_batch_size = max_batch_size
        self.logprob_mode = logprob_mode
        # Weight updates arrive through a miles-sync receiver: applied only once complete, then versioned.
        self.receiver = WeightReceiver(apply_fn=self.load_weights)
        self._seeds = torch.Generator().manual_seed(int(torch.randint(2**62, ())))  # for requests without a seed
        self._model_lock = threading.Lock()  # held by a running batch and by load_weights
        # Scheduler state, guarded by _state: submitted jobs wait in _incoming until the submitting event loop's
        # turn ends (so concurrent submissions batch together), then in _queue until a batch takes them.
        self._state = threading.Condition()
        self._incoming: list[_Job] = []
        self._queue: list[_Job] = []
        self._running: list[_Job] = []
        self._worker: threading.Thread | None = None  # runs while there is work, then exits
        self._paused = False
        self._pause_mode: PauseMode | None = None
        self._interrupt = threading.Event()  # read by the running generate: stop decoding now
        self._interrupted: list[GenerateOutput] = []  # partial outputs of the batch a pause interrupted
        self._row_abort: RowAbort | None = None  # the running batch's per-row abort criterion
        self._released: list[tuple[torch.nn.Parameter, torch.Size]] | None = None  # shapes while released
        self._base_zeroed = False  # re-allocated by resume_weights and not loaded since
        self.routing = routing_layout(self.model) if routed_experts else None
        if routed_experts and self.routing is None:
            raise ValueError(
                f"engine.routed_experts is true but the model at {model_path} has no MoE router to record; "
                "drop --engine.routed-experts for a dense model"
            )
        self.multimodal = is_multimodal_config(self.model.config)  # takes image prompts
        self.vision_token_ids = vision_token_ids(self.model.config)  # never sampled
        # The continuous loop runs text-only Llama-family models; a VLM's prefill needs its images (HF generate).
        self.continuous = continuous and not self.multimodal and decode.supports(self.model) and self.routing is None
        self._cache: decode.SlotKVCache | None = None  # the continuous loop's, while its worker runs
        # Requests started together (a model.generate call; with continuous batching, a prefill wave), newest last,
        # and with continuous batching the rows of each decode step.
        self.batch_sizes: deque[int] = deque(maxlen=10_000)
        self.decode_batch_sizes: deque[int] = deque(maxlen=10_000)

    # -- Engine protocol -------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.receiver.weight_version

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample a response for one request (``Engine.generate``).

        Requests submitted in the same event-loop turn (``asyncio.gather``) are queued together, so they share
        batches.
        Raises: ValueError for an empty prompt, or images for a text-only model or in a malformed layout;
            WeightsReleasedError while the weights are released; the error of a failed batch.
        """
        if not request.prompt_tokens:
            raise ValueError("a generate request has an empty prompt; every request needs at least one token")
        if request.multimodal_inputs is not None:
            if not self.multimodal:
                raise ValueError(
                    f"a generate request carries images but the engine's model ({type(self.model).__name__}) is "
                    "text-only; use a vision-language policy model"
                )
            validate_multimodal(request.multimodal_inputs, where="GenerateRequest.multimodal_inputs")
        with self._state:
            if self._released is not None:
                raise WeightsReleasedError(
                    "the engine's weights are released (release_weights); call resume_weights and load weights "
                    "before generating"
                )
            seed = request.seed if request.seed is not None else int(torch.randint(2**62, (), generator=self._seeds))
            generator = torch.Generator(device=self.model.device).manual_seed(seed)
            job = _Job(request, concurrent.futures.Future(), generator)
            if self.routing is not None:  # unrecorded (-1) until a forward routes it: an abort before that has rows too
                job.routed = np.full((len(request.prompt_tokens), *self.routing.shape), NOT_RECORDED, dtype=np.int32)
            self._incoming.append(job)
        asyncio.get_running_loop().call_soon(self._release)  # after the other submissions of this turn
        return await asyncio.wrap_future(job.future)

    def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Synchronous convenience for scripts and tests: all ``requests`` concurrently, outputs in request order.
        Not for use inside a running event loop (await ``generate`` there).
        """

        async def run() -> list[GenerateOutput]:
            return list(await asyncio.gather(*(self.generate(r) for r in requests)))

        return asyncio.run(run())

    async def pause(self, mode: PauseMode = "keep") -> list[GenerateOutput]:
        """``Engine.pause``: hold new batches and, for abort/retract, stop the running one after its current
        decode step; returns once no batch runs (waiting in a worker thread: the event loop keeps serving the
        requests in flight). Raises: ValueError for an unknown mode."""
        return await asyncio.to_thread(self.pause_now, mode)

    def pause_now(self, mode: PauseMode = "keep", *, hold_new: bool = True) -> list[GenerateOutput]:
        """``pause`` for synchronous callers (scripts, ``close``, tests): blocks until no batch runs.

        ``hold_new``: with abort, a request submitted while the pause waits for the running batch is held until
        ``resume`` (False: aborted too, for ``close``)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._state:
            self._paused = True
            # What abort ends: the requests submitted before the pause. One submitted while it waits for the running
            # batch (an aborted request resubmitted at once) is held until resume, as SGLang holds it.
            waiting = {id(job) for job in self._queue + self._incoming}
            if mode != "keep":
                self._pause_mode = mode
                self._interrupt.set()
            self._state.wait_for(lambda: not self._running)
            self._interrupt.clear()
            self._pause_mode = None
            outputs, self._interrupted = self._interrupted, []
            aborted: list[_Job] = []
            if mode == "abort":
                if not hold_new:
                    waiting |= {id(job) for job in self._queue + self._incoming}
                aborted = [job for job in self._queue + self._incoming if id(job) in waiting]
                self._queue = [job for job in self._queue if id(job) not in waiting]
                self._incoming = [job for job in self._incoming if id(job) not in waiting]
        for job in aborted:  # queued: empty outputs, or the partial ones of retracted requests
            if job.started or job.future.set_running_or_notify_cancel():
                outputs.append(self._finish(job, "abort"))
        if outputs:
            logger.debug("pause(%s): %d requests interrupted", mode, len(outputs))
        return outputs

    async def resume(self) -> None:
        self.resume_now()

    def resume_now(self) -> None:
        """``resume`` for synchronous callers."""
        with self._state:
            self._paused = False
            self._start_worker()

    def close(self) -> None:
        """Stop for good: ``pause("abort")`` (every request ends with finish_reason "abort") and wait for the
        worker thread to exit. Idempotent.

        A run stopped mid-generation (a second Ctrl-C) must not leave the worker in torch's C++ code when the
        interpreter exits: CPython ends a daemon thread that still runs then with ``pthread_exit``, and unwinding it
        through a ``noexcept`` C++ frame calls ``std::terminate`` ("terminate called without an active exception",
        exit status 134 instead of 130).
        """
        with self._state:
            worker = self._worker
        self.pause_now("abort", hold_new=False)
        if worker is not None:
            worker.join()  # pause returned once no batch runs: the thread only frees memory before it ends

    async def flush_cache(self) -> None:
        """No-op: the embedded engine keeps no KV cache between batches."""

    async def health(self) -> bool:
        """True unless the weights are released."""
        return self._released is None

    # -- requests --------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """True between ``pause`` and ``resume``."""
        return self._paused

    def abort(self, request_id: str | None = None) -> int:
        """End the requests named ``request_id`` (None: every request) with finish_reason "abort".

        A waiting request (queued, held by a pause, or retracted) ends now with what it sampled so far (possibly
        nothing); a running one ends after the decode step in progress, keeping the tokens sampled until then,
        while the rest of its batch goes on. Returns how many requests were found; an unknown id is no error.
        """
        with self._state:
            waiting = self._incoming + self._queue
            ended = [job for job in waiting if request_id is None or job.request.request_id == request_id]
            self._incoming = [job for job in self._incoming if job not in ended]
            self._queue = [job for job in self._queue if job not in ended]
            running = [
                (row, job)
                for row, job in enumerate(self._running)
                if not job.aborted and (request_id is None or job.request.request_id == request_id)
            ]
            for row, job in running:
                job.aborted = True
                if self._row_abort is not None:
                    self._row_abort.request(row)
        for job in ended:
            if job.started or job.future.set_running_or_notify_cancel():
                self._finish(job, "abort")
        return len(ended) + len(running)

    def load(self) -> EngineLoad:
        """Requests running and waiting now, and their tokens (a snapshot, for load balancing and tests)."""
        with self._state:
            running = [job for job in self._running if not job.future.done()]  # not yet cleared by the worker
            waiting = self._incoming + self._queue
            return EngineLoad(len(running), len(waiting), sum(len(job.context) for job in running + waiting))

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy (name, tensor) pairs into the model's parameters/buffers, casting to the engine dtype; waits for
        a running batch to end first.

        An update of LoRA adapter tensors (``...lora_A.default.weight``, ``...lora_B.default.weight``: the trainer's
        ``train.lora.sync adapter``) is loaded as adapters the engine applies on top of its base weights
        (``miles.rollout.engines.adapters``); it must hold every adapter and nothing else. HF names of the base
        weights keep working after adapters are added.

        Raises: KeyError naming the first unknown tensor name; ValueError on a shape mismatch or a bad adapter
            update; WeightsReleasedError while the weights are released.
        """
        with self._model_lock, torch.no_grad():
            if self._released is not None:
                raise WeightsReleasedError("cannot load weights while they are released; call resume_weights first")
            named_tensors = iter(named_tensors)
            first = next(named_tensors, None)
            if first is None:
                return
            if adapters.is_adapter_name(first[0]):  # adapter updates are small: taken whole, checked, then loaded
                if self._base_zeroed:
                    raise ValueError(
                        "an adapter update arrived, but the engine's base weights were released and re-allocated "
                        "zero-filled (resume_weights): push the full weights first (train.lora.sync merged)"
                    )
                adapters.apply_adapter_update(self.model, [first, *named_tensors])
                return
            self._base_zeroed = False
            state = self.model.state_dict()
            for name, tensor in itertools.chain([first], named_tensors):
                name = adapters.base_name(state, name)
                if name not in state:
                    raise KeyError(f"weight update names {name!r}, which the engine model does not have")
                target = state[name]
                if target.shape != tensor.shape:
                    raise ValueError(f"weight {name!r}: engine shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
                target.copy_(tensor)

    def set_weight_version(self, version: int) -> None:
        """Set ``weight_version`` for weights loaded with ``load_weights`` (not through ``receiver``, which sets it
        itself); waits for a running batch, so a batch's segments keep the version they started with.

        Raises: ValueError for a negative version.
        """
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        with self._model_lock:
            self.receiver.weight_version = version

    def release_weights(self) -> None:
        """Free the storage of every parameter (buffers, a few KiB, stay); generating and loading raise
        WeightsReleasedError until ``resume_weights``. Idempotent.

        Raises: RuntimeError if requests are running or waiting (end them first: ``pause("abort")``).
        """
        # The model lock first (as resume_weights and a running batch take it): a resume cannot slip in between
        # marking the weights released and freeing them.
        with self._model_lock, torch.no_grad():
            with self._state:
                if self._released is not None:
                    return
                load = self.load()
                if load.num_running or load.num_waiting:
                    raise RuntimeError(
                        f"cannot release the weights with {load.num_running} requests running and "
                        f"{load.num_waiting} waiting; abort them first (pause with mode abort) or let them finish"
                    )
                self._released = []  # from here on generate() refuses new requests
            for param in self.model.parameters():  # tied parameters appear once
                self._released.append((param, param.shape))
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        release_freed_memory()

    def resume_weights(self) -> None:
        """Re-allocate the parameters released by ``release_weights``, zero-filled: the old values are gone, so
        load weights before generating. ``weight_version`` is unchanged. A no-op when nothing is released."""
        with self._model_lock, torch.no_grad():
            if self._released is None:
                return
            for param, shape in self._released:
                param.data = torch.zeros(shape, dtype=param.dtype, device=param.device)
            self._base_zeroed = True  # until weights are pushed: adapters alone would sit on a zero base
            with self._state:
                self._released = None

    # -- scheduling ------------------------------------------------------------------------------
    def _release(self) -> None:
        """Move this turn's submissions into the queue, as one, and make sure the worker runs."""
        with self._state:
            self._queue += self._incoming
            self._incoming = []
            self._start_worker()

    def _start_worker(self) -> None:
        """Start the worker if there is work and none runs; call with ``_state`` held."""
        if self._worker is None and self._queue and not self._paused:
            self._worker = threading.Thread(target=self._work, name="embedded-engine", daemon=True)
            self._worker.start()

    def _next_batch(self) -> list[_Job]:
        """Take up to ``max_batch_size`` queued jobs with the first job's sampling settings, in queue order; call
        with ``_state`` held. Jobs whose caller cancelled them are dropped."""
        sampling = self._queue[0].sampling
        batch = [job for job in self._queue if job.sampling == sampling][: self.max_batch_size]
        self._queue = [job for job in self._queue if job not in batch]
        for job in batch:
            job.started = job.started or job.future.set_running_or_notify_cancel()
        return [job for job in batch if job.started]

    def _work(self) -> None:
        """Worker thread: run batches while jobs are queued and the engine is not paused, then exit."""
        if self.continuous:
            self._work_continuous()
            return
        while True:
            with self._state:
                if self._paused or not self._queue:
                    self._worker = None
                    return
                self._running = batch = self._next_batch()
                self._row_abort = RowAbort()  # abort() flags rows of this batch in it
            try:
                if batch:
                    self._run_batch(batch)
            except Exception as err:  # noqa: BLE001 - the batch's callers get the error; the engine goes on
                logger.warning("a batch of %d requests failed: %r", len(batch), err)
                with self._state:  # none of them is continued
                    self._queue = [job for job in self._queue if job not in batch]
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(err)
            with self._state:
                self._running = []
                self._row_abort = None
                self._state.notify_all()
            release_freed_memory()

    def _run_batch(self, batch: list[_Job]) -> None:
        """Generate one segment for every job; resolve finished jobs, and interrupted ones per the pause mode."""
        with self._model_lock:
            version = self.weight_version
            segments = self._generate_batch(
                [job.context for job in batch],
                batch[0].sampling,
                [job.generator for job in batch],
                row_abort=self._row_abort,
                multimodal=[job.request.multimodal_inputs for job in batch],
            )
        self.batch_sizes.append(len(batch))
        with self._state:
            retract = self._pause_mode == "retract"  # an "abort" finish means a pause interrupted the batch
        finished: list[tuple[_Job, FinishReason]] = []
        retracted: list[_Job] = []
        for job, (tokens, log_probs, finish_reason, routed) in zip(batch, segments):
            job.add_segment(tokens, log_probs, version, routed)
            if finish_reason == "abort" and retract and not job.aborted:
                retracted.append(job)
            else:
                finished.append((job, finish_reason))
        with self._state:  # retracted jobs go back to the front of the queue, to continue after resume
            self._queue = retracted + self._queue
            self._interrupted += [job.output("abort") for job in retracted]
        for job, finish_reason in finished:
            output = self._finish(job, finish_reason)
            if finish_reason == "abort" and not job.aborted:  # cut off by a pause: pause() returns it
                with self._state:
                    self._interrupted.append(output)

    # -- continuous batching ---------------------------------------------------------------------
    def _work_continuous(self) -> None:
        """Worker thread with continuous batching: between decode steps it ends what finished, was aborted or was
        interrupted by a pause, and admits queued requests into free slots; it exits when nothing runs and nothing
        may start, freeing the KV cache."""
        rows: list[_Row] = []
        while True:
            with self._state:
                interrupt = self._pause_mode if self._interrupt.is_set() and rows else None
                admitted = [] if self._paused else self._admit(self.max_batch_size - len(rows))
                if not rows and not admitted:
                    self._running = []
                    self._worker = None
                    self._cache = None
                    self._state.notify_all()
                    break
                self._running = [row.job for row in rows] + admitted
            try:
                if interrupt is not None:
                    self._interrupt_rows(rows, retract=interrupt == "retract")
                    rows = []
                else:
                    rows = self._step(rows, admitted)
            except Exception as err:  # noqa: BLE001 - the running requests' callers get the error; the engine goes on
                jobs = [row.job for row in rows] + admitted
                logger.warning("a decode step of %d requests failed: %r", len(jobs), err)
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(err)
                rows = []
                self._cache = None
        release_freed_memory()

    def _admit(self, num: int) -> list[_Job]:
        """Take up to ``num`` queued jobs, in queue order; call with ``_state`` held. Cancelled ones are dropped."""
        taken, self._queue = self._queue[: max(num, 0)], self._queue[max(num, 0) :]
        for job in taken:
            job.started = job.started or job.future.set_running_or_notify_cancel()
        return [job for job in taken if job.started]

    def _step(self, rows: list[_Row], admitted: list[_Job]) -> list[_Row]:
        """One iteration: end aborted rows, one decode step for the running rows, prefill the admitted jobs (their
        first token), then end the rows that sampled a stop token or used their budget. Returns the rows that run on.
        """
        with self._model_lock:
            version = self.weight_version
            changed = [row for row in rows if row.version != version]
            self._close_segments(changed)  # weights loaded between two steps: a new segment from here
            for row in changed:
                row.version = version
            rows = self._retire(rows, {i: "abort" for i, row in enumerate(rows) if row.job.aborted})
            need = [row.position + row.budget + 1 for row in rows]
            need += [len(job.context) + job.sampling.max_new_tokens for job in admitted]
            if not need:
                return rows
            if self._cache is None:
                self._cache = decode.SlotKVCache(self.model, self.max_batch_size, max(need))
            self._cache.ensure_length(max(need))
            if rows:
                newest = torch.tensor([row.segment_tokens[-1] for row in rows], device=self.model.device)
                positions = torch.tensor([row.position for row in rows], device=self.model.device)
                logits = decode.decode_step(self.model, self._cache, newest, positions)
                for row in rows:
                    row.position += 1
                self._sample(rows, logits)
                self.decode_batch_sizes.append(len(rows))
            if admitted:
                rows = rows + self._prefill(admitted, first_slot=len(rows), version=version)
                self.batch_sizes.append(len(admitted))
            stop_ids = set(self.stop_token_ids)
            ending: dict[int, FinishReason] = {}
            for i, row in enumerate(rows):
                if row.segment_tokens[-1] in stop_ids:
                    ending[i] = "stop"
                elif row.budget == 0:
                    ending[i] = "length"
            return self._retire(rows, ending)

    def _prefill(self, jobs: list[_Job], *, first_slot: int, version: int) -> list[_Row]:
        """Prefill each distinct context once into the slots from ``first_slot`` on, fork its cache to the other
        jobs with that context (the n samples of a prompt), and sample every job's first token."""
        rows = [_Row(job, version, position=len(job.context)) for job in jobs]
        first_of: dict[tuple[int, ...], int] = {}
        logits = []
        for offset, job in enumerate(jobs):
            context = tuple(job.context)
            slot = first_slot + offset
            if context in first_of:
                self._cache.copy_slot(first_of[context], slot, len(context))
                logits.append(logits[first_of[context] - first_slot])
            else:
                first_of[context] = slot
                logits.append(decode.prefill(self.model, self._cache, slot, context))
        self._sample(rows, torch.stack(logits))
        return rows

    def _sample(self, rows: list[_Row], logits: Tensor) -> None:
        """Append one token and its log-prob to each row: row b draws from softmax(top_p(top_k(logits[b] / T)))
        with its own generator; the log-prob is log softmax(logits[b] / T) at the token (untruncated).

        logits: [B, V] in the model's dtype.
        """
        temperature = torch.tensor([row.job.request.sampling.temperature for row in rows], device=logits.device)
        scaled = logits.float() / temperature[:, None]  # [B, V] fp32
        warped = scaled
        for b, row in enumerate(rows):
            warpers = truncation(row.job.request.sampling)
            if warpers:
                if warped is scaled:
                    warped = scaled.clone()
                for warper in warpers:
                    warped[b : b + 1] = warper(None, warped[b : b + 1])
        chosen = sample_rows(warped, [row.job.generator for row in rows])  # [B]
        picked = (scaled.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)).tolist()
        for row, token, log_prob in zip(rows, chosen.tolist(), picked):
            row.segment_tokens.append(token)
            row.segment_log_probs.append(log_prob)

    def _close_segments(self, rows: list[_Row]) -> None:
        """Close the rows' open segments; in "prefill" log-prob mode first rescore them as the trainer would."""
        if self.logprob_mode == "prefill":
            # One sequence per forward, unpadded: the scores must not depend on which rows happen to finish in the
            # same step (that depends on when requests arrived; batched, the numbers moved by ~1e-5 with it).
            for row in rows:
                if row.segment_tokens:
                    score = self.score(
                        [row.job.context], [row.segment_tokens], temperature=row.job.request.sampling.temperature
                    )[0]
                    row.segment_log_probs = score[: len(row.segment_tokens)].tolist()
        for row in rows:
            row.close_segment()

    def _retire(self, rows: list[_Row], ending: dict[int, FinishReason]) -> list[_Row]:
        """End the rows at the indices of ``ending`` with their finish reasons; the last rows move into the freed
        slots, so the rest stay in slots ``0..B-1``. Returns the rows that run on."""
        if not ending:
            return rows
        leaving = [(rows[i], reason) for i, reason in ending.items()]
        self._close_segments([row for row, _ in leaving])
        rows = list(rows)
        for i in sorted(ending, reverse=True):
            last = len(rows) - 1
            if i != last:
                self._cache.copy_slot(last, i, rows[last].position)
                rows[i] = rows[last]
            rows.pop()
        for row, reason in leaving:
            self._finish(row.job, reason)
        return rows

    def _interrupt_rows(self, rows: list[_Row], *, retract: bool) -> None:
        """A pause with mode abort or retract: every running row ends now, keeping what it sampled; retracted ones
        go back to the front of the queue (to continue after resume), the others end with finish_reason "abort"."""
        with self._model_lock:
            self._close_segments(rows)
        retracted = [row.job for row in rows if retract and not row.job.aborted]
        with self._state:
            self._queue = retracted + self._queue
            self._interrupted += [job.output("abort") for job in retracted]
        for row in rows:
            if row.job in retracted:
                continue
            output = self._finish(row.job, "abort")
            if not row.job.aborted:  # cut off by a pause: pause() returns it
                with self._state:
                    self._interrupted.append(output)

    def _finish(self, job: _Job, finish_reason: FinishReason) -> GenerateOutput:
        """Resolve a job's ``generate`` call."""
        output = job.output(finish_reason)
        job.future.set_result(output)
        return output

    # -- sampling --------------------------------------------------------------------------------
    @torch.no_grad()
    def _generate_batch(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        generators: list[torch.Generator],
        *,
        row_abort: RowAbort | None = None,
        multimodal: Sequence[MultimodalInputs | None] | None = None,
    ) -> list[tuple[list[int], list[float], FinishReason, np.ndarray | None]]:
        """One ``model.generate`` over left-padded prompts; row b samples with ``generators[b]`` (and a
        vision-language model sees ``multimodal[b]``, the images whose placeholders are in ``prompts[b]``).

        Decoding stops early, for every row, once ``_interrupt`` is set, and for a single row once ``row_abort``
        flags it. Returns per row (response tokens, log-probs, finish reason, routing): "stop" (stop token kept),
        "length" (``max_new_tokens``), or "abort" (cut off by the interrupt or the row's abort); routing is
        [prompt + response tokens, num_layers, top_k] int32 when the engine records it (``routed_experts``), else
        None.
        """
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        max_len = max(len(p) for p in prompts)
        pad_id = self.stop_token_ids[0]
        # Left padding: every prompt ends at the same column, so new tokens line up.
        input_ids = torch.full((len(prompts), max_len), pad_id, dtype=torch.int64)
        attention_mask = torch.zeros(len(prompts), max_len, dtype=torch.int64)
        for b, prompt in enumerate(prompts):
            input_ids[b, max_len - len(prompt) :] = torch.tensor(prompt)
            attention_mask[b, max_len - len(prompt) :] = 1
        input_ids = input_ids.to(self.model.device)
        images = multimodal_forward_kwargs(self.model, input_ids, multimodal)  # {} for text-only rows
        # Greedy search over RowSampler's one-hot scores: HF's argmax picks exactly the token RowSampler drew, and
        # HF's own warpers and multinomial (which would use the global RNG) never run.
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.stop_token_ids,
            pad_token_id=pad_id,
            return_dict_in_generate=True,
            output_logits=self.logprob_mode == "decode",
        )
        criteria = [Interrupt(self._interrupt)]
        if row_abort is not None:
            row_abort.prompt_width = max_len
            criteria.append(row_abort)
        # decode mode: the routing of generate's own forwards (prefill mode records the rescoring forward below)
        recorder = RoutingRecorder(self.routing) if self.routing is not None and self.logprob_mode == "decode" else None
        with recorder or contextlib.nullcontext():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask.to(self.model.device),
                generation_config=config,
                logits_processor=LogitsProcessorList([RowSampler(sampling, generators, self.vision_token_ids)]),
                stopping_criteria=StoppingCriteriaList(criteria),
                **images,
            )
        decode_calls = recorder.take() if recorder is not None else []
        new_tokens = out.sequences[:, max_len:].cpu()  # [B, S]
        stop = torch.isin(new_tokens, torch.tensor(self.stop_token_ids))
        lengths = [int(hits[0]) + 1 if len(hits) else new_tokens.shape[1] for hits in (row.nonzero() for row in stop)]
        if row_abort is not None:  # an aborted row's later columns are padding (the pad id is a stop id)
            lengths = [min(n, row_abort.cut.get(b, n)) for b, n in enumerate(lengths)]
        responses = [new_tokens[b, :n].tolist() for b, n in enumerate(lengths)]
        routed: list[np.ndarray | None] = [None] * len(prompts)
        if self.logprob_mode == "decode":
            logits = torch.stack(out.logits, dim=1).float().cpu() / sampling.temperature  # [B, S, V], unprocessed
            log_probs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens[..., None]).squeeze(-1)
            if recorder is not None:
                routed = _decode_routing(decode_calls, prompts, lengths, max_len)
        else:
            with RoutingRecorder(self.routing) if self.routing is not None else contextlib.nullcontext() as rescoring:
                log_probs = self.score(prompts, responses, temperature=sampling.temperature, multimodal=multimodal)
            if rescoring is not None:
                routed = _score_routing(rescoring.take(), prompts, responses)
        results: list[tuple[list[int], list[float], FinishReason, np.ndarray | None]] = []
        for b, length in enumerate(lengths):
            if bool(stop[b, length - 1]):
                finish: FinishReason = "stop"
            else:
                finish = "length" if length == sampling.max_new_tokens else "abort"
            results.append((new_tokens[b, :length].tolist(), log_probs[b, :length].tolist(), finish, routed[b]))
        return results

    @torch.no_grad()
    def score(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        *,
        temperature: float,
        multimodal: Sequence[MultimodalInputs | None] | None = None,
    ) -> Tensor:
        """Log-probs of ``responses`` given ``prompts`` (and each row's images, for a vision-language model): one
        right-padded forward pass, the trainer's layout.

        Returns: [B, S] float32 nats on the CPU, S = longest response; zeros past each response.
        """
        num, seq_len = len(prompts), max(len(p) + len(r) for p, r in zip(prompts, responses))
        width = max(1, max(len(r) for r in responses))
        tokens = torch.zeros(num, seq_len, dtype=torch.int64)
        attention_mask = torch.zeros(num, seq_len, dtype=torch.int64)
        for b, (prompt, response) in enumerate(zip(prompts, responses)):
            tokens[b, : len(prompt) + len(response)] = torch.tensor(prompt + response)
            attention_mask[b, : len(prompt) + len(response)] = 1
        device = self.model.device
        log_probs, _ = model_response_log_probs(
            self.model,
            tokens.to(device),
            attention_mask.to(device),
            torch.tensor([len(p) for p in prompts], device=device),
            num_response_columns=width,
            temperature=temperature,
            multimodal=multimodal,
        )
        lengths = torch.tensor([len(r) for r in responses])
        return log_probs.float().cpu() * (torch.arange(width)[None, :] < lengths[:, None])


def _score_routing(calls: list[Tensor], prompts: list[list[int]], responses: list[list[int]]) -> list[np.ndarray]:
    """Per row, the routing ``score``'s one right-padded forward recorded: [len(prompt) + len(response), layers,
    top_k] int32, the last token's -1 (it predicts past the sequence; SGLang does not route it either)."""
    (call,) = calls
    per_row = call.view(len(prompts), -1, *call.shape[1:])  # [B, seq_len, layers, top_k]
    rows = []
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        row = per_row[b, : len(prompt) + len(response)].numpy().copy()
        row[-1] = NOT_RECORDED
        rows.append(row)
    return rows


def _decode_routing(calls: list[Tensor], prompts: list[list[int]], lengths: list[int], width: int) -> list[np.ndarray]:
    """Per row, the routing ``generate`` recorded: the prefill call's ([B * width] tokens, left-padded rows) for the
    prompt, then one decode call per fed-back token ([B] tokens each); [len(prompt) + length, layers, top_k] int32
    with the last token's row -1 (never fed back); only the prompt's rows when nothing was sampled.

    Raises: RuntimeError when the calls do not have that shape (a ``generate`` that prefills in chunks).
    """
    batch = len(prompts)
    if not calls or calls[0].shape[0] != batch * width or any(c.shape[0] != batch for c in calls[1:]):
        raise RuntimeError(
            "routing recorder: generate's forwards were not one prefill of the padded prompts and one token per "
            f"row per step ({[c.shape[0] for c in calls]} tokens for {batch} rows of {width})"
        )
    prefill = calls[0].view(batch, width, *calls[0].shape[1:])
    steps = torch.stack(calls[1:], dim=1) if len(calls) > 1 else prefill[:, :0]  # [B, S - 1, layers, top_k]
    rows = []
    for b, (prompt, length) in enumerate(zip(prompts, lengths)):
        row = prefill[b, width - len(prompt) :].numpy()
        if length > 0:  # (generate samples at least one token; kept for safety) the prompt alone, all of it fed
            row = np.concatenate([row, steps[b, : length - 1].numpy(), np.full_like(row[:1], NOT_RECORDED)])
        rows.append(row)
    return rows


def release_freed_memory() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``); a no-op elsewhere.

    glibc gives every thread its own malloc arena and keeps freed blocks there, so the decode logits a batch freed in
    the worker thread stay resident while the trainer, in the main thread, allocates its own (measured: 1.5 GB
    resident after a 64 x 48-token SmolLM2 batch, 0.9 GB after trimming).
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc():
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def truncation(sampling: SamplingConfig) -> list:
    """HF's top-k then top-p logits warpers for ``sampling`` (HF's order), none when both are off (top_k 0,
    top_p 1.0). Each maps [B, V] float scores to scores with -inf at the excluded tokens."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    warpers = []
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
    return warpers


def sample_rows(logits: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
    """One token per row from softmax(logits[b]), drawn with ``generators[b]`` by inverse transform sampling: the
    first token whose cumulative probability exceeds u ~ U[0, 1) (one ``torch.rand`` of the row's generator).

    A row's draw depends only on its logits and its generator. One ``cumsum`` over the batch replaces a
    ``torch.multinomial`` per row (~8 ms each on a 49k vocabulary here: most of a decode step's sampling time).

    Args:
        logits: [B, V] float32, -inf where a token is excluded (top-k / top-p); every row has a finite entry.
        generators: B generators on ``logits.device``.
    Returns: [B] int64 token ids.
    """
    weights = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)  # [B, V], unnormalized probabilities
    cdf = weights.double().cumsum(dim=-1)  # float64: u * total stays below the total for every u < 1
    u = torch.stack([torch.rand((), generator=g, device=logits.device, dtype=torch.float64) for g in generators])
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]


class RowSampler:
    """A transformers logits processor that samples every row with its own generator.

    Row b's token is drawn from softmax(top_p(top_k(logits / temperature))) (HF's own warpers, in HF's order) with
    ``generators[b]`` (``sample_rows``); the returned scores are -inf everywhere except 0 at the drawn token, so
    greedy search picks it. A row's draws therefore depend only on its generator, never on the other rows of the batch.

    Args:
        sampling: temperature, top_k (0 = off) and top_p (1.0 = off) of the batch.
        generators: one per row, on the model's device.
        banned: token ids never sampled (a VLM's image placeholder and vision markers: a response holding one would
            not match its images), excluded like top-k / top-p truncation: log-probs stay those of the whole
            distribution.
    """

    def __init__(
        self, sampling: SamplingConfig, generators: Sequence[torch.Generator], banned: Sequence[int] = ()
    ) -> None:
        from transformers import LogitsProcessorList, TemperatureLogitsWarper

        self.warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature), *truncation(sampling)])
        self.generators = list(generators)
        self.banned = list(banned)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        """input_ids: [B, L] int64; scores: [B, V] float logits of the next token. Returns [B, V] float32."""
        scores = scores.float()
        if self.banned:
            scores = scores.index_fill(1, torch.tensor(self.banned, device=scores.device), float("-inf"))
        warped = self.warpers(input_ids, scores)  # [B, V]
        tokens = sample_rows(warped, self.generators)
        chosen = torch.full_like(warped, float("-inf"))
        return chosen.scatter_(1, tokens[:, None], 0.0)


class Interrupt:
    """A transformers stopping criterion that stops every row once ``event`` is set (``EmbeddedEngine.pause``):
    the running ``generate`` returns after the decode step in progress, with the tokens sampled so far."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: object) -> Tensor:
        """input_ids: [B, L] int64. Returns [B] bool, all ``event.is_set()``."""
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class RowAbort:
    """A transformers stopping criterion that stops single rows of a batch (``EmbeddedEngine.abort``).

    ``request(row)`` may be called from any thread; at the next decode step the row is stopped (``generate`` pads
    it from then on) and ``cut[row]`` records how many tokens it had sampled, the rest of the batch going on.
    """

    def __init__(self) -> None:
        self.prompt_width = 0  # columns of the left-padded prompts, set before generate
        self.cut: dict[int, int] = {}  # row -> response tokens it keeps
        self._requested: set[int] = set()
        self._lock = threading.Lock()

    def request(self, row: int) -> None:
        with self._lock:
            self._requested.add(row)

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: object) -> Tensor:
        """input_ids: [B, L] int64, prompt and tokens so far. Returns [B] bool, True for the aborted rows."""
        with self._lock:
            rows = sorted(self._requested)
        for row in rows:
            self.cut.setdefault(row, input_ids.shape[1] - self.prompt_width)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[rows] = True
        return done.to(input_ids.device)
