"""``miles serve``: the embedded engine behind a subset of SGLang's native HTTP API, for CPUs where SGLang cannot run.

    python -m miles.rollout.serve --model PATH [--host 127.0.0.1] [--port 30000] [--dtype fp32|bf16]
        [--max-batch-size N] [--logprob-mode prefill|decode] [--stop-token-ids ID ...] [--log-level info]
        [--enable-return-routed-experts]

One ``EmbeddedEngine`` answers the endpoints Miles (``SGLangEngine``, ``SGLangWeightSink``) and the sglang-router
use, with SGLang's field names and semantics (SGLang's ``entrypoints/http_server.py`` and ``managers/io_struct.py``,
read at sgl-project/sglang 0025436 / 001067f; the ``/generate`` format is ``engines/sglang_api.py``).
Token-in-token-out only: ``input_ids`` in, ``output_ids`` and ``meta_info.output_token_logprobs`` out, ``text``
always "" (no tokenizer). Differences from SGLang, all deliberate:

- ``/pause_generation`` mode ``in_place`` runs the engine's ``pause("keep")``: SGLang freezes the running requests
  mid-decode and resumes them with their KV cache; Miles lets the running batch finish (the call blocks until it
  has), and queued requests wait. Either way no request is aborted and each completes once, after
  ``/continue_generation`` for those not yet running. ``abort`` and ``retract`` are the engine's modes of the same
  name. The default mode is SGLang's, ``abort``.
- ``/update_weights_from_distributed`` checks every name and shape against the model before loading, so a rejected
  request loads nothing of itself (earlier requests of the same update stay loaded, as in SGLang).
- ``/update_weights_from_tensor`` is refused: SGLang's payload is CUDA IPC handles, which a CPU engine cannot open.
- ``/release_memory_occupation`` frees the parameters for real; ``/resume_memory_occupation`` re-allocates them
  zero-filled (SGLang without a CPU backup keeps no values either), so weights must be pushed again before
  generating. Releasing needs an idle engine (abort first), as in SGLang.
- ``/update_weights_from_disk`` also reads a ``miles.sync.disk`` version directory, checking every shard against
  its manifest (a corrupt one loads nothing), and loads all tensors or none; the served ``model_path`` stays the
  one the server started with (SGLang's becomes the new one).
- weight versions are integers in strings ("0", "1", ...): the engine's versions are ints.
- ``return_routed_experts`` (with ``--enable-return-routed-experts``) sends the routing of the forward that gave
  the log-probs (``EmbeddedEngine``'s ``routed_experts``), dense layers' ids as -1.
- LoRA (``/load_lora_adapter`` from a peft directory, ``/unload_lora_adapter``, ``/generate``'s ``lora_path``; no
  ``--enable-lora`` needed): the engine applies one adapter, the newest loaded, to every request. A request names
  a loaded adapter (an older one gets the newest: its ``weight_version`` says which weights sampled it) and, while
  one is loaded, must name one (SGLang would run the base model; miles serve cannot mix the two in a batch).
  Unloading the applied one applies the newest that remains (so a client rolling back a version it just loaded
  gets the one before), or, with none left, sets B to zero: the base model.

Endpoints: ``/health``, ``/health_generate``, ``/get_model_info``, ``/get_server_info``, ``/get_weight_version``,
``/get_load``, ``/generate``, ``/abort_request``, ``/pause_generation``, ``/continue_generation``, ``/flush_cache``,
``/slow_down`` (SGLang's testing aid), ``/init_weights_update_group``, ``/destroy_weights_update_group``,
``/update_weights_from_distributed``, ``/update_weights_from_disk``, ``/update_weights_from_tensor`` (refused),
``/update_weight_version``, ``/release_memory_occupation``, ``/resume_memory_occupation``, ``/load_lora_adapter``,
``/unload_lora_adapter``. Blocking work (pause,
weight transfer, release) runs in worker threads, so ``/generate`` and ``/health`` keep answering meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest
from miles.rollout.engines.adapters import is_adapter_name, read_adapter_dir
from miles.rollout.engines.embedded import EmbeddedEngine, WeightsReleasedError
from miles.rollout.engines.sglang_api import generate_response, parse_generate_request, parse_weight_version
from miles.rollout.remote_code import check_remote_code
from miles.sync.disk import MANIFEST, read_hf_weights, read_manifest, read_weights
from miles.sync.transports.distributed import init_weight_group

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT
SGLANG_TO_MILES_PAUSE = {"abort": "abort", "retract": "retract", "in_place": "keep"}
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name

router = APIRouter()


@dataclass
class ServeState:
    """What the endpoints share: the engine, the model's limits, the weight groups joined, the slow-down."""

    engine: EmbeddedEngine
    model_path: str
    vocab_size: int
    context_length: int
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    forward_sleep_s: float = 0.0  # /slow_down
    num_generate_requests: int = 0  # /generate requests answered 200 (in /get_server_info)
    adapters: dict[str, str] = field(default_factory=dict)  # loaded LoRA adapters, oldest first: name -> path
    adapter_tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name -> its update
    active_adapter: str | None = None  # the one the engine applies (the newest loaded)
    processor: Any = None  # a vision-language model's VisionProcessor: /generate's image_data -> image inputs

    @property
    def version(self) -> str:
        return str(self.engine.weight_version)


def create_app(engine: EmbeddedEngine, *, model_path: str, trust_remote_code: bool = False) -> FastAPI:
    """The FastAPI app over ``engine`` (one process, one engine); ``trust_remote_code`` as the engine was built
    (a vision-language model's processor is loaded here)."""
    app = FastAPI(title="miles serve")
    app.state.serve = state = ServeState(
        engine,
        model_path,
        vocab_size=engine.model.get_input_embeddings().num_embeddings,
        context_length=int(getattr(engine.model.config, "max_position_embeddings", 1 << 30)),
    )
    if engine.multimodal:  # the same processor as the trainer's renders: same pixels from the same image files
        from miles.rollout.multimodal import VisionProcessor

        state.processor = VisionProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)

    def sleep_before_forward(module: Any, args: Any) -> None:
        if state.forward_sleep_s > 0:
            time.sleep(state.forward_sleep_s)

    # On the LM head: it runs once per forward pass, through HF generate and in the continuous-batching loop alike.
    engine.model.get_output_embeddings().register_forward_pre_hook(sleep_before_forward)
    app.include_router(router)
    return app


def _state(request: Request) -> ServeState:
    return request.app.state.serve


def _error(message: str, status: int = 400) -> JSONResponse:
    """SGLang's ``ErrorResponse``."""
    phrase = {400: "Bad Request", 500: "Internal Server Error", 503: "Service Unavailable"}[status]
    body = {"object": "error", "message": message, "type": phrase, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    """SGLang's ``{"success", "message"}`` answer: 200, or 400 on failure."""
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object body ({} when empty). Raises: ValueError for bad JSON or a non-object."""
    raw = await request.body()
    if not raw:
        return {}
    data = await request.json()
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    return data


# -- status -----------------------------------------------------------------------------------------
@router.get("/health")
async def health() -> Response:
    """200 while the process is up (also paused or released: the router should keep the worker)."""
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """One greedy token from token id 0, as SGLang; 503 while paused or released, or after 20 s."""
    engine = _state(request).engine
    if engine.paused or not await engine.health():
        return Response(status_code=503)
    probe = GenerateRequest([0], SamplingConfig(top_k=1, max_new_tokens=1), request_id=f"HEALTH_CHECK_{time.time()}")
    try:
        await asyncio.wait_for(asyncio.shield(engine.generate(probe)), HEALTH_CHECK_TIMEOUT_S)
    except (TimeoutError, WeightsReleasedError):
        engine.abort(probe.request_id)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    state = _state(request)
    config = state.engine.model.config
    return {
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.version,
        "served_model_name": state.model_path,
        "max_context_length": state.context_length,
        "vocab_size": state.vocab_size,
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
        "eos_token_ids": list(state.engine.stop_token_ids),
        "supports_vision": False,
    }


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    """The ``ServerArgs`` fields the sglang-router reads when it registers a worker, and miles serve's own."""
    state = _state(request)
    engine = state.engine
    return {
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "served_model_name": state.model_path,
        "is_generation": True,
        "is_embedding": False,
        "skip_tokenizer_init": True,
        "model_type": getattr(engine.model.config, "model_type", None),
        "architectures": getattr(engine.model.config, "architectures", None),
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": "null",
        "max_running_requests": engine.max_batch_size,
        "context_length": state.context_length,
        "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
        "device": engine.model.device.type,
        "logprob_mode": engine.logprob_mode,
        "stop_token_ids": list(engine.stop_token_ids),
        "weight_version": state.version,
        "num_generate_requests": state.num_generate_requests,
        "version": "miles-serve",
    }


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, str]:
    return {"weight_version": _state(request).version}


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, int]]:
    """SGLang's load report: ``num_reqs`` running + waiting, ``num_waiting_reqs``, ``num_tokens`` of both."""
    load = _state(request).engine.load()
    num_reqs = load.num_running + load.num_waiting
    return [{"dp_rank": 0, "num_reqs": num_reqs, "num_waiting_reqs": load.num_waiting, "num_tokens": load.num_tokens}]


# -- generation -------------------------------------------------------------------------------------
@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    state = _state(request)
    started = time.perf_counter()
    try:
        body = await _body(request)
        parsed, return_logprob = parse_generate_request(
            body,
            vocab_size=state.vocab_size,
            context_length=state.context_length,
            stop_token_ids=state.engine.stop_token_ids,
            routed_experts=state.engine.routing is not None,
        )
        _check_lora_path(state, body.get("lora_path"))
        if parsed.image_data is not None:
            images = await asyncio.to_thread(_image_inputs, state, parsed.image_data)
            parsed = dataclasses.replace(parsed, multimodal_inputs=images)
        output = await state.engine.generate(parsed)
    except WeightsReleasedError as err:
        return _error(f"{err} (POST /resume_memory_occupation, then push weights)", 503)
    except ValueError as err:
        return _error(str(err))
    except Exception as err:  # noqa: BLE001 - a failed batch: this request's answer, the server goes on
        logger.warning("a /generate request failed: %r", err)
        return _error(f"generation failed: {err!r}", 500)
    latency_s = time.perf_counter() - started
    state.num_generate_requests += 1
    answer = generate_response(
        output,
        parsed,
        return_logprob=return_logprob,
        latency_s=latency_s,
        return_routed_experts=bool(body.get("return_routed_experts")),
    )
    return JSONResponse(answer)


def _image_inputs(state: ServeState, image_data: list[str]) -> dict[str, torch.Tensor]:
    """``image_data`` (base64 image files, or data URIs) -> the model's image inputs, by its own image processor
    (decoded as ``miles.rollout.multimodal.load_image`` decodes: PIL, RGB).

    Raises: ValueError (the request's 400) for a text-only model or an entry that is not a base64 image file."""
    import base64
    import binascii
    import io

    from PIL import Image, UnidentifiedImageError

    if state.processor is None:
        raise ValueError(f"image_data: the model at {state.model_path} takes text only (no vision tower)")
    images = []
    for i, entry in enumerate(image_data):
        text = entry.split(";base64,", 1)[1] if entry.startswith("data:") and ";base64," in entry[:64] else entry
        try:  # base64 only: this server never reads files named by a request
            images.append(Image.open(io.BytesIO(base64.b64decode(text, validate=True))).convert("RGB"))
        except binascii.Error:
            raise ValueError(f"image_data[{i}] is not base64 text; send each image file base64-encoded") from None
        except (OSError, UnidentifiedImageError):
            raise ValueError(f"image_data[{i}] is base64 but not an image file PIL can read") from None
    return state.processor.image_inputs(images)


def _check_lora_path(state: ServeState, lora_path: Any) -> None:
    """Raises: ValueError (the request's 400) for a ``lora_path`` that names no loaded adapter, or none while one is
    loaded (every request then runs with it)."""
    if lora_path is None:
        if state.active_adapter is not None:
            raise ValueError(
                f"miles serve applies its LoRA adapter to every request; name it in lora_path (loaded: "
                f"{sorted(state.adapters)})"
            )
        return
    if not isinstance(lora_path, str):
        raise ValueError(f"lora_path must be one adapter name (one prompt per request), got {lora_path!r}")
    if lora_path not in state.adapters:
        raise ValueError(f"LoRA adapter {lora_path!r} is not loaded (loaded: {sorted(state.adapters)})")


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """End ``rid`` (or every request with ``abort_all``): a waiting one at once, a running one after its decode
    step; 200 whether or not it was found, as SGLang."""
    try:
        body = await _body(request)
    except ValueError as err:
        return _error(str(err))
    if body.get("abort_all"):
        _state(request).engine.abort()
    elif body.get("rid"):
        _state(request).engine.abort(str(body["rid"]))
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    """Blocks until no batch runs (``EmbeddedEngine.pause``); mode in_place maps to the engine's keep."""
    try:
        mode = (await _body(request)).get("mode", "abort")
    except ValueError as err:
        return _error(str(err))
    if mode not in SGLANG_TO_MILES_PAUSE:
        return _error(f"pause mode must be one of {sorted(SGLANG_TO_MILES_PAUSE)}, got {mode!r}")
    await _state(request).engine.pause(SGLANG_TO_MILES_PAUSE[mode])
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    await _state(request).engine.resume()
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """Always succeeds: the engine caches nothing between batches."""
    await _state(request).engine.flush_cache()
    return PlainTextResponse("Cache flushed.\n")


@router.api_route("/slow_down", methods=["GET", "POST"])
async def slow_down(request: Request) -> Response:
    """SGLang's testing aid: sleep ``forward_sleep_time`` seconds before every forward pass (null or 0: off)."""
    try:
        sleep_s = (await _body(request)).get("forward_sleep_time") or 0.0
    except ValueError as err:
        return _error(str(err))
    if isinstance(sleep_s, bool) or not isinstance(sleep_s, (int, float)) or sleep_s < 0:
        return _error(f"forward_sleep_time must be a number >= 0 or null, got {sleep_s!r}")
    _state(request).forward_sleep_s = float(sleep_s)
    return Response(status_code=200)


# -- weights ----------------------------------------------------------------------------------------
@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> Response:
    """Join the trainer's weight group as rank ``rank_offset`` (returns once every rank joined)."""
    groups = _state(request).groups
    try:
        body = await _body(request)
        name = str(body.get("group_name", DEFAULT_GROUP))
        if name in groups:
            raise ValueError(f"weight update group {name!r} exists; destroy it first or use another name")
        kwargs = {
            "backend": str(body.get("backend", "nccl")),
            "master_address": str(body["master_address"]),
            "master_port": int(body["master_port"]),
            "world_size": int(body["world_size"]),
            "rank": int(body["rank_offset"]),
            "group_name": name,
        }
    except (KeyError, TypeError, ValueError) as err:
        return _result(False, f"bad init_weights_update_group request: {err!r}")
    try:
        groups[name] = await asyncio.to_thread(init_weight_group, **kwargs)
    except Exception as err:  # noqa: BLE001 - reported to the caller, as SGLang does
        return _result(False, f"Failed to initialize custom process group: {err}.")
    logger.info("joined weight group %r as rank %d of %d", name, kwargs["rank"], kwargs["world_size"])
    return _result(True, "Succeeded to initialize custom process group.")


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> Response:
    try:
        name = (await _body(request)).get("group_name", DEFAULT_GROUP)
    except ValueError as err:
        return _result(False, str(err))
    group = _state(request).groups.pop(name, None)
    if group is None:
        return _result(False, "The group to be destroyed does not exist.")
    await asyncio.to_thread(dist.destroy_process_group, group)
    return _result(True, "Succeeded to destroy custom process group.")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> Response:
    """Receive one broadcast per tensor from rank 0, in ``names`` order, and load them all (or none).

    ``abort_all_requests`` aborts every request first; ``flush_cache`` needs nothing (no cache).
    """
    state = _state(request)
    try:
        body = await _body(request)
        names, shapes = body["names"], body["shapes"]
        dtypes = [getattr(torch, str(d), None) for d in body["dtypes"]]
        name = body.get("group_name", DEFAULT_GROUP)
        group = state.groups.get(name)
        if group is None:
            raise ValueError(f"no weight update group {name!r}; POST /init_weights_update_group first")
        if body.get("load_format") is not None:
            raise ValueError(
                f"load_format {body['load_format']!r} is not supported (only null: a broadcast per tensor)"
            )
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"got {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
        if not all(isinstance(d, torch.dtype) for d in dtypes):
            raise ValueError(f"unknown dtype among {body['dtypes']}; use torch names such as 'bfloat16'")
        new_version = body.get("weight_version")
        new_version = None if new_version is None else parse_weight_version(new_version)
    except (KeyError, TypeError, ValueError) as err:
        return _result(False, f"bad update_weights_from_distributed request: {err}")
    if body.get("abort_all_requests"):
        state.engine.abort()
    try:
        await asyncio.to_thread(_receive_and_load, state.engine, group, names, dtypes, shapes)
    except Exception as err:  # noqa: BLE001 - reported to the caller; the version stays
        message = f"Failed to update parameter online: {err}. The weight version stays {state.version}."
        logger.warning(message)
        return _result(False, message)
    message = "Succeeded to update parameter online."
    if new_version is not None:
        await asyncio.to_thread(state.engine.set_weight_version, new_version)
        message += f" Weight version updated to {new_version}."
    return _result(True, message)


def _receive_and_load(engine: EmbeddedEngine, group: Any, names: list, dtypes: list, shapes: list) -> None:
    """Take part in one broadcast per tensor (SGLang's ``ModelRunner.update_weights_from_distributed``: src 0,
    ``names`` order, all issued async, then waited), then load them all, or none if a name or shape is wrong.

    Every broadcast is received even when the metadata does not fit the model, so the sender never hangs.
    Raises: ValueError naming the first bad tensor; what the broadcast or ``load_weights`` raised.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    tensors = [torch.empty([int(n) for n in shape], dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes)]
    handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for tensor in tensors]
    for handle in handles:
        handle.wait()
    state = engine.model.state_dict()
    for name, tensor in zip(names, tensors):
        if name not in state:
            raise ValueError(f"the model has no tensor {name!r}; nothing of this request was loaded")
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{name!r} arrived with shape {list(tensor.shape)}, the model's is {list(state[name].shape)}; "
                "nothing of this request was loaded"
            )
    engine.load_weights(zip(names, tensors))


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    """Load the weights of the directory ``model_path`` (SGLang's ``UpdateWeightFromDiskReqInput``), all or none.

    ``model_path`` is a version directory ``miles.sync.disk.DiskWeightWriter`` wrote (every shard checked against
    its ``manifest.json`` first) or a plain HF safetensors checkpoint. The files are read while generation goes
    on; then, as SGLang's writer lock does, the running batch finishes, new batches wait, the tensors are copied
    in and ``weight_version`` (if given) is set, and generation continues; an engine already paused (the trainer
    pauses it around a push) is loaded at once and stays paused. ``abort_all_requests`` aborts every request
    first; ``keep_pause`` keeps the engine paused after the update. ``load_format`` may be null, "auto" or
    "safetensors"; ``flush_cache``, ``is_async``, ``torch_empty_cache``, ``recapture_cuda_graph`` and
    ``token_step`` need nothing here. Unlike SGLang the served ``model_path`` stays the one the server started
    with (a version directory is removed once newer ones exist).
    """
    state = _state(request)
    try:
        body = await _body(request)
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise ValueError(f"model_path must be a non-empty directory path, got {model_path!r}")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {body['load_format']!r} is not supported (null, 'auto' or 'safetensors')")
        if body.get("manifest") is not None:
            raise ValueError("the manifest field is not supported; miles serve reads model_path/manifest.json")
        new_version = body.get("weight_version")
        new_version = None if new_version is None else parse_weight_version(new_version)
    except (TypeError, ValueError) as err:
        return _result(False, f"bad update_weights_from_disk request: {err}", num_paused_requests=0)
    if body.get("abort_all_requests"):
        state.engine.abort()
    try:
        named = await asyncio.to_thread(_read_weight_dir, Path(model_path), new_version)
        await asyncio.to_thread(_load_paused, state.engine, named, new_version, bool(body.get("keep_pause")))
    except Exception as err:  # noqa: BLE001 - reported to the caller; weights and version stay
        message = f"Failed to update weights: {err}. The weight version stays {state.version}."
        logger.warning(message)
        return _result(False, message, num_paused_requests=0)
    logger.info("loaded %d tensors from %s (weight version %s)", len(named), model_path, state.version)
    message = "Succeeded to update model weights."
    if new_version is not None:
        message += f" Weight version updated to {new_version}."
    return _result(True, message, num_paused_requests=0)


def _read_weight_dir(path: Path, version: int | None) -> dict[str, torch.Tensor]:
    """The tensors of a Miles version directory (checked against its manifest, whose version must equal
    ``version`` when one is given) or of a plain HF safetensors directory.

    Raises: WeightUpdateError naming the file at fault; ValueError for a missing directory or a version mismatch.
    """
    if not path.is_dir():
        raise ValueError(f"model_path {path} is not a directory on this server")
    if not (path / MANIFEST).is_file():
        return read_hf_weights(path)
    manifest_version = read_manifest(path).version
    if version is not None and version != manifest_version:
        raise ValueError(f"{path / MANIFEST} holds weight version {manifest_version}, the request says {version}")
    return read_weights(path)


def _load_paused(engine: EmbeddedEngine, named: dict[str, torch.Tensor], version: int | None, keep_pause: bool) -> None:
    """Check every name and shape against the model, then load and set the version with no batch running.

    Raises: ValueError naming the first tensor the model lacks or whose shape differs (nothing loaded);
        WeightsReleasedError while the weights are released.
    """
    model_state = engine.model.state_dict()
    for name, tensor in named.items():
        if name not in model_state:
            raise ValueError(f"the model has no tensor {name!r}; nothing was loaded")
        if tuple(model_state[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{name!r} has shape {list(tensor.shape)} on disk, the model's is {list(model_state[name].shape)}; "
                "nothing was loaded"
            )
    was_paused = engine.paused
    if not was_paused:
        engine.pause_now("keep")  # blocks until the running batch ends; queued requests wait
    try:
        engine.load_weights(named.items())
        if version is not None:
            engine.set_weight_version(version)
    finally:
        if not was_paused and not keep_pause:
            engine.resume_now()


def _lora_result(state: ServeState, success: bool, error: str | None = None) -> JSONResponse:
    """SGLang's ``LoRAUpdateOutput``: 200, or 400 on failure."""
    loaded = {name: {"lora_name": name, "lora_path": path} for name, path in state.adapters.items()}
    body = {"success": success, "error_message": error, "loaded_adapters": loaded}
    return JSONResponse(body, status_code=200 if success else 400)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """Load the peft LoRA adapter at ``lora_path`` under ``lora_name`` (SGLang's ``LoadLoRAAdapterReqInput``) and
    apply it from now on (``miles.rollout.engines.adapters.read_adapter_dir``: its scaling folded into B). Every
    later adapter must target the same modules with the same rank (the engine replaces the adapters whole). The
    running batch finishes first, as for a weight update; ``pinned`` needs nothing here.
    """
    state = _state(request)
    try:
        body = await _body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"lora_name and lora_path must be non-empty strings, got {name!r} and {path!r}")
        if name in state.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first or use another name")
    except ValueError as err:
        return _lora_result(state, False, f"bad load_lora_adapter request: {err}")
    try:
        named = await asyncio.to_thread(read_adapter_dir, path)
        await asyncio.to_thread(_load_adapter_paused, state.engine, named)
    except Exception as err:  # noqa: BLE001 - reported to the caller; the adapter before stays
        message = f"Failed to load LoRA adapter {name!r} from {path}: {err}"
        logger.warning(message)
        return _lora_result(state, False, message)
    state.adapters[name], state.adapter_tensors[name], state.active_adapter = path, named, name
    logger.info("loaded LoRA adapter %s from %s (%d tensors)", name, path, len(named))
    return _lora_result(state, True)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    """Forget adapter ``lora_name``; unloading the one the engine applies applies the newest that remains, or with
    none left sets its B to zero (the base model)."""
    state = _state(request)
    try:
        name = (await _body(request)).get("lora_name")
        if name not in state.adapters:
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(state.adapters)})")
    except ValueError as err:
        return _lora_result(state, False, str(err))
    if name == state.active_adapter:
        remaining = [n for n in state.adapters if n != name]
        if remaining:
            await asyncio.to_thread(_load_adapter_paused, state.engine, state.adapter_tensors[remaining[-1]])
        else:
            zeros = {n: torch.zeros_like(t) if ".lora_B." in n else t.clone() for n, t in _adapter_state(state.engine)}
            await asyncio.to_thread(_load_adapter_paused, state.engine, zeros)
        state.active_adapter = remaining[-1] if remaining else None
    del state.adapters[name], state.adapter_tensors[name]
    logger.info("unloaded LoRA adapter %s", name)
    return _lora_result(state, True)


def _adapter_state(engine: EmbeddedEngine) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in engine.model.state_dict().items() if is_adapter_name(n)]


def _load_adapter_paused(engine: EmbeddedEngine, named: dict[str, torch.Tensor]) -> None:
    """Load an adapter update with no batch running (the engine checks it whole first: nothing loads on an error)."""
    was_paused = engine.paused
    if not was_paused:
        engine.pause_now("keep")
    try:
        engine.load_weights(named.items())
    finally:
        if not was_paused:
            engine.resume_now()


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor() -> Response:
    return _result(
        False,
        "update_weights_from_tensor is not supported by miles serve (SGLang passes CUDA IPC handles); "
        "use update_weights_from_distributed",
    )


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    """Set the version; ``abort_all_requests`` (SGLang's default: true) first aborts every request."""
    engine = _state(request).engine
    try:
        body = await _body(request)
        new_version = parse_weight_version(body["new_version"])
    except (KeyError, ValueError) as err:
        return _result(False, f"bad update_weight_version request: {err!r}")
    if body.get("abort_all_requests", True):
        engine.abort()
    await asyncio.to_thread(engine.set_weight_version, new_version)
    return _result(True, f"Weight version updated to {new_version}", new_version=str(new_version))


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request) -> Response:
    """Free the parameters (tag "weights"; "kv_cache" has nothing to free); needs an idle engine."""
    try:
        tags = _tags(await _body(request))
        if "weights" in tags:
            engine = _state(request).engine
            nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
            await asyncio.to_thread(engine.release_weights)
            logger.info("released the weights' memory (%.1f MiB of parameters)", nbytes / 2**20)
    except (RuntimeError, ValueError) as err:
        return _error(str(err))
    return _result(True, "Released the weights' memory; resume it, then push weights, before generating.")


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request) -> Response:
    """Re-allocate the parameters, zero-filled: push weights before generating."""
    try:
        tags = _tags(await _body(request))
    except ValueError as err:
        return _error(str(err))
    if "weights" in tags:
        await asyncio.to_thread(_state(request).engine.resume_weights)
        logger.info("re-allocated the weights, zero-filled")
    return _result(True, "Re-allocated the weights, zero-filled: push weights before generating.")


def _tags(body: dict[str, Any]) -> set[str]:
    """SGLang's memory tags; null means all. Raises: ValueError for an unknown tag."""
    tags = body.get("tags")
    if tags is None:
        return {"weights", "kv_cache"}
    if not isinstance(tags, list) or set(tags) - {"weights", "kv_cache"}:
        raise ValueError(f"tags must be null or a list of 'weights' and 'kv_cache', got {tags!r}")
    return set(tags)


# -- entry point ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="miles serve",
        description="Serve a HF model with the embedded engine behind SGLang's native HTTP API (/generate, "
        "/pause_generation, /update_weights_from_distributed, ...), for machines where SGLang cannot run.",
    )
    parser.add_argument("--model", "--model-path", dest="model", required=True, help="HF model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights and compute dtype")
    parser.add_argument("--max-batch-size", type=int, default=64, help="most requests decoded together")
    parser.add_argument(
        "--logprob-mode",
        choices=["prefill", "decode"],
        default="prefill",
        help="prefill: rescore each response in one forward pass (the trainer's numbers); decode: the decode steps'",
    )
    parser.add_argument(
        "--stop-token-ids", type=int, nargs="+", default=None, help="ids that end a response (default: the model's eos)"
    )
    parser.add_argument("--random-seed", type=int, default=None, help="seeds requests sent without a sampling_seed")
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="record each token's MoE experts (routing replay, R3) for /generate's return_routed_experts "
        "(SGLang's flag)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="load the model's own Python code (auto_map in its config.json / tokenizer_config.json), as SGLang's "
        "and vLLM's flag; that code runs with this server's permissions: pass it only for files you trust",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status (2 for a bad model directory or option)."""
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (Path(args.model) / "config.json").is_file():
        print(f"miles serve: --model {args.model} is not a HF model directory (no config.json)", file=sys.stderr)  # noqa: T201
        return 2
    try:
        check_remote_code(args.model, trusted=args.trust_remote_code, where="--model", fix="pass --trust-remote-code")
    except ValueError as err:
        print(f"miles serve: {err}", file=sys.stderr)  # noqa: T201
        return 2
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)  # the engine draws its request seeds from torch's RNG once
    try:
        engine = EmbeddedEngine(
            args.model,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            stop_token_ids=args.stop_token_ids,
            logprob_mode=args.logprob_mode,
            routed_experts=args.enable_return_routed_experts,
            trust_remote_code=args.trust_remote_code,
        )
    except ValueError as err:
        print(f"miles serve: {err}", file=sys.stderr)  # noqa: T201
        return 2
    app = create_app(engine, model_path=str(args.model), trust_remote_code=args.trust_remote_code)
    logger.info("serving %s (%s, %s log-probs) on http://%s:%d", args.model, args.dtype, args.logprob_mode,
                args.host, args.port)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
