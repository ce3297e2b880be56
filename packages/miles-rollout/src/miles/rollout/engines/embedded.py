"""The embedded engine: an in-process HF transformers model that samples batches with per-token log-probs.

It is the CPU default and the reference for engine/trainer numerics: log-probs are log softmax(logits / T) of the
sampled token, computed from the same model the trainer holds, before top-p/top-k truncation.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Literal

import torch
from miles.core.config import SamplingConfig
from miles.core.log_probs import model_response_log_probs, warn_if_slow_bf16
from miles.core.protocols import GenerateOutput, GenerateRequest
from miles.sync import WeightReceiver
from torch import Tensor

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class EmbeddedEngine:
    """Batched sampling with an HF causal LM in this process.

    Args:
        model_path: HF model directory (config.json + safetensors).
        dtype: "fp32" or "bf16" for the engine's weights and compute.
        max_batch_size: sequences per ``generate`` call; larger requests are chunked.
        stop_token_ids: ids that end a response (finish_reason "stop"); default the model's eos ids.
        logprob_mode: "prefill" (default) rescores prompt + response in one right-padded forward pass, the
            computation the trainer does, so fp32 engine and trainer log-probs agree to ~1e-6; "decode" keeps
            the logits of the KV-cached decode steps (what server engines return; ~3e-5 apart in fp32).
    Raises: ValueError for an unknown dtype or a path without a model.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: Literal["fp32", "bf16"] = "fp32",
        max_batch_size: int = 64,
        stop_token_ids: Sequence[int] | None = None,
        logprob_mode: Literal["prefill", "decode"] = "prefill",
    ) -> None:
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"engine dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        warn_if_slow_bf16(DTYPES[dtype], logger, where="engine.dtype")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).eval()
        self.model.requires_grad_(False)
        if stop_token_ids is None:
            eos = self.model.generation_config.eos_token_id
            stop_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not stop_token_ids:
            raise ValueError(f"model at {model_path} declares no eos token; pass stop_token_ids")
        self.stop_token_ids = list(stop_token_ids)
        self.max_batch_size = max_batch_size
        if logprob_mode not in ("prefill", "decode"):
            raise ValueError(f"logprob_mode must be 'prefill' or 'decode', got {logprob_mode!r}")
        self.logprob_mode = logprob_mode
        # Weight updates arrive through a miles-sync receiver: applied only once complete, then versioned.
        self.receiver = WeightReceiver(apply_fn=self.load_weights)
        self._paused = threading.Event()
        self._lock = threading.Lock()

    # -- Engine protocol -------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.receiver.weight_version

    def generate(
        self, requests: Sequence[GenerateRequest], *, on_finished: Callable[[int], None] | None = None
    ) -> list[GenerateOutput]:
        """Sample a response for each request; requests with equal sampling settings are batched together.

        Args:
            requests: the generations to run.
            on_finished: called from inside the decode loop with the number of sequences that just sampled a stop
                token, and after each batch with the number that hit ``max_new_tokens``; for progress display, it
                changes nothing that is sampled.
        Raises: RuntimeError if the engine is paused.
        """
        if self._paused.is_set():
            raise RuntimeError("engine is paused (a weight update is in progress); call resume() first")
        outputs: list[GenerateOutput | None] = [None] * len(requests)
        by_sampling: dict[SamplingConfig, list[int]] = {}
        for i, request in enumerate(requests):
            by_sampling.setdefault(request.sampling, []).append(i)
        with self._lock:
            for sampling, indices in by_sampling.items():
                for start in range(0, len(indices), self.max_batch_size):
                    chunk = indices[start : start + self.max_batch_size]
                    seed = requests[chunk[0]].seed
                    prompts = [requests[i].prompt_tokens for i in chunk]
                    results = self._generate_batch(prompts, sampling, seed, on_finished=on_finished)
                    for i, result in zip(chunk, results):
                        outputs[i] = result
        return outputs  # type: ignore[return-value]

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def flush_cache(self) -> None:
        """No-op: the embedded engine keeps no KV cache between calls."""

    def health(self) -> bool:
        return True

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy (name, tensor) pairs into the model's parameters/buffers, casting to the engine dtype.

        Raises: KeyError naming the first unknown tensor name; ValueError on a shape mismatch.
        """
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in state:
                    raise KeyError(f"weight update names {name!r}, which the engine model does not have")
                target = state[name]
                if target.shape != tensor.shape:
                    raise ValueError(f"weight {name!r}: engine shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
                target.copy_(tensor)

    # -- sampling --------------------------------------------------------------------------------
    @torch.no_grad()
    def _generate_batch(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seed: int | None,
        *,
        on_finished: Callable[[int], None] | None = None,
    ) -> list[GenerateOutput]:
        from transformers import GenerationConfig, StoppingCriteriaList

        if any(len(p) == 0 for p in prompts):
            raise ValueError("a generate request has an empty prompt; every request needs at least one token")
        max_len = max(len(p) for p in prompts)
        pad_id = self.stop_token_ids[0]
        # Left padding: every prompt ends at the same column, so new tokens line up.
        input_ids = torch.full((len(prompts), max_len), pad_id, dtype=torch.int64)
        attention_mask = torch.zeros(len(prompts), max_len, dtype=torch.int64)
        for b, prompt in enumerate(prompts):
            input_ids[b, max_len - len(prompt) :] = torch.tensor(prompt)
            attention_mask[b, max_len - len(prompt) :] = 1
        config = GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0 disables (HF's default would be 50)
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.stop_token_ids,
            pad_token_id=pad_id,
            return_dict_in_generate=True,
            output_logits=self.logprob_mode == "decode",
        )
        counter = StopCounter(self.stop_token_ids, on_finished) if on_finished is not None else None
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([counter] if counter is not None else []),
            )
        if counter is not None:  # the rest ran to max_new_tokens
            on_finished(len(prompts) - counter.num_stopped)
        new_tokens = out.sequences[:, max_len:]  # [B, S]
        stop = torch.isin(new_tokens, torch.tensor(self.stop_token_ids))
        lengths = [int(hits[0]) + 1 if len(hits) else new_tokens.shape[1] for hits in (row.nonzero() for row in stop)]
        if self.logprob_mode == "decode":
            logits = torch.stack(out.logits, dim=1).float() / sampling.temperature  # [B, S, V], unprocessed
            log_probs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens[..., None]).squeeze(-1)
        else:
            responses = [new_tokens[b, :n].tolist() for b, n in enumerate(lengths)]
            log_probs = self.score(prompts, responses, temperature=sampling.temperature)
        results = []
        for b, length in enumerate(lengths):
            results.append(
                GenerateOutput(
                    response_tokens=new_tokens[b, :length].tolist(),
                    log_probs=log_probs[b, :length].tolist(),
                    finish_reason="stop" if bool(stop[b, length - 1]) else "length",
                    weight_version=self.weight_version,
                )
            )
        return results

    @torch.no_grad()
    def score(self, prompts: list[list[int]], responses: list[list[int]], *, temperature: float) -> Tensor:
        """Log-probs of ``responses`` given ``prompts``: one right-padded forward pass, the trainer's layout.

        Returns: [B, S] float32 nats, S = longest response; zeros past each response.
        """
        num, seq_len = len(prompts), max(len(p) + len(r) for p, r in zip(prompts, responses))
        width = max(1, max(len(r) for r in responses))
        tokens = torch.zeros(num, seq_len, dtype=torch.int64)
        attention_mask = torch.zeros(num, seq_len, dtype=torch.int64)
        for b, (prompt, response) in enumerate(zip(prompts, responses)):
            tokens[b, : len(prompt) + len(response)] = torch.tensor(prompt + response)
            attention_mask[b, : len(prompt) + len(response)] = 1
        log_probs, _ = model_response_log_probs(
            self.model,
            tokens,
            attention_mask,
            torch.tensor([len(p) for p in prompts]),
            num_response_columns=width,
            temperature=temperature,
        )
        lengths = torch.tensor([len(r) for r in responses])
        return log_probs * (torch.arange(width)[None, :] < lengths[:, None])


class StopCounter:
    """A transformers stopping criterion that stops nothing: it counts the sequences that just sampled a stop token
    and reports them to ``on_finished``, so progress shows inside one batched ``model.generate`` call.

    It returns all False, so ``generate`` stops, samples and pads exactly as without it. Once a sequence has
    stopped, ``generate`` pads it with ``pad_token_id`` (a stop token here): ``stopped`` keeps it from counting twice.
    It has no ``eos_token_id`` attribute on purpose: transformers reads one as "an EOS criterion is present".
    """

    def __init__(self, stop_token_ids: Sequence[int], on_finished: Callable[[int], None]) -> None:
        self.stop_token_ids = torch.tensor(list(stop_token_ids))
        self.on_finished = on_finished
        self.stopped: Tensor | None = None  # [B] bool, set on the first decode step

    @property
    def num_stopped(self) -> int:
        """Sequences that have sampled a stop token so far."""
        return 0 if self.stopped is None else int(self.stopped.sum())

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: object) -> Tensor:
        """input_ids: [B, L] int64, prompt and tokens so far (the newest last). Returns [B] bool, all False."""
        hit = torch.isin(input_ids[:, -1], self.stop_token_ids.to(input_ids.device))  # [B]
        if self.stopped is None:
            self.stopped = torch.zeros_like(hit)
        num_new = int((hit & ~self.stopped).sum())  # host sync, once per decode step: generate syncs there too
        self.stopped |= hit
        if num_new:
            self.on_finished(num_new)
        return torch.zeros_like(hit)
