"""LoRA (train.lora): only adapters train, engines get W + scale * B A, the base untouched exactly, the reference
is the adapter-disabled policy, checkpoints hold the adapters (peft's layout) and the merged model."""

import sys
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import PolicyObjective
from miles.core.config import AlgorithmConfig
from miles.core.loop import train_step
from miles.train import FSDP2Backend, TrainConfig
from miles.train.config import LoraConfig
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402

OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _backend(model_dir, lora=LORA, **kwargs) -> FSDP2Backend:
    return FSDP2Backend(model_dir, train=TrainConfig(lr=1e-2, micro_batch_size=4, lora=lora), temperature=1.0, **kwargs)


def _base(model_dir) -> dict[str, torch.Tensor]:
    return load_file(Path(model_dir) / "model.safetensors")


def test_only_adapters_train_and_the_first_push_is_the_base_exactly(tiny_llama_dir):
    backend = _backend(tiny_llama_dir)
    trainable = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert len(trainable) == 2 * 3 * 2  # A and B x 3 target modules x 2 layers
    assert {id(p) for g in backend.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in backend.model.named_parameters() if n in trainable
    }
    pushed = dict(backend.export_weights())
    base = _base(tiny_llama_dir)
    assert pushed.keys() == base.keys()  # HF names: no base_layer, no adapter tensors
    for name, tensor in base.items():  # B starts at zero: W + scale * B A == W bit for bit
        assert torch.equal(pushed[name], tensor), name


def test_merged_push_is_base_plus_scaled_adapter_product_and_untouched_tensors_are_exact(tiny_llama_dir):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    backend = _backend(tiny_llama_dir)
    for seed in range(3):
        train_step(backend, make_batch(seed=seed), OBJECTIVE)
    pushed = dict(backend.export_weights())
    base = _base(tiny_llama_dir)
    layer = backend.model.model.layers[1].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert b.abs().max() > 0  # trained: the check below is not W == W
    expected = base["model.layers.1.self_attn.q_proj.weight"] + (b @ a) * (8.0 / 4)
    torch.testing.assert_close(pushed["model.layers.1.self_attn.q_proj.weight"], expected, atol=1e-7, rtol=0)
    for name, tensor in base.items():
        if not any(t in name for t in ("q_proj", "v_proj", "down_proj")):
            assert torch.equal(pushed[name], tensor), name  # the untouched base goes out exactly as loaded
    # peft's own merge of the same adapters gives the same model
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32),
        PeftLoraConfig(r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    adapters = {n: p for n, p in backend.model.named_parameters() if ".lora_" in n}
    reference.base_model.model.load_state_dict(adapters, strict=False)
    merged = reference.merge_and_unload().state_dict()
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0, msg=name)


def test_engine_with_the_merged_push_matches_the_trainer_log_probs(tiny_llama_dir):
    from miles.rollout.engines.embedded import EmbeddedEngine
    from miles.sync import InProcessTransport, WeightSender

    backend = _backend(tiny_llama_dir)
    for seed in range(2):
        train_step(backend, make_batch(seed=seed), OBJECTIVE)
    engine = EmbeddedEngine(tiny_llama_dir, stop_token_ids=[2])
    WeightSender(InProcessTransport(engine.receiver)).push(backend.export_weights(), version=1)
    batch = make_batch(seed=5)
    trainer = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    with torch.no_grad():
        logits = engine.model(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits
    for row in range(batch.batch_size):
        p, n = int(batch.prompt_lengths[row]), int(batch.response_lengths[row])
        lp = torch.log_softmax(logits[row, p - 1 : p + n - 1], -1).gather(-1, batch.tokens[row, p : p + n, None])[:, 0]
        torch.testing.assert_close(trainer[row, :n], lp, atol=1e-5, rtol=0)
    engine.close()


def test_the_reference_is_the_adapter_disabled_policy(tiny_llama_dir):
    plain = FSDP2Backend(tiny_llama_dir, train=TrainConfig(), temperature=1.0)
    backend = _backend(tiny_llama_dir, reference_path=tiny_llama_dir)
    assert backend.ref_model is None and "ref_log_probs" in backend.available_outputs  # no second copy held
    batch = make_batch(seed=3)
    base = plain.forward(batch, outputs={"old_log_probs"}).old_log_probs
    for seed in range(3):
        train_step(backend, make_batch(seed=seed), OBJECTIVE)
    out = backend.forward(batch, outputs={"old_log_probs", "ref_log_probs"})
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(out.ref_log_probs[mask], base[mask], atol=1e-6, rtol=0)
    assert (out.old_log_probs[mask] - base[mask]).abs().max() > 1e-3  # the adapters did change the policy


def test_checkpoint_holds_adapters_for_resume_and_the_merged_model_for_export(tiny_llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    backend = _backend(tiny_llama_dir)
    train_step(backend, make_batch(seed=0), OBJECTIVE)
    backend.save(tmp_path)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).state_dict()
    for name, tensor in dict(backend.export_weights()).items():
        assert torch.equal(merged[name], tensor), name
    # peft loads the adapters onto the base and gives the merged model's logits
    tokens = make_batch().tokens[:2]
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32), tmp_path / "adapter"
    )
    merged_model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=tokens).logits, merged_model(input_ids=tokens).logits,
                                   atol=1e-5, rtol=0)  # fmt: skip
    # exact resume: the next step from the checkpoint equals the next step of the original
    restored = _backend(tiny_llama_dir)
    restored.load(tmp_path)
    assert restored.step == 1
    train_step(backend, make_batch(seed=1), OBJECTIVE)
    train_step(restored, make_batch(seed=1), OBJECTIVE)
    for (name, a), (_, b) in zip(backend.export_weights(), restored.export_weights()):
        assert torch.equal(a, b), name


def test_resume_with_other_adapters_and_unknown_modules_fail_in_one_line(tiny_llama_dir, tmp_path):
    backend = _backend(tiny_llama_dir)
    backend.save(tmp_path)
    other = _backend(tiny_llama_dir, lora=LoraConfig(rank=2, target_modules=["q_proj", "v_proj", "down_proj"]))
    with pytest.raises(ValueError, match=r"was trained with r 4, this run has 2"):
        other.load(tmp_path)
    with pytest.raises(ValueError, match=r"train.lora.target_modules: 'qkv' matches no module, not a Linear.*'q_proj'"):
        _backend(tiny_llama_dir, lora=LoraConfig(target_modules=["qkv"]))


def test_adapter_init_is_seeded_not_taken_from_the_run_rng(tiny_llama_dir):
    # Regression: A came from the global RNG, so a resumed run (other draws before the build) started from other
    # adapters and its steps differed from the uninterrupted run's.
    torch.manual_seed(1)
    first = _backend(tiny_llama_dir)
    torch.rand(1000)
    second = _backend(tiny_llama_dir)
    state = torch.get_rng_state()
    third = _backend(
        tiny_llama_dir, lora=LoraConfig(rank=4, alpha=8.0, target_modules=LORA.target_modules, init_seed=7)
    )
    assert torch.equal(torch.get_rng_state(), state)  # the run's RNG stream is not moved
    for (name, a), (_, b), (_, c) in zip(*(m.model.named_parameters() for m in (first, second, third))):
        if "lora_A" in name:
            assert torch.equal(a, b) and not torch.equal(a, c), name


@pytest.mark.integration
def test_two_ranks_push_save_and_load_the_same_merged_model_as_one(tiny_llama_dir, tmp_path):
    # Regression: rank 0 merged the checkpoint from the live (sharded) adapters after the other rank had returned:
    # an all-gather one rank ran alone, so save hung.
    import subprocess

    from miles.core.algorithms.objective import LossCounts
    from transformers import AutoModelForCausalLM

    worker = Path(__file__).parent / "lora_worker.py"
    out = tmp_path / "rank0.pt"
    args = [str(tmp_path / "init"), str(tiny_llama_dir), str(out)]
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", *args], cwd=worker.parent) for r in range(2)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    result = torch.load(out, weights_only=True)
    single = _backend(tiny_llama_dir)
    batch = make_batch()
    single.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    single.optimizer_step()
    expected = dict(single.export_weights())
    assert result["pushed"].keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(result["pushed"][name], tensor, atol=1e-5, rtol=0, msg=name)
        assert torch.equal(result["restored"][name], result["pushed"][name]), name
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint" / "model", dtype=torch.float32).state_dict()
    for name, tensor in result["pushed"].items():
        assert torch.equal(saved[name], tensor), name


def test_adapter_dropout_is_on_in_training_only(tiny_llama_dir):
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.5, target_modules=["q_proj", "v_proj"])
    backend = _backend(tiny_llama_dir, lora=lora)
    train_step(backend, make_batch(seed=0), OBJECTIVE)  # B != 0, so dropout would show in the output
    batch = make_batch(seed=2)
    first = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    second = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    assert torch.equal(first, second)  # no dropout outside training: deterministic, like the engine's
    layers = [m for n, m in backend.model.named_modules() if n.endswith("lora_dropout.default")]
    assert layers and not any(m.training for m in layers)


def test_resume_with_other_scaling_and_untied_targets_are_refused(tiny_llama_dir, tiny_smollm2_dir, tmp_path):
    backend = _backend(tiny_llama_dir)
    backend.save(tmp_path)
    other = _backend(tiny_llama_dir, lora=LoraConfig(rank=4, alpha=16.0, target_modules=LORA.target_modules))
    with pytest.raises(ValueError, match=r"was trained with lora_alpha 8.0, this run has 16.0"):
        other.load(tmp_path)
    with pytest.raises(ValueError, match=r"lm_head shares its weight with the input embedding"):
        _backend(tiny_smollm2_dir, lora=LoraConfig(target_modules=["lm_head"]))
    with pytest.raises(
        ValueError, match=r"'embed_tokens' names a Embedding \(model.embed_tokens\), not a Linear layer"
    ):
        _backend(tiny_llama_dir, lora=LoraConfig(target_modules=["embed_tokens"]))
