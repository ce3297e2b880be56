"""DiffusionNFT's objective: reinforcement on the forward (noising) process, with no log-probs and any sampler.

DiffusionNFT (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", arXiv:2509.16117,
Eq. 6-8) trains the velocity with flow matching on the sampled clean images, split between an implicit positive
policy v+ = (1 - b) v_old + b v_theta and an implicit negative one v- = (1 + b) v_old - b v_theta, weighted by each
image's optimality probability r in [0, 1]:

    L = E[ r ||v+(x_t, t) - v||^2 + (1 - r) ||v-(x_t, t) - v||^2 ],  x_t = (1 - t) x_0 + t eps,  v = eps - x_0,

so that a well-rewarded image pulls v_theta towards its flow-matching target and a badly rewarded one pushes it away
(relative to the sampling policy v_old, held fixed). r = 0.5 + 0.5 clip(A / Z, -1, 1) from the advantage A.
"""

from __future__ import annotations

import torch
from torch import Tensor


def optimality(advantages: Tensor, *, scale: float) -> Tensor:
    """DiffusionNFT's optimality probability r = 0.5 + 0.5 * clip(A / scale, -1, 1).

    Args: advantages [B] float (group-normalized rewards); scale: Z > 0. Returns: [B] float32 in [0, 1].
    Raises: ValueError for scale <= 0.
    """
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    return 0.5 + 0.5 * (advantages.float() / scale).clamp(-1.0, 1.0)


def forward_noised(x0: Tensor, t: Tensor | float, eps: Tensor) -> tuple[Tensor, Tensor]:
    """The rectified-flow forward process: x_t = (1 - t) x0 + t eps and its velocity target v = eps - x0.

    Args: x0 [B, ...] clean samples; t a float or [B] times in [0, 1]; eps [B, ...] standard normal noise.
    Returns: (x_t, v), both [B, ...] float32.
    """
    t = torch.as_tensor(t, dtype=torch.float32, device=x0.device)
    t = t.expand(x0.shape[0]) if t.dim() == 0 else t
    t = t.reshape(-1, *([1] * (x0.dim() - 1)))
    x0, eps = x0.float(), eps.float()
    return (1 - t) * x0 + t * eps, eps - x0


def diffusion_nft_loss(
    v_theta: Tensor, v_old: Tensor, v_target: Tensor, r: Tensor, *, beta: float = 1.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """DiffusionNFT's loss (module docstring), averaged over elements and images.

    Args:
        v_theta: [B, ...] the trained model's velocity (carries grad).
        v_old: [B, ...] the sampling policy's velocity at the same points (no grad).
        v_target: [B, ...] the flow-matching target eps - x0.
        r: [B] optimality probabilities in [0, 1].
        beta: b > 0, how far the implicit policies sit from v_old (1.0: v+ = v_theta).
    Returns: (scalar loss, metrics: ``nft/positive_mse`` and ``nft/negative_mse``, each mean over images).
    Raises: ValueError for beta <= 0 or shape mismatches.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if v_theta.shape != v_old.shape or v_theta.shape != v_target.shape or r.shape != v_theta.shape[:1]:
        raise ValueError(
            f"shapes differ: v_theta {tuple(v_theta.shape)}, v_old {tuple(v_old.shape)}, "
            f"v_target {tuple(v_target.shape)}, r {tuple(r.shape)}"
        )
    v_theta, v_old, v_target = v_theta.float(), v_old.detach().float(), v_target.float()
    positive = ((1 - beta) * v_old + beta * v_theta - v_target).pow(2).flatten(1).mean(1)
    negative = ((1 + beta) * v_old - beta * v_theta - v_target).pow(2).flatten(1).mean(1)
    r = r.float()
    loss = (r * positive + (1 - r) * negative).mean()
    return loss, {"nft/positive_mse": positive.detach().mean(), "nft/negative_mse": negative.detach().mean()}


def old_policy_decay(optimizer_steps: int, *, rate: float, max_decay: float, delay: int = 0) -> float:
    """DiffusionNFT's soft-update coefficient eta of the old (sampling) policy after ``optimizer_steps`` updates:
    ``theta_old <- eta * theta_old + (1 - eta) * theta``, with ``eta = min(rate * (optimizer_steps - delay),
    max_decay)`` from ``delay`` steps on and 0 before (the reference implementation's schedule: rate 1e-3, max 0.5 by
    default; delay 75, rate 7.5e-3, max 0.999 for OCR). eta = 0 makes the old policy the trained one.

    Raises: ValueError for a negative rate or delay, or max_decay outside [0, 1).
    """
    if rate < 0 or delay < 0 or not 0 <= max_decay < 1:
        raise ValueError(f"need rate >= 0, delay >= 0 and 0 <= max_decay < 1, got {rate}, {delay}, {max_decay}")
    if optimizer_steps < delay:
        return 0.0
    return min((optimizer_steps - delay) * rate, max_decay)
