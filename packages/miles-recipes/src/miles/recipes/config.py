"""The root config tree: each section is owned by its package; this module composes them and checks the rules
across sections. Validation is pure (no file read, no plugin imported, no model resolved), so a cluster recipe
validates on a laptop; ``miles.recipes.run.build_inputs`` checks files, models and plugins when a run is built."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from miles.core.algorithms.config import ON_OFF
from miles.core.algorithms.registry import POLICY_LOSSES
from miles.core.config import (
    AlgorithmConfig,
    EvalConfig,
    ExecutionConfig,
    LoopConfig,
    ModelsConfig,
    RolloutConfig,
    check_group_size,
    check_models,
)
from miles.core.plugins import check_plugin_path
from miles.rollout.config import (
    MIXTURE_REPLACES,
    DataConfig,
    EmbeddedEngineConfig,
    EngineConfig,
    RewardConfig,
    check_engine_health_settings,
)
from miles.train.config import BACKEND_NAMES, TrainConfig
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class WandbConfig(BaseModel):
    """A Weights & Biases run fed the same metrics as metrics.jsonl (``miles.recipes.sinks.WandbSink``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    project: str = Field("miles", description="W&B project the run is logged to.")
    name: str = Field("", description="W&B run display name; empty = the run directory's name (run.name).")
    group: str = Field("", description="W&B group, to compare runs of one sweep together; empty = no group.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline (the default): write the W&B run files only, no network or account needed; upload "
        "later with `wandb sync <dir>/wandb/offline-run-*`. online: stream to the W&B server (needs `wandb login` "
        "or WANDB_API_KEY).",
    )
    dir: str = Field(
        "", description="Directory W&B writes its wandb/ folder into; empty = the run directory (recommended)."
    )


class RunConfig(BaseModel):
    """Where outputs go and how the process runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field("", description="Run directory name under run.dir; empty = '<recipe>-<timestamp>'.")
    dir: str = Field("runs", description="Parent directory of run directories.")
    num_threads: int = Field(
        0, ge=0, description="torch intra-op threads; 0 = one per core. Use 1 when another job shares the cores."
    )
    progress: bool = Field(True, description="Show a console progress bar with the key metrics.")
    tensorboard: bool = Field(
        False,
        description="Also write every metric as a TensorBoard scalar under <run dir>/tensorboard/ (same names as "
        "metrics.jsonl; `tensorboard --logdir runs`). Needs pip install 'miles-recipes[tensorboard]' (the "
        "workspace has it).",
    )
    wandb: Annotated[WandbConfig | None, ON_OFF] = Field(
        None,
        description="Also log every metric (same names as metrics.jsonl) and the resolved config to a Weights & "
        "Biases run; null (the default) = off. --run.wandb on turns it on with the defaults below, any "
        "--run.wandb.KEY VALUE too. The W&B run id is kept in <run dir>/wandb_run_id, so --resume continues the "
        "same W&B run; W&B ignores steps below the last one it has (online: the steps a crashed run logged past "
        "its checkpoint keep their first values). Needs pip install 'miles-recipes[wandb]' (the workspace has it).",
    )
    hooks: list[str] = Field(
        default_factory=list,
        description="module:attr of train-hook factories (context: miles.core.protocols.RunContext) -> an object "
        "with any of on_rollout_end(step, samples), on_train_step_end(step, metrics), on_save(step, path).",
    )
    sinks: list[str] = Field(
        default_factory=list,
        description="module:attr of metrics-sink factories (context: RunContext) -> an object with log(metrics, "
        "step) and close(), fed the same records as metrics.jsonl.",
    )

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        for key in ("hooks", "sinks"):
            for i, path in enumerate(getattr(self, key)):
                check_plugin_path(f"run.{key}[{i}]", path, f"my_pkg.tracking:build_{key[:-1]}")
        return self


class MilesConfig(BaseModel):
    """Everything a run needs; validated as a whole before anything is loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    models: ModelsConfig = Field(default_factory=ModelsConfig, description="Policy, reference, critic, teacher.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt source.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Batch arithmetic and sampling.")
    engine: EngineConfig = Field(
        default_factory=EmbeddedEngineConfig, description="Inference engine, chosen by engine.type."
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages, loss and terms.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training backend.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig, description="Where the components run.")
    loop: LoopConfig = Field(default_factory=LoopConfig, description="Loop kind, steps and checkpoint cadence.")
    run: RunConfig = Field(default_factory=RunConfig, description="Outputs and process settings.")

    @model_validator(mode="after")
    def _check(self) -> MilesConfig:
        self._check_algorithm()
        if self.reward.type == "reasoning_gym" and self.data.source != "reasoning_gym":
            raise ValueError(
                "reward.type is 'reasoning_gym' but data.source is "
                f"{self.data.source!r}: that scorer needs reasoning-gym entries as labels. "
                "Set --reward.type math (for GSM8K-style answers) or custom."
            )
        for i, component in enumerate(self.data.mixture):
            if self.reward.type == "reasoning_gym" and component.source != "reasoning_gym":
                raise ValueError(
                    f"reward.type is 'reasoning_gym' but data.mixture[{i}].source ({component.name}) is "
                    f"{component.source!r}: that scorer needs reasoning-gym entries as labels. Set --reward.type "
                    "custom with a reward that scores each dataset its own way (sample.metadata['dataset'] names it)."
                )
        self._check_execution()
        self._check_loop()
        self._check_megatron()
        self._check_qat()
        if self.train.dtype == "fp16" and self.models.critic is not None:
            raise ValueError(
                "train.dtype is 'fp16' with a critic (models.critic, advantage gae): the critic has no loss scaling "
                "yet. Use --train.dtype bf16 or fp32, or another advantage estimator"
            )
        lora = self.train.lora
        if lora is not None and lora.sync == "adapter":
            if self.engine.type == "sglang" and self.engine.server == "sglang" and self.loop.partial_rollout:
                raise ValueError(
                    "loop.partial_rollout is on with train.lora.sync adapter on SGLang servers: SGLang keeps a "
                    "request paused in place on the adapter it started with, so its later tokens would not be "
                    "sampled by the weights its version says. Set --loop.partial-rollout false, or --train.lora.sync "
                    "merged."
                )
            if self.engine.type == "vllm" and lora.rank > 512:
                raise ValueError(
                    f"train.lora.rank is {lora.rank} with train.lora.sync adapter on vLLM, which serves adapters of "
                    "rank up to 512: set --train.lora.rank 512 or less, or --train.lora.sync merged"
                )
            if self.engine.type != "embedded" and getattr(self.engine, "delta_weights", False):
                raise ValueError(
                    "engine.delta_weights is on with train.lora.sync adapter: the servers load each adapter version "
                    "from disk whole. Set --engine.delta-weights false."
                )
        for i in range(len(self.eval.sets)):
            eval_set_data(self, i)  # each named eval set's data section validates
        return self

    def _check_megatron(self) -> None:
        """Refuse what train.backend megatron does not hold yet, before any model loads."""
        train = self.train
        mg = train.megatron
        if train.backend != "megatron":
            sizes = {k: v for k, v in mg.model_dump().items() if v != 1}
            if sizes:  # a layout the FSDP2 backend would silently ignore
                key, size = next(iter(sizes.items()))
                raise ValueError(
                    f"train.megatron.{key} is {size} but train.backend is {train.backend!r}, which does not read "
                    f"train.megatron (FSDP2 shards every layer over train.world_size); use --train.backend megatron, "
                    f"or drop --train.megatron.{key.replace('_', '-')}"
                )
            return
        lora = train.lora
        refused = (
            (lora is not None and lora.dropout > 0, "train.lora.dropout > 0", "--train.lora.dropout 0"),
            (self.models.critic is not None, "a critic (models.critic, advantage gae)", "another advantage estimator"),
            (train.dtype in ("bf16", "fp16"), f"train.dtype {train.dtype}", "--train.dtype fp32"),
        )
        for is_set, what, fix in refused:
            if is_set:
                raise ValueError(
                    f"train.backend is 'megatron', which does not support {what} yet: use {fix}, or "
                    "--train.backend fsdp2"
                )
        if train.qat != "none":
            from miles.train.megatron.qat import check_megatron_qat

            check_megatron_qat(train.qat)
        if lora is not None:
            from miles.train.megatron.lora import megatron_targets

            megatron_targets(lora.target_modules)  # fused q/k/v and gate/up are targeted whole
        tensor_parallel, expert_parallel = mg.tensor_parallel_size, mg.expert_parallel_size
        pipeline_parallel, context_parallel = mg.pipeline_parallel_size, mg.context_parallel_size
        from miles.train.megatron.context_parallel import context_parallel_refusal

        refusal = context_parallel_refusal(
            context_parallel=context_parallel, tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
        )  # fmt: skip
        if refusal is not None:
            raise ValueError(refusal)
        if context_parallel > 1 and train.world_size % (tensor_parallel * context_parallel * pipeline_parallel):
            raise ValueError(
                f"train.megatron.context_parallel_size is {context_parallel} (tensor_parallel_size "
                f"{tensor_parallel}, pipeline_parallel_size {pipeline_parallel}) but train.world_size is "
                f"{train.world_size}: each sequence is split over context_parallel_size ranks of a replica; set "
                f"--train.world-size to a multiple of {tensor_parallel * context_parallel * pipeline_parallel} "
                "(several ranks run as Ray actors: --execution.mode ray), or a smaller size"
            )
        product = tensor_parallel * expert_parallel * pipeline_parallel
        if train.world_size % product:
            raise ValueError(
                f"train.megatron.tensor_parallel_size is {tensor_parallel}, expert_parallel_size {expert_parallel} "
                f"and pipeline_parallel_size {pipeline_parallel} but train.world_size is {train.world_size}: the "
                "trainer's ranks are tensor_parallel_size x pipeline_parallel_size x data-parallel replicas, a "
                "stage's replicas split its experts expert_parallel_size ways; set --train.world-size to a multiple of "
                f"{product} (several ranks run as Ray actors: --execution.mode ray), or smaller sizes"
            )

    def _check_qat(self) -> None:
        """QAT trains for the engine's quantized weights: the same codec on both sides, FSDP2 without LoRA."""
        qat = self.train.qat
        if qat == "none":
            return
        codec = getattr(self.engine, "weight_codec", None)
        if codec is None:
            raise ValueError(
                f"train.qat is {qat!r} but engine.type {self.engine.type} has no weight_codec (quantized rollout is "
                f"wired for the embedded engine): use --engine.type embedded --engine.weight-codec {qat}, or drop "
                "--train.qat"
            )
        if codec != qat:
            other = "drop --train.qat" if codec == "identity" else f"--train.qat {codec}"
            raise ValueError(
                f"train.qat is {qat!r} but engine.weight_codec is {codec!r}: QAT trains for the engine's weights, so "
                f"the two must name one codec. Set --engine.weight-codec {qat}, or {other}"
            )
        if self.train.lora is not None:
            raise ValueError(
                f"train.qat is {qat!r} with train.lora on: QAT fake-quantizes full linear weights, not base + "
                "adapter. Drop --train.lora, or --train.qat"
            )

    def _check_loop(self) -> None:
        """Refuse an asynchronous loop with parts it cannot run ahead: SFT (nothing is generated) and dynamic
        sampling (its rounds need the whole step's rewards before generating more)."""
        mode = self.loop.mode
        if mode == "sync":
            return
        if self.rollout.mode == "sft":
            raise ValueError(
                f"loop.mode is {mode!r} but rollout.mode is 'sft': supervised fine-tuning generates nothing to "
                "overlap with training. Set --loop.mode sync."
            )
        if self.algorithm.dynamic_sampling is not None:
            raise ValueError(
                f"loop.mode is {mode!r} but algorithm.dynamic_sampling is on, which the asynchronous loops do not "
                "support yet. Set --loop.mode sync, or --algorithm.dynamic-sampling null."
            )
        loop_pause = self.loop.pause_mode
        engine_pause = getattr(self.engine, "pause_mode", None)
        if loop_pause is not None and "pause_mode" in self.engine.model_fields_set and engine_pause != loop_pause:
            raise ValueError(
                f"engine.pause_mode is {engine_pause!r} but loop.mode fully_async pauses the engines with "
                f"{loop_pause!r} at every weight update (abort, or retract with --loop.partial-rollout true); drop "
                "--engine.pause-mode"
            )

    def _check_execution(self) -> None:
        """Refuse a trainer world size the execution mode cannot run, and Ray execution without a server engine."""
        execution, world_size = self.execution, self.train.world_size
        if world_size != 1 and execution.mode == "local":
            backend = BACKEND_NAMES[self.train.backend]
            raise ValueError(
                f"train.world_size is {world_size} but execution.mode is 'local', which trains in this one process "
                f"(world size 1). Set --execution.mode ray to run {world_size} {backend} ranks as Ray actors (with a "
                "server engine: --engine.type sglang --engine.server miles on CPU), or --train.world-size 1."
            )
        check_engine_health_settings(self.engine, execution_mode=execution.mode)
        if execution.mode != "ray":
            return
        if self.engine.type == "embedded":
            raise ValueError(
                "execution.mode is 'ray' but engine.type is 'embedded': the embedded engine lives in the driver "
                "process and its in-process weight transfer cannot reach it from the trainer's rank-0 actor. Use a "
                "server engine: --engine.type sglang --engine.server miles (CPU; --engine.type vllm or sglang on "
                "GPU), or --execution.mode local."
            )
        if execution.ray.colocate:
            self._check_colocation()
        if execution.ray.engine_bundle:
            self._check_engine_bundles()
        ray, cpus = execution.ray, world_size * execution.ray.trainer_cpus_per_rank
        if ray.num_cpus is not None and cpus > ray.num_cpus:
            raise ValueError(
                f"execution.ray.num_cpus is {ray.num_cpus}, but the trainer's bundles need train.world_size x "
                f"execution.ray.trainer_cpus_per_rank = {world_size} x {ray.trainer_cpus_per_rank:g} = {cpus:g} CPUs, "
                f"so they could never be placed. Set --execution.ray.num-cpus {cpus:g} (or more; logical CPUs may "
                "exceed the cores), or lower --execution.ray.trainer-cpus-per-rank."
            )
        engine_cpus = self.engine.num_servers * ray.engine_cpus_per_server
        if ray.num_cpus is not None and cpus + engine_cpus > ray.num_cpus:
            raise ValueError(
                f"execution.ray.num_cpus is {ray.num_cpus}, but the trainer's bundles ({cpus:g} CPUs) and the engine "
                f"bundles (engine.num_servers x execution.ray.engine_cpus_per_server = {self.engine.num_servers} x "
                f"{ray.engine_cpus_per_server:g} = {engine_cpus:g} CPUs) need {cpus + engine_cpus:g}, so they could "
                f"never all be placed. Set --execution.ray.num-cpus {cpus + engine_cpus:g} (or more; logical CPUs may "
                "exceed the cores), or lower --execution.ray.engine-cpus-per-server."
            )

    def _check_engine_bundles(self) -> None:
        """Engine bundles hold the servers Miles starts, beside (not inside) the trainer's bundles."""
        ray = self.execution.ray
        key = "engine_cpus_per_server" if ray.engine_cpus_per_server > 0 else "engine_gpus_per_server"
        value = getattr(ray, key)
        if ray.colocate:
            raise ValueError(
                f"execution.ray.{key} is {value:g} but execution.ray.colocate is true, which puts the servers in the "
                f"trainer's bundles instead. Drop --execution.ray.{key.replace('_', '-')}, or --execution.ray.colocate."
            )
        if self.engine.urls:
            raise ValueError(
                f"execution.ray.{key} is {value:g} but engine.urls names servers already running: engine bundles "
                f"hold the servers Miles starts. Drop --execution.ray.{key.replace('_', '-')}, or --engine.urls."
            )

    def _check_colocation(self) -> None:
        """Colocation hands the devices back and forth once per step: it needs the synchronous loop and engine
        servers Miles places itself (in the trainer's bundles) and can free and re-allocate."""
        if self.loop.mode != "sync":
            raise ValueError(
                f"execution.ray.colocate is true but loop.mode is {self.loop.mode!r}: colocated engines and trainer "
                "take turns on the same devices, so rollout and training cannot overlap. Set --loop.mode sync, or "
                "--execution.ray.colocate false (engines on devices of their own)."
            )
        if self.engine.type != "sglang":
            raise ValueError(
                f"execution.ray.colocate is true but engine.type is {self.engine.type!r}: colocation places the "
                "engine servers Miles starts in Ray actors and frees their memory through SGLang's "
                "/release_memory_occupation. Use --engine.type sglang (--engine.server miles on CPU), or "
                "--execution.ray.colocate false."
            )
        if self.engine.urls:
            raise ValueError(
                "execution.ray.colocate is true but engine.urls names servers already running: colocation places "
                "the servers it starts in the trainer's bundles. Drop --engine.urls, or --execution.ray.colocate "
                "false."
            )

    def _check_algorithm(self) -> None:
        """Refuse algorithm settings that would silently do nothing with this rollout shape or these models."""
        algorithm = self.algorithm
        check_group_size(self.rollout, algorithm)  # group baselines and dynamic sampling need n >= 2
        check_models(self.models, algorithm)  # critic, teacher and reference exactly as the algorithm reads them
        policy_loss = algorithm.loss.policy_loss
        if (self.rollout.mode == "sft") != POLICY_LOSSES[policy_loss].supervised:
            raise ValueError(
                f"rollout.mode is {self.rollout.mode!r} but algorithm.loss.policy_loss is {policy_loss!r}: "
                "supervised fine-tuning needs both (reference answers as responses, trained by likelihood), and "
                "either alone trains on nothing useful. Set --rollout.mode sft --algorithm.loss.policy-loss sft "
                "together, or neither."
            )
        max_len, buffer_len = self.rollout.sampling.max_new_tokens, algorithm.overlong.buffer_len
        if buffer_len > max_len:
            raise ValueError(
                f"algorithm.overlong.buffer_len is {buffer_len}, longer than rollout.sampling.max_new_tokens "
                f"{max_len}: the penalty ramp must fit inside the length limit. Set --algorithm.overlong.buffer-len "
                f"to at most {max_len} (DAPO: a quarter of it)."
            )
        if self.rollout.mode == "multi_turn" and buffer_len:
            raise ValueError(
                f"algorithm.overlong.buffer_len is {buffer_len} but rollout.mode is 'multi_turn': the soft overlong "
                "penalty ramps up toward rollout.sampling.max_new_tokens, which bounds one turn, while a multi-turn "
                "response (tool results included) runs up to rollout.multi_turn.max_response_tokens, so it would "
                "punish responses that are not overlong. Set --algorithm.overlong.buffer-len 0."
            )


# Keys of the flat layout (Miles before the nested config) -> where they live now; for the messages that meet an
# old run's config.yaml or an old recipe/flag.
RENAMED_KEYS = {
    "model": "models.policy (model.path is now models.policy.path)",
    "model.path": "models.policy.path",
    **{
        f"algorithm.{old}": f"algorithm.{new}"
        for old, new in {
            "advantage_estimator": "advantage.estimator",
            "advantage_estimator_path": "advantage.estimator_path",
            "advantage_eps": "advantage.eps",
            "gamma": "advantage.gamma",
            "lam": "advantage.lam",
            "policy_loss": "loss.policy_loss",
            "policy_loss_path": "loss.policy_loss_path",
            "loss_reducer_path": "loss.reducer_path",
            "clip_low": "loss.clip_low",
            "clip_high": "loss.clip_high",
            "dual_clip_c": "loss.dual_clip_c",
            "aggregation": "loss.aggregation",
            "entropy_coef": "loss.entropy_coef",
            "kl_coef": "kl.coef",
            "kl_estimator": "kl.estimator",
            "kl_mode": "kl.mode",
            "importance_sampling": "rollout_correction.importance_sampling",
            "importance_level": "rollout_correction.level",
            "importance_lower": "rollout_correction.lower",
            "importance_upper": "rollout_correction.upper",
            "opsm": "rollout_correction.opsm",
            "opsm_threshold": "rollout_correction.opsm_threshold",
            "dynamic_sampling": "dynamic_sampling (a section: null = off)",
            "dynamic_sampling_max_rounds": "dynamic_sampling.max_rounds",
            "dynamic_sampling_over_sample": "dynamic_sampling.over_sample",
            "dynamic_sampling_filter_path": "dynamic_sampling.filter_path",
            "overlong_filter": "overlong.filter",
            "overlong_buffer_len": "overlong.buffer_len",
            "overlong_penalty_factor": "overlong.penalty_factor",
        }.items()
    },
    "algorithm.critic_path": "models.critic.path",
    "algorithm.critic_lr": "models.critic.lr",
    "algorithm.value_clip": "models.critic.value_clip",
    "algorithm.teacher_path": "models.teacher.path",
    "algorithm.teacher_temperature": "models.teacher.temperature",
}

# Keys Miles no longer has -> what replaces them, for the unknown-key message.
REMOVED_KEYS = {
    "rollout.rollout_path": "a whole-step rollout function is no longer a rollout protocol: write a group-generate "
    "factory (one prompt -> its n samples; docs/extending.md) and give it with --rollout.generate-path",
}


def flat_layout_key(raw: dict[str, Any]) -> str | None:
    """The first key of ``raw`` that belongs to the flat layout of an older Miles (see ``RENAMED_KEYS``), or None."""
    if isinstance(raw.get("model"), dict):
        return "model.path" if "path" in raw["model"] else "model"
    algorithm = raw.get("algorithm")
    if isinstance(algorithm, dict):
        for key in algorithm:
            if f"algorithm.{key}" in RENAMED_KEYS and key not in AlgorithmConfig.model_fields:
                return f"algorithm.{key}"
    return None


def eval_set_data(cfg: MilesConfig, index: int) -> DataConfig:
    """The data section of ``eval.sets[index]``: the run's ``data`` with the set's ``data`` keys on top; a set that
    gives a source key (source, task, path, ...) replaces the run's ``data.mixture`` with that one source.

    Raises: ValueError naming ``eval.sets[index].data`` and the first bad key.
    """
    overrides = cfg.eval.sets[index].data
    base = cfg.data.model_dump()
    if "mixture" not in overrides and any(key in MIXTURE_REPLACES for key in overrides):
        base["mixture"] = []  # a set naming its own source evaluates on that source, not on the run's mixture
    try:
        return DataConfig.model_validate({**base, **overrides})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        key = f"eval.sets[{index}].data" + (f".{where}" if where else "")
        raise ValueError(f"{key}: {first['msg']}") from None
