"""``miles train --dry-run``: what a config would start, printed instead of started.

The plan names the Ray session and its placement groups, every engine server's command line and environment (built
by ``miles.rollout.engines.launch.planned_servers``, which the launches of SGLang-API servers and of vLLM servers in
Ray actors use too; local vLLM servers get the same ``vllm_command`` arguments from ``launch_vllm_servers``), the
router, the trainer's ranks and the weight path between them. Nothing is started, loaded or
downloaded, and the model path is printed as configured (a cluster's path need not exist on the machine planning).
Ports chosen free at launch (``engine.port`` 0) are printed as ``PORT_N``; the interpreter running Miles as
``python``.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from miles.recipes.config import MilesConfig
from miles.recipes.registry import MODELS


def launch_plan(cfg: MilesConfig) -> str:
    """The launch plan of ``cfg`` as text, one fact per line (stable for a given config: snapshot-tested).

    Args:
        cfg: a validated config (``resolve_config``).
    Returns: the plan, ending with a newline.
    """
    lines = ["# miles train --dry-run: what this config starts (nothing was started)"]
    lines += _ray(cfg)
    lines += _engine(cfg)
    lines += _trainer(cfg)
    lines += _loop(cfg)
    return "\n".join(lines) + "\n"


def _ray(cfg: MilesConfig) -> list[str]:
    execution = cfg.execution
    if execution.mode == "local":
        return ["ray: none (execution.mode local: trainer and engine driven from this process)"]
    ray = execution.ray
    if ray.address is not None:
        session = f"connect to the cluster at {ray.address}"
    else:
        cpus = f"{ray.num_cpus} logical CPUs" if ray.num_cpus is not None else "this machine's CPUs"
        session = f"start a local cluster with {cpus}"
    namespace = f", namespace {ray.namespace}" if ray.namespace else ""
    lines = [f"ray: {session}{namespace}; stopped at exit if this run started it"]
    world = cfg.train.world_size
    trainer_bundle = _bundle({"CPU": ray.trainer_cpus_per_rank})
    lines.append(
        f"ray placement group 'trainer': {world} x {trainer_bundle} ({ray.placement_strategy}), one per trainer rank"
    )
    num_servers = getattr(cfg.engine, "num_servers", 0)
    if cfg.engine.type != "embedded" and not cfg.engine.urls:
        if ray.colocate:
            lines.append(f"ray engines: server i's actor in trainer bundle i mod {world} (colocated), 0 CPUs asked")
        elif ray.engine_bundle:
            lines.append(
                f"ray placement group 'engines': {num_servers} x {_bundle(ray.engine_bundle)} "
                f"({ray.placement_strategy}), one per server, its actor asking for them"
            )
        else:
            lines.append("ray engines: each server in a Ray actor on this node asking for 0 CPUs (no engine bundles)")
    if ray.max_trainer_restarts:
        lines.append(f"ray trainer restarts: up to {ray.max_trainer_restarts}, each from the newest checkpoint")
    return lines


def _engine(cfg: MilesConfig) -> list[str]:
    from miles.rollout.engines.launch import planned_servers

    engine = cfg.engine
    model = cfg.models.policy.path
    if engine.type == "embedded":
        extras = [f"{engine.weight_codec} weights"] if engine.weight_codec != "identity" else []
        extras += ["routing replay (R3)"] if engine.routed_experts else []
        extras += ["delta updates"] if engine.delta_weights else []
        details = ", ".join([f"dtype {engine.dtype}", f"max_batch_size {engine.max_batch_size}", *extras])
        codec = f", {engine.weight_codec} codec" if engine.weight_codec != "identity" else ""
        probe = f"; a {engine.probe.tokens}-token probe after each update" if engine.probe.tokens else ""
        return [
            f"engine: embedded (in-process HF model of {model}; {details})",
            f"weights: trainer -> engine in process (miles.sync InProcessTransport{codec}){probe}",
        ]
    kind = "vLLM" if engine.type == "vllm" else ("miles serve (SGLang's API)" if engine.server == "miles" else "SGLang")
    if engine.urls:
        lines = [f"engine: {kind} servers already running at {', '.join(engine.urls)} (none started)"]
    else:
        where = "in Ray actors" if cfg.execution.mode == "ray" else "as processes of this one"
        lines = [f"engine: {engine.num_servers} {kind} server(s) {where}, started one at a time"]
        ports = [engine.port + i if engine.port else f"PORT_{i}" for i in range(engine.num_servers)]
        lora = cfg.train.lora
        rank = lora.rank if lora is not None and lora.sync == "adapter" else 0
        trusted = cfg.models.policy.trust_remote_code
        planned = planned_servers(
            engine, model, cfg.rollout.seed, ports=ports, lora_rank=rank, trust_remote_code=trusted
        )
        for server in planned:
            env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(server.env.items()))
            lines.append(f"  {server.name}: {env + ' ' if env else ''}{_command(server.argv)}")
    if engine.type == "sglang" and engine.router:
        lines.append(
            f"router: sglang-router (policy {engine.router_policy}) at {engine.host}:<free port> in front of them, "
            f"{_command([sys.executable, '-m', 'sglang_router.launch_router'])} ..."
        )
    transfer = getattr(engine, "weight_transfer", "group")
    if cfg.train.lora is not None and cfg.train.lora.sync == "adapter":
        path = "LoRA adapters only, each version written to disk and loaded by every server"
    elif transfer == "disk":
        path = "safetensors versions written to disk (engine.weight_transfer disk), every server reloads them"
    else:
        path = "a weight group from trainer rank 0 to every server (engine.weight_transfer group), bucket by bucket"
    delta = ", delta-encoded" if getattr(engine, "delta_weights", False) else ""
    probe = f"; a {engine.probe.tokens}-token probe after each update" if engine.probe.tokens else ""
    lines.append(f"weights: {path}{delta}{probe}")
    return lines


def _trainer(cfg: MilesConfig) -> list[str]:
    train = cfg.train
    world = train.world_size
    where = "Ray actors, joined over gloo" if cfg.execution.mode == "ray" else "this process"
    layout = ""
    if train.backend == "megatron":
        mg = train.megatron
        layout = f", tensor parallel {mg.tensor_parallel_size}, expert parallel {mg.expert_parallel_size}"
        if mg.pipeline_parallel_size > 1:
            layout += f", pipeline parallel {mg.pipeline_parallel_size}"
        if mg.context_parallel_size > 1:
            layout += f", context parallel {mg.context_parallel_size}"
    extras = [f"dtype {train.dtype}", f"{train.batch_layout} batches", f"micro_batch_size {train.micro_batch_size}"]
    if train.lora is not None:
        extras.append(f"LoRA rank {train.lora.rank} ({train.lora.sync} sync)")
    if train.qat != "none":
        extras.append(f"QAT {train.qat}")
    models = [f"reference {cfg.models.reference.path or cfg.models.policy.path}"] if cfg.algorithm.kl else []
    models += ["critic"] if cfg.models.critic is not None else []
    models += ["teacher"] if cfg.models.teacher is not None else []
    held = f"; also holds: {', '.join(models)}" if models else ""
    registered = ""
    if cfg.models.policy.path in MODELS:
        registered = " (a registered model, converted into the Miles cache on first use: its directory is what runs)"
    elif not Path(cfg.models.policy.path).expanduser().is_dir():
        registered = " (not a directory on this machine: the machines that run it need it there)"
    if cfg.models.policy.trust_remote_code:
        registered += "; its own Python code may run (models.policy.trust_remote_code)"
    lines = [
        f"trainer: {world} {train.backend} rank(s) in {where}{layout}; {', '.join(extras)}{held}",
        f"policy: {cfg.models.policy.path}{registered}",
    ]
    gpus = cfg.execution.ray.engine_gpus_per_server
    if cfg.execution.mode == "ray" and gpus > 8:
        lines.append(
            f"note: an engine bundle of {gpus:g} GPUs must fit on one node (a Ray bundle never spans nodes); servers "
            "across nodes are not wired yet"
        )
    if cfg.execution.mode == "ray" and gpus:
        lines.append(
            "note: the engines get GPUs, the trainer ranks CPU bundles: ranks on GPU bundles are not wired into miles "
            "train yet (train.world_size), so this trainer would run on CPUs"
        )
    return lines


def _loop(cfg: MilesConfig) -> list[str]:
    rollout, loop = cfg.rollout, cfg.loop
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    staleness = f", max weight staleness {loop.max_weight_staleness}" if loop.max_weight_staleness is not None else ""
    return [
        f"loop: {loop.mode}, {loop.num_steps} steps of {rollout.rollout_batch_size} prompts x "
        f"{rollout.n_samples_per_prompt} samples = {samples}{staleness}; checkpoint every {loop.save_interval} steps"
    ]


def _bundle(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{key}: {value:g}" for key, value in resources.items() if value) + "}"


def _command(argv: list[Any]) -> str:
    """``argv`` as a shell line, with this interpreter shown as ``python`` (the plan is for another machine)."""
    return shlex.join("python" if arg == sys.executable else str(arg) for arg in argv)


__all__ = ["launch_plan"]
