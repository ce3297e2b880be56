"""``miles serve-diffusion``: a Miles server that speaks SGLang-Diffusion's post-training HTTP API. It is not SGLang.

    miles serve-diffusion --model tiny-flow [--host 127.0.0.1] [--port 30000] [--shift 3.0] [--seed 0]

SGLang-Diffusion needs a CUDA GPU; this server answers the same endpoints with Miles' own sampler
(``miles.diffusion.sampler``) and a ``FlowModel``, so an RL client of SGLang-Diffusion (rollouts, weight pushes,
checks) runs on a CPU. Field names, encodings and messages are SGLang's (``miles.diffusion.sglang_api``; read at
sgl-project/sglang ``multimodal_gen/runtime/entrypoints/post_training/{io_struct,rollout_api,weights_api}.py`` and
``runtime/post_training/{weights_updater,weights_checker,rl_dataclasses}.py``). The images and noise are Miles',
not SGLang's: the same request gives other pixels on a real SGLang-Diffusion server.

Endpoints:

- ``GET /health``: 200 once the model is loaded.
- ``POST /rollout/generate`` (SGLang's ``RolloutRequest``): ``num_outputs_per_prompt`` images of one prompt,
  answered as a JSON list of SGLang's ``RolloutResponse`` (``generate``); a refused request is a 400
  ``{"detail": "Invalid sampling params: ..."}``, SGLang's shape of it.
- ``POST /update_weights_from_disk`` (``{model_path, flush_cache, target_modules}``): as SGLang's
  ``WeightsUpdater``: ``<model_path>/<module>/*.safetensors`` into each target module; ``{success, message}``,
  200 or 400.
- ``POST /update_weights_from_tensor_checker`` (``{target_module, expected_named_tensors_sha256}``): SGLang's
  ``UpdateWeightFromTensorChecker``: the loaded tensors' ``tensor_sha256`` against the expected ones.

Not served (404): ``/update_weights_from_tensor`` (CUDA IPC handles or flattened buckets), ``/get_weights_checksum``,
``/release_memory_occupation``, ``/resume_memory_occupation``, the encode API, and SGLang-Diffusion's OpenAI-style
image endpoints.

Differences from SGLang-Diffusion, all deliberate:

- The answer of ``/rollout/generate`` is JSON (``application/json``), as SGLang-Diffusion answered before it moved
  to msgpack; the tensors inside are SGLang's ``{"__tensor__": true, "data": base64 safetensors, ...}`` either way.
- What this server cannot do is refused (400) instead of run differently: ``rollout_sde_type`` other than "sde"
  (SGLang also has "cps" and "ode"), ``rollout_log_prob_no_const``, ``rollout_sde_step_indices`` /
  ``rollout_return_step_indices`` other than every step, ``rollout_return_denoising_env``, ``image_path``,
  ``extra_sampling_params``, a width or height other than the model's image size, and field names SGLang's
  ``RolloutRequest`` does not have (SGLang ignores those: a misspelt field would go unnoticed).
- ``seed`` and ``num_inference_steps`` are required (SGLang takes the pipeline's defaults; its answer then fails
  on ``seed`` null); ``num_outputs_per_prompt`` defaults to 1 and ``guidance_scale`` to 1.0, no guidance (SGLang:
  the pipeline's default). Guidance is ``guidance_scale`` for an SD3-family transformer and ``true_cfg_scale`` for
  Qwen-Image's; the other one must be null or 1.
- One CPU ``torch.Generator`` seeded with ``seed`` draws the whole batch's noise (``generator_device`` ignored), so
  image i of a request depends on ``num_outputs_per_prompt``; a request is reproducible whole.
- ``rollout_debug_mode`` (SGLang's default: true) is accepted, but ``rollout_debug_tensors`` is always null;
  ``denoising_env`` is null; ``peak_memory_mb`` is null. ``num_frames``, ``fps`` and ``suppress_logs`` are ignored
  (SGLang's image pipelines ignore the first two). With ``rollout`` false the rollout_* settings are not checked.
- ``dit_trajectory.latents`` are [T + 1, C, H, W] whatever the model (SGLang's Qwen-Image sends packed 2 x 2
  patches); ``dit_trajectory`` carries ``sigmas`` [T + 1] beside ``timesteps`` [T], as newer SGLang does.
- ``/update_weights_from_disk`` updates the ``transformer`` only (SGLang: every ``nn.Module`` of the pipeline). It
  reads and checks every file first and loads nothing on any error (SGLang loads module by module and rolls back):
  a tensor name the module lacks is an error here (SGLang skips it), as is a shape that differs. A directory
  ``<model_path>/transformer/`` with Miles' ``manifest.json`` (``miles.sync.disk``) is read with its checksums
  verified. Parameters and buffers load (SGLang: parameters), cast to the module's dtype as SGLang does.
  ``flush_cache`` has nothing to flush (no TeaCache). A Miles ``save_flow_model`` directory is such a
  ``model_path`` (its ``transformer/`` holds diffusers' safetensors).

Rollouts, weight loads and checks take one lock, in a worker thread: a weight push never lands mid-rollout, and
``/health`` keeps answering.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from miles.diffusion.models import FlowModel
from miles.diffusion.sampler import flow_sigmas, is_qwen_image, sample, sample_ode
from miles.diffusion.sglang_api import ROLLOUT_PATH, TRANSFORMER, encode_tensor, tensor_sha256
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import Tensor, nn

logger = logging.getLogger(__name__)

MAX_DISPLAY_TENSORS = 5  # SGLang's weights_checker lists at most this many names per failure


class RolloutRequest(BaseModel):
    """SGLang-Diffusion's ``RolloutRequest`` (its field names and defaults; unknown fields refused).

    Attributes (those used): prompt; negative_prompt (the unconditional prompt under guidance, null = "");
    seed; width, height (pixels, null = the model's); num_inference_steps (T); num_outputs_per_prompt (n);
    guidance_scale, true_cfg_scale (classifier-free guidance, 1 = off); rollout (false: ODE sampling, the image
    only); rollout_sde_type; rollout_noise_level (Flow-GRPO's a); rollout_log_prob_no_const;
    rollout_return_dit_trajectory; rollout_sde_step_indices, rollout_return_step_indices (null = every step).
    """

    model_config = ConfigDict(extra="forbid")

    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None
    generator_device: str = "cuda"
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    num_outputs_per_prompt: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    num_frames: int | None = None
    fps: int | None = None
    rollout: bool = True
    rollout_sde_type: str = "sde"
    rollout_noise_level: float = 0.7
    rollout_log_prob_no_const: bool = False
    rollout_debug_mode: bool = True
    rollout_return_denoising_env: bool = False
    rollout_return_dit_trajectory: bool = False
    rollout_sde_step_indices: list[int] | None = None
    rollout_return_step_indices: list[int] | None = None
    image_path: list[str] | None = None
    suppress_logs: bool = False
    extra_sampling_params: dict[str, Any] | None = None


@dataclass(frozen=True)
class Rollout:
    """One checked ``/rollout/generate`` request: what ``generate`` samples.

    Attributes: prompt; negative_prompt (used when guidance_scale != 1); seed; num_steps T >= 2; n images;
    guidance_scale (1.0 = off); noise_level a > 0; sde: SDE sampling with log-probs (else the ODE, image only);
    return_trajectory: send ``dit_trajectory``.
    """

    prompt: str
    negative_prompt: str
    seed: int
    num_steps: int
    n: int
    guidance_scale: float
    noise_level: float
    sde: bool
    return_trajectory: bool


@dataclass
class ServeState:
    """What the endpoints share: the model, its image size, the schedule's shift, the lock."""

    model: FlowModel
    model_path: str
    shift: float
    image_size: tuple[int, int]  # (height, width) in pixels
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def modules(self) -> dict[str, nn.Module]:
        """The updatable modules by SGLang's pipeline names."""
        return {TRANSFORMER: self.model.transformer}


def image_size(model: FlowModel) -> tuple[int, int]:
    """(height, width) of ``model``'s images: a pipeline's resolution, else (the tiny twin's pixels) the latent's."""
    resolution = model.source.get("resolution")
    return (resolution, resolution) if resolution else tuple(model.latent_shape[-2:])


def check_rollout(request: RolloutRequest, *, image_hw: tuple[int, int], qwen_image: bool) -> Rollout:
    """The ``Rollout`` a request asks for. Raises: ValueError, one line naming the field, for what this server does
    not do (module docstring)."""
    if request.seed is None:
        raise ValueError("seed is required (miles serve-diffusion has no default seed)")
    steps = request.num_inference_steps
    if steps is None or steps < 2:
        raise ValueError(f"num_inference_steps must be an integer >= 2, got {steps}")
    n = 1 if request.num_outputs_per_prompt is None else request.num_outputs_per_prompt
    if n < 1:
        raise ValueError(f"num_outputs_per_prompt must be >= 1, got {n}")
    for name, value, size in (("height", request.height, image_hw[0]), ("width", request.width, image_hw[1])):
        if value is not None and value != size:
            raise ValueError(f"{name} {value} is not this model's image {name} {size} (send {size} or null)")
    used, other = ("true_cfg_scale", "guidance_scale") if qwen_image else ("guidance_scale", "true_cfg_scale")
    if getattr(request, other) not in (None, 1.0):
        raise ValueError(f"{other} {getattr(request, other)} is not this model's guidance: send {used}")
    scale = getattr(request, used)
    scale = 1.0 if scale is None else scale
    if scale < 1.0:
        raise ValueError(f"{used} must be >= 1 (1 = no guidance), got {scale}")
    if request.image_path:
        raise ValueError("image_path: image inputs are not served (text-to-image only)")
    if request.extra_sampling_params:
        raise ValueError(f"extra_sampling_params {sorted(request.extra_sampling_params)} are not served")
    if request.rollout:
        if request.rollout_sde_type != "sde":
            raise ValueError(f"rollout_sde_type {request.rollout_sde_type!r} is not served, only 'sde' (Flow-GRPO's)")
        if request.rollout_noise_level <= 0:
            raise ValueError(f"rollout_noise_level must be > 0 for SDE log-probs, got {request.rollout_noise_level}")
        if request.rollout_log_prob_no_const:
            raise ValueError("rollout_log_prob_no_const true is not served: log-probs keep the Gaussian's constants")
        for name in ("rollout_sde_step_indices", "rollout_return_step_indices"):
            indices = getattr(request, name)
            if indices is not None and sorted(indices) != list(range(steps)):
                raise ValueError(f"{name} {indices}: only every step is served (null, or 0 .. {steps - 1})")
        if request.rollout_return_denoising_env:
            raise ValueError("rollout_return_denoising_env true is not served (the answer's denoising_env is null)")
    return Rollout(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt or "",
        seed=request.seed,
        num_steps=steps,
        n=n,
        guidance_scale=float(scale),
        noise_level=request.rollout_noise_level,
        sde=request.rollout,
        return_trajectory=request.rollout and request.rollout_return_dit_trajectory,
    )


@torch.no_grad()
def generate(model: FlowModel, rollout: Rollout, *, shift: float) -> list[dict[str, Any]]:
    """Sample ``rollout.n`` images and answer them as SGLang's ``RolloutResponse`` list (JSON-ready).

    Per image: ``generated_output`` [3, H, W] float32 in [0, 1] ((decode + 1) / 2, clamped); with SDE sampling
    ``rollout_log_probs`` [T] float32 nats (per-step transition log-density averaged over the latent's elements,
    ``miles.diffusion.sde``), and when asked ``dit_trajectory``: ``latents`` [T + 1, C, H, W] float32 (the latent
    before each step, then the final one), ``timesteps`` [T] float32 (sigma x 1000), ``sigmas`` [T + 1] float32.
    ``inference_time_s`` is the whole request's sampling and decoding time, the same for each image (as SGLang's).
    """
    start = time.perf_counter()
    cond = model.encode([rollout.prompt] * rollout.n)
    uncond = model.encode([rollout.negative_prompt] * rollout.n) if rollout.guidance_scale != 1.0 else None
    generator = torch.Generator().manual_seed(rollout.seed)
    num_steps = rollout.num_steps
    sigmas = model.schedule(num_steps) if model.schedule is not None else flow_sigmas(num_steps, shift=shift)
    common = dict(latent_shape=model.latent_shape, num_steps=num_steps, uncond=uncond,
                  guidance_scale=rollout.guidance_scale, generator=generator, sigmas=sigmas)  # fmt: skip
    trajectories = None
    if rollout.sde:
        trajectories = sample(model.transformer, cond, noise_level=rollout.noise_level, **common)
        final = trajectories.latents[:, -1]
    else:
        final = sample_ode(model.transformer, cond, **common)
    images = ((model.decode(final).float() + 1) / 2).clamp(0, 1).cpu()  # [n, 3, H, W]
    elapsed = time.perf_counter() - start
    request_id = uuid.uuid4().hex
    timesteps = sigmas_out = None
    if rollout.return_trajectory:
        timesteps = encode_tensor((sigmas[:-1] * 1000).float())
        sigmas_out = encode_tensor(sigmas.float())
    answer = []
    for i in range(rollout.n):
        item: dict[str, Any] = {
            "request_id": request_id,
            "prompt": rollout.prompt,
            "seed": rollout.seed,
            "generated_output": encode_tensor(images[i]),
            "rollout_log_probs": None,
            "rollout_debug_tensors": None,
            "denoising_env": None,
            "dit_trajectory": None,
            "inference_time_s": elapsed,
            "peak_memory_mb": None,
        }
        if trajectories is not None:
            item["rollout_log_probs"] = encode_tensor(trajectories.log_probs[i].float())
        if rollout.return_trajectory:
            latents = encode_tensor(trajectories.latents[i].float())
            item["dit_trajectory"] = {"latents": latents, "timesteps": timesteps, "sigmas": sigmas_out}
        answer.append(item)
    return answer


def module_tensors(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s parameters, then its buffers not already named (non-persistent ones too), by name."""
    tensors = dict(module.named_parameters())
    for name, buffer in module.named_buffers():
        tensors.setdefault(name, buffer)
    return tensors


def read_module_weights(weights_dir: Path, module: nn.Module) -> dict[str, Tensor]:
    """The tensors of ``weights_dir`` (Miles' checked version directory when it has ``manifest.json``, else every
    ``*.safetensors``), each checked against ``module``: the name must be one of its parameters or buffers, the
    shape the same.

    Returns: name -> CPU tensor. Raises: ValueError (or miles.sync's WeightUpdateError) naming the tensor or file.
    """
    from miles.sync.disk import MANIFEST, read_hf_weights, read_weights

    named = read_weights(weights_dir) if (weights_dir / MANIFEST).is_file() else read_hf_weights(weights_dir)
    ours = module_tensors(module)
    for name, tensor in named.items():
        if name not in ours:
            raise ValueError(f"{weights_dir} holds {name!r}, which is no parameter or buffer of the module")
        if tuple(tensor.shape) != tuple(ours[name].shape):
            raise ValueError(f"{name!r} has shape {list(tensor.shape)} in {weights_dir}, the module's is "
                             f"{list(ours[name].shape)}")  # fmt: skip
    return named


@torch.no_grad()
def load_module_weights(module: nn.Module, named: dict[str, Tensor]) -> None:
    """Copy checked tensors into ``module`` in place, each cast to the target's dtype and device."""
    ours = module_tensors(module)
    for name, tensor in named.items():
        ours[name].copy_(tensor.to(dtype=ours[name].dtype))


def check_module_sha256(module_name: str, module: nn.Module, expected: dict[str, str]) -> tuple[bool, str]:
    """SGLang's ``UpdateWeightFromTensorChecker.verify``: every expected name present with that ``tensor_sha256``.
    Returns: (success, SGLang's message)."""
    ours = module_tensors(module)
    actual = {name: tensor_sha256(ours[name]) for name in expected if name in ours}
    missing = sorted(name for name in expected if name not in actual)
    mismatched = sorted(name for name, sha in expected.items() if name in actual and actual[name] != sha)
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} tensor(s): {_names(missing)}")
    if mismatched:
        parts.append(f"checksum mismatch for {len(mismatched)} tensor(s): {_names(mismatched)}")
    if parts:
        return False, f"Module '{module_name}' update weight check failed: " + "; ".join(parts)
    return True, f"Verified module '{module_name}' update for {len(expected)} tensor(s)."


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_DISPLAY_TENSORS])
    return shown + (f", ... (+{len(names) - MAX_DISPLAY_TENSORS} more)" if len(names) > MAX_DISPLAY_TENSORS else "")


# -- HTTP -------------------------------------------------------------------------------------------------------
router = APIRouter()


def create_app(model: FlowModel, *, model_path: str, shift: float = 3.0) -> FastAPI:
    """The FastAPI app serving ``model`` (module docstring); ``model_path`` is what it was loaded from, ``shift``
    the SD3 schedule's (a model with its own ``schedule`` ignores it)."""
    app = FastAPI(title="miles serve-diffusion")
    app.state.serve = ServeState(model, model_path, shift, image_size(model))
    app.include_router(router)
    return app


def _state(request: Request) -> ServeState:
    return request.app.state.serve


def _result(success: bool, message: str) -> JSONResponse:
    """SGLang's ``{"success", "message"}`` answer: 200, or 400 on failure."""
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object body. Raises: ValueError for bad JSON or another JSON value."""
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body


@router.get("/health")
async def health() -> Response:
    """200, empty body, once the model is loaded (the server answers nothing before)."""
    return Response(status_code=200)


@router.post(ROLLOUT_PATH)
async def rollout_generate(request: Request) -> Response:
    """Check the request whole, then sample it in a worker thread under the lock (module docstring)."""
    state = _state(request)
    try:
        parsed = RolloutRequest.model_validate(await _body(request))
        qwen_image = is_qwen_image(state.model.transformer)
        rollout = check_rollout(parsed, image_hw=state.image_size, qwen_image=qwen_image)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        return JSONResponse({"detail": f"Invalid sampling params: {where}: {first['msg']}"}, status_code=400)
    except ValueError as err:
        return JSONResponse({"detail": f"Invalid sampling params: {err}"}, status_code=400)
    async with state.lock:
        answer = await asyncio.to_thread(generate, state.model, rollout, shift=state.shift)
    logger.debug("rollout: %d images x %d steps in %.2fs", rollout.n, rollout.num_steps, answer[0]["inference_time_s"])
    return JSONResponse(answer)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    """SGLang's ``WeightsUpdater.update_weights_from_disk``, all or nothing (module docstring)."""
    state = _state(request)
    try:
        body = await _body(request)
    except ValueError as err:
        return _result(False, str(err))
    path, targets = body.get("model_path"), body.get("target_modules")
    if not path or not isinstance(path, str):
        return _result(False, "model_path is required")
    if targets is not None and (not isinstance(targets, list) or not all(isinstance(t, str) for t in targets)):
        return _result(False, f"target_modules must be null or a list of module names, got {targets!r}")
    names = list(state.modules) if targets is None else targets
    unknown = [name for name in names if name not in state.modules]
    if unknown:
        return _result(False, f"Module(s) requested for update not found in pipeline: {unknown}. Available "
                              f"Module(s): {list(state.modules)}")  # fmt: skip
    if not names:
        return _result(False, f"No matching modules found for update. Requested: {targets}. Available "
                              f"nn.Module(s): {list(state.modules)}")  # fmt: skip
    missing = [name for name in names if not any((Path(path) / name).glob("*.safetensors"))]
    if missing:
        return _result(False, f"Cannot update weights: missing weight files for modules: {missing}. "
                              "No partial updates allowed.")  # fmt: skip
    updates = {}
    for name in names:  # read and check every module's files before loading any
        try:
            updates[name] = await asyncio.to_thread(read_module_weights, Path(path) / name, state.modules[name])
        except Exception as err:  # noqa: BLE001 - any read or check failure is the caller's to see; nothing loaded
            return _result(False, f"Failed to update module '{name}': {err}. Nothing was loaded.")
    async with state.lock:
        for name, named in updates.items():
            await asyncio.to_thread(load_module_weights, state.modules[name], named)
    logger.info("loaded %s from %s (%d tensors)", ", ".join(updates), path, sum(map(len, updates.values())))
    return _result(True, f"Updated {len(updates)} modules ({', '.join(updates)}).")


@router.post("/update_weights_from_tensor_checker")
async def update_weights_from_tensor_checker(request: Request) -> Response:
    """SGLang's ``UpdateWeightFromTensorChecker``: the loaded tensors against expected SHA-256s."""
    state = _state(request)
    try:
        body = await _body(request)
    except ValueError as err:
        return _result(False, str(err))
    target, expected = body.get("target_module"), body.get("expected_named_tensors_sha256")
    if not target:
        return _result(False, "target_module is required")
    if not isinstance(expected, dict) or not expected:
        return _result(False, "expected_named_tensors_sha256 is required")
    if target not in state.modules:
        return _result(False, f"Module '{target}' is not initialized")
    async with state.lock:
        success, message = await asyncio.to_thread(check_module_sha256, target, state.modules[target], expected)
    return _result(success, message)


def serve(
    model: FlowModel,
    *,
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    shift: float = 3.0,
    log_level: str = "info",
) -> None:
    """Serve ``model`` on ``host:port`` until SIGINT / SIGTERM (uvicorn)."""
    import uvicorn

    app = create_app(model, model_path=model_path, shift=shift)
    height, width = image_size(model)
    logger.info("serving %s (%d x %d images) with SGLang-Diffusion's API on http://%s:%d", model_path, width, height,
                host, port)  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level=log_level)
