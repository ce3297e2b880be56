"""``RayTrainGroup``: the trainer as ``train.world_size`` Ray actors, one per placement-group bundle.

Each actor (``TrainWorker``) is one rank of a torch.distributed group (gloo on CPU; gloo + NCCL when its bundle has
a GPU) and owns the backend ``train.backend`` names (``FSDP2Backend``, or ``MegatronBackend``). The driver holds the
global batch: ``forward`` and ``forward_backward`` give each data-parallel replica its contiguous rows (an FSDP2 rank
is a replica; a Megatron replica is ``tensor_parallel_size x context_parallel_size x pipeline_parallel_size`` ranks,
which all get its rows:
``MegatronConfig.replica_of``), with the global ``LossCounts``, so the update equals one big batch on one rank (the
backends' contract).
Weights leave from rank 0's actor through the sink its ``weight_sink_factory`` builds there, never through the
driver.

Every call goes to all ranks and waits for all of them; calls from several threads (the loop, the engine
supervisor's re-weighting of a restarted server) reach every rank in the same order, so their collectives match.
A dead actor fails the call with ``TrainerRankFailed`` naming its rank, and every later call too: the surviving
ranks may be blocked in a collective with it, so the group cannot continue; ``close()`` it and rebuild (resume from
the last checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import pickle
import random
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.batch import TrainBatch
from miles.core.execution import import_ray, placement_group_for
from miles.core.rng import capture_rng_state, restore_rng_state
from miles.train.config import BACKEND_NAMES, TrainConfig, backend_class
from miles.train.fsdp2.backend import WeightSink, drain_weights
from torch import Tensor

logger = logging.getLogger(__name__)

TRAINER_RNG_FILE = "trainer_rng_rank{rank}.json"  # python/numpy/torch RNG states of each trainer rank, in save dirs
_TOKEN_LAYOUT_FIELDS = ("tokens", "attention_mask", "routed_experts")  # [B, L, ...]; other 2-D fields: [B, T]


class TrainerRankFailed(RuntimeError):
    """A trainer rank's actor died (crashed, killed, or failed to start); its ``RayTrainGroup`` is unusable.

    Attributes:
        rank: the failed rank.
    """

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def shard_rows(batch_size: int, world_size: int) -> list[range]:
    """Contiguous rows of each rank, in rank order: sizes differ by at most one (the first ``B mod W`` ranks get
    one more); a rank gets no rows when ``batch_size < world_size``."""
    base, extra = divmod(batch_size, world_size)
    ends = np.cumsum([base + (rank < extra) for rank in range(world_size)]).tolist()
    return [range(end - (base + (rank < extra)), end) for rank, end in enumerate(ends)]


def pad_shard(batch: TrainBatch, rows: range, *, num_rows: int) -> TrainBatch:
    """Rows ``rows`` of ``batch`` followed by untrained filler rows up to ``num_rows``.

    Every FSDP2 rank must run the same number of micro-batches (each forward/backward is a collective), so
    uneven shards are padded with copies of the batch's shortest row (cheapest to recompute) whose per-token [T]
    tensors are zeroed, ``loss_mask`` (all False) included: they add exactly 0 to the loss, its gradient and the
    token-mean metrics, whose denominators are the global counts. Columns keep the batch's widths ([B, L], [B, T]).

    Args:
        batch: the global batch.
        rows: this rank's rows (``shard_rows``), possibly empty.
        num_rows: rows of every rank's shard, >= len(rows).
    Returns: a [num_rows, ...] batch; outputs of rows ``len(rows):`` are to be dropped.
    """
    filler = int((batch.prompt_lengths + batch.response_lengths).argmin())  # host sync
    index = torch.tensor([*rows, *[filler] * (num_rows - len(rows))], dtype=torch.int64)
    shard = batch.select(index)
    if num_rows == len(rows):
        return shard
    real = (torch.arange(num_rows) < len(rows))[:, None]  # [num_rows, 1]
    per_token = {
        f.name: torch.where(real, value, torch.zeros((), dtype=value.dtype))
        for f in dataclasses.fields(shard)
        if isinstance(value := getattr(shard, f.name), Tensor)
        and value.dim() == 2
        and f.name not in _TOKEN_LAYOUT_FIELDS
    }
    return shard.replace(**per_token)


class TrainWorker:
    """One trainer rank inside a Ray actor: its process group, RNG seed and backend (``train.backend``).

    Built by ``RayTrainGroup`` (``ray.remote(TrainWorker)``); its methods are the group's, for this rank's shard.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.backend = None

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's IP, a free TCP port) where rank 0's TCP store will listen."""
        ray = import_ray()
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(
        self,
        master_address: str,
        master_port: int,
        *,
        num_threads: int,
        seed: int,
        timeout_s: float,
        weight_sink_factory: Callable[[], WeightSink] | None,
        backend_kwargs: Mapping[str, Any],
    ) -> frozenset[str]:
        """Join the group's process group, seed every RNG with ``seed`` (the same on every rank, so models a rank
        initializes randomly agree), build the rank-0 weight sink and the backend. Returns its outputs."""
        import torch.distributed as dist
        from transformers.utils import logging as hf_logging

        backend_cls = backend_class(backend_kwargs["train"])

        ray = import_ray()
        hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank and model; the driver owns the console
        torch.set_num_threads(num_threads)
        gpu = torch.cuda.is_available() and bool(ray.get_gpu_ids())
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if gpu else "gloo",
            init_method=f"tcp://{master_address}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        sink = weight_sink_factory() if self.rank == 0 and weight_sink_factory is not None else None
        self.backend = backend_cls(weight_sink=sink, **backend_kwargs)
        return self.backend.available_outputs

    def forward(self, batch: TrainBatch, outputs: Collection[str]) -> dict[str, Tensor]:
        """This shard's requested outputs, each [b, T] float32."""
        done = self.backend.forward(batch, outputs=outputs)
        return {name: getattr(done, name) for name in outputs}

    def forward_backward(self, batch: TrainBatch, objective: PolicyObjective, counts: LossCounts) -> dict[str, float]:
        return self.backend.forward_backward(batch, objective, counts)

    def optimizer_step(self, loss: float | None) -> dict[str, float]:
        return self.backend.optimizer_step(loss=loss)

    def push_weights(self, version: int) -> None:
        self.backend.push_weights(version)

    def push_weights_to(self, sink_factory: Callable[[], Any], version: int) -> None:
        """Send the full weights as ``version`` through a one-off sink ``sink_factory`` builds here (rank 0; every
        rank gathers), after this rank's own sink left its weight group (``close()``: the group had a server that
        is gone; the next ``push_weights`` joins a new one with every server)."""
        named = self.backend.export_weights()  # collective, one tensor at a time
        sink = None
        try:
            if self.rank == 0:
                if self.backend.weight_sink is not None:
                    self.backend.weight_sink.close()
                sink = sink_factory()
                sink.push(named, version=version)
        finally:
            drain_weights(named)  # the other ranks gather every tensor, whatever happened here
            if sink is not None:
                sink.close()

    def full_state_dict(self) -> dict[str, Tensor] | None:
        state = self.backend.full_state_dict()  # collective
        return state if self.rank == 0 else None

    def full_gradients(self) -> dict[str, Tensor] | None:
        grads = self.backend.full_gradients()  # collective
        return grads if self.rank == 0 else None

    def rng_state(self) -> dict[str, Any]:
        """This rank's python/numpy/torch RNG states (what ``save`` writes for it)."""
        return capture_rng_state()

    def save(self, path: Path) -> None:
        """The backend's checkpoint, plus every rank's RNG states, all written by rank 0."""
        import torch.distributed as dist

        states = [None] * self.world_size
        dist.all_gather_object(states, capture_rng_state())  # first: after save's collectives only rank 0 works
        self.backend.save(path)
        if self.rank == 0:
            for rank, state in enumerate(states):
                (Path(path) / TRAINER_RNG_FILE.format(rank=rank)).write_text(json.dumps(state))

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote; this rank's RNG continues where it was saved (if the file is there)."""
        self.backend.load(path)
        rng_file = Path(path) / TRAINER_RNG_FILE.format(rank=self.rank)
        if rng_file.is_file():
            restore_rng_state(json.loads(rng_file.read_text()))
        else:
            logger.warning("%s has no RNG state of trainer rank %d; its RNG continues from the seed", path, self.rank)


class RayTrainGroup:
    """``TrainBackend`` running ``train.world_size`` ranks of ``train.backend`` as Ray actors, one per bundle.

    Needs a Ray session (``miles.core.execution.ray_session``). Construction starts the actors, joins them into
    one process group and builds each rank's ``FSDP2Backend`` or ``MegatronBackend`` (loading the models once per
    rank).

    Args:
        model_path: HF model directory, readable on every node.
        train: the trainer section; ``train.world_size`` is the number of ranks.
        temperature: sampling temperature of the rollouts (``FSDP2Backend``).
        weight_sink_factory: a picklable zero-argument callable, run inside rank 0's actor, that builds the sink
            ``push_weights`` sends through (a ``miles.sync.WeightSender`` joined to the engines); None = no push.
        resources_per_rank: one bundle per rank, e.g. ``{"CPU": 1}`` or ``{"CPU": 4, "GPU": 1}``.
        placement_group: an existing group to place the ranks on (bundles ``first_bundle`` ..
            ``first_bundle + world_size - 1``, e.g. shared with colocated engines); None = a new one, owned and
            removed by ``close()``.
        first_bundle: the bundle index of rank 0 in ``placement_group``.
        seed: RNG seed of every rank (random initializations, e.g. a critic's head, agree across ranks).
        collective_timeout_s: how long a rank waits in a collective (the process group's timeout); a rank whose
            peer raised is freed after this.
        placement_timeout_s: how long to wait for the cluster to place the ranks.
        **backend_kwargs: the rest of the backends' arguments (reference_path, teacher_path,
            teacher_temperature, critic_path, critic_lr), picklable.
    Raises: ImportError without Ray; ValueError when ``train.world_size`` is not a multiple of the Megatron
        tensor-parallel size; ValueError/TimeoutError from ``placement_group_for``; TrainerRankFailed if a rank dies
        while starting (the message holds its error, e.g. a bad model path).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        train: TrainConfig,
        temperature: float,
        weight_sink_factory: Callable[[], WeightSink] | None = None,
        resources_per_rank: Mapping[str, float] | None = None,
        placement_group: Any = None,
        first_bundle: int = 0,
        seed: int = 0,
        collective_timeout_s: float = 1800.0,
        placement_timeout_s: float = 60.0,
        **backend_kwargs: Any,
    ) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t0 = time.perf_counter()
        resources = dict(resources_per_rank or {"CPU": 1.0})
        self.world_size = train.world_size
        self.backend_name = train.backend
        # ranks that run the same rows: a Megatron replica's tensor-parallel ranks and pipeline stages
        self.replica_of = [
            train.megatron.replica_of(rank, self.world_size) if train.backend == "megatron" else rank
            for rank in range(self.world_size)
        ]
        self.weight_sink_factory = weight_sink_factory
        self._stack = contextlib.ExitStack()
        self._failure: TrainerRankFailed | None = None
        self._closed = False
        self._objective: tuple[PolicyObjective, Any] | None = None  # (objective, its object-store ref)
        self._actors: list[Any] = []
        self._submit = threading.Lock()  # one call's tasks reach every rank before another call's
        self._trained_since_push = False  # an optimizer step (or a load) since the last push_weights
        try:
            if placement_group is None:
                placement_group = self._stack.enter_context(
                    placement_group_for([resources] * self.world_size, timeout_s=placement_timeout_s)
                )
            self._stack.callback(self._kill_actors)  # before the placement group is removed
            custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
            worker = ray.remote(TrainWorker)
            self._actors = [
                worker.options(
                    num_cpus=resources.get("CPU", 0.0),
                    num_gpus=resources.get("GPU", 0.0),
                    resources=custom,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group, placement_group_bundle_index=first_bundle + rank
                    ),
                ).remote(rank, self.world_size)
                for rank in range(self.world_size)
            ]
            master_address, master_port = self._wait([self._actors[0].rendezvous_address.remote()], "start")[0]
            kwargs = dict(model_path=model_path, train=train, temperature=temperature, **backend_kwargs)
            self.available_outputs: frozenset[str] = self._call(
                "setup",
                master_address,
                master_port,
                num_threads=max(1, int(resources.get("CPU", 1))),
                seed=seed,
                timeout_s=collective_timeout_s,
                weight_sink_factory=weight_sink_factory,
                backend_kwargs=kwargs,
            )[0]
        except BaseException:
            self._stack.close()
            raise
        logger.info(
            "started %d %s trainer ranks on Ray (%s each) in %.1fs",
            self.world_size,
            BACKEND_NAMES[self.backend_name],
            resources,
            time.perf_counter() - t0,
        )

    # -- TrainBackend ------------------------------------------------------------------------------
    def forward(self, batch: TrainBatch, *, outputs: Collection[str]) -> TrainBatch:
        """The batch with the requested ``outputs`` set, each [B, T] float32, computed by the ranks on their rows.

        Raises: ValueError naming an output the ranks cannot compute; TrainerRankFailed.
        """
        outputs = sorted(outputs)
        rows, shards = self._shards(batch)
        answers = self._call("forward", per_rank=[(shard, outputs) for shard in shards])
        parts = [answers[self.replica_of.index(replica)] for replica in range(len(rows))]  # its first rank's
        changes = {name: torch.cat([part[name][: len(r)] for part, r in zip(parts, rows)]) for name in outputs}
        return batch.replace(**changes)

    def forward_backward(self, batch: TrainBatch, objective: PolicyObjective, counts: LossCounts) -> dict[str, float]:
        """Accumulate the gradients of ``objective`` over the global ``batch``, each rank on its rows.

        Args:
            batch: the whole global batch of this optimizer step (or one micro-step of it).
            objective: travels to the actors pickled (cloudpickle; put in the object store once per objective).
            counts: the global denominators (``LossCounts.of(batch)`` for the whole step).
        Returns: metrics reduced over ranks (rank 0's; every rank holds the same).
        Raises: TypeError if ``objective`` does not pickle; what the objective raises; TrainerRankFailed.
        """
        _, shards = self._shards(batch)
        objective_ref = self._objective_ref(objective)
        return self._call("forward_backward", per_rank=[(shard, objective_ref, counts) for shard in shards])[0]

    def optimizer_step(self, *, loss: float | None = None) -> dict[str, float]:
        """``FSDP2Backend.optimizer_step`` on every rank; returns rank 0's grad_norm, lr, skipped_steps."""
        self._trained_since_push = True
        return self._call("optimizer_step", loss)[0]

    def push_weights(self, version: int) -> None:
        """Send the full weights as update ``version`` from rank 0's actor (every rank gathers).

        Raises: RuntimeError without a ``weight_sink_factory``; what the sink raises (``WeightUpdateError``,
            ``TimeoutError``: the engines keep their version); TrainerRankFailed.
        """
        if self.weight_sink_factory is None:
            raise RuntimeError(
                "push_weights: this RayTrainGroup has no weight sink; pass weight_sink_factory=... (a picklable "
                "callable building a miles.sync.WeightSender inside rank 0's actor)"
            )
        self._call("push_weights", version)
        self._trained_since_push = False

    def push_weights_to(self, sink_factory: Callable[[], WeightSink], *, version: int) -> None:
        """Send the current full weights as update ``version`` through a one-off sink ``sink_factory`` builds in
        rank 0's actor, e.g. to one engine server that restarted (and so left the weight group): rank 0's own sink
        first leaves its group (its ``close()``), and its next ``push_weights`` joins a new one with every server.

        Meant for ``version`` = the last version pushed: the weights are the trainer's now, so after an optimizer
        step that no ``push_weights`` followed yet (async loops), the server gets newer weights under that version
        until the next push (logged as a warning). Thread-safe with the other calls; collective (every rank gathers).

        Args:
            sink_factory: picklable, zero-argument; builds a sink with ``push(named_tensors, version=)`` and
                ``close()`` (``SGLangSinkFactory`` of the one server).
            version: the version the server reports afterwards (>= 1).
        Raises: RuntimeError without a ``weight_sink_factory`` (rank 0's sink); what the one-off sink raises
            (``WeightUpdateError``); TrainerRankFailed.
        """
        if self.weight_sink_factory is None:
            raise RuntimeError("push_weights_to: this RayTrainGroup pushes no weights (no weight_sink_factory)")
        if self._trained_since_push:
            logger.warning(
                "re-weighting an engine as v%d with weights trained since then (not published yet); the next "
                "publish replaces them",
                version,
            )
        self._call("push_weights_to", sink_factory, version)

    def save(self, path: Path) -> None:
        """Write the backend's checkpoint into ``path`` (rank 0 writes; a node-local path works for one node
        only) plus ``trainer_rng_rank{R}.json``, the RNG states of each rank. Raises as ``FSDP2Backend.save``."""
        self._call("save", Path(path))

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote, RNG states included; every rank reads ``path``."""
        self._trained_since_push = True  # the engines hold other weights until the next push
        self._call("load", Path(path))

    # -- diagnostics (collective) ------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, Tensor]:
        """Unsharded fp32 weights by HF name, gathered on rank 0 and copied to the driver (tests, diagnostics)."""
        return self._call("full_state_dict")[0]

    def full_gradients(self) -> dict[str, Tensor]:
        """Unsharded accumulated gradients by parameter name, via rank 0 (tests, diagnostics)."""
        return self._call("full_gradients")[0]

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def actors(self) -> list[Any]:
        """The rank actors' handles, in rank order (for fault-injection tests and Ray tooling)."""
        return list(self._actors)

    def close(self) -> None:
        """Kill every rank's actor and remove the placement group this group made; idempotent."""
        self._stack.close()
        self._closed = True

    def __enter__(self) -> RayTrainGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------
    def _shards(self, batch: TrainBatch) -> tuple[list[range], list[TrainBatch]]:
        """Each replica's rows and each rank's shard (its replica's rows, padded to the largest replica's)."""
        rows = shard_rows(batch.batch_size, max(self.replica_of) + 1)
        num_rows = max(1, len(rows[0]))  # replica 0 has the most rows; a rank never gets an empty batch
        shards = [pad_shard(batch, r, num_rows=num_rows) for r in rows]
        return rows, [shards[replica] for replica in self.replica_of]

    def _objective_ref(self, objective: PolicyObjective) -> Any:
        if self._objective is None or self._objective[0] is not objective:
            ray = import_ray()
            try:
                self._objective = (objective, ray.put(objective))
            except (TypeError, AttributeError, pickle.PicklingError) as err:
                raise TypeError(
                    f"the objective ({type(objective).__name__}) must pickle to reach the trainer actors, but: {err}. "
                    "A loss or reducer plugin (algorithm.loss.policy_loss_path / reducer_path) must be a module-level "
                    "function of an importable module"
                ) from err
        return self._objective[1]

    def _call(self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank (``per_rank[r]`` as rank r's positional args, else ``args``); results in
        rank order."""
        if self._closed:
            raise RuntimeError(f"RayTrainGroup.{method}: the group is closed (its actors are gone); build a new one")
        if self._failure is not None:
            raise self._failure
        with self._submit:  # Ray runs one caller's tasks on an actor in submission order
            refs = [
                getattr(actor, method).remote(*(per_rank[rank] if per_rank is not None else args), **kwargs)
                for rank, actor in enumerate(self._actors)
            ]
        return self._wait(refs, method)

    def _wait(self, refs: list[Any], method: str) -> list[Any]:
        """Results of one call's refs (ref r = rank r).

        A dead actor fails the call at once, and the group for good: the live ranks may wait for it in a
        collective. An error raised by the method itself is re-raised (the lowest rank's) once every rank returned:
        the ranks raise alike before or inside a collective (the inputs and reduced values they check are the
        same), and only rank 0 works after the last one (the sink's push, checkpoint writes), so the group stays
        usable. A rank that raised alone before a collective frees its peers after ``collective_timeout_s``.
        """
        ray = import_ray()
        from ray.exceptions import RayActorError

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        errors: dict[int, Exception] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as err:
                self._failure = TrainerRankFailed(
                    rank,
                    f"trainer rank {rank} of {self.world_size} died during {method}: {err}\nThe other ranks may be "
                    "blocked in a collective with it, so this RayTrainGroup cannot continue: close() it and build a "
                    "new one (resume from the last checkpoint).",
                )
                raise self._failure from err
            except Exception as err:  # the method raised on this rank (a RayTaskError, an instance of its cause)
                errors[rank] = err
        if errors:
            raise errors[min(errors)]
        return results

    def _kill_actors(self) -> None:
        ray = import_ray()
        if ray.is_initialized():
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
        self._actors = []
