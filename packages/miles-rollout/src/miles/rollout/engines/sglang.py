"""SGLang servers (or ``miles serve``) as a Miles ``Engine``, and the trainer side of SGLang's weight update.

``SGLangEngine`` speaks SGLang's native HTTP API: ``/generate`` token-in-token-out (``input_ids`` in, tokens and
log-probs from ``meta_info.output_token_logprobs`` out, as slime's ``sglang_rollout.generate`` reads them),
``/pause_generation`` / ``/continue_generation`` / ``/flush_cache`` on every worker. ``SGLangWeightSink`` pushes
weights the way slime's ``update_weight_from_distributed`` does: one weight group (the trainer is rank 0, engine
ranks from ``rank_offset`` 1), then per bucket one ``/update_weights_from_distributed`` request per server (names,
dtypes, shapes) while the trainer broadcasts each tensor in that order, and finally ``/update_weight_version``.
Field names and semantics were checked against sgl-project/sglang (``entrypoints/http_server.py`` 0025436,
``managers/io_struct.py`` 001067f, ``sampling/sampling_params.py`` 00c17ca,
``model_executor/model_runner.py::update_weights_from_distributed``) and THUDM/slime
(``backends/sglang_utils/sglang_engine.py``,
``backends/megatron_utils/update_weight/update_weight_from_distributed.py``,
``rollout/sglang_rollout.py``).
``SGLangTensorWeightSink`` is the colocated path, ``/update_weights_from_tensor``: CUDA IPC handles instead of a
broadcast (see its docstring for the sources).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import itertools
import logging
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from miles.core.protocols import GenerateOutput, GenerateRequest, PauseMode, RequestFailed
from miles.core.publisher import run_sync
from miles.rollout.engines.sglang_api import generate_payload, parse_generate_response, parse_weight_version
from miles.rollout.remote_code import TRUST_REMOTE_CODE_EXTRA_ARG, TRUST_REMOTE_CODE_FLAG
from miles.sync import WeightUpdateError, next_version
from torch import Tensor

logger = logging.getLogger(__name__)

SGLANG_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # engine.dtype -> SGLang's --dtype
MILES_TO_SGLANG_PAUSE = {"abort": "abort", "retract": "retract", "keep": "in_place"}
REASON_WAIT_S = 10.0  # after a broken broadcast, how long to wait for the failed server's own message
# sglang-router 0.3.2's error codes for "no worker could take this request" (500: its own retries on the workers
# failed, e.g. the worker died mid-request; 503: no healthy worker, or every circuit breaker open). Retried like a
# dropped connection; any other answer of the router is the worker's own.
ROUTER_UNAVAILABLE_CODES = frozenset({"call_upstream_request_error", "no_available_workers"})


def launch_command(
    model_path: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    python: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv of ``python -m sglang.launch_server --model-path ... --host ... --port ... [--dtype ...]
    [--trust-remote-code]`` plus ``extra_args``.

    ``python`` defaults to this interpreter. ``dtype`` is Miles' name ("fp32", "bf16", "fp16"; ``engine.dtype``),
    sent as SGLang's (float32, bfloat16, float16); None leaves SGLang's default (the checkpoint's dtype). Extra
    arguments may use slime's ``--sglang-`` prefix (``--sglang-mem-fraction-static 0.8`` becomes
    ``--mem-fraction-static 0.8``, ``--sglang-x=1`` becomes ``--x=1``); other tokens pass through unchanged.
    ``trust_remote_code`` lets the server run the model's own code (``models.policy.trust_remote_code``).
    Raises: ValueError if ``extra_args`` sets the model path, host, port, dtype or trust-remote-code (they are
        arguments here), or for an unknown ``dtype``.
    """
    extra: list[str] = []
    for arg in map(str, extra_args):
        if arg.startswith("--sglang-"):
            arg = "--" + arg.removeprefix("--sglang-")
        flag = arg.split("=", 1)[0]
        if flag in ("--model-path", "--model", "--host", "--port"):
            raise ValueError(f"launch_command: extra_args sets {flag}; pass model_path, host and port as arguments")
        if flag == "--dtype":
            raise ValueError("engine.extra_args sets --dtype; set engine.dtype (fp32, bf16, fp16) instead")
        if flag == TRUST_REMOTE_CODE_FLAG:
            raise ValueError(TRUST_REMOTE_CODE_EXTRA_ARG)
        extra.append(arg)
    server = ["-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host, "--port", str(port)]
    if dtype is not None:
        if dtype not in SGLANG_DTYPES:
            raise ValueError(f"engine.dtype must be one of {sorted(SGLANG_DTYPES)} here, got {dtype!r}")
        server += ["--dtype", SGLANG_DTYPES[dtype]]
    if trust_remote_code:
        server.append(TRUST_REMOTE_CODE_FLAG)
    return [python or sys.executable, *server, *extra]


def _router_unavailable(response: httpx.Response) -> bool:
    """True when sglang-router answered that no worker could take the request (``ROUTER_UNAVAILABLE_CODES``)."""
    if response.status_code not in (500, 503):
        return False
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") in ROUTER_UNAVAILABLE_CODES


def _message(response: httpx.Response) -> str:
    """The error message of an SGLang answer (``ErrorResponse.message``, ``message``, or the text)."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500]
    if isinstance(body, dict):
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key]["message"] if isinstance(body[key], dict) else body[key])
    return str(body)[:500]


class SGLangEngine:
    """``Engine`` over SGLang HTTP servers (or ``miles serve``): workers, optionally behind an sglang-router.

    Args:
        worker_urls: ``http://host:port`` of each server; control calls (pause, continue, flush, weights) go to
            every one of them.
        router_url: where ``generate`` goes when given (the router balances); else round-robin over the workers.
        stop_token_ids: sent as ``sampling_params.stop_token_ids`` (SGLang stops on these and the model's eos);
            None sends none.
        request_timeout_s: how long one ``/generate`` attempt may take.
        max_retries: attempts after a timeout, a dropped or refused connection (a server that died or restarts),
            or the router's answer that no worker could take the request; each with the same rid and seed, so a
            resubmitted request samples what the first attempt would have. Without a router each retry goes to
            a worker that has not failed this request yet. After a timeout or a dropped connection the earlier
            attempt is aborted on every worker first, so it does not keep running.
        retry_backoff_s: wait before the first retry of a failure that came back at once (refused or dropped
            connection, router unavailable), doubled for each later one, so the retries span a server restart
            (0.5 with 2 retries: 0.5 s then 1 s); retries after a timeout go at once. 0 = no wait.
        control_timeout_s: timeout of pause, continue, flush and the other control calls.
        transport: an ``httpx`` transport for every request (None: real connections; tests: ``httpx.MockTransport``).
        routed_experts_shape: (num_layers, top_k) of an MoE model to ask every ``/generate`` for the experts each
            token was routed to (``return_routed_experts``; the server needs ``--enable-return-routed-experts``):
            ``GenerateOutput.routed_experts`` [prompt + response tokens, num_layers, top_k] int32, for routing
            replay (R3). None: not asked.
        adapter: the servers apply LoRA adapters pushed by a ``SGLangAdapterSink`` (``train.lora.sync adapter``):
            from weight version 1 on every request names the adapter of the version the servers reported on the
            last ``resume`` (``sglang_lora.adapter_name``); version 0 is the base model.
    Raises: ValueError for no workers, a timeout <= 0, max_retries < 0 or retry_backoff_s < 0.

    ``pause`` returns [] (SGLang's ``/pause_generation`` returns no outputs): the interrupted requests' outputs
    come back through their pending ``generate`` calls. ``generate`` raises RequestFailed for a request that was
    rejected, answered malformed output or a non-finite log-prob, got a server error, or timed out once the retries
    are spent; only that request's sample fails, other requests are unaffected.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        router_url: str | None = None,
        stop_token_ids: Sequence[int] | None = None,
        request_timeout_s: float = 600.0,
        max_retries: int = 2,
        retry_backoff_s: float = 0.5,
        control_timeout_s: float = 300.0,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        routed_experts_shape: tuple[int, int] | None = None,
        adapter: bool = False,
    ) -> None:
        if not worker_urls:
            raise ValueError("SGLangEngine needs at least one worker URL (http://host:port)")
        if request_timeout_s <= 0 or control_timeout_s <= 0:
            raise ValueError(
                f"request_timeout_s ({request_timeout_s}) and control_timeout_s ({control_timeout_s}) must be > 0"
            )
        if max_retries < 0:
            raise ValueError(f"max_retries is {max_retries}; it must be >= 0 (0: one attempt per request)")
        if retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s is {retry_backoff_s}; it must be >= 0 (0: retry at once)")
        self.worker_urls = [url.rstrip("/") for url in worker_urls]
        self.router_url = router_url.rstrip("/") if router_url else None
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else None
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.control_timeout_s = control_timeout_s
        self.routed_experts_shape = routed_experts_shape  # (num_layers, top_k): ask for each token's MoE experts
        self.adapter = adapter
        self.adapter_version = 0  # adapter: the version requests name, read from the servers on each resume
        self._transport = transport
        self._next_worker = itertools.cycle(self.worker_urls)
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=control_timeout_s, transport=transport)  # type: ignore[arg-type]
        # An AsyncClient's connections belong to the event loop that made them; rollouts run one loop each.
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )

    # -- Engine protocol -------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The lowest version any worker holds (one ``GET /get_weight_version`` per worker)."""
        versions = [parse_weight_version(self._get(url, "/get_weight_version")["weight_version"])
                    for url in self.worker_urls]  # fmt: skip
        return min(versions)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """``Engine.generate`` through ``/generate``."""
        if not request.prompt_tokens:
            raise ValueError("a generate request has an empty prompt; every request needs at least one token")
        lora_path = None
        if self.adapter and self.adapter_version >= 1:
            from miles.rollout.engines.sglang_lora import adapter_name

            lora_path = adapter_name(self.adapter_version)
        payload = generate_payload(
            request,
            stop_token_ids=self.stop_token_ids,
            return_routed_experts=self.routed_experts_shape is not None,
            lora_path=lora_path,
        )
        client = self._async_client()
        last_error: Exception | str | None = None
        failed_urls: set[str] = set()
        backoff_s = 0.0
        for attempt in range(self.max_retries + 1):
            if backoff_s > 0:
                await asyncio.sleep(backoff_s)
            url = self.router_url or self._worker(avoid=failed_urls)
            try:
                response = await client.post(url + "/generate", json=payload, timeout=self.request_timeout_s)
            except httpx.TransportError as err:
                last_error = err
                failed_urls.add(url)
                logger.warning(
                    "request %s to %s failed (attempt %d of %d): %r",
                    request.request_id, url, attempt + 1, self.max_retries + 1, err,
                )  # fmt: skip
                await self._abort_everywhere(client, request.request_id)
                timed_out = isinstance(err, httpx.TimeoutException)  # it already waited request_timeout_s
                backoff_s = 0.0 if timed_out else self.retry_backoff_s * 2**attempt
                continue
            if self.router_url is not None and _router_unavailable(response):
                last_error = f"{url}/generate answered {response.status_code}: {_message(response)}"
                logger.warning(
                    "request %s: the router has no worker for it (attempt %d of %d): %s",
                    request.request_id, attempt + 1, self.max_retries + 1, last_error,
                )  # fmt: skip
                backoff_s = self.retry_backoff_s * 2**attempt
                continue
            if response.status_code == 400:
                raise RequestFailed(f"{url}/generate rejected request {request.request_id}: {_message(response)}")
            if response.status_code != 200:
                raise RequestFailed(
                    f"{url}/generate answered {response.status_code} for request {request.request_id}: "
                    f"{_message(response)}"
                )
            try:
                output = parse_generate_response(
                    response.json(), request, routed_experts_shape=self.routed_experts_shape
                )
            except ValueError as err:  # malformed or non-finite: only this request's sample fails
                raise RequestFailed(f"{url}/generate: {err}") from None
            return output
        raise RequestFailed(
            f"request {request.request_id} got no answer in {self.max_retries + 1} attempts of at most "
            f"{self.request_timeout_s:.0f}s (last: {last_error!r}); raise request_timeout_s, max_retries or "
            "retry_backoff_s, or check the servers"
        )

    async def pause(self, mode: PauseMode = "keep") -> list[GenerateOutput]:
        """``Engine.pause`` as ``/pause_generation`` on every worker: abort, retract, or keep -> SGLang's
        ``in_place`` (requests stay in the server and continue after ``resume``). Returns [].

        Raises: ValueError for an unknown mode; RuntimeError naming a worker that failed.
        """
        if mode not in MILES_TO_SGLANG_PAUSE:
            raise ValueError(f"pause mode must be one of {sorted(MILES_TO_SGLANG_PAUSE)}, got {mode!r}")
        await self._apost_all("/pause_generation", {"mode": MILES_TO_SGLANG_PAUSE[mode]})
        return []

    async def resume(self) -> None:
        """``/continue_generation`` on every worker (with ``adapter``: first read the version whose adapter requests
        name from now on). Raises: RuntimeError naming a worker that failed."""
        if self.adapter:
            self.adapter_version = await asyncio.to_thread(lambda: self.weight_version)
        await self._apost_all("/continue_generation", {})

    async def flush_cache(self) -> None:
        """``/flush_cache`` on every worker. SGLang refuses (400) while requests run or wait; that is retried for
        up to ``control_timeout_s``. Raises: RuntimeError if a worker still refuses."""
        deadline = time.monotonic() + self.control_timeout_s
        pending = list(self.worker_urls)
        async with self._control_client() as client:
            while pending:
                refused = []
                for url in pending:
                    try:
                        status = (await client.post(url + "/flush_cache")).status_code
                    except httpx.HTTPError as err:
                        raise RuntimeError(f"{url}/flush_cache failed: {err!r}") from err
                    if status == 400:
                        refused.append(url)
                    elif status != 200:
                        raise RuntimeError(f"{url}/flush_cache answered {status}")
                if refused and time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{refused[0]} refused /flush_cache for {self.control_timeout_s:.0f}s: it still holds "
                        "requests (SGLang cannot flush while paused in_place with requests held; pause with retract "
                        "or abort)"
                    )
                pending = refused
                if pending:
                    await asyncio.sleep(0.5)  # poll: SGLang answers at once, refusing while busy

    async def health(self) -> bool:
        """True when every worker (and the router) answers ``/health`` with 200."""
        urls = self.worker_urls + ([self.router_url] if self.router_url else [])
        async with self._control_client() as client:

            async def ok(url: str) -> bool:
                try:
                    return (await client.get(url + "/health")).status_code == 200
                except httpx.HTTPError:
                    return False

            return all(await asyncio.gather(*(ok(url) for url in urls)))

    def health_generate(self, timeout_s: float = 30.0) -> dict[str, bool]:
        """Each worker's ``GET /health_generate``: True when it generated a token (SGLang runs one greedy token;
        a paused, released or stuck server answers 503 or not at all within ``timeout_s``). Stricter than
        ``health``, which only asks whether the process answers."""
        results = {}
        for url in self.worker_urls:
            try:
                results[url] = self._client.get(url + "/health_generate", timeout=timeout_s).status_code == 200
            except httpx.HTTPError:
                results[url] = False
        return results

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/release_memory_occupation`` on every worker (colocated training frees the GPU for the trainer):
        ``tags`` of SGLang's ``"weights"`` / ``"kv_cache"``, None = both. The workers must be idle (pause with
        abort first); before generating again: ``resume_memory``, then push weights (released weights are gone).
        Raises: ValueError for another tag; RuntimeError naming a worker that refused."""
        run_sync(self._apost_all("/release_memory_occupation", {"tags": _memory_tags(tags)}))

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/resume_memory_occupation`` on every worker: re-allocates what ``release_memory`` freed (weights
        zero-filled: push them before generating). Raises: as ``release_memory``."""
        run_sync(self._apost_all("/resume_memory_occupation", {"tags": _memory_tags(tags)}))

    def close(self) -> None:
        """Close the HTTP connections of this thread's client (async clients close with their event loop)."""
        self._client.close()

    # -- helpers ---------------------------------------------------------------------------------
    def _worker(self, avoid: Collection[str] = ()) -> str:
        """The next worker in round-robin order that is not in ``avoid`` (the next one if every worker is)."""
        with self._lock:
            for _ in range(len(self.worker_urls)):
                url = next(self._next_worker)
                if url not in avoid:
                    return url
            return next(self._next_worker)

    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)  # one per in-flight request
            client = httpx.AsyncClient(transport=self._transport, limits=limits)  # type: ignore[arg-type]
            self._async_clients[loop] = client
        return client

    async def _abort_everywhere(self, client: httpx.AsyncClient, rid: str) -> None:
        """Best effort: end an attempt that timed out, wherever it runs (the router does not forward aborts)."""

        async def abort(url: str) -> None:
            try:
                await client.post(url + "/abort_request", json={"rid": rid}, timeout=self.control_timeout_s)
            except httpx.HTTPError as err:
                logger.warning("could not abort request %s on %s: %r", rid, url, err)

        await asyncio.gather(*(abort(url) for url in self.worker_urls))

    def _get(self, url: str, path: str) -> Any:
        response = self._client.get(url + path)
        if response.status_code != 200:
            raise RuntimeError(f"{url}{path} answered {response.status_code}: {_message(response)}")
        return response.json()

    def _control_client(self) -> httpx.AsyncClient:
        """A client for engine control calls, closed after them (they may come from any event loop)."""
        return httpx.AsyncClient(timeout=self.control_timeout_s, transport=self._transport)  # type: ignore[arg-type]

    async def _apost_all(self, path: str, body: dict[str, Any]) -> None:
        """POST ``body`` to every worker at once. Raises: RuntimeError naming the first worker that failed."""
        async with self._control_client() as client:

            async def post(url: str) -> str | None:
                try:
                    response = await client.post(url + path, json=body)
                except httpx.HTTPError as err:
                    return f"{url}{path} failed: {err!r}"
                if response.status_code != 200:
                    return f"{url}{path} answered {response.status_code}: {_message(response)}"
                return None

            errors = [e for e in await asyncio.gather(*(post(url) for url in self.worker_urls)) if e is not None]
        if errors:
            raise RuntimeError(errors[0] + (f" (and {len(errors) - 1} more workers)" if len(errors) > 1 else ""))


def _memory_tags(tags: Sequence[str] | None) -> list[str] | None:
    """SGLang's memory tags (``ReleaseMemoryOccupationReqInput.tags``). Raises: ValueError for another one."""
    if tags is None:
        return None
    unknown = sorted(set(tags) - {"weights", "kv_cache"})
    if unknown:
        raise ValueError(f"memory tags must be 'weights' and/or 'kv_cache', got {unknown}")
    return list(tags)


def _buckets(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor travels alone), in the given order."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class SGLangWeightSink:
    """The trainer side of SGLang's ``/update_weights_from_distributed``: ``push`` like ``miles.sync.WeightSender``.

    On first use it creates a weight group (``init_weight_group``; the trainer is rank 0, server i joins at
    ``rank_offset`` 1 + the tensor-parallel ranks before it; backend "nccl" for CUDA tensors and CUDA servers,
    else "gloo").
    Each bucket of at most ``bucket_bytes`` is one ``/update_weights_from_distributed`` request per server (sent
    concurrently) plus one ``torch.distributed.broadcast`` per tensor from rank 0, in the request's ``names``
    order; ``/update_weight_version`` sets the version once every bucket is loaded everywhere.

    Args:
        engine: the ``SGLangEngine`` whose ``worker_urls`` receive the weights.
        bucket_bytes: tensor bytes per request (512 MiB: few requests, bounded receive buffers).
        master_address: the trainer's address as the servers reach it (the weight group's rendezvous).
        timeout_s: how long joining, each request and each broadcast may take.

    A failed push raises ``WeightUpdateError``; the servers keep their version, but buckets loaded before the
    failure stay loaded (SGLang's behavior), so push again before trusting their weights.
    """

    def __init__(
        self,
        engine: SGLangEngine,
        *,
        bucket_bytes: int = 512 * 2**20,
        master_address: str = "127.0.0.1",
        timeout_s: float = 300.0,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes is {bucket_bytes}; it must be > 0 (512 * 2**20 is a good default)")
        self.urls = list(engine.worker_urls)
        self.bucket_bytes = bucket_bytes
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.version = 0
        self.group: Any = None
        self.group_name: str | None = None
        self.backend: str | None = None
        self._client = httpx.Client(timeout=timeout_s, transport=engine._transport)  # type: ignore[arg-type]

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int:
        """Send one complete update and return its version once every server loaded it and took the version.

        Args:
            named_tensors: ``(name, tensor)`` pairs in HF names; read during the call only.
            version: the update's version (> ``self.version``); default ``self.version + 1``.
        Raises: ValueError for an old version or no tensors; WeightUpdateError (one line: the server URL and its
            message) if a server failed or timed out.
        """
        version = next_version(version, self.version, holder="this sink")
        tensors = iter(named_tensors)
        first = next(tensors, None)
        if first is None:
            raise ValueError("push got no tensors; pass the model's (name, tensor) pairs")
        start = time.perf_counter()
        self._connect(cuda_tensors=first[1].is_cuda)
        device = "cuda" if self.backend == "nccl" else "cpu"
        num_buckets, nbytes = 0, 0
        for bucket in _buckets(itertools.chain([first], tensors), self.bucket_bytes):
            bucket = [(name, tensor.detach().to(device).contiguous()) for name, tensor in bucket]
            self._send_bucket(bucket, version)
            num_buckets += 1
            nbytes += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
        _set_weight_version(self._client, self.urls, version)
        self.version = version
        logger.debug(  # per step
            "pushed weights v%d to %d servers in %.2fs (%d buckets, %.1f MiB)",
            version, len(self.urls), time.perf_counter() - start, num_buckets, nbytes / 2**20,
        )  # fmt: skip
        return version

    def close(self) -> None:
        """Leave the weight group on every server and here (best effort); the next ``push`` joins a new one."""
        import torch.distributed as dist

        if self.group is None:
            return
        for url in self.urls:
            self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name})
        dist.destroy_process_group(self.group)
        self.group = self.group_name = None

    # -- helpers ---------------------------------------------------------------------------------
    def _send_bucket(self, bucket: list[tuple[str, Tensor]], version: int) -> None:
        """One ``/update_weights_from_distributed`` per server, sent first (they wait for the broadcasts), then one
        broadcast per tensor in the same order; returns once every server loaded the bucket.

        Raises: WeightUpdateError naming the first failed server. If a server left the broadcasts unreceived
            (it answered at once, or died), the group is unusable and the next push joins a new one.
        """
        import torch.distributed as dist

        body = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
            "shapes": [list(tensor.shape) for _, tensor in bucket],
            "group_name": self.group_name,
            "flush_cache": False,  # the publisher flushes once, after the whole update
        }
        pool = concurrent.futures.ThreadPoolExecutor(len(self.urls))
        try:
            futures = {url: pool.submit(self._post, url, "/update_weights_from_distributed", body) for url in self.urls}
            handles = [dist.broadcast(tensor, src=0, group=self.group, async_op=True) for _, tensor in bucket]
            try:
                broadcast_done = self._wait(handles, futures)
            except RuntimeError as err:  # gloo/NCCL: a server closed its end (died, or destroyed the group)
                self.group = self.group_name = None
                concurrent.futures.wait(futures.values(), timeout=REASON_WAIT_S)
                self._raise_on_failure(futures, version, wait=False)
                raise WeightUpdateError(f"weight update v{version}: the broadcast to {self.urls} broke: {err}") from err
            if not broadcast_done:
                self.group = self.group_name = None
            self._raise_on_failure(futures, version, wait=broadcast_done)
        finally:
            pool.shutdown(wait=False)  # after a failure, other servers may still wait for broadcasts

    def _connect(self, cuda_tensors: bool) -> None:
        """Create the weight group with every server, once (again after a failure left it unusable).

        NCCL when the tensors are on CUDA and every server is too (SGLang reports ``device`` "cuda", miles serve
        its model's, e.g. "cpu"); gloo otherwise, the tensors then travel through host memory.
        """
        if self.group is not None:
            return
        from miles.rollout.engines.server import free_port
        from miles.sync.transports.distributed import init_weight_group

        infos = [self._info(url) for url in self.urls]
        on_cuda = all(str(info.get("device", "cuda")).startswith("cuda") for info in infos)
        backend = "nccl" if cuda_tensors and on_cuda else "gloo"
        ranks = [int(info.get("tp_size", 1)) for info in infos]  # SGLang joins one rank per TP rank
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        port, name = free_port(), f"miles-weights-{uuid.uuid4().hex[:8]}"
        world_size = 1 + sum(ranks)
        pool = concurrent.futures.ThreadPoolExecutor(len(self.urls))
        try:
            futures = {
                url: pool.submit(self._post, url, "/init_weights_update_group", {
                    "master_address": self.master_address, "master_port": port, "rank_offset": offset,
                    "world_size": world_size, "group_name": name, "backend": backend,
                })
                for url, offset in zip(self.urls, offsets)
            }  # fmt: skip
            try:
                group = init_weight_group(
                    backend=backend,
                    master_address=self.master_address,
                    master_port=port,
                    world_size=world_size,
                    rank=0,
                    group_name=name,
                    timeout_s=self.timeout_s,
                )
            except Exception as err:
                self._raise_on_failure(futures, self.version + 1, wait=False)  # a server's own message, if any
                raise WeightUpdateError(f"joining the weight group with {self.urls} failed: {err}") from err
            self._raise_on_failure(futures, self.version + 1, wait=True)
        finally:
            pool.shutdown(wait=False)  # a server that never joins answers only at its own timeout
        self.group, self.group_name, self.backend = group, name, backend
        logger.info("weight group %s (%s) with %d servers, world size %d", name, backend, len(self.urls), world_size)

    def _info(self, url: str) -> dict[str, Any]:
        try:
            response = self._client.get(url + "/get_server_info")
            return response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def _post(self, url: str, path: str, body: dict[str, Any]) -> str | None:
        return _post_for_result(self._client, url, path, body)

    @staticmethod
    def _wait(handles: list[Any], futures: dict[str, concurrent.futures.Future]) -> bool:
        """Wait for the broadcasts, or until a server answered with a failure before receiving them all; returns
        whether they completed. Raises: RuntimeError from a broadcast that failed."""
        while not all(handle.is_completed() for handle in handles):
            if any(f.done() and f.result() is not None for f in futures.values()):
                return all(handle.is_completed() for handle in handles)
            time.sleep(0.005)  # poll: a gloo/NCCL Work has no wait-with-timeout
        for handle in handles:
            handle.wait()
        return True

    def _raise_on_failure(self, futures: dict[str, concurrent.futures.Future], version: int, *, wait: bool) -> None:
        """Raise WeightUpdateError for the first failed request; ``wait``: wait for every answer first, else look
        only at those already in."""
        if wait:
            concurrent.futures.wait(futures.values())
        _raise_first([e for e in (f.result() for f in futures.values() if f.done()) if e is not None], version)


def _post_all(client: httpx.Client, path: str, bodies: dict[str, dict[str, Any]]) -> list[str]:
    """POST each server (the keys of ``bodies``) its body, all at once; returns the one-line failures."""
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        results = pool.map(lambda url: _post_for_result(client, url, path, bodies[url]), bodies)
        return [error for error in results if error is not None]


def _raise_first(errors: list[str], version: int, how: str = "") -> None:
    """Raise WeightUpdateError naming the first of ``errors`` (one per failed server), if any."""
    if errors:
        more = f" (and {len(errors) - 1} more servers)" if len(errors) > 1 else ""
        raise WeightUpdateError(f"weight update v{version}{how} failed: {' '.join(errors[0].split())}{more}")


def _set_weight_version(client: httpx.Client, urls: Sequence[str], version: int) -> None:
    """The last request of an update: every server takes ``version`` (``/update_weight_version``, requests kept).
    Raises: WeightUpdateError naming the first server that failed."""
    body = {"new_version": str(version), "abort_all_requests": False}  # SGLang's default would abort
    _raise_first(_post_all(client, "/update_weight_version", dict.fromkeys(urls, body)), version)


def _post_for_result(
    client: httpx.Client, url: str, path: str, body: dict[str, Any], keep: dict[str, Any] | None = None
) -> str | None:
    """POST; None on success, else the one-line failure (SGLang answers ``{"success": false, "message"}``).
    ``keep``: the parsed JSON answer is stored there under ``url``."""
    try:
        response = client.post(url + path, json=body)
    except httpx.HTTPError as err:
        return f"{url}{path} failed: {err!r}"
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if keep is not None:
        keep[url] = answer
    if isinstance(answer, dict) and answer.get("success") is False:  # LoRA endpoints name it error_message
        return f"{url}{path}: {answer.get('message') or answer.get('error_message')}"
    if response.status_code != 200:
        return f"{url}{path} answered {response.status_code}: {_message(response)}"
    return None


class SGLangDiskWeightSink:
    """The trainer side of SGLang's ``/update_weights_from_disk``: ``push`` like ``miles.sync.WeightSender``.

    Each push writes the version with ``miles.sync.DiskWeightWriter`` (``<root>/v000007/``: safetensors shards,
    ``config.json`` copied from ``config_from``, ``manifest.json`` with checksums, published by an atomic
    rename), then POSTs ``/update_weights_from_disk`` {model_path, load_format "safetensors", abort_all_requests
    false, weight_version} to every server at once and checks each answer and each server's
    ``/get_weight_version``. For servers that share a filesystem with the trainer and no weight group (other
    nodes, another network), or as the fallback when no other path works. ``miles serve`` verifies the manifest's
    checksums before loading; real SGLang loads the directory as a checkpoint (it needs ``config.json``, so pass
    ``config_from``) and does not read the manifest.

    Args:
        engine: the ``SGLangEngine`` whose ``worker_urls`` load the weights.
        root: the shared directory the versions go to (created if missing).
        server_root: where the servers see ``root``, when mounted elsewhere there; default ``root``.
        config_from: HF model directory whose ``config.json`` / ``generation_config.json`` each version gets.
        shard_bytes: most tensor bytes per safetensors file.
        keep: versions kept on disk; keep 2 or more with real SGLang, which rolls a failed load back by reading
            the directory it loaded last.
        timeout_s: how long one server may take to load a version.

    A failed push raises ``WeightUpdateError`` naming the server and its message; servers that loaded it before
    another failed keep it (the version directory stays, so pushing the same version again rewrites it).
    """

    def __init__(
        self,
        engine: SGLangEngine,
        *,
        root: str | Path,
        server_root: str | None = None,
        config_from: str | Path | None = None,
        shard_bytes: int = 4 * 2**30,
        keep: int = 2,
        timeout_s: float = 600.0,
    ) -> None:
        from miles.sync.disk import DiskWeightWriter

        if timeout_s <= 0:
            raise ValueError(f"timeout_s is {timeout_s}; it must be > 0 (seconds one server may take to load)")
        self.urls = list(engine.worker_urls)
        self.writer = DiskWeightWriter(root, shard_bytes=shard_bytes, keep=keep, config_from=config_from)
        self.server_root = server_root if server_root is not None else str(self.writer.root)
        self.version = 0
        self._new_client = lambda: httpx.Client(timeout=timeout_s, transport=engine._transport)  # type: ignore[arg-type]
        self._client = self._new_client()

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int:
        """Write one complete update to disk and return its version once every server loaded it and reports it.

        Args:
            named_tensors: ``(name, tensor)`` pairs in HF names; read during the call only.
            version: the update's version (> ``self.version``); default ``self.version + 1``.
        Raises: ValueError for an old version or no tensors; OSError if the version cannot be written;
            WeightUpdateError (one line: the server URL and its message) if a server failed, timed out or reports
            another version afterwards.
        """
        version = next_version(version, self.version, holder="this sink")
        if self._client.is_closed:  # closed between pushes (Ray's resync closes rank 0's sink): open again
            self._client = self._new_client()
        start = time.perf_counter()
        path = self.writer.write(named_tensors, version=version)
        body = {
            "model_path": f"{self.server_root.rstrip('/')}/{path.name}",
            "load_format": "safetensors",
            "abort_all_requests": False,  # the publisher paused the servers
            "weight_version": str(version),
        }

        errors = _post_all(self._client, "/update_weights_from_disk", dict.fromkeys(self.urls, body))
        if not errors:
            errors = [f"{url}/get_weight_version is {got!r} after loading {path.name}" for url in self.urls
                      if (got := self._weight_version(url)) != str(version)]  # fmt: skip
        _raise_first(errors, version, " from disk")
        self.version = version
        logger.debug(  # per step
            "pushed weights v%d to %d servers through %s in %.2fs", version, len(self.urls), path,
            time.perf_counter() - start,
        )  # fmt: skip
        return version

    def close(self) -> None:
        """Close the HTTP connections (the versions on disk stay); a later ``push`` opens them again."""
        self._client.close()

    def _weight_version(self, url: str) -> str | None:
        try:
            response = self._client.get(url + "/get_weight_version")
            return str(response.json()["weight_version"]) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None


def _serialize_for_ipc(named_tensors: list[tuple[str, Tensor]]) -> str:
    """One ``serialized_named_tensors`` entry: the ``[(name, tensor), ...]`` list pickled by ``ForkingPickler``
    (torch's reducers write each CUDA tensor's IPC handle, not its data) and base64-encoded, as SGLang's
    ``MultiprocessingSerializer.serialize(obj, output_str=True)`` does. The device goes in as the GPU's UUID, as
    SGLang's ``monkey_patch_torch_reductions`` writes it (the server maps it back to its own index), so the trainer
    and the server may number the GPUs differently (another ``CUDA_VISIBLE_DEVICES``).

    Args:
        named_tensors: ``(name, tensor)`` pairs, contiguous CUDA tensors; the server maps them while it loads, so
            they must stay alive until its answer.
    Returns: the base64 text (ASCII) of the pickle.
    Raises: ValueError (one line) naming the first tensor that is not on CUDA.
    """
    from multiprocessing.reduction import ForkingPickler  # the pickler torch.multiprocessing registers its reducers on

    import torch
    from torch.multiprocessing import reductions

    for name, tensor in named_tensors:
        if not tensor.is_cuda:
            no_cuda = "" if torch.cuda.is_available() else "; this machine has no CUDA"
            raise ValueError(
                f"SGLangTensorWeightSink needs CUDA tensors, but {name!r} is on {tensor.device}{no_cuda}: "
                "/update_weights_from_tensor passes CUDA IPC handles, so the trainer and SGLang must share the GPUs "
                "(colocated); otherwise use --engine.weight-transfer group (/update_weights_from_distributed)"
            )
    for device in {tensor.device for _, tensor in named_tensors}:
        torch.cuda.current_stream(device).synchronize()  # the server reads them on its own stream, in its process

    def reduce_with_uuid(tensor: Tensor) -> tuple[Any, tuple[Any, ...]]:
        rebuild, args = reductions.reduce_tensor(tensor)
        if tensor.is_cuda and isinstance(args[6], int):  # rebuild_cuda_tensor's 7th argument is the device
            args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
        return rebuild, args

    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table = {  # this pickler only: torch's process-wide reducers stay as they are
        cls: reduce_with_uuid if reduce is reductions.reduce_tensor else reduce
        for cls, reduce in pickler.dispatch_table.items()
    }
    pickler.dump(named_tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class SGLangTensorWeightSink:
    """The trainer side of SGLang's ``/update_weights_from_tensor``: ``push`` like ``miles.sync.WeightSender``, for
    servers on the trainer's node that share its GPUs (colocated). No copy and no weight group: each request carries
    CUDA IPC handles of the trainer's tensors, which every server maps and loads from.

    Each bucket of at most ``bucket_bytes`` is one request per server (sent concurrently)::

        {"serialized_named_tensors": [payload] * tp_size, "load_format": None, "flush_cache": False,
         "abort_all_requests": False}

    ``payload`` is the bucket's ``[(name, tensor), ...]`` list, pickled with the IPC handles and base64-encoded
    (``_serialize_for_ipc``); SGLang's TP rank r deserializes entry r and loads the full tensors into its shard
    (``model.load_weights``), so the same payload goes once per TP rank (``tp_size`` from ``/get_server_info``).
    ``/update_weight_version`` sets the version once every bucket is loaded everywhere. ``load_format`` stays None
    (a list of named tensors): slime's ``"flattened_bucket"`` pickles SGLang's own ``FlattenedTensorMetadata``
    class, which needs SGLang installed on the trainer.
    Checked against sgl-project/sglang: ``managers/io_struct.py`` (``UpdateWeightsFromTensorReqInput``:
    serialized_named_tensors, load_format, flush_cache, abort_all_requests, weight_version),
    ``managers/tp_worker.py::update_weights_from_tensor`` (``serialized_named_tensors[self.tp_rank]``),
    ``entrypoints/engine.py::update_weights_from_tensor`` (one serialized copy per TP rank),
    ``utils.py::MultiprocessingSerializer``, ``utils/patch_torch.py`` (device UUID), ``entrypoints/http_server.py``
    (``{"success", "message"}``, 400 on failure); and THUDM/slime ``backends/sglang_utils/sglang_engine.py``
    (``update_weights_from_tensor``, the HTTP body).

    Args:
        engine: the ``SGLangEngine`` whose ``worker_urls`` receive the weights.
        bucket_bytes: tensor bytes per request (the tensors are not copied; this bounds what SGLang maps at once).
        timeout_s: how long one request may take.

    ``push`` raises ValueError for a CPU tensor (also on a machine without CUDA) before sending the bucket holding
    it: the trainer and SGLang must share the GPUs; servers elsewhere take ``SGLangWeightSink``
    (``--engine.weight-transfer group``).
    A failed push raises ``WeightUpdateError``; the servers keep their version, but buckets loaded before the
    failure stay loaded (SGLang's behavior), so push again before trusting their weights.
    """

    def __init__(self, engine: SGLangEngine, *, bucket_bytes: int = 512 * 2**20, timeout_s: float = 300.0) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes is {bucket_bytes}; it must be > 0 (512 * 2**20 is a good default)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s is {timeout_s}; it must be > 0 (seconds one request may take)")
        self.urls = list(engine.worker_urls)
        self.bucket_bytes = bucket_bytes
        self.version = 0
        self.tp_sizes: dict[str, int] = {}  # asked once per server, on the first push
        self._client = httpx.Client(timeout=timeout_s, transport=engine._transport)  # type: ignore[arg-type]

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int:
        """Send one complete update and return its version once every server loaded it and took the version.

        Args:
            named_tensors: ``(name, tensor)`` pairs in HF names, CUDA tensors of any dtype (SGLang casts while
                loading); read during the call only, and kept alive until the servers answered.
            version: the update's version (> ``self.version``); default ``self.version + 1``.
        Raises: ValueError for an old version, no tensors, or a tensor not on CUDA; WeightUpdateError (one line: the
            server URL and its message) if a server failed or timed out.
        """
        version = next_version(version, self.version, holder="this sink")
        start = time.perf_counter()
        num_buckets, nbytes = 0, 0
        for bucket in _buckets(named_tensors, self.bucket_bytes):
            bucket = [(name, tensor.detach().contiguous()) for name, tensor in bucket]
            payload = _serialize_for_ipc(bucket)  # raises for CPU tensors, before this bucket's requests
            if not self.tp_sizes:
                self.tp_sizes = {url: self._tp_size(url) for url in self.urls}
            bodies = {url: {
                "serialized_named_tensors": [payload] * self.tp_sizes[url],
                "load_format": None,  # a list of (name, tensor)
                "flush_cache": False,  # the publisher flushes once, after the whole update
                "abort_all_requests": False,  # the publisher paused the servers
            } for url in self.urls}  # fmt: skip
            _raise_first(_post_all(self._client, "/update_weights_from_tensor", bodies), version)
            num_buckets += 1
            nbytes += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
        if num_buckets == 0:
            raise ValueError("push got no tensors; pass the model's (name, tensor) pairs")
        _set_weight_version(self._client, self.urls, version)
        self.version = version
        logger.debug(  # per step
            "pushed weights v%d to %d servers through CUDA IPC in %.2fs (%d buckets, %.1f MiB)",
            version, len(self.urls), time.perf_counter() - start, num_buckets, nbytes / 2**20,
        )  # fmt: skip
        return version

    def close(self) -> None:
        """Close the HTTP connections."""
        self._client.close()

    def _tp_size(self, url: str) -> int:
        """The server's tensor-parallel ranks (``/get_server_info`` ``tp_size``; 1 when it does not say)."""
        try:
            response = self._client.get(url + "/get_server_info")
            return int(response.json().get("tp_size", 1)) if response.status_code == 200 else 1
        except (httpx.HTTPError, ValueError, AttributeError, TypeError):
            return 1
