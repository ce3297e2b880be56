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

Several ranks (``mesh``, data parallel): the transformer is sharded with FSDP2 (each transformer block, then the
root) and every rank holds a whole rollout copy. A step's batch is split so that each rank holds an equal part of
every mini-batch; each rank samples its rows with the noise those rows get when one process samples the whole batch,
rewards them, and the rewards are gathered so advantages and metrics are those of the whole batch. The averaged
gradients and the step then equal one process's (up to fp32 summation order). An SGLang-diffusion engine is not
wired here yet.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from miles.core.algorithms.advantages import grpo_advantages
from miles.diffusion.config import FlowGRPOConfig
from miles.diffusion.flow_grpo import flow_grpo_loss, gaussian_kl
from miles.diffusion.models import FlowModel, cast_module
from miles.diffusion.nft import diffusion_nft_loss, forward_noised, old_policy_decay, optimality
from miles.diffusion.rewards import to_uint8
from miles.diffusion.sampler import (
    Conditioning,
    Trajectories,
    is_qwen_image,
    sample,
    sample_ode,
    step_transition,
    velocity,
    weight_dtype,
)
from miles.diffusion.sglang_api import RolloutSettings
from miles.sync import InProcessTransport, WeightReceiver, WeightSender
from miles.sync.errors import WeightUpdateError
from miles.train.fsdp2.lora import adapter_dropout, adapters_disabled, apply_lora, full_tensor, merged_weights
from miles.train.fsdp2.optimizer import guarded_step, warmup_schedule
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from miles.diffusion.sglang import SGLangDiffusionEngine, SGLangDiffusionWeightSink

logger = logging.getLogger(__name__)

# (prompts, images [B, H, W, 3] uint8) -> one reward per image
ImageReward = Callable[[Sequence[str], np.ndarray], Sequence[float]]


class RewardFailed(ValueError):
    """The reward function raised, or returned other than one finite float per image (the message says which)."""


@dataclass(frozen=True)
class Rollout:
    """One step's samples.

    B is the step's whole batch (``prompts_per_step`` x ``group_size`` images, each prompt's group in a row), b the
    rows this rank holds (``rows``; b = B on one rank).

    Attributes:
        prompts: [b] the prompt of each image.
        trajectories: their SDE trajectories and per-step log-probs.
        images: [b, H, W, 3] uint8, the decoded final samples.
        rewards: [b] float32.
        advantages: [b] float32, normalized in the groups of the whole batch.
        weight_version: the rollout copy's weight version that sampled them.
        rows: [b] int64, the rows' indices in the whole batch.
        all_rewards: [B] float32, every rank's rewards in batch order.
    """

    prompts: list[str]
    trajectories: Trajectories
    images: np.ndarray
    rewards: Tensor
    advantages: Tensor
    weight_version: int
    rows: Tensor
    all_rewards: Tensor


def rank_rows(batch: int, updates: int, rank: int, world_size: int) -> Tensor:
    """The rows of a batch that one of ``world_size`` data-parallel ranks holds: of each of the ``updates``
    consecutive mini-batches, its ``rank``-th equal part, so every optimizer step averages the same images as one
    process's.

    Returns: int64 [batch / world_size], ascending.
    Raises: ValueError when ``updates x world_size`` does not divide ``batch``.
    """
    if batch % (updates * world_size):
        raise ValueError(f"{updates} mini-batches x {world_size} ranks must divide the batch of {batch} images")
    per_update = batch // updates
    part = per_update // world_size
    starts = [u * per_update + rank * part for u in range(updates)]
    return torch.cat([torch.arange(start, start + part) for start in starts])


def shard_transformer(transformer: torch.nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 (``fully_shard``) on each of the transformer's blocks, then on the rest (the root), in place: each
    block's parameters are all-gathered just for its forward and backward.

    Raises: ValueError for a transformer without ``transformer_blocks`` (SD3's and Qwen-Image's have them).
    """
    from torch.distributed.fsdp import fully_shard

    blocks = getattr(transformer, "transformer_blocks", None)
    if blocks is None:
        raise ValueError(
            f"{type(transformer).__name__} has no transformer_blocks: several ranks shard SD3 / Qwen-Image transformers"
        )
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(transformer, mesh=mesh)
    if is_qwen_image(transformer):  # its output is a Linear's 3-D view; the sampler only unpacks it out of place
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module \(FSDPQwenImageTransformer2DModel\) returned a view"
        )


class FlowGRPOTrainer:
    """Trains ``model.transformer`` with Flow-GRPO against ``reward``.

    Args:
        model: the flow model; its transformer is trained in fp32 (the master weights), a deep copy samples.
        config: the settings.
        reward: ``(prompts, images uint8 [B, H, W, 3]) -> [B]`` rewards.
        bucket_bytes: ``miles.sync`` bucket size of the weight push.
        mesh: a 1-D data-parallel mesh (gloo on CPU, NCCL on GPU) of several ranks, each running this trainer with
            the same arguments and the same prompts each step (module docstring); None: one process.
        engine: SGLang-Diffusion servers that sample the rollouts instead of the in-process copy
            (``miles.diffusion.sglang``); one process only. With it flow_grpo's old log-probs default to the
            trainer's recompute (``old_log_probs: auto``): the servers' kernels differ from the trainer's.
        weight_sink: with ``engine``, what pushes each published version to its servers (``push(named_tensors, *,
            version)``, ``SGLangDiffusionWeightSink``); the in-process copy gets every version too (evaluation and
            checkpoints read it).

    Raises: ValueError when the ranks cannot split each mini-batch equally (``rank_rows``), naming the settings, or
        for an engine without a weight sink or with several ranks.

    Attributes:
        policy: the trained transformer (with ``config.lora``: its adapters injected, peft); rollout_transformer: the
            sampling copy, a plain transformer loaded only through ``miles.sync``.
        receiver: the copy's ``WeightReceiver`` (``weight_version`` = the version it samples with).
        recompute_old_log_probs: whether flow_grpo's old log-probs are the trainer's recompute (the config's
            setting, auto resolved with the engine).
        steps_done: completed steps.
    """

    def __init__(
        self,
        model: FlowModel,
        config: FlowGRPOConfig,
        reward: ImageReward,
        *,
        bucket_bytes: int = 64 * 2**20,
        mesh: DeviceMesh | None = None,
        engine: SGLangDiffusionEngine | None = None,
        weight_sink: SGLangDiffusionWeightSink | None = None,
    ) -> None:
        self.model, self.config, self.reward = model, config, reward
        self.mesh = mesh if mesh is not None and mesh.size() > 1 else None
        if engine is not None and (weight_sink is None or self.mesh is not None):
            raise ValueError("an engine needs a weight sink and trains in one process (run.world_size 1)")
        self.engine, self.weight_sink, self._image_size = engine, weight_sink, None
        self.recompute_old_log_probs = config.recompute_old_log_probs or (
            engine is not None and config.loss == "flow_grpo" and config.old_log_probs == "auto"
        )
        self.rank, self.world_size = (mesh.get_local_rank(), mesh.size()) if self.mesh is not None else (0, 1)
        self._wire = _wire_device(self.mesh)
        try:
            self.rows = rank_rows(config.batch_size, config.updates_per_rollout, self.rank, self.world_size)
        except ValueError:
            raise ValueError(
                f"algorithm.prompts_per_step x group_size ({config.batch_size}) must split into "
                f"algorithm.updates_per_rollout ({config.updates_per_rollout}) x {self.world_size} ranks equal parts"
            ) from None
        self.policy = model.transformer.float().train()
        self.rollout_dtype = getattr(torch, config.rollout_dtype)
        self.rollout_transformer = copy.deepcopy(self.policy).eval().requires_grad_(False)
        cast_module(self.rollout_transformer, self.rollout_dtype)
        self.reference = None  # the run's starting weights, for flow_grpo's KL (LoRA: the policy, adapters off)
        if config.lora is not None:
            apply_lora(self.policy, config.lora, key="algorithm.lora")
        elif config.kl_coef > 0:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        if self.mesh is not None:
            shard_transformer(self.policy, self.mesh)
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

    def _load_rollout(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
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
        with torch.no_grad():
            version = self.sender.push(self._rollout_weights(everything=everything), version=version)
            if self.weight_sink is not None:  # the servers get what the copy got, as the same version
                self.weight_sink.push(self._rollout_weights(everything=everything), version=version)
            return version

    def _rollout_weights(self, *, everything: bool, trained: bool = False) -> Iterator[tuple[str, Tensor]]:
        """What the rollout copy samples with, as whole float32 tensors streamed one by one: the policy's weights
        (LoRA: the adapted layers' merged weights, every layer's with ``everything``), or with ``nft_decay_rate``
        the old policy's unless ``trained``. Collective on several ranks (each tensor gathered)."""
        named = self.policy.state_dict().items()
        adapters = None if trained else self.old_params
        if self.config.lora is not None:
            return merged_weights(self.policy, named if everything else self._adapted(), adapters=adapters)
        if adapters is not None:
            return ((name, full_tensor(adapters.get(name, t))) for name, t in named)
        return ((name, full_tensor(t)) for name, t in named)

    def _adapted(self) -> list[tuple[str, Tensor]]:
        """The LoRA-wrapped layers' state-dict items (base weights and biases, adapters): what merges into the
        adapted layers' weights, the only ones a LoRA step changes."""
        return [(n, t) for n, t in self.policy.state_dict().items() if ".base_layer." in n or ".lora_" in n]

    @contextlib.contextmanager
    def trained_transformer(self) -> Iterator[torch.nn.Module]:
        """A plain float32 transformer holding the trained weights inside the block (what a checkpoint's ``model/``
        saves): the policy; with LoRA or several ranks the rollout copy, which every ``train`` ends by loading with
        the (merged, whole) weights. When the copy holds something else (the old policy with ``nft_decay_rate``,
        bfloat16 roundings with ``rollout_dtype``), it is turned float32 in place, loaded with the trained weights
        (streamed, one tensor at a time) and, after the block, turned back and loaded with what the last push left
        there (derived again, bit for bit). Collective on several ranks."""
        if self.config.lora is None and self.mesh is None:
            yield self.policy
            return
        if self.old_params is None and self.rollout_dtype == torch.float32:
            yield self.rollout_transformer
            return
        self._rollout_as(torch.float32)
        self._load_rollout(self._rollout_weights(everything=True, trained=True))
        try:
            yield self.rollout_transformer
        finally:
            self._rollout_as(self.rollout_dtype)
            self._load_rollout(self._rollout_weights(everything=True))

    def _rollout_as(self, dtype: torch.dtype) -> None:
        """Convert the rollout copy to ``dtype`` in place (parameters keep their identity; buffers are replaced, so
        the name -> tensor map the weight receiver loads into is rebuilt)."""
        if weight_dtype(self.rollout_transformer) != dtype:
            cast_module(self.rollout_transformer, dtype)
            self._rollout_tensors = dict(self.rollout_transformer.state_dict(keep_vars=True))

    def _sigmas(self) -> Tensor | None:
        """The model's own schedule for ``num_steps`` (Qwen-Image); None: the sampler's SD3 schedule with ``shift``."""
        return self.model.schedule(self.config.num_steps) if self.model.schedule is not None else None

    def _conditions(self, prompts: Sequence[str]) -> tuple[Conditioning, Conditioning | None]:
        cond = self.model.encode(prompts)
        uncond = self.model.encode([""] * len(prompts)) if self.config.guidance_scale != 1.0 else None
        return cond, uncond

    def rollout(self, prompts: Sequence[str], *, step: int) -> Rollout:
        """Sample and reward ``group_size`` images per prompt with the rollout copy; the noise depends only on
        (``config.seed``, ``step``), so a resumed run samples what an uninterrupted one would.
        On several ranks each samples and rewards its rows (``rank_rows``) of the whole batch; every rank passes the
        same ``prompts``.

        Raises: RewardFailed if the reward raises or returns other than one finite float per image (on any rank).
        """
        cfg = self.config
        everyone = [prompt for prompt in prompts for _ in range(cfg.group_size)]
        rows = self._rows(len(everyone))
        expanded = [everyone[i] for i in rows.tolist()]
        if self.engine is not None:
            seeds = [((cfg.seed * 1_000_003 + step) * 4099 + i) % 2**31 for i in range(len(prompts))]
            trajectories, images = self.engine.generate(
                prompts, n=cfg.group_size, seeds=seeds, settings=self._engine_settings(),
                latent_shape=self.model.latent_shape,
            )  # fmt: skip
        else:
            cond, uncond = self._conditions(expanded)
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            trajectories = sample(
                self.rollout_transformer, cond, latent_shape=self.model.latent_shape, num_steps=cfg.num_steps,
                noise_level=cfg.noise_level, shift=cfg.shift, uncond=uncond, guidance_scale=cfg.guidance_scale,
                generator=generator, rows=(len(everyone), rows) if self.mesh is not None else None,
                sigmas=self._sigmas(),
            )  # fmt: skip
            with torch.no_grad():
                images = to_uint8(self.model.decode(trajectories.latents[:, -1]))
        rewards = self._score_everywhere(expanded, images)
        all_rewards = self._gather_rows(rewards, len(everyone))
        group_index = torch.arange(len(prompts)).repeat_interleave(cfg.group_size)
        advantages = grpo_advantages(all_rewards, group_index, normalize_std=cfg.normalize_std)[rows]
        return Rollout(
            expanded, trajectories, images, rewards, advantages, self.receiver.weight_version, rows, all_rewards
        )

    def _engine_settings(self) -> RolloutSettings:
        """What each engine request asks for: the algorithm's steps, noise and guidance, the model's image size
        (found once by decoding a zero latent)."""
        cfg = self.config
        if self._image_size is None:
            with torch.no_grad():
                device = next(self.policy.parameters()).device
                self._image_size = tuple(self.model.decode(torch.zeros(1, *self.model.latent_shape, device=device))
                                         .shape[-2:])  # fmt: skip
        height, width = self._image_size
        return RolloutSettings(cfg.num_steps, cfg.noise_level, cfg.guidance_scale, true_cfg=is_qwen_image(self.policy),
                               width=width, height=height)  # fmt: skip

    def _rows(self, batch: int) -> Tensor:
        """This rank's rows of a batch of ``batch`` images (all of them on one process)."""
        if batch == self.config.batch_size:
            return self.rows
        try:
            return rank_rows(batch, self.config.updates_per_rollout, self.rank, self.world_size)
        except ValueError as err:
            raise ValueError(f"{batch} images per step: {err}") from None

    def _score_everywhere(self, prompts: Sequence[str], images: np.ndarray) -> Tensor:
        """``score`` on every rank; a failure on one rank raises RewardFailed on all (none waits for the others)."""
        rewards, failure = torch.zeros(len(prompts)), None
        if prompts:  # a rank with no rows (an evaluation of fewer prompts than ranks) calls no reward
            try:
                rewards = self.score(prompts, images)
            except RewardFailed as err:
                failure = err
        if self.mesh is None:
            if failure is not None:
                raise failure
            return rewards
        failed = torch.tensor([float(failure is not None)], device=self._wire)
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX, group=self.mesh.get_group())
        if failure is not None:
            raise failure
        if failed.item():
            raise RewardFailed("the reward failed on another rank (its log names the error)")
        return rewards

    def _gather_rows(self, values: Tensor, batch: int) -> Tensor:
        """Every rank's ``values`` [b] (its rows, ``_rows``) as one [batch] tensor in batch order."""
        if self.mesh is None:
            return values
        mine = values.to(self._wire).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, mine, group=self.mesh.get_group())
        out = torch.empty(batch, dtype=values.dtype)
        for rank, part in enumerate(parts):
            out[rank_rows(batch, self.config.updates_per_rollout, rank, self.world_size)] = part.cpu()
        return out

    def _reduce(self, values: dict[str, float], *, op: str) -> dict[str, float]:
        """``values`` averaged (``op="mean"``) or maximized (``"max"``) over the ranks, keys in the same order."""
        if self.mesh is None or not values:
            return values
        keys = sorted(values)
        packed = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self._wire)
        reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(packed, op=reduce_op, group=self.mesh.get_group())
        if op == "mean":
            packed /= self.world_size
        return dict(zip(keys, packed.cpu().tolist()))

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
        if self.recompute_old_log_probs:
            rollout, sums["recompute_diff"] = self._recompute_old_log_probs(rollout, cond, uncond, step=step)
        applied = 0
        dropout = adapter_dropout(self.policy) if cfg.lora is not None else contextlib.nullcontext()
        with dropout:
            for update in range(cfg.updates_per_rollout):
                applied += self._update(rollout, cond, uncond, step=step, update=update, sums=sums)
        global_keys = {"loss", "grad_norm", "logprob_diff", "recompute_diff"}  # the whole batch's, or a maximum
        sums.update(self._reduce({k: v for k, v in sums.items() if k not in global_keys}, op="mean"))
        if "recompute_diff" in sums:  # the sampler's gap over the whole rollout, not the recompute's own 0
            sums["logprob_diff"] = sums.pop("recompute_diff")
        if "logprob_diff" in sums:
            sums.update(self._reduce({"logprob_diff": sums["logprob_diff"]}, op="max"))
        if self.old_params is not None:
            sums["nft/old_decay"] = self._soft_update()
        version = self.publish()
        if cfg.loss == "flow_grpo":
            sums["train_rollout_logprob_max_abs_diff"] = sums.pop("logprob_diff")
        return {**sums, "optimizer_steps": float(applied), "weight_version": float(version)}

    @torch.no_grad()
    def _recompute_old_log_probs(
        self, rollout: Rollout, cond: Conditioning, uncond: Conditioning | None, *, step: int
    ) -> tuple[Rollout, float]:
        """``rollout`` with the log-probs of every step this train step trains on recomputed by the trained
        transformer (as it is before the first update, no adapter dropout), in micro-batches; the other steps keep
        the sampler's. Returns: (that rollout, the largest |recomputed - sampled| on this rank)."""
        cfg = self.config
        traj = rollout.trajectories
        steps = sorted({i for update in range(cfg.updates_per_rollout) for i in self._train_steps(step, update)})
        log_probs = traj.log_probs.clone()
        kwargs = dict(noise_level=cfg.noise_level, guidance_scale=cfg.guidance_scale)
        for rows, mb_traj, mb_cond, mb_uncond in self._micro_batches(traj, cond, uncond, 0, len(rollout.prompts)):
            for i in steps:
                log_probs[rows, i] = step_transition(self.policy, mb_traj, mb_cond, i, uncond=mb_uncond,
                                                     **kwargs).log_prob  # fmt: skip
        gap = float((log_probs[:, steps] - traj.log_probs[:, steps]).abs().max()) if steps else 0.0
        recomputed = Trajectories(traj.latents, traj.sigmas, log_probs)
        return dataclasses.replace(rollout, trajectories=recomputed), gap

    def _micro_batches(
        self, traj: Trajectories, cond: Conditioning, uncond: Conditioning | None, start: int, stop: int
    ) -> Iterator[tuple[slice, Trajectories, Conditioning, Conditioning | None]]:
        """Rows ``start:stop`` in micro-batches of ``micro_batch_size``: (rows, their trajectories, conditioning,
        unconditioning)."""
        for first in range(start, stop, self.config.micro_batch_size):
            rows = slice(first, min(first + self.config.micro_batch_size, stop))
            mb_uncond = uncond.rows(rows) if uncond is not None else None
            yield rows, Trajectories(traj.latents[rows], traj.sigmas, traj.log_probs[rows]), cond.rows(rows), mb_uncond

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
        per_update = len(rollout.prompts) // cfg.updates_per_rollout  # this rank's part of the mini-batch
        batch_rows = len(rollout.all_rewards) // cfg.updates_per_rollout  # the whole mini-batch's
        traj = rollout.trajectories
        steps = self._train_steps(step, update)
        loss_total = 0.0
        micro_batches = self._micro_batches(traj, cond, uncond, update * per_update, (update + 1) * per_update)
        for rows, mb_traj, mb_cond, mb_uncond in micro_batches:
            weight = (rows.stop - rows.start) / per_update
            for i in steps:  # one backward per denoising step: activations of one step at a time
                noise_rows = rollout.rows[rows] - update * batch_rows  # rows of the mini-batch: NFT's noise
                loss, metrics = self._step_loss(
                    rollout, mb_traj, mb_cond, mb_uncond, rows, i, seed=(step, update, batch_rows, noise_rows)
                )
                diff = metrics.pop("logprob_diff", None)
                if diff is not None and update == 0:
                    sums["logprob_diff"] = max(sums.get("logprob_diff", 0.0), float(diff))
                scale = weight / len(steps)
                (loss * scale).backward()
                loss_total += float(loss.detach()) * scale
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value) * scale / cfg.updates_per_rollout
        loss_total = self._reduce({"loss": loss_total}, op="mean")["loss"]  # every rank steps, or none does
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
        seed: tuple[int, int, int, Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of denoising step ``i`` of the micro-batch ``rows`` (``config.loss``), and its metrics.
        ``seed``: (step, update, rows in the mini-batch, the micro-batch's rows in it): DiffusionNFT's noise of a row
        depends on these only, not on micro-batches or ranks."""
        cfg = self.config
        advantages = rollout.advantages[rows].to(traj.latents.device)
        if cfg.loss == "diffusion_nft":  # flow matching at the step's time on the sampled clean images
            x0 = traj.latents[:, -1]
            step, update, batch_rows, noise_rows = seed
            generator = torch.Generator().manual_seed(cfg.seed * 104_729 + step * 8191 + update * 127 + i)
            eps = torch.randn((batch_rows, *x0.shape[1:]), generator=generator)[noise_rows].to(x0.device)
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
        Raises: RewardFailed (``rollout``); with an engine, ConnectionError from its rollout (nothing changed: the
        step can run again) or WeightUpdateError from the push after the update (the step counts as done: the
        trainer and its in-process copy hold it, only the servers do not; a resume pushes every weight again).
        """
        if not prompts:
            raise ValueError("step needs at least one prompt")
        step = self.steps_done
        start = time.perf_counter()
        rollout = self.rollout(prompts, step=step)
        rollout_time = time.perf_counter() - start
        try:
            metrics = self.train(rollout, step=step)
        except WeightUpdateError:
            self.steps_done += 1
            raise
        self.steps_done += 1
        stds = rollout.all_rewards.view(-1, self.config.group_size).std(dim=1)
        return {
            "reward/mean": float(rollout.all_rewards.mean()),
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
        (held out: keep it apart from ``config.seed``). Returns: (mean reward, images [B, H, W, 3] uint8). On several
        ranks each samples every ``world_size``-th prompt and all return the whole result (collective).
        Raises: RewardFailed (``score``, on any rank)."""
        index = torch.arange(self.rank, len(prompts), self.world_size)
        mine = [prompts[i] for i in index.tolist()]
        images, rewards = None, torch.zeros(0)
        if mine:
            cond, uncond = self._conditions(mine)
            latents = sample_ode(
                self.rollout_transformer, cond, latent_shape=self.model.latent_shape, num_steps=self.config.num_steps,
                shift=self.config.shift, uncond=uncond, guidance_scale=self.config.guidance_scale,
                generator=torch.Generator().manual_seed(seed), rows=(len(prompts), index) if self.mesh else None,
                sigmas=self._sigmas(),
            )  # fmt: skip
            images = to_uint8(self.model.decode(latents))
        rewards = self._score_everywhere(mine, images) if mine or self.mesh else rewards
        if self.mesh is not None:
            parts: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(parts, (index, rewards, images), group=self.mesh.get_group())
            order = torch.cat([part[0] for part in parts]).argsort()
            rewards = torch.cat([part[1] for part in parts])[order]
            images = np.concatenate([part[2] for part in parts if part[2] is not None])[order.numpy()]
        values = rewards.tolist()
        return (math.fsum(values) / len(values), images)

    def state_dict(self) -> dict[str, Any]:
        """What an exact resume needs: the transformer (with LoRA its adapters only: the base is the run's model as
        loaded), the optimizer, the LR schedule, the step count, the rollout copy's weight version, and with
        ``nft_decay_rate`` the old policy (``old_params``: the soft-updated trainable parameters)."""
        transformer = self.policy.state_dict()
        if self.config.lora is not None:
            transformer = {name: t for name, t in transformer.items() if ".lora_" in name}
        transformer = {name: full_tensor(t) for name, t in transformer.items()}
        extra = (
            {"old_params": {n: full_tensor(t).clone() for n, t in self.old_params.items()}} if self.old_params else {}
        )
        optimizer = self.optimizer.state_dict()
        if self.mesh is not None:  # the whole moments, as one process holds them: any layout resumes from them
            whole = {i: {k: full_tensor(v) for k, v in held.items()} for i, held in optimizer["state"].items()}
            optimizer = {**optimizer, "state": whole}
        return {
            **extra,
            "weight_version": self.receiver.weight_version,
            "transformer": transformer,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "steps_done": self.steps_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output and publish the weights to the rollout copy with the saved weight
        version (versions only grow: a fresh trainer's copy holds v1).

        The optimizer's moments and the schedule's position come from ``state``; its settings (``lr``,
        ``weight_decay``, ``warmup_steps``) from this trainer's config, so a resumed run may change them (a changed
        one is logged). The tensors are whole (``state_dict``'s, of any number of ranks); several ranks take their
        shards of them.
        """
        cfg = self.config
        if cfg.lora is None:
            if set(state["transformer"]) != set(self.policy.state_dict()):
                raise ValueError("the saved transformer's tensors are not this transformer's (another model?)")
            _load_whole(self.policy, state["transformer"])
        else:  # the adapters onto the base as loaded, every one of them
            held = {name for name in self.policy.state_dict() if ".lora_" in name}
            if set(state["transformer"]) != held:
                missing, extra = sorted(held - set(state["transformer"])), sorted(set(state["transformer"]) - held)
                raise ValueError(
                    f"the saved LoRA adapters do not fit algorithm.lora: missing {missing[:3]}, unexpected "
                    f"{extra[:3]} (a checkpoint of another algorithm.lora.target_modules?)"
                )
            _load_whole(self.policy, state["transformer"])
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        moments = {
            i: {k: _shard_like(v, params[int(i)]) for k, v in held.items()}
            for i, held in state["optimizer"]["state"].items()
        }
        self.optimizer.load_state_dict({**state["optimizer"], "state": moments})
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
                    self.old_params[name].copy_(_shard_like(tensor, self.old_params[name]))
            else:  # a checkpoint of a run without the soft update: it starts from the trained weights
                logger.info("algorithm.nft_decay_rate is on but the checkpoint has no old policy: it starts as the "
                            "checkpoint's weights")  # fmt: skip
                for name, param in self.policy.named_parameters():
                    if name in self.old_params:
                        self.old_params[name].copy_(param.detach())
        self.publish(version=max(int(state["weight_version"]), self.sender.version + 1), everything=True)


def _shard_like(whole: Tensor, like: Tensor) -> Tensor:
    """``whole`` as ``like`` holds it: this rank's shard when ``like`` is a DTensor of the same shape, else as is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor) and tuple(whole.shape) == tuple(like.shape):
        return distribute_tensor(whole.to(like.dtype), like.device_mesh, like.placements)
    return whole


@torch.no_grad()
def _load_whole(module: torch.nn.Module, whole: dict[str, Tensor]) -> None:
    """Copy whole tensors into ``module``'s state by name (sharded or not); names not in ``whole`` stay."""
    held = module.state_dict()
    for name, tensor in whole.items():
        held[name].copy_(_shard_like(tensor, held[name]))


def _wire_device(mesh: DeviceMesh | None) -> torch.device:
    """Where the ranks' small collectives (rewards, metrics, flags) put their tensors: NCCL takes only this
    rank's GPU, gloo the CPU."""
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
