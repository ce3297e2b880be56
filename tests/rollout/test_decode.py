"""The continuous-batching engine's own attention and KV cache (``miles.rollout.engines.decode``) against the HF
model's full forward, for every supported model family (tiny random models built from configs)."""

import pytest
import torch
from miles.rollout.engines import decode


def _tiny(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=64,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,  # grouped-query attention: 3 query heads per kv head
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=model_type == "llama",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_prefill_then_decode_steps_give_the_full_forwards_logits(model_type):
    model = _tiny(model_type)
    assert decode.supports(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 9, 2)]
    cache = decode.SlotKVCache(model, slots=4, length=10)
    cache.ensure_length(30)  # grows (to 64), keeping nothing yet
    logits = torch.stack([decode.prefill(model, cache, slot, p) for slot, p in enumerate(prompts)])
    sequences = [list(p) for p in prompts]
    for step in range(6):
        for b, sequence in enumerate(sequences):
            full = model(input_ids=torch.tensor([sequence])).logits[0, -1]
            assert torch.allclose(logits[b], full, atol=1e-5), (step, b)
        tokens = logits.argmax(-1)
        positions = torch.tensor([len(s) for s in sequences])
        for sequence, token in zip(sequences, tokens.tolist()):
            sequence.append(token)
        if step == 2:  # the middle sequence leaves: the last moves into its slot, as the engine compacts
            cache.copy_slot(2, 1, len(sequences[2]) - 1)
            sequences, tokens, positions = [sequences[0], sequences[2]], tokens[[0, 2]], positions[[0, 2]]
        logits = decode.decode_step(model, cache, tokens, positions)


def test_a_forked_prefix_decodes_like_its_own_prefill():
    model = _tiny("llama")
    cache = decode.SlotKVCache(model, slots=2, length=16)
    first = decode.prefill(model, cache, 0, [5, 6, 7])
    cache.copy_slot(0, 1, 3)
    logits = decode.decode_step(model, cache, torch.tensor([9, 11]), torch.tensor([3, 3]))
    for row, token in enumerate((9, 11)):
        assert torch.allclose(logits[row], model(input_ids=torch.tensor([[5, 6, 7, token]])).logits[0, -1], atol=1e-5)
    assert first.shape == (64,)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        decode.prefill(model, cache, 0, list(range(3, 40)) + list(range(3, 40)))


def test_models_outside_the_supported_families_fall_back():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    assert not decode.supports(AutoModelForCausalLM.from_config(config))
    qwen2 = _tiny("qwen2")
    qwen2.config.use_sliding_window = True
    assert not decode.supports(qwen2)
