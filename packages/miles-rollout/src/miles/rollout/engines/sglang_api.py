"""SGLang's native ``/generate`` wire format, both ways: Miles requests to SGLang bodies and answers back
(``SGLangEngine``), SGLang bodies to Miles requests and outputs to answers (``miles serve``).

Field names and semantics follow sgl-project/sglang ``managers/io_struct.py::GenerateReqInput`` (001067f),
``sampling/sampling_params.py::SamplingParams`` (00c17ca) and the answer slime's ``rollout/sglang_rollout.py``
reads: tokens and log-probs from ``meta_info.output_token_logprobs`` as ``[log_prob, token_id, text]``, the finish
reason from ``meta_info.finish_reason.type`` ("stop" / "length" / "abort"), the weight version, a string, from
``meta_info.weight_version``, and with ``return_routed_experts`` (a server started with
``--enable-return-routed-experts``) ``meta_info.routed_experts``: base64 of int32 expert ids, one
``[num_layers, top_k]`` block per token of prompt + response but the last (SGLang's ``RoutedExpertsCapturer``, PR
12162; slime decodes it the same way). SGLang's sampling: temperature 0 is greedy (temperature 1, top_k 1); top_k -1 is
off and 0 invalid (Miles: 0 is off); max_new_tokens defaults to 128; ``sampling_seed`` seeds one request.
"""

from __future__ import annotations

import base64
import binascii
import math
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from miles.core.config import SamplingConfig
from miles.core.protocols import FinishReason, GenerateOutput, GenerateRequest

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k
FINISH_REASONS = ("stop", "length", "abort")

# GenerateReqInput fields miles serve does not implement, with the values that mean "not used" (None: any value
# is fine, the field changes nothing here: metrics, tracing, routing hints).
GENERATE_NEUTRAL: dict[str, tuple[Any, ...] | None] = {
    "input_embeds": (None,), "video_data": (None,), "audio_data": (None,),
    "logprob_start_len": (None, -1), "top_logprobs_num": (None, 0), "token_ids_logprob": (None,),
    "return_text_in_logprobs": (False,), "stream": (False, None), "return_hidden_states": (False,),
    "modalities": (None,), "session_params": (None,),
    "lora_id": (None,), "custom_logit_processor": (None,), "bootstrap_host": (None,), "bootstrap_port": (None,),
    "bootstrap_room": (None,), "data_parallel_rank": (None, 0), "routed_dp_rank": (None, 0), "extra_key": (None,),
    "cache_salt": (None,), "background": (False,), "return_entropy": (False,),
    "model": (None,), "return_bytes": (False,),  # sglang-router 0.3.2 adds both to every request it forwards
    "log_metrics": None, "no_logs": None, "custom_labels": None, "received_time": None, "priority": None,
    "external_trace_header": None, "conversation_id": None, "routing_key": None, "session_id": None,
    "http_worker_ipc": None,
}  # fmt: skip
# SamplingParams fields likewise (the text-only ones change no token).
SAMPLING_NEUTRAL: dict[str, tuple[Any, ...] | None] = {
    "min_p": (None, 0.0), "frequency_penalty": (None, 0.0), "presence_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0), "min_new_tokens": (None, 0), "n": (None, 1), "json_schema": (None,),
    "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "ignore_eos": (None, False), "stop": (None, "", []),
    "stop_regex": (None, "", []), "custom_params": (None,), "logit_bias": (None,),
    "skip_special_tokens": None, "spaces_between_special_tokens": None, "no_stop_trim": None, "stream_interval": None,
}  # fmt: skip


# -- client side: Miles -> SGLang -> Miles ---------------------------------------------------------
def generate_payload(
    request: GenerateRequest,
    *,
    stop_token_ids: Sequence[int] | None,
    return_routed_experts: bool = False,
    lora_path: str | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body for ``request``: token ids in, log-probs requested, ``rid`` = ``request_id``; with
    ``return_routed_experts`` the MoE experts each token was routed to (routing replay, R3); with ``lora_path`` the
    name of the loaded LoRA adapter to apply (SGLang's field takes a loaded adapter's name). A prompt with images
    sends them as ``image_data`` (base64 image files, in order) beside ``input_ids`` that already hold each image's
    expanded placeholders (SGLang's token-in-token-out VLM usage): the server runs its own image processor on them.

    Raises: ValueError for a request with image inputs but no ``image_data`` (nothing the server could process)."""
    if request.multimodal_inputs is not None and not request.image_data:
        raise ValueError(
            "the request has image inputs but no image_data (the images as base64 files) for the SGLang server to "
            "process; build image requests with miles.rollout.generate"
        )
    sampling = request.sampling
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k or -1,  # Miles 0 = off; SGLang -1 = off (0 is invalid there)
        "max_new_tokens": sampling.max_new_tokens,
    }
    if request.seed is not None:  # only then: an SGLang from before sampling_seed rejects the unknown key
        params["sampling_seed"] = request.seed
    if stop_token_ids is not None:
        params["stop_token_ids"] = list(stop_token_ids)
    body = {
        "input_ids": list(request.prompt_tokens),
        "sampling_params": params,
        "return_logprob": True,
        "rid": request.request_id,
        "stream": False,
    }
    if return_routed_experts:  # only then: a server without the capturer rejects the flag
        body["return_routed_experts"] = True
    if lora_path is not None:
        body["lora_path"] = lora_path
    if request.multimodal_inputs is not None:
        body["image_data"] = list(request.image_data)
    return body


def decode_routed_experts(encoded: Any, *, num_tokens: int, shape: tuple[int, int], where: str) -> np.ndarray:
    """SGLang's ``meta_info.routed_experts`` -> ``[num_tokens, num_layers, top_k]`` int32 expert ids.

    SGLang routes every token it runs through the model: the prompt and every sampled token but the last (which is
    never fed back), so it sends ``num_tokens - 1`` blocks. The last row is filled with -1, "no recorded routing":
    the trainer's router picks that token's experts itself (its logits predict past the sequence, so they are in
    no loss).

    Args:
        encoded: base64 of ``(num_tokens - 1) * num_layers * top_k`` little-endian int32 values.
        num_tokens: prompt + response tokens of the sample.
        shape: (num_layers, top_k) of the model (every layer, as SGLang captures them).
        where: names the answer in errors.
    Raises: ValueError (one line naming the request) when it is missing, not base64, or not that many values.
    """
    if not isinstance(encoded, str):
        raise ValueError(
            f"{where} has no meta_info.routed_experts string; start SGLang with --enable-return-routed-experts "
            "(engine.routed_experts true adds it to the servers Miles starts)"
        )
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where} has meta_info.routed_experts that is not base64") from None
    layers, top_k = shape
    expected = (num_tokens - 1) * layers * top_k
    if len(raw) != 4 * expected:
        raise ValueError(
            f"{where} has {len(raw) // 4} routed-expert ids; expected (tokens - 1) x layers x top_k = "
            f"{num_tokens - 1} x {layers} x {top_k} = {expected} (is engine.routed_experts' model the served one?)"
        )
    routed = np.full((num_tokens, layers, top_k), -1, dtype=np.int32)
    routed[: num_tokens - 1] = np.frombuffer(raw, dtype="<i4").reshape(num_tokens - 1, layers, top_k)
    return routed


def parse_generate_response(
    body: Any, request: GenerateRequest, *, routed_experts_shape: tuple[int, int] | None = None
) -> GenerateOutput:
    """An SGLang ``/generate`` answer -> ``GenerateOutput`` for ``request``; with ``routed_experts_shape`` (num_layers,
    top_k) also its ``routed_experts`` ([prompt + response tokens, num_layers, top_k] int32, see
    ``decode_routed_experts``).

    Raises: ValueError (naming the request id) for a malformed answer or a null / non-finite log-prob.
    """
    where = f"SGLang /generate answer for request {request.request_id}"
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise ValueError(f"{where} has no meta_info object")
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if finish_type not in FINISH_REASONS:
        raise ValueError(f"{where} has finish_reason {finish!r}; expected type stop, length or abort")
    entries = meta.get("output_token_logprobs")
    if entries is None and finish_type == "abort" and not body.get("output_ids"):
        entries = []  # aborted before its first token: SGLang may leave the list out
    if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) >= 2 for e in entries):
        raise ValueError(f"{where} has no meta_info.output_token_logprobs list of [log_prob, token_id, text]")
    tokens = [entry[1] for entry in entries]
    log_probs = [entry[0] for entry in entries]
    if not all(_is_int(t) for t in tokens):
        raise ValueError(f"{where} has non-integer token ids in output_token_logprobs")
    if not all(_is_number(lp) and math.isfinite(lp) for lp in log_probs):
        raise ValueError(f"{where} has a null or non-finite log-prob (NaN/inf logits); the sample cannot be trained")
    completion = meta.get("completion_tokens")
    if completion is not None and completion != len(tokens):
        raise ValueError(f"{where} says completion_tokens={completion} but carries {len(tokens)} log-probs")
    if finish_type == "stop" and not tokens:
        raise ValueError(f"{where} finished with 'stop' but has no tokens")
    try:
        version = parse_weight_version(meta.get("weight_version"))
        versions = [version]
        if isinstance(meta.get("miles_weight_versions"), list):  # miles serve: every segment's version
            versions = [parse_weight_version(v) for v in meta["miles_weight_versions"]] or [version]
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    segments = meta.get("miles_segment_lengths")
    if segments is not None and (
        not isinstance(segments, list)
        or not all(_is_int(n) and n >= 0 for n in segments)
        or len(segments) != len(versions)
        or sum(segments) != len(tokens)
    ):
        raise ValueError(
            f"{where} has miles_segment_lengths {segments!r}, which do not split its {len(tokens)} tokens over its "
            f"{len(versions)} weight versions"
        )
    routed = None
    if routed_experts_shape is not None and finish_type == "abort" and not tokens and "routed_experts" not in meta:
        # aborted before it was scheduled: nothing was routed (SGLang sends no routing then)
        routed = np.full((len(request.prompt_tokens), *routed_experts_shape), -1, dtype=np.int32)
    elif routed_experts_shape is not None:
        routed = decode_routed_experts(
            meta.get("routed_experts"),
            num_tokens=len(request.prompt_tokens) + len(tokens),
            shape=routed_experts_shape,
            where=where,
        )
    finish_reason: FinishReason = finish_type
    return GenerateOutput(
        response_tokens=tokens,
        log_probs=[float(lp) for lp in log_probs],
        finish_reason=finish_reason,
        request_id=request.request_id,
        weight_versions=versions,
        segment_lengths=segments,
        routed_experts=routed,
    )


def parse_weight_version(value: Any) -> int:
    """An SGLang weight version -> int: "3" -> 3; SGLang's initial "default" (or none) -> 0.

    Raises: ValueError for any other value (a version Miles did not set).
    """
    if value is None or value == "default":
        return 0
    try:
        version = int(str(value))
    except ValueError:
        version = -1
    if version < 0:
        raise ValueError(f"weight version {value!r} is not a Miles version (an integer >= 0, or SGLang's 'default')")
    return version


# -- server side: SGLang -> Miles -> SGLang --------------------------------------------------------
def parse_generate_request(
    body: Any, *, vocab_size: int, context_length: int, stop_token_ids: Sequence[int], routed_experts: bool = False
) -> tuple[GenerateRequest, bool]:
    """A ``/generate`` body (one prompt of token ids) -> (request, return_logprob).

    Fields miles serve does not implement are accepted only at their "not used" values (``GENERATE_NEUTRAL``);
    ``return_routed_experts`` true only when ``routed_experts`` (the server records routing: SGLang's
    ``--enable-return-routed-experts``).
    Raises: ValueError in one line naming the field, the value and the fix.
    """
    if not isinstance(body, dict):
        raise ValueError("the /generate body must be a JSON object")
    if body.get("text") is not None:
        raise ValueError("text is not supported: miles serve is token-in-token-out; send input_ids")
    known = {
        "text",
        "input_ids",
        "sampling_params",
        "return_logprob",
        "rid",
        "return_routed_experts",
        "lora_path",
        "image_data",
    }  # lora_path: checked by the server against its loaded adapters; image_data: processed by the server
    _check_neutral(body, GENERATE_NEUTRAL, known, "")
    return_routed = body.get("return_routed_experts") or False
    if not isinstance(return_routed, bool):
        raise ValueError(f"return_routed_experts must be true or false, got {return_routed!r}")
    if return_routed and not routed_experts:
        raise ValueError(
            "return_routed_experts is true but this server records no routing; start miles serve with "
            "--enable-return-routed-experts (an MoE model)"
        )
    input_ids = body.get("input_ids")
    if not isinstance(input_ids, list) or not input_ids:
        raise ValueError("input_ids must be a non-empty list of token ids")
    if not all(_is_int(t) for t in input_ids):
        kind = "a batch of prompts" if isinstance(input_ids[0], list) else "non-integer ids"
        raise ValueError(f"input_ids holds {kind}; send one prompt of integer ids per request")
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input_ids has ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise ValueError(f"rid must be a string, got {rid!r}")
    return_logprob = body.get("return_logprob") or False
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob must be true or false, got {return_logprob!r}")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ValueError("sampling_params must be a JSON object (one prompt per request)")
    sampling, seed = parse_sampling_params(params, stop_token_ids=stop_token_ids)
    if len(input_ids) + sampling.max_new_tokens > context_length:
        raise ValueError(
            f"{len(input_ids)} prompt tokens + max_new_tokens {sampling.max_new_tokens} exceed the model's context "
            f"length {context_length}; shorten the prompt or lower sampling_params.max_new_tokens"
        )
    images = body.get("image_data")
    if isinstance(images, str):
        images = [images]
    if images is not None and (not isinstance(images, list) or not all(isinstance(x, str) and x for x in images)):
        raise ValueError("image_data must be a base64 image (or a list of them, one per image of the prompt)")
    request = GenerateRequest(
        list(input_ids), sampling, seed=seed, request_id=rid or uuid.uuid4().hex, image_data=images or None
    )
    return request, return_logprob


def parse_sampling_params(
    params: dict[str, Any], *, stop_token_ids: Sequence[int]
) -> tuple[SamplingConfig, int | None]:
    """SGLang ``sampling_params`` -> (``SamplingConfig``, sampling seed or None).

    ``stop_token_ids`` may only name ids the engine stops on anyway (SGLang stops on eos plus these; the engine's
    stop set is fixed at start-up, ``miles serve --stop-token-ids``). Raises: ValueError naming the field.
    """
    known = {"temperature", "top_p", "top_k", "max_new_tokens", "sampling_seed", "stop_token_ids"}
    _check_neutral(params, SAMPLING_NEUTRAL, known, "sampling_params.")
    value = {key: params.get(key) for key in known}
    temperature = 1.0 if value["temperature"] is None else value["temperature"]
    top_k = -1 if value["top_k"] is None else value["top_k"]
    top_p = 1.0 if value["top_p"] is None else value["top_p"]
    max_new_tokens = 128 if value["max_new_tokens"] is None else value["max_new_tokens"]
    if not _is_number(temperature) or not temperature >= 0:
        raise ValueError(f"sampling_params.temperature must be a number >= 0, got {temperature!r}")
    if temperature < 1e-6:  # SGLang: greedy
        temperature, top_k = 1.0, 1
    if not _is_int(top_k) or (top_k < 1 and top_k != -1):
        raise ValueError(f"sampling_params.top_k must be -1 (off) or >= 1, got {top_k!r}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"sampling_params.top_p must be in (0, 1], got {top_p!r}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"sampling_params.max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    seed = value["sampling_seed"]
    if seed is not None and not _is_int(seed):
        raise ValueError(f"sampling_params.sampling_seed must be an integer, got {seed!r}")
    stops = value["stop_token_ids"] or []
    if not isinstance(stops, list) or not all(_is_int(t) for t in stops):
        raise ValueError(f"sampling_params.stop_token_ids must be a list of token ids, got {stops!r}")
    extra = sorted(set(stops) - set(stop_token_ids))
    if extra:
        raise ValueError(
            f"sampling_params.stop_token_ids {extra} are not among the engine's stop ids {list(stop_token_ids)}; "
            "start miles serve with --stop-token-ids to stop on them"
        )
    top_k = 0 if top_k == -1 or top_k >= TOP_K_ALL else top_k
    return SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens), seed


def generate_response(
    output: GenerateOutput,
    request: GenerateRequest,
    *,
    return_logprob: bool,
    latency_s: float,
    return_routed_experts: bool = False,
) -> dict[str, Any]:
    """SGLang's ``/generate`` answer for one finished request; a non-finite log-prob becomes null (as orjson
    writes it), which ``parse_generate_response`` rejects. With ``return_routed_experts``, ``meta_info.routed_experts``
    as SGLang sends it (the inverse of ``decode_routed_experts``): base64 of the little-endian int32 expert ids of
    every token but the last, ``[tokens - 1, layers, top_k]`` (-1 for dense layers)."""
    finish: dict[str, Any] = {"type": output.finish_reason}
    if output.finish_reason == "stop":
        finish["matched"] = output.response_tokens[-1]
    elif output.finish_reason == "length":
        finish["length"] = request.sampling.max_new_tokens
    else:
        finish["message"] = "aborted"
    meta: dict[str, Any] = {
        "id": request.request_id,
        "finish_reason": finish,
        "prompt_tokens": len(request.prompt_tokens),
        "completion_tokens": len(output.response_tokens),
        "cached_tokens": 0,  # no prefix cache
        "weight_version": str(output.weight_version),
        # Miles' own keys (SGLang's clients ignore them): a request retracted and continued across weight updates
        # spans several versions, and where each began; SGLang reports only the last version.
        "miles_weight_versions": [str(v) for v in output.weight_versions],
        "e2e_latency": latency_s,
    }
    if output.segment_lengths is not None:
        meta["miles_segment_lengths"] = list(output.segment_lengths)
    if return_routed_experts:
        num_tokens = len(request.prompt_tokens) + len(output.response_tokens)
        routed = np.asarray(output.routed_experts, dtype="<i4")[: num_tokens - 1]
        meta["routed_experts"] = base64.b64encode(routed.tobytes()).decode("ascii")
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp if math.isfinite(lp) else None, token, None]
            for lp, token in zip(output.log_probs, output.response_tokens)
        ]
    return {"text": "", "output_ids": list(output.response_tokens), "meta_info": meta}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_neutral(body: dict[str, Any], neutral: dict[str, tuple[Any, ...] | None], known: set[str], prefix: str):
    """Raise ValueError for a field of ``body`` outside ``known`` that is unknown or not at a neutral value."""
    for key, value in body.items():
        if key in known:
            continue
        if key not in neutral:
            raise ValueError(f"{prefix}{key} is not a field miles serve knows; remove it")
        allowed = neutral[key]
        if allowed is not None and not any(_same(value, a) for a in allowed):
            raise ValueError(f"{prefix}{key}={value!r} is not supported by miles serve; leave it unset")


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral``, except that a bool never equals a number (``True == 1`` in Python)."""
    return value is neutral or (value == neutral and isinstance(value, bool) == isinstance(neutral, bool))
