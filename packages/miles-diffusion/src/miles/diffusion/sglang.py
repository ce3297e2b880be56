"""Rollouts from SGLang-Diffusion servers, and the trainer's weights back into them, for the Flow-GRPO trainer.

``SGLangDiffusionEngine`` asks each server's ``POST /rollout/generate`` for a group of SDE-sampled images per prompt
and returns them as the in-process sampler does (``Trajectories``: the latent before each step and the last one,
the schedule, each step's transition log-prob; the decoded images), so ``FlowGRPOTrainer`` trains on them
unchanged. ``SGLangDiffusionWeightSink`` pushes the trainer's weights: it writes them with ``miles.sync``'s
``DiskWeightWriter`` in a pipeline's layout (``<root>/v000007/transformer/model.safetensors``, atomically, with
a checksummed manifest), posts ``/update_weights_from_disk`` {model_path, target_modules ["transformer"]} to every
server, and then ``/update_weights_from_tensor_checker`` with the SHA-256 of every tensor it wrote, so a push that
loaded nothing (a name the engine's module does not have: SGLang skips those silently) or loaded something else
fails instead of sampling with stale weights.

The wire format is ``miles.diffusion.sglang_api``. What ran here is ``miles serve-diffusion`` (a Miles server
speaking that API with Miles' sampler), never SGLang-Diffusion itself, which needs a CUDA GPU: untested against it
are its image format (assumed [3, H, W] float in [0, 1]), Qwen-Image's latent layout in ``dit_trajectory``
(packed patches are unpacked when their element count fits) and its numerics (the trainer recomputes the old
log-probs by default, so a kernel gap shows in ``train_rollout_logprob_max_abs_diff`` instead of in the ratio).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from miles.diffusion.sampler import Trajectories, unpack_latents
from miles.diffusion.sglang_api import (
    ROLLOUT_PATH,
    TRANSFORMER,
    RolloutImage,
    RolloutSettings,
    parse_rollout_response,
    rollout_request,
    tensor_sha256,
)
from miles.sync.errors import WeightUpdateError
from miles.sync.versions import next_version
from torch import Tensor

logger = logging.getLogger(__name__)


def _server_error(url: str, path: str, response: Any) -> str:
    try:
        body = response.json()
        message = body.get("message") or body.get("detail") or body.get("error") or body
    except ValueError:
        message = response.text[:300]
    return f"{url}{path} answered {response.status_code}: {message}"


class SGLangDiffusionEngine:
    """Flow-GRPO rollouts from SGLang-Diffusion servers (``POST /rollout/generate``), one request per prompt.

    Args:
        urls: the servers (``http://host:port``), one or more; a step's prompts go to them in turn, all at once.
        timeout_s: how long one request may take (a whole group of images), seconds.

    Raises: ValueError for no URLs or timeout_s <= 0.
    """

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 600.0) -> None:
        import httpx

        if not urls:
            raise ValueError("engine.urls is empty; give the SGLang-Diffusion servers' addresses (http://host:port)")
        if timeout_s <= 0:
            raise ValueError(f"engine.timeout_s is {timeout_s}; it must be > 0 (seconds one request may take)")
        self.urls = [url.rstrip("/") for url in urls]
        self.client = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        """Close the HTTP connections (the servers keep running: whoever started them stops them)."""
        self.client.close()

    def _post(self, url: str, path: str, body: dict[str, Any]) -> Any:
        import httpx

        try:
            response = self.client.post(url + path, json=body)
        except httpx.HTTPError as err:
            reason = str(err).rstrip(".")
            raise ConnectionError(f"{url}{path}: {type(err).__name__}: {reason} (is the server up?)") from None
        if response.status_code != 200:
            raise ConnectionError(_server_error(url, path, response))
        if "msgpack" in response.headers.get("content-type", ""):  # newer SGLang-Diffusion answers rollouts so
            import msgpack

            return msgpack.unpackb(response.content)
        return response.json()

    def generate(
        self, prompts: Sequence[str], *, n: int, seeds: Sequence[int], settings: RolloutSettings,
        latent_shape: tuple[int, int, int],
    ) -> tuple[Trajectories, np.ndarray]:  # fmt: skip
        """``n`` SDE-sampled images of each prompt, each prompt's group in a row (as the in-process sampler).

        Args:
            prompts: P prompts; prompt i's request carries ``seeds[i]`` (the server draws the group's noise from it).
            n: images per prompt (``num_outputs_per_prompt``).
            settings: steps T, noise level, guidance, image size.
            latent_shape: (C, H, W) of one latent, to unpack a server's packed latents (Qwen-Image's 2 x 2 patches).
        Returns: (Trajectories with latents [P n, T + 1, C, H, W], sigmas [T + 1], log_probs [P n, T], all float32;
            images [P n, H', W', 3] uint8).
        Raises: ConnectionError (one line: the server, the path, its answer) when a request fails; ValueError when an
            answer does not fit (``parse_rollout_response``), has other than ``n`` images, or the servers sampled
            with different schedules.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many seeds, got {len(seeds)}")

        def one(i: int) -> list[RolloutImage]:
            url = self.urls[i % len(self.urls)]
            answer = self._post(url, ROLLOUT_PATH, rollout_request(prompts[i], n=n, seed=seeds[i], settings=settings))
            if not isinstance(answer, list) or len(answer) != n:
                count = len(answer) if isinstance(answer, list) else type(answer).__name__
                raise ValueError(f"{url}{ROLLOUT_PATH}: asked for {n} images of a prompt, got {count}")
            return [parse_rollout_response(item, num_steps=settings.num_steps) for item in answer]

        with ThreadPoolExecutor(max_workers=min(len(prompts), 4 * len(self.urls)) or 1) as pool:
            images = [image for group in pool.map(one, range(len(prompts))) for image in group]
        sigmas = images[0].sigmas
        for image in images[1:]:
            if not torch.allclose(image.sigmas, sigmas, rtol=0, atol=1e-6):
                raise ValueError("the servers sampled with different schedules (dit_trajectory timesteps differ): "
                                 "serve the same model and scheduler everywhere")  # fmt: skip
        latents = torch.stack([_as_latents(image.latents, latent_shape) for image in images])
        log_probs = torch.stack([image.log_probs for image in images])
        return Trajectories(latents, sigmas, log_probs), np.stack([image.image for image in images])


def _as_latents(latents: Tensor, latent_shape: tuple[int, int, int]) -> Tensor:
    """A server's [T + 1, ...] latents as [T + 1, C, H, W]: as they are, or unpacked from 2 x 2 patches
    [T + 1, H W / 4, 4 C] (Qwen-Image's layout). Raises: ValueError when neither fits ``latent_shape``."""
    if tuple(latents.shape[1:]) == tuple(latent_shape):
        return latents
    channels, height, width = latent_shape
    if latents.dim() == 3 and tuple(latents.shape[1:]) == (height * width // 4, channels * 4):
        return unpack_latents(latents, (height, width))
    raise ValueError(f"dit_trajectory.latents: each step's latent is {list(latents.shape[1:])}, the model's is "
                     f"{list(latent_shape)} (or packed 2 x 2: [{height * width // 4}, {channels * 4}])")  # fmt: skip


class _Hashing:
    """Passes ``(name, tensor)`` pairs through (cast to ``dtype`` when floating) and records each one's SHA-256."""

    def __init__(self, named: Iterable[tuple[str, Tensor]], dtype: torch.dtype | None) -> None:
        self.named, self.dtype, self.sha256 = named, dtype, {}

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in self.named:
            if self.dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            tensor = tensor.detach().cpu()
            self.sha256[name] = tensor_sha256(tensor)
            yield name, tensor


class SGLangDiffusionWeightSink:
    """The trainer side of SGLang-Diffusion's ``/update_weights_from_disk``: ``push`` like ``miles.sync``'s
    ``WeightSender`` (module docstring).

    Args:
        engine: the ``SGLangDiffusionEngine`` whose servers load the weights.
        root: the directory the versions go to (created if missing); the servers must see it at the same path.
        module: the pipeline module the weights are (SGLang's ``target_modules``), diffusers' ``transformer``.
        dtype: the dtype the servers hold the module in (they cast what they load to it; the checksums are taken
            after the same cast); None: as pushed.
        keep: versions kept on disk (2: SGLang rolls a failed load back by reading the one it loaded last).

    Attributes: version: the last version every server loaded and verified (0 before the first push).
    """

    def __init__(
        self,
        engine: SGLangDiffusionEngine,
        *,
        root: str | Path,
        module: str = TRANSFORMER,
        dtype: torch.dtype | None = None,
        keep: int = 2,
    ) -> None:
        from miles.sync.disk import DiskWeightWriter

        self.engine, self.module, self.dtype = engine, module, dtype
        self.writer = DiskWeightWriter(root, keep=keep, subdir=module)
        self.version = 0

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int:
        """Write one whole update, have every server load it and verify it, and return its version.

        Args:
            named_tensors: ``(name, tensor)`` pairs in the module's parameter names; read once, during the call.
            version: the update's version (> ``self.version``); default ``self.version + 1``.
        Raises: ValueError for an old version or no tensors; OSError if it cannot be written; WeightUpdateError (one
            line: the server and its message) when a server fails to load it or its weights differ afterwards.
        """
        version = next_version(version, self.version, holder="this sink")
        hashing = _Hashing(named_tensors, self.dtype)
        path = self.writer.write(hashing, version=version)
        load = {"model_path": str(path), "flush_cache": True, "target_modules": [self.module]}
        check = {"target_module": self.module, "expected_named_tensors_sha256": hashing.sha256}
        for url in self.engine.urls:
            for endpoint, body in (("/update_weights_from_disk", load), ("/update_weights_from_tensor_checker", check)):
                try:
                    answer = self.engine._post(url, endpoint, body)
                except ConnectionError as err:
                    hint = ""
                    if "checksum mismatch" in str(err) and self.dtype is not None:
                        hint = f" (the checksums were taken in {str(self.dtype).removeprefix('torch.')}: is that the "
                        hint += "servers' transformer dtype? engine.dtype)"
                    raise WeightUpdateError(f"weights v{version}: {err}{hint}") from None
                if not answer.get("success", False):
                    raise WeightUpdateError(f"weights v{version}: {url}{endpoint}: {answer.get('message', answer)}")
        self.version = version
        logger.debug("weights v%d loaded and verified on %d server(s) from %s", version, len(self.engine.urls), path)
        return version
