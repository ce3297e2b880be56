"""Config section of the training backends."""

from __future__ import annotations

from typing import Annotated, Literal

from miles.core.config import ON_OFF  # the `on` / `off` switch every optional section takes
from miles.sync.codecs import LossyCodecName
from pydantic import BaseModel, ConfigDict, Field

LLAMA_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(BaseModel):
    """LoRA adapters on the policy (peft): only the adapters train; the engines get merged weights or the adapters.

    W' = W + (alpha / r) B A (rsLoRA: alpha / sqrt(r)), A [r, in] Kaiming-uniform, B [out, r] zeros, so training
    starts from the base model exactly (Hu et al. 2021, arXiv:2106.09685; Kalajdzievski 2023, arXiv:2312.03732).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(16, ge=1, description="r, the adapters' rank.")
    alpha: float = Field(32.0, gt=0.0, description="lora_alpha: the update is scaled by alpha / r (rsLoRA: / sqrt(r)).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input during training.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LLAMA_LINEAR_MODULES),
        min_length=1,
        description="Names (last path component) of the Linear layers that get adapters; the default is every "
        "attention and MLP projection of Llama/Qwen-family models.",
    )
    use_rslora: bool = Field(False, description="Rank-stabilized scaling alpha / sqrt(r) instead of alpha / r.")
    init_seed: int = Field(
        0, description="Seed of the A matrices' initialization (the same on every rank and every run of a config)."
    )
    sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="What weight pushes send. merged: W + scale * B A for targeted weights, the rest as loaded (any "
        "engine). adapter: only A and scale * B; the engine keeps its base weights and applies the adapters "
        "(the embedded engine; vLLM and SGLang-API servers load each version from a peft directory beside the run; "
        "on Megatron a fused layer's adapter goes out as HF adapters per projection sharing A): ~rank / hidden of "
        "the bytes.",
    )


class MegatronConfig(BaseModel):
    """Parallel layout of the Megatron-core backend (``train.backend megatron``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks each layer's weights are split over (Megatron tensor parallelism); it must divide the "
        "attention and key/value heads and train.world_size. The other ranks are data-parallel replicas.",
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks each MoE layer's experts are split over (Megatron expert parallelism; tokens reach their "
        "experts through an all-gather); it must divide the experts per layer, and tensor_parallel_size x "
        "expert_parallel_size x pipeline_parallel_size must divide train.world_size. 1 for dense models.",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="Pipeline stages the decoder layers are split over (Megatron pipeline parallelism: each stage "
        "holds a consecutive run of layers, the first the embedding, the last the final norm and output layer; "
        "activations and their gradients pass between stages point to point under Megatron's 1F1B schedule, so the "
        "stages work on different micro-batches at once: give a step several micro-batches, train.micro_batch_size). "
        "It must divide the model's layers, and tensor_parallel_size x pipeline_parallel_size must divide "
        "train.world_size: a data-parallel replica is that many ranks (Megatron's rank order: a replica's "
        "tensor-parallel ranks consecutive, its stages world_size / pipeline_parallel_size ranks apart). With "
        "expert_parallel_size > 1 each stage's MoE layers split their experts over the replicas.",
    )
    context_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks each sequence is split over (context parallelism, for long sequences): the CP ranks of a "
        "data-parallel replica get the same rows, each sequence is right-padded to a multiple of 2 x "
        "context_parallel_size and cut into 2 x context_parallel_size chunks, rank r holding chunks r and "
        "2 x context_parallel_size - 1 - r (Megatron's load-balanced split); attention all-gathers the keys and "
        "values over the CP ranks (on the CPU: miles.train.megatron.context_parallel, the stand-in for Transformer "
        "Engine's), and the ranks' log-probs are gathered back, so results equal context_parallel_size 1. "
        "tensor_parallel_size x context_parallel_size x pipeline_parallel_size must divide train.world_size (rank "
        "order tp-cp-ep-dp-pp). 1 = off. Dense models (padded or packed layout) with tensor and pipeline parallel "
        "size 1 only yet (the rest is refused).",
    )

    def replica_of(self, rank: int, world_size: int) -> int:
        """The data-parallel replica trainer ``rank`` belongs to (its rows), in Megatron's rank order tp-cp-ep-dp-pp:
        ``rank = t + TP * (c + CP * (d + DP * p))`` for tensor-parallel rank t, context-parallel rank c, replica d of
        DP = world_size / (TP x CP x PP) and pipeline stage p, so a replica's tensor- and context-parallel ranks are
        consecutive (all of them get the replica's rows) and its stages world_size / PP apart.

        Raises: ValueError when TP x CP x PP does not divide ``world_size``.
        """
        splits = self.tensor_parallel_size * self.context_parallel_size  # ranks sharing one replica's stage
        replica_size = splits * self.pipeline_parallel_size
        if world_size % replica_size:
            raise ValueError(
                f"train.world_size {world_size} is not a multiple of train.megatron.tensor_parallel_size x "
                f"context_parallel_size x pipeline_parallel_size ({replica_size})"
            )
        return (rank // splits) % (world_size // replica_size)


BACKEND_NAMES = {"fsdp2": "FSDP2", "megatron": "Megatron"}  # train.backend -> how logs name it


def backend_class(train: TrainConfig) -> type:
    """The ``TrainBackend`` class ``train.backend`` names (Megatron's imported only when chosen: an extra)."""
    if train.backend == "megatron":
        from miles.train.megatron import MegatronBackend

        return MegatronBackend
    from miles.train.fsdp2.backend import FSDP2Backend

    return FSDP2Backend


class TrainConfig(BaseModel):
    """Backend, optimizer, precision and micro-batching of the trainer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(
        3e-5, gt=0.0, description="AdamW peak learning rate. 3e-5 shows a GRPO rise in 10 steps on SmolLM2-135M."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup over this many optimizer steps; 0 = none.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.99, ge=0.0, lt=1.0, description="AdamW beta2 (0.99 is common for RL fine-tuning).")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, gt=0.0, description="Clip the global gradient L2 norm to this value.")
    micro_batch_size: int = Field(
        8,
        ge=1,
        description="Sequences per forward/backward; gradients accumulate to the global batch, and the "
        "result does not depend on this split (loss denominators are global).",
    )
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "fp32",
        description="Compute dtype. fp32: everything fp32. bf16: bf16 params in forward/backward with fp32 master "
        "weights, fp32 gradient reduction and optimizer (pure bf16 rounds away updates of ~1e-5); use it on GPUs, "
        "or CPUs with AVX512-BF16/AMX (on AVX2-only CPUs bf16 matmuls measured ~70x slower). fp16: the same with "
        "fp16 params and dynamic loss scaling (train.fp16_initial_loss_scale; an overflowing step is skipped and "
        "the scale halved; metric loss_scale), for GPUs without bf16 (V100, T4). auto: bf16 where the machine "
        "starting the run has fast bf16, fp32 elsewhere (decided at run start, the reason logged).",
    )
    fp16_initial_loss_scale: float = Field(
        2.0**16,
        ge=1.0,
        allow_inf_nan=False,
        description="train.dtype fp16: the first loss scale (torch.amp.GradScaler's default 65536); it halves on "
        "each overflowing (skipped) step and doubles after 2000 steps without one. Ignored for other dtypes.",
    )
    freeze_vision_tower: bool = Field(
        False,
        description="Vision-language policies: keep the vision tower (and its patch merger / projector) fixed, "
        "training the language model only; its weights are still pushed to the engines. Ignored for text models.",
    )
    batch_layout: Literal["padded", "packed"] = Field(
        "padded",
        description="Layout of the trainer's forward passes. padded: right-padded rows [B, L]. packed: the rows' "
        "tokens concatenated without padding (varlen, cu_seqlens), positions restarting per sequence, attention "
        "kept within each sequence; equal results, less compute when lengths vary.",
    )
    world_size: int = Field(
        1,
        ge=1,
        description="Data-parallel ranks (FSDP2 shards). 1 trains in this process (execution.mode local); >1 needs "
        "execution.mode ray: one Ray actor per rank, each on a CPU bundle of execution.ray.trainer_cpus_per_rank, "
        "joined over gloo (ranks on GPU bundles are not wired into miles train yet).",
    )
    backend: Literal["fsdp2", "megatron"] = Field(
        "fsdp2",
        description="fsdp2: the HF model sharded with FSDP2 (every feature). megatron: the model converted into a "
        "Megatron-core GPTModel (Llama/Mistral/Qwen2/Qwen3 dense decoders, Qwen3-MoE and DeepSeek-V3 with routing "
        "replay; tensor, pipeline, expert and context parallelism from train.megatron; fp32; LoRA on dense models, "
        "without dropout; no critic yet); needs the "
        "miles-train[megatron] extra.",
    )
    megatron: MegatronConfig = Field(
        default_factory=MegatronConfig, description="Parallel layout of train.backend megatron."
    )
    lora: Annotated[LoraConfig | None, ON_OFF] = Field(
        None,
        description="LoRA adapters (peft) on the policy: the optimizer holds only the adapters, checkpoints hold the "
        "adapters (and the merged model for export), the KL reference is the policy with its adapters disabled, "
        "and each weight push sends the merged weights (W + scale * B A; the untouched ones exactly as loaded). "
        "null (the default) = full fine-tuning; --train.lora on (or any --train.lora.KEY) turns it on.",
    )
    qat: Literal["none", LossyCodecName] = Field(
        "none",
        description="Quantization-aware training for a quantized rollout (engine.weight_codec, the same codec): the "
        "policy's linear layers compute with the codec's round trip of their weights (what the engine holds) and "
        "pass gradients straight through to the full-precision master weights, so the trainer's log-probs equal the "
        "engine's. Norms, embeddings, the LM head, biases and routers stay exact, as on the wire. Without LoRA; "
        "fsdp2: models whose quantized weights are all nn.Linear (dense models: fused MoE experts are refused); "
        "megatron: int4 or mxfp8 (blocks along a row, so Megatron's fused and split layouts quantize as the engine "
        "does), MoE experts included. none = train on the unquantized weights.",
    )
    skip_nonfinite_steps: bool = Field(
        True,
        description="true: skip (and count, as skipped_steps) an optimizer step whose loss or grad norm is NaN/inf; "
        "false: stop the run with a diagnosis instead. A non-finite step is never applied.",
    )
