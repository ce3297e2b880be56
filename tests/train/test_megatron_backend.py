"""Megatron-core backend on CPU: HF <-> Megatron conversion, the same numbers as the HF model and the FSDP2 backend,
tensor and data parallelism over gloo, checkpoints."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.config import AlgorithmConfig
from miles.train import FSDP2Backend, TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402
from megatron_models import VOCAB, save_tiny  # noqa: E402

pytest.importorskip("megatron.core")
from miles.train.megatron import CausalLMView, MegatronBackend, context_parallel, convert  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="train.backend megatron trains on the CPU only")

OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron_models")
    return {kind: save_tiny(root / kind, kind) for kind in ("llama", "qwen2", "qwen3")}


def _megatron(path, **train) -> MegatronBackend:
    return MegatronBackend(path, train=TrainConfig(backend="megatron", **train), temperature=1.0)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


# -- conversion -------------------------------------------------------------------------------------------------------
def test_fused_qkv_groups_query_heads_with_their_key_and_value_and_splits_back():
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=1)
    q, k, v = torch.tensor([[0.0], [1.0], [2.0], [3.0]]), torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    fused = convert._fuse_qkv(q, k, v, groups=2)
    # group 0: query heads 0, 1, its key, its value; group 1: query heads 2, 3, its key, its value
    assert fused.flatten().tolist() == [0.0, 1.0, 10.0, 20.0, 2.0, 3.0, 11.0, 21.0]
    for part, original in zip(convert._split_qkv(fused, config), (q, k, v)):
        assert torch.equal(part, original)


def test_shards_of_a_strided_parameter_reassemble_the_full_tensor():
    full = torch.arange(8.0).reshape(8, 1)  # [gate rows 0-3; up rows 4-7]
    param = torch.empty(4, 1)
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 2
    shards = [convert.shard_of(full, param, rank=r, world=2) for r in range(2)]
    # each rank holds its slice of gate and of up: [gate_r; up_r]
    assert shards[0].flatten().tolist() == [0.0, 1.0, 4.0, 5.0]
    assert shards[1].flatten().tolist() == [2.0, 3.0, 6.0, 7.0]
    assert torch.equal(convert.full_from_shards(shards, param), full)
    assert convert.padded_vocab_size(33, 2) == 34 and convert.padded_vocab_size(32, 2) == 32


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_megatron_logits_equal_the_hf_model_and_weights_convert_back_exactly(tiny_models, kind, layout):
    backend = _megatron(tiny_models[kind], batch_layout=layout)
    hf = _hf(tiny_models[kind])
    tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:], mask[2, 6:] = 0, 0
    with torch.no_grad():
        expected = hf(input_ids=tokens, attention_mask=mask).logits
        got = CausalLMView(backend.gpt, VOCAB)(input_ids=tokens, attention_mask=mask).logits
    assert got.shape == expected.shape
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)
    # packed: the three sequences in one row, positions restarting, must give each sequence's own logits
    lengths = mask.sum(1).tolist()
    packed = torch.cat([tokens[b, :n] for b, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        got_packed = CausalLMView(backend.gpt, VOCAB)(input_ids=packed, position_ids=positions).logits[0]
    torch.testing.assert_close(got_packed, expected[real], atol=1e-5, rtol=0)
    # each packed sequence is rotated from its own position 0 (the table GPTModel asks for covers 0..N-1)
    tables = []
    hook = backend.gpt.rotary_pos_emb.register_forward_hook(lambda module, args, out: tables.append(out))
    with torch.no_grad():
        CausalLMView(backend.gpt, VOCAB)(input_ids=packed, position_ids=positions)
    hook.remove()
    full_table = backend.gpt.rotary_pos_emb(12)
    assert torch.equal(tables[0], full_table[positions[0]])
    assert "forward" not in vars(backend.gpt.rotary_pos_emb)  # restored
    exported = dict(backend.export_weights())
    state = hf.state_dict()
    tied = hf.config.tie_word_embeddings
    assert set(exported) == set(state) - ({"lm_head.weight"} if tied else set())
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[name]), name


# -- the backend against FSDP2 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_log_probs_gradients_and_a_step_equal_the_fsdp2_backend(tiny_models, layout):
    """Same model, batch and objective: the Megatron backend's log-probs, loss metrics, gradients (HF names),
    grad norm and the weights after one AdamW step equal FSDP2's."""
    path = tiny_models["qwen3"]
    # adam_eps 1e-4: AdamW's first step is ~lr * g / (|g| + eps), which with eps 1e-8 turns a gradient entry's 1e-9
    # rounding difference near 0 into a sign flip of its update
    train = dict(micro_batch_size=2, batch_layout=layout, lr=1e-2, grad_clip=0.5, adam_eps=1e-4)
    megatron, fsdp2 = _megatron(path, **train), FSDP2Backend(path, train=TrainConfig(**train), temperature=1.0)
    batch = make_batch()
    for backend in (megatron, fsdp2):
        batch_lp = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
        backend.lp = batch_lp * batch.loss_mask
        backend.metrics = backend.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
        backend.grads = backend.full_gradients()
        backend.step_metrics = backend.optimizer_step()
    torch.testing.assert_close(megatron.lp, fsdp2.lp, atol=1e-5, rtol=0)
    assert megatron.metrics.keys() == fsdp2.metrics.keys()
    for key, value in fsdp2.metrics.items():
        assert megatron.metrics[key] == pytest.approx(value, abs=1e-5), key
    assert set(megatron.grads) == set(fsdp2.grads)
    for name, grad in fsdp2.grads.items():
        torch.testing.assert_close(megatron.grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert megatron.step_metrics["grad_norm"] == pytest.approx(fsdp2.step_metrics["grad_norm"], rel=1e-5)
    assert fsdp2.step_metrics["grad_norm"] > 0.5  # the clip was active, and equal on both sides
    after = fsdp2.full_state_dict()
    for name, tensor in megatron.full_state_dict().items():
        torch.testing.assert_close(tensor, after[name], atol=1e-6, rtol=0, msg=name)


def test_save_then_load_resumes_exactly_and_refuses_another_tensor_parallel_size(tiny_models, tmp_path):
    path = tiny_models["llama"]
    backend = _megatron(path, micro_batch_size=3, lr=1e-2)
    batch = make_batch()
    backend.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    backend.optimizer_step()
    backend.save(tmp_path / "ckpt")
    # model/ is an HF directory of the trained weights
    saved = _hf(tmp_path / "ckpt" / "model").state_dict()
    for name, tensor in backend.full_state_dict().items():
        assert torch.equal(saved[name], tensor), name
    restored = _megatron(path, micro_batch_size=3, lr=1e-2)
    restored.load(tmp_path / "ckpt")
    assert restored.step == 1
    nxt = make_batch(seed=1)
    for b in (backend, restored):
        b.forward_backward(nxt, OBJECTIVE, LossCounts.of(nxt))
        b.optimizer_step()
    resumed = restored.full_state_dict()
    for name, tensor in backend.full_state_dict().items():
        assert torch.equal(resumed[name], tensor), name  # AdamW moments restored: bit for bit
    state = tmp_path / "ckpt" / "trainer_state.json"
    state.write_text(state.read_text().replace('"tensor_parallel_size": 1', '"tensor_parallel_size": 2'))
    with pytest.raises(ValueError, match="tensor-parallel-size 2"):
        restored.load(tmp_path / "ckpt")


def test_what_the_backend_does_not_hold_yet_is_refused_in_one_line(tiny_models, tmp_path):
    with pytest.raises(ValueError, match=r"train.lora.dropout > 0 \(use --train.lora.dropout 0\) yet"):
        _megatron(tiny_models["llama"], lora={"dropout": 0.1})
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        convert.transformer_config_kwargs(_hf(tiny_models["llama"]).config, tensor_parallel=3, dtype=torch.float32)
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="model type 'gpt2' has no Megatron conversion"):
        convert.check_supported(AutoConfig.for_model("gpt2"))
    # Llama's attention_bias also biases o_proj (no conversion yet): refused up front, not at load
    with pytest.raises(ValueError, match="attention biases"):
        convert.check_supported(AutoConfig.for_model("llama", attention_bias=True))
    with pytest.raises(ValueError, match=r"context_parallel_size 2 with train.megatron.tensor_parallel_size 2 is not"):
        _megatron(tiny_models["llama"], megatron={"context_parallel_size": 2, "tensor_parallel_size": 2})
    for model_type, kind in (("qwen3_moe", "an MoE"), ("deepseek_v3", "an MLA"), ("qwen2_vl", "a vision-language")):
        refusal = context_parallel.model_refusal(AutoConfig.for_model(model_type), context_parallel=2)
        assert f"model type '{model_type}' is {kind} model, and context parallelism covers dense models" in refusal
    assert context_parallel.model_refusal(AutoConfig.for_model("qwen3_moe"), context_parallel=1) is None
    with pytest.raises(ValueError, match=r"expert_parallel_size 2 must divide .* \(none: a dense model\)"):
        convert.transformer_config_kwargs(
            _hf(tiny_models["llama"]).config, tensor_parallel=1, expert_parallel=2, dtype=torch.float32
        )


# -- two ranks over gloo ----------------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize(
    ("parallel", "layout", "kind", "optimizer_files"),
    [
        ("2", "packed", "qwen3", {"tp0_ep0.pt", "tp1_ep0.pt"}),
        ("1", "padded", "qwen3", {"tp0_ep0.pt"}),
        ("1p2", "packed", "qwen3", {"tp0_pp0_ep0.pt", "tp0_pp1_ep0.pt"}),
        ("1p2", "padded", "llama", {"tp0_pp0_ep0.pt", "tp0_pp1_ep0.pt"}),
        ("1c2", "padded", "qwen3", {"tp0_ep0.pt"}),
        ("1c2", "padded", "llama", {"tp0_ep0.pt"}),
        ("1c2", "packed", "qwen3", {"tp0_ep0.pt"}),
    ],
    ids=["tp2", "dp2", "pp2-tied", "pp2-untied", "cp2-qwen3", "cp2-llama", "cp2-packed"],
)
def test_two_ranks_equal_one_rank(tiny_models, tmp_path, parallel, layout, kind, optimizer_files):
    """TP=2 (weights split over two ranks, vocabulary 33 padded to 34), DP=2 (two replicas, half the rows each),
    PP=2 (a layer per stage; the tied embedding on both ends; a frozen reference through the same stages) and CP=2
    (both ranks the same rows, each sequence split over them; padded: the micro-batches' 6 and 7 tokens padded to 8;
    packed: each sequence of 5 to 7 tokens padded to 8 in the packed row):
    log-probs, metrics, gradients, the step, the push and the checkpoint equal the one-rank backend's."""
    path = tiny_models[kind]
    worker = Path(__file__).parent / "megatron_worker.py"
    out = tmp_path / "rank0.pt"
    args = [str(tmp_path / "init"), str(path), str(out), parallel, layout]
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", *args], cwd=worker.parent) for r in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    result = torch.load(out, weights_only=True)
    single = _megatron(path, micro_batch_size=2, batch_layout=layout, lr=1e-2, adam_eps=1e-4)  # the worker's
    batch = make_batch()
    lp = single.forward(batch, outputs={"old_log_probs"}).old_log_probs
    torch.testing.assert_close(result["log_probs"] * batch.loss_mask, lp * batch.loss_mask, atol=1e-5, rtol=0)
    if result["ref_log_probs"] is not None:  # the reference is the starting model: the policy's log-probs
        torch.testing.assert_close(result["ref_log_probs"] * batch.loss_mask, lp * batch.loss_mask, atol=1e-5, rtol=0)
    metrics = single.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    for key in ("loss", "loss/pg"):  # the worker's two accumulations add up to the one-rank single call's
        assert result["metrics"][key] == pytest.approx(metrics[key], abs=1e-5), key
    for name, grad in single.full_gradients().items():
        torch.testing.assert_close(result["grads"][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    step = single.optimizer_step()
    assert result["step"]["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-5)
    assert step["grad_norm"] > TrainConfig().grad_clip  # the step was clipped
    after = single.forward(batch, outputs={"old_log_probs"}).old_log_probs  # the tied output weight moved as one
    torch.testing.assert_close(result["log_probs_after"] * batch.loss_mask, after * batch.loss_mask, atol=1e-5, rtol=0)
    state = single.full_state_dict()
    assert list(result["pushed"]) == list(result["state"])  # the push is the full state, once per tensor
    for name, tensor in state.items():
        torch.testing.assert_close(result["state"][name], tensor, atol=1e-6, rtol=0, msg=name)
        assert torch.equal(result["pushed"][name], result["state"][name]), name
    assert result["state"]["model.embed_tokens.weight"].shape[0] == VOCAB  # the padding row never leaves
    saved = _hf(Path(str(out) + ".ckpt") / "model").state_dict()
    for name, tensor in result["state"].items():
        assert torch.equal(saved[name], tensor), name
        assert torch.equal(result["reloaded"][name], tensor), name  # load() gave every rank its part back
    assert {p.name for p in (Path(str(out) + ".ckpt") / "optimizer").iterdir()} == optimizer_files
