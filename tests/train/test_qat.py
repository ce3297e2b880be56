"""QAT for quantized rollout weights (``miles.train.qat``) and the embedded engine's quantized weights: the trainer's
forward uses exactly the values the engine holds, gradients pass straight through, and both sides quantize the same
tensors as ``WeightSender``."""

import pytest
import torch
import torch.nn.functional as F
from miles.sync import DEFAULT_CODEC_EXCLUDE, WeightSender, roundtrip, uses_codec
from miles.sync.codecs import int4
from miles.train.qat import QAT_CODECS, apply_qat, fake_quantize
from torch import nn


def test_int4_roundtrip_matches_a_hand_computed_group():
    # One row of 4 values, group of 128 padded with zeros: scale = amax / 7 = 0.5, q = round(x / 0.5) in [-7, 7].
    w = torch.tensor([[3.5, -1.2, 0.26, 0.0]])
    assert torch.equal(roundtrip("int4", w), torch.tensor([[3.5, -1.0, 0.5, 0.0]]))
    assert int4.GROUP == 128


@pytest.mark.parametrize("codec", QAT_CODECS)
def test_fake_quantize_forward_is_the_codec_round_trip_and_backward_is_straight_through(codec):
    torch.manual_seed(0)
    w = torch.randn(48, 160, requires_grad=True)
    x = torch.randn(5, 160)
    wq = fake_quantize(w, codec)
    assert torch.equal(wq, roundtrip(codec, w.detach()))
    assert not torch.equal(wq, w.detach())  # a lossy codec: the test would pass vacuously otherwise
    assert torch.equal(roundtrip(codec, wq.detach()), wq)  # idempotent: a re-sent quantized weight is unchanged
    F.linear(x, wq).square().sum().backward()
    # STE: dL/dW is dL/dQ(W), the gradient of the same loss taken at the quantized weight
    q = wq.detach().clone().requires_grad_(True)
    F.linear(x, q).square().sum().backward()
    torch.testing.assert_close(w.grad, q.grad, rtol=0, atol=0)


def test_apply_qat_quantizes_exactly_what_the_sender_quantizes_and_the_forward_uses_it(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    names = apply_qat(model, "int4")
    sent = [n for n, t in model.state_dict().items() if uses_codec(n, t, "int4", DEFAULT_CODEC_EXCLUDE)]
    assert names == sent
    # 2 layers x (q, k, v, o, gate, up, down); embeddings, norms and the (untied) LM head stay exact
    assert len(names) == 14 and not any("norm" in n or "embed" in n or "lm_head" in n for n in names)
    assert dict(model.named_parameters()).keys() == dict(reference.named_parameters()).keys()  # names unchanged
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in names:
                param.copy_(roundtrip("int4", param))
    tokens = torch.tensor([[1, 5, 9, 3, 7, 11]])
    torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=0, atol=0)
    # the master weights are untouched: the optimizer updates full-precision W
    assert torch.equal(dict(model.named_parameters())[names[0]], AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32
    ).state_dict()[names[0]])  # fmt: skip


def test_apply_qat_refuses_a_quantized_parameter_that_is_not_a_linear_weight():
    model = nn.Sequential(nn.Linear(8, 8), nn.Conv1d(2, 2, 3))
    with pytest.raises(ValueError, match=r"1\.weight would be quantized by engine.weight_codec int4 but is not an nn"):
        apply_qat(model, "int4")
    with pytest.raises(ValueError, match=r"train.qat is 'bf16'; choose one of"):
        apply_qat(nn.Linear(8, 8), "bf16")
    with pytest.raises(ValueError, match="no weight of this model would be quantized"):
        apply_qat(nn.ModuleDict({"final_norm": nn.LayerNorm(8)}), "int4")


def test_embedded_engine_holds_the_codec_round_trip_from_the_start_and_after_an_update(tiny_llama_dir):
    from miles.rollout.engines.embedded import EmbeddedEngine
    from miles.sync import InProcessTransport
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).state_dict()
    engine = EmbeddedEngine(tiny_llama_dir, weight_codec="fp8")
    try:
        state = engine.model.state_dict()
        quantized = [n for n, t in loaded.items() if uses_codec(n, t, "fp8", DEFAULT_CODEC_EXCLUDE)]
        assert len(quantized) == 14
        for name, tensor in loaded.items():
            expected = roundtrip("fp8", tensor) if name in quantized else tensor
            assert torch.equal(state[name], expected), name
        # an update travels as fp8 and lands as the same round trip of the new weights
        new = {n: t + 0.01 for n, t in loaded.items()}
        WeightSender(InProcessTransport(engine.receiver), codec="fp8").push(new.items())
        state = engine.model.state_dict()
        for name, tensor in new.items():
            expected = roundtrip("fp8", tensor) if name in quantized else tensor
            assert torch.equal(state[name], expected), name
        assert engine.weight_version == 1
    finally:
        engine.close()
    with pytest.raises(ValueError, match="not a registered codec"):
        EmbeddedEngine(tiny_llama_dir, weight_codec="fp7")
