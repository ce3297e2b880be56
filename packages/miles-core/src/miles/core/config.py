"""Config sections owned by miles-core: rollout batch arithmetic and sampling, evaluation, the models an algorithm
trains and reads, execution, the loop, and the rules across them and the algorithm section
(``miles.core.algorithms.config``). Each is frozen, forbids unknown keys and documents every field; validation
reads no file (model paths are checked when a run is built)."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from miles.core.algorithms.config import (
    ON_OFF,
    AdvantageConfig,
    AlgorithmConfig,
    DynamicSamplingConfig,
    KLConfig,
    LossConfig,
    OverlongConfig,
    RolloutCorrectionConfig,
    changed_fields,
)
from miles.core.algorithms.registry import ESTIMATORS, POLICY_LOSSES
from miles.core.plugins import check_plugin_path
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "AdvantageConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DynamicSamplingConfig",
    "EvalConfig",
    "EvalSetConfig",
    "ExecutionConfig",
    "KLConfig",
    "LoopConfig",
    "LossConfig",
    "ModelsConfig",
    "MultiTurnConfig",
    "OverlongConfig",
    "PolicyModelConfig",
    "RayConfig",
    "ReferenceModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SamplingConfig",
    "TeacherConfig",
    "check_group_size",
    "check_models",
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingConfig(_Section):
    """How the engine samples; the trainer scores tokens under the same temperature.

    Engines and the trainer report log-probs of the untruncated softmax(logits / temperature), so training
    rollouts (``rollout.sampling``) must sample from it: top_p 1.0 and top_k 0 there (``RolloutConfig`` refuses
    others). Evaluation (``eval.sampling``) may truncate freely: its log-probs are never trained on.
    """

    temperature: float = Field(1.0, gt=0.0, description="Softmax temperature; log-probs use logits / temperature.")
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling mass; 1.0 (the default) disables it. eval.sampling only: rollout.sampling "
        "must keep 1.0, since engine and trainer log-probs are those of the untruncated distribution.",
    )
    top_k: int = Field(
        0,
        ge=0,
        description="Keep the k most likely tokens; 0 (the default) disables it. eval.sampling only: "
        "rollout.sampling must keep 0, since engine and trainer log-probs are those of the untruncated distribution.",
    )
    max_new_tokens: int = Field(48, ge=1, description="Response length limit in tokens; hitting it = truncated.")


class MultiTurnConfig(_Section):
    """Multi-turn generation with tool calls (rollout.mode multi_turn; ``miles.rollout.multiturn``): the model calls a
    tool in the Hermes ``<tool_call>{json}</tool_call>`` format, Miles runs it, appends the result through the chat
    template and lets the model continue, token-in-token-out. docs/agentic.md has the details."""

    max_turns: int = Field(
        4,
        ge=1,
        description="Model turns (engine requests) per sample. A sample whose last allowed turn still calls a tool "
        "ends TRUNCATED (metadata stop_reason 'max_turns'); its tool calls are not run. 3-4 suit the calculator task.",
    )
    max_response_tokens: int = Field(
        256,
        ge=1,
        description="Token budget of the whole response: model tokens, tool results and template glue. Each turn asks "
        "for min(rollout.sampling.max_new_tokens, what is left); a turn cut at the budget, or tool results that would "
        "leave no room for one more model token, end the sample TRUNCATED (stop_reason 'max_response_tokens').",
    )
    tool_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds one tool call may take. Tools run in worker threads, off the rollout's event loop; a "
        "call past the limit returns 'Error: ... did not answer within N s' to the model (counted in metadata "
        "num_tool_timeouts) and the sample goes on. A thread cannot be killed: a tool that never returns keeps one, "
        "so a tool running untrusted code should run it in a subprocess with its own limit.",
    )
    tools: list[str] = Field(
        default_factory=lambda: ["miles.rollout.calculator:calculator"],
        description="The tools the model may call, each the module:attr of a miles.rollout.tools.Tool; imported and "
        "checked at start-up. The default is the safe arithmetic calculator (ast-based, no eval).",
    )
    few_shot: list[dict[str, str]] = Field(
        default_factory=list,
        description="Chat messages put between each prompt's system message and its first other message, e.g. one "
        "worked exchange (user, assistant with a <tool_call>, tool, assistant): small models imitate it. Part of the "
        "prompt (never trained); not added to prompts given as token ids. Empty (the default) adds nothing.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables of the chat template in every rendering (prompt and tool turns), e.g. "
        "{enable_thinking: false} for Qwen3 templates. Empty = the template's defaults.",
    )
    agent_path: str = Field(
        "",
        description="module:attr of an agent, fn(base_url: str, prompt: Sample) -> None (async or sync), that drives "
        "each sample's conversation through an OpenAI-compatible chat-completions endpoint at base_url "
        "(miles.rollout.agents); Miles records the exact ids and log-probs. It replaces the built-in tool loop: "
        "max_turns, max_response_tokens and chat_template_kwargs apply, tools, few_shot and tool_timeout_s must stay "
        "at their defaults (the agent's requests bring the messages and tools). Empty (the default) = the built-in "
        "loop.",
    )
    agent_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Seconds an agent (agent_path) may take for one sample; past it the sample fails (metadata "
        "failure names this key) and the group goes on. A sync agent's thread cannot be killed: it is left running "
        "as a daemon, and its later requests to the closed session fail. None (the default) = no limit.",
    )

    @model_validator(mode="after")
    def _check(self) -> MultiTurnConfig:
        check_plugin_path("rollout.multi_turn.agent_path", self.agent_path, "my_pkg.agents:agent")
        if self.agent_timeout_s is not None and not self.agent_path:
            raise ValueError(
                "rollout.multi_turn.agent_timeout_s is set but rollout.multi_turn.agent_path is empty: it limits an "
                "agent; drop --rollout.multi-turn.agent-timeout-s or set --rollout.multi-turn.agent-path"
            )
        if self.agent_path:
            for name in ("tools", "few_shot", "tool_timeout_s"):
                value = getattr(self, name)
                if value != type(self).model_fields[name].get_default(call_default_factory=True):
                    flag = f"--rollout.multi-turn.{name.replace('_', '-')}"
                    raise ValueError(
                        f"rollout.multi_turn.{name} is {value!r} but rollout.multi_turn.agent_path is set, and the "
                        "agent's requests bring their own messages and tools, so it would not be used. Give the tools "
                        f"and examples to the agent, and drop {flag}."
                    )
        return self


class RolloutConfig(_Section):
    """How many prompts and samples each step generates and how they are split into optimizer steps."""

    rollout_batch_size: int = Field(8, ge=1, description="Prompts per rollout step.")
    n_samples_per_prompt: int = Field(
        8, ge=1, description="Samples per prompt (the group size). GRPO needs >= 2; 8 is typical."
    )
    global_batch_size: int = Field(
        0,
        ge=0,
        description="Samples per optimizer step; 0 means all samples of a rollout (one optimizer step per rollout). "
        "Must divide rollout_batch_size * n_samples_per_prompt.",
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig,
        description="Sampling for training rollouts: temperature and max_new_tokens; top_p must stay 1.0 and top_k "
        "0, because the trainer's and the engine's log-probs are those of the untruncated distribution, so a "
        "truncated sampler would make the PPO ratio and the TIS/MIS corrections compare different distributions.",
    )
    mode: Literal["generate", "sft", "multi_turn"] = Field(
        "generate",
        description="generate: the engine samples the responses (RL); sft: the response is the data's reference "
        "answer (teacher forcing, no generation), trained on assistant tokens with algorithm.loss.policy_loss sft; "
        "multi_turn: the engine samples several turns with tool calls in between (rollout.multi_turn), tool tokens "
        "untrained.",
    )
    generate_path: str = Field(
        "",
        description="module:attr of a group-generate factory (miles.rollout.generate_factory.GenerateFactory): "
        "called once at start-up with a GenerateContext (engine, tokenizer, this section), it returns the "
        "GroupGenerateFn that turns each prompt into its n samples, for training and eval; imported and checked at "
        "start-up. Empty (the default) = the built-in one of rollout.mode (generate: single turn; multi_turn: "
        "miles.rollout.multiturn:build_multi_turn). Not with rollout.mode sft.",
    )
    sample_hook_path: str = Field(
        "",
        description="module:attr of fn(sample) -> None called on every generated sample before its reward (edit "
        "metadata, or fail a sample). Empty = none.",
    )
    multi_turn: MultiTurnConfig = Field(
        default_factory=MultiTurnConfig,
        description="Turn and token budgets, tools and prompt extras of rollout.mode multi_turn (a setting of it "
        "with another mode is an error).",
    )
    seed: int = Field(1234, description="Seed of the engine's sampler (each step derives its own).")
    max_resubmits: int = Field(
        2,
        ge=0,
        description="A response cut off by a weight update (loop.mode fully_async without loop.partial_rollout, or "
        "engine.pause_mode abort) is requested again from the start, with the same seed, up to this many times; "
        "then it stays aborted (kept, not trained).",
    )

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def max_response_tokens(self) -> int:
        """The longest response a sample can have, in tokens: ``multi_turn.max_response_tokens`` with
        rollout.mode multi_turn (all turns and tool results), else ``sampling.max_new_tokens``."""
        if self.mode == "multi_turn":
            return self.multi_turn.max_response_tokens
        return self.sampling.max_new_tokens

    @property
    def steps_per_rollout(self) -> int:
        gbs = self.global_batch_size or self.samples_per_rollout
        return self.samples_per_rollout // gbs

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        defaults = MultiTurnConfig()  # any field off its default, set or not
        changed = [n for n in MultiTurnConfig.model_fields if getattr(self.multi_turn, n) != getattr(defaults, n)]
        if self.mode != "multi_turn" and changed:
            key = f"rollout.multi_turn.{changed[0]}"
            raise ValueError(
                f"{key} is {getattr(self.multi_turn, changed[0])!r} but rollout.mode is {self.mode!r}, and it applies "
                f"to multi-turn rollouts only. Set --rollout.mode multi_turn, or drop --{key.replace('_', '-')}."
            )
        if self.generate_path and self.mode == "sft":
            raise ValueError(
                f"rollout.generate_path is {self.generate_path!r} but rollout.mode is 'sft', which generates nothing "
                "(the responses are the data's answers). Drop --rollout.generate-path, or set --rollout.mode generate."
            )
        if self.generate_path and ":" not in self.generate_path:
            raise ValueError(
                f"rollout.generate_path is {self.generate_path!r}; expected module:attr of a group-generate factory, "
                "e.g. --rollout.generate-path my_pkg.agents:build_generate"
            )
        check_plugin_path("rollout.sample_hook_path", self.sample_hook_path, "my_pkg.hooks:tag_sample")
        for key, value, off, flag in (
            ("top_p", self.sampling.top_p, 1.0, "--rollout.sampling.top-p 1.0"),
            ("top_k", self.sampling.top_k, 0, "--rollout.sampling.top-k 0"),
        ):
            if value != off:
                raise ValueError(
                    f"rollout.sampling.{key} is {value}, but training rollouts must sample the full distribution: "
                    "the engine and the trainer report log-probs of the untruncated softmax(logits / temperature), so "
                    "the PPO ratio and the TIS/MIS corrections would compare log-probs of different distributions. "
                    f"Set {flag} (truncated sampling is fine for evaluation: --eval.sampling.{key.replace('_', '-')})."
                )
        gbs = self.global_batch_size or self.samples_per_rollout
        if self.samples_per_rollout % gbs:
            raise ValueError(
                f"rollout.global_batch_size is {gbs}, but rollout_batch_size x n_samples_per_prompt = "
                f"{self.rollout_batch_size} x {self.n_samples_per_prompt} = {self.samples_per_rollout} samples is not "
                "a multiple of it, so some samples would never be trained. Set --rollout.global-batch-size to a "
                "divisor of that product (or 0 for one optimizer step per rollout)."
            )
        return self


class _EvalSettings(_Section):
    """What one evaluation samples and reports (shared by ``eval`` and each of ``eval.sets``)."""

    num_prompts: int = Field(32, ge=0, description="Fixed held-out prompts; 0 disables evaluation.")
    n_samples_per_prompt: int = Field(4, ge=1, description="Samples per eval prompt; eval/reward is their mean.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling used for evaluation.")
    pass_k: list[int] = Field(
        default_factory=lambda: [1],
        description="k of the eval/pass@k metrics: the unbiased estimate 1 - C(n-c, k) / C(n, k) per prompt (n "
        "samples, c of them passing; Chen et al. 2021, arXiv:2107.03374), averaged over prompts. Each k must be <= "
        "n_samples_per_prompt. [] = none.",
    )
    pass_threshold: float = Field(
        1.0, description="A sample passes (for pass@k) when its reward is >= this (1.0: fully correct)."
    )

    def _check_pass_k(self, key: str) -> None:
        bad = [k for k in self.pass_k if not 1 <= k <= self.n_samples_per_prompt]
        if bad:
            raise ValueError(
                f"{key}.pass_k holds {bad}, but pass@k needs 1 <= k <= {key}.n_samples_per_prompt "
                f"({self.n_samples_per_prompt}). Raise --{key.replace('_', '-')}.n-samples-per-prompt or drop those k."
            )


class EvalSetConfig(_EvalSettings):
    """One named eval set: its own prompts (``data`` overrides of the data section) and sampling; its metrics are
    ``eval/<name>/reward``, ``eval/<name>/pass@k``, ..."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Metric prefix eval/<name>/ (letters, digits, _.-).")
    num_prompts: int = Field(32, ge=1, description="Fixed held-out prompts of this set.")
    data: dict[str, Any] = Field(
        default_factory=dict,
        description="Keys of the data section that differ for this set, e.g. {source: file, path: test.jsonl} or "
        "{task: chain_sum}; its prompts are that data's eval prompts (checked with the data section).",
    )


class EvalConfig(_EvalSettings):
    """Held-out evaluation on fixed prompts with its own sampling settings, plus any named eval sets."""

    interval: int = Field(0, ge=0, description="Evaluate every N steps; 0 = only before the first and after the last.")
    path: str = Field(
        "",
        description="module:attr of an eval function (components, evaluation) -> dict[str, float] replacing the "
        "built-in one (miles.core.evaluation:evaluate: mean reward and pass@k over every eval set). Empty = the "
        "built-in one.",
    )
    sets: list[EvalSetConfig] = Field(
        default_factory=list,
        description="Named eval sets, evaluated after the default one (whose prompts are eval.num_prompts of the data "
        "section's eval prompts); each has its own num_prompts, sampling and pass_k, and is scored with the run's "
        "reward, so its labels must suit it, e.g. [{name: chain, data: {task: chain_sum, task_kwargs: {}}, "
        "n_samples_per_prompt: 8, pass_k: [1, 8]}].",
    )

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        check_plugin_path("eval.path", self.path, "my_pkg.evals:evaluate")
        if not self.num_prompts and self.interval and not self.sets:
            raise ValueError(
                f"eval.interval is {self.interval} but eval.num_prompts is 0 (evaluation off), so no evaluation "
                "would run. Set --eval.num-prompts 32 (or more), or drop --eval.interval."
            )
        if self.num_prompts:
            self._check_pass_k("eval")
        names = [s.name for s in self.sets]
        for i, eval_set in enumerate(self.sets):
            if eval_set.name in names[:i]:
                raise ValueError(f"eval.sets[{i}].name {eval_set.name!r} is used twice; give each set its own name")
            eval_set._check_pass_k(f"eval.sets[{i}]")
        return self

    @property
    def enabled(self) -> bool:
        """True when any evaluation runs (the default set or a named one)."""
        return bool(self.num_prompts or self.sets)


_TRUST_REMOTE_CODE = (
    "Load the model's own Python code: the classes its config.json / tokenizer_config.json / "
    "preprocessor_config.json name under auto_map (e.g. Kimi K2's tiktoken tokenizer, tokenization_kimi.py), passed "
    "as trust_remote_code to transformers' from_pretrained and as --trust-remote-code to vLLM / SGLang / miles serve. "
    "Security: that code runs with the run's permissions, so set it only for a checkpoint whose files you trust. "
    "false (the default) refuses such a checkpoint with one line naming this key."
)


class PolicyModelConfig(_Section):
    """The policy: the model being trained and served by the engine."""

    path: str = Field(
        "smollm2-135m-instruct",
        description="A model name registered in miles.recipes (smollm2-135m-instruct) or a local HF model directory "
        "(config.json + safetensors + tokenizer). Checked when the run is built.",
    )
    trust_remote_code: bool = Field(
        False,
        description=_TRUST_REMOTE_CODE
        + " Applies to this model and to the reference and critic while their paths are empty (they are this model).",
    )


class ReferenceModelConfig(_Section):
    """The frozen reference of the KL terms, held only while algorithm.kl is on."""

    path: str = Field(
        "",
        description="Registered name or HF model directory of the reference (same tokenizer as the policy); empty "
        "= the policy's initial weights (models.policy.path), the usual choice. Loaded only when algorithm.kl is on.",
    )
    trust_remote_code: bool = Field(
        False,
        description=_TRUST_REMOTE_CODE
        + " Only for a set models.reference.path (empty: models.policy.trust_remote_code).",
    )


class CriticConfig(_Section):
    """The critic of advantage 'gae': a scalar value head on a causal-LM backbone, trained alongside the policy."""

    path: str = Field(
        "",
        description="Registered name or HF model directory initializing the critic's backbone (a random value head "
        "is added); empty = the policy model (models.policy.path).",
    )
    trust_remote_code: bool = Field(
        False,
        description=_TRUST_REMOTE_CODE + " Only for a set models.critic.path (empty: models.policy.trust_remote_code).",
    )
    lr: float = Field(1e-5, gt=0.0, description="AdamW peak learning rate of the critic (train.warmup_steps applies).")
    value_clip: float = Field(
        0.2, gt=0.0, description="Critic value clipping range around the rollout-time values, in reward units."
    )


class TeacherConfig(_Section):
    """The frozen teacher of on-policy distillation (advantage 'opd')."""

    path: str = Field(
        min_length=1,
        description="Registered name or HF model directory of the teacher (required when models.teacher is on); "
        "it must share the policy's tokenizer and vocabulary.",
    )
    trust_remote_code: bool = Field(False, description=_TRUST_REMOTE_CODE)
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="Temperature of the teacher's log-probs: log softmax(teacher_logits / T). The student uses "
        "rollout.sampling.temperature; set both equal to distill the sampled distributions.",
    )


class ModelsConfig(_Section):
    """The models a run holds: the policy and, as the algorithm needs them, reference, critic and teacher."""

    policy: PolicyModelConfig = Field(default_factory=PolicyModelConfig, description="The policy model.")
    reference: ReferenceModelConfig = Field(
        default_factory=ReferenceModelConfig, description="The KL reference (held only while algorithm.kl is on)."
    )
    critic: Annotated[CriticConfig | None, ON_OFF] = Field(
        None,
        description="The critic; required by advantage 'gae' (which trains it) and refused otherwise. null (the "
        "default) = no critic; --models.critic.lr 1e-5 (any key) turns it on with the policy as its backbone.",
    )
    teacher: Annotated[TeacherConfig | None, ON_OFF] = Field(
        None,
        description="The teacher; required by advantage 'opd' (and allowed with a custom estimator, which gets "
        "its log-probs), refused otherwise. null (the default) = no teacher.",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelsConfig:
        for name, section in (("reference", self.reference), ("critic", self.critic)):
            if section is not None and section.trust_remote_code and not section.path:
                raise ValueError(
                    f"models.{name}.trust_remote_code is true but models.{name}.path is empty, so the {name} is the "
                    f"policy, whose code models.policy.trust_remote_code governs. Set "
                    f"--models.policy.trust-remote-code true instead, or give --models.{name}.path."
                )
        return self


class RayConfig(_Section):
    """The Ray session of execution.mode ray (``miles.core.execution.ray_session``) and the trainer's placement."""

    address: str | None = Field(
        None,
        description="An existing cluster to join ('auto', 'host:6379', 'ray://host:10001'); null (the default) "
        "starts a local cluster for the run and stops it at the end.",
    )
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="Logical CPUs of the local cluster; null (the default) = Ray's default (the machine's cores). "
        "Logical CPUs may exceed the cores (small actors share them). Local clusters only: a joined cluster "
        "(execution.ray.address) has its own.",
    )
    log_to_driver: bool = Field(
        True, description="Forward the actors' stdout/stderr (trainer ranks' warnings, tracebacks) to this console."
    )
    namespace: str | None = Field(
        None, description="Ray namespace of the run's actors; null (the default) = an anonymous one."
    )
    trainer_cpus_per_rank: float = Field(
        1.0,
        gt=0.0,
        description="CPUs of each trainer rank's placement-group bundle (one bundle per rank, train.world_size in "
        "all); also the rank's torch threads (at least 1).",
    )
    placement_strategy: Literal["PACK", "SPREAD"] = Field(
        "PACK",
        description="How the trainer bundles are placed: PACK (the default) on as few nodes as possible; SPREAD "
        "across nodes.",
    )
    colocate: bool = Field(
        False,
        description="Engines and trainer share the placement group's bundles (slime's --colocate, verl's hybrid "
        "engine): server i runs in trainer rank i's bundle (i modulo train.world_size), and each step hands the "
        "memory over, the engines freeing theirs (weights and KV cache) once the rollout is done and the trainer "
        "taking it back, then the trainer offloading before the engines re-allocate and receive the new weights. "
        "false (the default): disaggregated, the engines beside the trainer's bundles. Needs loop.mode sync and "
        "servers Miles starts (engine.type sglang, no engine.urls).",
    )
    engine_cpus_per_server: float = Field(
        0.0,
        ge=0.0,
        description="Engine bundles (disaggregated placement): > 0 gives each engine server Miles starts a "
        "placement-group bundle of its own with this many CPUs (one placement group of engine.num_servers bundles, "
        "placed by placement_strategy), its Ray actor and so its server inside it, beside the trainer's bundles. "
        "0 (the default): the servers' actors take no bundle (0 CPUs, on this node), and the trainer's bundles may "
        "hold every CPU. Needs servers Miles starts (no engine.urls) and colocate false.",
    )
    engine_gpus_per_server: float = Field(
        0.0,
        ge=0.0,
        description="GPUs of each engine bundle (see engine_cpus_per_server; either > 0 turns the engine bundles "
        "on): Ray gives the server's actor those GPUs (CUDA_VISIBLE_DEVICES), and the server it starts inherits them.",
    )
    max_trainer_restarts: int = Field(
        0,
        ge=0,
        description="How often a run whose trainer rank died (crashed, killed, OOM) restarts the trainer instead of "
        "stopping: all its rank actors are killed, train.world_size new ones start on the same placement group, "
        "and the run goes on from its newest checkpoint (weights, optimizer, data position, RNG states; the "
        "engines get the checkpoint's weights), redoing the steps after it; before the first checkpoint (always, "
        "with loop.save_interval 0) it starts over at step 0 from models.policy.path. 0 (the default) stops the "
        "run with one line naming the checkpoint to --resume from. A restart costs the trainer's start-up plus "
        "the redone steps: keep loop.save_interval small when restarts are on.",
    )

    @property
    def engine_bundle(self) -> dict[str, float]:
        """The resources of each engine server's bundle ({} = the servers take no bundle)."""
        bundle = {"CPU": self.engine_cpus_per_server, "GPU": self.engine_gpus_per_server}
        return {key: value for key, value in bundle.items() if value > 0}


class ExecutionConfig(_Section):
    """Where the components run."""

    mode: Literal["local", "ray"] = Field(
        "local",
        description="local: engine, trainer and loop in this one process, no cluster to start. ray: the trainer "
        "runs as train.world_size FSDP2 ranks, Ray actors on a placement group (execution.ray), and pushes its "
        "weights from rank 0 straight to the engine servers (engine.type vllm or sglang); the loop stays here.",
    )
    ray: RayConfig = Field(
        default_factory=RayConfig,
        description="The Ray session and the trainer's placement; execution.mode ray only (a setting of it with "
        "mode local is an error).",
    )

    @model_validator(mode="after")
    def _check_ray(self) -> ExecutionConfig:
        changed = changed_fields(self.ray, type(self.ray).model_fields)
        if self.mode != "ray" and changed:
            key = f"execution.ray.{changed[0]}"
            raise ValueError(
                f"{key} is {getattr(self.ray, changed[0])!r} but execution.mode is {self.mode!r}, and it applies to "
                f"Ray execution only. Set --execution.mode ray, or drop --{key.replace('_', '-')}."
            )
        if self.ray.address is not None and self.ray.num_cpus is not None:
            raise ValueError(
                f"execution.ray.num_cpus is {self.ray.num_cpus} but execution.ray.address is {self.ray.address!r}: "
                "a running cluster's resources are its own. Drop --execution.ray.num-cpus, or drop "
                "--execution.ray.address to start a local cluster with that many CPUs."
            )
        return self


class LoopConfig(_Section):
    """The training loop: which loop, how long, how often to save."""

    mode: Literal["sync", "one_step_off", "fully_async"] = Field(
        "sync",
        description="sync: generate, then train, then push weights, one step at a time. one_step_off: step k+1's "
        "rollout is generated (on step k's weights) while step k trains; it finishes before the weights are "
        "replaced, so every sample of step k >= 1 is exactly one version stale. fully_async: a producer keeps the "
        "engines generating into a buffer while the trainer consumes it, within loop.max_weight_staleness; a "
        "weight update interrupts requests in flight (aborted and generated again, or continued with "
        "loop.partial_rollout).",
    )
    max_weight_staleness: int | None = Field(
        None,
        ge=0,
        description="fully_async only (default 1 there): the most weight versions a trained sample's oldest token "
        "may lag the trainer's weights. Groups of step s start only after step s - N trained, and a group that "
        "is still staler when taken is dropped and generated again (counted as staleness/dropped_groups). 0 "
        "generates nothing ahead and reproduces the sync loop.",
    )
    partial_rollout: bool = Field(
        False,
        description="fully_async only: a weight update retracts requests in flight and continues them on the new "
        "weights, keeping their earlier tokens (a sample then carries several weight_versions; staleness counts "
        "from the oldest). false: they are aborted and requested again from the start (rollout.max_resubmits).",
    )
    stale_groups: Literal["regenerate", "drop"] = Field(
        "regenerate",
        description="fully_async only: a group still staler than loop.max_weight_staleness when the trainer takes it "
        "is dropped (staleness/dropped_groups) and its prompt generated again on newer weights (regenerate: every "
        "prompt is trained, some twice generated), or given up for good, a new prompt taking its place (drop: never "
        "trained; also counted as staleness/discarded_groups).",
    )
    mask_stale_segments: bool = Field(
        False,
        description="loop.partial_rollout only: train only the newest segment of a continued request; the tokens "
        "older weights sampled get loss_mask 0 (slime's mask-offpolicy-in-partial-rollout). Needs an engine that "
        "reports segment boundaries (embedded; server engines report versions only, and all tokens are trained).",
    )
    num_steps: int = Field(12, ge=1, description="Rollout steps (each: generate, score, train, push weights).")
    save_interval: int = Field(
        5,
        ge=0,
        description="Save a checkpoint every N steps and after the last; 0 = only after the last. A stop by "
        "Ctrl-C/SIGTERM also saves after the step it finishes. A SmolLM2-135M checkpoint (fp32 weights + AdamW "
        "state) is ~1.6 GB and takes a few seconds on CPU.",
    )
    keep_checkpoints: int = Field(
        2,
        ge=0,
        description="Keep only the newest N checkpoints (older ones are deleted after a newer one is published; "
        "the one `latest` names always stays); 0 keeps all. 2 (the default) still leaves a complete previous "
        "checkpoint while the next one is written.",
    )

    @model_validator(mode="after")
    def _check_async_settings(self) -> LoopConfig:
        if self.mode != "fully_async":
            settings = (
                ("max_weight_staleness", self.max_weight_staleness),
                ("partial_rollout", self.partial_rollout),
                ("stale_groups", self.stale_groups),
            )
            for name, value in settings:
                if value not in (None, False, "regenerate"):
                    raise ValueError(
                        f"loop.{name} is {value!r} but loop.mode is {self.mode!r}; it applies to fully_async only: set "
                        f"--loop.mode fully_async or drop --loop.{name.replace('_', '-')}"
                    )
        if self.mask_stale_segments and not self.partial_rollout:
            raise ValueError(
                "loop.mask_stale_segments is True but loop.partial_rollout is False: without partial rollouts every "
                "response has one segment. Set --loop.partial-rollout true, or drop --loop.mask-stale-segments"
            )
        return self

    @property
    def staleness_bound(self) -> int:
        """The staleness bound the loop enforces: 0 (sync), 1 (one_step_off), max_weight_staleness or 1."""
        if self.mode == "sync":
            return 0
        if self.mode == "one_step_off":
            return 1
        return 1 if self.max_weight_staleness is None else self.max_weight_staleness

    @property
    def pause_mode(self) -> str | None:
        """How a weight update pauses the engines in this loop, or None for the engine's own setting (nothing is
        in flight in the sync and one-step-off loops at an update)."""
        if self.mode != "fully_async":
            return None
        return "retract" if self.partial_rollout else "abort"


def check_group_size(rollout: RolloutConfig, algorithm: AlgorithmConfig) -> None:
    """Refuse algorithms that need groups of at least two samples per prompt when ``rollout`` gives one.

    A rule across two sections: the root config (``miles.recipes.config``) applies it at validation, and
    ``train`` again at its start, for loops driven from a user script.
    Raises: ValueError naming the key, the value, why nothing would be learned and the fix.
    """
    n, advantage = rollout.n_samples_per_prompt, algorithm.advantage
    group_baseline = ESTIMATORS[advantage.estimator].group_baseline and not advantage.estimator_path
    if group_baseline and not POLICY_LOSSES[algorithm.loss.policy_loss].supervised and n < 2:
        raise ValueError(
            f"rollout.n_samples_per_prompt is {n}, but advantage '{advantage.estimator}' needs at least 2: its "
            "baseline is the group (the mean of the prompt's samples), so a group of one always gets advantage 0 "
            "and nothing is learned. Set --rollout.n-samples-per-prompt 4 (or more), or pick an estimator without "
            "a group baseline (--algorithm.advantage.estimator reinforce_plus_plus or gae)."
        )
    if POLICY_LOSSES[algorithm.loss.policy_loss].supervised and n > 1:
        mode = "" if rollout.mode == "sft" else " --rollout.mode sft"  # the other half of SFT, in the same line
        raise ValueError(
            f"rollout.n_samples_per_prompt is {n} with algorithm.loss.policy_loss 'sft': supervised fine-tuning "
            f"trains each prompt's reference answer, so every step would train {n} identical copies of it (each "
            f"row weighted {n} times). Set --rollout.n-samples-per-prompt 1{mode} (and --rollout.rollout-batch-size "
            "for more answers per step)."
        )
    if algorithm.dynamic_sampling is not None and n < 2:
        raise ValueError(
            f"algorithm.dynamic_sampling is on with rollout.n_samples_per_prompt {n}: a group of one never "
            "has reward variance, so every group would be filtered. Set --rollout.n-samples-per-prompt 4 (or "
            "more), or --algorithm.dynamic-sampling null."
        )


def uses_critic(advantage: AdvantageConfig) -> bool:
    """The built-in estimator trains a critic (a custom ``estimator_path`` never gets one)."""
    return ESTIMATORS[advantage.estimator].critic and not advantage.estimator_path


TEACHER_FIX = (
    "Set --models.teacher.path to a stronger model with the policy's tokenizer (an HF model directory: a larger "
    "model of the policy's family, or the policy after RL training, e.g. runs/NAME/checkpoints/step_N/model)."
)


def same_model_path(a: str, b: str) -> bool:
    """The two model paths name the same registered model or directory, as far as the strings tell (no disk read:
    ``~``, ``.``/``..`` and a trailing slash are normalized, a relative path is taken from the current directory)."""

    def normal(path: str) -> str:
        return os.path.abspath(os.path.expanduser(path)) if os.sep in path or path.startswith(("~", ".")) else path

    return normal(a) == normal(b)


def check_models(models: ModelsConfig, algorithm: AlgorithmConfig) -> None:
    """Refuse a model the algorithm never reads, and an algorithm without the model it needs (registry-derived).

    Raises: ValueError naming both keys and the fix.
    """
    advantage = algorithm.advantage
    estimator = advantage.estimator
    if uses_critic(advantage) and models.critic is None:
        raise ValueError(
            f"algorithm.advantage.estimator is {estimator!r}, which trains a critic, but models.critic is off. "
            "Turn it on: --models.critic.lr 1e-5 (its backbone defaults to the policy; --models.critic.path "
            "another model), or pick an estimator without a critic."
        )
    if models.critic is not None and not uses_critic(advantage):
        what = "a custom estimator_path" if advantage.estimator_path else f"{estimator!r}"
        raise ValueError(
            f"models.critic is set but algorithm.advantage.estimator is {what}, which never reads critic values, so "
            "the critic would be trained for nothing. Set --algorithm.advantage.estimator gae, or turn it off: "
            "--models.critic null."
        )
    needs_teacher = "teacher_log_probs" in ESTIMATORS[estimator].needs and not advantage.estimator_path
    if needs_teacher and models.teacher is None:
        raise ValueError(
            f"algorithm.advantage.estimator is {estimator!r} but models.teacher is off: on-policy distillation "
            f"needs a teacher's log-probs. {TEACHER_FIX}"
        )
    if needs_teacher and same_model_path(models.teacher.path, models.policy.path):
        raise ValueError(
            f"models.teacher.path is {models.teacher.path!r}, the policy itself (models.policy.path "
            f"{models.policy.path!r}): on-policy distillation from the policy has advantage teacher_log_prob - "
            f"log_prob = 0 at every token, so the loss, the gradient and the update are 0. {TEACHER_FIX}"
        )
    if models.teacher is not None and not needs_teacher and not advantage.estimator_path:
        raise ValueError(
            f"models.teacher is set but algorithm.advantage.estimator is {estimator!r}, which never reads teacher "
            "log-probs, so the teacher would be loaded for nothing. Set --algorithm.advantage.estimator opd, or turn "
            "it off: --models.teacher null."
        )
    if algorithm.kl is None and changed_fields(models.reference, ["path"]):
        raise ValueError(
            f"models.reference.path is {models.reference.path!r} but algorithm.kl is off, so no reference is held. "
            "Turn KL on (--algorithm.kl.coef 0.001), or drop --models.reference.path."
        )
