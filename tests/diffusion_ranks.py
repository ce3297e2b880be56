"""The settings the several-rank diffusion tests share between the test and its worker processes."""

from miles.diffusion.config import FlowGRPOConfig

PROMPTS = ["a red image", "a blue image"]
SMALL = dict(prompts_per_step=2, group_size=4, num_steps=3, micro_batch_size=1, lr=1e-3, updates_per_rollout=2)
MODES = {
    # two mini-batches, KL to the starting model, two of three denoising steps trained (seeded subsets)
    "flow_grpo": dict(kl_coef=0.1, train_steps=2),
    # DiffusionNFT with the soft-updated old policy: its noise depends on the rows, not the micro-batches
    "diffusion_nft": dict(loss="diffusion_nft", nft_decay_rate=0.2, nft_decay_max=0.5),
    # LoRA adapters on the attention, KL to the adapters-off policy
    "lora": dict(kl_coef=0.1, lora=dict(rank=4, alpha=8.0)),
}


def config(mode: str) -> FlowGRPOConfig:
    return FlowGRPOConfig(**SMALL, **MODES[mode])


def reward(prompts, images):
    """Brightness of the red channel, in [0, 1]: a reward every image gets a different value of."""
    return [float(image[..., 0].mean()) / 255 for image in images]
