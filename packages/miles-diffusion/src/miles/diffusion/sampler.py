"""Sampling a flow-matching transformer as a policy: trajectories of latents with each step's log-prob, and their
recompute with gradients for training.

The model is a diffusers flow-matching transformer of one of two families, told apart by its class:

- SD3 / SD3.5 (``SD3Transformer2DModel``): latents [B, C, H, W], text embeddings, pooled embedding, timestep =
  1000 * sigma; it returns the velocity. Classifier-free guidance is v_u + g (v_c - v_u), as SD3's pipeline.
- Qwen-Image (``QwenImageTransformer2DModel``): latents packed into 2 x 2 patches ([B, H/2 * W/2, 4C]), text
  embeddings with their padding mask, timestep = sigma, the image's patch grid for its RoPE; no pooled embedding.
  Guidance is its pipeline's "true CFG": v_u + g (v_c - v_u), rescaled per patch to the norm of v_c.

Latents stay [B, C, H, W] here whatever the family (the SDE works elementwise); the Qwen-Image call packs and
unpacks them. Times come from diffusers' ``FlowMatchEulerDiscreteScheduler`` (``shift`` as SD3's; a model with its
own schedule, Qwen-Image's dynamic shift, passes ``sigmas``), from 1 (noise) down to 0. Every step is a transition
of ``miles.diffusion.sde.sde_step``; guidance, when on, mixes the conditional and unconditional velocities before the
step, so the log-prob is that of the guided policy (as Flow-GRPO samples and trains).
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
        pooled: [B, P] float, the pooled text embedding (SD3); None for a model without one (Qwen-Image).
        mask: [B, L] bool, True at real tokens, False at padding (Qwen-Image: prompts of a batch differ in length);
            None: every token is real.
    """

    prompt_embeds: Tensor
    pooled: Tensor | None = None
    mask: Tensor | None = None

    def rows(self, index: Tensor | slice) -> Conditioning:
        """The conditioning of some images."""
        return Conditioning(
            self.prompt_embeds[index],
            None if self.pooled is None else self.pooled[index],
            None if self.mask is None else self.mask[index],
        )


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


def _schedule(num_steps: int, shift: float, sigmas: Tensor | None) -> Tensor:
    if sigmas is None:
        return flow_sigmas(num_steps, shift=shift)
    if sigmas.shape != (num_steps + 1,):
        raise ValueError(f"sigmas holds {tuple(sigmas.shape)} times, {num_steps} steps need {num_steps + 1}")
    return sigmas.to(torch.float32)


def velocity(
    transformer: torch.nn.Module,
    x: Tensor,
    sigma: float | Tensor,
    cond: Conditioning,
    *,
    uncond: Conditioning | None = None,
    guidance_scale: float = 1.0,
) -> Tensor:
    """The (guided) velocity at ``x``: v_c, or with ``uncond`` and g = ``guidance_scale`` v_u + g (v_c - v_u)
    (Qwen-Image: that rescaled per 2 x 2 patch to the norm of v_c, as its pipeline's true CFG).

    Args: x [B, C, H, W]; sigma a float or [B] time; cond / uncond per image. Returns: [B, C, H, W] float32.
    """
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0])
    if is_qwen_image(transformer):
        if uncond is None or guidance_scale == 1.0:
            return _qwen_forward(transformer, x, sigma, cond).float()
        v_cond = _qwen_forward(transformer, x, sigma, cond).float()  # two calls, as its pipeline: prompts differ
        v_uncond = _qwen_forward(transformer, x, sigma, uncond).float()  # in length
        guided = pack_latents(v_uncond + guidance_scale * (v_cond - v_uncond))
        cond_norm = pack_latents(v_cond).norm(dim=-1, keepdim=True)
        return unpack_latents(guided * (cond_norm / guided.norm(dim=-1, keepdim=True)), x.shape[-2:])
    timestep = sigma * 1000
    if uncond is None or guidance_scale == 1.0:
        return _forward(transformer, x, timestep, cond).float()
    both = _forward(transformer, torch.cat([x, x]), torch.cat([timestep, timestep]),
                    Conditioning(torch.cat([uncond.prompt_embeds, cond.prompt_embeds]),
                                 torch.cat([uncond.pooled, cond.pooled]))).float()  # fmt: skip
    v_uncond, v_cond = both.chunk(2)
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def is_qwen_image(transformer: torch.nn.Module) -> bool:
    """Whether ``transformer`` is a Qwen-Image one (``QwenImageTransformer2DModel``, also once FSDP2 or peft wrapped
    it in place), by its class name: no diffusers import."""
    return any(cls.__name__ == "QwenImageTransformer2DModel" for cls in type(transformer).__mro__)


def pack_latents(x: Tensor) -> Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C]: 2 x 2 patches in row-major order, each (c, dy, dx) flattened, as
    ``QwenImagePipeline._pack_latents``. Raises: RuntimeError for odd H or W."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x: Tensor, size: Sequence[int]) -> Tensor:
    """The inverse of ``pack_latents``: [B, H/2 * W/2, 4C] -> [B, C, H, W] with (H, W) = ``size``."""
    b, _, d = x.shape
    h, w = size
    return x.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def weight_dtype(transformer: torch.nn.Module) -> torch.dtype:
    """The dtype of ``transformer``'s weights (its first parameter's): what its inputs are cast to (a bfloat16
    sampling copy gets bfloat16 latents and text embeddings; float32 comes back out of ``velocity``)."""
    return next(transformer.parameters()).dtype


def _qwen_forward(transformer: torch.nn.Module, x: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
    h, w = x.shape[-2:]
    dtype = weight_dtype(transformer)
    mask = cond.mask
    if mask is not None and bool(mask.all()):
        mask = None  # as its pipeline: no mask when every token is real
    out = transformer(
        hidden_states=pack_latents(x.to(dtype)),
        encoder_hidden_states=cond.prompt_embeds.to(dtype),
        encoder_hidden_states_mask=mask,
        timestep=sigma.to(dtype),
        img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0],
        return_dict=False,
    )[0]
    return unpack_latents(out, (h, w))


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
    dtype = weight_dtype(transformer)
    return transformer(
        hidden_states=x.to(dtype),
        encoder_hidden_states=cond.prompt_embeds.to(dtype),
        pooled_projections=cond.pooled.to(dtype),
        timestep=timestep,  # float32, as SD3's pipeline passes it: its sinusoidal embedding is computed in float32
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
    sigmas: Tensor | None = None,
) -> Trajectories:
    """Sample one trajectory per row of ``cond`` with the SDE (every step stochastic, with its log-prob).

    Args:
        transformer: the flow-matching transformer (SD3 or Qwen-Image, module docstring).
        cond: B rows of conditioning; uncond / guidance_scale: classifier-free guidance (off at 1.0).
        latent_shape: (C, H, W) of one latent.
        num_steps: T denoising steps; noise_level: Flow-GRPO's a (> 0); shift: the schedule's shift.
        generator: draws the initial noise and every step's noise.
        rows: ``(total, index)``: ``cond`` holds rows ``index`` (int64 [B]) of a batch of ``total``, and each gets the
            noise that row gets when the whole batch is sampled at once (ranks sampling their parts of a batch).
        sigmas: [T + 1] times from 1 down to 0, the model's own schedule (Qwen-Image's dynamic shift); None:
            ``flow_sigmas(num_steps, shift=shift)``.
    Returns: ``Trajectories`` on the transformer's device.
    Raises: ValueError when ``sigmas`` does not hold T + 1 times.
    """
    device = cond.prompt_embeds.device
    sigmas = _schedule(num_steps, shift, sigmas).to(device)
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
    sigmas: Tensor | None = None,
) -> Tensor:
    """Sample with the deterministic flow ODE (Euler, ``ode_step``): the evaluation sampler, as Flow-GRPO evaluates.

    Args: as ``sample``. Returns: the final latents [B, C, H, W] float32.
    """
    device = cond.prompt_embeds.device
    sigmas = _schedule(num_steps, shift, sigmas).to(device)
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
