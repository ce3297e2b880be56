"""The PPO critic: an HF backbone with a scalar value head, sharded with FSDP2; its loss comes from the objective
(``miles.core.algorithms.objective.ValueObjective``)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from miles.core.algorithms.objective import LossCounts, ValueObjective
from miles.core.batch import TrainBatch, split_micro_batches
from miles.train.fsdp2.optimizer import guarded_step, warmup_schedule
from torch import Tensor

logger = logging.getLogger(__name__)


def response_values(scores: Tensor, prompt_lengths: Tensor, *, num_response_columns: int) -> Tensor:
    """Values of the response states in ``TrainBatch`` [B, T] layout.

    V(s_t), the state before response token t, is read at position p_b + t - 1 (the position whose logits predict
    token t), so values and log-probs of one column belong to the same state.

    Args:
        scores: [B, L] float, the value head's output at every position.
        prompt_lengths: [B] int64, p_b >= 1.
        num_response_columns: T.
    Returns: [B, T] float32 (garbage past each response; mask it).
    """
    cols = torch.arange(num_response_columns, device=scores.device)
    pos = (prompt_lengths[:, None] - 1 + cols[None, :]).clamp(max=scores.shape[1] - 1)
    return scores.gather(1, pos).float()


def _copy_output(module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor:
    """Forward hook: the module's output as a tensor with its own storage (not a view)."""
    return output.clone()


class Critic:
    """Value model V(s_t) for GAE: a token-classification head (1 label) on an HF decoder, with its own AdamW.

    Args:
        model_path: HF model directory initializing the backbone (usually the policy); the head starts random.
        mesh: the data-parallel device mesh of the policy.
        param_dtype: compute dtype of the all-gathered parameters.
        lr: critic peak learning rate.
        micro_batch_size: sequences per forward/backward; grad_clip: gradient norm clip.
        warmup_steps: linear LR warmup over this many critic steps, as the policy's (``train.warmup_steps``).
        skip_nonfinite_steps: skip a step with a NaN/inf loss or grad norm (True) or raise (False), as the
            policy's (``train.skip_nonfinite_steps``); a non-finite step is never applied.
        trust_remote_code: run the backbone's own code (``auto_map``), as ``models.critic.trust_remote_code``.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        mesh,
        param_dtype: torch.dtype,
        lr: float,
        micro_batch_size: int,
        grad_clip: float,
        warmup_steps: int,
        skip_nonfinite_steps: bool,
        trust_remote_code: bool = False,
    ) -> None:
        from miles.train.fsdp2.parallelize import parallelize
        from transformers import AutoModelForTokenClassification

        model = AutoModelForTokenClassification.from_pretrained(
            model_path, num_labels=1, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
        model.config.use_cache = False
        # The head is nn.Linear(H, 1) with a bias: on a 3-D input torch runs addmm on the flattened input and returns
        # a view of the result, so FSDP2 warns that the critic "returned a view tensor" (an in-place op on it would
        # skip the pre-backward hook). A copy of the [B, L, 1] scores is not a view and costs B x L floats.
        model.score.register_forward_hook(_copy_output)
        self.model = parallelize(model, mesh=mesh, param_dtype=param_dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.scheduler = warmup_schedule(self.optimizer, warmup_steps=warmup_steps)
        self.micro_batch_size, self.grad_clip = micro_batch_size, grad_clip
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.world_size = dist.get_world_size()
        self.step = 0
        self.num_skipped_steps = 0
        self.pending_loss: float | None = None  # global value loss of the last forward_backward, for the guard

    def _values(self, mb: TrainBatch) -> Tensor:
        scores = self.model(input_ids=mb.tokens, attention_mask=mb.attention_mask.long()).logits[..., 0]  # [b, L]
        return response_values(scores, mb.prompt_lengths, num_response_columns=mb.loss_mask.shape[1])

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> Tensor:
        """[B, T] float32 values of the batch's response states, 0 past each response."""
        width = batch.loss_mask.shape[1]
        parts = [
            torch.nn.functional.pad(self._values(mb), (0, width - mb.loss_mask.shape[1]))
            for mb in split_micro_batches(batch, self.micro_batch_size)
        ]
        values = torch.cat(parts)
        cols = torch.arange(width)[None, :] < batch.response_lengths[:, None]
        return torch.where(cols, values, 0.0)

    def forward_backward(self, batch: TrainBatch, objective: ValueObjective, counts: LossCounts) -> dict[str, Tensor]:
        """Accumulate the gradients of the value loss over micro-batches of this rank's rows (no step).

        Returns: this rank's sums of loss/value and value_clipfrac (the caller reduces them over ranks and sets
            ``pending_loss`` to the global loss before ``optimizer_step``).
        Raises: ValueError if the batch lacks ``values`` or ``returns`` (run GAE first).
        """
        sums = {"loss/value": torch.zeros(()), "value_clipfrac": torch.zeros(())}
        micro_batches = split_micro_batches(batch, self.micro_batch_size)
        for i, mb in enumerate(micro_batches):
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2 (not an unsharded world-size-1 model)
                self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            loss, metrics = objective.loss(self._values(mb), mb, counts)
            (loss * self.world_size).backward()  # FSDP2 averages over ranks; the loss already uses global counts
            for name, value in metrics.items():
                sums[name] = sums[name] + value
        return sums

    def optimizer_step(self) -> dict[str, float]:
        """One guarded AdamW step with the policy's guard and LR warmup (see ``guarded_step``), checking
        ``pending_loss``.

        Returns: critic_grad_norm (before clipping), critic_lr, critic_skipped_steps.
        Raises: FloatingPointError on a non-finite step when ``skip_nonfinite_steps`` is False.
        """
        grad_norm, applied = guarded_step(
            self.model,
            self.optimizer,
            self.scheduler,
            loss=self.pending_loss if self.pending_loss is not None else 0.0,
            grad_clip=self.grad_clip,
            skip_nonfinite=self.skip_nonfinite_steps,
            step=self.step,
            what="critic",
            lr_key="models.critic.lr",
        )
        self.pending_loss = None
        self.num_skipped_steps += not applied
        self.step += 1
        return {
            "critic_grad_norm": grad_norm,
            "critic_lr": self.scheduler.get_last_lr()[0],
            "critic_skipped_steps": float(self.num_skipped_steps),
        }
