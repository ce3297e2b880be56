"""LoRA with adapter-only sync (train.lora.sync adapter): pushes carry only A and scale * B, the embedded engine
applies them over its untouched base (scaling applied once, rsLoRA too), and its log-probs equal the trainer's;
each update replaces the adapters whole (nothing stale stays), and a bad update loads nothing."""

import sys
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import PolicyObjective
from miles.core.config import AlgorithmConfig
from miles.core.loop import train_step
from miles.rollout.engines.embedded import EmbeddedEngine
from miles.sync import InProcessTransport, WeightSender
from miles.train import FSDP2Backend, TrainConfig
from miles.train.config import LoraConfig
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402

OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _backend(model_dir, **lora) -> FSDP2Backend:
    cfg = LoraConfig(**{"rank": 4, "alpha": 8.0, "target_modules": TARGETS, "sync": "adapter", **lora})
    return FSDP2Backend(model_dir, train=TrainConfig(lr=1e-2, micro_batch_size=4, lora=cfg), temperature=1.0)


def _engine_log_probs(engine: EmbeddedEngine, batch) -> torch.Tensor:
    prompts = [batch.tokens[b, : int(batch.prompt_lengths[b])].tolist() for b in range(batch.batch_size)]
    responses = [
        batch.tokens[
            b, int(batch.prompt_lengths[b]) : int(batch.prompt_lengths[b] + batch.response_lengths[b])
        ].tolist()
        for b in range(batch.batch_size)
    ]
    return engine.score(prompts, responses, temperature=1.0)


def _assert_engine_matches_trainer(engine, backend, batch) -> None:
    trainer = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    scored = _engine_log_probs(engine, batch)
    for row in range(batch.batch_size):
        n = int(batch.response_lengths[row])
        torch.testing.assert_close(scored[row, :n], trainer[row, :n], atol=1e-5, rtol=0)


def test_a_push_carries_only_a_and_the_scaled_b(tiny_llama_dir):
    backend = _backend(tiny_llama_dir)
    train_step(backend, make_batch(seed=0), OBJECTIVE)
    pushed = dict(backend.export_weights())
    held = dict(backend.model.named_parameters())
    assert pushed.keys() == {n for n in held if ".lora_" in n} and len(pushed) == 2 * 3 * 2
    layer = "model.layers.1.self_attn.q_proj"
    assert torch.equal(pushed[f"{layer}.lora_A.default.weight"], held[f"{layer}.lora_A.default.weight"].detach())
    b = held[f"{layer}.lora_B.default.weight"].detach()
    assert b.abs().max() > 0
    torch.testing.assert_close(pushed[f"{layer}.lora_B.default.weight"], b * (8.0 / 4), atol=0, rtol=0)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_after_lora_steps_the_engine_applying_the_adapters_matches_the_trainer(tiny_llama_dir, use_rslora):
    backend = _backend(tiny_llama_dir, use_rslora=use_rslora)
    engine = EmbeddedEngine(tiny_llama_dir, stop_token_ids=[2])
    sender = WeightSender(InProcessTransport(engine.receiver))
    for version in (1, 2, 3):
        train_step(backend, make_batch(seed=version), OBJECTIVE)
        sender.push(backend.export_weights(), version=version)
    assert engine.weight_version == 3
    _assert_engine_matches_trainer(engine, backend, make_batch(seed=7))
    # the engine's base is the base it loaded, bit for bit: never sent, never merged
    state = engine.model.state_dict()
    for name, tensor in load_file(Path(tiny_llama_dir) / "model.safetensors").items():
        held = state.get(name, state.get(name.replace(".weight", ".base_layer.weight")))
        assert torch.equal(held, tensor), name
    engine.close()


def test_each_update_replaces_the_adapters_and_a_bad_one_loads_nothing(tiny_llama_dir):
    backend = _backend(tiny_llama_dir)
    engine = EmbeddedEngine(tiny_llama_dir, stop_token_ids=[2])
    train_step(backend, make_batch(seed=0), OBJECTIVE)
    engine.load_weights(backend.export_weights())
    train_step(backend, make_batch(seed=1), OBJECTIVE)
    latest = dict(backend.export_weights())
    engine.load_weights(latest.items())
    fresh = EmbeddedEngine(tiny_llama_dir, stop_token_ids=[2])
    fresh.load_weights(latest.items())  # only the latest update: the same model as after two
    batch = make_batch(seed=4)
    assert torch.equal(_engine_log_probs(engine, batch), _engine_log_probs(fresh, batch))
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    partial = {n: t * 2 for n, t in latest.items() if "v_proj" not in n}
    with pytest.raises(ValueError, match=r"must carry exactly the adapters the engine holds: missing \[.*v_proj"):
        engine.load_weights(partial.items())
    other_rank = _backend(tiny_llama_dir, rank=2)
    with pytest.raises(ValueError, match="has shape .* the engine's is .*another train.lora.rank"):
        engine.load_weights(other_rank.export_weights())
    assert all(torch.equal(t, before[n]) for n, t in engine.model.state_dict().items())  # nothing loaded
    # HF names of the base still load after the adapters wrapped their layers
    name = "model.layers.0.self_attn.q_proj.weight"
    engine.load_weights([(name, torch.zeros_like(before[name.replace(".weight", ".base_layer.weight")]))])
    assert engine.model.state_dict()["model.layers.0.self_attn.q_proj.base_layer.weight"].abs().max() == 0
    for e in (engine, fresh):
        e.close()


def test_an_adapter_for_a_module_the_engine_lacks_is_refused(tiny_llama_dir):
    engine = EmbeddedEngine(tiny_llama_dir, stop_token_ids=[2])
    update = [("model.layers.0.self_attn.qkv.lora_A.default.weight", torch.zeros(4, 64))]
    with pytest.raises(ValueError, match="names 'model.layers.0.self_attn.qkv', which is not a Linear layer"):
        engine.load_weights(update)
    engine.close()


def test_adapters_are_refused_on_a_base_resumed_zero_filled_until_the_weights_are_pushed(tiny_llama_dir):
    # From a review: release_weights / resume_weights zero the base, which an adapter-only update never resends
    backend = _backend(tiny_llama_dir)
    engine = EmbeddedEngine(tiny_llama_dir, stop_token_ids=[2])
    engine.load_weights(backend.export_weights())
    engine.release_weights()
    engine.resume_weights()
    with pytest.raises(ValueError, match="base weights were released and re-allocated zero-filled"):
        engine.load_weights(backend.export_weights())
    engine.load_weights(load_file(Path(tiny_llama_dir) / "model.safetensors").items())  # the base, HF names
    engine.load_weights(backend.export_weights())
    _assert_engine_matches_trainer(engine, backend, make_batch(seed=2))
    engine.close()
