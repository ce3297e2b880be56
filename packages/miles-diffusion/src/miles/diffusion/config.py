"""Flow-GRPO's settings (``miles.diffusion.trainer``): rollout, objective, optimizer. Frozen; unknown keys refused."""

from __future__ import annotations

from typing import Annotated, Literal

from miles.core.config import ON_OFF
from miles.train.config import LoraConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator

# Flow-GRPO's SD3.5 LoRA targets: every projection of the joint attention (image and text streams)
SD3_ATTENTION_LINEARS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)  # fmt: skip


class FlowLoraConfig(LoraConfig):
    """LoRA adapters (peft) on the flow transformer, as Flow-GRPO trains SD3.5 (r 32, alpha 64, the joint attention's
    projections): only the adapters train; the rollout copy gets the merged weights ``W + (alpha / r) B A``."""

    rank: int = Field(32, ge=1, description="r, the adapters' rank (Flow-GRPO's SD3.5: 32).")
    alpha: float = Field(64.0, gt=0.0, description="lora_alpha: the update is scaled by alpha / r (Flow-GRPO: 64).")
    target_modules: list[str] = Field(
        default_factory=lambda: list(SD3_ATTENTION_LINEARS),
        min_length=1,
        description="Module names (path suffixes) of the Linear layers that get adapters; the default is every "
        "projection of SD3's joint attention, Flow-GRPO's choice.",
    )
    sync: Literal["merged"] = Field(
        "merged", description="merged only: the rollout copy is a plain transformer and gets W + scale * B A."
    )


class FlowGRPOConfig(BaseModel):
    """One Flow-GRPO step samples ``prompts_per_step`` x ``group_size`` images, rewards them, and trains the
    transformer on their denoising steps in ``updates_per_rollout`` optimizer steps.

    Defaults follow Flow-GRPO (arXiv:2505.05470, its SD3.5 configs) where they carry over to a small model: noise
    level 0.7, SD3's shift 3, ratio clip 1e-4, advantages clipped at 5, group-normalized rewards.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss: Literal["flow_grpo", "diffusion_nft"] = Field(
        "flow_grpo",
        description="flow_grpo: the clipped ratio of SDE step log-probs (arXiv:2505.05470). diffusion_nft: flow "
        "matching on the sampled images split into implicit positive / negative policies by reward, no log-probs "
        "(arXiv:2509.16117; CFG-free).",
    )
    prompts_per_step: int = Field(4, gt=0, description="Prompts sampled per step.")
    group_size: int = Field(8, ge=2, description="Images per prompt (the GRPO group).")
    num_steps: int = Field(10, ge=2, description="Denoising steps when sampling (every one an SDE step).")
    train_steps: int | None = Field(
        None, gt=0, description="Denoising reduction: train on this many of the sampled steps (a random subset per "
        "optimizer step, seeded); None trains on all of them."
    )  # fmt: skip
    noise_level: float = Field(0.7, gt=0, description="Flow-GRPO's SDE noise level a.")
    shift: float = Field(3.0, gt=0, description="The schedule's shift (SD3: 3.0; Qwen-Image has its own dynamically "
                         "shifted schedule and does not use it).")  # fmt: skip
    guidance_scale: float = Field(1.0, ge=1.0, description="Classifier-free guidance (1.0 = off; the empty prompt "
                                  "is the unconditional one).")  # fmt: skip
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient L2 norm.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup, in optimizer steps.")
    clip_range: float = Field(1e-4, gt=0, description="PPO ratio clip on each side (Flow-GRPO: 1e-4).")
    advantage_clip: float = Field(5.0, gt=0, description="Advantages are clipped to +- this.")
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="flow_grpo: weight of the per-step KL to the run's starting model "
        "(closed form between the two Gaussian steps; Flow-GRPO's beta); 0 = no reference.",
    )
    nft_beta: float = Field(
        1.0,
        gt=0,
        description="diffusion_nft: b, the implicit policies' distance from the "
        "sampling policy (1.0: the positive policy is the trained one).",
    )
    nft_decay_rate: float = Field(
        0.0,
        ge=0,
        description="diffusion_nft: the soft update of the old (sampling) policy after each step, theta_old <- eta "
        "theta_old + (1 - eta) theta with eta = min(rate x (optimizer steps - nft_decay_delay), nft_decay_max) "
        "(DiffusionNFT's schedule; its default: 0.001 with max 0.5); 0 = the old policy is the trained one.",
    )
    nft_decay_max: float = Field(0.5, ge=0, lt=1, description="diffusion_nft: the largest eta of the soft update.")
    nft_decay_delay: int = Field(
        0, ge=0, description="diffusion_nft: optimizer steps before the soft update starts (eta 0 before)."
    )
    nft_reward_scale: float = Field(
        1.0, gt=0, description="diffusion_nft: Z in r = 0.5 + 0.5 clip(A / Z, -1, 1), A the group-normalized advantage."
    )
    rollout_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="The sampling copy's dtype. bfloat16 halves its memory and samples as Flow-GRPO's bf16 runs do; "
        "the trained transformer stays float32 (master weights and compute), each push rounds into the copy.",
    )
    old_log_probs: Literal["auto", "rollout", "recompute"] = Field(
        "auto",
        description="flow_grpo's old log-probs (the ratio's denominator): rollout = the sampler's; recompute = the "
        "trained transformer's before the step's first update (one more forward per trained step, no grad; the "
        "ratio then starts at exactly 1 and train_rollout_logprob_max_abs_diff measures the sampler's gap over the "
        "whole rollout); auto = recompute with a bfloat16 rollout_dtype, else rollout.",
    )
    normalize_std: bool = Field(True, description="Divide by the group's reward std (GRPO); False: mean-centring.")
    updates_per_rollout: int = Field(1, gt=0, description="Optimizer steps per rollout batch (mini-batches); "
                                     "past the first, the ratio and its clip matter.")  # fmt: skip
    micro_batch_size: int = Field(8, gt=0, description="Images per forward/backward (memory only).")
    skip_nonfinite_steps: bool = Field(False, description="Skip an optimizer step with a non-finite loss or grad "
                                       "norm instead of stopping.")  # fmt: skip
    seed: int = Field(0, description="Seeds the noise of every rollout and the step subsets (exact resume).")
    lora: Annotated[FlowLoraConfig | None, ON_OFF] = Field(
        None,
        description="LoRA adapters on the transformer: the optimizer holds only the adapters, the KL reference is the "
        "transformer with its adapters off (no second copy), each push sends the adapted layers' merged weights, a "
        "checkpoint's model/ holds the merged transformer. null (the default) = full fine-tuning; --algorithm.lora on "
        "(or any --algorithm.lora.KEY) turns it on.",
    )

    @model_validator(mode="after")
    def _check(self) -> FlowGRPOConfig:
        batch = self.prompts_per_step * self.group_size
        if batch % self.updates_per_rollout:
            raise ValueError(
                f"algorithm.updates_per_rollout ({self.updates_per_rollout}) must divide algorithm.prompts_per_step x "
                f"algorithm.group_size ({batch}) so every optimizer step sees as many images"
            )
        if self.train_steps is not None and self.train_steps > self.num_steps:
            raise ValueError(
                f"algorithm.train_steps ({self.train_steps}) must be at most algorithm.num_steps ({self.num_steps})"
            )
        if self.loss == "diffusion_nft" and self.guidance_scale != 1.0:
            raise ValueError(
                "algorithm.loss diffusion_nft trains CFG-free: set --algorithm.guidance-scale 1.0 (or loss flow_grpo)"
            )
        if self.loss != "diffusion_nft" and self.nft_decay_rate > 0:
            raise ValueError(
                "algorithm.nft_decay_rate is DiffusionNFT's soft update of its old policy; flow_grpo samples with the "
                "trained weights: set --algorithm.nft-decay-rate 0 (or --algorithm.loss diffusion_nft)"
            )
        if self.loss == "diffusion_nft" and self.old_log_probs != "auto":
            raise ValueError(
                "algorithm.old_log_probs is flow_grpo's ratio denominator; diffusion_nft uses no log-probs: leave it "
                "auto"
            )
        if self.loss == "diffusion_nft" and self.kl_coef > 0:
            raise ValueError(
                "algorithm.kl_coef is flow_grpo's KL to a reference; diffusion_nft has none: set --algorithm.kl-coef 0"
            )
        return self

    @property
    def batch_size(self) -> int:
        """Images per step."""
        return self.prompts_per_step * self.group_size

    @property
    def recompute_old_log_probs(self) -> bool:
        """Whether flow_grpo's old log-probs are the trainer's recompute (``old_log_probs``, auto resolved)."""
        if self.loss != "flow_grpo":
            return False
        if self.old_log_probs == "auto":
            return self.rollout_dtype != "float32"
        return self.old_log_probs == "recompute"
