"""FSDP2 training backend over an HF causal LM: forward passes, forward/backward of a given objective, optimizer
steps, weight pushes and checkpoints. It holds models and optimizers; the RL objective comes from ``miles.core``."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection, Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from miles.core.algorithms.objective import (
    LossCounts,
    PolicyObjective,
    accumulate_policy_loss,
    reduce_policy_metrics,
)
from miles.core.batch import TrainBatch, split_micro_batches
from miles.core.log_probs import model_response_log_probs, packed_model_response_log_probs, warn_if_slow_bf16
from miles.core.precision import torch_dtype
from miles.core.routing_replay import replay_routing, routing_layout, token_routing
from miles.core.varlen_attention import register_varlen_sdpa
from miles.train.config import TrainConfig
from miles.train.fsdp2.lora import (
    adapter_dropout,
    adapter_state,
    adapter_weights,
    adapters_disabled,
    apply_lora,
    load_adapters,
    merge_state,
    merged_weights,
    write_peft_config,
)
from miles.train.fsdp2.optimizer import guarded_step, warmup_schedule
from miles.train.fsdp2.state import (
    full_model_state,
    gather_module_state,
    load_module,
    write_model_dir,
    write_weights,
)
from torch import Tensor

logger = logging.getLogger(__name__)


def ensure_process_group() -> None:
    """Start a single-process gloo group if none exists (world size 1, in-process default)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class WeightSink(Protocol):
    """Where ``push_weights`` sends (a ``miles.sync.WeightSender``)."""

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int: ...


class FSDP2Backend:
    """``TrainBackend`` with FSDP2 data parallelism; every rank of the current process group constructs one.

    Each rank gets its own rows of the global batch and the caller passes the global loss denominators
    (``LossCounts``), so the update equals one big batch on one rank.

    Args:
        model_path: HF model directory.
        train: optimizer/precision/micro-batch/layout section.
        temperature: sampling temperature of the rollouts being trained on (log-probs use logits / T).
        reference_path: HF directory of the frozen reference of the KL terms (``models.reference``; usually
            ``model_path``, the initial policy); None = no reference (``algorithm.kl`` off).
        teacher_path: HF directory of a frozen teacher (on-policy distillation); None = no teacher.
        teacher_temperature: temperature of the teacher's log-probs (``models.teacher.temperature``).
        critic_path: HF directory initializing a critic (PPO/GAE, see ``critic.py``); None = no critic.
        critic_lr: the critic's peak learning rate (``models.critic.lr``).
        weight_sink: where ``push_weights`` sends the full weights (rank 0's sender; None on other ranks, which
            still take part in the gather).
        trust_remote_code, reference_trust_remote_code, teacher_trust_remote_code, critic_trust_remote_code: run
            that model's own code (``auto_map`` in its config.json), as ``models.*.trust_remote_code``.
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
        from miles.core.multimodal import load_policy_model
        from miles.train.fsdp2.parallelize import parallelize
        from torch.distributed.device_mesh import init_device_mesh

        ensure_process_group()
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.train_cfg = train
        self.temperature, self.teacher_temperature = temperature, teacher_temperature
        self.model_path = Path(model_path)
        self.weight_sink = weight_sink
        warn_if_slow_bf16(torch_dtype(train.dtype), logger, where="train.dtype")
        model = load_policy_model(model_path, dtype=torch.float32, trust_remote_code=trust_remote_code)
        model.config.use_cache = False
        _packed_attention(model, train.batch_layout)
        if train.freeze_vision_tower:
            for module in vision_modules(model):
                module.requires_grad_(False)  # before the optimizer, which then never sees its parameters
        if train.lora is not None:
            apply_lora(model, train.lora)
        if train.qat != "none":
            from miles.train.qat import apply_qat

            quantized = apply_qat(model, train.qat)
            logger.info("train.qat %s: %d linear weights fake-quantized in the forward", train.qat, len(quantized))
        mesh = init_device_mesh("cpu", (self.world_size,))
        self.model = parallelize(model, mesh=mesh, param_dtype=torch_dtype(train.dtype))
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # LoRA: the adapters only
            lr=train.lr,
            betas=(train.adam_beta1, train.adam_beta2),
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
        )
        self.scheduler = warmup_schedule(self.optimizer, warmup_steps=train.warmup_steps)
        self.ref_model = None
        # LoRA with the initial policy as reference: the reference is the policy with its adapters off, no 2nd copy
        self.ref_is_base = (
            train.lora is not None
            and reference_path is not None
            and (Path(reference_path).resolve() == self.model_path.resolve())
        )
        if reference_path is not None and not self.ref_is_base:  # frozen, unsharded, no grad; same vocabulary
            self.ref_model = load_policy_model(
                reference_path, dtype=torch_dtype(train.dtype), trust_remote_code=reference_trust_remote_code
            ).eval()
            self.ref_model.requires_grad_(False)
            _packed_attention(self.ref_model, train.batch_layout)
        self.teacher_model = None
        if teacher_path is not None:  # frozen, unsharded, no grad; same vocabulary as the policy
            self.teacher_model = load_policy_model(
                teacher_path, dtype=torch_dtype(train.dtype), trust_remote_code=teacher_trust_remote_code
            ).eval()
            self.teacher_model.requires_grad_(False)
            _packed_attention(self.teacher_model, train.batch_layout)
        self.critic = None
        if critic_path is not None:
            from miles.train.fsdp2.critic import Critic

            self.critic = Critic(
                critic_path,
                mesh=mesh,
                param_dtype=torch_dtype(train.dtype),
                lr=critic_lr,
                micro_batch_size=train.micro_batch_size,
                grad_clip=train.grad_clip,
                warmup_steps=train.warmup_steps,
                skip_nonfinite_steps=train.skip_nonfinite_steps,
                trust_remote_code=critic_trust_remote_code,
            )
        self.step = 0
        self.num_skipped_steps = 0
        self.loss_scaler = None
        if train.dtype == "fp16":  # fp16's narrow range: the loss is scaled, the gradients unscaled before the step
            from miles.train.loss_scale import DynamicLossScaler

            self.loss_scaler = DynamicLossScaler(scale=train.fp16_initial_loss_scale)
        self._pending_loss = 0.0  # global loss of the last forward_backward, checked by optimizer_step's guard
        self._ref_replays: bool | None = None  # whether the reference model replays routing (R3), decided once

    # -- forward -------------------------------------------------------------------------------
    @property
    def available_outputs(self) -> frozenset[str]:
        """The ``forward`` outputs this backend can compute (the models it holds)."""
        held = {"old_log_probs"}
        held |= {"ref_log_probs"} if self.ref_model is not None or self.ref_is_base else set()
        held |= {"teacher_log_probs"} if self.teacher_model is not None else set()
        held |= {"values"} if self.critic is not None else set()
        return frozenset(held)

    def _log_probs(
        self, model: torch.nn.Module, mb: TrainBatch, *, with_entropy: bool, temperature: float | None = None
    ) -> tuple[Tensor, Tensor | None]:
        packed = self.train_cfg.batch_layout == "packed"
        log_probs_fn = packed_model_response_log_probs if packed else model_response_log_probs
        replay = mb.routed_experts is not None and self._replays(model)
        with replay_routing(model, token_routing(mb, packed=packed) if replay else None):
            return log_probs_fn(
                model,
                mb.tokens,
                mb.attention_mask,
                mb.prompt_lengths,
                num_response_columns=mb.loss_mask.shape[1],
                temperature=self.temperature if temperature is None else temperature,
                with_entropy=with_entropy,
                multimodal=mb.multimodal_inputs,
            )

    def _replays(self, model: torch.nn.Module) -> bool:
        """R3: whether ``model``'s forward routes each token to the experts the engine chose: the policy does, and a
        reference model of the same MoE layout; a teacher (another model) and any other model route themselves."""
        if model is self.model:
            return True
        if model is not self.ref_model:
            return False
        if self._ref_replays is None:
            try:
                policy, ref = routing_layout(self.model), routing_layout(self.ref_model)
            except ValueError:  # a router replay does not know: it routes itself
                policy = ref = None
            self._ref_replays = policy is not None and ref is not None and policy.shape == ref.shape
        return self._ref_replays

    @torch.no_grad()
    def forward(self, batch: TrainBatch, *, outputs: Collection[str]) -> TrainBatch:
        """The batch with the requested ``outputs`` set, each [B, T] float32, and nothing else computed.

        Outputs: ``old_log_probs`` (current policy, logits / sampling temperature), ``ref_log_probs`` (frozen
        reference), ``teacher_log_probs`` (teacher, at ``teacher_temperature``), ``values`` (critic).
        Raises: ValueError naming an output this backend cannot compute (see ``available_outputs``).
        """
        outputs = set(outputs)
        if outputs - self.available_outputs:
            raise ValueError(
                f"backend.forward: cannot compute {sorted(outputs - self.available_outputs)}; this backend holds "
                f"{sorted(self.available_outputs)} (a reference needs algorithm.kl on, a teacher models.teacher, "
                "values models.critic)"
            )
        models = {"old_log_probs": self.model, "ref_log_probs": self.ref_model, "teacher_log_probs": self.teacher_model}
        parts: dict[str, list[Tensor]] = {name: [] for name in models if name in outputs}
        width = batch.loss_mask.shape[1]
        if self.ref_is_base:
            models["ref_log_probs"] = self.model
        for mb in split_micro_batches(batch, self.train_cfg.micro_batch_size) if parts else []:
            for name in parts:
                temperature = self.teacher_temperature if name == "teacher_log_probs" else None
                base_only = (
                    adapters_disabled(self.model) if name == "ref_log_probs" and self.ref_is_base else nullcontext()
                )
                with base_only:
                    lp = self._log_probs(models[name], mb, with_entropy=False, temperature=temperature)[0]
                parts[name].append(_pad_cols(lp, width))
        changes = {name: torch.cat(values) for name, values in parts.items()}
        if "values" in outputs:
            changes["values"] = self.critic.compute_values(batch)
        return batch.replace(**changes)

    # -- training -------------------------------------------------------------------------------
    def forward_backward(self, batch: TrainBatch, objective: PolicyObjective, counts: LossCounts) -> dict[str, float]:
        """Accumulate the gradients of ``objective`` over micro-batches of this rank's rows (no optimizer step).

        ``counts`` are the denominators of the whole global batch (every rank's rows), so the accumulated gradient
        is the same for every micro-batch size and every split of the global batch over ranks. With a critic and
        a value objective, the critic's value-loss gradients accumulate too (on every row).
        The micro-batch loop, the metric accumulation and their reduction are the objective's
        (``accumulate_policy_loss``, ``reduce_policy_metrics``), shared by every backend.
        Returns: global metrics (loss, loss/pg, pg_clipfrac, ppo_kl, entropy, train_rollout_* ...; loss/value and
            value_clipfrac with a critic), reduced over ranks.
        Raises: ValueError when ``counts`` are this rank's rather than the global batch's.
        """

        def backward(loss: Tensor, i: int, num_micro_batches: int) -> None:
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2 (not an unsharded world-size-1 model)
                self.model.set_requires_gradient_sync(i == num_micro_batches - 1)  # reduce-scatter once, at the end
            # FSDP2 averages gradients over ranks; the loss already divides by global counts, so undo it.
            scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
            (loss * (self.world_size * scale)).backward()

        dropout = adapter_dropout(self.model) if self.train_cfg.lora is not None else nullcontext()
        with dropout:
            sums = self._accumulate(objective, batch, counts, backward)
        if self.critic is not None and objective.value is not None:
            sums.update(self.critic.forward_backward(batch, objective.value, counts))
        metrics = reduce_policy_metrics(objective, sums, counts, all_reduce=all_reduce_metrics)
        self._pending_loss = metrics["loss"]
        if "loss/value" in metrics:
            self.critic.pending_loss = metrics["loss/value"]  # global: every rank takes the same skip decision
        return metrics

    def _accumulate(self, objective: PolicyObjective, batch: TrainBatch, counts: LossCounts, backward) -> dict:
        return accumulate_policy_loss(
            objective,
            batch,
            counts,
            world_size=self.world_size,
            micro_batch_size=self.train_cfg.micro_batch_size,
            log_probs_fn=lambda mb: self._log_probs(self.model, mb, with_entropy=True),
            backward=backward,
        )

    def optimizer_step(self, *, loss: float | None = None) -> dict[str, float]:
        """Clip gradients, step AdamW and the LR schedule, zero gradients; skip the step on NaN/inf (config).
        With a critic that accumulated gradients, its optimizer steps too (same guard, its own schedule).
        With fp16 (``loss_scaler``) the gradients are unscaled first; non-finite gradients of a finite loss are an
        overflow of the scaled backward: the step is skipped (counted in skipped_steps) and the scale backs off.

        Args:
            loss: the loss the guard checks; default the global loss of the last ``forward_backward``.
        Returns: grad_norm (before clipping), lr, skipped_steps (and critic_grad_norm, critic_lr,
            critic_skipped_steps with a critic; loss_scale, the scale of the next step, with fp16).
        """
        loss = self._pending_loss if loss is None else loss
        skip_nonfinite, skip_note = self.train_cfg.skip_nonfinite_steps, ""
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(self.model.parameters())
            if math.isfinite(loss):  # non-finite gradients of a finite loss: an overflow, part of fp16 training
                skip_nonfinite = True
                skip_note = (
                    f": an fp16 overflow of the backward at loss scale {self.loss_scaler.scale:g}; the scale halves "
                    f"to {self.loss_scaler.backed_off():g}"
                )
        grad_norm, applied = guarded_step(
            self.model,
            self.optimizer,
            self.scheduler,
            loss=loss,
            grad_clip=self.train_cfg.grad_clip,
            skip_nonfinite=skip_nonfinite,
            step=self.step,
            what="policy",
            lr_key="train.lr",
            skip_note=skip_note,
        )
        self._pending_loss = 0.0
        self.num_skipped_steps += not applied
        self.step += 1
        metrics = {
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "skipped_steps": float(self.num_skipped_steps),
        }
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=not applied)
            metrics["loss_scale"] = self.loss_scaler.scale
        if self.critic is not None and self.critic.pending_loss is not None:
            metrics.update(self.critic.optimizer_step())
        return metrics

    def full_gradients(self) -> dict[str, Tensor]:
        """Unsharded gradients by parameter name (collective; for tests and diagnostics)."""
        return {
            name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }

    # -- weights and checkpoints ----------------------------------------------------------------
    def full_state_dict(self) -> dict[str, Tensor]:
        """Unsharded fp32 weights on CPU, HF names (collective: every rank must call it)."""
        return full_model_state(self.model)

    def export_weights(self) -> Iterable[tuple[str, Tensor]]:
        """(HF name, fp32 tensor) pairs of the full model for the engines, produced one tensor at a time: a
        sharded model's parameters are gathered (``DTensor.full_tensor``, on the parameters' device) as they are
        read and freed once the reader drops them, so a push never holds the whole model twice; an unsharded
        model's are its live parameters, detached (no copy; a list, so a sender may resend it). A tied tensor
        (embedding = LM head) is sent once, under its first name, as HF checkpoints store it (the engine's model
        re-ties it).

        Collective on a sharded model: every rank must read the whole stream, in order (``drain_weights`` in a
        ``finally``).
        """
        unique: dict[int, tuple[str, Tensor]] = {}  # keep_vars: the Parameters themselves, so tied names share one
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            unique.setdefault(id(tensor), (name, tensor))
        named = list(unique.values())
        lora = self.train_cfg.lora
        if lora is None:
            stream = _gathered(named)
        elif lora.sync == "adapter":  # the engines apply the adapters: A and scale * B only, the base stays theirs
            stream = adapter_weights(self.model, named)
        else:  # the merged weights (W + scale * B A; the engines hold no adapters), other tensors as held
            stream = merged_weights(self.model, named)
        if self.world_size == 1:  # a 1-rank mesh (bf16's mixed-precision wrapper) gathers nothing
            return list(stream)
        return stream

    def push_weights(self, version: int) -> None:
        """Send the full weights as update ``version`` from this rank (collective: every rank gathers, one tensor
        at a time; the ranks given a ``weight_sink`` send), never through the driver.

        Raises: RuntimeError if no rank of a world-size-1 backend has a sink; what the sink raises on a failed
            update (the engines keep their previous version).
        """
        if self.weight_sink is None and self.world_size == 1:
            raise RuntimeError("push_weights: this backend has no weight_sink; pass weight_sink=WeightSender(...)")
        named = self.export_weights()  # collective
        try:
            if self.weight_sink is not None:
                self.weight_sink.push(named, version=version)
        finally:
            drain_weights(named)

    def save(self, path: Path) -> None:
        """Write ``model/`` (HF directory: config, safetensors) + ``optimizer.pt`` + ``trainer_state.json``, and
        ``critic/`` (safetensors + ``optimizer.pt``: optimizer, LR schedule, skipped steps) when a critic is held.
        Collective; rank 0 writes.

        ``path`` should be a fresh temporary directory; the caller publishes it by an atomic rename.
        Raises: FloatingPointError if any weight is NaN/inf (nothing is written).
        """
        weights, optim_state = gather_module_state(self.model, self.optimizer, what="policy")
        critic = None
        if self.critic is not None:
            critic = gather_module_state(self.critic.model, self.critic.optimizer, what="critic")
        if self.rank != 0:
            return
        path = Path(path)
        if self.train_cfg.lora is not None:  # adapters alone (peft's layout) for resume; model/ merged for export
            write_weights(adapter_state(weights), path / "adapter" / "adapter_model.safetensors")
            write_peft_config(self.train_cfg.lora, str(self.model_path), path / "adapter")
            weights = merge_state(self.model, weights)
        write_model_dir(weights, self.model.config, self.model_path, path / "model")
        torch.save({"optimizer": optim_state, "scheduler": self.scheduler.state_dict()}, path / "optimizer.pt")
        if critic is not None:
            write_weights(critic[0], path / "critic" / "model.safetensors")
            torch.save(
                {
                    "optimizer": critic[1],
                    "scheduler": self.critic.scheduler.state_dict(),
                    "skipped_steps": self.critic.num_skipped_steps,
                },
                path / "critic" / "optimizer.pt",
            )
        trainer_state = {"step": self.step, "skipped_steps": self.num_skipped_steps}
        if self.loss_scaler is not None:
            trainer_state["loss_scaler"] = self.loss_scaler.state_dict()
        (path / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))

    def load(self, path: Path) -> None:
        """Restore model, optimizer, scheduler, step (and the critic) from ``save``'s layout.

        A critic checkpoint from before the critic had an LR schedule (no ``scheduler`` entry) loads too: its
        schedule continues at the trainer's step count.

        Raises: FileNotFoundError if this backend holds a critic but the checkpoint has none.
        """
        path = Path(path)
        trainer_state = json.loads((path / "trainer_state.json").read_text())
        state = torch.load(path / "optimizer.pt", weights_only=True)
        if self.train_cfg.lora is not None:
            if not (path / "adapter" / "adapter_model.safetensors").is_file():
                raise FileNotFoundError(
                    f"{path} has no adapter/ but this run trains LoRA adapters (train.lora); resume from a checkpoint "
                    "of a LoRA run, or turn train.lora off"
                )
            load_adapters(
                self.model,
                self.optimizer,
                path / "adapter" / "adapter_model.safetensors",
                state["optimizer"],
                self.train_cfg.lora,
            )
        else:
            load_module(self.model, self.optimizer, path / "model" / "model.safetensors", state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            if not (path / "critic" / "model.safetensors").is_file():
                raise FileNotFoundError(
                    f"{path} has no critic/ but this run trains a critic (advantage 'gae'); resume from a checkpoint "
                    "of a run with the same algorithm"
                )
            critic_state = torch.load(path / "critic" / "optimizer.pt", weights_only=True)
            load_module(
                self.critic.model,
                self.critic.optimizer,
                path / "critic" / "model.safetensors",
                critic_state["optimizer"],
            )
            if "scheduler" in critic_state:
                self.critic.scheduler.load_state_dict(critic_state["scheduler"])
                self.critic.num_skipped_steps = critic_state["skipped_steps"]
            else:  # saved before the critic had a schedule: it had taken one (unguarded) step per trainer step
                self.critic.scheduler = warmup_schedule(
                    self.critic.optimizer, warmup_steps=self.train_cfg.warmup_steps, steps_done=trainer_state["step"]
                )
            self.critic.step = trainer_state["step"]
        self.step, self.num_skipped_steps = trainer_state["step"], trainer_state["skipped_steps"]
        if self.loss_scaler is not None and "loss_scaler" in trainer_state:  # else: a run switched to fp16 restarts it
            self.loss_scaler.load_state_dict(trainer_state["loss_scaler"])
            if self.loss_scaler.scale != self.train_cfg.fp16_initial_loss_scale:
                logger.info(
                    "resumed: the loss scale continues at the checkpoint's %g (train.fp16_initial_loss_scale %g "
                    "applies to a new run)",
                    self.loss_scaler.scale,
                    self.train_cfg.fp16_initial_loss_scale,
                )


def vision_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vision tower of an HF vision-language model and the projector into the language model where it is a
    sibling module (Qwen-VL's ``model.visual`` holds its patch merger; LLaVA's ``vision_tower`` has
    ``multi_modal_projector`` beside it, SmolVLM's ``vision_model`` a ``connector``, Kimi K2.5's ``vision_tower`` an
    ``mm_projector``); [] for a text model."""
    inner = getattr(model, "model", model)
    for name in ("visual", "vision_tower", "vision_model"):
        if isinstance(tower := getattr(inner, name, None), torch.nn.Module):
            projectors = (getattr(inner, p, None) for p in ("multi_modal_projector", "connector", "mm_projector"))
            return [tower, *(p for p in projectors if isinstance(p, torch.nn.Module))]
    return []


def _packed_attention(model: torch.nn.Module, batch_layout: str) -> None:
    """Packed rows attend per sequence (``miles.core.varlen_attention``) where the model would use SDPA over a
    block-diagonal mask of the whole row; flash/flex/eager implementations are left as they are."""
    if batch_layout == "packed" and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(register_varlen_sdpa())


def all_reduce_metrics(totals: Tensor, op: str, group=None) -> Tensor:
    """``torch.distributed.all_reduce`` of ``totals`` over ``group`` (None: the default group): "sum" or "max"
    (``reduce_policy_metrics``' all_reduce)."""
    dist.all_reduce(totals, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return totals


def _pad_cols(values: Tensor, width: int) -> Tensor:
    """Right-pad [b, t] to [b, width] with zeros (micro-batches are trimmed to their own response width)."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def _gathered(named: list[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in named:
        with torch.no_grad():  # per tensor: a no_grad held across the yield would leak into the reader
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()  # collective
        yield name, full


def drain_weights(named: Iterable[tuple[str, Tensor]]) -> None:
    """Read whatever is left of ``export_weights``' stream. On a sharded model every tensor is a collective, so a
    rank with no sink, or whose sink failed part-way, still takes part in every gather and the ranks stay in step;
    call it in a ``finally`` after the push (it reads nothing once the sink read it all, or of a list)."""
    if iter(named) is named:
        for _ in named:
            pass
