"""Build the components of a run from a validated ``MilesConfig`` and drive the loop.

Validation is pure; everything that reads the disk or imports user code is checked here, first and cheaply
(``build_inputs``): model paths, data files, reward and algorithm plugins."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import logging.handlers
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from miles.core.algorithms.config import load_algorithm_plugins
from miles.core.logs import one_line
from miles.core.loop import AllSamplesAborted, AllSamplesFailed, Components, DynamicSamplingExhausted, train
from miles.core.plugins import load_plugin
from miles.core.producer import PromptQueue
from miles.core.protocols import DataContext, DataSource, MetricsSink, RewardFn, RunContext, TrainBackend
from miles.core.rewards import TimeLimitedReward
from miles.core.rng import capture_rng_state, restore_rng_state
from miles.recipes.checkpoint import restore_run_checkpoint, save_run_checkpoint, write_atomic
from miles.recipes.config import MilesConfig
from miles.recipes.interrupts import StopRequest
from miles.recipes.registry import check_model_code, check_model_path, resolve_model_path
from miles.recipes.run_dir import LOCK_FILE, RunDirError, check_room, checkpoint_size
from miles.recipes.sinks import (
    WANDB_MISSING,
    ConsoleSink,
    JsonlSink,
    TensorBoardSink,
    WandbSink,
    plot_metrics,
    plot_rewards,
)
from miles.rollout.config import DataConfig, RewardConfig

if TYPE_CHECKING:
    from miles.core.publisher import Colocation, EnginePublisher, LogProbProbe
    from miles.rollout.engines.launch import LaunchedEngine

logger = logging.getLogger(__name__)

LOG_FILE = "train.log"


class RunSetupError(Exception):
    """A user-caused problem found while building a run (a bad data file, reward plugin, ...): one line that
    names the config key and the fix. Nothing has been written to the run directory when it is raised."""


class RunInputError(Exception):
    """A run that started stopped on a problem with what the user supplied that only training reveals (every sample
    of a step failed: a reward function that raises, hangs or returns NaN on everything): one line naming the
    config key (the reward function) and the first failure reasons. ``miles train`` exits 2."""


class RunFailed(Exception):
    """A run that started stopped on a failure it cannot continue past (a trainer rank died, with no trainer restart
    left): one line naming what failed and the checkpoint the run continues from (``miles train --resume``)."""


@dataclass(frozen=True)
class RunResult:
    """How a run ended.

    Attributes:
        run_dir: the run directory.
        steps_done: completed training steps.
        num_steps: ``loop.num_steps`` of the run.
        checkpoint: the newest checkpoint directory, or None if none was written.
        stopped_by: the signal that stopped the run early ("SIGINT", "SIGTERM"), or None.
    """

    run_dir: Path
    steps_done: int
    num_steps: int
    checkpoint: Path | None
    stopped_by: str | None = None


def build_data_sources(data: DataConfig, *, num_eval_prompts: int) -> tuple[DataSource, DataSource | None]:
    """The training data source of a data section and its held-out eval source (None when no eval).

    A reasoning-gym task draws eval entries with ``data.eval_seed``. A file source evaluates on
    ``data.eval_path``, or, without one, on ``num_eval_prompts`` rows of ``data.path`` held out of training. A
    ``data.mixture`` is built by ``build_mixture_sources``.
    Raises: ValueError naming ``data.path`` / ``data.eval_path`` when it is not a file; as ``FileSource`` /
        ``ReasoningGymSource`` (ValueError, FileNotFoundError naming the key).
    """
    from miles.rollout.data import FileSource, ReasoningGymSource

    if data.mixture:
        return build_mixture_sources(data, num_eval_prompts=num_eval_prompts)
    if data.source == "custom":
        factory = load_plugin(data.source_path, key="data.source_path")

        def custom(split: str, seed: int) -> DataSource:
            source = factory(DataContext(data=data, split=split, seed=seed))
            missing = [m for m in ("next_prompts", "state_dict", "load_state_dict") if not hasattr(source, m)]
            if missing:
                raise TypeError(
                    f"data.source_path: {data.source_path!r} returned a {type(source).__name__} without "
                    f"{', '.join(missing)}; expected a DataSource (miles.core.protocols.DataSource)"
                )
            return source

        return custom("train", data.seed), (custom("eval", data.eval_seed) if num_eval_prompts else None)
    if data.source == "file":
        for key, value in (("path", data.path), ("eval_path", data.eval_path)):
            if value and not Path(value).expanduser().exists():
                raise ValueError(
                    f"data.{key} is {value!r}, which does not exist (relative paths start at the current directory "
                    f"{Path.cwd()}); pass --data.{key.replace('_', '-')} /path/to/file.jsonl"
                )
    system_prompt = data.system_prompt or None
    if data.source == "reasoning_gym":

        def task(seed: int) -> ReasoningGymSource:
            return ReasoningGymSource(
                data.task,
                size=data.size,
                seed=seed,
                task_kwargs=data.task_kwargs,
                system_prompt=system_prompt,
                prompt_suffix=data.prompt_suffix,
            )

        return task(data.seed), (task(data.eval_seed) if num_eval_prompts else None)

    def file(path: str, *, seed: int, key: str, num_heldout: int = 0) -> FileSource:
        return FileSource(
            path,
            prompt_key=data.prompt_key,
            label_key=data.label_key,
            image_key=data.image_key,
            seed=seed,
            system_prompt=system_prompt,
            prompt_suffix=data.prompt_suffix,
            bad_rows=data.bad_rows,
            num_heldout=num_heldout,
            key=key,
        )

    if data.eval_path or not num_eval_prompts:
        train_source = file(data.path, seed=data.seed, key="data.path")
        heldout = file(data.eval_path, seed=data.eval_seed, key="data.eval_path") if num_eval_prompts else None
        return train_source, heldout
    train_source = file(data.path, seed=data.seed, key="data.path", num_heldout=num_eval_prompts)
    logger.info(
        "evaluating on %d rows of %s held out of training (set --data.eval-path for a separate eval file)",
        num_eval_prompts,
        Path(data.path).name,
    )
    return train_source, train_source.heldout_source(seed=data.eval_seed)


def build_mixture_sources(data: DataConfig, *, num_eval_prompts: int) -> tuple[DataSource, DataSource | None]:
    """The sources of ``data.mixture``: a ``MixtureSource`` over each dataset's training source and, for eval, one
    with the same weights over each dataset's eval source (None when no eval).

    Each dataset is built as a one-source data section (its entry plus the shared data.seed, data.eval_seed,
    data.bad_rows). The eval prompts are the same mix as training: the first ``num_eval_prompts`` of the eval
    mixture take ``mixture_counts(weights, num_eval_prompts)`` from the datasets, so a file dataset without an
    eval_path holds exactly that many rows out of training (at least 1, so every dataset has an eval source).
    Raises: ValueError naming ``data.mixture[i]`` (a path that is not a file, a bad row or task, ...).
    """
    from miles.rollout.data import MixtureSource, mixture_counts

    shared = {"seed": data.seed, "eval_seed": data.eval_seed, "bad_rows": data.bad_rows}
    weights = [component.weight for component in data.mixture]
    shares = mixture_counts(weights, num_eval_prompts)
    train, heldout = [], []
    for i, (component, share) in enumerate(zip(data.mixture, shares)):
        key = f"data.mixture[{i}]"
        for field in ("path", "eval_path"):
            value = getattr(component, field)
            if value and not Path(value).expanduser().exists():
                raise ValueError(
                    f"{key}.{field} ({component.name}) is {value!r}, which does not exist (relative paths start at the "
                    f"current directory {Path.cwd()}); fix {field} in that entry of data.mixture"
                )
        section = DataConfig(**component.model_dump(exclude={"name", "weight"}), **shared)
        try:
            source, eval_source = build_data_sources(section, num_eval_prompts=max(share, 1) if num_eval_prompts else 0)
        except (ValueError, OSError) as err:
            raise ValueError(f"{key} ({component.name}): {err}") from err
        train.append((component.name, component.weight, source))
        heldout.append((component.name, component.weight, eval_source))
    logger.info(
        "data.mixture: %s (eval prompts per dataset: %s)",
        ", ".join(f"{c.name} x{c.weight:g}" for c in data.mixture),
        shares,
    )
    return MixtureSource(train), (MixtureSource(heldout) if num_eval_prompts else None)


def build_reward(reward: RewardConfig) -> RewardFn:
    """The reward function a reward section names: in this process (each call in a thread limited to
    ``reward.timeout_s``, unless it is 0) or, with ``reward.workers > 0``, a started ``ProcessPoolReward``, which
    holds processes: the caller closes it (``close()``; it also closes at interpreter exit)."""
    from functools import partial

    from miles.core.reward_pool import ProcessPoolReward
    from miles.rollout import rewards

    # What the built-in rewards import on their first call, imported once by the workers' fork server instead (it
    # starts no thread), so no worker spends its first call's timeout_s on imports. A partial of a module-level
    # function pickles by reference, so workers get the built-ins with their settings.
    preload: tuple[str, ...] = ("miles.rollout.rewards",)
    if reward.type == "reasoning_gym":
        reward_fn, preload = rewards.reasoning_gym_reward, (*preload, "reasoning_gym")
    elif reward.type == "math":
        reward_fn, preload = rewards.math_reward, (*preload, "math_verify")
    elif reward.type == "code":
        code = reward.code
        reward_fn = partial(rewards.code_reward, time_limit_s=code.time_limit_s, memory_limit_mib=code.memory_limit_mib)
    elif reward.type == "exact_match":
        reward_fn = rewards.exact_match_reward
    elif reward.type == "f1":
        reward_fn = rewards.f1_reward
    elif reward.type == "remote":
        remote = reward.remote
        reward_fn = partial(
            rewards.remote_reward,
            url=remote.url,
            score_key=remote.score_key,
            timeout_s=remote.timeout_s,
            max_retries=remote.max_retries,
            backoff_s=remote.backoff_s,
        )
    else:
        reward_fn = load_plugin(reward.path, key="reward.path", num_positional=1)
    if reward.workers > 0:
        return ProcessPoolReward(
            reward.path if reward.type == "custom" else reward_fn,  # a plugin is imported by path in each worker
            num_workers=reward.workers,
            timeout_s=reward.timeout_s or None,
            memory_limit_mib=reward.memory_limit_mib,
            preload=preload,
        )
    return TimeLimitedReward(reward_fn, timeout_s=reward.timeout_s) if reward.timeout_s else reward_fn


def model_paths(cfg: MilesConfig) -> dict[str, str]:
    """The model paths a run loads, by dotted key: the policy and, as the config holds them, reference (a set
    path, while KL is on), critic (a set path) and teacher."""
    models = cfg.models
    paths = {"models.policy.path": models.policy.path}
    if cfg.algorithm.kl is not None and models.reference.path:
        paths["models.reference.path"] = models.reference.path
    if models.critic is not None and models.critic.path:
        paths["models.critic.path"] = models.critic.path
    if models.teacher is not None:
        paths["models.teacher.path"] = models.teacher.path
    return paths


def algorithm_models(cfg: MilesConfig, model_path: Path) -> dict[str, object]:
    """The models the algorithm needs, as backend kwargs: the reference (while ``algorithm.kl`` is on; the initial
    policy unless ``models.reference.path``), the teacher and critic directories (registered names resolved; an
    empty critic path is the policy) and their settings, and every model's ``trust_remote_code`` (the policy's as
    ``trust_remote_code``; a reference or critic with an empty path takes the policy's)."""
    models = cfg.models
    policy_trusted = models.policy.trust_remote_code

    def resolve(key: str, path: str) -> Path:
        return resolve_model_path(path, key=key) if path else model_path

    kwargs: dict[str, object] = {"trust_remote_code": policy_trusted}
    if cfg.algorithm.kl is not None:
        kwargs["reference_path"] = resolve("models.reference.path", models.reference.path)
        kwargs["reference_trust_remote_code"] = models.reference.trust_remote_code or policy_trusted
    if models.teacher is not None:
        kwargs["teacher_path"] = resolve("models.teacher.path", models.teacher.path)
        kwargs["teacher_temperature"] = models.teacher.temperature
        kwargs["teacher_trust_remote_code"] = models.teacher.trust_remote_code
    if models.critic is not None:
        kwargs["critic_path"] = resolve("models.critic.path", models.critic.path)
        kwargs["critic_lr"] = models.critic.lr
        kwargs["critic_trust_remote_code"] = models.critic.trust_remote_code or policy_trusted
    return kwargs


def _model_dirs(cfg: MilesConfig, model_path: Path) -> dict[str, tuple[Path, bool]]:
    """Every model directory the run loads, by its key ("models.policy.path", ...): (directory,
    trust_remote_code), from ``algorithm_models``."""
    models = algorithm_models(cfg, model_path)
    dirs = {"models.policy.path": (model_path, cfg.models.policy.trust_remote_code)}
    for name in ("reference", "teacher", "critic"):
        if f"{name}_path" in models:
            dirs[f"models.{name}.path"] = (models[f"{name}_path"], models[f"{name}_trust_remote_code"])
    return dirs


@contextmanager
def ray_trainer_placement(cfg: MilesConfig) -> Iterator[Any]:
    """The Ray session ``execution.ray`` describes (dashboard off; shut down at exit if it started the cluster)
    holding a placement group of one bundle per trainer rank (``train.world_size``), removed at exit.

    The bundles are the trainer's alone: the engine servers' Ray actors ask for 0 CPUs on this node
    (``miles.rollout.engines.launch._start_server_actors`` says why), share these bundles (``colocate``), or get
    bundles of their own (``ray_engine_placement``).

    Raises: RunSetupError (one line, the keys to change) when the cluster cannot be reached or cannot place the
        bundles; ImportError naming the install command without Ray.
    """
    from miles.core.execution import placement_group_for, ray_session

    ray_cfg, world_size = cfg.execution.ray, cfg.train.world_size
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(
                ray_session(
                    address=ray_cfg.address,
                    num_cpus=ray_cfg.num_cpus,
                    log_to_driver=ray_cfg.log_to_driver,
                    namespace=ray_cfg.namespace,
                )
            )
        except ConnectionError as err:
            raise RunSetupError(
                f"execution.ray.address is {ray_cfg.address!r}, but Ray could not connect to it: "
                f"{' '.join(str(err).split())}. Check the address (or drop --execution.ray.address to start a local "
                "cluster)."
            ) from err
        bundles = [{"CPU": ray_cfg.trainer_cpus_per_rank}] * world_size
        try:
            group = stack.enter_context(placement_group_for(bundles, strategy=ray_cfg.placement_strategy))
        except (ValueError, TimeoutError) as err:
            cpus = world_size * ray_cfg.trainer_cpus_per_rank
            raise RunSetupError(
                f"train.world_size x execution.ray.trainer_cpus_per_rank = {world_size} x "
                f"{ray_cfg.trainer_cpus_per_rank:g} = {cpus:g} CPUs cannot be placed on this Ray cluster: "
                f"{' '.join(str(err).split())}. Set --execution.ray.num-cpus {cpus:g} or more (a local cluster; "
                "logical CPUs may exceed the cores), or lower --train.world-size or "
                "--execution.ray.trainer-cpus-per-rank."
            ) from err
        yield group


@contextmanager
def ray_engine_placement(cfg: MilesConfig) -> Iterator[Any]:
    """The engine bundles of execution.mode ray (``execution.ray.engine_cpus_per_server`` /
    ``engine_gpus_per_server``): a placement group of one bundle per engine server Miles starts, placed by
    ``execution.ray.placement_strategy`` and removed at exit; None when those are 0 (the servers take no bundle).
    Enter it inside ``ray_trainer_placement``'s session.

    Raises: RunSetupError (one line, the keys to change) when the cluster cannot place the bundles.
    """
    from miles.core.execution import import_ray, placement_group_for

    ray_cfg, num_servers = cfg.execution.ray, cfg.engine.num_servers
    bundle = ray_cfg.engine_bundle
    if not bundle or cfg.engine.urls:
        yield None
        return
    trainer_cpus = cfg.train.world_size * ray_cfg.trainer_cpus_per_rank
    engine_cpus = num_servers * ray_cfg.engine_cpus_per_server
    needed, total = trainer_cpus + engine_cpus, import_ray().cluster_resources().get("CPU", 0.0)
    what = (
        f"the trainer's bundles ({trainer_cpus:g} CPUs) and engine.num_servers x "
        f"execution.ray.engine_cpus_per_server = {num_servers} x {ray_cfg.engine_cpus_per_server:g} CPUs need "
        f"{needed:g} CPUs"
    )
    if ray_cfg.address is None:
        fix = f"Set --execution.ray.num-cpus {needed:g} or more (logical CPUs may exceed the cores)"
    else:
        fix = f"Join a cluster with {needed:g} CPUs or more"
    fix += ", or lower --execution.ray.engine-cpus-per-server"
    if needed > total:  # fail now: the placement would wait for resources that never come
        cores = ray_cfg.num_cpus is None and ray_cfg.address is None
        default = " (execution.ray.num_cpus unset: the cores)" if cores else ""
        raise RunSetupError(f"{what}, but this Ray cluster has {total:g}{default}. {fix}.")
    with contextlib.ExitStack() as stack:
        try:
            group = stack.enter_context(
                placement_group_for([bundle] * num_servers, strategy=ray_cfg.placement_strategy)
            )
        except (ValueError, TimeoutError) as err:
            raise RunSetupError(
                f"the engine bundles ({num_servers} x {bundle}) could not be placed beside the trainer's: {what}; "
                f"{' '.join(str(err).split())}. {fix}."
            ) from err
        yield group


def build_ray_trainer(
    cfg: MilesConfig, model_path: Path, launched: LaunchedEngine, placement: Any, stack: contextlib.ExitStack
) -> TrainBackend:
    """The trainer of execution.mode ray: ``train.world_size`` ranks of ``train.backend`` as Ray actors
    (``RayTrainGroup``), one per bundle of ``placement`` (``ray_trainer_placement``), rank 0 pushing the weights
    through the sink ``launched.sink_factory`` builds in its actor; ``stack`` closes the group. Logs one line:
    ranks, bundles, processes, engines."""
    from miles.core.execution import import_ray
    from miles.train.config import BACKEND_NAMES
    from miles.train.ray_group import RayTrainGroup

    ray_cfg, world_size = cfg.execution.ray, cfg.train.world_size
    assert launched.sink_factory is not None, "MilesConfig refuses execution.mode ray with the embedded engine"
    group = RayTrainGroup(
        model_path,
        train=cfg.train,
        temperature=cfg.rollout.sampling.temperature,
        weight_sink_factory=launched.sink_factory,
        resources_per_rank={"CPU": ray_cfg.trainer_cpus_per_rank},
        placement_group=placement,
        **algorithm_models(cfg, model_path),
    )
    stack.callback(group.close)  # before its placement group is removed (entered earlier, so left later)
    ray = import_ray()
    where = ray.get([actor.__ray_call__.remote(_process_of) for actor in group.actors])
    logger.info(
        "Ray placement: %d %s trainer ranks on bundles 0-%d of a %s placement group (%g CPU each; %s), rank 0 "
        "pushes the weights; engines: %s%s",
        world_size,
        BACKEND_NAMES[cfg.train.backend],
        world_size - 1,
        ray_cfg.placement_strategy,
        ray_cfg.trainer_cpus_per_rank,
        ", ".join(f"rank {rank}: pid {pid} on {node}" for rank, (node, pid) in enumerate(where)),
        launched.description,
        "" if launched.server_actors else ", processes of this driver outside Ray",
    )
    return group


def engine_resync(components: Components, sink_factory: Any) -> Callable[[str], None]:
    """The engine supervisor's ``on_restarted`` in Ray mode: push the run's current weights to one restarted server.

    The weights come from the current trainer (``components.backend``, a ``RayTrainGroup``; a trainer restart
    replaces it) at the current version (``components.publisher.version``, read under the supervisor's
    ``resync_lock``, which every publish holds too): rank 0's sink leaves its weight group, which had the dead
    server, and a one-off sink for the restarted server alone (``sink_factory.only(url)``) sends them. At version 0
    nothing is pushed: the restarted server loaded models.policy.path, the run's version 0.

    Args:
        components: the loop's components (read at each call).
        sink_factory: ``LaunchedEngine.sink_factory`` (``SGLangSinkFactory`` / ``VLLMSinkFactory`` of every
            server).
    Returns: ``on_restarted(url)``; it raises what ``RayTrainGroup.push_weights_to`` raises.
    """

    def on_restarted(url: str) -> None:
        version = components.publisher.version
        if version == 0:
            return
        t0 = time.perf_counter()
        components.backend.push_weights_to(sink_factory.only(url), version=version)
        logger.info("pushed weights v%d to the restarted engine %s in %.1fs", version, url, time.perf_counter() - t0)

    return on_restarted


def _process_of(_worker: object) -> tuple[str, int]:
    """(node IP, pid) of the actor process it runs in (through ``ActorHandle.__ray_call__``)."""
    from miles.core.execution import import_ray

    return import_ray().util.get_node_ip_address(), os.getpid()


@dataclass(frozen=True)
class RunPlugins:
    """The extension points of a run that ``Components`` and the sinks take, imported and checked
    (``miles.core.plugins.EXTENSION_POINTS``); the algorithm, data, reward and generate plugins load elsewhere."""

    sample_hook: Any = None
    group_reward_fn: Any = None
    eval_fn: Any = None
    hook_factories: tuple[Any, ...] = ()
    sink_factories: tuple[Any, ...] = ()

    def build_hooks_and_sinks(self, context: RunContext) -> tuple[list[Any], list[Any]]:
        """Call the ``run.hooks`` / ``run.sinks`` factories with ``context``.

        Raises: TypeError naming the key when a sink lacks ``log``/``close`` or a hook has none of the hook methods.
        """
        hooks, sinks = [], []
        for i, factory in enumerate(self.hook_factories):
            hook = factory(context)
            if not any(hasattr(hook, m) for m in ("on_rollout_end", "on_train_step_end", "on_save")):
                raise TypeError(
                    f"run.hooks[{i}] returned a {type(hook).__name__} with none of on_rollout_end, on_train_step_end, "
                    "on_save (miles.core.protocols.TrainHooks)"
                )
            hooks.append(hook)
        for i, factory in enumerate(self.sink_factories):
            sink = factory(context)
            if not (callable(getattr(sink, "log", None)) and callable(getattr(sink, "close", None))):
                raise TypeError(
                    f"run.sinks[{i}] returned a {type(sink).__name__} without log(metrics, step) and close() "
                    "(miles.core.protocols.MetricsSink)"
                )
            sinks.append(sink)
        return hooks, sinks


def load_run_plugins(cfg: MilesConfig) -> RunPlugins:
    """Import and check ``rollout.sample_hook_path``, ``reward.group_path``, ``eval.path``, ``run.hooks`` and
    ``run.sinks`` (nothing is built).

    Raises: RunSetupError with one line naming the key and the expected signature.
    """

    def load(key: str, path: str) -> Any:
        return load_plugin(path, key=key) if path else None

    try:
        return RunPlugins(
            sample_hook=load("rollout.sample_hook_path", cfg.rollout.sample_hook_path),
            group_reward_fn=load("reward.group_path", cfg.reward.group_path),
            eval_fn=load("eval.path", cfg.eval.path),
            hook_factories=tuple(load(f"run.hooks[{i}]", p) for i, p in enumerate(cfg.run.hooks)),
            sink_factories=tuple(load(f"run.sinks[{i}]", p) for i, p in enumerate(cfg.run.sinks)),
        )
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        raise RunSetupError(" ".join(str(err).split())) from err


def build_eval_sets(cfg: MilesConfig) -> dict[str, list]:
    """The fixed prompts of each named eval set (``eval.sets``): the eval prompts of the set's data section
    (``eval_set_data``), ``num_prompts`` of them, by name.

    Raises: RunSetupError naming ``eval.sets[i]`` for data that cannot be built (a missing file, a bad row, ...).
    """
    from miles.recipes.config import eval_set_data

    prompts = {}
    for i, eval_set in enumerate(cfg.eval.sets):
        try:
            _, source = build_data_sources(eval_set_data(cfg, i), num_eval_prompts=eval_set.num_prompts)
            prompts[eval_set.name] = source.next_prompts(eval_set.num_prompts)
        except (ValueError, TypeError, ImportError, AttributeError, OSError) as err:
            raise RunSetupError(f"eval.sets[{i}] ({eval_set.name}): {' '.join(str(err).split())}") from err
    return prompts


def build_inputs(cfg: MilesConfig) -> tuple[RewardFn, DataSource, list]:
    """The user-supplied parts of a run, checked and built first because they fail cheaply: model paths exist,
    algorithm plugins, the group-generate factory and its tools import with the right signatures; then (reward
    function, training data source, eval prompts).

    Raises: RunSetupError with one line naming the key and the fix (a model path that is neither registered nor
        an HF directory or ships code it is not trusted to run, a bad data file or row, a plugin that does not
        import or has the wrong signature, ...).
    """
    from miles.rollout.generate_factory import load_generate_factory

    try:
        for key, path in model_paths(cfg).items():
            check_model_path(path, key=key)
            model = getattr(cfg.models, key.split(".")[1])  # the section of a set path: its own trust_remote_code
            check_model_code(path, key=key, trusted=model.trust_remote_code)
        load_algorithm_plugins(cfg.algorithm)
        load_generate_factory(cfg.rollout)  # rollout.generate_path and rollout.multi_turn.tools import and fit
        if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ImportError(
                "run.tensorboard is true but the tensorboard package is not installed: pip install "
                "'miles-recipes[tensorboard]', or drop --run.tensorboard"
            )
        if cfg.run.wandb is not None and importlib.util.find_spec("wandb") is None:
            raise ImportError(WANDB_MISSING)
        reward_fn = build_reward(cfg.reward)
        data_source, eval_source = build_data_sources(cfg.data, num_eval_prompts=cfg.eval.num_prompts)
        eval_prompts = eval_source.next_prompts(cfg.eval.num_prompts) if eval_source is not None else []
    except (ValueError, TypeError, ImportError, AttributeError, OSError) as err:
        raise RunSetupError(" ".join(str(err).split())) from err
    return reward_fn, data_source, eval_prompts


def build_probe(cfg: MilesConfig, tokenizer: Any) -> LogProbProbe | None:
    """The weight probe of ``engine.probe`` (None when its ``tokens`` is 0): the prompt tokenized as is, the
    rollouts' temperature, the tolerance for the engine's dtype and weight codec."""
    from miles.core.publisher import LogProbProbe

    probe = cfg.engine.probe
    if probe.tokens == 0:
        return None
    return LogProbProbe(
        tokenizer(probe.prompt, add_special_tokens=False)["input_ids"],
        temperature=cfg.rollout.sampling.temperature,
        max_new_tokens=probe.tokens,
        max_abs_diff=probe.tolerance(
            cfg.engine.dtype,
            exact_weights=getattr(cfg.engine, "weight_codec", "identity") in ("identity", cfg.train.qat),
        ),
        seed=cfg.rollout.seed,
    )


def build_rollout(cfg: MilesConfig, engine: Any, tokenizer: Any) -> Any:
    """The run's group-generate function (``GroupGenerateFn``), for training and eval: SFT's reference answers, the
    ``rollout.generate_path`` (or multi-turn) factory's function, or the built-in single-turn ``ChatRollout``.

    Raises: RunSetupError with one line for what a factory refuses or returns.
    """
    from miles.rollout.generate import ChatRollout
    from miles.rollout.generate_factory import GenerateContext, build_generate_fn, generate_factory_path
    from miles.rollout.sft import SFTRollout

    if cfg.rollout.mode == "sft":  # reference answers, no generation
        return SFTRollout(tokenizer)
    if generate_factory_path(cfg.rollout) is not None:  # rollout.generate_path, or multi_turn's built-in one
        context = GenerateContext(
            engine=engine,
            tokenizer=tokenizer,
            rollout=cfg.rollout,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            mask_stale_segments=cfg.loop.mask_stale_segments,
        )
        try:  # imports were checked by build_inputs; this is what the factory itself refuses (before the run
            # directory is written, like every other build failure)
            return build_generate_fn(cfg.rollout, context)
        except (ValueError, TypeError) as err:
            raise RunSetupError(" ".join(str(err).split())) from err
    return ChatRollout(
        engine,
        tokenizer,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        max_resubmits=cfg.rollout.max_resubmits,
        mask_stale_segments=cfg.loop.mask_stale_segments,
    )


def build_eval_rollout(cfg: MilesConfig, engine: Any, tokenizer: Any) -> Any:
    """The rollout of evaluations when it differs from the training one, else None: with ``rollout.mode sft`` the
    built-in single-turn ``ChatRollout`` (SFT trains on the reference answers; its eval generates and scores)."""
    from miles.rollout.generate import ChatRollout

    if cfg.rollout.mode != "sft":
        return None
    return ChatRollout(engine, tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens)


def evaluate_model(cfg: MilesConfig, *, log_dir: Path) -> dict[str, float]:
    """Evaluate ``models.policy.path`` alone, as a run evaluates between steps (``miles eval``): the eval function
    (``eval.path``, else the built-in one) over the default eval set and every ``eval.sets`` entry, with the run's
    reward, sample hook and group reward. Nothing is trained and no run directory is written; server logs go to
    ``log_dir``.

    Returns: the eval metrics (``eval/reward``, ``eval/pass@k``, ``eval/<set>/...``, ``time/eval``).
    Raises: RunSetupError as ``run`` does, and when no eval set is configured.
    """
    from miles.core.evaluation import evaluate
    from miles.rollout.engines.launch import launch_engine
    from miles.rollout.multimodal import load_tokenizer

    if not cfg.eval.enabled:
        raise RunSetupError("eval.num_prompts is 0 and eval.sets is empty: nothing to evaluate; set --eval.num-prompts")
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    plugins = load_run_plugins(cfg)
    with contextlib.ExitStack() as stack:
        reward_fn, _, eval_prompts = build_inputs(cfg)
        if hasattr(reward_fn, "close"):
            stack.callback(reward_fn.close)
        eval_sets = build_eval_sets(cfg)
        model_path = resolve_model_path(cfg.models.policy.path, key="models.policy.path")
        _check_vision_model(cfg, model_path, training=False)
        trusted = cfg.models.policy.trust_remote_code
        tokenizer = load_tokenizer(model_path, trust_remote_code=trusted)
        launched = launch_engine(
            cfg.engine, model_path, log_dir=log_dir, seed=cfg.rollout.seed, trust_remote_code=trusted
        )
        stack.callback(launched.close)
        generate_group = build_rollout(cfg, launched.engine, tokenizer)
        eval_generate_group = build_eval_rollout(cfg, launched.engine, tokenizer)
        components = Components(
            data_source=None,  # type: ignore[arg-type] - evaluation reads no training data
            generate_group=generate_group,
            eval_generate_group=eval_generate_group,
            reward_fn=reward_fn,
            backend=None,  # type: ignore[arg-type] - nor a trainer
            publisher=None,  # type: ignore[arg-type] - nor publishes weights (no eval/weight_version)
            sink=None,  # type: ignore[arg-type]
            eval_prompts=eval_prompts,
            eval_sets=eval_sets,
            sample_hook=plugins.sample_hook,
            group_reward_fn=plugins.group_reward_fn,
        )
        return (plugins.eval_fn or evaluate)(components, cfg.eval)


def resolve_precision(cfg: MilesConfig) -> MilesConfig:
    """``cfg`` with ``train.dtype`` / ``engine.dtype`` ``auto`` decided for this machine, each decision logged with
    its reason (``miles.core.precision``); the run's ``config.yaml`` then records the dtypes that ran."""
    from miles.core.precision import fast_bf16, resolve_dtype

    if "auto" not in (cfg.train.dtype, cfg.engine.dtype):
        return cfg
    _, reason = fast_bf16()
    update = {}
    if cfg.train.dtype == "auto" and cfg.train.backend == "megatron":  # its bf16 path is not wired yet
        update["train"] = cfg.train.model_copy(update={"dtype": "fp32"})
        logger.info("train.dtype auto -> fp32: train.backend megatron trains in fp32 for now")
    elif cfg.train.dtype == "auto":
        update["train"] = cfg.train.model_copy(update={"dtype": resolve_dtype("auto")})
    if cfg.engine.dtype == "auto":
        update["engine"] = cfg.engine.model_copy(update={"dtype": resolve_dtype("auto")})
    for key, section in update.items():
        if key == "engine" or cfg.train.backend != "megatron":
            logger.info("%s.dtype auto -> %s: %s", key, section.dtype, reason)
    return cfg.model_copy(update=update)


def run(
    cfg: MilesConfig, run_dir: Path, *, resume_from: Path | None = None, replace_existing: bool = False
) -> RunResult:
    """Train per ``cfg``, writing ``config.yaml``, ``metrics.jsonl``, ``train.log``, checkpoints, ``reward.png``
    and ``metrics.png`` (redrawn from the whole ``metrics.jsonl`` when a resumed run ends) to run_dir.

    Nothing is written to ``run_dir`` until every component is built. During the loop the first Ctrl-C/SIGTERM
    finishes the current step, saves a checkpoint and returns; a second one raises KeyboardInterrupt at once
    (the run continues from its last checkpoint). In execution.mode ray a dead trainer rank stops the run, or, up to
    ``execution.ray.max_trainer_restarts`` times, restarts the trainer from the newest checkpoint (step 0 before
    the first one); the records after a restart carry ``trainer/restarts``.

    Args:
        cfg: the validated config.
        run_dir: the run directory (created if missing).
        resume_from: a checkpoint directory to continue from exactly: weights, optimizer, scheduler, data
            position, RNG states and weight version are restored, and training runs the remaining steps up to
            ``loop.num_steps``; ``metrics.jsonl`` rows after the checkpoint's step are dropped.
        replace_existing: delete what ``run_dir`` holds (once the build succeeded; its lock file stays) and start
            it from step 0.
    Returns: how the run ended (``RunResult``).
    Raises: RunSetupError for a user-caused build problem (see ``build_inputs``; also a run directory that cannot
        be written or whose disk lacks room for one checkpoint, found before any model loads); RunInputError when
        every sample of a step failed; RunFailed when a trainer rank died (execution.mode ray) and no trainer
        restart is left; KeyboardInterrupt on a second signal. Each of these, and any other exception, is written
        to ``train.log`` once the run directory is written.
    """
    from miles.core.publisher import Colocation, EnginePublisher
    from miles.rollout.engines.launch import launch_engine
    from miles.rollout.engines.server_actor import EngineRestartError
    from miles.rollout.multimodal import load_tokenizer
    from miles.train.config import backend_class
    from miles.train.ray_group import TrainerRankFailed
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Loading weights" bars; the console sink owns the progress bar
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    with _run_log(run_dir) as start_log, contextlib.ExitStack() as stack:
        cfg = resolve_precision(cfg)
        # Everything is validated; now build (the order puts cheap failures first).
        plugins = load_run_plugins(cfg)
        reward_fn, data_source, eval_prompts = build_inputs(cfg)
        eval_sets = build_eval_sets(cfg)
        if hasattr(reward_fn, "close"):  # a ProcessPoolReward's worker processes end with the run
            stack.callback(reward_fn.close)
        if cfg.loop.mode != "sync":  # prompts generated ahead and not yet trained are stored with checkpoints
            data_source = PromptQueue(data_source)
        model_path = resolve_model_path(cfg.models.policy.path, key="models.policy.path")
        _check_room(cfg, run_dir, model_path=model_path, resume_from=resume_from)  # before any model loads
        if cfg.train.backend == "megatron":  # from config.json alone, before any engine starts
            _check_megatron_models(cfg, model_path)
        _check_vision_model(cfg, model_path)
        _check_qat_model(cfg, model_path)
        _check_packed_layout(cfg, model_path)
        _check_routing_model(cfg, model_path)
        t0 = time.perf_counter()
        # a VisionProcessor for a vision-language policy
        tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.models.policy.trust_remote_code)
        ray_mode = cfg.execution.mode == "ray"
        engine_placement = None
        if ray_mode:  # first: a cluster that cannot start or place the trainer fails before any server starts
            trainer_placement = stack.enter_context(ray_trainer_placement(cfg))
            engine_placement = stack.enter_context(ray_engine_placement(cfg))
        # Server logs start beside the run directory (not written before the build succeeds), then move into it.
        launched = launch_engine(
            cfg.engine,
            model_path,
            log_dir=run_dir.parent / f".{run_dir.name}.servers",
            seed=cfg.rollout.seed,
            remote_sink=ray_mode,
            server_actors=ray_mode,  # Ray owns and restarts the servers; the supervisor below watches them
            colocate_with=trainer_placement if ray_mode and cfg.execution.ray.colocate else None,
            engine_placement=engine_placement,
            weight_dir=run_dir.parent / f".{run_dir.name}.weights",  # engine.weight_transfer disk, removed at the end
            lora_rank=_adapter_rank(cfg),
            trust_remote_code=cfg.models.policy.trust_remote_code,
        )
        stack.callback(launched.close)
        engine = launched.engine
        if ray_mode:
            backend = build_ray_trainer(cfg, model_path, launched, trainer_placement, stack)
        else:
            backend = backend_class(cfg.train)(
                model_path,
                train=cfg.train,
                temperature=cfg.rollout.sampling.temperature,
                weight_sink=launched.weight_sink,
                **algorithm_models(cfg, model_path),
            )
        pause_mode = cfg.loop.pause_mode or getattr(cfg.engine, "pause_mode", "keep")
        probe = build_probe(cfg, tokenizer)
        colocation = Colocation([engine]) if cfg.execution.ray.colocate else None
        publisher = EnginePublisher(backend, [engine], pause_mode=pause_mode, probe=probe, colocation=colocation)
        generate_group = build_rollout(cfg, engine, tokenizer)
        eval_generate_group = build_eval_rollout(cfg, engine, tokenizer)
        logger.info(
            "loaded %s (engine: %s; trainer %s %s) in %.1fs",
            model_path,
            launched.description,
            cfg.train.backend,
            cfg.train.dtype,
            time.perf_counter() - t0,
        )
        # Built: from here on the run directory is written.
        if replace_existing and run_dir.is_dir():
            _remove_run_dir(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        launched.move_logs(run_dir / "servers")
        if launched.actor_logs or launched.processes:  # the start lines named the logs' first place
            logger.info("engine server and router logs: %s", run_dir / "servers")
        start_log()
        write_atomic(run_dir / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        checkpoints = run_dir / "checkpoints"
        final: list[Path] = []
        start_step = 0
        if resume_from is not None:  # last: building the models above consumed RNG draws the checkpoint must undo
            publisher, start_step = _restore_checkpoint(
                Path(resume_from),
                backend=backend,
                data_source=data_source,
                engine=engine,
                pause_mode=pause_mode,
                probe=probe,
                colocation=colocation,
            )
            _drop_metrics_after(run_dir / "metrics.jsonl", start_step)
            final.append(Path(resume_from))
            logger.info("resumed from %s at step %d (weights v%d)", resume_from, start_step, engine.weight_version)
        console = ConsoleSink(cfg.loop.num_steps, initial=start_step, enabled=cfg.run.progress)
        tensorboard = None
        if cfg.run.tensorboard:  # a resumed run logs again from the step after its checkpoint
            tensorboard = TensorBoardSink(run_dir / "tensorboard", purge_step=start_step + 1 if resume_from else None)
        config_dict = cfg.model_dump(mode="json")
        try:  # first: user code is the likeliest to fail, before a W&B run is opened
            hooks, extra_sinks = plugins.build_hooks_and_sinks(
                RunContext(run_dir=run_dir, config=config_dict, start_step=start_step)
            )
        except (ValueError, TypeError) as err:
            raise RunSetupError(" ".join(str(err).split())) from err
        wandb = None
        if cfg.run.wandb is not None:  # a resumed run continues the W&B run whose id the run directory holds
            wandb = WandbSink(cfg.run.wandb, run_dir=run_dir, run_config=config_dict, resume=resume_from is not None)
        sink = _RunSink(run_dir / "metrics.jsonl", console, tensorboard, wandb, extra=extra_sinks)
        stop = StopRequest()

        def save(step: int) -> Path:
            t_save = time.perf_counter()
            with stop.protect():
                try:
                    path = save_run_checkpoint(
                        checkpoints,
                        step,
                        backend=components.backend,  # the current trainer: a restart replaces it
                        data_source=data_source,
                        weight_version=engine.weight_version,
                        config=config_dict,
                        tokenizer=tokenizer,
                        keep=cfg.loop.keep_checkpoints,
                    )
                except (OSError, RuntimeError) as err:
                    if not isinstance(err, OSError) and not _is_write_error(err):
                        raise
                    logger.debug("checkpoint step_%d could not be written", step, exc_info=True)
                    raise RunFailed(
                        f"could not write checkpoint step_{step} in {checkpoints} "
                        f"({str(err).strip().splitlines()[0]}); the run stopped and {_last_checkpoint(final)}. "
                        "Free disk space (one checkpoint is ~12 bytes per parameter) or make the directory writable"
                    ) from err
                final.append(path)
            logger.info("saved checkpoint %s in %.2fs", final[-1], time.perf_counter() - t_save)
            return final[-1]

        components = Components(
            data_source=data_source,
            generate_group=generate_group,
            eval_generate_group=eval_generate_group,
            reward_fn=reward_fn,
            backend=backend,
            publisher=publisher,
            sink=sink,
            eval_prompts=eval_prompts,
            eval_sets=eval_sets,
            save_checkpoint=save,
            should_stop=stop,
            progress=console.eval_bar if cfg.run.progress else None,
            sample_hook=plugins.sample_hook,
            group_reward_fn=plugins.group_reward_fn,
            eval_fn=plugins.eval_fn,
            hooks=hooks,
            colocation=colocation,
        )
        if colocation is not None:
            colocation.start(backend)
        if launched.server_actors:  # Ray mode: a dead server is restarted, re-weighted and re-added to the router
            supervisor = launched.supervise(engine_resync(components, launched.sink_factory))
            components.engine_health = supervisor.check  # engine/restarts; an engine that stays dead stops the run
            components.publisher.guard = supervisor.publish_guard  # no push while a server restarts
        from tqdm.contrib.logging import logging_redirect_tqdm

        root = logging.getLogger()
        console_level = min(  # without a console handler, what logging's last resort shows (tqdm adds one)
            (h.level for h in root.handlers if type(h) is logging.StreamHandler), default=logging.WARNING
        )

        max_restarts, restarts = cfg.execution.ray.max_trainer_restarts, 0
        initial_state = (data_source.state_dict(), capture_rng_state())  # what a restart before any checkpoint restores
        try:
            with stop, logging_redirect_tqdm(), _console_level(console_level):  # log lines print above the bar
                while True:
                    try:
                        if restarts:  # after a failure; in the try: a rank may die again while the new one starts
                            start_step = _restart_trainer(
                                components,
                                build_backend=lambda: build_ray_trainer(
                                    cfg, model_path, launched, trainer_placement, stack
                                ),
                                checkpoint=final[-1] if final else None,
                                initial_state=initial_state,
                                engine=engine,
                                pause_mode=pause_mode,
                            )
                            sink.rewind(start_step, restarts=restarts)
                        steps_done = train(
                            components,
                            loop=cfg.loop,
                            rollout=cfg.rollout,
                            algorithm=cfg.algorithm,
                            evaluation=cfg.eval,
                            critic=cfg.models.critic,
                            start_step=start_step,
                        )
                        break
                    except TrainerRankFailed as err:  # Ray mode: the other ranks cannot go on without it
                        logger.debug("the trainer failed", exc_info=True)  # the whole story, in train.log only
                        if restarts == max_restarts:
                            raise
                        restarts += 1
                        logger.warning(
                            "%s; restarting the trainer from %s (restart %d of %d, execution.ray.max_trainer_restarts)",
                            str(err).splitlines()[0].rstrip(". "),
                            final[-1] if final else "step 0 (no checkpoint yet)",
                            restarts,
                            max_restarts,
                        )
        except TrainerRankFailed as err:
            where = _last_checkpoint(final)
            stopped = "the run stopped"
            if restarts:
                stopped += f", out of trainer restarts (execution.ray.max_trainer_restarts is {max_restarts}),"
            raise RunFailed(f"{str(err).splitlines()[0].rstrip('. ')}; {stopped} and {where}") from err
        except EngineRestartError as err:  # Ray mode: an engine server the supervisor could not bring back
            logger.debug("an engine failed", exc_info=True)
            first_line = str(err).splitlines()[0].rstrip(". ")
            raise RunFailed(f"{first_line}; the run stopped and {_last_checkpoint(final)}") from err
        except AllSamplesFailed as err:
            raise RunInputError(all_failed_message(err, cfg.reward)) from err
        except AllSamplesAborted as err:  # weight updates cut every request off: no user input is at fault
            raise RunFailed(f"{err}; the run stopped and {_last_checkpoint(final)}") from err
        except DynamicSamplingExhausted as err:  # the task's difficulty or the filter's settings: the user's to change
            raise RunInputError(str(err).rstrip(".")) from err
        finally:
            sink.close()
            if (run_dir / "metrics.jsonl").stat().st_size:
                plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png")
                plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png")
        if steps_done < cfg.loop.num_steps:  # the console may be gone (``| tee`` killed by the Ctrl-C): log it too
            logger.info("stopped by %s after step %d of %d", stop.requested, steps_done, cfg.loop.num_steps)
    return RunResult(
        run_dir=run_dir,
        steps_done=steps_done,
        num_steps=cfg.loop.num_steps,
        checkpoint=final[-1] if final else None,
        stopped_by=stop.requested if steps_done < cfg.loop.num_steps else None,
    )


def _is_write_error(err: RuntimeError) -> bool:
    """True for torch's own file-write failures (``torch.save`` on a full or vanishing disk raises RuntimeError from
    its zip writer, not OSError); a trainer or engine failure is not one."""
    return any(mark in str(err) for mark in ("PytorchStreamWriter", "inline_container", "file write failed"))


def all_failed_message(err: AllSamplesFailed, reward: RewardConfig) -> str:
    """One line for a step in which every sample failed: the step, the reward function (``reward.path``, or the
    built-in ``reward.type``) when every failure was the reward's, the first three distinct failure reasons and the
    fix."""
    name = f"reward.path {reward.path!r}" if reward.type == "custom" else f"reward.type {reward.type!r}"
    if reward.group_path:
        name += f" with reward.group_path {reward.group_path!r}"
    rewards_failed = all(kind.startswith("reward_") for kind in err.kinds)
    reasons = "; ".join(one_line(reason) for reason in err.reasons[:3])
    if len(err.reasons) > 3:
        reasons += f"; and {len(err.reasons) - 3} more"
    if err.kinds == ["reward_timeout"]:
        fix = (
            f"Make the reward function return within reward.timeout_s ({reward.timeout_s:g} s), or raise "
            "--reward.timeout-s"
        )
    elif rewards_failed:
        fix = "Fix the reward function (call it on one sample in Python to see its error)"
    else:
        fix = "Fix what the reasons name"
    which = f" (reward: {name})" if rewards_failed else ""  # not the reward's fault when generation failed
    return f"step {err.step}: all {err.num_samples} samples failed{which}; first reasons: {reasons}. {fix}"


def _adapter_rank(cfg: MilesConfig) -> int:
    """The LoRA rank of a run whose engines apply the adapters themselves (``train.lora.sync adapter``), else 0."""
    lora = cfg.train.lora
    return lora.rank if lora is not None and lora.sync == "adapter" else 0


def _check_qat_model(cfg: MilesConfig, model_path: Path) -> None:
    """Refuse, in one line and before any model loads, ``train.qat`` on a model with a weight the engine's codec
    would quantize that QAT cannot fake-quantize (FSDP2: fused MoE expert tensors): from config.json, on the meta
    device. The Megatron backend holds each expert as its own linear and fake-quantizes it (its check is at build)."""
    if cfg.train.qat == "none" or cfg.train.backend == "megatron":
        return
    from miles.train.qat import check_qat_model
    from transformers import AutoConfig

    try:
        trusted = cfg.models.policy.trust_remote_code
        check_qat_model(
            AutoConfig.from_pretrained(model_path, trust_remote_code=trusted), cfg.train.qat, trust_remote_code=trusted
        )
    except ValueError as err:
        raise RunSetupError(f"models.policy.path ({model_path}): {err}") from None


def _check_routing_model(cfg: MilesConfig, model_path: Path) -> None:
    """Refuse, in one line and before any model loads, ``engine.routed_experts`` for a policy with no MoE router
    (nothing to record) or, on FSDP2, a router class Miles cannot replay: ``routing_layout`` of the model built on
    the meta device from config.json (no weights read)."""
    if not getattr(cfg.engine, "routed_experts", False):  # vLLM engines have no such field
        return
    import torch
    from miles.core.multimodal import auto_model_class
    from miles.core.routing_replay import routing_layout
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.models.policy.trust_remote_code)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, trust_remote_code=cfg.models.policy.trust_remote_code)
    try:
        layout = routing_layout(model)
    except ValueError as err:
        if cfg.train.backend != "fsdp2":  # Megatron replays its own routers
            return
        raise RunSetupError(f"models.policy.path ({model_path}): {err}") from None
    if layout is None:
        raise RunSetupError(
            f"engine.routed_experts is true but models.policy.path ({model_path}) has no MoE router to record; "
            "drop --engine.routed-experts for a dense model"
        )


def _check_packed_layout(cfg: MilesConfig, model_path: Path) -> None:
    """Refuse, in one line and before any model loads, ``train.batch_layout packed`` on the FSDP2 backend with a
    policy, reference, teacher or critic whose architecture packing would compute wrongly
    (``miles.core.log_probs.packing_refusal``), from config.json files alone."""
    if cfg.train.batch_layout != "packed" or cfg.train.backend != "fsdp2":
        return
    from miles.core.log_probs import packing_refusal
    from transformers import AutoConfig

    for key, (path, trusted) in _model_dirs(cfg, model_path).items():
        if (refusal := packing_refusal(AutoConfig.from_pretrained(path, trust_remote_code=trusted))) is not None:
            raise RunSetupError(
                f"{key} ({path}): train.batch_layout packed: {refusal}; set --train.batch-layout padded"
            )


def _feeds_images(cfg: MilesConfig) -> bool:
    """Whether this run's prompts surely carry images: an ``image_key`` in the data section, a mixture component or
    an eval set's data, or the bundled visual task as the data source."""
    visual = "miles.rollout.data.visual_tasks:"
    return any(
        _data_field(s, "image_key") or str(_data_field(s, "source_path") or "").startswith(visual)
        for s in _data_sections(cfg)
    )


def _data_sections(cfg: MilesConfig) -> list[Any]:
    """The data section, its mixture components and the eval sets' data overrides (dicts)."""
    return [cfg.data, *cfg.data.mixture, *(eval_set.data for eval_set in cfg.eval.sets)]


def _data_field(section: Any, key: str) -> Any:
    return section.get(key) if isinstance(section, dict) else getattr(section, key, None)


def _may_feed_images(cfg: MilesConfig) -> bool:
    """Whether this run's prompts may carry images: an ``image_key`` in the data section, a mixture component or an
    eval set's data, or a custom data source (``data.source custom``: its entries are not known before it runs)."""
    return any(_data_field(s, "image_key") or _data_field(s, "source") == "custom" for s in _data_sections(cfg))


TEXT_ONLY_VISION_TYPES = ("kimi_k25",)
"""Vision-language model types whose towers take pixels as [P, 3, p, p] patches (Kimi K2.5's MoonViT), not the
[P, D] rows Miles' Qwen-VL-style rendering gives: trained on text prompts only (the tower frozen or not)."""


def _check_vision_model(cfg: MilesConfig, model_path: Path, *, training: bool = True) -> None:
    """Refuse, in one line, what vision-language policies do not run with yet: vLLM servers when the prompts may
    carry images, except Qwen3-VL and Qwen2-VL (``vllm_images.IMAGE_MODEL_TYPES``) with full-weight updates through
    the weight group (SGLang-API servers take them as image_data; text-only runs of a vision-language checkpoint, as
    Qwen3.5's, use any engine), vLLM and SGLang servers for Idefics3 / SmolVLM image prompts (the embedded engine and
    miles serve take them) and LoRA on those models, SFT rollouts and agent plugins (their renderers do not carry
    images; multi-turn tool calling does), a critic (no token-classification head for VLMs), a text-only reference
    or teacher, and image prompts for ``TEXT_ONLY_VISION_TYPES`` (Kimi K2.5). The Megatron backend refuses the
    architecture itself (``_check_megatron_models``). From config.json files alone, before anything starts."""
    from miles.core.multimodal import IDEFICS3_MODEL_TYPES, is_multimodal_config
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.models.policy.trust_remote_code)
    if not is_multimodal_config(config):
        if _feeds_images(cfg):
            raise RunSetupError(
                f"models.policy.path ({model_path}) is a text-only model but the prompts carry images (data.image_key "
                "or the bundled visual task); use a vision-language model (e.g. --models.policy.path tiny-qwen3-vl)"
            )
        if training and cfg.train.freeze_vision_tower:
            raise RunSetupError(
                f"train.freeze_vision_tower is true but models.policy.path ({model_path}) has no vision tower; drop "
                "--train.freeze-vision-tower"
            )
        return
    where = f"models.policy.path ({model_path}) is a vision-language model"
    images = _may_feed_images(cfg)
    if images and config.model_type in TEXT_ONLY_VISION_TYPES:
        raise RunSetupError(
            f"{where} ({config.model_type}) that Miles trains on text prompts only: its tower takes another pixel "
            "layout than Miles' image processing renders; drop data.image_key (and the visual task), or use a "
            "Qwen-VL family model for image prompts"
        )
    miles_serve = cfg.engine.type == "sglang" and cfg.engine.server == "miles"
    if images and config.model_type in IDEFICS3_MODEL_TYPES and cfg.engine.type != "embedded" and not miles_serve:
        server = "vLLM" if cfg.engine.type == "vllm" else "SGLang"
        raise RunSetupError(
            f"{where} ({config.model_type}, the Idefics3 / SmolVLM image layout): image prompts run on the embedded "
            f"engine and miles serve only, not on {server} servers yet; set --engine.type embedded, or sglang with "
            "--engine.server miles (a text-only run, without data.image_key or a custom data source, may use any "
            "engine)"
        )
    if training and config.model_type in IDEFICS3_MODEL_TYPES and cfg.train.lora is not None:
        raise RunSetupError(
            f"{where} ({config.model_type}): LoRA is not tested on Idefics3 / SmolVLM yet (the default "
            "train.lora.target_modules q/k/v_proj would also adapt its vision tower's attention); drop "
            "--train.lora.rank"
        )
    if cfg.engine.type == "vllm" and images:
        from miles.rollout.engines.vllm_images import IMAGE_MODEL_TYPES

        untested = {
            f"a model type other than {' or '.join(IMAGE_MODEL_TYPES)}": config.model_type not in IMAGE_MODEL_TYPES,
            "engine.weight_transfer disk": cfg.engine.weight_transfer == "disk",
            "LoRA adapter sync (train.lora.sync adapter)": cfg.train.lora is not None
            and cfg.train.lora.sync == "adapter",
        }
        for what, refused in untested.items():
            if refused:
                raise RunSetupError(
                    f"{where} ({config.model_type}): image prompts go to vLLM servers for Qwen3-VL and Qwen2-VL with "
                    f"the weight group's full-weight updates only, not with {what} yet; set --engine.type embedded or "
                    "sglang (a text-only run, without data.image_key or a custom data source, may use vLLM)"
                )
    if not images and cfg.engine.type != "embedded":
        logger.info("%s, trained on text prompts only (engine %s)", where, cfg.engine.type)
    if cfg.rollout.mode not in ("generate", "multi_turn"):
        raise RunSetupError(
            f"{where}: rollout.mode {cfg.rollout.mode} does not run vision-language models yet (its renderer does not "
            "carry images); use --rollout.mode generate or multi_turn"
        )
    if cfg.rollout.mode == "multi_turn" and cfg.rollout.multi_turn.agent_path:
        raise RunSetupError(
            f"{where}: an agent plugin (rollout.multi_turn.agent_path) talks to the OpenAI-compatible endpoint, which "
            "takes no images yet; drop --rollout.multi-turn.agent-path (multi-turn tool calling takes image prompts)"
        )
    if not training:
        return
    refusals = {  # what: (set, why, fix)
        "a critic (models.critic)": (
            cfg.models.critic is not None,
            "no token-classification head",
            "use an algorithm without one (GRPO, REINFORCE++)",
        ),
    }
    for what, (refused, why, fix) in refusals.items():
        if refused:
            raise RunSetupError(f"{where}: {what} is not supported for vision-language models yet ({why}); {fix}")
    for key, section in (("models.reference.path", cfg.models.reference), ("models.teacher.path", cfg.models.teacher)):
        path = getattr(section, "path", "") if section is not None else ""
        if path:
            other = resolve_model_path(path, key=key)
            if not is_multimodal_config(AutoConfig.from_pretrained(other, trust_remote_code=section.trust_remote_code)):
                raise RunSetupError(f"{where} but {key} ({other}) is text-only: it cannot score image prompts")


def _check_megatron_models(cfg: MilesConfig, model_path: Path) -> None:
    """Refuse, in one line, a policy, reference or teacher the Megatron backend cannot convert with
    ``train.megatron``'s parallel sizes, or a missing megatron-core (``RunSetupError``)."""
    from miles.train.megatron.convert import check_model_dir

    dirs = _model_dirs(cfg, model_path)
    for key, (path, trusted) in dirs.items():
        if key == "models.critic.path":  # refused by the backend itself (no critic on Megatron yet)
            continue
        try:
            check_model_dir(
                path,
                tensor_parallel=cfg.train.megatron.tensor_parallel_size,
                expert_parallel=cfg.train.megatron.expert_parallel_size,
                pipeline_parallel=cfg.train.megatron.pipeline_parallel_size,
                key=key,
                trust_remote_code=trusted,
            )
        except ValueError as err:
            raise RunSetupError(str(err)) from None
        if cfg.train.megatron.context_parallel_size > 1:  # dense models only
            from miles.train.megatron.context_parallel import model_refusal
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trusted)
            if refusal := model_refusal(hf_config, context_parallel=cfg.train.megatron.context_parallel_size):
                raise RunSetupError(f"{key} ({path}): {refusal}")
    from miles.train.megatron.vision import check_supported as check_vision_language
    from transformers import AutoConfig

    megatron = cfg.train.megatron
    try:  # a vision-language policy: Qwen2-VL without pipeline / expert parallelism, LoRA or QAT
        check_vision_language(
            AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.models.policy.trust_remote_code),
            pipeline_parallel=megatron.pipeline_parallel_size,
            expert_parallel=megatron.expert_parallel_size,
            lora=cfg.train.lora is not None, qat=cfg.train.qat,
        )  # fmt: skip
    except ValueError as err:
        raise RunSetupError(f"models.policy.path ({model_path}): {err}") from None
    if cfg.train.lora is not None:
        from miles.train.megatron.convert import is_moe
        from transformers import AutoConfig

        if is_moe(AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.models.policy.trust_remote_code)):
            raise RunSetupError(
                f"models.policy.path ({model_path}) is an MoE model: train.backend megatron does not support "
                "train.lora on MoE models yet; use --train.backend fsdp2 or --train.lora off"
            )


def _check_room(cfg: MilesConfig, run_dir: Path, *, model_path: Path, resume_from: Path | None) -> None:
    """``check_room`` for one checkpoint of this run (the policy, and the critic trained beside it), estimated
    from the models' files or the checkpoint resumed from; reads no weights.

    Raises: RunSetupError naming the run directory, the sizes and the fix.
    """
    model_dirs = [model_path]
    if cfg.models.critic is not None:
        critic = cfg.models.critic.path
        model_dirs.append(resolve_model_path(critic, key="models.critic.path") if critic else model_path)
    size, how = checkpoint_size(resume_from=resume_from, model_dirs=model_dirs, lora=cfg.train.lora is not None)
    try:
        check_room(run_dir, checkpoint_bytes=size, how=how, keep_checkpoints=cfg.loop.keep_checkpoints)
    except RunDirError as err:
        raise RunSetupError(str(err)) from err


def _last_checkpoint(final: list[Path]) -> str:
    """Where a failed run continues from, for its one-line message."""
    return f"its last checkpoint is {final[-1]}" if final else "no checkpoint was written (it starts at step 0)"


@contextmanager
def _run_log(run_dir: Path) -> Iterator:
    """DEBUG-level log of the ``miles`` loggers into ``run_dir/train.log``; records are buffered in memory until
    the yielded ``start()`` is called (once the run directory may be written), so a failed build writes nothing.

    An exception that ends the run after ``start()`` is written to ``train.log`` alone (the console gets the
    ``miles:`` line): ERROR with its message (and the traceback, for an unexpected one), or a line for an interrupt.
    """
    miles_logger = logging.getLogger("miles")
    previous_level = miles_logger.level
    if miles_logger.getEffectiveLevel() > logging.DEBUG:
        miles_logger.setLevel(logging.DEBUG)  # handlers (the console's is INFO) filter what they show
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    buffer = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    miles_logger.addHandler(buffer)
    file_handler: list[logging.Handler] = []

    def start() -> None:
        handler = logging.FileHandler(run_dir / LOG_FILE, encoding="utf-8")
        handler.setFormatter(formatter)
        handler.setLevel(logging.DEBUG)
        buffer.setTarget(handler)
        buffer.flush()
        miles_logger.removeHandler(buffer)
        miles_logger.addHandler(handler)
        file_handler.append(handler)

    try:
        yield start
    except BaseException as err:
        if file_handler:
            _log_to_file(file_handler[0], err)
        raise
    finally:
        miles_logger.removeHandler(buffer)
        buffer.close()
        for handler in file_handler:
            miles_logger.removeHandler(handler)
            handler.close()
        miles_logger.setLevel(previous_level)


def _log_to_file(handler: logging.Handler, err: BaseException) -> None:
    """Write how a run ended on ``err`` to ``train.log``'s handler only."""
    exc_info = None
    if isinstance(err, KeyboardInterrupt):
        level, message = logging.INFO, "interrupted (Ctrl-C or SIGTERM): the step in progress was abandoned"
    elif isinstance(err, (RunInputError, RunFailed)):  # one line; the DEBUG lines above it tell the story
        level, message = logging.ERROR, f"the run stopped: {err}"
    else:
        level, message = logging.ERROR, f"the run failed: {type(err).__name__}: {err}"
        exc_info = (type(err), err, err.__traceback__)
    handler.handle(logging.LogRecord(__name__, level, __file__, 0, message, None, exc_info))


@contextmanager
def _console_level(level: int) -> Iterator[None]:
    """Give tqdm's console handlers (``logging_redirect_tqdm`` swaps them in without the level) the level of the
    handlers they replace, so the DEBUG lines meant for ``train.log`` stay off the console."""
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "_TqdmLoggingHandler":
            handler.setLevel(level)
    yield


def _remove_run_dir(run_dir: Path) -> None:
    """Delete what a run directory holds but its lock file (``miles train`` holds it: the directory itself must
    stay). Each entry is renamed into a trash directory beside it (atomic), ``checkpoints/`` first, so a crash
    midway never leaves part of a checkpoint, and a checkpoint never outlives the rest of its run."""
    entries = sorted((p for p in run_dir.iterdir() if p.name != LOCK_FILE), key=lambda p: p.name != "checkpoints")
    if not entries:
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.trash-", dir=run_dir.parent))
    for entry in entries:
        os.replace(entry, trash / entry.name)
    shutil.rmtree(trash, ignore_errors=True)
    logger.info("removed the previous contents of %s", run_dir)


def _drop_metrics_after(path: Path, step: int) -> None:
    """Keep only the ``metrics.jsonl`` rows up to ``step`` (a crashed run may have logged steps past its
    last checkpoint; the resumed run logs them again)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        write_atomic(path, "".join(kept))


def _restore_checkpoint(
    checkpoint: Path,
    *,
    backend: TrainBackend,
    data_source: DataSource,
    engine: Any,
    pause_mode: str,
    guard: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    probe: LogProbProbe | None = None,
    colocation: Colocation | None = None,
) -> tuple[EnginePublisher, int]:
    """Restore ``checkpoint`` into a built trainer and data source (``restore_run_checkpoint``: weights, optimizer,
    data position, RNG states) and push its weights to ``engine``, which holds others (models.policy.path's, or
    newer ones), as the checkpoint's weight version. Returns (the publisher, continuing from that version; the
    checkpoint's step). With ``colocation`` the push re-allocates engines that released their memory."""
    from miles.core.publisher import EnginePublisher

    state = restore_run_checkpoint(checkpoint, backend=backend, data_source=data_source)
    publisher = EnginePublisher(
        backend,
        [engine],
        version=max(state.weight_version - 1, 0),
        pause_mode=pause_mode,
        guard=guard,
        probe=probe,
        colocation=colocation,
    )
    if state.weight_version > 0:
        publisher.publish()  # as the checkpoint's version; the next step's publish continues from it
    return publisher, state.step


def _restart_trainer(
    components: Components,
    *,
    build_backend: Callable[[], TrainBackend],
    checkpoint: Path | None,
    initial_state: tuple[dict[str, Any], dict[str, Any]],
    engine: Any,
    pause_mode: str,
) -> int:
    """Replace the failed trainer of ``components`` (execution.ray.max_trainer_restarts): close it (its actors are
    killed; the placement group stays), build a new one and restore ``checkpoint`` into it, or with None go back to
    step 0: ``initial_state`` (the data source's state and the RNG states before the first step) and the weights of
    models.policy.path, pushed to ``engine`` as a new version if it holds trained ones. Sets ``components.backend``
    and ``components.publisher``. Returns the step to continue from.

    Raises: TrainerRankFailed when a rank of the new trainer dies too.
    """
    from miles.core.publisher import EnginePublisher

    t0 = time.perf_counter()
    components.backend.close()
    backend = build_backend()
    if checkpoint is not None:
        publisher, step = _restore_checkpoint(
            checkpoint,
            backend=backend,
            data_source=components.data_source,
            engine=engine,
            pause_mode=pause_mode,
            guard=components.publisher.guard,  # the engine supervisor's, in Ray mode
            probe=components.publisher.probe,
            colocation=components.colocation,  # a trainer that died mid-step may leave the engines released
        )
    else:
        data_state, rng_state = initial_state
        components.data_source.load_state_dict(data_state)
        restore_rng_state(rng_state)
        version, guard, probe = engine.weight_version, components.publisher.guard, components.publisher.probe
        publisher = EnginePublisher(
            backend,
            [engine],
            version=version,
            pause_mode=pause_mode,
            guard=guard,
            probe=probe,
            colocation=components.colocation,
        )
        step = 0
        released = components.colocation is not None and components.colocation.released
        if publisher.version > 0 or released:  # versions never repeat: the initial weights come back as a new one
            publisher.publish()
    components.backend, components.publisher = backend, publisher
    logger.info(
        "restarted the trainer at step %d (weights v%d) in %.1fs", step, publisher.version, time.perf_counter() - t0
    )
    return step


class _RunSink:
    """The run's metrics sinks, ``metrics.jsonl`` and the console (and TensorBoard, W&B when on). After a trainer
    restart (``rewind``) every record also counts the restarts so far (``trainer/restarts``)."""

    def __init__(
        self,
        path: Path,
        console: ConsoleSink,
        tensorboard: TensorBoardSink | None = None,
        wandb: WandbSink | None = None,
        *,
        extra: Sequence[MetricsSink] = (),
    ) -> None:
        self.path, self.console, self.tensorboard, self.wandb = path, console, tensorboard, wandb
        self.extra = list(extra)  # run.sinks
        self._jsonl = JsonlSink(path)
        self._restarts = 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._restarts:
            metrics = {**metrics, "trainer/restarts": float(self._restarts)}
        self._jsonl.log(metrics, step)
        if self.tensorboard is not None:
            self.tensorboard.log(metrics, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step)
        for extra in self.extra:
            extra.log(metrics, step)
        self.console.log(metrics, step)

    def rewind(self, step: int, *, restarts: int) -> None:
        """Drop the ``metrics.jsonl`` rows the restarted trainer logs again: those after ``step``, all of them from
        step 0 (the step-0 eval runs again); TensorBoard hides the same events (W&B keeps their first values)."""
        self._jsonl.close()  # the file is replaced: append to the new one
        _drop_metrics_after(self.path, step if step > 0 else -1)
        self._jsonl = JsonlSink(self.path)
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = TensorBoardSink(self.tensorboard.log_dir, purge_step=step + 1 if step > 0 else 0)
        self._restarts = restarts

    def close(self) -> None:
        self._jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()
        for extra in self.extra:
            extra.close()
        self.console.close()
