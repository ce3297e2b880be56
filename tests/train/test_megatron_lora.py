"""LoRA on the Megatron backend: adapters on the fused linears that follow their tensor-parallel split, the merged
weights it pushes equal what the model computes, the reference is the policy with its adapters off, checkpoints
resume exactly, and two tensor-parallel ranks equal one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.config import AlgorithmConfig
from miles.core.log_probs import model_response_log_probs
from miles.train import TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402
from megatron_models import save_tiny, set_lora_b  # noqa: E402

pytest.importorskip("megatron.core")
from miles.train.megatron import MegatronBackend  # noqa: E402
from miles.train.megatron.lora import megatron_targets  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="train.backend megatron trains on the CPU only")

OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
LORA = {"rank": 4, "alpha": 8.0}  # scaling 2


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("megatron_lora") / "qwen2", "qwen2")  # q/k/v biases too


def _backend(path, reference=None, **train) -> MegatronBackend:
    train = {"lora": LORA, "lr": 1e-2, "micro_batch_size": 2, **train}
    return MegatronBackend(
        path, train=TrainConfig(backend="megatron", **train), temperature=1.0, reference_path=reference
    )


def _hf_log_probs(state: dict, path: Path, batch) -> torch.Tensor:
    """Log-probs of the HF model at ``path`` holding ``state`` (HF names), on ``batch``'s responses."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    with torch.no_grad():
        lp, _ = model_response_log_probs(
            model, batch.tokens, batch.attention_mask, batch.prompt_lengths,
            num_response_columns=batch.loss_mask.shape[1], temperature=1.0, with_entropy=False,
        )  # fmt: skip
    return lp * batch.loss_mask


def test_hf_targets_map_to_megatrons_fused_layers_and_a_fused_group_in_part_is_refused():
    assert megatron_targets(["q_proj", "k_proj", "v_proj", "o_proj"]) == ["linear_proj", "linear_qkv"]
    assert megatron_targets(["gate_proj", "up_proj", "down_proj"]) == ["linear_fc1", "linear_fc2"]
    with pytest.raises(ValueError, match=r"lists \['q_proj', 'v_proj'\] of \['q_proj', 'k_proj', 'v_proj'\]"):
        megatron_targets(["q_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"has \['lm_head'\], which train.backend megatron cannot adapt"):
        megatron_targets(["lm_head"])


def test_the_model_is_the_merged_weights_it_pushes_and_the_reference_is_the_base(qwen2_dir):
    backend = _backend(qwen2_dir, reference=qwen2_dir)
    batch = make_batch()
    trainable = {name for name, p in backend.gpt.named_parameters() if p.requires_grad}
    assert trainable and all(name.endswith((".lora_A", ".lora_B")) for name in trainable)
    assert len(backend.lora_layers) == 8  # linear_qkv, linear_proj, linear_fc1, linear_fc2 of 2 layers
    base = {name: t.clone() for name, t in backend.export_weights()}
    start = backend.forward(batch, outputs={"old_log_probs", "ref_log_probs"})
    assert torch.equal(start.old_log_probs, start.ref_log_probs)  # B = 0: the adapters start as no-ops
    set_lora_b(backend)
    merged = {name: t.clone() for name, t in backend.export_weights()}
    out = backend.forward(batch, outputs={"old_log_probs", "ref_log_probs"})
    mask = batch.loss_mask
    # the HF model holding the pushed (merged) weights computes what the Megatron model with adapters does ...
    torch.testing.assert_close(out.old_log_probs * mask, _hf_log_probs(merged, qwen2_dir, batch), atol=1e-5, rtol=0)
    assert ((out.old_log_probs - out.ref_log_probs) * mask).abs().max() > 1e-2
    # ... and the reference is the base model, with no second copy held
    torch.testing.assert_close(out.ref_log_probs * mask, _hf_log_probs(base, qwen2_dir, batch), atol=1e-5, rtol=0)
    assert backend.ref_model is None
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert changed == {n for n in base if n.endswith(tuple(f"{t}.weight" for t in targets))}  # biases, norms stay
    # a step moves the adapters alone
    backend.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    assert backend.optimizer_step()["grad_norm"] > 0
    after = dict(backend.export_weights())
    assert all(torch.equal(after[n], merged[n]) for n in merged if n not in changed)
    assert all(not torch.equal(after[n], merged[n]) for n in changed)


def test_adapter_sync_sends_hf_adapters_sharing_a_that_compute_what_the_fused_ones_do(qwen2_dir):
    """train.lora.sync adapter: linear_qkv's adapter as q/k/v_proj adapters with one A and B split per query group
    (scaling folded in), linear_fc1's as gate/up_proj: an HF model given them computes what Megatron does."""
    from miles.rollout.engines.adapters import apply_adapter_update
    from transformers import AutoModelForCausalLM

    backend = _backend(qwen2_dir, lora={**LORA, "sync": "adapter"})
    set_lora_b(backend)
    sent = dict(backend.export_weights())
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert len(sent) == 2 * len(targets) * 2 and all(".lora_" in name for name in sent)
    prefix = "model.layers.0.self_attn"
    assert torch.equal(sent[f"{prefix}.q_proj.lora_A.default.weight"], sent[f"{prefix}.v_proj.lora_A.default.weight"])
    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    apply_adapter_update(model, sent.items())  # what the embedded engine does with an adapter update
    batch = make_batch()
    with torch.no_grad():
        lp, _ = model_response_log_probs(
            model, batch.tokens, batch.attention_mask, batch.prompt_lengths,
            num_response_columns=batch.loss_mask.shape[1], temperature=1.0, with_entropy=False,
        )  # fmt: skip
    ours = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    torch.testing.assert_close(ours * batch.loss_mask, lp * batch.loss_mask, atol=1e-5, rtol=0)
    merged = backend.full_state_dict()  # the checkpoint's model/: merged, whichever sync
    torch.testing.assert_close(ours * batch.loss_mask, _hf_log_probs(merged, qwen2_dir, batch), atol=1e-5, rtol=0)


def test_a_checkpoint_resumes_the_adapters_exactly_and_refuses_other_lora_settings(qwen2_dir, tmp_path):
    batch = make_batch()
    first = _backend(qwen2_dir)
    for _ in range(2):
        first.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
        first.optimizer_step()
    first.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter" / "megatron_adapters.safetensors").is_file()
    restored = _backend(qwen2_dir)
    restored.load(tmp_path / "ckpt")
    for name, tensor in first.full_state_dict().items():
        assert torch.equal(restored.full_state_dict()[name], tensor), name
    steps = []
    for backend in (first, restored):
        backend.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
        steps.append(backend.optimizer_step())
    assert steps[0] == steps[1]
    with pytest.raises(ValueError, match="written with train.lora.rank 4, this run has 8"):
        _backend(qwen2_dir, lora={"rank": 8, "alpha": 8.0}).load(tmp_path / "ckpt")


@pytest.mark.integration
@pytest.mark.parametrize(
    "parallel", ["2", "1p2", "1c2"], ids=["tensor_parallel_2", "pipeline_parallel_2", "context_parallel_2"]
)
def test_two_tensor_parallel_ranks_or_stages_train_the_same_adapters_as_one(qwen2_dir, tmp_path, parallel):
    """TP=2: A of the column-parallel layers replicated and B split like the weight (gate/up strided), the reverse
    on the row-parallel ones; PP=2: each stage its layers' adapters, a reference (the adapters off) through the
    stages; CP=2: whole adapters on both ranks, each sequence split over them: log-probs, metrics, the adapters'
    gradients, the step, the merged push, the adapters an adapter sync would send and the checkpoint's adapters
    equal one rank's."""
    worker = Path(__file__).parent / "megatron_worker.py"
    out = tmp_path / "rank0.pt"
    args = [str(tmp_path / "init"), str(qwen2_dir), str(out), parallel, "padded"]
    env = {**os.environ, "MEGATRON_WORKER_LORA": "4"}
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(r), "2", *args], cwd=worker.parent, env=env)
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    result = torch.load(out, weights_only=True)
    single = _backend(qwen2_dir, lora={"rank": 4, "alpha": 8.0}, batch_layout="padded", adam_eps=1e-4)  # the worker's
    set_lora_b(single)
    batch = make_batch()
    lp = single.forward(batch, outputs={"old_log_probs"}).old_log_probs
    torch.testing.assert_close(result["log_probs"] * batch.loss_mask, lp * batch.loss_mask, atol=1e-5, rtol=0)
    metrics = single.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    for key in ("loss", "loss/pg"):
        assert result["metrics"][key] == pytest.approx(metrics[key], abs=1e-5), key
    grads = single.full_gradients()
    assert set(result["grads"]) == set(grads) and all(n.endswith((".lora_A", ".lora_B")) for n in grads)
    assert all(grads[n].abs().max() > 0 for n in grads)  # A's too: B acts from the start
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    step = single.optimizer_step()
    assert result["step"]["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-5)
    for name, tensor in single.full_state_dict().items():
        torch.testing.assert_close(result["state"][name], tensor, atol=1e-5, rtol=0, msg=name)
        assert torch.equal(result["pushed"][name], result["state"][name]), name
        torch.testing.assert_close(result["reloaded"][name], result["state"][name], atol=1e-6, rtol=0, msg=name)
    adapters = dict(single._hf_adapters())
    assert list(result["adapters"]) == list(adapters)  # every layer's, in the model's order
    for name, tensor in adapters.items():
        torch.testing.assert_close(result["adapters"][name], tensor, atol=1e-5, rtol=0, msg=name)
    from safetensors.torch import load_file

    saved = load_file(str(Path(str(out) + ".ckpt") / "adapter" / "megatron_adapters.safetensors"))
    single.save(tmp_path / "single")
    expected = load_file(str(tmp_path / "single" / "adapter" / "megatron_adapters.safetensors"))
    assert saved.keys() == expected.keys()  # whole-model names, whatever the layout
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, atol=1e-5, rtol=0, msg=name)
