"""Flow-GRPO training of a text-to-image flow model: sample groups of images with the rollout copy, reward them,
train the transformer on their denoising steps, and publish the new weights to the rollout copy through
``miles.sync`` (versioned buckets, in-process transport), as the LLM loop does with its engines.

One step (Flow-GRPO, arXiv:2505.05470, Algorithm 1):

1. sample ``prompts_per_step`` x ``group_size`` SDE trajectories with the rollout copy (weight version v), keeping
   every step's log-prob;
2. decode and reward the images; GRPO advantages per group (``miles.core``'s ``grpo_advantages``);
3. in ``updates_per_rollout`` mini-batches, recompute the log-probs of the trained steps (all, or a seeded random
   subset: denoising reduction) with gradients, apply ``flow_grpo_loss`` and one guarded optimizer step each;
4. push the transformer's weights to the rollout copy (version v + 1).

The trainer holds one process; FSDP2 across ranks and an SGLang-diffusion engine are not wired here yet.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from miles.core.algorithms.advantages import grpo_advantages
from miles.diffusion.config import FlowGRPOConfig
from miles.diffusion.flow_grpo import flow_grpo_loss
from miles.diffusion.models import FlowModel
from miles.diffusion.rewards import to_uint8
from miles.diffusion.sampler import Conditioning, Trajectories, sample, sample_ode, step_log_probs
from miles.sync import InProcessTransport, WeightReceiver, WeightSender
from miles.train.fsdp2.optimizer import guarded_step, warmup_schedule
from torch import Tensor

# (prompts, images [B, H, W, 3] uint8) -> one reward per image
ImageReward = Callable[[Sequence[str], np.ndarray], Sequence[float]]


class RewardFailed(ValueError):
    """The reward function raised, or returned other than one finite float per image (the message says which)."""


@dataclass(frozen=True)
class Rollout:
    """One step's samples.

    Attributes:
        prompts: [B] the prompt of each image (each prompt ``group_size`` times in a row).
        trajectories: their SDE trajectories and per-step log-probs.
        images: [B, H, W, 3] uint8, the decoded final samples.
        rewards: [B] float32.
        advantages: [B] float32, group-normalized.
        weight_version: the rollout copy's weight version that sampled them.
    """

    prompts: list[str]
    trajectories: Trajectories
    images: np.ndarray
    rewards: Tensor
    advantages: Tensor
    weight_version: int


class FlowGRPOTrainer:
    """Trains ``model.transformer`` with Flow-GRPO against ``reward``.

    Args:
        model: the flow model; its transformer is trained in fp32 (the master weights), a deep copy samples.
        config: the settings.
        reward: ``(prompts, images uint8 [B, H, W, 3]) -> [B]`` rewards.
        bucket_bytes: ``miles.sync`` bucket size of the weight push.

    Attributes:
        policy: the trained transformer; rollout_transformer: the sampling copy, loaded only through ``miles.sync``.
        receiver: the copy's ``WeightReceiver`` (``weight_version`` = the version it samples with).
        steps_done: completed steps.
    """

    def __init__(
        self, model: FlowModel, config: FlowGRPOConfig, reward: ImageReward, *, bucket_bytes: int = 64 * 2**20
    ) -> None:
        self.model, self.config, self.reward = model, config, reward
        self.policy = model.transformer.float().train()
        self.rollout_transformer = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self._rollout_tensors = dict(self.rollout_transformer.state_dict(keep_vars=True))
        self.receiver = WeightReceiver(apply_fn=self._load_rollout)
        self.sender = WeightSender(InProcessTransport(self.receiver), bucket_bytes=bucket_bytes, codec="identity")
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay
        )
        self.scheduler = warmup_schedule(self.optimizer, warmup_steps=config.warmup_steps)
        self.steps_done = 0
        self.publish()

    def _load_rollout(self, named_tensors: Sequence[tuple[str, Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in named_tensors:
                self._rollout_tensors[name].copy_(tensor)

    def publish(self) -> int:
        """Push the transformer's weights to the rollout copy. Returns: the new weight version."""
        with torch.no_grad():
            return self.sender.push(self.policy.state_dict().items())

    def _conditions(self, prompts: Sequence[str]) -> tuple[Conditioning, Conditioning | None]:
        cond = self.model.encode(prompts)
        uncond = self.model.encode([""] * len(prompts)) if self.config.guidance_scale != 1.0 else None
        return cond, uncond

    def rollout(self, prompts: Sequence[str], *, step: int) -> Rollout:
        """Sample and reward ``group_size`` images per prompt with the rollout copy; the noise depends only on
        (``config.seed``, ``step``), so a resumed run samples what an uninterrupted one would.

        Raises: RewardFailed if the reward raises or returns other than one finite float per image.
        """
        cfg = self.config
        expanded = [prompt for prompt in prompts for _ in range(cfg.group_size)]
        cond, uncond = self._conditions(expanded)
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        trajectories = sample(
            self.rollout_transformer, cond, latent_shape=self.model.latent_shape, num_steps=cfg.num_steps,
            noise_level=cfg.noise_level, shift=cfg.shift, uncond=uncond, guidance_scale=cfg.guidance_scale,
            generator=generator,
        )  # fmt: skip
        with torch.no_grad():
            images = to_uint8(self.model.decode(trajectories.latents[:, -1]))
        try:
            rewards = torch.tensor([float(r) for r in self.reward(expanded, images)], dtype=torch.float32)
        except Exception as err:  # the user's function: its message, not a traceback
            raise RewardFailed(f"the reward raised {type(err).__name__}: {err}") from err
        if rewards.shape != (len(expanded),) or not bool(torch.isfinite(rewards).all()):
            raise RewardFailed(f"the reward must return {len(expanded)} finite floats, got {rewards.tolist()}")
        group_index = torch.arange(len(prompts)).repeat_interleave(cfg.group_size)
        advantages = grpo_advantages(rewards, group_index, normalize_std=cfg.normalize_std)
        return Rollout(expanded, trajectories, images, rewards, advantages, self.receiver.weight_version)

    def _train_steps(self, step: int, update: int) -> list[int]:
        cfg = self.config
        if cfg.train_steps is None or cfg.train_steps == cfg.num_steps:
            return list(range(cfg.num_steps))
        generator = torch.Generator().manual_seed(cfg.seed * 7919 + step * 31 + update + 1)
        return sorted(torch.randperm(cfg.num_steps, generator=generator)[: cfg.train_steps].tolist())

    def train(self, rollout: Rollout, *, step: int) -> dict[str, float]:
        """Train on one rollout in ``updates_per_rollout`` optimizer steps, then publish the weights.

        Returns: metrics (loss, clipfrac, approx_kl, grad_norm, and ``train_rollout_logprob_max_abs_diff``: the
        largest |recomputed - sampled| log-prob of the first mini-batch, before any update; 0 up to fp32 when the
        rollout copy holds the policy's weights).
        """
        cfg = self.config
        batch = len(rollout.prompts)
        per_update = batch // cfg.updates_per_rollout
        cond, uncond = self._conditions(rollout.prompts)
        traj = rollout.trajectories
        sums: dict[str, float] = {"loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "grad_norm": 0.0}
        log_prob_diff, applied = 0.0, 0
        for update in range(cfg.updates_per_rollout):
            steps = self._train_steps(step, update)
            loss_total = 0.0
            for start in range(update * per_update, (update + 1) * per_update, cfg.micro_batch_size):
                rows = slice(start, min(start + cfg.micro_batch_size, (update + 1) * per_update))
                mb_traj = Trajectories(traj.latents[rows], traj.sigmas, traj.log_probs[rows])
                mb_cond = cond.rows(rows)
                mb_uncond = uncond.rows(rows) if uncond is not None else None
                weight = (rows.stop - rows.start) / per_update
                for i in steps:  # one backward per denoising step: activations of one step at a time
                    log_probs = step_log_probs(
                        self.policy, mb_traj, mb_cond, [i], noise_level=cfg.noise_level, uncond=mb_uncond,
                        guidance_scale=cfg.guidance_scale,
                    )  # fmt: skip
                    old = mb_traj.log_probs[:, [i]]
                    if update == 0:
                        log_prob_diff = max(log_prob_diff, float((log_probs.detach() - old).abs().max()))
                    loss, metrics = flow_grpo_loss(
                        log_probs, old, rollout.advantages[rows], torch.ones_like(old, dtype=torch.bool),
                        clip_low=cfg.clip_range, clip_high=cfg.clip_range, advantage_clip=cfg.advantage_clip,
                    )  # fmt: skip
                    scale = weight / len(steps)
                    (loss * scale).backward()
                    loss_total += float(loss.detach()) * scale
                    for key in ("clipfrac", "approx_kl"):
                        sums[key] += float(metrics[key]) * scale / cfg.updates_per_rollout
            grad_norm, ok = guarded_step(
                self.policy, self.optimizer, self.scheduler, loss=loss_total, grad_clip=cfg.grad_clip,
                skip_nonfinite=cfg.skip_nonfinite_steps, step=step, what="transformer", lr_key="lr",
            )  # fmt: skip
            applied += ok
            sums["loss"] += loss_total / cfg.updates_per_rollout
            sums["grad_norm"] += grad_norm / cfg.updates_per_rollout
        version = self.publish()
        return {**sums, "train_rollout_logprob_max_abs_diff": log_prob_diff, "optimizer_steps": float(applied),
                "weight_version": float(version)}  # fmt: skip

    def step(self, prompts: Sequence[str]) -> dict[str, float]:
        """One Flow-GRPO step (module docstring) on ``prompts``.

        Returns: its metrics (``reward/*``, ``loss``, ``grad_norm``, ``clipfrac``, ``approx_kl``,
        ``train_rollout_logprob_max_abs_diff``, ``optimizer_steps``, ``weight_version``, ``time/*`` in s).
        Raises: RewardFailed (``rollout``).
        """
        step = self.steps_done
        start = time.perf_counter()
        rollout = self.rollout(prompts, step=step)
        rollout_time = time.perf_counter() - start
        metrics = self.train(rollout, step=step)
        self.steps_done += 1
        stds = rollout.rewards.view(-1, self.config.group_size).std(dim=1)
        return {
            "reward/mean": float(rollout.rewards.mean()),
            "reward/std_in_group": float(stds.mean()),
            "reward/no_signal_groups": float((stds == 0).float().mean()),
            "rollout/weight_version": float(rollout.weight_version),
            **metrics,
            "time/rollout": rollout_time,
            "time/train": time.perf_counter() - start - rollout_time,
        }

    @torch.no_grad()
    def evaluate(self, prompts: Sequence[str], *, seed: int) -> tuple[float, np.ndarray]:
        """Mean reward of one ODE sample (deterministic given the noise) per prompt, from noise seeded by ``seed``
        (held out: keep it apart from ``config.seed``). Returns: (mean reward, images [B, H, W, 3] uint8)."""
        cond, uncond = self._conditions(prompts)
        latents = sample_ode(
            self.rollout_transformer, cond, latent_shape=self.model.latent_shape, num_steps=self.config.num_steps,
            shift=self.config.shift, uncond=uncond, guidance_scale=self.config.guidance_scale,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        images = to_uint8(self.model.decode(latents))
        rewards = [float(r) for r in self.reward(list(prompts), images)]
        return (math.fsum(rewards) / len(rewards), images)

    def state_dict(self) -> dict[str, Any]:
        """What an exact resume needs: the transformer, the optimizer, the LR schedule, the step count, the rollout
        copy's weight version."""
        return {
            "weight_version": self.receiver.weight_version,
            "transformer": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps_done": self.steps_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output and publish the weights to the rollout copy with the saved weight
        version (versions only grow: a fresh trainer's copy holds v1)."""
        self.policy.load_state_dict(state["transformer"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = int(state["steps_done"])
        with torch.no_grad():
            version = max(int(state["weight_version"]), self.sender.version + 1)
            self.sender.push(self.policy.state_dict().items(), version=version)
