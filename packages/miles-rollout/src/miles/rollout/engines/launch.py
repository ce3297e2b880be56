"""Build the configured engine: the embedded one in this process, or server engines Miles starts (and stops).

``launch_engine(cfg.engine, model_path, log_dir=...)`` returns the ``Engine``, the weight sink the training backend
pushes into (``push(named_tensors, version=)``) and ``close``, which stops every process it started. For server
engines it also returns a ``sink_factory``: a picklable description of the servers that builds their weight sink in
another process (rank 0 of a Ray trainer), so the weights go from there to the servers, never through this one.
With ``server_actors=True`` (Ray mode) SGLang-API servers run in Ray actors that Ray restarts, and
``LaunchedEngine.supervise`` starts the health monitor that restarts, re-weights and re-registers a dead one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from miles.rollout.config import EmbeddedEngineConfig, HealthCheckConfig, SGLangEngineConfig, VLLMEngineConfig

logger = logging.getLogger(__name__)


@dataclass
class LaunchedEngine:
    """An engine ready to serve, its weight sink, and what stops it.

    Attributes:
        engine: the ``Engine`` (``EmbeddedEngine``, ``VLLMEngine``, ``SGLangEngine``).
        weight_sink: receives the trainer's full weights as one version (``push(named_tensors, version=)``).
        description: one line for the log: which engine, where.
        closers: called in reverse order by ``close`` (servers, router).
        processes: the server (and router) processes Miles started, whose logs ``move_logs`` moves.
        sink_factory: server engines: a picklable zero-argument callable (``SGLangSinkFactory``,
            ``VLLMSinkFactory``) that builds an equivalent weight sink in the process calling it, e.g. rank 0's
            Ray trainer actor; None for the embedded engine, whose weights can only be pushed from this process.
        server_actors: the ``ServerActorHandle`` of each server started in a Ray actor (``launch_engine(...,
            server_actors=True)``), which ``supervise`` watches; empty otherwise.
        router: the sglang-router Miles started (``SGLangRouter``), or None.
        health_check: the supervisor's settings (``engine.health_check``) for ``server_actors``.
        actor_logs: the log files of ``server_actors``, which every incarnation of an actor reopens by path.
        rotation: what the supervisor takes a dead server out of and puts a restored one back into
            (``remove_worker`` / ``add_worker``): the sglang-router, or the ``VLLMEngine``, which routes its own
            requests; None: nothing (servers without a router are reachable again before their resync).
    """

    engine: Any
    weight_sink: Any
    description: str
    closers: list[Callable[[], None]] = field(default_factory=list)
    processes: list[Any] = field(default_factory=list)
    sink_factory: Callable[[], Any] | None = None
    server_actors: list[Any] = field(default_factory=list)
    router: Any = None
    health_check: HealthCheckConfig | None = None
    actor_logs: list[Path] = field(default_factory=list)
    rotation: Any = None

    def move_logs(self, directory: Path) -> None:
        """Move the started processes' log files into ``directory`` (same file system: they keep writing).

        A server actor's log is hard-linked there instead (a restarted incarnation appends to the path it was
        given, which is the same file); ``close`` removes the first names last.
        """
        for process in self.processes:
            if process.log_path.exists():
                directory.mkdir(parents=True, exist_ok=True)
                before = process.log_path.parent
                process.log_path = process.log_path.rename(directory / process.log_path.name)
                with contextlib.suppress(OSError):  # the directory they started in, once empty
                    before.rmdir()
        linked = [path for path in self.actor_logs if path.exists()]
        for path in linked:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / path.name).unlink(missing_ok=True)  # a resumed run's: replaced, as a rename would
            os.link(path, directory / path.name)
        if linked:
            self.closers.insert(0, lambda: _unlink_logs(linked))

    def supervise(self, on_restarted: Callable[[str], None]) -> Any:
        """Start an ``EngineSupervisor`` over ``server_actors`` (``health_check``, ``router``); ``close`` stops it
        before the servers. Returns it (``publish_guard``, ``check``).

        Args:
            on_restarted: brings a restarted server (its URL) to the run's current weights; see ``EngineSupervisor``.
        Raises: RuntimeError when no server runs in a Ray actor (``launch_engine(..., server_actors=True)``).
        """
        from miles.rollout.engines.supervisor import EngineSupervisor

        if not self.server_actors:
            raise RuntimeError(
                "supervise: no engine server runs in a Ray actor; launch the engine with server_actors=True (Ray "
                "mode, servers Miles starts)"
            )
        supervisor = EngineSupervisor(
            self.server_actors, config=self.health_check, on_restarted=on_restarted, router=self.rotation
        ).start()
        self.closers.append(supervisor.stop)
        return supervisor

    def close(self) -> None:
        """Stop what was started for this engine (idempotent)."""
        while self.closers:
            self.closers.pop()()


def _unlink_logs(paths: list[Path]) -> None:
    """Remove the first names of hard-linked logs, and their directory once it is empty."""
    for path in paths:
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        paths[0].parent.rmdir()


def stop_token_ids(model_path: str | Path) -> list[int]:
    """The model's eos ids (generation_config.json, else config.json), which end a response."""
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


@dataclass(frozen=True)
class SGLangSinkFactory:
    """Builds the ``SGLangWeightSink`` of SGLang-API servers (SGLang, ``miles serve``) where it is called.

    Picklable (URLs and settings only), for rank 0's Ray trainer actor: the sink it builds there joins the
    servers' weight group from that process (its address towards the first server is the group's rendezvous).

    Attributes:
        urls: the servers' base URLs (every one receives each update).
        timeout_s: the sink's join / request / broadcast timeout.
        disk_root: ``engine.weight_transfer`` disk: the shared directory of an ``SGLangDiskWeightSink``; "" = the
            weight group's ``SGLangWeightSink``.
        config_from: the HF model directory whose config each disk version gets.
        lora_rank: ``train.lora.sync adapter``: the servers apply LoRA adapters and the sink is a
            ``SGLangAdapterSink`` writing to ``disk_root``; 0 = full weights.
    """

    urls: tuple[str, ...]
    timeout_s: float = 300.0
    disk_root: str = ""
    config_from: str = ""
    lora_rank: int = 0

    def __call__(self) -> Any:
        from miles.rollout.engines.sglang import SGLangDiskWeightSink, SGLangEngine, SGLangWeightSink

        if self.lora_rank:
            from miles.rollout.engines.sglang_lora import SGLangAdapterSink

            return SGLangAdapterSink(self.urls, root=self.disk_root, timeout_s=self.timeout_s)
        client = SGLangEngine(self.urls)  # an HTTP client only: the sink reads its worker URLs
        if self.disk_root:
            return SGLangDiskWeightSink(
                client, root=self.disk_root, config_from=self.config_from or None, timeout_s=self.timeout_s
            )
        return SGLangWeightSink(client, master_address=address_towards(self.urls[0]), timeout_s=self.timeout_s)

    def only(self, url: str) -> SGLangSinkFactory:
        """The factory of a sink for server ``url`` alone (one of ``urls``), e.g. a restarted one that left the
        weight group. Raises: ValueError for a URL that is not one of ``urls``."""
        if url not in self.urls:
            raise ValueError(f"SGLangSinkFactory.only: {url} is not one of the servers {list(self.urls)}")
        return dataclasses.replace(self, urls=(url,))


@dataclass(frozen=True)
class VLLMSinkFactory:
    """Builds the ``VLLMWeightSink`` of vLLM servers where it is called (picklable, like ``SGLangSinkFactory``).

    Its sink sets the versions on the servers; the driver's ``VLLMEngine`` reads them back on ``resume`` (see
    ``launch_engine(remote_sink=True)``). The weight group's rendezvous is 127.0.0.1 (``VLLMWeightSink``): the
    trainer's rank 0 must share the servers' node.

    Attributes:
        urls: the servers' base URLs.
        model: the served model name (``VLLMEngine.model``).
        dtype: the servers' dtype ("fp32" / "bf16"), for the checksums.
        verify: compare the servers' weight checksums with the pushed tensors after each push.
        timeout_s: the weight group's and each request's timeout.
        delta: send delta updates (``engine.delta_weights``).
        disk_root: ``engine.weight_transfer`` disk: the shared directory of a ``VLLMDiskWeightSink``; "" = the
            weight group's ``VLLMWeightSink``. With ``lora_rank``: where the adapter versions go.
        lora_rank: ``train.lora.sync adapter``: the servers apply a LoRA adapter of this rank and the sink is a
            ``VLLMAdapterSink`` writing to ``disk_root``; 0 = full weights.
    """

    urls: tuple[str, ...]
    model: str
    dtype: str = "fp32"
    verify: bool = True
    timeout_s: float = 600.0
    delta: bool = False
    disk_root: str = ""
    lora_rank: int = 0

    def __call__(self) -> Any:
        from miles.rollout.engines.vllm import VLLMEngine

        adapter = _adapter_name(self.lora_rank)
        client = VLLMEngine(self.urls, model=self.model, request_timeout_s=self.timeout_s, adapter=adapter)
        return _vllm_sink(client, self)

    def only(self, url: str) -> VLLMSinkFactory:
        """The factory of a sink for server ``url`` alone (one of ``urls``), e.g. a restarted one that left the
        weight group. Raises: ValueError for a URL that is not one of ``urls``."""
        if url not in self.urls:
            raise ValueError(f"VLLMSinkFactory.only: {url} is not one of the servers {list(self.urls)}")
        return dataclasses.replace(self, urls=(url,))


def _vllm_sink(engine: Any, factory: VLLMSinkFactory) -> Any:
    """The weight sink ``factory`` describes, on ``engine`` (a ``VLLMEngine``)."""
    if factory.lora_rank:
        from miles.rollout.engines.vllm_lora import VLLMAdapterSink

        return VLLMAdapterSink(engine, root=factory.disk_root, timeout_s=factory.timeout_s)
    if factory.disk_root:
        from miles.rollout.engines.vllm_disk import VLLMDiskWeightSink

        return VLLMDiskWeightSink(
            engine,
            root=factory.disk_root,
            config_from=factory.model,
            dtype=factory.dtype,
            verify=factory.verify,
            timeout_s=factory.timeout_s,
        )
    from miles.rollout.engines.vllm import VLLMWeightSink

    return VLLMWeightSink(
        engine, dtype=factory.dtype, verify=factory.verify, timeout_s=factory.timeout_s, delta=factory.delta
    )


def address_towards(url: str) -> str:
    """This host's IP address on the route to ``url``'s host (127.0.0.1 for a loopback server): where a server
    reaches a weight group this process opens. No packet is sent (a UDP socket only picks the route)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(host), parts.port or 80))
        return sock.getsockname()[0]


def launch_engine(
    cfg: Any,
    model_path: str | Path,
    *,
    log_dir: str | Path,
    seed: int = 0,
    remote_sink: bool = False,
    server_actors: bool = False,
    colocate_with: Any = None,
    engine_placement: Any = None,
    weight_dir: str | Path | None = None,
    lora_rank: int = 0,
    trust_remote_code: bool = False,
) -> LaunchedEngine:
    """Start the engine ``cfg`` (the ``engine`` config section) describes, for the model at ``model_path``.

    Args:
        remote_sink: the weights are pushed from another process through ``LaunchedEngine.sink_factory`` (a Ray
            trainer actor): a vLLM engine then reads its weight version from the servers on every ``resume``
            (SGLang engines always do), since the sink that sets it is not this process's.
        server_actors: execution.mode ray: the servers Miles starts each run in a Ray actor (``ServerActor``, in
            the Ray session this process has), which Ray restarts; with ``engine.router`` the router starts
            first. ``LaunchedEngine.supervise`` then watches them. Servers named by ``engine.urls`` stay as they
            are.
        colocate_with: with ``server_actors``, the trainer's Ray placement group (``execution.ray.colocate``):
            server i's actor runs in its bundle i modulo the bundle count, beside trainer rank i. None: on this
            (the driver's) node, outside any bundle.
        engine_placement: with ``server_actors``, a placement group of one bundle per server
            (``execution.ray.engine_cpus_per_server`` / ``engine_gpus_per_server``): server i's actor runs in bundle
            i and asks for its resources (disaggregated engine bundles). None: as ``colocate_with`` None.
        weight_dir: ``engine.weight_transfer`` disk without ``engine.weight_dir``: the directory the versions go
            to, removed by ``close``.
        lora_rank: ``train.lora.sync adapter``: the rank of the adapter the engine applies on top of its base
            (vLLM / SGLang: servers started with runtime LoRA loading, adapter versions written beside the run as
            with ``engine.weight_transfer`` disk; the embedded engine and ``miles serve`` take adapters as they
            come); 0 = full weights.
        trust_remote_code: ``models.policy.trust_remote_code``: the engine runs the model's own code (the
            embedded engine's ``from_pretrained``, the servers' ``--trust-remote-code``).
    ``engine.dtype`` auto is decided here for this machine (``miles.core.precision.resolve_dtype``).
    Raises: ServerStartError (one message with the server's log tail and the fix) when a server does not start;
        EngineRestartError (its actor's error) when a server actor does not start.
    """
    from miles.core.precision import resolve_dtype

    cfg = cfg.model_copy(update={"dtype": resolve_dtype(cfg.dtype)})  # engine.dtype auto, decided for this machine
    if isinstance(cfg, EmbeddedEngineConfig):
        return _embedded(cfg, model_path, trust_remote_code=trust_remote_code)
    disk_root = _disk_root(cfg, weight_dir, log_dir, adapters=bool(lora_rank))
    if isinstance(cfg, VLLMEngineConfig):
        launched = _vllm(
            cfg, model_path, Path(log_dir), seed, remote_sink=remote_sink, disk_root=disk_root,
            server_actors=server_actors, engine_placement=engine_placement, lora_rank=lora_rank,
            trust_remote_code=trust_remote_code,
        )  # fmt: skip
    elif isinstance(cfg, SGLangEngineConfig):
        launched = _sglang(
            cfg,
            model_path,
            Path(log_dir),
            seed,
            server_actors=server_actors,
            colocate_with=colocate_with,
            engine_placement=engine_placement,
            disk_root=disk_root,
            lora_rank=lora_rank,
            trust_remote_code=trust_remote_code,
        )
    else:
        raise TypeError(f"unknown engine config {type(cfg).__name__}")
    if disk_root and not cfg.weight_dir:
        launched.closers.insert(0, lambda: shutil.rmtree(disk_root, ignore_errors=True))
    return launched


def _disk_root(cfg: Any, weight_dir: str | Path | None, log_dir: str | Path, *, adapters: bool = False) -> str:
    """Where ``engine.weight_transfer`` disk (or a vLLM engine's adapter updates) writes the versions ("" for the
    weight group)."""
    if getattr(cfg, "weight_transfer", "group") != "disk" and not adapters:
        return ""
    return str(Path(cfg.weight_dir or weight_dir or Path(log_dir) / "weights").resolve())


def _embedded(cfg: EmbeddedEngineConfig, model_path: str | Path, *, trust_remote_code: bool) -> LaunchedEngine:
    from miles.rollout.engines.embedded import EmbeddedEngine
    from miles.sync import InProcessTransport, WeightSender

    engine = EmbeddedEngine(
        model_path,
        dtype=cfg.dtype,
        max_batch_size=cfg.max_batch_size,
        logprob_mode=cfg.logprob_mode,
        routed_experts=cfg.routed_experts,
        weight_codec=cfg.weight_codec,
        trust_remote_code=trust_remote_code,
    )
    sender = WeightSender(InProcessTransport(engine.receiver), codec=cfg.weight_codec, delta=cfg.delta_weights)
    extras = [f"{cfg.weight_codec} weights"] if cfg.weight_codec != "identity" else []
    extras += ["delta updates"] if cfg.delta_weights else []
    description = f"embedded ({', '.join([cfg.dtype, *extras])})"
    return LaunchedEngine(engine, sender, description, closers=[engine.close])


def _server_env(cfg: Any) -> dict[str, str]:
    env = dict(cfg.env)
    if cfg.threads:
        env.setdefault("OMP_NUM_THREADS", str(cfg.threads))
    return env


def _vllm(
    cfg: VLLMEngineConfig,
    model_path: str | Path,
    log_dir: Path,
    seed: int,
    *,
    remote_sink: bool,
    disk_root: str,
    server_actors: bool = False,
    engine_placement: Any = None,
    lora_rank: int = 0,
    trust_remote_code: bool = False,
) -> LaunchedEngine:
    from miles.rollout.engines.vllm import VLLMEngine, image_token_id, launch_vllm_servers

    servers = []
    urls = list(cfg.urls)
    launched = LaunchedEngine(None, None, "")
    if server_actors and not urls:
        urls = _start_vllm_actors(
            cfg,
            model_path,
            log_dir,
            launched,
            seed,
            engine_placement=engine_placement,
            lora_rank=lora_rank,
            trust_remote_code=trust_remote_code,
        )
    elif not urls:
        servers = launch_vllm_servers(
            model_path,
            num_servers=cfg.num_servers,
            python=cfg.python,  # "" = default_vllm_python()
            host=cfg.host,
            port=cfg.port,
            log_dir=log_dir,
            startup_timeout_s=cfg.startup_timeout_s,
            env={**_server_env(cfg), "VLLM_CPU_KVCACHE_SPACE": f"{cfg.kv_cache_gib:g}", **_lora_env(lora_rank)},
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager,
            seed=seed,
            trust_remote_code=trust_remote_code,
            extra_args=[*_lora_args(lora_rank), *cfg.extra_args],
        )
        urls = [server.url for server in servers]
    try:
        stop_ids = stop_token_ids(model_path)
    except BaseException:  # nothing else may keep the servers it started running
        launched.close()
        for server in servers:
            server.stop()
        raise
    engine = VLLMEngine(
        urls,
        model=str(model_path),
        stop_token_ids=stop_ids,
        request_timeout_s=cfg.request_timeout_s,
        max_retries=cfg.max_retries,
        servers=servers,
        version_from_servers=remote_sink,
        supervised=bool(launched.server_actors),
        adapter=_adapter_name(lora_rank),
        image_token_id=image_token_id(model_path),
    )
    factory = VLLMSinkFactory(
        tuple(engine.urls),
        model=str(model_path),
        dtype=cfg.dtype,
        verify=cfg.verify_weights,
        timeout_s=cfg.request_timeout_s,
        delta=cfg.delta_weights,
        disk_root=disk_root,
        lora_rank=lora_rank,
    )
    sink = _vllm_sink(engine, factory)
    where = ", ".join(urls)
    if launched.server_actors:
        where += ", each in a Ray actor" + (" in an engine bundle of its own" if engine_placement is not None else "")
        launched.rotation = engine  # the engine routes its own requests: the supervisor takes servers out of it
    else:
        where += f" (logs in {log_dir})" if servers else " (already running)"
    if lora_rank:
        where += f", LoRA adapters (rank {lora_rank}) through {disk_root}"
    elif disk_root:
        where += f", weights through {disk_root}"
    launched.engine, launched.weight_sink, launched.sink_factory = engine, sink, factory
    launched.description = f"vLLM {cfg.dtype} at {where}"
    launched.closers.append(engine.close)
    launched.processes.extend(servers)
    return launched


def _adapter_name(lora_rank: int) -> str | None:
    from miles.rollout.engines.vllm_lora import ADAPTER_NAME

    return ADAPTER_NAME if lora_rank else None


def _lora_args(lora_rank: int) -> list[str]:
    from miles.rollout.engines.vllm_lora import lora_server_args

    return lora_server_args(lora_rank) if lora_rank else []


def _lora_env(lora_rank: int) -> dict[str, str]:
    from miles.rollout.engines.vllm_lora import LORA_ENV

    return dict(LORA_ENV) if lora_rank else {}


def _start_vllm_actors(
    cfg: VLLMEngineConfig,
    model_path: str | Path,
    log_dir: Path,
    launched: LaunchedEngine,
    seed: int,
    *,
    engine_placement: Any = None,
    lora_rank: int = 0,
    trust_remote_code: bool = False,
) -> list[str]:
    """Start ``cfg.num_servers`` vLLM servers, each owned by a ``ServerActor`` (see ``_own_by_actors``); a
    restarted one starts paused (``/pause?mode=keep``) until the supervisor has resynced and resumed it.
    Returns their URLs. Raises: ServerStartError (install command, missing model) before any actor starts."""
    from miles.rollout.engines.server import ServerStartError
    from miles.rollout.engines.server_actor import ServerSpec
    from miles.rollout.engines.vllm import check_vllm_installed, default_vllm_python

    if not (Path(model_path) / "config.json").is_file():
        raise ServerStartError(
            f"no model at {model_path} (no config.json there); set models.policy.path to an HF model directory"
        )
    has_torchvision = check_vllm_installed(cfg.python or default_vllm_python())
    specs = []
    planned = planned_servers(
        cfg,
        model_path,
        seed,
        ports=_server_ports(cfg),
        lora_rank=lora_rank,
        no_torchvision=not has_torchvision,
        trust_remote_code=trust_remote_code,
    )
    for i, server in enumerate(planned):
        specs.append(
            ServerSpec(
                server.name,
                server.argv,
                port=server.port,
                log_path=log_dir / f"vllm_{i}.log",
                host=cfg.host,
                env=server.env,
                startup_timeout_s=cfg.startup_timeout_s,
                hold_path="/pause?mode=keep",
            )
        )
    try:
        return _own_by_actors(specs, cfg, launched, engine_placement=engine_placement)
    except BaseException:
        launched.close()
        raise


def moe_routing_shape(model_path: str | Path) -> tuple[int, int]:
    """(num_layers, top_k) of the MoE model at ``model_path`` from its HF ``config.json``: ``num_hidden_layers`` and
    ``num_experts_per_tok`` (Qwen3-MoE, DeepSeek-V3 / Kimi K2, GLM-4.5 MoE, Mixtral, gpt-oss), the shape of the
    routing SGLang reports per token (every layer, dense ones included, as its capturer records them).
    Raises: ServerStartError (one line) when the file or either key is missing, i.e. not an MoE model.
    """
    import json

    from miles.rollout.engines.server import ServerStartError

    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ServerStartError(f"engine.routed_experts needs the model's config.json: {path}: {err}") from None
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    layers, top_k = config.get("num_hidden_layers"), config.get("num_experts_per_tok")
    if not isinstance(layers, int) or not isinstance(top_k, int) or layers < 1 or top_k < 1:
        raise ServerStartError(
            f"engine.routed_experts is true but {path} has no num_hidden_layers / num_experts_per_tok "
            f"({layers!r} / {top_k!r}): routing replay is for MoE models; drop --engine.routed-experts"
        )
    return layers, top_k


def _sglang(
    cfg: SGLangEngineConfig,
    model_path: str | Path,
    log_dir: Path,
    seed: int,
    *,
    server_actors: bool,
    colocate_with: Any = None,
    engine_placement: Any = None,
    disk_root: str,
    lora_rank: int = 0,
    trust_remote_code: bool = False,
) -> LaunchedEngine:
    from miles.rollout.engines.server import ServerStartError
    from miles.rollout.engines.sglang import SGLangDiskWeightSink, SGLangEngine, SGLangWeightSink

    cfg = _with_sglang_lora_args(cfg, lora_rank)
    launched = LaunchedEngine(None, None, "")
    urls = list(cfg.urls)
    router_url = None
    try:
        if not urls and not (Path(model_path) / "config.json").is_file():
            raise ServerStartError(
                f"no model at {model_path} (no config.json there); set models.policy.path to an HF model directory"
            )
        if server_actors and not urls:
            if cfg.router:  # first: a restarted server actor leaves it before its new server answers
                router_url = _start_router(cfg, [], log_dir, launched)
            urls = _start_server_actors(
                cfg, model_path, log_dir, launched, router_url=router_url, colocate_with=colocate_with,
                engine_placement=engine_placement, trust_remote_code=trust_remote_code,
            )  # fmt: skip
            if launched.router is not None:
                for url in urls:
                    launched.router.add_worker(url)
        else:
            if not urls:
                urls = _start_server_processes(cfg, model_path, log_dir, launched, trust_remote_code=trust_remote_code)
            if cfg.router:
                from miles.rollout.engines.router import WorkerMonitor

                router_url = _start_router(cfg, urls, log_dir, launched)
                # Dead servers leave the router. A restarted one (same URL) stays out: it would serve its initial
                # weights, and nothing here re-weights it (Ray mode's supervisor does).
                monitor = WorkerMonitor(
                    launched.router, urls, interval_s=cfg.health_check_interval_s, readd=False
                ).start()
                launched.closers.append(monitor.stop)
    except BaseException:
        launched.close()
        raise
    engine = SGLangEngine(
        urls,
        router_url=router_url,
        stop_token_ids=stop_token_ids(model_path),
        request_timeout_s=cfg.request_timeout_s,
        max_retries=cfg.max_retries,
        routed_experts_shape=moe_routing_shape(model_path) if cfg.routed_experts else None,
        adapter=bool(lora_rank),
    )
    where = ", ".join(urls) + (f" behind sglang-router at {router_url}" if router_url else "")
    owner = ", each in a Ray actor" if launched.server_actors else ""
    if colocate_with is not None and launched.server_actors:
        owner += " in a trainer rank's bundle (colocated)"
    elif engine_placement is not None and launched.server_actors:
        owner += " in an engine bundle of its own"
    launched.sink_factory = SGLangSinkFactory(
        tuple(engine.worker_urls),
        disk_root=disk_root,
        config_from=str(model_path) if disk_root and not lora_rank else "",
        lora_rank=lora_rank,
    )
    launched.engine = engine
    if lora_rank:
        launched.weight_sink = launched.sink_factory()
        where += f", LoRA adapters (rank {lora_rank}) through {disk_root}"
    elif disk_root:
        launched.weight_sink = SGLangDiskWeightSink(engine, root=disk_root, config_from=model_path)
        where += f", weights through {disk_root}"
    else:
        launched.weight_sink = SGLangWeightSink(engine)
    launched.description = f"{cfg.server} server(s) ({cfg.dtype}) at {where}{owner}"
    return launched


def _server_command(
    cfg: SGLangEngineConfig, model_path: str | Path, port: int | str, i: int, *, trust_remote_code: bool = False
) -> tuple[list[str], str]:
    """(argv, name) of server ``i`` at ``port``: miles serve or SGLang."""
    from miles.rollout.engines.sglang import launch_command
    from miles.rollout.remote_code import TRUST_REMOTE_CODE_EXTRA_ARG, TRUST_REMOTE_CODE_FLAG

    if cfg.server == "miles":
        command = [
            cfg.python or sys.executable, "-m", "miles.rollout.serve",
            "--model", str(model_path),
            "--host", cfg.host,
            "--port", str(port),
            "--dtype", cfg.dtype,
            "--max-batch-size", str(cfg.max_batch_size),
            "--logprob-mode", cfg.logprob_mode,
            *(["--enable-return-routed-experts"] if cfg.routed_experts else []),
            *([TRUST_REMOTE_CODE_FLAG] if trust_remote_code else []),
            *cfg.extra_args,
        ]  # fmt: skip
        if TRUST_REMOTE_CODE_FLAG in cfg.extra_args:
            raise ValueError(TRUST_REMOTE_CODE_EXTRA_ARG)
        return command, f"miles serve {i}"
    extra = list(cfg.extra_args)
    if cfg.routed_experts and "--enable-return-routed-experts" not in extra:
        extra.insert(0, "--enable-return-routed-experts")
    command = launch_command(
        model_path, host=cfg.host, port=port, python=cfg.python, dtype=cfg.dtype, trust_remote_code=trust_remote_code,
        extra_args=extra,
    )  # fmt: skip
    return command, f"SGLang server {i}"


def _server_start_hint(cfg: SGLangEngineConfig) -> str:
    """The fix a failed start of a ``cfg.server`` server suggests."""
    if cfg.server == "miles":
        return "check the model path and the log above"
    return "SGLang needs a GPU and `pip install sglang`; on a CPU use --engine.server miles"


def _server_ports(cfg: SGLangEngineConfig) -> list[int]:
    from miles.rollout.engines.server import free_port

    return [cfg.port + i if cfg.port else free_port(cfg.host) for i in range(cfg.num_servers)]


@dataclass(frozen=True)
class PlannedServer:
    """One server process ``launch_engine`` starts for a server engine config.

    Attributes:
        name: e.g. "vLLM server 0".
        argv: its command line.
        env: the variables set on top of the launching process's environment.
        port: the port it listens on (an int, or the placeholder ``planned_servers`` was given).
    """

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int | str


def planned_servers(
    cfg: VLLMEngineConfig | SGLangEngineConfig,
    model_path: str | Path,
    seed: int,
    *,
    ports: list[int] | list[str],
    lora_rank: int = 0,
    no_torchvision: bool = False,
    trust_remote_code: bool = False,
) -> list[PlannedServer]:
    """The server processes a vLLM / SGLang-API engine config starts, one per port: the single place their command
    lines and environments are built (local processes, Ray server actors and ``miles train --dry-run`` use it).

    Args:
        cfg: the engine section (``engine.urls`` set means no server is started: callers check it).
        model_path: the policy's directory.
        seed: the rollout seed (vLLM's ``--seed``).
        ports: one per server: ints, or placeholders a dry run prints.
        lora_rank: the trainer's LoRA rank when adapters are synced (adds the servers' adapter flags), else 0.
        no_torchvision: the vLLM environment lacks torchvision (``check_vllm_installed``): a vision-language
            model's servers get ``vllm_env(no_torchvision=True)``.
        trust_remote_code: ``models.policy.trust_remote_code``: each server gets ``--trust-remote-code``.
    Returns: ``cfg.num_servers`` planned servers, in order.
    """
    if isinstance(cfg, VLLMEngineConfig):
        from miles.rollout.engines.vllm import default_vllm_python, is_vision_model, vllm_command, vllm_env

        python = cfg.python or default_vllm_python()
        vision = is_vision_model(model_path)
        base = vllm_env(kv_cache_gib=cfg.kv_cache_gib, no_torchvision=vision and no_torchvision)
        env = {**base, **_server_env(cfg), **_lora_env(lora_rank)}
        return [
            PlannedServer(
                f"vLLM server {i}",
                vllm_command(
                    model_path,
                    python=python,
                    host=cfg.host,
                    port=port,
                    dtype=cfg.dtype,
                    max_model_len=cfg.max_model_len,
                    enforce_eager=cfg.enforce_eager,
                    seed=seed,
                    vision=vision,
                    trust_remote_code=trust_remote_code,
                    extra_args=[*_lora_args(lora_rank), *cfg.extra_args],
                ),
                env,
                port,
            )
            for i, port in enumerate(ports)
        ]
    cfg = _with_sglang_lora_args(cfg, lora_rank)
    planned = []
    for i, port in enumerate(ports):
        argv, name = _server_command(cfg, model_path, port, i, trust_remote_code=trust_remote_code)
        planned.append(PlannedServer(name, argv, _server_env(cfg), port))
    return planned


def _with_sglang_lora_args(cfg: SGLangEngineConfig, lora_rank: int) -> SGLangEngineConfig:
    """``cfg`` with SGLang's runtime-adapter flags first in ``extra_args`` when adapters are synced to SGLang
    servers (``miles serve`` takes adapters without flags)."""
    if not lora_rank or cfg.server != "sglang":
        return cfg
    from miles.rollout.engines.sglang_lora import lora_server_args

    return cfg.model_copy(update={"extra_args": [*lora_server_args(lora_rank), *cfg.extra_args]})


def _start_server_processes(
    cfg: SGLangEngineConfig, model_path: str | Path, log_dir: Path, launched: LaunchedEngine, *, trust_remote_code: bool
) -> list[str]:
    """Start ``cfg.num_servers`` servers as processes of this one (local mode); returns their URLs."""
    from miles.rollout.engines.server import ServerProcess

    urls = []
    hint = _server_start_hint(cfg)
    planned_list = planned_servers(cfg, model_path, 0, ports=_server_ports(cfg), trust_remote_code=trust_remote_code)
    for i, planned in enumerate(planned_list):
        server = ServerProcess(
            planned.name,
            planned.argv,
            host=cfg.host,
            port=planned.port,
            log_path=log_dir / f"{cfg.server}_{i}.log",
            env=planned.env,
            startup_timeout_s=cfg.startup_timeout_s,
            hint=hint,
        )
        server.start()
        launched.closers.append(server.stop)
        launched.processes.append(server)
        urls.append(server.url)
    return urls


def _start_server_actors(
    cfg: SGLangEngineConfig,
    model_path: str | Path,
    log_dir: Path,
    launched: LaunchedEngine,
    *,
    router_url: str | None,
    colocate_with: Any = None,
    engine_placement: Any = None,
    trust_remote_code: bool = False,
) -> list[str]:
    """Start ``cfg.num_servers`` servers, each owned by a ``ServerActor`` at a fixed port (Ray restarts it);
    returns their URLs. Needs the Ray session.

    Resources: each actor asks for 0 CPUs and is pinned to this (the driver's) node. The actor itself only owns
    a process and answers probes; the server's threads (``engine.threads``) and GPUs are not Ray resources here,
    exactly as when the servers are processes of the driver, so engines take nothing from the trainer's
    placement group (on a 2-core machine the trainer's bundles hold every logical CPU) and need no
    ``execution.ray.num_cpus`` of their own. The node is the driver's because the servers bind ``engine.host``
    (127.0.0.1 by default) and load ``models.policy.path`` from this node's disk, as the router reaches them.

    With ``colocate_with`` (the trainer's placement group, ``execution.ray.colocate``) server i's actor is scheduled
    into bundle i modulo the bundle count, still asking for 0 CPUs: it shares trainer rank i's bundle, and so its
    node (one node here; across nodes ``engine.host`` must be an address the router and the driver reach).
    With ``engine_placement`` (``execution.ray.engine_cpus_per_server`` / ``engine_gpus_per_server``) server i's
    actor runs in that group's bundle i and asks for its CPUs and GPUs: engines on resources of their own.
    """
    from miles.rollout.engines.server_actor import ServerSpec

    specs = []
    planned_list = planned_servers(cfg, model_path, 0, ports=_server_ports(cfg), trust_remote_code=trust_remote_code)
    for i, planned in enumerate(planned_list):
        specs.append(
            ServerSpec(
                planned.name,
                planned.argv,
                port=planned.port,
                log_path=log_dir / f"{cfg.server}_{i}.log",
                host=cfg.host,
                env=planned.env,
                startup_timeout_s=cfg.startup_timeout_s,
                router_url=router_url,
            )
        )
    return _own_by_actors(specs, cfg, launched, colocate_with=colocate_with, engine_placement=engine_placement)


def _own_by_actors(
    specs: list[Any], cfg: Any, launched: LaunchedEngine, *, colocate_with: Any = None, engine_placement: Any = None
) -> list[str]:
    """Start one ``ServerActor`` per spec, record them in ``launched`` (closers, logs, ``server_actors``,
    ``health_check``) and return their URLs.

    Placement (``_start_server_actors`` says why): by default each actor asks for 0 CPUs on this node;
    ``colocate_with`` (the trainer's placement group): actor i in its bundle i modulo the bundle count, still 0 CPUs;
    ``engine_placement`` (one bundle per server): actor i in bundle i, asking for that bundle's CPUs and GPUs (the
    server inherits the GPUs Ray gives the actor). Either group is checked after the start.
    Raises: RuntimeError when Ray ran an actor outside its group; what ``start_server_actors`` raises.
    """
    from miles.core.execution import import_ray
    from miles.rollout.engines.server_actor import start_server_actors
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    Path(specs[0].log_path).parent.mkdir(parents=True, exist_ok=True)
    group = colocate_with if colocate_with is not None else engine_placement
    if group is None:
        node = NodeAffinitySchedulingStrategy(node_id=import_ray().get_runtime_context().get_node_id(), soft=False)
        options = [{"num_cpus": 0, "scheduling_strategy": node} for _ in specs]
        indices: list[int] = []
    else:
        bundles = group.bundle_specs
        if colocate_with is None and len(bundles) != len(specs):
            raise ValueError(f"engine_placement has {len(bundles)} bundles for {len(specs)} servers; give one each")
        indices = [i % len(bundles) for i in range(len(specs))]
        options = [
            {
                "num_cpus": 0 if colocate_with is not None else bundles[i].get("CPU", 0),
                "num_gpus": 0 if colocate_with is not None else bundles[i].get("GPU", 0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            }
            for i in indices
        ]
    handles = start_server_actors(specs, actor_options=options)
    for handle in handles:
        launched.closers.append(handle.stop)
        launched.actor_logs.append(Path(handle.spec.log_path))
    launched.server_actors, launched.health_check = handles, cfg.health_check
    if group is not None:  # Ray placed them as asked, or says why not here
        ray = import_ray()
        groups = ray.get([handle.actor.__ray_call__.remote(_placement_group_of) for handle in handles])
        whose = "the trainer's placement group" if colocate_with is not None else "the engines' placement group"
        wrong = [h.url for h, got in zip(handles, groups) if got != group.id.hex()]
        if wrong:
            raise RuntimeError(f"engine servers {wrong} run outside {whose}")
        logger.info(
            "%s: engine server(s) %s in bundle(s) %s of %s",
            "colocated" if colocate_with is not None else "engine bundles",
            ", ".join(h.url for h in handles),
            ", ".join(map(str, indices)),
            whose,
        )
    return [handle.url for handle in handles]


def _placement_group_of(_actor: Any) -> str | None:
    """The placement group id (hex) of the actor it runs in (through ``ActorHandle.__ray_call__``)."""
    from miles.core.execution import import_ray

    return import_ray().get_runtime_context().get_placement_group_id()


def _start_router(cfg: SGLangEngineConfig, urls: list[str], log_dir: Path, launched: LaunchedEngine) -> str:
    """Start sglang-router in front of ``urls`` (each must serve already; none: the servers are added later)."""
    from miles.rollout.engines.router import SGLangRouter

    router = SGLangRouter(
        urls,
        policy=cfg.router_policy,
        host=cfg.host,
        log_path=log_dir / "sglang_router.log",
        startup_timeout_s=cfg.startup_timeout_s,
    )
    router.start()
    launched.closers.append(router.stop)
    launched.processes.append(router.process)
    launched.router = launched.rotation = router
    return router.url
