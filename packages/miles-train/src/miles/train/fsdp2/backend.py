"""FSDP2 training backend over an HF causal LM: log-probs, PPO/GRPO train steps, weight export, checkpoints."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from miles.core.algorithms.importance import importance_weights, off_policy_sequence_mask
from miles.core.algorithms.losses import ADVANTAGE_WEIGHTED_LOSSES, LossParams, aggregate, policy_loss
from miles.core.batch import TrainBatch, split_micro_batches
from miles.core.config import AlgorithmConfig
from miles.core.log_probs import model_response_log_probs, warn_if_slow_bf16
from miles.core.plugins import load_plugin
from miles.train.config import TrainConfig
from miles.train.fsdp2.optimizer import guarded_step, warmup_schedule
from miles.train.fsdp2.state import full_model_state, gather_module_state, load_module, write_weights
from torch import Tensor

logger = logging.getLogger(__name__)

PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ensure_process_group() -> None:
    """Start a single-process gloo group if none exists (world size 1, in-process default)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class FSDP2Backend:
    """``TrainBackend`` with FSDP2 data parallelism; every rank of the current process group constructs one.

    Each rank gets its own rows of the global batch (``train_step`` takes this rank's shard) and loss
    denominators are all-reduced, so the update equals one big batch on one rank.

    Args:
        model_path: HF model directory.
        train: optimizer/precision/micro-batch section.
        algorithm: loss section (clip, KL, entropy, aggregation).
        temperature: sampling temperature of the rollouts being trained on (log-probs use logits / T).
        max_new_tokens: the normalizer of ``seq_mean_token_sum_norm``.
        teacher_path: HF directory of a frozen teacher (on-policy distillation); its log-probs use
            ``algorithm.teacher_temperature``. None = no teacher.
        critic_path: HF directory initializing a critic (PPO/GAE, see ``critic.py``). None = no critic.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        train: TrainConfig,
        algorithm: AlgorithmConfig,
        temperature: float,
        max_new_tokens: int,
        teacher_path: str | Path | None = None,
        critic_path: str | Path | None = None,
    ) -> None:
        from miles.train.fsdp2.parallelize import parallelize
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM

        ensure_process_group()
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.train_cfg, self.algorithm = train, algorithm
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.model_path = Path(model_path)
        warn_if_slow_bf16(PARAM_DTYPES[train.dtype], logger, where="train.dtype")
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model.config.use_cache = False
        mesh = init_device_mesh("cpu", (self.world_size,))
        self.model = parallelize(model, mesh=mesh, param_dtype=PARAM_DTYPES[train.dtype])
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=train.lr,
            betas=(train.adam_beta1, train.adam_beta2),
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
        )
        self.scheduler = warmup_schedule(self.optimizer, warmup_steps=train.warmup_steps)
        self.ref_model = None
        if algorithm.kl_coef > 0.0:  # reference = frozen initial policy, unsharded, no grad
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=PARAM_DTYPES[train.dtype]).eval()
            self.ref_model.requires_grad_(False)
        self.teacher_model = None
        if teacher_path is not None:  # frozen, unsharded, no grad; same vocabulary as the policy
            self.teacher_model = AutoModelForCausalLM.from_pretrained(
                teacher_path, dtype=PARAM_DTYPES[train.dtype]
            ).eval()
            self.teacher_model.requires_grad_(False)
        self.critic = None
        if critic_path is not None:
            from miles.train.fsdp2.critic import Critic

            self.critic = Critic(
                critic_path,
                mesh=mesh,
                param_dtype=PARAM_DTYPES[train.dtype],
                lr=algorithm.critic_lr,
                value_clip=algorithm.value_clip,
                micro_batch_size=train.micro_batch_size,
                grad_clip=train.grad_clip,
                warmup_steps=train.warmup_steps,
                skip_nonfinite_steps=train.skip_nonfinite_steps,
            )
        self.loss_fn = (
            load_plugin(algorithm.policy_loss_path, key="algorithm.policy_loss_path", num_positional=5)
            if algorithm.policy_loss_path
            else algorithm.policy_loss
        )
        self.reducer = (
            load_plugin(algorithm.loss_reducer_path, key="algorithm.loss_reducer_path", num_positional=4)
            if algorithm.loss_reducer_path
            else None
        )
        self.loss_params = LossParams(
            clip_low=algorithm.clip_low, clip_high=algorithm.clip_high, dual_clip_c=algorithm.dual_clip_c
        )
        self.step = 0
        self.num_skipped_steps = 0

    # -- log-probs ------------------------------------------------------------------------------
    def _log_probs(
        self, model: torch.nn.Module, mb: TrainBatch, *, with_entropy: bool, temperature: float | None = None
    ) -> tuple[Tensor, Tensor | None]:
        return model_response_log_probs(
            model,
            mb.tokens,
            mb.attention_mask,
            mb.prompt_lengths,
            num_response_columns=mb.loss_mask.shape[1],
            temperature=self.temperature if temperature is None else temperature,
            with_entropy=with_entropy,
        )

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch) -> TrainBatch:
        """Set ``old_log_probs`` (current policy) and, with the models held, ``ref_log_probs``,
        ``teacher_log_probs`` (at ``algorithm.teacher_temperature``) and critic ``values``; [B, T] f32."""
        old, ref, teacher = [], [], []
        width = batch.loss_mask.shape[1]
        for mb in split_micro_batches(batch, self.train_cfg.micro_batch_size):
            old.append(_pad_cols(self._log_probs(self.model, mb, with_entropy=False)[0], width))
            if self.ref_model is not None:
                ref.append(_pad_cols(self._log_probs(self.ref_model, mb, with_entropy=False)[0], width))
            if self.teacher_model is not None:
                temperature = self.algorithm.teacher_temperature
                lp = self._log_probs(self.teacher_model, mb, with_entropy=False, temperature=temperature)[0]
                teacher.append(_pad_cols(lp, width))
        return batch.replace(
            old_log_probs=torch.cat(old),
            ref_log_probs=torch.cat(ref) if ref else batch.ref_log_probs,
            teacher_log_probs=torch.cat(teacher) if teacher else batch.teacher_log_probs,
            values=self.critic.compute_values(batch) if self.critic is not None else batch.values,
        )

    # -- training -------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's rows of the global batch; returns global metrics.

        Without ``old_log_probs`` the batch is on-policy: the ratio's denominator is the detached current
        log-prob (ratio 1), which saves a forward pass. Reference log-probs are computed here if KL is on.
        """
        metrics = self.forward_backward(batch)
        metrics.update(self.optimizer_step(loss=metrics["loss"]))
        if self.critic is not None:
            counts = torch.tensor([batch.num_loss_tokens], dtype=torch.float64)
            dist.all_reduce(counts)
            metrics.update(self.critic.train_step(batch, num_tokens=int(counts[0])))
        return metrics

    def forward_backward(self, batch: TrainBatch) -> dict[str, float]:
        """Accumulate gradients of the policy loss over micro-batches (no optimizer step).

        Loss denominators (tokens, sequences) are all-reduced over ranks first, so the accumulated gradient is
        the same for every micro-batch size and every split of the global batch over ranks.
        Returns: global metrics (loss, loss/pg, pg_clipfrac, ppo_kl, entropy, train_rollout_* ...).
        """
        if self.ref_model is not None and batch.ref_log_probs is None:
            batch = batch.replace(ref_log_probs=self.compute_log_probs(batch).ref_log_probs)
        counts = torch.tensor([batch.num_loss_tokens, batch.batch_size], dtype=torch.float64)
        dist.all_reduce(counts)
        num_tokens, num_sequences = int(counts[0]), int(counts[1])
        batch, num_skipped = self._drop_rows_without_signal(batch)
        metrics_num_tokens = batch.num_loss_tokens if num_skipped else None
        sums: dict[str, Tensor] = {
            "loss": torch.zeros(()),
            "skipped_zero_advantage_samples": torch.tensor(float(num_skipped)),
        }
        micro_batches = split_micro_batches(batch, self.train_cfg.micro_batch_size) if batch.batch_size else []
        for i, mb in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce-scatter once, at the end
            log_probs, entropy = self._log_probs(self.model, mb, with_entropy=True)
            old_log_probs = mb.old_log_probs if mb.old_log_probs is not None else log_probs.detach()
            loss_mask, token_weights, correction = self._rollout_correction(mb, log_probs, old_log_probs)
            tok = dict(mode="token_mean", num_tokens=metrics_num_tokens or num_tokens)
            loss, metrics = policy_loss(
                log_probs,
                old_log_probs,
                mb.advantages,
                loss_mask,
                params=self.loss_params,
                aggregation=self.algorithm.aggregation,
                num_tokens=num_tokens,
                num_sequences=num_sequences,
                loss=self.loss_fn,
                reducer=self.reducer,
                normalizer=float(self.max_new_tokens),
                token_weights=token_weights,
                ref_log_probs=mb.ref_log_probs,
                kl_coef=self.algorithm.kl_coef if self.algorithm.kl_mode == "loss" else 0.0,
                kl_estimator=self.algorithm.kl_estimator,
                entropy=entropy,
                entropy_coef=self.algorithm.entropy_coef,
                metrics_num_tokens=metrics_num_tokens,
            )
            metrics.update({name: aggregate(v, mb.loss_mask, **tok) for name, v in correction.items()})
            # FSDP2 averages gradients over ranks; the loss already divides by global counts, so undo it.
            (loss * self.world_size).backward()
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value.detach()
            sums["loss"] = sums["loss"] + loss.detach()
        names = sorted(sums)
        totals = torch.stack([torch.as_tensor(sums[n], dtype=torch.float64) for n in names])
        dist.all_reduce(totals)
        metrics = dict(zip(names, totals.tolist()))  # host sync
        if "_is_weight_sq" in metrics:  # ESS ratio = mean(w)^2 / mean(w^2), from token means over the global batch
            sq_mean = metrics.pop("_is_weight_sq")
            ess = metrics.pop("_is_weight") ** 2 / sq_mean if sq_mean > 0 else 1.0
            metrics["ess_ratio"] = min(ess, 1.0)  # <= 1 by Cauchy-Schwarz; rounding can overshoot by ~1e-13
        return metrics

    def _rollout_correction(
        self, mb: TrainBatch, log_probs: Tensor, old_log_probs: Tensor
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
        """Loss mask after OPSM, detached importance weights (TIS/MIS/icepop) and per-token mismatch values.

        Returns: (loss_mask [b, t] bool, token_weights [b, t] float32 or None, {metric: [b, t] per-token values}
            to be token-averaged: train_rollout_logprob_abs_diff, train_rollout_kl, tis_clipfrac and the ESS terms).
        """
        cfg, loss_mask = self.algorithm, mb.loss_mask
        if mb.rollout_log_probs is None:
            if cfg.importance_sampling != "none" or cfg.opsm:
                raise ValueError(
                    "algorithm.importance_sampling / algorithm.opsm need the engine's rollout_log_probs, but the "
                    "batch has none; use an engine that returns log-probs, or set them to none / false."
                )
            return loss_mask, None, {}
        diff = (old_log_probs - mb.rollout_log_probs).detach()
        values = {"train_rollout_logprob_abs_diff": diff.abs(), "train_rollout_kl": -diff}
        if cfg.opsm:
            loss_mask = off_policy_sequence_mask(
                log_probs, mb.rollout_log_probs, mb.advantages, loss_mask, threshold=cfg.opsm_threshold
            )
            values["opsm_masked_frac"] = (mb.loss_mask & ~loss_mask).float()
        token_weights = None
        if cfg.importance_sampling != "none":
            token_weights, outside = importance_weights(
                old_log_probs.detach(),
                mb.rollout_log_probs,
                loss_mask,
                mode=cfg.importance_sampling,
                level=cfg.importance_level,
                lower=cfg.importance_lower,
                upper=cfg.importance_upper,
            )
            values.update(
                {"tis_clipfrac": outside.float(), "_is_weight": token_weights, "_is_weight_sq": token_weights**2}
            )
        return loss_mask, token_weights, values

    def _drop_rows_without_signal(self, batch: TrainBatch) -> tuple[TrainBatch, int]:
        """Drop samples whose advantages are all 0 when nothing else (KL, entropy bonus) gives them a gradient.

        Exact: such a row adds -ratio * 0 = 0 to the loss and its gradient, and the loss denominators were
        counted before the drop. GRPO groups with equal rewards are all-zero, often most of a batch early on.
        Only with world size 1: FSDP2 ranks must run the same number of backward passes.
        """
        kl_loss = self.algorithm.kl_coef > 0.0 and self.algorithm.kl_mode == "loss"
        advantage_weighted = isinstance(self.loss_fn, str) and self.loss_fn in ADVANTAGE_WEIGHTED_LOSSES
        if self.world_size > 1 or kl_loss or self.algorithm.entropy_coef > 0.0 or not advantage_weighted:
            return batch, 0
        keep = ((batch.advantages != 0) & batch.loss_mask).any(dim=1)
        if not keep.any():  # keep one row (zero gradient) so that entropy and log-prob metrics are still measured
            keep[0] = True
        num_skipped = int((~keep).sum())  # host sync
        if num_skipped == 0:
            return batch, 0
        return batch.select(keep.nonzero().squeeze(1)), num_skipped

    def optimizer_step(self, *, loss: float = 0.0) -> dict[str, float]:
        """Clip gradients, step AdamW and the LR schedule, zero gradients; skip the step on NaN/inf (config).

        Returns: grad_norm (before clipping), lr, skipped_steps.
        """
        grad_norm, applied = guarded_step(
            self.model,
            self.optimizer,
            self.scheduler,
            loss=loss,
            grad_clip=self.train_cfg.grad_clip,
            skip_nonfinite=self.train_cfg.skip_nonfinite_steps,
            step=self.step,
            what="policy",
            lr_key="train.lr",
        )
        self.num_skipped_steps += not applied
        self.step += 1
        return {
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "skipped_steps": float(self.num_skipped_steps),
        }

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

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, fp32 tensor) pairs of the full model for the engines; a tied tensor (embedding = LM head) is
        sent once, under its first name, as HF checkpoints store it (the engine's model re-ties it)."""
        seen: set[int] = set()
        for name, tensor in self.full_state_dict().items():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                yield name, tensor

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
        write_weights(weights, path / "model" / "model.safetensors")
        config = copy.deepcopy(self.model.config)
        config.use_cache = True  # turned off for training only; the saved model is for inference
        config.save_pretrained(path / "model")
        if (self.model_path / "generation_config.json").is_file():
            shutil.copy2(self.model_path / "generation_config.json", path / "model" / "generation_config.json")
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
        (path / "trainer_state.json").write_text(
            json.dumps({"step": self.step, "skipped_steps": self.num_skipped_steps}, indent=2)
        )

    def load(self, path: Path) -> None:
        """Restore model, optimizer, scheduler, step (and the critic) from ``save``'s layout.

        A critic checkpoint from before the critic had an LR schedule (no ``scheduler`` entry) loads too: its
        schedule continues at the trainer's step count.

        Raises: FileNotFoundError if this backend holds a critic but the checkpoint has none.
        """
        path = Path(path)
        trainer_state = json.loads((path / "trainer_state.json").read_text())
        state = torch.load(path / "optimizer.pt", weights_only=True)
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


def _pad_cols(values: Tensor, width: int) -> Tensor:
    """Right-pad [b, t] to [b, width] with zeros (micro-batches are trimmed to their own response width)."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))
