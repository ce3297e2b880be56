"""Sampling a flow-matching transformer as a policy: trajectories of latents with each step's log-prob, and their
recompute with gradients for training.

The model is a diffusers flow-matching transformer with SD3's call signature (``SD3Transformer2DModel``: latents,
text embeddings, pooled embedding, timestep = 1000 * sigma; it returns the velocity). Times come from diffusers'
``FlowMatchEulerDiscreteScheduler`` (``shift`` as SD3's), from 1 (noise) down to 0. Every step is a transition of
``miles.diffusion.sde.sde_step``; classifier-free guidance, when on, mixes the conditional and unconditional
velocities before the step, so the log-prob is that of the guided policy (as Flow-GRPO samples and trains).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from miles.diffusion.sde import SDEStep, ode_step, sde_step
from torch import Tensor


def noise(shape: Sequence[int], generator: torch.Generator | None, device: torch.device | str) -> Tensor:
    """Standard normal float32 noise of ``shape`` on ``device``, drawn on the generator's own device (a CPU generator
    gives the same noise whatever ``device`` is: a run samples the same on a GPU as on the CPU)."""
    where = generator.device if generator is not None else device
    return torch.randn(tuple(shape), generator=generator, device=where, dtype=torch.float32).to(device)


@dataclass(frozen=True)
class Conditioning:
    """What the transformer is conditioned on, per image.

    Attributes:
        prompt_embeds: [B, L, D] float, the text encoder's token embeddings.
        pooled: [B, P] float, the pooled text embedding.
    """

    prompt_embeds: Tensor
    pooled: Tensor

    def rows(self, index: Tensor | slice) -> Conditioning:
        """The conditioning of some images."""
        return Conditioning(self.prompt_embeds[index], self.pooled[index])


@dataclass(frozen=True)
class Trajectories:
    """B sampled denoising trajectories.

    Attributes:
        latents: [B, T + 1, C, H, W] float32: ``latents[:, 0]`` the initial noise, ``latents[:, i + 1]`` the
            outcome of step i, ``latents[:, -1]`` the final sample.
        sigmas: [T + 1] float32, the times, 1 = noise down to 0.
        log_probs: [B, T] float32, each step's transition log-prob under the weights that sampled it.
    """

    latents: Tensor
    sigmas: Tensor
    log_probs: Tensor

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]


def flow_sigmas(num_steps: int, *, shift: float = 3.0) -> Tensor:
    """The ``num_steps`` + 1 times of diffusers' ``FlowMatchEulerDiscreteScheduler`` with ``shift`` (SD3: 3.0),
    from 1.0 down to 0.0. Raises: ValueError for num_steps < 2."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if num_steps < 2:
        raise ValueError(f"num_steps must be >= 2 (the first step starts at sigma 1), got {num_steps}")
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.to(torch.float32).clone()


def velocity(
    transformer: torch.nn.Module,
    x: Tensor,
    sigma: float | Tensor,
    cond: Conditioning,
    *,
    uncond: Conditioning | None = None,
    guidance_scale: float = 1.0,
) -> Tensor:
    """The (guided) velocity at ``x``: v_c, or v_u + g (v_c - v_u) with ``uncond`` and g = ``guidance_scale``.

    Args: x [B, C, H, W]; sigma a float or [B] time; cond / uncond per image. Returns: [B, C, H, W] float32.
    """
    timestep = (torch.as_tensor(sigma, dtype=torch.float32, device=x.device) * 1000).expand(x.shape[0])
    if uncond is None or guidance_scale == 1.0:
        return _forward(transformer, x, timestep, cond).float()
    both = _forward(transformer, torch.cat([x, x]), torch.cat([timestep, timestep]),
                    Conditioning(torch.cat([uncond.prompt_embeds, cond.prompt_embeds]),
                                 torch.cat([uncond.pooled, cond.pooled]))).float()  # fmt: skip
    v_uncond, v_cond = both.chunk(2)
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def _noise_rows(
    shape: Sequence[int], generator: torch.Generator | None, device: torch.device | str, rows: tuple[int, Tensor] | None
) -> Tensor:
    """``noise(shape)``, or with ``rows = (total, index)`` rows ``index`` of the noise of ``total`` rows."""
    if rows is None:
        return noise(shape, generator, device)
    total, index = rows
    if len(index) != shape[0]:
        raise ValueError(f"rows index {len(index)} rows, the batch has {shape[0]}")
    return noise((total, *shape[1:]), generator, device)[index.to(device)]


def _forward(transformer: torch.nn.Module, x: Tensor, timestep: Tensor, cond: Conditioning) -> Tensor:
    return transformer(
        hidden_states=x.to(cond.prompt_embeds.dtype),
        encoder_hidden_states=cond.prompt_embeds,
        pooled_projections=cond.pooled,
        timestep=timestep,
        return_dict=False,
    )[0]


@torch.no_grad()
def sample(
    transformer: torch.nn.Module,
    cond: Conditioning,
    *,
    latent_shape: Sequence[int],
    num_steps: int,
    noise_level: float = 0.7,
    shift: float = 3.0,
    uncond: Conditioning | None = None,
    guidance_scale: float = 1.0,
    generator: torch.Generator | None = None,
    rows: tuple[int, Tensor] | None = None,
) -> Trajectories:
    """Sample one trajectory per row of ``cond`` with the SDE (every step stochastic, with its log-prob).

    Args:
        transformer: the flow-matching transformer (SD3 signature).
        cond: B rows of conditioning; uncond / guidance_scale: classifier-free guidance (off at 1.0).
        latent_shape: (C, H, W) of one latent.
        num_steps: T denoising steps; noise_level: Flow-GRPO's a (> 0); shift: the schedule's shift.
        generator: draws the initial noise and every step's noise.
        rows: ``(total, index)``: ``cond`` holds rows ``index`` (int64 [B]) of a batch of ``total``, and each gets the
            noise that row gets when the whole batch is sampled at once (ranks sampling their parts of a batch).
    Returns: ``Trajectories`` on the transformer's device.
    """
    device = cond.prompt_embeds.device
    sigmas = flow_sigmas(num_steps, shift=shift).to(device)
    batch = cond.prompt_embeds.shape[0]
    x = _noise_rows((batch, *latent_shape), generator, device, rows)
    latents, log_probs = [x], []
    for i in range(num_steps):
        v = velocity(transformer, x, sigmas[i], cond, uncond=uncond, guidance_scale=guidance_scale)
        step = sde_step(x, v, sigmas[i], sigmas[i + 1], noise_level=noise_level, sigma_max=float(sigmas[1]),
                        x_next=None, noise=_noise_rows(x.shape, generator, x.device, rows))  # fmt: skip
        x = step.x_next
        latents.append(x)
        log_probs.append(step.log_prob)
    return Trajectories(latents=torch.stack(latents, dim=1), sigmas=sigmas, log_probs=torch.stack(log_probs, dim=1))


@torch.no_grad()
def sample_ode(
    transformer: torch.nn.Module,
    cond: Conditioning,
    *,
    latent_shape: Sequence[int],
    num_steps: int,
    shift: float = 3.0,
    uncond: Conditioning | None = None,
    guidance_scale: float = 1.0,
    generator: torch.Generator | None = None,
    rows: tuple[int, Tensor] | None = None,
) -> Tensor:
    """Sample with the deterministic flow ODE (Euler, ``ode_step``): the evaluation sampler, as Flow-GRPO evaluates.

    Args: as ``sample``. Returns: the final latents [B, C, H, W] float32.
    """
    device = cond.prompt_embeds.device
    sigmas = flow_sigmas(num_steps, shift=shift).to(device)
    x = _noise_rows((cond.prompt_embeds.shape[0], *latent_shape), generator, device, rows)
    for i in range(num_steps):
        v = velocity(transformer, x, sigmas[i], cond, uncond=uncond, guidance_scale=guidance_scale)
        x = ode_step(x, v, sigmas[i], sigmas[i + 1])
    return x


def step_transition(
    transformer: torch.nn.Module,
    trajectories: Trajectories,
    cond: Conditioning,
    step: int,
    *,
    noise_level: float = 0.7,
    uncond: Conditioning | None = None,
    guidance_scale: float = 1.0,
) -> SDEStep:
    """Sampled step ``step`` of each trajectory as a Gaussian transition under ``transformer``'s current weights (its
    mean carries the gradient): the log-prob for the ratio, the mean and scale for a KL to a reference.

    Args: as ``sample``; step: an index in [0, T). Returns: ``SDEStep`` with ``x_next`` the sampled outcome.
    Raises: ValueError for a step out of range.
    """
    if not 0 <= step < trajectories.num_steps:
        raise ValueError(f"step {step} must lie in [0, {trajectories.num_steps})")
    sigmas = trajectories.sigmas
    x = trajectories.latents[:, step]
    v = velocity(transformer, x, sigmas[step], cond, uncond=uncond, guidance_scale=guidance_scale)
    return sde_step(x, v, sigmas[step], sigmas[step + 1], noise_level=noise_level, sigma_max=float(sigmas[1]),
                    x_next=trajectories.latents[:, step + 1])  # fmt: skip


def step_log_probs(
    transformer: torch.nn.Module,
    trajectories: Trajectories,
    cond: Conditioning,
    steps: Sequence[int],
    *,
    noise_level: float = 0.7,
    uncond: Conditioning | None = None,
    guidance_scale: float = 1.0,
) -> Tensor:
    """The log-probs of the sampled ``steps`` of each trajectory under ``transformer``'s current weights (grad flows
    to it): what the trainer recomputes for the importance ratio.

    Args: as ``sample``; steps: indices in [0, T), the steps trained on (all, or a subset: denoising reduction).
    Returns: [B, len(steps)] float32.
    Raises: ValueError for a step out of range.
    """
    if any(not 0 <= i < trajectories.num_steps for i in steps):
        raise ValueError(f"steps {list(steps)} must lie in [0, {trajectories.num_steps})")
    columns = [
        step_transition(transformer, trajectories, cond, i, noise_level=noise_level, uncond=uncond,
                        guidance_scale=guidance_scale).log_prob
        for i in steps
    ]  # fmt: skip
    return torch.stack(columns, dim=1)
