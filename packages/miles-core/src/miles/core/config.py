"""Config sections owned by miles-core: the algorithm (advantages + loss), rollout batch arithmetic and
sampling, evaluation, and the loop. Each is frozen, forbids unknown keys and documents every field."""

from __future__ import annotations

from typing import Literal

from miles.core.algorithms.registry import ESTIMATORS, POLICY_LOSSES
from pydantic import BaseModel, ConfigDict, Field, model_validator


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
    mode: Literal["generate", "sft"] = Field(
        "generate",
        description="generate: the engine samples the responses (RL); sft: the response is the data's reference "
        "answer (teacher forcing, no generation), trained on assistant tokens with algorithm.policy_loss sft.",
    )
    seed: int = Field(1234, description="Seed of the engine's sampler (each step derives its own).")

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def steps_per_rollout(self) -> int:
        gbs = self.global_batch_size or self.samples_per_rollout
        return self.samples_per_rollout // gbs

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
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


class EvalConfig(_Section):
    """Held-out evaluation on fixed prompts with its own sampling settings."""

    interval: int = Field(0, ge=0, description="Evaluate every N steps; 0 = only before the first and after the last.")
    num_prompts: int = Field(32, ge=0, description="Fixed held-out prompts; 0 disables evaluation.")
    n_samples_per_prompt: int = Field(4, ge=1, description="Samples per eval prompt; eval/reward is their mean.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling used for evaluation.")


# The choices come from the registry (miles.core.algorithms.registry), the only place a name is matched.
AdvantageEstimator = Literal[tuple(ESTIMATORS)]  # type: ignore[valid-type]
PolicyLoss = Literal[tuple(POLICY_LOSSES)]  # type: ignore[valid-type]

# Plugin keys of AlgorithmConfig and the positional arguments their callables must accept.
PLUGIN_ARITY = {
    "advantage_estimator_path": 2,  # (inputs: AdvantageInputs, params: AdvantageParams) -> (advantages, returns)
    "policy_loss_path": 5,  # (log_probs, old_log_probs, advantages, loss_mask, params: LossParams) -> (loss, clipped)
    "loss_reducer_path": 4,  # (token_loss, loss_mask, num_tokens, num_sequences) -> scalar
    "reward_post_process_path": 2,  # (samples, rewards [B] float32) -> rewards [B] float32
    "dynamic_sampling_filter_path": 1,  # (group: list[Sample]) -> bool keep
}


class AlgorithmConfig(_Section):
    """Advantage estimator, policy loss and their corrections. GRPO, Dr.GRPO and DAPO are values of one path;
    see docs/algorithms.md for the config of each algorithm."""

    advantage_estimator: AdvantageEstimator = Field(
        "grpo",
        description="grpo: (r - group mean) / group std (arXiv:2402.03300); dr_grpo: r - group mean "
        "(arXiv:2503.20783); rloo: r - mean of the other samples (arXiv:2402.14740); reinforce_plus_plus: returns "
        "whitened over the batch, reinforce_plus_plus_baseline: minus the group mean first (arXiv:2501.03262); "
        "gae: PPO with a critic (arXiv:1506.02438, needs a critic); opd: on-policy distillation, per-token "
        "teacher_log_prob - student_log_prob (needs algorithm.teacher_path). Group estimators (grpo, dr_grpo, "
        "rloo, reinforce_plus_plus_baseline) need n_samples_per_prompt >= 2.",
    )
    advantage_estimator_path: str = Field(
        "",
        description="module:attr of a custom estimator fn(inputs: AdvantageInputs, params: AdvantageParams) -> "
        "(advantages [B, T], returns [B, T] or None); replaces advantage_estimator. Empty = built-in.",
    )
    policy_loss: PolicyLoss = Field(
        "ppo",
        description="ppo: clipped token ratio (GRPO/DAPO/PPO); gspo: clipped length-normalized sequence ratio, use "
        "clip 3e-4/4e-4 and seq_mean_token_mean (arXiv:2507.18071); cispo: clipped stop-gradient IS weight times "
        "log-prob (arXiv:2506.13585); sft: negative log-likelihood of the loss-masked tokens (advantages unused).",
    )
    policy_loss_path: str = Field(
        "",
        description="module:attr of a custom policy loss fn(log_probs, old_log_probs, advantages, loss_mask, "
        "params: LossParams) -> (token_loss [B, T], clipped [B, T] bool); replaces policy_loss. Empty = built-in.",
    )
    loss_reducer_path: str = Field(
        "",
        description="module:attr of a custom aggregation fn(token_loss, loss_mask, num_tokens, num_sequences) -> "
        "scalar, with global counts; replaces aggregation. Empty = built-in.",
    )
    reward_post_process_path: str = Field(
        "",
        description="module:attr of fn(samples, rewards [B] float32) -> rewards [B] float32, applied after "
        "scoring and overlong shaping, before advantages. Empty = none.",
    )
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO lower clip: ratio >= 1 - clip_low.")
    clip_high: float = Field(
        0.2,
        ge=0.0,
        description="PPO upper clip: ratio <= 1 + clip_high. 0.28 = DAPO clip-higher (arXiv:2503.14476); "
        "equal to clip_low gives plain PPO/GRPO.",
    )
    dual_clip_c: float = Field(
        0.0,
        ge=0.0,
        description="Dual-clip constant c (> 1, typically 3): caps the loss of negative-advantage tokens at "
        "c * |A| (arXiv:1912.09729); 0 disables. policy_loss ppo only.",
    )
    kl_coef: float = Field(
        0.0, ge=0.0, description="Weight of the KL to the reference model; 0 skips the reference model entirely."
    )
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3",
        description="KL estimator (Schulman 2020): k3 is unbiased and low-variance (GRPO's choice); low_var_kl "
        "is k3 clamped to [-10, 10]; k1 is the usual choice for a reward penalty.",
    )
    kl_mode: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: differentiable KL term added to the loss (GRPO); reward: per-token penalty "
        "-kl_coef * KL(old || ref) added to the rewards before advantages (PPO/REINFORCE++).",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Entropy bonus weight (loss -= coef * entropy); 0 = entropy is only a metric."
    )
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="Per-token loss -> scalar. token_mean: DAPO; seq_mean_token_mean: GRPO paper, GSPO; "
        "seq_mean_token_sum_norm: Dr.GRPO (divides by sampling.max_new_tokens).",
    )
    advantage_eps: float = Field(1e-6, gt=0.0, description="Added to a std before dividing (grpo, reinforce++).")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of token rewards (gae, reinforce++); 1.0 = none.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (gae): 1.0 = Monte-Carlo, 0.0 = one-step TD.")
    critic_path: str = Field(
        "",
        description="HF model directory (or registered name) initializing the critic of advantage 'gae'; a "
        "scalar value head is added on top. Empty = the policy model.",
    )
    critic_lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate of the critic (gae).")
    value_clip: float = Field(
        0.2, gt=0.0, description="Critic value clipping range around the rollout-time values (gae), reward units."
    )
    teacher_path: str = Field(
        "", description="HF model directory (or registered name) of the teacher for advantage 'opd'; same vocabulary."
    )
    teacher_temperature: float = Field(
        1.0,
        gt=0.0,
        description="Temperature of the teacher's log-probs (opd): log softmax(teacher_logits / T). The student "
        "uses rollout.sampling.temperature; set both equal to distill the sampled distributions.",
    )
    importance_sampling: Literal["none", "tis", "mis", "icepop"] = Field(
        "none",
        description="Rollout/training mismatch correction, weight from rho = pi_old / pi_rollout (no grad): tis "
        "clamps rho to [importance_lower, importance_upper], mis zeroes it outside, icepop = mis per token "
        "(arXiv:2510.18855). none: no correction (train_rollout_* metrics still measure the mismatch).",
    )
    importance_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="Where rho is measured (tis/mis): token, sequence (product of token ratios) or geometric "
        "(per-token geometric mean of the sequence).",
    )
    importance_lower: float = Field(0.0, ge=0.0, le=1.0, description="Lower bound of rho (tis/mis/icepop).")
    importance_upper: float = Field(
        2.0, ge=1.0, description="Upper bound of rho (tis/mis/icepop); TIS uses ~2, IcePop [0.5, 5]."
    )
    opsm: bool = Field(
        False,
        description="Off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556): drop negative-advantage "
        "sequences whose mean log(pi_rollout / pi_theta) exceeds opsm_threshold.",
    )
    opsm_threshold: float = Field(0.05, ge=0.0, description="OPSM divergence threshold delta, nats per token.")
    overlong_filter: bool = Field(
        False,
        description="DAPO overlong filtering: samples cut at max_new_tokens (finish reason 'length') are not "
        "trained (loss mask 0) but still count in their group's reward statistics.",
    )
    overlong_buffer_len: int = Field(
        0,
        ge=0,
        description="DAPO soft overlong punishment (arXiv:2503.14476 Eq. 13): the last N tokens before "
        "max_new_tokens ramp a reward penalty from 0 to -overlong_penalty_factor; 0 disables.",
    )
    overlong_penalty_factor: float = Field(1.0, ge=0.0, description="Penalty at max_new_tokens (overlong shaping).")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and generate "
        "more prompts until rollout_batch_size groups are kept, at most dynamic_sampling_max_rounds rounds.",
    )
    dynamic_sampling_max_rounds: int = Field(
        3,
        ge=1,
        description="Generation rounds per step with dynamic sampling (the first included); if the batch is "
        "still short after them the step fails with an error naming the filtered counts.",
    )
    dynamic_sampling_over_sample: float = Field(
        1.0,
        ge=1.0,
        description="Extra rounds of dynamic sampling ask for this factor times the missing groups (DAPO "
        "over-samples, since many groups are filtered again); 1.0 = exactly the missing ones.",
    )
    dynamic_sampling_filter_path: str = Field(
        "",
        description="module:attr of a custom group filter fn(group: list[Sample]) -> bool (True = keep) "
        "replacing the zero-variance test of dynamic sampling. Empty = built-in.",
    )

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.clip_high < self.clip_low:
            raise ValueError(
                f"algorithm.clip_high ({self.clip_high}) is below algorithm.clip_low ({self.clip_low}); clip-higher "
                "(DAPO) raises the upper bound, never lowers it. Set --algorithm.clip-high >= clip_low."
            )
        if self.dual_clip_c and (
            self.dual_clip_c <= 1.0 or "dual_clip_c" not in POLICY_LOSSES[self.policy_loss].params
        ):
            raise ValueError(
                f"algorithm.dual_clip_c is {self.dual_clip_c} with policy_loss {self.policy_loss!r}; dual clip caps "
                "ppo's loss at c*|A| and needs c > 1 to leave the clipped objective intact. Set "
                "--algorithm.dual-clip-c 3 with --algorithm.policy-loss ppo, or 0 to disable."
            )
        estimator = ESTIMATORS[self.advantage_estimator]
        if "teacher_log_probs" in estimator.needs and not self.teacher_path:
            raise ValueError(
                "algorithm.advantage_estimator is 'opd' but algorithm.teacher_path is empty: on-policy distillation "
                "needs a teacher's log-probs. Set --algorithm.teacher-path /path/to/teacher (same tokenizer)."
            )
        if self.teacher_path and "teacher_log_probs" not in estimator.needs and not self.advantage_estimator_path:
            raise ValueError(
                f"algorithm.teacher_path is set but advantage_estimator is {self.advantage_estimator!r}, which never "
                "reads teacher log-probs, so the teacher would be loaded for nothing. Set "
                "--algorithm.advantage-estimator opd, or drop --algorithm.teacher-path."
            )
        if self.critic_path and not estimator.critic:
            raise ValueError(
                f"algorithm.critic_path is set but advantage_estimator is {self.advantage_estimator!r}; only 'gae' "
                "uses a critic. Set --algorithm.advantage-estimator gae, or drop --algorithm.critic-path."
            )
        from miles.core.plugins import load_plugin

        for key, arity in PLUGIN_ARITY.items():  # fail at start-up, naming the key
            if getattr(self, key):
                try:
                    load_plugin(getattr(self, key), key=f"algorithm.{key}", num_positional=arity)
                except (ImportError, AttributeError, TypeError) as err:  # pydantic reports only ValueErrors
                    raise ValueError(str(err)) from err
        return self


class LoopConfig(_Section):
    """The training loop: how long, how often to save."""

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


def check_group_size(rollout: RolloutConfig, algorithm: AlgorithmConfig) -> None:
    """Refuse algorithms that need groups of at least two samples per prompt when ``rollout`` gives one.

    A rule across two sections: the root config (``miles.recipes.config``) applies it at validation, and
    ``train_sync`` again at its start, for loops driven from a user script.
    Raises: ValueError naming the key, the value, why nothing would be learned and the fix.
    """
    n, estimator = rollout.n_samples_per_prompt, algorithm.advantage_estimator
    group_baseline = ESTIMATORS[estimator].group_baseline and not algorithm.advantage_estimator_path
    if group_baseline and not POLICY_LOSSES[algorithm.policy_loss].supervised and n < 2:
        raise ValueError(
            f"rollout.n_samples_per_prompt is {n}, but advantage '{estimator}' needs at least 2: its baseline "
            "is the group (the mean of the prompt's samples), so a group of one always gets advantage 0 and "
            "nothing is learned. Set --rollout.n-samples-per-prompt 4 (or more), or pick an estimator without "
            "a group baseline (--algorithm.advantage-estimator reinforce_plus_plus or gae)."
        )
    if algorithm.dynamic_sampling and n < 2:
        raise ValueError(
            f"algorithm.dynamic_sampling is on with rollout.n_samples_per_prompt {n}: a group of one never "
            "has reward variance, so every group would be filtered. Set --rollout.n-samples-per-prompt 4 (or "
            "more), or --algorithm.dynamic-sampling false."
        )
