"""Config sections owned by miles-rollout: data, engine, reward. Validation reads no file: data files are checked
when the data source is built."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from miles.core.plugins import check_plugin_path
from miles.sync.codecs import LossyCodecName
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MixtureComponentConfig(_Section):
    """One dataset of ``data.mixture``: its name and weight, and its own source settings (the keys of the data
    section with the same names; data.seed, data.eval_seed, data.bad_rows and data.max_prompt_tokens are shared)."""

    name: str = Field(
        description="The dataset's name: metadata['dataset'] of its prompts and the suffix of its metrics "
        "(reward/mean/<name>); letters, digits and _.- only, unique within the mixture."
    )
    weight: float = Field(
        1.0,
        description="Relative share of the training prompts, > 0: weight / the sum of the weights. Prompts are "
        "assigned by a deterministic weighted round-robin, so weights 3 and 1 serve exactly 3 of every 4 prompts "
        "from the first.",
    )
    source: Literal["reasoning_gym", "file"] = Field(
        "reasoning_gym", description="reasoning_gym: a procedural task; file: a local JSONL/Parquet file."
    )
    task: str = Field("basic_arithmetic", description="reasoning-gym task name (source=reasoning_gym).")
    task_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of reasoning_gym.create_dataset for the task."
    )
    size: int = Field(10_000, ge=1, description="Entries generated per epoch (source=reasoning_gym).")
    path: str = Field("", description="JSONL/Parquet training file (source=file), relative to the current directory.")
    eval_path: str = Field(
        "",
        description="JSONL/Parquet file of eval prompts (source=file). Empty = hold this dataset's share of "
        "eval.num_prompts rows of its path out of training.",
    )
    prompt_key: str = Field("question", description="Column holding the question text (source=file).")
    label_key: str = Field("answer", description="Column holding the reference answer (source=file).")
    image_key: str = Field("", description="Column holding each row's images (source=file; see data.image_key).")
    system_prompt: str = Field("", description="System message; empty = the chat template's default.")
    prompt_suffix: str = Field("", description="Appended to every question of this dataset.")


# Keys of the data section that describe one source; with data.mixture each dataset has its own.
MIXTURE_REPLACES = (
    "source",
    "source_path",
    "task",
    "task_kwargs",
    "size",
    "path",
    "eval_path",
    "prompt_key",
    "label_key",
    "image_key",
    "system_prompt",
    "prompt_suffix",
)


class DataConfig(_Section):
    """Where prompts come from and how they are rendered."""

    source: Literal["reasoning_gym", "file", "custom"] = Field(
        "reasoning_gym",
        description="reasoning_gym: a procedural task (offline, seeded); file: a local JSONL/Parquet file; custom: "
        "the data-source factory at data.source_path.",
    )
    source_path: str = Field(
        "",
        description="module:attr of a data-source factory (context: miles.core.protocols.DataContext) -> DataSource "
        "(next_prompts, state_dict, load_state_dict), called for the 'train' split and, when eval.num_prompts > 0, "
        "the 'eval' split (source=custom).",
    )
    task: str = Field("basic_arithmetic", description="reasoning-gym task name (source=reasoning_gym).")
    task_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of reasoning_gym.create_dataset for the task."
    )
    size: int = Field(10_000, ge=1, description="Entries generated per epoch (source=reasoning_gym).")
    seed: int = Field(1234, description="Seed of the training entries and of the per-epoch shuffle order.")
    eval_seed: int = Field(
        999_999, description="Seed of the held-out eval entries (a different seed gives different prompts)."
    )
    path: str = Field(
        "",
        description="JSONL/Parquet training file (source=file), e.g. GSM8K's train.jsonl, or a directory an HF "
        "datasets Dataset was saved to (save_to_disk; one split); relative to the current directory. Checked when the "
        "run is built.",
    )
    eval_path: str = Field(
        "",
        description="JSONL/Parquet file of held-out eval prompts (source=file; same columns), e.g. GSM8K's "
        "test.jsonl. Empty = hold eval.num_prompts rows of data.path out of training (a fixed choice) and "
        "evaluate on them.",
    )
    prompt_key: str = Field("question", description="Column holding the question text (source=file).")
    label_key: str = Field("answer", description="Column holding the reference answer (source=file).")
    image_key: str = Field(
        "",
        description="Column holding each row's images for a vision-language policy (source=file), e.g. 'images': a "
        "list (or one) of image file paths (relative to the data file's directory), base64 text, raw bytes, or "
        "datasets' {bytes, path} records. A text question gets one image part per image, at its '<image>' markers "
        "if it has as many, else before the text. Empty = text-only rows.",
    )
    system_prompt: str = Field("", description="System message; empty = the chat template's default.")
    prompt_suffix: str = Field("", description="Appended to every question, e.g. ' Reply with only the final number.'")
    max_prompt_tokens: int = Field(1024, ge=1, description="Longer prompts are skipped and counted as failed.")
    bad_rows: Literal["skip", "stop"] = Field(
        "stop",
        description="A data-file row that cannot be used (not JSON, not UTF-8, missing/empty/wrongly typed prompt or "
        "label; source=file): stop = fail at start-up listing each bad row as file:line; skip = leave it out, "
        "count it and log the first few. stop is the safe default; skip suits large scraped datasets.",
    )
    mixture: list[MixtureComponentConfig] = Field(
        default_factory=list,
        description="Train on several datasets at once, e.g. [{name: sums, weight: 3, task: basic_arithmetic}, "
        "{name: gsm8k, weight: 1, source: file, path: train.jsonl}]: each prompt comes from one of them by weight "
        "(deterministic weighted round-robin; each dataset keeps its own epochs), tagged metadata['dataset']; eval "
        "prompts are the same mix of their eval splits. The data section's own source keys (source, task, path, "
        "...) must stay at their defaults then. Empty = the single source of the data section.",
    )

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.mixture:
            self._check_mixture()
            return self
        if self.source != "custom" and self.source_path:
            raise ValueError(
                f"data.source is {self.source!r} but data.source_path is {self.source_path!r} (a data-source factory, "
                "used only with data.source custom; a recipe may have set it): add --data.source-path '' to drop it, "
                "or --data.source custom to use it"
            )
        if (self.source == "custom") != bool(self.source_path):
            raise ValueError(
                f"data.source is {self.source!r} and data.source_path is {self.source_path!r}: a data-source factory "
                "needs both; pass --data.source custom --data.source-path my_pkg.data:build_source, or neither."
            )
        check_plugin_path("data.source_path", self.source_path, "my_pkg.data:build_source")
        if self.source == "file" and not self.path:
            raise ValueError("data.source is 'file' but data.path is empty; pass --data.path /path/to/file.jsonl")
        if self.eval_path and self.source != "file":
            raise ValueError(
                f"data.eval_path is {self.eval_path!r} but data.source is {self.source!r}: eval files are for "
                "source=file (a reasoning-gym task draws its eval prompts with data.eval_seed). Drop --data.eval-path "
                "or set --data.source file."
            )
        return self

    def _check_mixture(self) -> None:
        """Refuse a data section whose own source keys would be ignored by ``mixture``, and bad datasets."""
        for key in MIXTURE_REPLACES:
            value, default = getattr(self, key), DataConfig.model_fields[key].get_default(call_default_factory=True)
            if value != default:
                reset = {"": "''", "{}": "'{}'"}.get(str(default), str(default))  # shell-quoted when empty
                raise ValueError(
                    f"data.{key} is {value!r} but data.mixture is set, which takes each dataset's settings from its "
                    f"own entry, so data.{key} would be ignored. Move it into the mixture entries ({{name: ..., "
                    f"{key}: ...}}) and drop it from the data section (on the command line: --data."
                    f"{key.replace('_', '-')} {reset})."
                )
        names = [component.name for component in self.mixture]
        for i, component in enumerate(self.mixture):
            key = f"data.mixture[{i}]"
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", component.name):
                raise ValueError(
                    f"{key}.name is {component.name!r}; a dataset name is a metric suffix (reward/mean/<name>): "
                    "use letters, digits and _.- only, e.g. name: gsm8k"
                )
            if component.name in names[:i]:
                raise ValueError(
                    f"{key}.name {component.name!r} is used twice in data.mixture; give each dataset its own name"
                )
            if not component.weight > 0:
                raise ValueError(
                    f"{key}.weight ({component.name}) is {component.weight:g}, but a weight is the dataset's share "
                    "of the prompts and must be > 0; give it a positive weight (e.g. weight: 1) or drop the dataset"
                )
            if component.source == "file" and not component.path:
                raise ValueError(
                    f"{key}.source ({component.name}) is 'file' but its path is empty; add path: /path/to/file.jsonl "
                    "to that entry"
                )
            if component.eval_path and component.source != "file":
                raise ValueError(
                    f"{key}.eval_path ({component.name}) is {component.eval_path!r} but its source is "
                    f"{component.source!r}: eval files are for source file (a reasoning-gym task draws its eval "
                    "prompts with data.eval_seed); drop eval_path from that entry or set source: file"
                )


def _delta_weights_field() -> Any:
    """``engine.delta_weights`` of the engines that take delta updates (a field per class keeps each class's key
    order, which the "unknown key" messages list)."""
    return Field(
        False,
        description="Send each weight update as its change from the last one (miles.sync delta: the smaller of the "
        "sparse changed words and the zstd-compressed XOR, checksummed; a restarted engine gets a full update). Cuts "
        "the bytes moved to about 0.5-0.6 (fp32) / 0.08 (bf16) of a full update per GRPO step of the default job, for "
        "CPU time on both sides; metrics sync/sent_mib and sync/sent_fraction.",
    )


class ProbeConfig(_Section):
    """The weight probe after each update (``miles.core.publisher.LogProbProbe``): the engine samples a fixed
    prompt, the trainer recomputes the sampled tokens' log-probs, and their largest difference is the metric
    ``sync/probe_logprob_max_abs_diff``."""

    tokens: int = Field(16, ge=0, description="Tokens each engine samples for the probe per update; 0 = no probe.")
    max_abs_diff: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Largest |engine - trainer| log-prob (nats) of a probe token before the update counts as failed "
        "(the run stops: the engine does not sample with the trainer's weights); null = 0.1 for an fp32 engine, 1.0 "
        "for bf16, report only for quantized weights without train.qat (fp32 engines agree to ~1e-5 here; one "
        "damaged linear layer moved a tiny model's by 0.2-0.5).",
    )
    prompt: str = Field(
        "The quick brown fox jumps over the lazy dog. Counting on: one, two, three,",
        min_length=1,
        description="The probe prompt (tokenized as is, no chat template).",
    )

    @model_validator(mode="after")
    def _check_off(self) -> ProbeConfig:
        if self.tokens == 0 and self.max_abs_diff is not None:
            raise ValueError(
                f"engine.probe.max_abs_diff is {self.max_abs_diff:g} but engine.probe.tokens is 0, which turns the "
                "probe off: drop --engine.probe.max-abs-diff, or set --engine.probe.tokens 16"
            )
        return self

    def tolerance(self, engine_dtype: str, *, exact_weights: bool = True) -> float | None:
        """``max_abs_diff``, or its default for an engine of ``engine_dtype`` ("fp32" / "bf16" / "fp16") whose
        weights are (``exact_weights``) or are not (a lossy ``weight_codec`` the trainer does not fake-quantize) the
        trainer's: None (report only) for the latter, whose gap is the quantization's (fp8 on SmolLM2-135M: probe
        tokens up to ~1 nat apart), not a failed update's."""
        if self.max_abs_diff is not None:
            return self.max_abs_diff
        if not exact_weights:
            return None
        return 0.1 if engine_dtype == "fp32" else 1.0


def _probe_field() -> Any:
    return Field(
        default_factory=ProbeConfig,
        description="After each weight update the engine samples a fixed prompt and the trainer recomputes those "
        "tokens' log-probs: metric sync/probe_logprob_max_abs_diff; too large a difference fails the update.",
    )


class EmbeddedEngineConfig(_Section):
    """The embedded engine: an in-process HF model (``miles.rollout.engines.EmbeddedEngine``)."""

    type: Literal["embedded"] = Field(
        "embedded",
        description="The engine kind, the key of the engine union: embedded (in-process HF model, the CPU default), "
        "vllm (vLLM servers Miles starts), sglang (SGLang servers, or `miles serve` on CPU, optionally behind "
        "sglang-router).",
    )
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Engine weights/compute dtype (fp16: GPUs without bf16). bf16 only pays off on GPUs or CPUs "
        "with AVX512-BF16/AMX; auto picks bf16 there and fp32 elsewhere, decided when the run starts (the reason is "
        "logged).",
    )
    max_batch_size: int = Field(
        64,
        ge=1,
        description="Most sequences decoded together (the KV cache's slots; per generate call for other models).",
    )
    logprob_mode: Literal["prefill", "decode"] = Field(
        "prefill",
        description="prefill: rescore each response with one forward pass (trainer numerics); "
        "decode: keep the decode-step logits, as server engines do.",
    )
    routed_experts: bool = Field(
        False,
        description="MoE routing replay (R3): record the experts every router chose for each token (from the forward "
        "that gave the log-probs) and have the trainer route each token to them, gating weights from its live "
        "router logits. Needs an MoE model (Qwen2/3-MoE, Qwen3.5-MoE, Mixtral, OLMoE, DeepSeek-V3, DeepSeek-V4, "
        "GLM-4.5, GLM-5).",
    )
    weight_codec: Literal["identity", LossyCodecName] = Field(
        "identity",
        description="Quantized rollout: the engine's weights are the miles.sync codec's round trip of the trainer's "
        "(fp8: E4M3 per 128x128 tile, mxfp8, nvfp4, int4: groups of 128), from the start and after every update "
        "(which travels in that format); norms, embeddings, the LM head, biases and routers stay exact. On CPU the "
        "engine computes with the dequantized values: the numerics of a quantized engine, not its speed. The cost "
        "shows in train_rollout_logprob_abs_diff; --train.qat with the same codec removes it. identity = exact.",
    )
    delta_weights: bool = _delta_weights_field()
    probe: ProbeConfig = _probe_field()


class HealthCheckConfig(_Section):
    """How the engine supervisor (``miles.rollout.engines.supervisor``) probes each server and when it restarts one.

    The names and defaults follow slime's fault tolerance (``--rollout-health-check-*``).
    """

    first_wait_s: float = Field(
        0.0,
        ge=0.0,
        description="Seconds after the supervisor starts before an engine's first probe (slime's "
        "--rollout-health-check-first-wait). 0 suits servers that already serve when it starts; raise it when "
        "they still compile or warm up then.",
    )
    interval_s: float = Field(
        30.0,
        gt=0.0,
        description="Seconds between the starts of two probes of one engine (slime's --rollout-health-check-interval). "
        "A dead engine is found within about interval_s (a hung one within interval_s * max_consecutive_failures); "
        "its in-flight requests are resubmitted elsewhere at once whatever the interval.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="A probe slower than this many seconds is a failure (slime's --rollout-health-check-timeout).",
    )
    max_consecutive_failures: int = Field(
        2,
        ge=1,
        description="Failed probes in a row before the engine is restarted (slime's "
        "--rollout-health-check-max-consecutive-failures); more than 1 keeps one slow answer from a busy engine "
        "from restarting it. A probe finding the server's actor dead, or a new server process (restarted between "
        "probes), acts at once.",
    )
    restart_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="Seconds a restarted engine may take to serve again (Ray's restart plus the server's start-up) "
        "before the supervisor gives up on it and the run stops with an error naming it.",
    )


class _ServerEngineConfig(_Section):
    """What every server engine shares: where the servers run, how Miles starts them and talks to them."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="The servers' weights/compute dtype; auto: bf16 where the machine starting the run has fast bf16 "
        "(a GPU with bf16, a CPU with AVX512-BF16/AMX), else fp32.",
    )
    num_servers: int = Field(1, ge=1, description="Servers Miles starts (each holds the whole model).")
    urls: list[str] = Field(
        default_factory=list,
        description="Base URLs of servers that already run (e.g. http://10.0.0.5:30000); Miles starts none then, "
        "and num_servers is ignored.",
    )
    host: str = Field("127.0.0.1", description="Address the servers Miles starts bind to (loopback by default).")
    port: int = Field(0, ge=0, le=65535, description="First server's port (the next ones count up); 0 = free ports.")
    python: str = Field(
        "",
        description="Python interpreter that runs the server (the environment the engine is installed in). Empty: "
        "for vllm $MILES_VLLM_PYTHON, else the environment scripts/install_vllm.sh makes "
        "(~/.cache/miles/vllm-venv/bin/python, under $MILES_CACHE_DIR if set); for sglang this interpreter.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Extra server command-line arguments, passed through verbatim (last)."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of the servers.")
    threads: int = Field(0, ge=0, description="OpenMP threads per server (OMP_NUM_THREADS); 0 = the server's choice.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Seconds a server may take to answer its health URL.")
    request_timeout_s: float = Field(600.0, gt=0, description="Seconds one HTTP request may take.")
    max_retries: int = Field(
        2, ge=0, description="Times a timed-out or dropped generate request is sent again (same seed)."
    )
    pause_mode: Literal["abort", "retract", "keep"] = Field(
        "keep",
        description="How the servers pause for a weight update: keep = running requests finish first (the "
        "synchronous loop has none in flight); retract = they stop and continue under the new weights; abort = "
        "they end with their partial response.",
    )
    verify_weights: bool = Field(
        True,
        description="After each weight update, compare the servers' weight checksums with the pushed tensors "
        "(vllm: /weight_checker) and fail the update on a mismatch.",
    )
    weight_transfer: Literal["group", "disk"] = Field(
        "group",
        description="How weight updates reach the servers: group = a weight group the servers join (gloo here, "
        "NCCL on GPUs), tensors broadcast from the trainer; disk = each version written as safetensors shards plus "
        "a checksummed manifest under engine.weight_dir and loaded by every server (SGLang "
        "/update_weights_from_disk, vLLM's in-place reload): for servers that share a filesystem with the trainer "
        "but no network group, or when nothing else works.",
    )
    weight_dir: str = Field(
        "",
        description="engine.weight_transfer disk: the shared directory the versions go to (the newest 2 stay); "
        "empty = a directory beside the run directory, removed when the run ends.",
    )
    health_check: HealthCheckConfig = Field(
        default_factory=HealthCheckConfig,
        description="execution.mode ray: how the engine supervisor probes the servers Miles starts (each owned by "
        "a Ray actor that Ray restarts) and when it restarts one; a restarted server is brought to the run's "
        "current weights before it serves requests again (it rejoins the router, or the vLLM engine's rotation). "
        "Not used in local mode or with engine.urls.",
    )
    probe: ProbeConfig = _probe_field()

    @model_validator(mode="after")
    def _check_health(self) -> _ServerEngineConfig:
        if self.urls and self.health_check != HealthCheckConfig():
            changed = next(k for k, v in self.health_check if v != HealthCheckConfig.model_fields[k].default)
            key = f"engine.health_check.{changed}"
            raise ValueError(
                f"{key} is {getattr(self.health_check, changed)!r} but engine.urls names servers that already run: "
                "the supervisor restarts only servers Miles starts (in Ray actors). Drop "
                f"--{key.replace('_', '-')}, or drop --engine.urls to let Miles start the servers."
            )
        return self


class VLLMEngineConfig(_ServerEngineConfig):
    """vLLM servers (``miles.rollout.engines.vllm``): started by Miles, updated in place through vLLM's RL endpoints
    and the miles.sync weight-transfer plugin. Install: scripts/install_vllm.sh."""

    type: Literal["vllm"] = Field("vllm", description="The engine kind: vLLM servers.")
    max_model_len: int = Field(2048, ge=16, description="vLLM --max-model-len: prompt + response tokens.")
    enforce_eager: bool = Field(
        True, description="vLLM --enforce-eager: no torch.compile (20-30 s startup instead of 70-100 s on a CPU)."
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="VLLM_CPU_KVCACHE_SPACE: CPU KV-cache size in GiB.")
    delta_weights: bool = _delta_weights_field()

    @model_validator(mode="after")
    def _check(self) -> VLLMEngineConfig:
        if self.delta_weights and self.weight_transfer == "disk":
            raise ValueError(
                "engine.delta_weights is true but engine.weight_transfer is disk: delta updates go through the "
                "weight group. Drop --engine.delta-weights, or set --engine.weight-transfer group."
            )
        return self


class SGLangEngineConfig(_ServerEngineConfig):
    """SGLang-API servers (``miles.rollout.engines.sglang``): real SGLang (GPU) or `miles serve` (the embedded
    engine behind SGLang's native API, for CPUs), optionally behind the real sglang-router."""

    type: Literal["sglang"] = Field("sglang", description="The engine kind: SGLang-API servers.")
    server: Literal["sglang", "miles"] = Field(
        "sglang",
        description="What Miles starts: sglang (python -m sglang.launch_server; needs a GPU) or miles (miles serve: "
        "the embedded engine behind SGLang's native API, runs on CPU).",
    )
    router: bool = Field(
        False, description="Put the real sglang-router in front of the servers (pip install 'miles-rollout[router]')."
    )
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = Field(
        "cache_aware",
        description="How the router picks a server: cache_aware sends prompts sharing a prefix (a group's samples) "
        "to the same server for its prefix cache; round_robin alternates; power_of_two picks the less loaded of two.",
    )
    health_check_interval_s: float = Field(
        10.0,
        gt=0,
        description="execution.mode local: seconds between Miles' health checks of the servers behind the router "
        "(a dead one leaves the router, a server answering again at its URL comes back). Ray mode uses "
        "engine.health_check instead.",
    )
    routed_experts: bool = Field(
        False,
        description="MoE routing replay (R3): every /generate asks for the experts each token was routed to "
        "(return_routed_experts; the servers Miles starts, SGLang or miles serve, get --enable-return-routed-experts), "
        "read as [tokens, num_layers, top_k] with num_layers and top_k (num_experts_per_tok) from the model's "
        "config.json; the trainer replays them (R3).",
    )
    max_batch_size: int = Field(64, ge=1, description="miles serve: sequences per generate call.")
    logprob_mode: Literal["prefill", "decode"] = Field(
        "decode", description="miles serve: log-probs from the decode steps (as SGLang) or a prefill rescoring."
    )

    @model_validator(mode="after")
    def _dtype_once(self) -> SGLangEngineConfig:
        flags = {arg.split("=", 1)[0] for arg in self.extra_args}
        if flags & {"--dtype", "--sglang-dtype"}:
            raise ValueError(
                "engine.extra_args sets --dtype; set engine.dtype (fp32, bf16, fp16) instead: Miles passes it to the "
                "servers and compares their log-probs with its tolerance"
            )
        return self


def check_engine_health_settings(engine: Any, *, execution_mode: str) -> None:
    """Refuse a health setting the execution mode does not read (the root config calls it).

    ``engine.health_check`` (the Ray actors' supervisor) applies to execution.mode ray;
    ``engine.health_check_interval_s`` (the router's worker monitor) to local mode and to servers named by
    ``engine.urls``.
    Raises: ValueError naming the key, the mode and the key to set instead.
    """
    if not isinstance(engine, _ServerEngineConfig):
        return
    sglang = isinstance(engine, SGLangEngineConfig)  # only it has the router's worker monitor
    if execution_mode != "ray" and engine.health_check != HealthCheckConfig():
        changed = next(k for k, v in engine.health_check if v != HealthCheckConfig.model_fields[k].default)
        key = f"engine.health_check.{changed}"
        raise ValueError(
            f"{key} is {getattr(engine.health_check, changed)!r} but execution.mode is {execution_mode!r}: the engine "
            "supervisor runs in Ray mode only, where Ray owns the servers and restarts them. Set --execution.mode "
            f"ray, or drop --{key.replace('_', '-')}"
            + (" (local mode: --engine.health-check-interval-s)." if sglang else ".")
        )
    default_interval = SGLangEngineConfig.model_fields["health_check_interval_s"].default
    if sglang and execution_mode == "ray" and not engine.urls and engine.health_check_interval_s != default_interval:
        raise ValueError(
            f"engine.health_check_interval_s is {engine.health_check_interval_s:g} but execution.mode is 'ray', where "
            "the servers Miles starts are watched by the engine supervisor instead. Set "
            f"--engine.health-check.interval-s {engine.health_check_interval_s:g}, or drop "
            "--engine.health-check-interval-s."
        )


ENGINE_TYPES = ("embedded", "vllm", "sglang")


def _engine_type(value: Any) -> str | None:
    """The tag of an engine section; a mapping without ``type`` is the embedded engine (the default)."""
    if isinstance(value, dict):
        return value.get("type", "embedded")
    return getattr(value, "type", None)


# The ``engine`` section: a union discriminated on ``type``.
EngineConfig = Annotated[
    Annotated[EmbeddedEngineConfig, Tag("embedded")]
    | Annotated[VLLMEngineConfig, Tag("vllm")]
    | Annotated[SGLangEngineConfig, Tag("sglang")],
    Discriminator(
        _engine_type,
        custom_error_type="engine_type",
        custom_error_message=f"engine.type must be one of {', '.join(ENGINE_TYPES)}",
    ),
]


class CodeRewardConfig(_Section):
    """Sandbox limits of reward.type code (miles.rollout.rewards.code): each test case runs the response's program
    once in ``python -I`` in a fresh temporary directory, network and process creation blocked."""

    time_limit_s: float = Field(
        5.0,
        gt=0.0,
        description="Wall-clock seconds one test case's run may take; past it the program's process group is "
        "killed and the sample scores 0 (reward_outcome timeout). The run stops at the first case that does not "
        "pass, so a sample takes up to this plus its passing cases' time: reward.timeout_s (default 60) must be "
        "above this.",
    )
    memory_limit_mib: int = Field(
        1024,
        gt=0,
        description="Address space (RLIMIT_AS, MiB) of the program's process, the interpreter's ~15 MiB included; "
        "an allocation past it scores 0 (reward_outcome memory).",
    )


class RemoteRewardConfig(_Section):
    """The scoring service of reward.type remote (miles.rollout.rewards.remote): one JSON POST per sample."""

    url: str = Field(
        "",
        description="http(s) endpoint receiving {prompt, response, label, metadata} as JSON and answering a JSON "
        "object with the score (type=remote; required), e.g. http://rm-host:8000/score.",
    )
    score_key: str = Field(
        "score", description="Field of the reply holding the reward (a finite number); dots walk into objects."
    )
    timeout_s: float = Field(30.0, gt=0.0, description="Seconds each HTTP attempt may take.")
    max_retries: int = Field(
        3,
        ge=0,
        description="Attempts after the first on a connection error, a timeout or a 5xx reply (not a 4xx); after "
        "the last one the sample fails with the error (samples/failed_reward_timeout or _error) and the run goes on.",
    )
    backoff_s: float = Field(
        0.5, ge=0.0, description="Seconds before the first retry, doubled for each further one (0.5, 1, 2 s)."
    )


class RewardConfig(_Section):
    """How a completed sample is scored."""

    type: Literal["reasoning_gym", "math", "code", "exact_match", "f1", "remote", "custom"] = Field(
        "reasoning_gym",
        description="reasoning_gym: the task's scorer on the extracted answer (binary); math: math-verify "
        "against the label (GSM8K '#### N', a MATH solution's \\\\boxed{}) of the last \\\\boxed{} of the response "
        "(else its last number): the boxed-answer reward; code: the response's Python program run on the label's "
        "[stdin, expected_stdout] cases in a sandbox (reward.code), 1 if all pass; exact_match / f1: SQuAD v1.1 "
        "exact match / token F1 of the response's <answer> (else the whole response), max over the label's answers "
        "(a string or a list); remote: the score a service at reward.remote.url gives; custom: the function at "
        "reward.path.",
    )
    path: str = Field("", description="module:attr of a custom reward function (sample) -> float (type=custom).")
    group_path: str = Field(
        "",
        description="module:attr of a group reward function (group: list[Sample]) -> list[float], called per prompt "
        "after each sample's own reward, whose values replace the group's rewards (rank-based, pairwise, diversity). "
        "Empty = none.",
    )
    timeout_s: float = Field(
        60.0,
        ge=0.0,
        description="Seconds one reward call may take; a slower call fails its sample (counted in samples/failed "
        "and samples/failed_reward_timeout, reason naming reward.timeout_s) instead of hanging the run; a step in "
        "which every call times out stops the run. The default 60 is far above what the shipped rewards take (math "
        "and reasoning-gym: milliseconds; code: at most its cases x reward.code.time_limit_s, 15 s for the shipped "
        "recipe's 3 cases) and bounds a hang. "
        "With reward.workers 0 the call runs in a thread that is abandoned, not stopped; with workers > 0 its worker "
        "process is killed and replaced. reward.type remote: all attempts of a sample share it, so with the remote "
        "defaults (30 s per attempt, 3 retries: up to ~124 s) what runs past 60 s is cut off; 130 allows them all. "
        "0 = no limit (a hanging reward hangs the run; with reward.workers 0 the call runs in the calling thread).",
    )
    workers: int = Field(
        0,
        ge=0,
        description="Reward worker processes. 0 = score in the trainer process (a reward that segfaults or exhausts "
        "memory ends the run). N = a pool of N processes that score each batch concurrently: a worker that dies "
        "fails only its sample (samples/failed_reward_crash) and is replaced. 2-4 suits code-executing or slow "
        "scorers. Start-up imports torch and the reward's modules once (a few seconds, in the fork server the "
        "workers are forked from); a replaced worker starts in well under a second.",
    )
    memory_limit_mib: int | None = Field(
        None,
        gt=0,
        description="Address space (virtual memory, MiB) each reward worker may allocate on top of its size after "
        "loading the reward function (RLIMIT_AS); an allocation past it raises MemoryError and fails the sample "
        "(samples/failed_reward_memory). Needs reward.workers > 0. Unset = no limit. Virtual memory: each thread "
        "the reward starts reserves a stack and malloc arena too, so allow a few hundred MiB (e.g. 1024).",
    )
    code: CodeRewardConfig = Field(
        default_factory=CodeRewardConfig,
        description="Sandbox limits of reward.type code (a setting of it with another type is an error).",
    )
    remote: RemoteRewardConfig = Field(
        default_factory=RemoteRewardConfig,
        description="Endpoint, timeout and retries of reward.type remote (a setting of it with another type is an "
        "error).",
    )

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        for name, section in (("code", self.code), ("remote", self.remote)):
            defaults = type(section)()  # any field off its default, set or not
            changed = [n for n in type(section).model_fields if getattr(section, n) != getattr(defaults, n)]
            if self.type != name and changed:
                key = f"reward.{name}.{changed[0]}"
                raise ValueError(
                    f"{key} is {getattr(section, changed[0])!r} but reward.type is {self.type!r}, and it applies to "
                    f"reward.type {name} only. Set --reward.type {name}, or drop --{key.replace('_', '-')}."
                )
        if self.type == "remote" and not self.remote.url.startswith(("http://", "https://")):
            raise ValueError(
                f"reward.type is 'remote' but reward.remote.url is {self.remote.url!r}, not an http(s) URL; set "
                "--reward.remote.url http://rm-host:8000/score"
            )
        check_plugin_path("reward.group_path", self.group_path, "my_pkg.rewards:rank_in_group")
        if self.path and self.type != "custom":  # else the recipe's reward would run and the plugin silently not
            raise ValueError(
                f"reward.path is {self.path!r} but reward.type is {self.type!r}, and reward.path is read by "
                "reward.type custom only. Set --reward.type custom too, or drop --reward.path."
            )
        if self.type == "custom" and ":" not in self.path:
            raise ValueError(
                f"reward.type is 'custom' but reward.path is {self.path!r}; set --reward.path my_module:my_reward"
            )
        limits = {"code": ("reward.code.time_limit_s", self.code.time_limit_s)}
        limits["remote"] = ("reward.remote.timeout_s", self.remote.timeout_s)
        if self.timeout_s and self.type in limits and self.timeout_s <= limits[self.type][1]:
            key, value = limits[self.type]
            raise ValueError(
                f"reward.timeout_s is {self.timeout_s:g} but {key} is {value:g}: a reward call is cut off after "
                f"reward.timeout_s, so not even one {'test case' if self.type == 'code' else 'attempt'} could finish. "
                f"Set --reward.timeout-s above {value:g} (e.g. {4 * value:g}), or lower --{key.replace('_', '-')}."
            )
        if self.memory_limit_mib is not None and self.workers == 0:
            raise ValueError(
                f"reward.memory_limit_mib is {self.memory_limit_mib} but reward.workers is 0: the limit applies to "
                "reward worker processes (in-process scoring would cap the trainer itself); set --reward.workers 2, "
                "or drop --reward.memory-limit-mib"
            )
        return self
