import pytest
import torch
from miles.sync.layouts import from_peft_name, fused_to_hf, hf_to_fused, to_peft_name

HIDDEN, Q, KV, INTER, EXPERTS = 8, 8, 4, 6, 2


def _hf_layer() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(Q, HIDDEN, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(KV, HIDDEN, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(KV, HIDDEN, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(Q, generator=g),
        "model.layers.0.self_attn.k_proj.bias": torch.randn(KV, generator=g),
        "model.layers.0.self_attn.v_proj.bias": torch.randn(KV, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(INTER, HIDDEN, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(INTER, HIDDEN, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(HIDDEN, generator=g),
    }
    for e in range(EXPERTS):
        for proj, shape in (
            ("gate_proj", (INTER, HIDDEN)),
            ("up_proj", (INTER, HIDDEN)),
            ("down_proj", (HIDDEN, INTER)),
        ):
            state[f"model.layers.1.mlp.experts.{e}.{proj}.weight"] = torch.randn(*shape, generator=g)
    return state


def test_hf_names_fuse_into_engine_layouts_with_the_documented_shapes():
    fused = dict(hf_to_fused(_hf_layer().items(), num_experts=EXPERTS))
    assert fused["model.layers.0.self_attn.qkv_proj.weight"].shape == (Q + 2 * KV, HIDDEN)
    assert fused["model.layers.0.self_attn.qkv_proj.bias"].shape == (Q + 2 * KV,)
    assert fused["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * INTER, HIDDEN)
    assert fused["model.layers.1.mlp.experts.w13_weight"].shape == (EXPERTS, 2 * INTER, HIDDEN)
    assert fused["model.layers.1.mlp.experts.w2_weight"].shape == (EXPERTS, HIDDEN, INTER)
    assert "model.layers.0.input_layernorm.weight" in fused
    # q rows come first, then k, then v.
    hf = _hf_layer()
    assert torch.equal(
        fused["model.layers.0.self_attn.qkv_proj.weight"][Q : Q + KV], hf["model.layers.0.self_attn.k_proj.weight"]
    )


def test_fusing_then_splitting_returns_the_hf_tensors_exactly():
    hf = _hf_layer()
    fused = list(hf_to_fused(hf.items(), num_experts=EXPERTS))
    back = dict(fused_to_hf(fused, q_size=Q, kv_size=KV))
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_an_incomplete_group_is_reported_with_what_arrived():
    partial = [(n, t) for n, t in _hf_layer().items() if "v_proj.weight" not in n]
    with pytest.raises(ValueError, match=r"self_attn.qkv_proj.weight has only \['k_proj', 'q_proj'\]"):
        list(hf_to_fused(partial, num_experts=EXPERTS))


@pytest.mark.parametrize(
    "model_name, peft_name",
    [
        pytest.param(
            "model.layers.0.self_attn.q_proj.lora_A.default.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            id="lora_A",
        ),
        pytest.param(
            "model.layers.1.mlp.down_proj.lora_B.default.weight",
            "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight",
            id="lora_B",
        ),
    ],
)
def test_peft_names_map_both_ways(model_name, peft_name):
    assert to_peft_name(model_name) == peft_name
    assert from_peft_name(peft_name) == model_name
    assert from_peft_name(peft_name.removeprefix("base_model.model.")) == model_name  # the prefix is optional


def test_from_peft_name_refuses_a_name_without_a_lora_part():
    with pytest.raises(ValueError, match="is no LoRA adapter name"):
        from_peft_name("base_model.model.model.layers.0.mlp.up_proj.weight")
