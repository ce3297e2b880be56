"""LoRA adapter updates into SGLang-API servers (``train.lora.sync adapter`` with ``engine.type sglang``).

SGLang serves adapters by name and refuses to load a name twice, so each version gets its own name,
``adapter_name(version)`` (``miles-adapter-v7``), loaded from a peft directory written beside the run
(``miles.rollout.engines.adapters.write_adapter_dir``) with SGLang's path endpoint::

    POST /load_lora_adapter {"lora_name": "miles-adapter-v7", "lora_path": <version dir>}

(the tensor endpoint ``/load_lora_adapter_from_tensors`` passes torch IPC handles, and its field names changed
between SGLang releases; a path works across them and across nodes with a shared filesystem). Requests name the
version the engine read from the servers on its last ``resume`` (``SGLangEngine(adapter=True)``: ``/generate``'s
``lora_path``), so a request never names an adapter that is not loaded yet. The adapter before the current one stays
loaded (a request sent before the resume that follows a push may still name it); every other ``miles-adapter-v*`` a
server lists after a load (older versions, or ones a restarted trainer or an earlier run left) is unloaded in the
background (SGLang's unload waits for the requests that use it). A name about to be loaded is unloaded first, so a
trainer that restarts from a checkpoint can load its version again.

The trainer folds the LoRA scaling into B, so the directory says ``lora_alpha = r`` and the scaling is applied once.
Real SGLang needs ``--enable-lora --max-lora-rank R --lora-target-modules all --max-loras-per-batch 2``
(``lora_server_args``); ``miles serve`` takes adapters without flags. Tested here against ``miles serve`` only (no
GPU for SGLang): what ran is this client and sink against a Miles server speaking SGLang's API, not SGLang.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
from miles.rollout.engines.adapters import adapter_layout, write_adapter_dir
from miles.sync import WeightUpdateError, next_version, prune_versions
from torch import Tensor

logger = logging.getLogger(__name__)

ADAPTER_PREFIX = "miles-adapter-v"


def adapter_name(version: int) -> str:
    """The name an adapter version is served under (``miles-adapter-v7``)."""
    return f"{ADAPTER_PREFIX}{version}"


def lora_server_args(rank: int) -> list[str]:
    """SGLang server arguments for runtime-loaded adapters of rank ``rank`` (two held at once: the current and the
    previous version). Raises: ValueError for a rank < 1."""
    if rank < 1:
        raise ValueError(f"train.lora.rank is {rank}; it must be >= 1")
    return [
        "--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", "all",
        "--max-loras-per-batch", "2",  # no --max-loaded-loras: the sink unloads, and a cap would refuse loads
    ]  # fmt: skip


class SGLangAdapterSink:
    """The trainer side of LoRA adapter updates into SGLang-API servers: ``push`` like ``miles.sync.WeightSender``.

    Each push checks that it carries the same adapter tensors (names and shapes) as this sink's first, writes the
    version, has every server load it under ``adapter_name(version)`` (unloading that name first), records the
    version on every server (``/update_weight_version``), unloads in the background every other Miles adapter the
    servers list but the previous version's, and keeps the last ``keep`` version directories. The caller pauses the
    servers around a push and resumes them after, which is when the engine starts naming the new adapter.

    Args:
        urls: the servers' base URLs (every one loads each version).
        root: the directory the versions go to (the servers must see it at the same path).
        keep: version directories kept on disk (>= 2: the previous version may still be loaded).
        timeout_s: how long one server may take to load an adapter.
        transport: an ``httpx`` transport (tests: ``httpx.MockTransport``); None = the network.

    Raises (push): ValueError for a version not newer than the sink's; WeightUpdateError (one line, naming the
    server) when the update differs from the first in names or shapes, a server refuses it or the version cannot
    be recorded (the servers that loaded it unload it again; requests keep naming the previous version's adapter).
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        root: str | Path,
        keep: int = 2,
        timeout_s: float = 600.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if keep < 2:
            raise ValueError(f"keep is {keep}; at least 2 (the previous version may still be loaded)")
        self.urls = [url.rstrip("/") for url in urls]
        self.root = Path(root).resolve()
        self.keep = keep
        self.version = 0
        self.last_push = None  # no PushStats: adapters are written to disk, not sent in buckets
        self._timeout_s, self._transport = timeout_s, transport
        self._http: httpx.Client | None = None
        self._layout: dict[str, tuple[int, ...]] | None = None
        self._unloads: list[threading.Thread] = []

    @property
    def _client(self) -> httpx.Client:
        """The HTTP client, opened again after ``close`` (Ray's resync closes a sink that later pushes again)."""
        if self._http is None or self._http.is_closed:
            self._http = httpx.Client(timeout=self._timeout_s, transport=self._transport)
        return self._http

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int:
        """Write one adapter update and return its version once every server loaded it and reports it."""
        from miles.rollout.engines.sglang import _raise_first, _set_weight_version

        version = next_version(version, self.version, holder="this sink")
        start = time.perf_counter()
        named = dict(named_tensors)  # adapters are small (~rank / hidden of the model)
        layout = adapter_layout(named, self._layout, version)
        path = write_adapter_dir(self.root, version, named.items())
        self._unload([version], wait=True)  # a name an earlier sink left (a restarted trainer) is loaded anew
        errors, listed = self._load_everywhere({"lora_name": adapter_name(version), "lora_path": str(path)})
        try:
            _raise_first(errors, version, " (LoRA adapter)")
            _set_weight_version(self._client, self.urls, version)
        except WeightUpdateError:  # the servers that loaded it drop it again, so a retry can load it anew
            self._unload([version], wait=True)
            raise
        self.version, self._layout = version, layout
        stale = sorted(v for v in listed if v not in (version, version - 1))
        if stale:
            self._unload(stale, wait=False)
        prune_versions(self.root, keep=self.keep, current=version)
        logger.debug(
            "loaded LoRA adapter v%d into %d servers from %s in %.2fs", version, len(self.urls), path,
            time.perf_counter() - start,
        )  # fmt: skip
        return version

    def _load_everywhere(self, body: dict) -> tuple[list[str], set[int]]:
        """POST ``/load_lora_adapter`` to every server at once. Returns the one-line failures and the versions of
        the Miles adapters the servers list as loaded afterwards (SGLang's ``loaded_adapters``)."""
        from miles.rollout.engines.sglang import _post_for_result

        def load(url: str) -> tuple[str | None, set[int]]:
            error = _post_for_result(self._client, url, "/load_lora_adapter", body, keep=answers)
            return error, _miles_versions(answers.get(url))

        answers: dict[str, object] = {}
        with concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:
            results = list(pool.map(load, self.urls))
        return [e for e, _ in results if e is not None], set().union(*(v for _, v in results))

    def _unload(self, versions: list[int], *, wait: bool) -> None:
        """Unload ``versions`` from every server (best effort: a failure is logged, the server keeps the adapter
        until it restarts)."""

        def run() -> None:
            for version in versions:
                body = {"lora_name": adapter_name(version)}
                for url in self.urls:
                    try:
                        response = self._client.post(url + "/unload_lora_adapter", json=body)
                        if response.status_code != 200:
                            logger.debug("%s kept adapter v%d: %s", url, version, response.text[:200])
                    except Exception as err:  # noqa: BLE001 - best effort, also in a background thread
                        logger.warning("%s could not unload LoRA adapter v%d: %r", url, version, err)

        if wait:
            run()
            return
        thread = threading.Thread(target=run, name="miles-unload-adapters", daemon=True)
        thread.start()
        self._unloads = [t for t in self._unloads if t.is_alive()] + [thread]

    def close(self) -> None:
        """Wait for background unloads (up to 30 s) and close the HTTP connections (the versions on disk stay); a
        later ``push`` opens them again."""
        for thread in self._unloads:
            thread.join(timeout=30.0)
        if self._http is not None:
            self._http.close()


def _miles_versions(answer: object) -> set[int]:
    """The versions of the ``miles-adapter-v*`` names in a LoRA answer's ``loaded_adapters``."""
    loaded = answer.get("loaded_adapters") if isinstance(answer, dict) else None
    names = loaded if isinstance(loaded, dict) else {}
    suffixes = (name.removeprefix(ADAPTER_PREFIX) for name in names if name.startswith(ADAPTER_PREFIX))
    return {int(suffix) for suffix in suffixes if suffix.isdigit()}
