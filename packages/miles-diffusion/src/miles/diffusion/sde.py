"""Flow-matching sampling as a stochastic process whose every denoising step has a Gaussian transition log-prob.

A rectified-flow model predicts the velocity v(x_t, t) of x_t = (1 - t) x_0 + t eps (t = 1: noise, t = 0: data).
Its ODE sampler, x_{t + dt} = x_t + v dt with dt < 0, is deterministic: no per-step probability to train with a
policy gradient. Flow-GRPO (Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv:2505.05470,
Eq. 9-12) samples instead from the reverse-time SDE with the same marginals as the ODE,

    x_{t + dt} = x_t + [v + s_t^2 / (2 t) * (x_t + (1 - t) v)] dt + s_t sqrt(|dt|) eps,
    s_t = a * sqrt(t / (1 - t)),

(a = ``noise_level``), so each step is x_next ~ N(mean, (s_t sqrt(|dt|))^2 I) and its log-density is known in closed
form: the policy's "log-prob" of a denoising step. At t = 1 the ratio t / (1 - t) is infinite; as Flow-GRPO does,
the denominator then uses ``sigma_max``, the first time below 1 of the schedule.

Per-step log-probs here are the Gaussian log-density averaged over a sample's elements (not summed), as Flow-GRPO
computes them: the importance ratio exp(log_prob - old_log_prob) then stays O(1) whatever the latent size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class SDEStep:
    """One denoising step of ``sde_step``.

    Attributes:
        x_next: [B, ...] the sample at the next (smaller) time.
        mean: [B, ...] the Gaussian transition's mean (a function of the model's velocity: carries its grad).
        scale: [B, 1, ...] its standard deviation s_t sqrt(|dt|), broadcastable to ``mean``.
        log_prob: [B] float32, ``transition_log_prob(x_next, mean, scale)``.
    """

    x_next: Tensor
    mean: Tensor
    scale: Tensor
    log_prob: Tensor


def _per_sample(value: Tensor | float, like: Tensor) -> Tensor:
    """A scalar or [B] time as [B, 1, ..., 1] (broadcastable to ``like`` [B, ...]), float32."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.dim() == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.dim() - 1)))


def noise_std(sigma: Tensor | float, *, noise_level: float, sigma_max: float) -> Tensor:
    """Flow-GRPO's diffusion coefficient s_t = a * sqrt(t / (1 - t)) at t = ``sigma``; where t >= 1 the denominator
    is 1 - ``sigma_max``.

    Args:
        sigma: time(s) in (0, 1], a float or a tensor.
        noise_level: a >= 0 (Flow-GRPO uses 0.7); 0 gives the deterministic ODE step.
        sigma_max: the schedule's first time below 1, used in the denominator at t = 1.
    Returns: float32 tensor of ``sigma``'s shape.
    Raises: ValueError for a negative noise level or sigma_max outside (0, 1).
    """
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    if not 0.0 < sigma_max < 1.0:
        raise ValueError(f"sigma_max must be in (0, 1) (the schedule's first time below 1), got {sigma_max}")
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    denominator = 1.0 - torch.where(sigma >= 1.0, torch.full_like(sigma, sigma_max), sigma)
    return noise_level * torch.sqrt(sigma / denominator)


def transition_log_prob(x_next: Tensor, mean: Tensor, scale: Tensor) -> Tensor:
    """log N(x_next; mean, scale^2 I), averaged over each sample's elements.

    Args:
        x_next: [B, ...] the step's outcome (its gradient is not taken: it is the sampled action).
        mean: [B, ...] the transition mean; carries the policy's grad.
        scale: [B, 1, ...] or broadcastable, > 0.
    Returns: [B] float32 (mean over all but the first dim of -(x - m)^2 / (2 s^2) - log s - log sqrt(2 pi)).
    """
    x_next, mean = x_next.detach().float(), mean.float()
    scale = scale.float().expand_as(mean)
    log_density = -((x_next - mean) ** 2) / (2 * scale**2) - torch.log(scale) - LOG_SQRT_2PI
    return log_density.flatten(1).mean(dim=1)


def sde_step(
    x: Tensor,
    velocity: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    *,
    noise_level: float,
    sigma_max: float,
    x_next: Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> SDEStep:
    """One step from time ``sigma`` to ``sigma_next`` < ``sigma`` of the marginal-preserving SDE (module docstring).

    Args:
        x: [B, ...] the sample at ``sigma``.
        velocity: [B, ...] the model's v(x, sigma) (carries grad when training).
        sigma, sigma_next: float or [B] times, 1 >= sigma > sigma_next >= 0.
        noise_level: a > 0.
        sigma_max: see ``noise_std``.
        x_next: the outcome to score (training recomputes the log-prob of the sampled step); None samples one
            with ``generator``.
        generator: the noise's generator (sampling only; on ``x``'s device).
        noise: the standard normal noise of the step [B, ...] (sampling only), instead of drawing it.
    Returns: ``SDEStep``.
    Raises: ValueError for noise_level <= 0 (no density: use the ODE) or times that do not decrease.
    """
    if noise_level <= 0:
        raise ValueError(f"sde_step needs noise_level > 0 for a transition density, got {noise_level}")
    t, t_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    if bool((t_next >= t).any()) or bool((t > 1).any()) or bool((t_next < 0).any()):
        raise ValueError("sde_step goes from sigma to a smaller sigma_next, both in [0, 1]")
    dt = t_next - t  # < 0
    std = noise_std(t, noise_level=noise_level, sigma_max=sigma_max).to(x.device)
    x32, v32 = x.float(), velocity.float()
    mean = x32 + (v32 + std**2 / (2 * t) * (x32 + (1 - t) * v32)) * dt
    scale = std * torch.sqrt(-dt)
    if x_next is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        x_next = (mean + scale * noise.float()).detach()
    return SDEStep(x_next=x_next, mean=mean, scale=scale, log_prob=transition_log_prob(x_next, mean, scale))


def ode_step(x: Tensor, velocity: Tensor, sigma: Tensor | float, sigma_next: Tensor | float) -> Tensor:
    """The deterministic Euler step x + v * (sigma_next - sigma) of the flow ODE (evaluation sampling).

    Args: x, velocity [B, ...]; sigma, sigma_next float or [B]. Returns: [B, ...] float32.
    """
    dt = _per_sample(sigma_next, x) - _per_sample(sigma, x)
    return x.float() + velocity.float() * dt
