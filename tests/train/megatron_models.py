"""Tiny random HF models of the architectures the Megatron backend converts (shared by tests and spawned workers).

Vocabulary 33 (odd: tensor parallelism pads it), 2 layers, 4 heads over 2 key/value groups; the Qwen3 one has tied
embeddings, per-head q/k norms and a head_dim that is not hidden / heads, the Qwen2 one q/k/v biases."""

from pathlib import Path

import torch

VOCAB = 33


def save_tiny(path: Path, model_type: str, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    extra = {
        "llama": dict(tie_word_embeddings=False),
        "qwen2": dict(tie_word_embeddings=False),
        "qwen3": dict(tie_word_embeddings=True, head_dim=24),
    }[model_type]
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **common, **extra)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random norms and biases, so a mis-mapped one shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return path


def set_lora_b(backend, seed: int = 0, scale: float = 0.05) -> None:
    """Give every LoRA B of a Megatron backend the same random full tensor whatever its tensor- and pipeline-parallel
    sizes (each rank its shard; each layer's drawn from its whole-model name), so the adapters act and A gets
    gradients."""
    import zlib

    from miles.train.megatron.convert import shard_of

    with torch.no_grad():
        for module, layer in backend.lora_layers.items():
            g = torch.Generator().manual_seed(seed + zlib.crc32(backend._global_name(module).encode()))
            full = scale * torch.randn(layer.base_layer.output_size, layer.lora_B.shape[1], generator=g)
            layer.lora_B.copy_(shard_of(full, layer.lora_B, rank=backend.tp_rank, world=backend.tensor_parallel))
