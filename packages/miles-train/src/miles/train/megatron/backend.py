"""Megatron-core training backend: an HF causal LM converted into Megatron's ``GPTModel``, tensor-parallel over the
ranks of the current process group, with the same ``TrainBackend`` contract and the same shared objective as FSDP2.

Rank layout: ``world = tensor_parallel_size * context_parallel_size * data_parallel_size * pipeline_parallel_size``;
Megatron's ``parallel_state`` groups the ranks (order tp-cp-ep-dp-pp: the tensor- and context-parallel ranks of one
replica are consecutive, its pipeline stages outermost). Every rank of a replica runs the same rows; data-parallel
replicas get their own rows and Megatron's ``DistributedDataParallel`` sums their gradients; with
``expert_parallel_size`` > 1 the replicas split each MoE layer's experts.
MoE models (Qwen3-MoE, DeepSeek-V3 / Kimi K2) replay the engine's routing (R3) when the batch carries it: each
router's top-k is the recorded experts where a token has them, with gating weights from the live logits
(``RecordedTopK``). LoRA sits on Megatron's fused linears (``miles.train.megatron.lora``; dense models, no dropout).
With ``pipeline_parallel_size`` > 1 each replica's ranks form stages holding consecutive layers (with expert
parallelism each stage's experts split over the replicas; MoE stages replay the routing of their own layers, LoRA
stages hold their layers' adapters), run by
Megatron's 1F1B pipeline schedule: activations pass from stage to stage and gradients back, the last stage computes
the log-probs and the loss.
With ``context_parallel_size`` > 1 the context-parallel ranks of a replica split each sequence (Megatron's
load-balanced chunks) and attend over each other's keys and values: ``miles.train.megatron.context_parallel``, the
CPU stand-in for Transformer Engine's context parallelism (dense models, padded or packed, no tensor or pipeline
parallelism yet); ``forward`` and the loss see the whole [B, T] log-probs, gathered.
Vision-language models: Qwen2-VL (``miles.train.megatron.vision``): the language model is the ``GPTModel`` with
multimodal RoPE, the HF vision tower and merger its replicated submodule ``visual``, image features scattered into
the placeholders and fed as ``decoder_input``; tensor- and data-parallel, padded or packed (the rest refused).
LoRA on MoE models, a critic and other vision-language families are not wired in yet.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import warnings
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from miles.core.algorithms.objective import (
    LossCounts,
    PolicyLossAccumulator,
    PolicyObjective,
    accumulate_policy_loss,
    reduce_policy_metrics,
)
from miles.core.batch import TrainBatch, split_micro_batches
from miles.core.log_probs import model_response_log_probs, packed_model_response_log_probs
from miles.core.routing_replay import NOT_RECORDED, token_routing
from miles.train.config import TrainConfig
from miles.train.fsdp2.backend import WeightSink, all_reduce_metrics, drain_weights, ensure_process_group
from miles.train.fsdp2.optimizer import guarded_step, warmup_schedule
from miles.train.fsdp2.state import write_model_dir
from miles.train.megatron import context_parallel as megatron_cp
from miles.train.megatron import convert
from miles.train.megatron import lora as megatron_lora
from miles.train.megatron import qat as megatron_qat
from miles.train.megatron import vision as megatron_vision
from miles.train.megatron.cpu import (
    apply_if_no_gpu,
    local_mla_spec,
    pipeline_embedding_sync_skipped,
    tag_mla_down_projections,
)
from torch import Tensor

logger = logging.getLogger(__name__)

# Megatron announces at import that it falls back to torch norms and local multi-tensor kernels without Apex /
# Transformer Engine (always, on a CPU), and that a config default is deprecated: nothing a user can act on.
for _message in (r".*(Apex|Transformer Engine).* not installed", r"full scope is deprecated"):
    warnings.filterwarnings("ignore", message=_message, module=r"megatron\.")

BLOCK_DIAGONAL_MASK = "miles_block_diagonal_mask"  # what CausalLMView attends with (see its docstring)


def init_parallel_state(
    tensor_parallel: int, expert_parallel: int = 1, pipeline_parallel: int = 1, context_parallel: int = 1
) -> None:
    """Megatron's ``parallel_state`` over the current process group with ``tensor_parallel`` x ``context_parallel``
    x ``pipeline_parallel`` ranks per replica (Megatron's default rank order tp-cp-ep-dp-pp: a replica's tensor- and
    context-parallel ranks consecutive, its stages world / pipeline_parallel apart, ``MegatronConfig.replica_of``)
    and each MoE layer's experts split over ``expert_parallel`` replicas of a stage (re-initialized when an earlier
    backend in this process used other sizes); seeds Megatron's RNG tracker.

    Raises: ValueError when the world size is not a multiple of the sizes' product.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    if world % (tensor_parallel * context_parallel * pipeline_parallel):
        raise ValueError(
            f"train.megatron.tensor_parallel_size {tensor_parallel} x context_parallel_size {context_parallel} x "
            f"pipeline_parallel_size {pipeline_parallel} must divide the trainer's world size {world} "
            "(train.world_size); set --train.world-size to a multiple of their product, or smaller sizes"
        )
    if world % (tensor_parallel * expert_parallel * pipeline_parallel):
        raise ValueError(
            f"train.megatron.tensor_parallel_size {tensor_parallel} x expert_parallel_size {expert_parallel} x "
            f"pipeline_parallel_size {pipeline_parallel} must divide the trainer's world size {world} "
            "(train.world_size): world = tensor_parallel_size x pipeline_parallel_size x data-parallel replicas, and "
            "the replicas hold the experts split expert_parallel_size ways"
        )
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        ) == (tensor_parallel, expert_parallel, pipeline_parallel, context_parallel):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        expert_model_parallel_size=expert_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
        order="tp-cp-ep-dp-pp",  # pp last: the one order Megatron allows for stages and experts over replicas
    )
    rng = torch.get_rng_state()
    model_parallel_cuda_manual_seed(1234)  # dropout is off: the tracker only has to exist; keep the run's RNG
    torch.set_rng_state(rng)


class RecordedTopK:
    """A Megatron router's ``router_replay`` hook (the interface of ``megatron.core.transformer.moe.router_replay.
    RouterReplay.get_replay_topk``) that routes each token to its recorded experts where it has them and lets the
    live top-k decide where its row is -1; the scores of the chosen experts are gathered from the live ones, so the
    router still gets gradients (softmax over the chosen logits = HF's softmax, top-k and renormalization).

    Args:
        target: [T, top_k] int expert ids in the router's token order, -1 rows unrecorded.
    Raises: ValueError at the forward when the router sees another number of tokens.
    """

    def __init__(self, target: Tensor) -> None:
        self.target = target

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        live_scores, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target.to(device=live.device, dtype=live.dtype)
        if target.shape != live.shape:
            raise ValueError(
                f"routing replay: a Megatron router sees {tuple(live.shape)} (tokens, top_k) but the routed experts "
                f"give {tuple(target.shape)}"
            )
        known = (target >= 0).all(dim=-1, keepdim=True)  # [T, 1]
        chosen = torch.where(known, target, live)
        return scores.gather(1, chosen), chosen


def megatron_routers(gpt: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder layer index (0-based, in the whole model: a pipeline stage's layers keep their global numbers) -> the
    ``TopKRouter`` of that MoE layer held here; empty for a dense model (or stage)."""
    return {layer.layer_number - 1: layer.mlp.router for layer in gpt.decoder.layers if hasattr(layer.mlp, "router")}


class CausalLMView:
    """A Megatron ``GPTModel`` called the way ``miles.core.log_probs`` calls an HF causal LM.

    ``view(input_ids=[B, L], attention_mask=[B, L] | None, position_ids=[B, L] | None, logits_to_keep=int | [M])``
    returns an object with ``.logits`` [B, K, V] (V: the HF vocabulary; Megatron's padding rows dropped). Attention
    is causal and, with a 0/1 ``attention_mask``, never reaches padded keys; without one, a new sequence starts at
    each position id 0 (the packed layout) and attends only within itself: an explicit block-diagonal causal mask,
    which Megatron's attention takes on every path (its name is ``BLOCK_DIAGONAL_MASK``). Under sequence parallelism
    the sequence is right-padded to a multiple of the tensor-parallel size, and under expert parallelism to the
    longest of the expert-parallel ranks' (their MoE layers all-gather equal token counts), with tokens nothing
    attends to. Collective over those ranks under expert parallelism (each rank must call it as often). On a
    pipeline stage before the last it raises ``StageOutput`` with the stage's hidden states instead of returning.

    Args:
        model: the ``GPTModel`` (or its DDP wrapper); gpt: the ``GPTModel`` itself.
        vocab_size: the HF vocabulary.
        routed: R3, [T, num_layers, top_k] recorded experts in HF's token order (``token_routing``), replayed by
            every MoE router of the forward; None routes live.
    Raises: ValueError when ``routed`` does not fit the model's MoE layers (shape, expert ids).
    """

    def __init__(
        self, model: torch.nn.Module, vocab_size: int, *, gpt: torch.nn.Module | None = None, routed=None
    ) -> None:
        from megatron.core import parallel_state

        self.model, self.vocab_size = model, vocab_size
        self.gpt = model if gpt is None else gpt
        self.config = SimpleNamespace(_attn_implementation=BLOCK_DIAGONAL_MASK)
        self.sequence_parallel = self.gpt.config.sequence_parallel
        # the ranks an MoE layer all-gathers tokens over: every forward must bring the same number of them
        self.expert_group = None
        if getattr(self.gpt.config, "num_moe_experts", None) and self.gpt.config.expert_model_parallel_size > 1:
            self.expert_group = parallel_state.get_expert_tensor_and_model_parallel_group()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.routers = megatron_routers(self.gpt) if routed is not None else {}
        self.routed = routed
        if routed is not None:
            self._check_routing(routed)

    def _check_routing(self, routed: Tensor) -> None:
        config = self.gpt.config
        if not getattr(config, "num_moe_experts", None):  # (a pipeline stage may hold dense layers only)
            raise ValueError("routing replay: the batch carries routed experts but the model has no MoE router")
        expected = (config.num_layers, config.moe_router_topk)
        if routed.dim() != 3 or tuple(routed.shape[1:]) != expected:
            raise ValueError(
                f"routing replay: routed experts have shape {tuple(routed.shape)}, expected [tokens, num_layers, "
                f"top_k] with (num_layers, top_k) = {expected} from the model's config"
            )
        low, high = int(routed.min()), int(routed.max())
        if low < NOT_RECORDED or high >= config.num_moe_experts:
            raise ValueError(
                f"routing replay: routed expert ids span [{low}, {high}], but the model's routers have "
                f"{config.num_moe_experts} experts (and -1 means unrecorded); was the routing recorded with this model?"
            )

    def _router_targets(self, batch: int, length: int, padded: int) -> dict[int, Tensor]:
        """Each router's [tokens, top_k] target in Megatron's token order: sequence-major ([S, B] flattened), this
        rank's sequence chunk under sequence parallelism, -1 for the padding."""
        routed = self.routed.reshape(batch, length, *self.routed.shape[1:])
        routed = torch.nn.functional.pad(routed, (0, 0, 0, 0, 0, padded - length), value=NOT_RECORDED)
        routed = routed.transpose(0, 1).reshape(padded * batch, *routed.shape[2:])  # [S * B, layers, top_k]
        if self.sequence_parallel:
            chunk = padded // self.tp_size * batch
            routed = routed[self.tp_rank * chunk : (self.tp_rank + 1) * chunk]
        return {layer: routed[:, layer] for layer in self.routers}

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        **_flash_kwargs: Any,
    ) -> SimpleNamespace:
        batch, length = input_ids.shape
        multiple = self.tp_size if self.sequence_parallel else 1
        longest = length
        if self.expert_group is not None:  # expert-parallel ranks hold other replicas' rows: pad to the longest
            longest_t = torch.tensor(length)
            dist.all_reduce(longest_t, op=dist.ReduceOp.MAX, group=self.expert_group)
            longest = int(longest_t)
        padded = -(-longest // multiple) * multiple
        if padded != length:  # tokens past the end: masked as keys, their own sequence when packed
            extra = padded - length
            input_ids = torch.nn.functional.pad(input_ids, (0, extra))
            if attention_mask is not None:
                attention_mask = torch.nn.functional.pad(attention_mask, (0, extra))
            elif position_ids is not None:
                position_ids = torch.cat([position_ids, torch.arange(extra).expand(batch, extra)], dim=1)
        targets = self._router_targets(batch, length, padded) if self.routed is not None else {}
        logits = self._forward(input_ids, attention_mask, position_ids, targets)[:, :length]
        if isinstance(logits_to_keep, Tensor):
            logits = logits[:, logits_to_keep]
        elif logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)

    def _forward(
        self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None, targets: dict
    ) -> Tensor:
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)
        masked = positions[None, :] > positions[:, None]  # [L, L], True = may not attend (Megatron's convention)
        if attention_mask is not None:
            masked = masked[None, None] | ~attention_mask.bool()[:, None, None, :]  # [B, 1, L, L]
        ropes: list[torch.nn.Module] = []
        if position_ids is None:
            position_ids = positions[None, :].expand(batch, length)
        elif attention_mask is None:
            sequence = (position_ids == 0).cumsum(dim=-1)  # [B, L], which packed sequence each token is in
            masked = masked[None, None] | (sequence[:, None, :, None] != sequence[:, None, None, :])
            ropes = _rotary_tables(self.gpt)
        if masked.dim() == 2:
            masked = masked[None, None]
        for layer, target in targets.items():
            self.routers[layer].router_replay = RecordedTopK(target)
        for rope in ropes:  # each packed sequence rotated from its own position 0, as the engine rotates it
            rope.forward = _rope_at(rope, position_ids)
        try:
            out = self.model(input_ids, position_ids, masked)
            if not getattr(self.gpt, "post_process", True):  # a pipeline stage before the last: hidden states
                raise StageOutput(out)
            return out[..., : self.vocab_size]  # [B, L, V]
        finally:
            for router in self.routers.values():
                router.router_replay = None
            for rope in ropes:
                del rope.forward  # the class's forward again


class StageOutput(Exception):  # noqa: N818 (control flow, not an error)
    """What ``CausalLMView`` raises on a pipeline stage before the last, after its layers ran: the stage's output
    hidden states ``hidden`` ([S, B, H], S this rank's sequence chunk under sequence parallelism), which the next
    stage takes as input. Raising lets the log-prob functions build the stage's call exactly as on the last stage."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__("pipeline stage output")
        self.hidden = hidden


def _rotary_tables(gpt: torch.nn.Module) -> list[torch.nn.Module]:
    """The rotary embeddings a ``GPTModel`` computes its RoPE angles with: the model's one, or (MLA, whose attention
    rotates only part of each head and builds its own table) each layer's attention's."""
    if getattr(gpt, "rotary_pos_emb", None) is not None:
        return [gpt.rotary_pos_emb]
    return [m.rotary_pos_emb for m in (layer.self_attention for layer in gpt.decoder.layers)
            if getattr(m, "rotary_pos_emb", None) is not None]  # fmt: skip


def _rope_at(rope: torch.nn.Module, position_ids: Tensor):
    """A ``RotaryEmbedding.forward`` returning the rotary table at ``position_ids`` ([1, N]: one packed row) rather
    than at 0..N-1, which ``GPTModel`` asks for: RoPE is relative, so both give the same attention in exact
    arithmetic, but the angles of a late packed sequence would be computed (and rounded) at large positions."""
    table_forward = type(rope).forward

    def forward(max_seq_len: int, *args, **kwargs):
        table = table_forward(rope, int(position_ids.max()) + 1, *args, **kwargs)  # [P, 1, 1, d]
        if isinstance(table, tuple):  # YaRN's (table, mscale)
            return (table[0][position_ids[0]], *table[1:])
        return table[position_ids[0]]  # [N, 1, 1, d]

    return forward


class MegatronBackend:
    """``TrainBackend`` on Megatron-core: every rank of the current process group constructs one.

    Arguments as ``FSDP2Backend`` (model_path, train, temperature, reference_path, teacher_path,
    teacher_temperature, weight_sink, the models' trust_remote_code); the parallel sizes are ``train.megatron``'s.
    The reference and teacher are frozen ``GPTModel``s with the same tensor-parallel layout.

    With ``train.lora`` the targeted linears get adapters that follow their tensor-parallel split
    (``miles.train.megatron.lora``), the optimizer holds the adapters only, a reference at the policy's path is the
    policy with its adapters off (no second model), pushes are the merged weights or (``train.lora.sync adapter``)
    the adapters under HF names, ``model/`` holds the merged weights and ``adapter/`` the adapters (Megatron names,
    whole) for resume.

    Raises: ValueError (one line naming the setting) for what this backend does not hold yet: a critic, bf16,
        LoRA dropout / MoE models, a model architecture without a conversion, a tensor-parallel size
        that does not divide the heads or the world size, context parallelism outside what it covers
        (``context_parallel.context_parallel_refusal``, ``model_refusal``).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        train: TrainConfig,
        temperature: float,
        reference_path: str | Path | None = None,
        teacher_path: str | Path | None = None,
        teacher_temperature: float = 1.0,
        critic_path: str | Path | None = None,
        critic_lr: float = 1e-5,
        weight_sink: WeightSink | None = None,
        trust_remote_code: bool = False,
        reference_trust_remote_code: bool = False,
        teacher_trust_remote_code: bool = False,
        critic_trust_remote_code: bool = False,
    ) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from transformers import AutoConfig

        lora = train.lora
        for refused, what in (
            (lora is not None and lora.dropout > 0, "train.lora.dropout > 0 (use --train.lora.dropout 0)"),
            (critic_path is not None, "a critic (advantage gae)"),
            (train.dtype == "bf16", "train.dtype bf16"),
            (torch.cuda.is_available(), "CUDA devices (it trains on the CPU; run with CUDA_VISIBLE_DEVICES=)"),
        ):
            if refused:
                raise ValueError(f"train.backend megatron does not support {what} yet; use --train.backend fsdp2")
        ensure_process_group()
        self.cpu_compat = apply_if_no_gpu()
        self.tensor_parallel = train.megatron.tensor_parallel_size
        self.expert_parallel = train.megatron.expert_parallel_size
        self.pipeline_parallel = train.megatron.pipeline_parallel_size
        self.context_parallel = train.megatron.context_parallel_size
        refusal = megatron_cp.context_parallel_refusal(
            context_parallel=self.context_parallel, tensor_parallel=self.tensor_parallel,
            pipeline_parallel=self.pipeline_parallel,
        )  # fmt: skip
        if refusal is not None:
            raise ValueError(refusal)
        init_parallel_state(self.tensor_parallel, self.expert_parallel, self.pipeline_parallel, self.context_parallel)
        self.cp_group = parallel_state.get_context_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        # experts: split over the expert-parallel ranks, each expert's weights over the expert-tensor-parallel ones
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.etp_group = parallel_state.get_expert_tensor_parallel_group()
        self.etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        self.etp_size = parallel_state.get_expert_tensor_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.rank = dist.get_rank()
        self.train_cfg = train
        self.temperature, self.teacher_temperature = temperature, teacher_temperature
        self.model_path = Path(model_path)
        self.weight_sink = weight_sink
        self.trust_remote_code = trust_remote_code
        self.hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        megatron_vision.check_supported(
            self.hf_config, pipeline_parallel=self.pipeline_parallel,
            expert_parallel=self.expert_parallel, lora=lora is not None, qat=train.qat,
        )  # fmt: skip
        if lora is not None and convert.is_moe(self.hf_config):
            raise ValueError(
                "train.backend megatron does not support train.lora on MoE models yet; use --train.backend fsdp2 "
                "or --train.lora off"
            )
        self.gpt = self._build(model_path, trust_remote_code=trust_remote_code)
        if train.freeze_vision_tower and hasattr(self.gpt, "visual"):  # before DDP and the optimizer
            self.gpt.visual.requires_grad_(False)
        if train.qat != "none":  # the policy computes with the engine's quantized weights (not the reference)
            quantized = megatron_qat.apply_megatron_qat(self.gpt, train.qat, tensor_parallel=self.tensor_parallel)
            logger.info("train.qat %s: %d Megatron linear weights fake-quantized", train.qat, len(quantized))
        self.lora_layers: dict[str, megatron_lora.LoraParallelLinear] = {}
        if lora is not None:
            self.lora_layers = megatron_lora.apply_lora(
                self.gpt, target_modules=lora.target_modules, rank=lora.rank, alpha=lora.alpha,
                use_rslora=lora.use_rslora, init_seed=lora.init_seed, tp_rank=self.tp_rank,
                tp_size=self.tensor_parallel, whole_name=self._global_name,
            )  # fmt: skip
        self.model = DistributedDataParallel(
            self.gpt.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            ),
            self.gpt,
        )
        self.optimizer = torch.optim.AdamW(
            [p for p in self.gpt.parameters() if p.requires_grad],  # LoRA: the adapters only
            lr=train.lr,
            betas=(train.adam_beta1, train.adam_beta2),
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
        )
        self.scheduler = warmup_schedule(self.optimizer, warmup_steps=train.warmup_steps)
        # LoRA with the initial policy as reference: the policy with its adapters off, no second model
        self.ref_is_base = (
            lora is not None
            and reference_path is not None
            and Path(reference_path).resolve() == self.model_path.resolve()
        )
        self.ref_model = None
        if reference_path is not None and not self.ref_is_base:
            self.ref_model = self._build(reference_path, frozen=True, trust_remote_code=reference_trust_remote_code)
        self.teacher_model = None
        if teacher_path is not None:
            self.teacher_model = self._build(teacher_path, frozen=True, trust_remote_code=teacher_trust_remote_code)
        self.step = 0
        self.num_skipped_steps = 0
        self._pending_loss = 0.0
        self._grads_final = True

    def _build(self, path: str | Path, *, frozen: bool = False, trust_remote_code: bool = False) -> torch.nn.Module:
        """A ``GPTModel`` holding this rank's shards of the HF model at ``path`` (``trust_remote_code``: its
        ``models.*.trust_remote_code``)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        hf_config = self.hf_config if Path(path) == self.model_path else _hf_config(path, trust_remote_code)
        if (refusal := megatron_cp.model_refusal(hf_config, context_parallel=self.context_parallel)) is not None:
            raise ValueError(f"{path}: {refusal}")
        lm_config = megatron_vision.language_config(hf_config)  # a VLM's language model; a text model's config
        vlm = megatron_vision.is_vision_language(hf_config)
        config = convert.config_class(lm_config)(
            **convert.transformer_config_kwargs(
                lm_config,
                tensor_parallel=self.tensor_parallel,
                expert_parallel=self.expert_parallel,
                pipeline_parallel=self.pipeline_parallel,
                dtype=torch.float32,
            ),
            **({"mrope_section": megatron_vision.mrope_section(hf_config)} if vlm else {}),
        )
        config = convert.pipeline_config(config)
        # local (no Transformer Engine) dense or MoE layers per config.moe_layer_freq
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        if convert.is_mla(hf_config):  # MLA without Transformer Engine
            spec = local_mla_spec(spec, tensor_parallel=self.tensor_parallel)
        if self.context_parallel > 1:  # attention over every CP rank's keys (Transformer Engine's, on the CPU)
            spec = megatron_cp.context_parallel_spec(spec)
        rng = torch.get_rng_state()  # Megatron's init draws are overwritten by the HF weights; keep the run's RNG
        with pipeline_embedding_sync_skipped():
            model = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                pre_process=self.pp_rank == 0,
                post_process=self.pp_rank == self.pipeline_parallel - 1,
                **convert.gpt_model_kwargs(lm_config, tensor_parallel=self.tensor_parallel)
                | ({"position_embedding_type": "mrope"} if vlm else {}),
            )
            megatron_vision.attach_vision_tower(model, hf_config)  # a VLM's HF tower as model.visual
        torch.set_rng_state(rng)
        if convert.is_mla(hf_config):
            tag_mla_down_projections(model)
        model.hf_vocab_size = lm_config.vocab_size
        self._load_hf(model, _hf_state(path, trust_remote_code), hf_config)
        if frozen:
            model.eval().requires_grad_(False)
        return model

    def _load_hf(self, model: torch.nn.Module, hf_state: dict[str, Tensor], hf_config: Any) -> None:
        """Copy this rank's shards of an HF state dict into ``model`` (its experts: the ones its expert-parallel
        rank holds). Raises: ValueError naming missing or unexpected tensors."""
        full = megatron_vision.hf_to_megatron(hf_state, hf_config, tensor_parallel=self.tensor_parallel)
        # LoRA: the base weights sit under base_layer; the adapters are not in an HF checkpoint
        params = {name.replace(".base_layer.", "."): p for name, p in _weights(model)
                  if not name.endswith((".lora_A", ".lora_B"))}  # fmt: skip
        offset = self.ep_rank * convert.num_experts(hf_config) // self.expert_parallel
        wanted = {name: convert.global_expert_name(self._global_name(name, model), offset) for name in params}
        missing = sorted(g for g in wanted.values() if g not in full)
        unexpected = sorted(
            n for n in set(full) - set(wanted.values())
            if not convert.is_expert_name(n) and self._stage_holds(n, model)
        )  # fmt: skip
        if missing or unexpected:
            raise ValueError(
                f"train.backend megatron: converted weights do not match the Megatron model: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                rank, world, _ = self._tp_layout(name)
                param.copy_(convert.shard_of(full[wanted[name]], param, rank=rank, world=world))

    def _global_name(self, name: str, model: torch.nn.Module | None = None) -> str:
        """A stage's parameter name as the whole model names it: its decoder layers numbered from the stage's first
        layer's global index, and (tied embeddings) the last stage's copy of the output weight as the embedding it
        mirrors. Unchanged without pipeline parallelism."""
        if self.pipeline_parallel == 1:
            return name
        gpt = self.gpt if model is None else model
        if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
            return "embedding.word_embeddings.weight"
        if name.startswith("decoder.layers."):
            index, rest = name.removeprefix("decoder.layers.").split(".", 1)
            return f"decoder.layers.{int(index) + self._layer_offset(gpt)}.{rest}"
        return name

    def _layer_offset(self, gpt: torch.nn.Module) -> int:
        """Global index of this stage's first decoder layer (stages hold equal runs of layers)."""
        return self.pp_rank * gpt.config.num_layers // self.pipeline_parallel

    def _stage_holds(self, name: str, model: torch.nn.Module) -> bool:
        """Whether this pipeline stage holds the whole model's Megatron tensor ``name``."""
        if self.pipeline_parallel == 1:
            return True
        if name.startswith("decoder.layers."):
            first = self._layer_offset(model)
            return first <= int(name.split(".")[2]) < first + model.config.num_layers // self.pipeline_parallel
        if name.startswith("embedding."):
            return model.pre_process
        return model.post_process  # the final norm and output layer

    def _tied_copy(self, name: str) -> bool:
        """The last stage's copy of a tied embedding (kept equal by Megatron's embedding-group gradient sum): the
        first stage's embedding is the one exported, checkpointed and counted in the gradient norm."""
        return self.pipeline_parallel > 1 and name == "output_layer.weight" and not self.gpt.pre_process and (
            self.gpt.share_embeddings_and_output_weights
        )  # fmt: skip

    def _across_stages(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Every pipeline stage's full tensors (this stage's from ``named``: local names, full tensors) under the
        whole model's names, stage by stage, on every rank: each stage broadcasts its names and tensors over the
        pipeline group, one at a time. Collective over it; without pipeline parallelism ``named`` renamed as is."""
        local = ((self._global_name(n), t) for n, t in named if not self._tied_copy(n))
        if self.pipeline_parallel == 1:
            yield from local
            return
        for stage, src in enumerate(dist.get_process_group_ranks(self.pp_group)):
            mine = stage == self.pp_rank
            while True:
                item = next(local, None) if mine else None
                header = [None if item is None else (item[0], tuple(item[1].shape), item[1].dtype)]
                dist.broadcast_object_list(header, src=src, group=self.pp_group)
                if header[0] is None:
                    break
                name, shape, dtype = header[0]
                tensor = item[1].detach().contiguous() if mine else torch.empty(shape, dtype=dtype)
                dist.broadcast(tensor, src=src, group=self.pp_group)
                yield name, tensor

    def _tp_layout(self, name: str) -> tuple[int, int, Any]:
        """(rank, size, group) of the ranks parameter ``name`` is tensor-parallel over: an expert's over the
        expert-tensor-parallel ranks, every other parameter's over the tensor-parallel ranks."""
        if convert.is_expert_name(name):
            return self.etp_rank, self.etp_size, self.etp_group
        return self.tp_rank, self.tensor_parallel, self.tp_group

    # -- forward -------------------------------------------------------------------------------
    @property
    def available_outputs(self) -> frozenset[str]:
        """The ``forward`` outputs this backend can compute (the models it holds)."""
        held = {"old_log_probs"}
        held |= {"ref_log_probs"} if self.ref_model is not None or self.ref_is_base else set()
        held |= {"teacher_log_probs"} if self.teacher_model is not None else set()
        return frozenset(held)

    def _log_probs(
        self,
        model: torch.nn.Module,
        mb: TrainBatch,
        *,
        with_entropy: bool,
        temperature: float | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """[B, T] log-probs (and entropy) of ``model`` on ``mb``'s responses. With pipeline parallelism this stage's
        part only (called from Megatron's schedule, which passes the activations): ``StageOutput`` is raised on a
        stage before the last."""
        packed = self.train_cfg.batch_layout == "packed"
        log_probs_fn = packed_model_response_log_probs if packed else model_response_log_probs
        gpt = self.gpt if model is self.model else model
        if self.context_parallel > 1:  # this rank's chunks of each sequence, the log-probs gathered back
            return megatron_cp.context_parallel_log_probs(
                model, gpt, mb.tokens, mb.attention_mask, mb.prompt_lengths, vocab_size=gpt.hf_vocab_size,
                num_response_columns=mb.loss_mask.shape[1],
                temperature=self.temperature if temperature is None else temperature,
                with_entropy=with_entropy, packed=packed, group=self.cp_group,
            )  # fmt: skip
        routed = token_routing(mb, packed=packed) if mb.routed_experts is not None and self._replays(gpt) else None

        if hasattr(gpt, "visual"):  # a vision-language model: the rows' images in
            view = megatron_vision.VisionLanguageView(model, self.hf_config, gpt.hf_vocab_size, gpt=gpt)
            return log_probs_fn(
                view,
                mb.tokens,
                mb.attention_mask,
                mb.prompt_lengths,
                num_response_columns=mb.loss_mask.shape[1],
                temperature=self.temperature if temperature is None else temperature,
                with_entropy=with_entropy,
                multimodal=mb.multimodal_inputs,
            )
        return log_probs_fn(
            CausalLMView(model, gpt.hf_vocab_size, gpt=gpt, routed=routed),
            mb.tokens,
            mb.attention_mask,
            mb.prompt_lengths,
            num_response_columns=mb.loss_mask.shape[1],
            temperature=self.temperature if temperature is None else temperature,
            with_entropy=with_entropy,
        )

    def _replays(self, gpt: torch.nn.Module) -> bool:
        """R3: the policy replays the engine's routing, and a reference with the same MoE layout; a teacher (or a
        reference of another architecture) routes itself."""
        if gpt is self.gpt:
            return True
        if gpt is not self.ref_model:
            return False
        shape = lambda m: (m.config.num_layers, m.config.moe_router_topk, tuple(megatron_routers(m)))  # noqa: E731
        return bool(getattr(gpt.config, "num_moe_experts", None)) and shape(gpt) == shape(self.gpt)

    @torch.no_grad()
    def forward(self, batch: TrainBatch, *, outputs: Collection[str]) -> TrainBatch:
        """As ``FSDP2Backend.forward``: the requested outputs ([B, T] float32), nothing else computed.

        Raises: ValueError naming an output this backend cannot compute.
        """
        outputs = set(outputs)
        if outputs - self.available_outputs:
            raise ValueError(
                f"backend.forward: cannot compute {sorted(outputs - self.available_outputs)}; this backend holds "
                f"{sorted(self.available_outputs)} (a reference needs algorithm.kl on, a teacher models.teacher)"
            )
        ref = self.model if self.ref_is_base else self.ref_model  # LoRA: the policy with its adapters off
        models = {"old_log_probs": self.model, "ref_log_probs": ref, "teacher_log_probs": self.teacher_model}
        width = batch.loss_mask.shape[1]
        micro_batches = split_micro_batches(batch, self.train_cfg.micro_batch_size)
        results = {}
        for name in (name for name in models if name in outputs):
            temperature = self.teacher_temperature if name == "teacher_log_probs" else None
            base = name == "ref_log_probs" and self.ref_is_base
            with megatron_lora.adapters_disabled(self.gpt) if base else contextlib.nullcontext():
                if self.pipeline_parallel > 1:
                    parts = self._pipelined_log_probs(models[name], micro_batches, temperature=temperature)
                else:
                    parts = [self._log_probs(models[name], mb, with_entropy=False, temperature=temperature)[0]
                             for mb in micro_batches]  # fmt: skip
            results[name] = torch.cat([torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for lp in parts])
        return batch.replace(**results)

    def _pipelined_log_probs(
        self, model: torch.nn.Module, micro_batches: list[TrainBatch], *, temperature: float | None
    ) -> list[Tensor]:
        """Each micro-batch's [b, t] log-probs under ``model`` through Megatron's pipeline schedule (forward only: a
        stage runs the next micro-batch while later stages work on earlier ones), computed on the last stage and
        broadcast to every stage. Collective over the pipeline group."""
        from megatron.core import parallel_state

        def forward_step(batches: Iterator[TrainBatch], _model: torch.nn.Module):
            mb = next(batches)
            try:
                log_probs, _ = self._log_probs(model, mb, with_entropy=False, temperature=temperature)
            except StageOutput as stage:  # a stage before the last: its activations go on
                return stage.hidden, None
            return log_probs, None  # the last stage: kept by the schedule (no loss function)

        kept = self._run_schedule(forward_step, model, micro_batches, forward_only=True)
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        shapes = [[tuple(t.shape) for t in kept] if parallel_state.is_pipeline_last_stage() else None]
        dist.broadcast_object_list(shapes, src=last, group=self.pp_group)
        results = []
        for i, shape in enumerate(shapes[0]):
            value = kept[i].contiguous() if parallel_state.is_pipeline_last_stage() else torch.empty(shape)
            dist.broadcast(value, src=last, group=self.pp_group)
            results.append(value)
        return results

    # -- training -------------------------------------------------------------------------------
    def forward_backward(self, batch: TrainBatch, objective: PolicyObjective, counts: LossCounts) -> dict[str, float]:
        """As ``FSDP2Backend.forward_backward``: accumulate ``objective``'s gradients over micro-batches of this
        replica's rows (every tensor-parallel rank of a replica gets the same rows), ``counts`` being the global
        batch's. Megatron's DDP sums the replicas' gradients (``finalize_model_grads``, which also all-reduces the
        gradients of parameters replicated over tensor-parallel ranks where Megatron needs it).

        Returns: global metrics, reduced over the data-parallel replicas.
        Raises: ValueError when ``counts`` are this replica's rather than the global batch's.
        """

        def backward(loss: Tensor, i: int, num_micro_batches: int) -> None:
            # DDP averages over replicas (and context-parallel ranks, whose gathered log-probs' backward sums CP
            # copies: context_parallel); the loss already divides by global counts
            (loss * self.dp_size).backward()

        if self.pipeline_parallel > 1:
            sums = self._pipelined_forward_backward(objective, batch, counts)
        else:
            sums = accumulate_policy_loss(
                objective,
                batch,
                counts,
                world_size=self.dp_size,
                micro_batch_size=self.train_cfg.micro_batch_size,
                log_probs_fn=lambda mb: self._log_probs(self.model, mb, with_entropy=True),
                backward=backward,
            )
        self._grads_final = False  # finalized once before they are read: it sums some over ranks, not idempotent
        dp_reduce = functools.partial(all_reduce_metrics, group=self.dp_group)  # each replica's metrics once
        metrics = reduce_policy_metrics(objective, sums, counts, all_reduce=dp_reduce)
        self._pending_loss = metrics["loss"]
        return metrics

    def _run_schedule(
        self, forward_step: Any, model: torch.nn.Module, micro_batches: list[TrainBatch], *, forward_only: bool
    ) -> list[Any]:
        """Megatron's pipeline schedule (1F1B) over ``micro_batches`` with ``forward_step(iterator, model)``; returns
        what the schedule kept on the last stage (an empty list elsewhere). Collective over the pipeline group."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.tokens.shape[1] for mb in micro_batches),  # shapes travel with the tensors
            micro_batch_size=self.train_cfg.micro_batch_size,
            forward_only=forward_only,
        )

    def _pipelined_forward_backward(
        self, objective: PolicyObjective, batch: TrainBatch, counts: LossCounts
    ) -> dict[str, Tensor]:
        """``forward_backward``'s micro-batches through Megatron's 1F1B pipeline schedule
        (``forward_backward_pipelining_without_interleaving``): a stage runs the next micro-batch's forward while
        later stages still work on earlier ones, and backwards interleave with forwards once the pipeline is full.
        The last stage computes each micro-batch's loss (divided by the global counts; DDP sums the replicas'
        gradients under ``calculate_per_token_loss``, where it averages them without a pipeline) and hands it to the
        schedule, which back-propagates it; activations and their gradients pass between stages point to
        point, with their shapes (micro-batches differ in length). Returns: ``accumulate_policy_loss``'s sums,
        the last stage's, on every stage. Collective over the pipeline group."""
        from megatron.core import parallel_state

        accumulator = PolicyLossAccumulator(
            objective, batch, counts, world_size=self.dp_size, micro_batch_size=self.train_cfg.micro_batch_size
        )

        def forward_step(micro_batches: Iterator[TrainBatch], model: torch.nn.Module):
            mb = next(micro_batches)
            try:
                log_probs, entropy = self._log_probs(model, mb, with_entropy=True)
            except StageOutput as stage:  # a stage before the last: its activations go on
                return stage.hidden, None
            # not times dp_size: with calculate_per_token_loss (pipeline_config) DDP sums the replicas' gradients
            loss = accumulator.loss(mb, log_probs, entropy)
            return loss, lambda out: (out, torch.ones((), dtype=torch.int), {})  # per-token: nothing divided

        if accumulator.micro_batches:
            self._run_schedule(forward_step, self.model, accumulator.micro_batches, forward_only=False)
        sums = [accumulator.sums]  # the last stage's metrics, to every stage
        dist.broadcast_object_list(
            sums, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=self.pp_group
        )
        return sums[0]

    def _finalize_grads(self) -> None:
        """Megatron's ``finalize_model_grads`` once per accumulation: the replicas' gradient sum (DDP), and the sum
        over tensor-parallel ranks of the gradients of parameters each holds whole but sees part of the tokens of
        (norms and routers under sequence parallelism, q/k norms). Collective."""
        from megatron.core.distributed import finalize_model_grads

        if not self._grads_final:
            finalize_model_grads([self.model])
            self._grads_final = True

    def _clip_grads(self, max_norm: float) -> Tensor:
        """Global L2 norm of the gradients (each tensor-parallel shard once, replicated parameters once), then scale
        them to at most ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` does (a tied embedding once, on the first
        pipeline stage). Collective over the tensor- and pipeline-parallel ranks."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        named = [(n, p) for n, p in self.gpt.named_parameters() if p.grad is not None]
        grads = [p.grad for _, p in named]  # every one scaled, the tied copy too (it must stay equal to the embedding)
        named = [(n, p) for n, p in named if not self._tied_copy(n)]  # counted once in the norm
        # dense: each tensor-parallel shard once (replicated parameters on TP rank 0), summed over the TP ranks;
        # experts: every rank's own (split over expert-parallel and expert-tensor-parallel ranks), summed over both
        dense = torch.zeros((), dtype=torch.float32)
        experts = torch.zeros((), dtype=torch.float32)
        for name, p in named:
            if convert.is_expert_name(name):
                if getattr(p, "tensor_model_parallel", False) or self.etp_rank == 0:
                    experts = experts + p.grad.float().pow(2).sum()
            elif param_is_not_tensor_parallel_duplicate(p):
                dense = dense + p.grad.float().pow(2).sum()
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())  # tensor- and pipeline-parallel
        dist.all_reduce(experts, group=parallel_state.get_expert_tensor_and_model_parallel_group())
        if self.pipeline_parallel > 1:  # each stage's experts
            dist.all_reduce(experts, group=self.pp_group)
        norm = (dense + experts).sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(coef)
        return norm

    def optimizer_step(self, *, loss: float | None = None) -> dict[str, float]:
        """As ``FSDP2Backend.optimizer_step``: clip (tensor-parallel-aware norm), step AdamW and the LR schedule,
        zero the gradient buffers; skip the step on NaN/inf (config). Returns grad_norm, lr, skipped_steps."""
        self._finalize_grads()
        for param in self.gpt.parameters():
            param.grad = param.main_grad if getattr(param, "main_grad", None) is not None else param.grad
        grad_norm, applied = guarded_step(
            self.gpt,
            self.optimizer,
            self.scheduler,
            loss=self._pending_loss if loss is None else loss,
            grad_clip=self.train_cfg.grad_clip,
            skip_nonfinite=self.train_cfg.skip_nonfinite_steps,
            step=self.step,
            what="policy",
            lr_key="train.lr",
            clip_grads=self._clip_grads,
        )
        self.model.zero_grad_buffer()
        self._grads_final = True  # zero: nothing to sum
        self._pending_loss = 0.0
        self.num_skipped_steps += not applied
        self.step += 1
        return {
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "skipped_steps": float(self.num_skipped_steps),
        }

    def full_gradients(self) -> dict[str, Tensor]:
        """Full gradients by HF name (collective over the TP group; for tests and diagnostics), read from the
        gradient buffers after ``forward_backward``."""
        self._finalize_grads()
        if self.lora_layers:  # the adapters' gradients, Megatron names (they have no HF names)
            grads = ((name, p.main_grad) for name, p in self.gpt.named_parameters() if p.requires_grad)
            return {name: t.clone() for name, t in self._across_stages(self._gathered(grads))}
        held = ((name, p.main_grad) for name, p in self.gpt.named_parameters() if p.requires_grad)  # not frozen ones
        grads = self._across_stages(self._gathered(held))
        return {name: t.clone() for name, t in megatron_vision.megatron_to_hf(grads, self.hf_config)}

    # -- weights and checkpoints ----------------------------------------------------------------
    def _gathered(
        self, named: Iterable[tuple[str, Tensor]], layouts: dict[str, Tensor] | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """Full tensors from this rank's shards, one at a time: an all-gather over the (expert-)tensor-parallel ranks
        per split tensor, and for an expert's weight under expert parallelism one over the expert-parallel ranks,
        yielding every rank's expert under its global index (Megatron names). ``layouts``: the parameter whose
        split a name's shard has, where the name is not a parameter's (LoRA's merged weights)."""
        params = dict(_weights(self.gpt)) | (layouts or {})
        local_experts = convert.num_experts(self.hf_config) // self.expert_parallel
        for name, shard in named:
            param, shard = params[name], shard.detach()
            _, world, group = self._tp_layout(name)
            if world > 1 and getattr(param, "tensor_model_parallel", False):
                shards = [torch.empty_like(shard) for _ in range(world)]
                dist.all_gather(shards, shard.contiguous(), group=group)
                shard = convert.full_from_shards(shards, param)
            if self.expert_parallel == 1 or not convert.is_expert_name(name):
                yield name, shard
                continue
            experts = [torch.empty_like(shard) for _ in range(self.expert_parallel)]
            dist.all_gather(experts, shard.contiguous(), group=self.ep_group)
            for ep_rank, expert in enumerate(experts):
                yield convert.global_expert_name(name, ep_rank * local_experts), expert

    def export_weights(self) -> Iterable[tuple[str, Tensor]]:
        """(HF name, fp32 tensor) pairs of the full model, produced one Megatron tensor at a time (gathered over the
        tensor-parallel ranks; the fused q/k/v and gate/up split back into HF's tensors; the vocabulary padding
        dropped). A tied embedding is sent once, as ``model.embed_tokens.weight``.

        Collective with tensor parallelism: every rank must read the whole stream, in order (``drain_weights``).
        """
        if self.lora_layers and self.train_cfg.lora.sync == "adapter":
            stream = self._hf_adapters()
        elif self.lora_layers:
            stream = self._merged_hf()
        else:
            stream = megatron_vision.megatron_to_hf(
                self._across_stages(self._gathered(_weights(self.gpt))), self.hf_config
            )
        if self.tensor_parallel == self.pipeline_parallel == 1 and not (
            self.lora_layers and self.train_cfg.lora.sync == "merged"
        ):
            return list(stream)  # views of the live parameters (or small adapters): a sender may resend it
        return stream  # merged LoRA weights are new tensors: one at a time, never the whole model at once

    def _merged_hf(self) -> Iterator[tuple[str, Tensor]]:
        """LoRA's merged weights under HF names: W + scaling * B A merged on each rank's shard, then gathered and
        converted as plain weights are. Collective over the tensor-parallel ranks."""
        layouts = {name.replace(".base_layer.", "."): p for name, p in self.gpt.named_parameters()}
        merged = megatron_lora.merged_parameters(self.gpt)
        return convert.megatron_to_hf(self._across_stages(self._gathered(merged, layouts)), self.hf_config)

    def _hf_adapters(self) -> Iterator[tuple[str, Tensor]]:
        """The adapters as HF-named LoRA tensors for an engine that applies them (``train.lora.sync adapter``):
        a fused layer's adapter becomes one per HF projection, sharing A, with B (times the scaling, so the engine
        applies scaling 1) split by rows as the fused weight is (q/k/v per query group, gate/up): the same function.
        Collective over the tensor- and pipeline-parallel ranks, one layer at a time."""

        def stage_adapters() -> Iterator[tuple[str, Tensor]]:  # this stage's, whole: A, then B times the scaling
            for module, layer in self.lora_layers.items():
                named = [(f"{module}.lora_A", layer.lora_A), (f"{module}.lora_B", layer.lora_B)]
                (_, a), (_, b) = list(self._gathered(named))
                yield f"{module}.lora_A", a.detach()
                yield f"{module}.lora_B", b.detach().float() * layer.scaling

        adapters = self._across_stages(stage_adapters())  # every stage's, under whole-model names
        for (name, a), (_, b) in zip(adapters, adapters, strict=False):  # (A, B) pairs
            module = name.removesuffix(".lora_A")
            for hf_name, part in convert.megatron_to_hf([(f"{module}.weight", b)], self.hf_config):
                prefix = hf_name.removesuffix(".weight")
                yield f"{prefix}.lora_A.default.weight", a.detach().clone()  # one copy per projection
                yield f"{prefix}.lora_B.default.weight", part.contiguous()

    def full_state_dict(self) -> dict[str, Tensor]:
        """Full fp32 weights by HF name (with LoRA: merged), copies (collective over the TP group)."""
        stream = self._merged_hf() if self.lora_layers else self.export_weights()
        return {name: tensor.clone() for name, tensor in stream}

    def push_weights(self, version: int) -> None:
        """As ``FSDP2Backend.push_weights``: every rank gathers, the ranks given a ``weight_sink`` send.

        Raises: RuntimeError if a single-rank backend has no sink; what the sink raises on a failed update.
        """
        if self.weight_sink is None and dist.get_world_size() == 1:
            raise RuntimeError("push_weights: this backend has no weight_sink; pass weight_sink=WeightSender(...)")
        named = self.export_weights()
        try:
            if self.weight_sink is not None:
                self.weight_sink.push(named, version=version)
        finally:
            drain_weights(named)

    def save(self, path: Path) -> None:
        """Write ``model/`` (HF directory: config, safetensors; rank 0), ``optimizer/tp{T}_ep{E}.pt`` (with pipeline
        parallelism ``tp{T}_pp{P}_ep{E}.pt``; the AdamW and
        LR-schedule state of each tensor- and expert-parallel position, written by the first rank holding it) and
        ``trainer_state.json``.
        Collective; returns once every rank has written.

        Raises: FloatingPointError if any weight is NaN/inf (nothing is written).
        """
        from megatron.core import parallel_state

        weights = self.full_state_dict()
        adapters = self._full_adapters()  # collective
        nonfinite = [name for name, tensor in weights.items() if not torch.isfinite(tensor).all()]
        if nonfinite:
            raise FloatingPointError(
                f"refusing to save a checkpoint: policy weights {nonfinite[:3]} hold NaN/inf. The previous "
                "checkpoint is intact; resume from it with a lower --train.lr."
            )
        path = Path(path)
        failure = None
        try:  # every rank reaches the agreement below, so a rank whose write failed never leaves the others waiting
            if self.rank == 0:
                self._write_model_dir(weights, path)
                if adapters:
                    self._write_adapters(adapters, path / "adapter")
            if parallel_state.get_expert_data_parallel_rank() == 0:  # the first copy of its dense and expert states
                (path / "optimizer").mkdir(parents=True, exist_ok=True)
                torch.save(
                    {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                    path / "optimizer" / self._optimizer_file,
                )
        except Exception as err:  # re-raised below, after the ranks agreed
            failure = err
        failed = torch.tensor(float(failure is not None))
        if dist.get_world_size() > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if failed.item():
            raise RuntimeError(f"saving {path}: another trainer rank failed to write its part (see its error)")

    def _write_model_dir(self, weights: dict[str, Tensor], path: Path) -> None:
        write_model_dir(weights, self.hf_config, self.model_path, path / "model")
        state = {
            "step": self.step,
            "skipped_steps": self.num_skipped_steps,
            "tensor_parallel_size": self.tensor_parallel,
            "expert_parallel_size": self.expert_parallel,
            "pipeline_parallel_size": self.pipeline_parallel,
        }
        (path / "trainer_state.json").write_text(json.dumps(state, indent=2))

    def _full_adapters(self) -> dict[str, Tensor]:
        """The adapters whole (Megatron names; collective over the tensor-parallel ranks); {} without LoRA."""
        named = ((name, p) for name, p in self.gpt.named_parameters() if p.requires_grad and self.lora_layers)
        return {name: tensor.clone() for name, tensor in self._across_stages(self._gathered(named))}

    def _write_adapters(self, adapters: dict[str, Tensor], path: Path) -> None:
        from safetensors.torch import save_file

        lora = self.train_cfg.lora
        path.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for n, t in adapters.items()}, str(path / ADAPTER_FILE))
        settings = {key: getattr(lora, key) for key in LORA_SETTINGS}
        (path / "lora.json").write_text(json.dumps(settings, indent=2))

    def _load_adapters(self, path: Path) -> None:
        """The adapters of ``save``'s ``adapter/`` into this rank's shards. Raises: ValueError (one line) for a
        checkpoint without them or written with other LoRA settings."""
        from safetensors.torch import load_file

        if not (path / ADAPTER_FILE).is_file() or not (path / "lora.json").is_file():
            raise ValueError(
                f"{path.parent} has no adapter/ but this run trains LoRA adapters (train.lora); resume from a "
                "checkpoint of a LoRA run, or turn train.lora off"
            )
        saved = json.loads((path / "lora.json").read_text())
        for key in LORA_SETTINGS:
            same = sorted if key == "target_modules" else (lambda value: value)
            if same(saved.get(key) or []) != same(getattr(self.train_cfg.lora, key) or []):
                raise ValueError(
                    f"{path.parent} was written with train.lora.{key} {saved.get(key)!r}, this run has "
                    f"{getattr(self.train_cfg.lora, key)!r}; resume with the checkpoint's value"
                )
        full = load_file(str(path / ADAPTER_FILE))
        with torch.no_grad():
            for name, param in self.gpt.named_parameters():
                if param.requires_grad:
                    whole = full[self._global_name(name)]
                    param.copy_(convert.shard_of(whole, param, rank=self.tp_rank, world=self.tensor_parallel))

    @property
    def _optimizer_file(self) -> str:
        stage = f"_pp{self.pp_rank}" if self.pipeline_parallel > 1 else ""
        return f"tp{self.tp_rank}{stage}_ep{self.ep_rank}.pt"

    def load(self, path: Path) -> None:
        """Restore weights, optimizer, schedule and step from ``save``'s layout.

        Raises: ValueError when the checkpoint was written with another tensor- or expert-parallel size (its
            optimizer shards do not fit); FileNotFoundError for a checkpoint without ``optimizer/`` (e.g. an FSDP2 one).
        """
        path = Path(path)
        trainer_state = json.loads((path / "trainer_state.json").read_text())
        if not (path / "optimizer").is_dir():
            raise FileNotFoundError(
                f"{path} holds no Megatron optimizer state (optimizer/): it was written by another backend; resume "
                "it with the backend that wrote it (train.backend)"
            )
        sizes = (
            ("tensor_parallel_size", self.tensor_parallel),
            ("expert_parallel_size", self.expert_parallel),
            ("pipeline_parallel_size", self.pipeline_parallel),
        )
        for key, size in sizes:
            saved = trainer_state.get(key, 1)
            if saved != size:
                raise ValueError(
                    f"{path} was written with train.megatron.{key} {saved}, this run uses {size}; resume with "
                    f"--train.megatron.{key.replace('_', '-')} {saved}"
                )
        if self.lora_layers:  # the base as the run started it, then the adapters (model/ holds the merged weights)
            self._load_hf(self.gpt, _hf_state(self.model_path, self.trust_remote_code), self.hf_config)
            self._load_adapters(path / "adapter")
        else:
            self._load_hf(self.gpt, _hf_state(path / "model", self.trust_remote_code), self.hf_config)
        state = torch.load(path / "optimizer" / self._optimizer_file, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.num_skipped_steps = trainer_state["step"], trainer_state["skipped_steps"]


ADAPTER_FILE = "megatron_adapters.safetensors"
LORA_SETTINGS = ("rank", "alpha", "use_rslora", "target_modules")  # a resume must match these


def _weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """A Megatron model's parameters and the buffers that hold HF weights (``convert.WEIGHT_BUFFERS``: DeepSeek's
    router score-correction bias), by name."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        if name.endswith(convert.WEIGHT_BUFFERS):
            yield name, buffer


def _hf_config(path: str | Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def _hf_state(path: str | Path, trust_remote_code: bool) -> dict[str, Tensor]:
    """The fp32 state dict of the HF causal LM (or vision-language model) at ``path`` (tied tensors appear under both
    names)."""
    from miles.core.multimodal import load_policy_model

    model = load_policy_model(path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return model.state_dict()
