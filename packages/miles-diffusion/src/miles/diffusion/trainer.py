"""Flow-GRPO training of a text-to-image flow model: sample groups of images with the rollout copy, reward them,
train the transformer on their denoising steps, and publish the new weights to the rollout copy through
``miles.sync`` (versioned buckets, in-process transport), as the LLM loop does with its engines.

One step (Flow-GRPO, arXiv:2505.05470, Algorithm 1):

1. sample ``prompts_per_step`` x ``group_size`` SDE trajectories with the rollout copy (weight version v), keeping
   every step's log-prob;
2. decode and reward the images; GRPO advantages per group (``miles.core``'s ``grpo_advantages``);
3. in ``updates_per_rollout`` mini-batches, recompute the log-probs of the trained steps (all, or a seeded random
   subset: denoising reduction) with gradients, apply ``flow_grpo_loss`` (plus ``kl_coef`` times the per-step KL to
   the run's starting model) and one guarded optimizer step each;
4. push the transformer's weights to the rollout copy (version v + 1).

With ``algorithm.lora`` only LoRA adapters on the transformer's attention train (Flow-GRPO's SD3.5 setting): the KL
reference is the transformer with its adapters off, and each push sends the adapted layers' merged weights
``W + (alpha / r) B A`` (``miles.train.fsdp2.lora``), the rest of the rollout copy staying as loaded.

With ``loss: diffusion_nft`` step 3 is DiffusionNFT's instead (``miles.diffusion.nft``): flow matching on the
sampled clean images at the trained steps' times, split by reward between implicit positive and negative policies
around the rollout copy (the sampling policy); no log-probs are used. With ``nft_decay_rate`` the sampling policy is
DiffusionNFT's soft-updated old policy ``theta_old <- eta theta_old + (1 - eta) theta`` (of the trained parameters:
the adapters with LoRA), pushed to the rollout copy instead of the trained weights.

The trainer holds one process; FSDP2 across ranks and an SGLang-diffusion engine are not wired here yet.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from miles.core.algorithms.advantages import grpo_advantages
from miles.diffusion.config import FlowGRPOConfig
from miles.diffusion.flow_grpo import flow_grpo_loss, gaussian_kl
from miles.diffusion.models import FlowModel
from miles.diffusion.nft import diffusion_nft_loss, forward_noised, old_policy_decay, optimality
from miles.diffusion.rewards import to_uint8
from miles.diffusion.sampler import Conditioning, Trajectories, sample, sample_ode, step_transition, velocity
from miles.sync import InProcessTransport, WeightReceiver, WeightSender
from miles.train.fsdp2.lora import adapter_dropout, adapters_disabled, apply_lora, merged_weights
from miles.train.fsdp2.optimizer import guarded_step, warmup_schedule
from torch import Tensor

logger = logging.getLogger(__name__)

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
        policy: the trained transformer (with ``config.lora``: its adapters injected, peft); rollout_transformer: the
            sampling copy, a plain transformer loaded only through ``miles.sync``.
        receiver: the copy's ``WeightReceiver`` (``weight_version`` = the version it samples with).
        steps_done: completed steps.
    """

    def __init__(
        self, model: FlowModel, config: FlowGRPOConfig, reward: ImageReward, *, bucket_bytes: int = 64 * 2**20
    ) -> None:
        self.model, self.config, self.reward = model, config, reward
        self.policy = model.transformer.float().train()
        self.rollout_transformer = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.reference = None  # the run's starting weights, for flow_grpo's KL (LoRA: the policy, adapters off)
        if config.lora is not None:
            apply_lora(self.policy, config.lora, key="algorithm.lora")
        elif config.kl_coef > 0:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self._rollout_tensors = dict(self.rollout_transformer.state_dict(keep_vars=True))
        self.receiver = WeightReceiver(apply_fn=self._load_rollout)
        self.sender = WeightSender(InProcessTransport(self.receiver), bucket_bytes=bucket_bytes, codec="identity")
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay
        )
        self.scheduler = warmup_schedule(self.optimizer, warmup_steps=config.warmup_steps)
        self.steps_done = 0
        # DiffusionNFT's old policy (soft-updated trainable parameters), pushed instead of them; None: the policy's
        self.old_params: dict[str, Tensor] | None = None
        if config.nft_decay_rate > 0:
            self.old_params = {n: p.detach().clone() for n, p in self.policy.named_parameters() if p.requires_grad}
        self.publish(everything=True)

    def _load_rollout(self, named_tensors: Sequence[tuple[str, Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in named_tensors:
                self._rollout_tensors[name].copy_(tensor)

    def publish(self, *, version: int | None = None, everything: bool = False) -> int:
        """Push the transformer's weights to the rollout copy: all of them (full fine-tuning; ``everything``), or
        with LoRA the adapted layers' merged weights (the only ones that change; the rest of the copy is as loaded).

        Args:
            version: the weight version to publish as (default: the next one).
            everything: send every tensor (the first push, a resume).
        Returns: the new weight version.
        """
        named = self.policy.state_dict().items()
        if self.config.lora is not None:
            named = merged_weights(self.policy, named if everything else self._adapted(), adapters=self.old_params)
        elif self.old_params is not None:
            named = [(name, self.old_params.get(name, t)) for name, t in named]
        with torch.no_grad():
            return self.sender.push(named, version=version)

    def _adapted(self) -> list[tuple[str, Tensor]]:
        """The LoRA-wrapped layers' state-dict items (base weights and biases, adapters): what merges into the
        adapted layers' weights, the only ones a LoRA step changes."""
        return [(n, t) for n, t in self.policy.state_dict().items() if ".base_layer." in n or ".lora_" in n]

    @contextlib.contextmanager
    def trained_transformer(self) -> Iterator[torch.nn.Module]:
        """A plain transformer holding the trained weights inside the block (what a checkpoint's ``model/`` saves):
        the policy; with LoRA the rollout copy, which every ``train`` ends by loading with the merged weights (with
        ``nft_decay_rate`` it holds the old policy: its adapted layers hold the merged trained weights inside the
        block, and the old policy's again after it)."""
        if self.config.lora is None:
            yield self.policy
            return
        if self.old_params is None:
            yield self.rollout_transformer
            return
        merged = dict(merged_weights(self.policy, self._adapted()))
        held = {name: self._rollout_tensors[name].detach().clone() for name in merged}
        self._load_rollout(list(merged.items()))
        try:
            yield self.rollout_transformer
        finally:
            self._load_rollout(list(held.items()))

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
        rewards = self.score(expanded, images)
        group_index = torch.arange(len(prompts)).repeat_interleave(cfg.group_size)
        advantages = grpo_advantages(rewards, group_index, normalize_std=cfg.normalize_std)
        return Rollout(expanded, trajectories, images, rewards, advantages, self.receiver.weight_version)

    def score(self, prompts: Sequence[str], images: np.ndarray) -> Tensor:
        """The reward of each image, checked: [B] float32.

        Raises: RewardFailed if the reward raises or returns other than one finite float per image.
        """
        try:
            values = list(self.reward(list(prompts), images))
            rewards = torch.tensor([float(r) for r in values], dtype=torch.float32)
        except Exception as err:  # the user's function: its message, not a traceback
            raise RewardFailed(f"the reward raised {type(err).__name__}: {err}") from err
        if rewards.shape != (len(prompts),) or not bool(torch.isfinite(rewards).all()):
            shown = rewards.tolist() if len(rewards) <= 8 else f"{len(rewards)} values"
            raise RewardFailed(f"the reward must return {len(prompts)} finite floats, got {shown}")
        return rewards

    def _train_steps(self, step: int, update: int) -> list[int]:
        cfg = self.config
        if cfg.train_steps is None or cfg.train_steps == cfg.num_steps:
            return list(range(cfg.num_steps))
        generator = torch.Generator().manual_seed(cfg.seed * 7919 + step * 31 + update + 1)
        return sorted(torch.randperm(cfg.num_steps, generator=generator)[: cfg.train_steps].tolist())

    def train(self, rollout: Rollout, *, step: int) -> dict[str, float]:
        """Train on one rollout in ``updates_per_rollout`` optimizer steps, then publish the weights.

        Returns: metrics: ``loss``, ``grad_norm``; flow_grpo: ``clipfrac``, ``approx_kl``, ``kl`` (with a
        reference) and ``train_rollout_logprob_max_abs_diff``, the largest |recomputed - sampled| log-prob of the
        first mini-batch, before any update (0 up to fp32 when the rollout copy holds the policy's weights);
        diffusion_nft: ``nft/positive_mse``, ``nft/negative_mse``, ``nft/old_decay`` (eta of the soft update, with
        ``nft_decay_rate``).
        """
        cfg = self.config
        cond, uncond = self._conditions(rollout.prompts)
        sums: dict[str, float] = {"loss": 0.0, "grad_norm": 0.0}
        applied = 0
        dropout = adapter_dropout(self.policy) if cfg.lora is not None else contextlib.nullcontext()
        with dropout:
            for update in range(cfg.updates_per_rollout):
                applied += self._update(rollout, cond, uncond, step=step, update=update, sums=sums)
        if self.old_params is not None:
            sums["nft/old_decay"] = self._soft_update()
        version = self.publish()
        if cfg.loss == "flow_grpo":
            sums["train_rollout_logprob_max_abs_diff"] = sums.pop("logprob_diff")
        return {**sums, "optimizer_steps": float(applied), "weight_version": float(version)}

    def _update(
        self,
        rollout: Rollout,
        cond: Conditioning,
        uncond: Conditioning | None,
        *,
        step: int,
        update: int,
        sums: dict[str, float],
    ) -> int:
        """One optimizer step on mini-batch ``update`` of the rollout; adds its metrics into ``sums`` (the
        largest log-prob gap of the first one into ``sums["logprob_diff"]``). Returns: 1 if the step applied."""
        cfg = self.config
        per_update = len(rollout.prompts) // cfg.updates_per_rollout
        traj = rollout.trajectories
        steps = self._train_steps(step, update)
        loss_total = 0.0
        for start in range(update * per_update, (update + 1) * per_update, cfg.micro_batch_size):
            rows = slice(start, min(start + cfg.micro_batch_size, (update + 1) * per_update))
            mb_traj = Trajectories(traj.latents[rows], traj.sigmas, traj.log_probs[rows])
            mb_cond = cond.rows(rows)
            mb_uncond = uncond.rows(rows) if uncond is not None else None
            weight = (rows.stop - rows.start) / per_update
            for i in steps:  # one backward per denoising step: activations of one step at a time
                loss, metrics = self._step_loss(
                    rollout, mb_traj, mb_cond, mb_uncond, rows, i, seed=(step, update, rows.start)
                )
                diff = metrics.pop("logprob_diff", None)
                if diff is not None and update == 0:
                    sums["logprob_diff"] = max(sums.get("logprob_diff", 0.0), float(diff))
                scale = weight / len(steps)
                (loss * scale).backward()
                loss_total += float(loss.detach()) * scale
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value) * scale / cfg.updates_per_rollout
        grad_norm, ok = guarded_step(
            self.policy, self.optimizer, self.scheduler, loss=loss_total, grad_clip=cfg.grad_clip,
            skip_nonfinite=cfg.skip_nonfinite_steps, step=step, what="transformer", lr_key="algorithm.lr",
        )  # fmt: skip
        sums["loss"] += loss_total / cfg.updates_per_rollout
        sums["grad_norm"] += grad_norm / cfg.updates_per_rollout
        return int(ok)

    def _step_loss(
        self,
        rollout: Rollout,
        traj: Trajectories,
        cond: Conditioning,
        uncond: Conditioning | None,
        rows: slice,
        i: int,
        *,
        seed: tuple[int, int, int],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of denoising step ``i`` of the micro-batch ``rows`` (``config.loss``), and its metrics."""
        cfg = self.config
        advantages = rollout.advantages[rows].to(traj.latents.device)
        if cfg.loss == "diffusion_nft":  # flow matching at the step's time on the sampled clean images
            x0 = traj.latents[:, -1]
            step, update, start = seed
            generator = torch.Generator().manual_seed(cfg.seed * 104_729 + step * 8191 + update * 127 + start * 31 + i)
            eps = torch.randn(x0.shape, generator=generator).to(x0.device)
            sigma = traj.sigmas[i]
            x_t, target = forward_noised(x0, sigma, eps)
            with torch.no_grad():
                v_old = velocity(self.rollout_transformer, x_t, sigma, cond)
            v_theta = velocity(self.policy, x_t, sigma, cond)
            r = optimality(advantages.clamp(-cfg.advantage_clip, cfg.advantage_clip), scale=cfg.nft_reward_scale)
            return diffusion_nft_loss(v_theta, v_old, target, r, beta=cfg.nft_beta)
        kwargs = dict(noise_level=cfg.noise_level, uncond=uncond, guidance_scale=cfg.guidance_scale)
        current = step_transition(self.policy, traj, cond, i, **kwargs)
        old = traj.log_probs[:, [i]]
        kl = None
        if cfg.kl_coef > 0:
            with torch.no_grad(), self._reference() as reference_model:
                reference = step_transition(reference_model, traj, cond, i, **kwargs)
            kl = gaussian_kl(current.mean, reference.mean, current.scale)[:, None]
        loss, metrics = flow_grpo_loss(
            current.log_prob[:, None], old, advantages, torch.ones_like(old, dtype=torch.bool),
            clip_low=cfg.clip_range, clip_high=cfg.clip_range, advantage_clip=cfg.advantage_clip,
            kl=kl, kl_coef=cfg.kl_coef,
        )  # fmt: skip
        metrics["logprob_diff"] = (current.log_prob.detach()[:, None] - old).abs().max()
        return loss, metrics

    @torch.no_grad()
    def _soft_update(self) -> float:
        """DiffusionNFT's soft update of the old policy after this step's optimizer steps (``old_policy_decay``).
        Returns: eta."""
        cfg = self.config
        eta = old_policy_decay(
            int(self.scheduler.last_epoch), rate=cfg.nft_decay_rate, max_decay=cfg.nft_decay_max,
            delay=cfg.nft_decay_delay,
        )  # fmt: skip
        for name, param in self.policy.named_parameters():
            if name in self.old_params:
                self.old_params[name].mul_(eta).add_(param.detach(), alpha=1.0 - eta)
        return eta

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The KL reference, the run's starting transformer: a frozen copy, or with LoRA the policy with its
        adapters off (the base weights never train)."""
        if self.reference is not None:
            yield self.reference
            return
        with adapters_disabled(self.policy):
            yield self.policy

    def step(self, prompts: Sequence[str]) -> dict[str, float]:
        """One Flow-GRPO step (module docstring) on ``prompts``.

        Returns: its metrics (``reward/*``, ``loss``, ``grad_norm``, ``clipfrac``, ``approx_kl``,
        ``train_rollout_logprob_max_abs_diff``, ``optimizer_steps``, ``weight_version``, ``time/*`` in s).
        Raises: RewardFailed (``rollout``).
        """
        if not prompts:
            raise ValueError("step needs at least one prompt")
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
        (held out: keep it apart from ``config.seed``). Returns: (mean reward, images [B, H, W, 3] uint8).
        Raises: RewardFailed (``score``)."""
        cond, uncond = self._conditions(prompts)
        latents = sample_ode(
            self.rollout_transformer, cond, latent_shape=self.model.latent_shape, num_steps=self.config.num_steps,
            shift=self.config.shift, uncond=uncond, guidance_scale=self.config.guidance_scale,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        images = to_uint8(self.model.decode(latents))
        rewards = self.score(prompts, images).tolist()
        return (math.fsum(rewards) / len(rewards), images)

    def state_dict(self) -> dict[str, Any]:
        """What an exact resume needs: the transformer (with LoRA its adapters only: the base is the run's model as
        loaded), the optimizer, the LR schedule, the step count, the rollout copy's weight version, and with
        ``nft_decay_rate`` the old policy (``old_params``: the soft-updated trainable parameters)."""
        transformer = self.policy.state_dict()
        if self.config.lora is not None:
            transformer = {name: t for name, t in transformer.items() if ".lora_" in name}
        extra = {"old_params": {n: t.clone() for n, t in self.old_params.items()}} if self.old_params else {}
        return {
            **extra,
            "weight_version": self.receiver.weight_version,
            "transformer": transformer,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps_done": self.steps_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output and publish the weights to the rollout copy with the saved weight
        version (versions only grow: a fresh trainer's copy holds v1).

        The optimizer's moments and the schedule's position come from ``state``; its settings (``lr``,
        ``weight_decay``, ``warmup_steps``) from this trainer's config, so a resumed run may change them (a changed
        one is logged).
        """
        cfg = self.config
        if cfg.lora is None:
            self.policy.load_state_dict(state["transformer"])
        else:  # the adapters onto the base as loaded, every one of them
            held = {name for name in self.policy.state_dict() if ".lora_" in name}
            if set(state["transformer"]) != held:
                missing, extra = sorted(held - set(state["transformer"])), sorted(set(state["transformer"]) - held)
                raise ValueError(
                    f"the saved LoRA adapters do not fit algorithm.lora: missing {missing[:3]}, unexpected "
                    f"{extra[:3]} (a checkpoint of another algorithm.lora.target_modules?)"
                )
            self.policy.load_state_dict(state["transformer"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        saved = state["optimizer"]["param_groups"][0]
        for key, now in (("lr", cfg.lr), ("weight_decay", cfg.weight_decay)):
            before = saved.get("initial_lr" if key == "lr" else key)
            if before is not None and before != now:
                logger.info("algorithm.%s changed on resume: %g -> %g", key, before, now)
        for group in self.optimizer.param_groups:
            group["initial_lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
        optimizer_steps = int(state["scheduler"]["last_epoch"])  # the schedule's position: steps applied
        self.scheduler = warmup_schedule(self.optimizer, warmup_steps=cfg.warmup_steps, steps_done=optimizer_steps)
        self.steps_done = int(state["steps_done"])
        if self.old_params is not None:
            if "old_params" in state:
                for name, tensor in state["old_params"].items():
                    self.old_params[name].copy_(tensor)
            else:  # a checkpoint of a run without the soft update: it starts from the trained weights
                logger.info("algorithm.nft_decay_rate is on but the checkpoint has no old policy: it starts as the "
                            "checkpoint's weights")  # fmt: skip
                for name, param in self.policy.named_parameters():
                    if name in self.old_params:
                        self.old_params[name].copy_(param.detach())
        self.publish(version=max(int(state["weight_version"]), self.sender.version + 1), everything=True)
