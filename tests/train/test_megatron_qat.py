"""QAT on the Megatron backend (``miles.train.megatron.qat``): the trainer computes with exactly the weights a
quantized engine holds (the codec's round trip of each HF tensor the sender quantizes, MoE experts included), and
gradients pass straight through to the full-precision weights. Reference: an HF model directory holding those
round-tripped weights (what ``EmbeddedEngine(weight_codec=...)`` loads), run by the FSDP2 backend."""

import sys
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.batch import build_train_batch
from miles.core.config import AlgorithmConfig
from miles.sync import DEFAULT_CODEC_EXCLUDE, roundtrip, uses_codec
from miles.train import FSDP2Backend, TrainConfig
from moe_models import engine_rollout, save_moe_model

pytest.importorskip("megatron.core")

from miles.train.megatron import MegatronBackend, convert  # noqa: E402
from miles.train.megatron.qat import check_megatron_qat  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from megatron_models import save_tiny  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="train.backend megatron trains on the CPU only")

OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "deepseek_v3"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qat_{request.param}")
    if request.param == "llama":
        return save_tiny(path, "llama")
    return save_moe_model(request.param, path)


def _engine_weights_dir(model_dir: Path, codec: str, out: Path) -> Path:
    """``model_dir`` with every tensor the sender quantizes replaced by its round trip: the engine's weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if uses_codec(name, param, codec, DEFAULT_CODEC_EXCLUDE):
                param.copy_(roundtrip(codec, param))
    model.save_pretrained(out)
    for extra in model_dir.glob("tokenizer*"):
        (out / extra.name).write_bytes(extra.read_bytes())
    return out


def _batch(model_dir: Path):
    """8 rows: an engine rollout of the MoE models (routed live on both sides), the dense model's fixed batch."""
    from batch_fixture import make_batch
    from transformers import AutoConfig

    if not convert.is_moe(AutoConfig.from_pretrained(model_dir)):
        return make_batch()
    batch = build_train_batch(engine_rollout(model_dir), torch.tensor([1.0, -1.0] * 4), pad_token_id=0)
    return batch.replace(routed_experts=None, old_log_probs=batch.rollout_log_probs)


@pytest.mark.parametrize("codec", ["int4", "mxfp8"])
def test_megatron_qat_computes_with_the_engines_weights_and_passes_gradients_straight_through(
    model_dir, tmp_path, codec
):
    """Log-probs equal the round-tripped model's (without QAT they measurably differ), the fake-quantized Megatron
    weights are exactly the HF tensors the sender quantizes, and the gradients w.r.t. the full-precision weights are
    the round-tripped model's (straight-through); the weights a push sends stay full precision."""
    engine_dir = _engine_weights_dir(model_dir, codec, tmp_path / "engine")
    batch = _batch(model_dir)
    train = dict(backend="megatron", micro_batch_size=4, batch_layout="packed", lr=1e-2)
    qat = MegatronBackend(model_dir, train=TrainConfig(**train, qat=codec), temperature=1.0)
    plain = MegatronBackend(model_dir, train=TrainConfig(**train), temperature=1.0)
    reference = FSDP2Backend(engine_dir, train=TrainConfig(micro_batch_size=4, batch_layout="packed"), temperature=1.0)
    mask = batch.loss_mask.bool()
    got = qat.forward(batch, outputs={"old_log_probs"}).old_log_probs[mask]
    want = reference.forward(batch, outputs={"old_log_probs"}).old_log_probs[mask]
    unquantized = plain.forward(batch, outputs={"old_log_probs"}).old_log_probs[mask]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (unquantized - want).abs().max() > 1e-4  # the quantization shows: the test above can fail

    quantized = {n for n, m in qat.gpt.named_modules() if type(m).__name__.startswith("FakeQuantized")}
    params = dict(qat.gpt.named_parameters())
    as_hf = {name for name, _ in convert.megatron_to_hf(((f"{q}.weight", params[f"{q}.weight"]) for q in quantized),
                                                         qat.hf_config)}  # fmt: skip
    exported = dict(qat.export_weights())
    assert as_hf == {n for n, t in exported.items() if uses_codec(n, t, codec, DEFAULT_CODEC_EXCLUDE)}
    original = dict(plain.export_weights())
    for name, tensor in exported.items():  # W, not Q(W): the sender quantizes once, on the wire
        assert torch.equal(tensor, original[name]), name

    for backend in (qat, reference):
        backend.metrics = backend.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    assert qat.metrics["loss"] == pytest.approx(reference.metrics["loss"], abs=1e-6)
    want_grads = reference.full_gradients()
    for name, grad in qat.full_gradients().items():
        torch.testing.assert_close(grad, want_grads[name], atol=5e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("codec", ["fp8", "nvfp4"])
def test_codecs_whose_blocks_span_rows_or_the_tensor_are_refused_in_one_line(codec):
    with pytest.raises(ValueError, match=rf"train.qat {codec} on train.backend megatron: .* use --train.qat int4 or "):
        check_megatron_qat(codec)
