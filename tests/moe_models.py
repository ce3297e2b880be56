"""Tiny random MoE causal LMs of three router families (routing replay tests): Qwen3-MoE (softmax top-k),
DeepSeek-V3 (sigmoid, group-limited, score-correction bias, a dense first layer) and GLM-5 (``glm_moe_dsa``: DSA
attention, the DeepSeek-V3 router). 3 decoder layers (layer 0 dense), 8 experts, top-2, 32-token vocabulary.

``HYBRID_FAMILIES`` have no dense layer: Qwen3.5-MoE (``qwen3_5_moe_text``: Gated DeltaNet linear attention in
layers 0-1, gated full attention in layer 2, the softmax router, a gated shared expert) and DeepSeek-V4
(``deepseek_v4``: compressed attention, a hash-routed layer 0 whose experts come from a token-id table, then
sqrt(softplus) routers)."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen3_moe", "deepseek_v3", "glm_moe_dsa")
HYBRID_FAMILIES = ("qwen3_5_moe", "deepseek_v4")
VOCAB = 32
EOS = 2
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,  # MLA (DeepSeek-V3, GLM-5) caches one key/value per head
    num_experts_per_tok=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=EOS,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)


def moe_config(family: str, **overrides):
    """The HF config of the tiny ``family`` model (one of ``FAMILIES``); ``overrides`` replace common fields."""
    from transformers import AutoConfig, DeepseekV3Config, GlmMoeDsaConfig, Qwen3MoeConfig

    _COMMON = {**globals()["_COMMON"], **overrides}
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**_COMMON, num_experts=8, head_dim=8, norm_topk_prob=True, mlp_only_layers=[0])
    if family == "deepseek_v3":
        return DeepseekV3Config(
            **_COMMON, **_MLA, n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5,
        )  # fmt: skip
    if family == "glm_moe_dsa":
        return GlmMoeDsaConfig(
            **_COMMON, **_MLA, head_dim=8, n_routed_experts=8, n_group=2, topk_group=1,
            n_shared_experts=1, index_topk=8, index_head_dim=8, index_n_heads=2,
            mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=1,
        )  # fmt: skip
    if family == "qwen3_5_moe":
        return AutoConfig.for_model(
            "qwen3_5_moe_text", **_COMMON, head_dim=8, num_experts=8, shared_expert_intermediate_size=16,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
        )  # fmt: skip
    if family == "deepseek_v4":
        _COMMON["num_key_value_heads"] = 1  # one compressed key/value head, as DeepSeek-V4
        return AutoConfig.for_model(
            "deepseek_v4", **_COMMON, head_dim=16, q_lora_rank=16, qk_rope_head_dim=8, n_routed_experts=8,
            n_shared_experts=1, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=8, index_topk=8,
            sliding_window=8, num_nextn_predict_layers=0, mlp_layer_types=["hash_moe", "moe", "moe"],
            layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        )  # fmt: skip
    raise ValueError(family)


def make_moe_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """The tiny ``family`` model, random init (``seed``), fp32, eval mode. Router weights are drawn with std 1 (HF
    initializes them near zero, where every token would tie), expert weights with std 0.3 (so which experts a
    token goes to shows in its log-probs), score-correction biases small and nonzero."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = moe_config(family, **overrides)
    attention = "eager" if family == "deepseek_v4" else "sdpa"  # transformers has no SDPA path for DeepSeek-V4
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
            elif ".mlp.experts." in name:  # large enough that the chosen experts move the log-probs
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
            elif name.endswith("tid2eid"):  # the hash router's table: top_k distinct experts per token id
                buffer.copy_(torch.rand(buffer.shape[0], 8).argsort(-1)[:, : buffer.shape[1]])
    return model.eval()


def save_moe_model(family: str, path: Path, seed: int = 0, tokenizer=None, **overrides) -> Path:
    """``make_moe_model`` saved as an HF model directory at ``path`` (``overrides``: config fields); with
    ``tokenizer``, sized for it (vocabulary, special ids) and saved beside it, so the ``miles`` CLI runs it on
    chat-template prompts."""
    if tokenizer is not None:
        overrides |= dict(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        tokenizer.save_pretrained(path)
    make_moe_model(family, seed, **overrides).save_pretrained(path)
    return path


def engine_rollout(model_dir) -> list:
    """8 samples (4 prompts x 2, up to 8 new tokens, temperature 1) of the embedded engine on ``model_dir``, with
    the routing it recorded (``Sample.rollout_routed_experts``)."""
    from miles.core.config import SamplingConfig
    from miles.core.protocols import GenerateRequest
    from miles.core.sample import Sample
    from miles.rollout.engines.embedded import EmbeddedEngine

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (4 + i,), generator=gen).tolist() for i in range(4)]
    engine = EmbeddedEngine(model_dir, stop_token_ids=[EOS], routed_experts=True)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0)
    requests = [GenerateRequest(p, sampling, seed=10 * i + j) for i, p in enumerate(prompts) for j in range(2)]
    outputs = engine.generate_batch(requests)
    engine.close()
    return [
        Sample(
            index=i,
            group_index=i // 2,
            prompt="",
            tokens=r.prompt_tokens + o.response_tokens,
            response_length=len(o.response_tokens),
            rollout_log_probs=o.log_probs,
            loss_mask=[1] * len(o.response_tokens),
            rollout_routed_experts=o.routed_experts,
        )
        for i, (r, o) in enumerate(zip(requests, outputs))
    ]
