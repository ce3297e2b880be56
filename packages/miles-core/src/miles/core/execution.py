"""Ray execution (DESIGN.md section 5): a Ray session and the placement groups that hold trainer and engine actors.

Ray is an optional dependency (the ``ray`` extra) and is imported only here, lazily, so ``local`` mode runs
without it. Core receives factories from the recipes layer and never imports rollout or train; the actor groups
(``miles.train.ray_group.RayTrainGroup``, engine actors) live in their own packages and place themselves on the
bundles of a group made by ``placement_group_for``.

Usage::

    with ray_session(num_cpus=4), placement_group_for([{"CPU": 1}] * 2) as pg:
        ...  # actors with PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, Literal

logger = logging.getLogger(__name__)

RAY_INSTALL_HINT = "uv sync (the Miles workspace installs it) or pip install 'miles-core[ray]'"

# Set in this process's environment (inherited by the Ray processes it starts) unless the user set them:
_RAY_ENV_DEFAULTS = {
    # Under `uv run`, Ray >= 2.45 starts every worker with `uv run` in an uploaded copy of the working directory:
    # a fresh virtual environment without the workspace (the workers die with "No module named 'ray'") and ~15 s
    # of zipping the repository in ray.init. Off, workers run the driver's interpreter (sys.executable). Ray reads
    # it when `ray` is first imported, so it is set before that.
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    # Ray 2.60 otherwise may generate a token into ~/.ray/auth_token; the local clusters Miles starts listen on
    # this machine only. Set RAY_AUTH_MODE=token to join a cluster that uses token authentication.
    "RAY_AUTH_MODE": "disabled",
}

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


def import_ray() -> ModuleType:
    """The ``ray`` module, imported with Miles' environment defaults (``_RAY_ENV_DEFAULTS``).

    Import Ray through this function, not ``import ray``, before the first ``ray_session``: one of the defaults is
    read at Ray's import.
    Raises: ImportError naming the install command when Ray is not installed.
    """
    for name, value in _RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        import ray
    except ImportError as err:
        raise ImportError(
            f"Ray execution (execution.mode ray) needs Ray, which is not installed; install it with {RAY_INSTALL_HINT}"
        ) from err
    return ray


@contextlib.contextmanager
def ray_session(
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    include_dashboard: bool = False,
    log_to_driver: bool = True,
    runtime_env: Mapping[str, Any] | None = None,
    namespace: str | None = None,
    object_store_memory: int | None = None,
) -> Iterator[None]:
    """Start (or join) Ray for the block; ``ray.shutdown()`` on exit only if this call started it.

    If this process is already connected to Ray, the block runs in that session and the settings here are ignored
    (with a warning when any was given).

    Args:
        address: an existing cluster ("auto", "ray://host:10001", "host:6379"); None starts a local one.
        num_cpus, num_gpus: logical resources of the local cluster (None: detected). More logical CPUs than cores
            is fine for small actors (4 on a 2-core machine runs a 2-rank trainer and the driver's work).
        include_dashboard: start the dashboard (and its state API); off by default (it costs ~1 s and a port).
        log_to_driver: forward the actors' stdout/stderr to this process.
        runtime_env: Ray runtime environment of every worker (env_vars, working_dir, ...).
        namespace: Ray namespace (named actors are looked up within it); None = an anonymous one.
        object_store_memory: bytes of the local object store; None = Ray's default (30% of memory).
    Raises: ValueError if ``num_cpus``/``num_gpus``/``object_store_memory`` are given with ``address`` (a
        running cluster's resources are its own); ImportError without Ray; what ``ray.init`` raises.
    """
    ray = import_ray()
    local_only = {"num_cpus": num_cpus, "num_gpus": num_gpus, "object_store_memory": object_store_memory}
    given = sorted(name for name, value in local_only.items() if value is not None)
    if address is not None and given:
        raise ValueError(
            f"ray_session(address={address!r}) connects to a running cluster, whose resources are fixed, but "
            f"{given} were given too; drop them, or pass address=None to start a local cluster with them"
        )
    if ray.is_initialized():
        if given or address is not None or runtime_env is not None or namespace is not None:
            logger.warning("Ray is already initialized in this process; ray_session settings are ignored")
        yield
        return
    ray.init(
        address=address,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=include_dashboard,
        log_to_driver=log_to_driver,
        runtime_env=dict(runtime_env) if runtime_env is not None else None,
        namespace=namespace,
        object_store_memory=object_store_memory,
    )
    logger.info("Ray started (%s): %s", address or "local cluster", _format_resources(ray.cluster_resources()))
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def placement_group_for(
    bundles: Sequence[Mapping[str, float]],
    *,
    strategy: PlacementStrategy = "PACK",
    timeout_s: float = 60.0,
    name: str = "",
) -> Iterator[Any]:
    """A placement group of ``bundles``, created and placed for the block, removed on exit.

    Args:
        bundles: one resource dict per bundle, e.g. ``[{"CPU": 1}] * 2`` for two trainer ranks, or
            ``{"CPU": 1, "GPU": 1}`` per rank on GPUs.
        strategy: Ray's placement strategy: PACK (as few nodes as possible), SPREAD, STRICT_PACK (one node),
            STRICT_SPREAD (one node per bundle).
        timeout_s: how long to wait for the cluster to place it.
        name: the group's name in Ray (``ray.util.get_placement_group``); "" = anonymous.
    Yields: the ready ``ray.util.placement_group.PlacementGroup``.
    Raises: ValueError for no bundles, an empty bundle, or more of a resource than the whole cluster has;
        TimeoutError naming the resources asked and those available when it is not placed within ``timeout_s``
        (other actors hold them, or no node fits a bundle); ImportError without Ray.
    """
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    if not bundles or any(not bundle for bundle in bundles):
        raise ValueError(f"placement_group_for needs at least one bundle, each naming a resource; got {bundles}")
    asked = _sum_resources(bundles)
    total = ray.cluster_resources()
    short = {key: value for key, value in asked.items() if value > total.get(key, 0.0)}
    if short:
        raise ValueError(
            f"a placement group of {len(bundles)} bundles {list(bundles)} asks for {_format_resources(asked)}, but "
            f"the Ray cluster has only {_format_resources(total, keys=asked)} in all; start Ray with more "
            "(ray_session(num_cpus=...); logical CPUs may exceed cores) or ask for fewer ranks/resources per bundle"
        )
    group = placement_group([dict(bundle) for bundle in bundles], strategy=strategy, name=name)
    try:
        if not group.wait(timeout_seconds=timeout_s):
            available = ray.available_resources()
            raise TimeoutError(
                f"a placement group of {len(bundles)} bundles ({strategy}) asking for {_format_resources(asked)} was "
                f"not placed within {timeout_s}s: {_format_resources(available, keys=asked)} are available now of "
                f"{_format_resources(total, keys=asked)}. Other actors or placement groups hold the rest (close "
                "them), or no node fits one bundle; ask for less per bundle or use strategy SPREAD"
            )
        logger.debug("placement group of %d bundles ready (%s)", len(bundles), _format_resources(asked))
        yield group
    finally:
        if ray.is_initialized():  # a session that already ended removed everything with it
            remove_placement_group(group)


def _sum_resources(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + float(value)
    return total


def _format_resources(resources: Mapping[str, float], *, keys: Collection[str] | None = None) -> str:
    """'2 CPU, 1 GPU' for the named keys (default: CPU, GPU and custom resources, not memory or node ids)."""
    if keys is None:
        keys = [k for k in resources if not k.startswith("node:") and k not in ("memory", "object_store_memory")]
    return ", ".join(f"{resources.get(key, 0.0):g} {key}" for key in sorted(keys)) or "no resources"
