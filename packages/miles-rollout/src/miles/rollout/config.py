"""Config sections owned by miles-rollout: data, engine, reward. Validation reads no file: data files are checked
when the data source is built."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(_Section):
    """Where prompts come from and how they are rendered."""

    source: Literal["reasoning_gym", "file"] = Field(
        "reasoning_gym",
        description="reasoning_gym: a procedural task (offline, seeded); file: a local JSONL/Parquet file.",
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
        description="JSONL/Parquet training file (source=file), e.g. GSM8K's train.jsonl; relative to the current "
        "directory. Checked when the run is built.",
    )
    eval_path: str = Field(
        "",
        description="JSONL/Parquet file of held-out eval prompts (source=file; same columns), e.g. GSM8K's "
        "test.jsonl. Empty = hold eval.num_prompts rows of data.path out of training (a fixed choice) and "
        "evaluate on them.",
    )
    prompt_key: str = Field("question", description="Column holding the question text (source=file).")
    label_key: str = Field("answer", description="Column holding the reference answer (source=file).")
    system_prompt: str = Field("", description="System message; empty = the chat template's default.")
    prompt_suffix: str = Field("", description="Appended to every question, e.g. ' Reply with only the final number.'")
    max_prompt_tokens: int = Field(1024, ge=1, description="Longer prompts are skipped and counted as failed.")
    bad_rows: Literal["skip", "stop"] = Field(
        "stop",
        description="A data-file row that cannot be used (not JSON, not UTF-8, missing/empty/wrongly typed prompt or "
        "label; source=file): stop = fail at start-up listing each bad row as file:line; skip = leave it out, "
        "count it and log the first few. stop is the safe default; skip suits large scraped datasets.",
    )

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.source == "file" and not self.path:
            raise ValueError("data.source is 'file' but data.path is empty; pass --data.path /path/to/file.jsonl")
        if self.eval_path and self.source != "file":
            raise ValueError(
                f"data.eval_path is {self.eval_path!r} but data.source is {self.source!r}: eval files are for "
                "source=file (a reasoning-gym task draws its eval prompts with data.eval_seed). Drop --data.eval-path "
                "or set --data.source file."
            )
        return self


class EmbeddedEngineConfig(_Section):
    """The embedded engine: an in-process HF model (``miles.rollout.engines.EmbeddedEngine``)."""

    type: Literal["embedded"] = Field(
        "embedded",
        description="The engine kind, the key of the engine union: embedded (in-process HF model, the CPU default) "
        "is the only one today; vLLM and SGLang server engines are planned.",
    )
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Engine weights/compute dtype; bf16 only pays off on GPUs or CPUs with AVX512-BF16/AMX."
    )
    max_batch_size: int = Field(64, ge=1, description="Sequences per generate call.")
    logprob_mode: Literal["prefill", "decode"] = Field(
        "prefill",
        description="prefill: rescore each response with one forward pass (trainer numerics); "
        "decode: keep the decode-step logits, as server engines do.",
    )


ENGINE_TYPES = ("embedded",)


def _engine_type(value: Any) -> str | None:
    """The tag of an engine section; a mapping without ``type`` is the embedded engine (the default)."""
    if isinstance(value, dict):
        return value.get("type", "embedded")
    return getattr(value, "type", None)


# The ``engine`` section: a union discriminated on ``type`` (one member until the vLLM and SGLang adapters).
EngineConfig = Annotated[
    Annotated[EmbeddedEngineConfig, Tag("embedded")],
    Discriminator(
        _engine_type,
        custom_error_type="engine_type",
        custom_error_message=f"engine.type must be one of {', '.join(ENGINE_TYPES)} (no other engine is implemented)",
    ),
]


class RewardConfig(_Section):
    """How a completed sample is scored."""

    type: Literal["reasoning_gym", "math", "custom"] = Field(
        "reasoning_gym",
        description="reasoning_gym: the task's scorer on the extracted answer (binary); math: math-verify "
        "against the label (GSM8K '#### N', \\\\boxed{}); custom: the function at reward.path.",
    )
    path: str = Field("", description="module:attr of a custom reward function (sample) -> float (type=custom).")
    timeout_s: float = Field(
        0.0,
        ge=0.0,
        description="Seconds one reward call may take; a slower call fails its sample (counted in samples/failed) "
        "instead of hanging the run. 0 = no limit (calls run inline). 30 is a sane value for remote or "
        "code-executing scorers.",
    )

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if self.type == "custom" and ":" not in self.path:
            raise ValueError(
                f"reward.type is 'custom' but reward.path is {self.path!r}; set --reward.path my_module:my_reward"
            )
        return self
