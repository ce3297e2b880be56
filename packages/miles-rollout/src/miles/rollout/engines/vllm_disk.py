"""Disk handoff to vLLM servers: each version written as a checkpoint, then reloaded in place by every server.

A server with ``VLLM_SERVER_DEV_MODE=1`` (how Miles starts vLLM) runs a worker method on every worker through
``POST /collective_rpc {"method": ..., "kwargs": {...}}`` (``vllm/entrypoints/serve/dev/rpc/api_router.py``). Miles
starts vLLM with miles-sync's worker extension, whose ``miles_reload_weights(weights_path)`` checks the version
(manifest checksums, names and shapes) and then loads it in place with vLLM's layerwise reload
(``miles.sync.integrations.vllm.MilesWorkerExtension``; vLLM's own ``reload_weights`` leaves a failed load half-done
and, on CPU, the tied LM head stale). Needs no weight group: the servers only share a filesystem with the trainer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from miles.rollout.engines.vllm import StreamingDigests, VLLMEngine, verify_servers, vllm_name_prefixes
from miles.sync import WeightUpdateError, next_version
from torch import Tensor

logger = logging.getLogger(__name__)


class VLLMDiskWeightSink:
    """The trainer side of a disk handoff to vLLM: ``push`` like ``miles.sync.WeightSender``.

    Each push writes the version with ``miles.sync.DiskWeightWriter`` (``<root>/v000007/``: safetensors shards,
    ``config.json`` copied from ``config_from``, ``manifest.json`` with xxh3 per shard, published by an atomic
    rename), has every server load it (``/collective_rpc`` ``miles_reload_weights``), records the version on every
    server (``/update_weight_version``) and, with ``verify``, compares the servers' ``/weight_checker`` digests with the
    pushed tensors'. The caller pauses the servers around a push (``EnginePublisher`` does).

    Args:
        engine: the servers' ``VLLMEngine``; its ``weight_version`` follows each committed push.
        root: the shared directory the versions go to (created if missing).
        server_root: where the servers see ``root``, when mounted elsewhere there; default ``root``.
        config_from: HF model directory whose ``config.json`` / ``generation_config.json`` each version gets (vLLM
            loads the directory as a checkpoint).
        dtype: the servers' dtype ("fp32" / "bf16"), for the digests.
        shard_bytes: most tensor bytes per safetensors file.
        keep: versions kept on disk.
        verify: compare checksums after each push.
        timeout_s: how long one server may take to reload.

    Raises (push): ValueError for an old version; OSError if the version cannot be written; WeightUpdateError (one
    line: the server URL and its message) when a server refuses the version (a corrupt shard, a tensor missing or
    of the wrong shape: checked before the model is touched, so it keeps serving the version before) or holds
    other weights afterwards.
    """

    def __init__(
        self,
        engine: VLLMEngine,
        *,
        root: str | Path,
        server_root: str | None = None,
        config_from: str | Path | None = None,
        dtype: str = "fp32",
        shard_bytes: int = 4 * 2**30,
        keep: int = 2,
        verify: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        from miles.sync.disk import DiskWeightWriter

        if timeout_s <= 0:
            raise ValueError(f"timeout_s is {timeout_s}; it must be > 0 (seconds one server may take to reload)")
        if dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be 'fp32', 'bf16' or 'fp16' (the servers' engine.dtype), got {dtype!r}")
        self.engine = engine
        self.writer = DiskWeightWriter(root, shard_bytes=shard_bytes, keep=keep, config_from=config_from)
        self.server_root = server_root if server_root is not None else str(self.writer.root)
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.verify = verify
        self.timeout_s = timeout_s
        self.last_verified: tuple[int, int] = (0, 0)  # (verified, not checkable) tensors of the last push

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int:
        """Write one complete update to disk and return its version once every server reloaded it.

        Args:
            named_tensors: ``(name, tensor)`` pairs in HF names; read during the call only.
            version: the update's version (> the engine's); default the engine's + 1.
        """
        engine = self.engine
        version = next_version(version, engine.weight_version, holder="the engine")
        start = time.perf_counter()
        digests = StreamingDigests(self.dtype, vllm_name_prefixes(engine.model))
        named = digests.watch(named_tensors) if self.verify else named_tensors  # streamed, never listed
        path = self.writer.write(named, version=version)
        body = {
            "method": "miles_reload_weights",
            "kwargs": {"weights_path": f"{self.server_root.rstrip('/')}/{path.name}"},
        }
        try:
            engine.post_all("/collective_rpc", json=body, timeout_s=self.timeout_s)
        except RuntimeError as err:
            raise WeightUpdateError(
                f"weight update v{version} from disk failed: {' '.join(str(err).split())}"
            ) from None
        engine.set_weight_version(version)
        if self.verify:
            self.last_verified = verify_servers(engine, digests.result(), f"{path} (v{version})")
        logger.debug(  # per step
            "pushed weights v%d to %d vLLM servers through %s in %.2fs", version, len(engine.urls), path,
            time.perf_counter() - start,
        )  # fmt: skip
        return version

    def close(self) -> None:
        """Nothing to leave: every push is a file handoff (the versions on disk stay)."""
