"""SGLang-Diffusion's post-training HTTP API as Miles speaks it: the wire format both sides share.

SGLang-Diffusion (``sglang serve`` of a diffusion model, ``sglang.multimodal_gen``) answers RL rollouts at
``POST /rollout/generate`` and swaps weights at ``POST /update_weights_from_disk``; Miles' client
(``miles.diffusion.sglang``) and its stand-in server (``miles.diffusion.serve``) both use the field names and
encodings here, read from sgl-project/sglang's ``multimodal_gen/runtime/entrypoints/post_training/``
(``io_struct.py``: ``RolloutRequest`` / ``RolloutResponse``; ``rollout_api.py``; ``utils.py``: ``_maybe_serialize``;
``weights_api.py``) and ``runtime/post_training/`` (``rl_dataclasses.py``, ``scheduler_rl_mixin.py``,
``weights_checker.py``, ``weights_updater.py``).

- A tensor travels as ``{"__tensor__": true, "data": base64(safetensors {"t": tensor}), "shape": [...],
  "dtype": "torch.float32"}`` (``encode_tensor`` / ``decode_tensor``).
- ``/rollout/generate`` takes one prompt and ``num_outputs_per_prompt`` and answers a JSON list, one
  ``RolloutResponse`` per image: ``generated_output`` (the decoded image), ``rollout_log_probs`` ([T] float32: each
  denoising step's Gaussian transition log-density averaged over the latent's elements, SGLang's
  ``log_prob_sum / count``, Flow-GRPO's convention as ``miles.diffusion.sde``), ``dit_trajectory``
  (``latents`` [T + 1, ...]: the noisy latent before each step, then the final one; ``timesteps`` [T]: the
  scheduler's, sigma x 1000; newer SGLang also sends ``sigmas`` [T + 1]).
- A weight push writes ``<model_path>/transformer/*.safetensors`` (diffusers' layout, parameter names as the
  module's) and posts ``{"model_path", "target_modules": ["transformer"]}``; ``/update_weights_from_tensor_checker``
  compares ``{"target_module", "expected_named_tensors_sha256"}`` with the loaded tensors (``tensor_sha256``).

Untested against a real SGLang-Diffusion server (it needs a CUDA GPU): what ran here is ``miles.diffusion.serve``,
a Miles server answering these endpoints with Miles' own sampler.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

ROLLOUT_PATH = "/rollout/generate"
TRANSFORMER = "transformer"  # the pipeline module RL trains, SGLang's default target module


def encode_tensor(tensor: Tensor) -> dict[str, Any]:
    """``tensor`` as SGLang-Diffusion's ``_maybe_serialize`` sends it (bit-exact in its own dtype)."""
    from safetensors.torch import save

    tensor = tensor.detach().contiguous().cpu()
    data = base64.b64encode(save({"t": tensor})).decode("ascii")
    return {"__tensor__": True, "data": data, "shape": list(tensor.shape), "dtype": str(tensor.dtype)}


def decode_tensor(value: Any, *, field: str) -> Tensor:
    """The tensor an ``encode_tensor`` dict carries (also a bare base64 string, as older SGLang-Diffusion sent, or
    raw safetensors bytes in a msgpack answer).

    Raises: ValueError naming ``field`` when ``value`` is neither, or its data is not a safetensors blob.
    """
    from safetensors.torch import load

    data = value.get("data") if isinstance(value, dict) and value.get("__tensor__") else value
    if isinstance(data, bytes):  # a msgpack answer may carry the safetensors blob as raw bytes
        data = base64.b64encode(data).decode("ascii")
    if not isinstance(data, str):
        raise ValueError(f"{field}: expected a serialized tensor ({{'__tensor__': true, 'data': ...}}), got "
                         f"{type(value).__name__}")  # fmt: skip
    try:
        return load(base64.b64decode(data))["t"]
    except Exception as err:  # noqa: BLE001 - any decoding failure is the same bad field
        raise ValueError(f"{field}: not a base64 safetensors tensor ({err})") from None


def tensor_sha256(tensor: Tensor) -> str:
    """SGLang-Diffusion's per-tensor checksum (``weights_checker.compute_tensor_sha256``): SHA-256 of the dtype's
    name, the shape's repr and the raw bytes, so it differs when any of them does."""
    tensor = tensor.detach().cpu().contiguous()
    hasher = hashlib.sha256()
    hasher.update(str(tensor.dtype).encode("utf-8"))
    hasher.update(repr(tuple(tensor.shape)).encode("utf-8"))
    hasher.update(tensor.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


@dataclass(frozen=True)
class RolloutSettings:
    """What one rollout request asks of the engine.

    Attributes:
        num_steps: denoising steps T (every one an SDE step).
        noise_level: Flow-GRPO's SDE noise level a (> 0).
        guidance_scale: classifier-free guidance (1.0: off), against the empty negative prompt.
        true_cfg: send it as ``true_cfg_scale`` (Qwen-Image's pipeline) instead of ``guidance_scale`` (SD3).
        width, height: the image's size in pixels; None: the pipeline's default.
    """

    num_steps: int
    noise_level: float
    guidance_scale: float = 1.0
    true_cfg: bool = False
    width: int | None = None
    height: int | None = None


def rollout_request(prompt: str, *, n: int, seed: int, settings: RolloutSettings) -> dict[str, Any]:
    """The ``/rollout/generate`` body for ``n`` images of ``prompt`` (SGLang's ``RolloutRequest``).

    Every step samples with the SDE and returns its log-prob with the Gaussian's constants (no
    ``rollout_log_prob_no_const``); the trajectory comes back, debug tensors and the denoising environment do not.
    """
    body: dict[str, Any] = {
        "prompt": prompt,
        "seed": seed,
        "num_inference_steps": settings.num_steps,
        "num_outputs_per_prompt": n,
        "rollout": True,
        "rollout_sde_type": "sde",
        "rollout_noise_level": settings.noise_level,
        "rollout_log_prob_no_const": False,
        "rollout_debug_mode": False,
        "rollout_return_denoising_env": False,
        "rollout_return_dit_trajectory": True,
        "suppress_logs": True,
    }
    if settings.guidance_scale != 1.0:
        body["negative_prompt"] = ""
        body["true_cfg_scale" if settings.true_cfg else "guidance_scale"] = settings.guidance_scale
    else:
        body["guidance_scale"] = 1.0
    if settings.width is not None:
        body["width"], body["height"] = settings.width, settings.height
    return body


@dataclass(frozen=True)
class RolloutImage:
    """One image of a ``/rollout/generate`` answer.

    Attributes:
        image: [H, W, 3] uint8 RGB.
        latents: [T + 1, ...] float32, the latent before each step, then the final one (as the engine holds them:
            [C, H, W] for SD3; Qwen-Image's may be packed 2 x 2 patches, [H W / 4, 4 C]).
        sigmas: [T + 1] float32, the times from (about) 1 down to 0.
        log_probs: [T] float32.
    """

    image: np.ndarray
    latents: Tensor
    sigmas: Tensor
    log_probs: Tensor


def image_to_uint8(output: Tensor, *, field: str = "generated_output") -> np.ndarray:
    """SGLang-Diffusion's decoded image, [3, H, W] or [3, 1, H, W] float in [0, 1] (uint8 passes as it is), as
    [H, W, 3] uint8 (clamped, rounded). Raises: ValueError naming ``field`` for another shape."""
    if output.dim() == 4 and output.shape[1] == 1:
        output = output[:, 0]
    if output.dim() != 3 or output.shape[0] != 3:
        raise ValueError(f"{field}: expected an RGB image [3, H, W] (or [3, 1, H, W]), got {list(output.shape)}")
    if output.dtype != torch.uint8:
        output = (output.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return output.permute(1, 2, 0).numpy()


def parse_rollout_response(item: Any, *, num_steps: int) -> RolloutImage:
    """One element of a ``/rollout/generate`` answer as a ``RolloutImage``.

    Raises: ValueError (one line naming the field) when a field is missing or its shape does not fit ``num_steps``.
    """
    if not isinstance(item, dict):
        raise ValueError(f"/rollout/generate: expected a list of objects, got an element of {type(item).__name__}")
    for key in ("generated_output", "rollout_log_probs", "dit_trajectory"):
        if item.get(key) is None:
            raise ValueError(f"/rollout/generate: the answer has no {key} (the server must run with rollout on and "
                             "rollout_return_dit_trajectory)")  # fmt: skip
    image = image_to_uint8(decode_tensor(item["generated_output"], field="generated_output"))
    log_probs = decode_tensor(item["rollout_log_probs"], field="rollout_log_probs").float().reshape(-1)
    trajectory = item["dit_trajectory"]
    latents = decode_tensor(trajectory.get("latents"), field="dit_trajectory.latents").float()
    if trajectory.get("sigmas") is not None:
        sigmas = decode_tensor(trajectory["sigmas"], field="dit_trajectory.sigmas").double().reshape(-1)
    else:  # SGLang's flow-matching scheduler: timestep = sigma x 1000, the last sigma 0
        timesteps = decode_tensor(trajectory.get("timesteps"), field="dit_trajectory.timesteps").double()
        sigmas = torch.cat([timesteps.reshape(-1) / 1000.0, torch.zeros(1, dtype=torch.float64)])
    if log_probs.shape != (num_steps,) or sigmas.shape != (num_steps + 1,) or latents.shape[0] != num_steps + 1:
        raise ValueError(
            f"/rollout/generate: {num_steps} steps asked, got log-probs {list(log_probs.shape)}, sigmas "
            f"{list(sigmas.shape)}, latents {list(latents.shape)} (need [T], [T + 1], [T + 1, ...])"
        )
    return RolloutImage(image, latents, sigmas.float(), log_probs)
