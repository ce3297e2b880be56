"""Sampling a tiny diffusers flow-matching transformer as a policy (``miles.diffusion.sampler``): the trainer's
recompute of every step's log-prob equals the sampler's, gradients reach the transformer, and a policy-gradient step
on one step's log-prob raises it."""

import pytest
import torch
from miles.diffusion.sampler import Conditioning, flow_sigmas, sample, step_log_probs, velocity


def tiny_transformer():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                 pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16)  # fmt: skip


def conditioning(batch, seed):
    gen = torch.Generator().manual_seed(seed)
    return Conditioning(torch.randn(batch, 5, 16, generator=gen), torch.randn(batch, 8, generator=gen))


def test_the_schedule_is_diffusers_shifted_one_to_zero():
    sigmas = flow_sigmas(10, shift=3.0)
    assert sigmas.shape == (11,) and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert bool((sigmas.diff() < 0).all())
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    assert torch.equal(sigmas, scheduler.sigmas.float())  # diffusers' own schedule, SD3's shift
    assert bool((flow_sigmas(10, shift=3.0)[1:-1] > flow_sigmas(10, shift=1.0)[1:-1]).all())  # shift: more noise


@pytest.mark.parametrize("guidance_scale", [1.0, 4.5])
def test_recomputed_step_log_probs_equal_the_samplers(guidance_scale):
    model = tiny_transformer().eval()
    cond, uncond = conditioning(3, 1), conditioning(3, 2)
    traj = sample(model, cond, latent_shape=(4, 8, 8), num_steps=6, noise_level=0.7, uncond=uncond,
                  guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert traj.latents.shape == (3, 7, 4, 8, 8) and traj.log_probs.shape == (3, 6)
    assert torch.isfinite(traj.log_probs).all()
    again = step_log_probs(model, traj, cond, range(6), noise_level=0.7, uncond=uncond, guidance_scale=guidance_scale)
    assert torch.allclose(again, traj.log_probs, atol=1e-6, rtol=0)
    subset = step_log_probs(model, traj, cond, [1, 4], noise_level=0.7, uncond=uncond, guidance_scale=guidance_scale)
    assert torch.allclose(subset, traj.log_probs[:, [1, 4]], atol=1e-6, rtol=0)  # denoising reduction: any subset
    other = step_log_probs(model, traj, conditioning(3, 7), range(6), noise_level=0.7, uncond=uncond,
                           guidance_scale=guidance_scale)  # fmt: skip
    assert (other - traj.log_probs).abs().max() > 1e-4  # the prompt matters


def test_a_gradient_step_on_a_steps_log_prob_raises_it():
    model = tiny_transformer()
    cond = conditioning(2, 1)
    traj = sample(model, cond, latent_shape=(4, 8, 8), num_steps=4, generator=torch.Generator().manual_seed(3))
    before = step_log_probs(model, traj, cond, [2])
    before.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and sum(float(g.abs().sum()) for g in grads) > 0
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p += 1e-3 * p.grad
    after = step_log_probs(model, traj, cond, [2])
    assert bool((after.sum() > before.sum()).item())
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        step_log_probs(model, traj, cond, [4])
    assert velocity(model, traj.latents[:, 0], 1.0, cond).shape == (2, 4, 8, 8)


def test_the_ode_sampler_is_euler_on_the_velocity():
    from miles.diffusion.sampler import sample_ode
    from miles.diffusion.sde import ode_step

    model = tiny_transformer().eval()
    cond = conditioning(2, 1)
    out = sample_ode(model, cond, latent_shape=(4, 8, 8), num_steps=3, generator=torch.Generator().manual_seed(5))
    x = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(5))
    sigmas = flow_sigmas(3)
    with torch.no_grad():
        for i in range(3):
            x = ode_step(x, velocity(model, x, sigmas[i], cond), sigmas[i], sigmas[i + 1])
    assert torch.equal(out, x)


def test_noise_comes_from_the_generators_device():
    from miles.diffusion.sampler import noise

    a = noise((2, 3), torch.Generator().manual_seed(1), "cpu")
    assert torch.equal(a, torch.randn(2, 3, generator=torch.Generator().manual_seed(1)))
    assert noise((2, 3), None, "cpu").shape == (2, 3)
    model = tiny_transformer().eval()
    cond = conditioning(2, 1)
    traj = sample(model, cond, latent_shape=(4, 8, 8), num_steps=2, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(4)
    assert torch.equal(traj.latents[:, 0], torch.randn(2, 4, 8, 8, generator=gen))  # the initial noise comes first


def test_rows_of_a_batch_are_sampled_as_in_the_whole_batch():
    """What a rank samples (``rows=(total, index)``) equals those rows of the whole batch sampled at once: the
    initial noise and every step's noise are the rows' own (SDE and ODE samplers)."""
    from miles.diffusion.sampler import sample_ode

    model = tiny_transformer().eval()
    cond = conditioning(4, 1)
    kwargs = dict(latent_shape=(4, 8, 8), num_steps=3)
    whole = sample(model, cond, **kwargs, generator=torch.Generator().manual_seed(3))
    index = torch.tensor([1, 3])
    part = sample(model, cond.rows(index), **kwargs, generator=torch.Generator().manual_seed(3), rows=(4, index))
    torch.testing.assert_close(part.latents, whole.latents[index], atol=1e-6, rtol=0)
    torch.testing.assert_close(part.log_probs, whole.log_probs[index], atol=1e-6, rtol=0)
    ode = sample_ode(model, cond, **kwargs, generator=torch.Generator().manual_seed(3))
    ode_part = sample_ode(
        model, cond.rows(index), **kwargs, generator=torch.Generator().manual_seed(3), rows=(4, index)
    )
    torch.testing.assert_close(ode_part, ode[index], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="rows index 2 rows, the batch has 4"):
        sample(model, cond, **kwargs, rows=(4, index))
