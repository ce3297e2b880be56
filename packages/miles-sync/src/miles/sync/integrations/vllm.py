"""A vLLM weight-transfer engine built on miles.sync: ``pip install miles-sync`` into a vLLM environment and start
the server with ``--weight-transfer-config '{"backend": "miles"}'``.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes; miles-sync's entry point
(``register``) adds the "miles" backend to ``WeightTransferEngineFactory``. vLLM's RL endpoints then drive it:

    POST /init_weight_transfer_engine  {"init_info": {"master_address", "master_port", "world_size",
                                                      "rank_offset", "group_name", "backend": "gloo"|"nccl"}}
        -> every worker joins a weight group of its own (``init_weight_group``) as rank rank_offset + its index
    POST /start_weight_update           -> vLLM's layerwise reload starts (weights arrive in checkpoint format)
    POST /update_weights {"update_info": {"version": v}}
        -> each worker serves one miles.sync update (``DistributedEndpoint``): bucket metadata + one broadcast
           per bucket, decoded by its ``WeightReceiver`` and loaded with ``model.load_weights`` when complete;
           its ack (or error) goes back to the trainer's ``WeightSender`` in the same collective
    POST /finish_weight_update          -> the reload finalizes (fusing, dtype conversion)

The trainer side is plain miles.sync: ``WeightSender(DistributedTransport(group, src=0))`` on rank 0 of the same
group, run while the ``/update_weights`` request is in flight (``miles.rollout.engines.vllm.VLLMWeightSink`` does
this). This module imports vLLM, so only vLLM processes import it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from miles.sync.receiver import WeightReceiver
from miles.sync.transports.distributed import DistributedEndpoint, init_weight_group
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

logger = logging.getLogger("vllm.miles_sync")  # under vLLM's logger, so it reaches the server log

BACKEND_NAME = "miles"


@dataclass
class MilesInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``/init_weight_transfer_engine``: where the trainer's weight group meets.

    Attributes:
        master_address, master_port: the trainer's (rank 0's) rendezvous address.
        world_size: 1 (trainer) + every engine worker of every server in the group.
        rank_offset: this server's first rank in the group (its workers take rank_offset, rank_offset + 1, ...).
        group_name: the group's name (unique per group in a process).
        backend: torch.distributed backend of the group: "gloo" (CPU weights) or "nccl" (CUDA weights).
        timeout_s: joining and every collective may wait this long.
    """

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    group_name: str = "miles_weights"
    backend: str = "gloo"
    timeout_s: float = 600.0


@dataclass
class MilesUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``/update_weights``: the version the trainer is about to send."""

    version: int


class MilesWeightTransferEngine(WeightTransferEngine[MilesInitInfo, MilesUpdateInfo]):
    """Worker side of the "miles" backend: a ``DistributedEndpoint`` feeding a ``WeightReceiver`` whose apply step
    is the model's own ``load_weights`` (so vLLM fuses q/k/v and gate/up as it does when loading a checkpoint)."""

    init_info_cls = MilesInitInfo
    update_info_cls = MilesUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.endpoint: DistributedEndpoint | None = None
        self.receiver = WeightReceiver(apply_fn=self._load, device=device)

    def _load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        # Receive buffers persist across updates: vLLM's loader copies, so views are fine here.
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(named_tensors)

    def init_transfer_engine(self, init_info: MilesInitInfo) -> None:
        """Join the trainer's weight group (blocks until every rank joined)."""
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        rank = init_info.rank_offset + worker_rank
        group = init_weight_group(
            backend=init_info.backend,
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            world_size=init_info.world_size,
            rank=rank,
            group_name=init_info.group_name,
            timeout_s=init_info.timeout_s,
        )
        self.endpoint = DistributedEndpoint(self.receiver, group, src=0)
        logger.info("miles weight transfer: joined %s as rank %d of %d", init_info.group_name, rank, group.size())

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_gemms(self.model)

    def receive_weights(self, update_info: MilesUpdateInfo) -> None:
        """Serve one update; the trainer learns of a failure through the update's ack, and vLLM through the raise.

        Raises: RuntimeError before ``init_transfer_engine``; WeightUpdateError when the update was rejected.
        """
        if self.endpoint is None:
            raise RuntimeError("miles weight transfer is not initialized: POST /init_weight_transfer_engine first")
        try:
            if not self.endpoint.serve_update():
                raise RuntimeError("the trainer closed the miles weight transport instead of sending an update")
            if self.receiver.weight_version != update_info.version:
                raise RuntimeError(
                    f"update v{update_info.version} was not applied (the engine holds "
                    f"v{self.receiver.weight_version}); see this server's log for the bucket that failed"
                )
        except BaseException:
            # start_weight_update moved every layer to the meta device for the layerwise reload; nothing was loaded
            # (the receiver applies complete updates only), so finishing now puts the previous weights back.
            # Without it the next forward fails ("Cannot copy out of meta tensor") and the engine core dies.
            self.finish_weight_update()
            raise

    def shutdown(self) -> None:
        if self.endpoint is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.endpoint.group)
            self.endpoint = None


def repack_cpu_gemms(model: torch.nn.Module) -> None:
    """Rebuild the CPU GEMM handles of layers that keep their weight (vLLM 0.32 on CPU); no-op elsewhere.

    vLLM's CPU backend packs weights into oneDNN handles when a model loads. A tied LM head keeps its weight
    (the embedding's) and packs it too, and the layerwise reload never repacks it, so after an update it would
    still compute logits with the old embedding. Layers whose weight the packing removed were rebuilt by the
    reload itself.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every ``*.safetensors`` file in ``model_dir`` (headers only; {} if there are none)."""
    from pathlib import Path

    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


class MilesWorkerExtension:
    """vLLM worker extension (``--worker-extension-cls miles.sync.integrations.vllm.MilesWorkerExtension``): a
    disk handoff that loads a version exactly or not at all.

    ``POST /collective_rpc {"method": "miles_reload_weights", "kwargs": {"weights_path": DIR}}`` runs
    ``miles_reload_weights`` in every worker. vLLM's own ``reload_weights`` leaves a failed load half-done (layers
    on the meta device: the next request kills the engine core) and, on CPU, the tied LM head with the old
    embedding; this one checks first and repacks after.
    """

    _miles_reference_shapes: dict[str, tuple[int, ...]] | None = None

    def miles_reload_weights(self, weights_path: str) -> None:
        """Load the version directory ``weights_path`` (written by ``miles.sync.DiskWeightWriter``) in place.

        Every shard is checked against the manifest's xxh3 (``miles.sync.disk.read_weights``) and every tensor's
        name and shape against the checkpoint the server started from, before the model is touched.
        Raises: WeightUpdateError (the engine keeps its weights) naming the file or tensor that is wrong.
        """
        from miles.sync.disk import read_weights
        from miles.sync.errors import WeightUpdateError
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if self._miles_reference_shapes is None:
            self._miles_reference_shapes = checkpoint_shapes(self.model_config.model)
        tensors = read_weights(weights_path)
        reference = self._miles_reference_shapes
        if reference:
            missing = sorted(set(reference) - set(tensors))
            unknown = sorted(set(tensors) - set(reference))
            wrong = [f"{n} {tuple(t.shape)} (expected {reference[n]})" for n, t in tensors.items()
                     if n in reference and tuple(t.shape) != reference[n]]  # fmt: skip
            if missing or unknown or wrong:
                raise WeightUpdateError(
                    f"{weights_path} does not fit this server's model: {len(missing)} tensors missing {missing[:3]}, "
                    f"{len(unknown)} unknown {unknown[:3]}, {len(wrong)} of the wrong shape {wrong[:3]}"
                )
        model = self.model_runner.get_model()
        initialize_layerwise_reload(model)
        try:
            model.load_weights(tensors.items())
        finally:  # also after a failed load: the layers leave the meta device
            finalize_layerwise_reload(model, self.model_config)
            repack_cpu_gemms(model)
        logger.info("miles: reloaded %d tensors from %s", len(tensors), weights_path)


def register() -> None:
    """vLLM general-plugin entry point: add the "miles" weight-transfer backend (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, __name__, "MilesWeightTransferEngine")
