"""The PPO critic (weights + optimizer) is saved with the policy and restored on load."""

import json
import sys
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import PolicyObjective
from miles.core.config import AdvantageConfig, AlgorithmConfig, CriticConfig
from miles.core.loop import train_step
from miles.train import FSDP2Backend, TrainConfig
from miles.train.fsdp2.state import full_model_state

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402

GAE = PolicyObjective(
    AlgorithmConfig(advantage=AdvantageConfig(estimator="gae")), max_new_tokens=8, critic=CriticConfig()
)


def _backend(model_dir, critic_path, **train):
    return FSDP2Backend(
        model_dir, train=TrainConfig(micro_batch_size=3, **train), temperature=1.0, critic_path=critic_path
    )


def test_critic_weights_and_optimizer_survive_save_and_load(tiny_llama_dir, tmp_path):
    backend = _backend(tiny_llama_dir, tiny_llama_dir)
    batch = make_batch()
    _one_critic_step(backend)
    backend.save(tmp_path)
    assert (tmp_path / "critic" / "model.safetensors").is_file()

    restored = _backend(tiny_llama_dir, tiny_llama_dir)
    restored.load(tmp_path)
    expected, got = full_model_state(backend.critic.model), full_model_state(restored.critic.model)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=0, rtol=0, msg=name)
    torch.testing.assert_close(restored.critic.compute_values(batch), backend.critic.compute_values(batch))
    moments = [s["exp_avg"] for s in restored.critic.optimizer.state.values()]
    assert moments and any(m.abs().sum() > 0 for m in moments)


def test_loading_a_checkpoint_without_critic_into_a_critic_run_is_a_clear_error(tiny_llama_dir, tmp_path):
    FSDP2Backend(tiny_llama_dir, train=TrainConfig(), temperature=1.0).save(tmp_path)
    with pytest.raises(FileNotFoundError, match="no critic"):
        _backend(tiny_llama_dir, tiny_llama_dir).load(tmp_path)


def _one_critic_step(backend):
    batch = make_batch()
    values = backend.critic.compute_values(batch)
    train_step(backend, batch.replace(values=values, returns=values + 1.0), GAE)


def test_the_critic_lr_schedule_and_skip_count_survive_save_and_load(tiny_llama_dir, tmp_path):
    # warmup 4, critic_lr 1e-5 (default): after one step the next uses 1e-5 * 2/4 = 5e-6.
    backend = _backend(tiny_llama_dir, tiny_llama_dir, warmup_steps=4)
    _one_critic_step(backend)
    backend.critic.num_skipped_steps = 2
    backend.save(tmp_path)
    restored = _backend(tiny_llama_dir, tiny_llama_dir, warmup_steps=4)
    restored.load(tmp_path)
    assert restored.critic.scheduler.last_epoch == 1 and restored.critic.num_skipped_steps == 2
    assert restored.critic.optimizer.param_groups[0]["lr"] == pytest.approx(5e-6)
    assert restored.critic.scheduler.get_last_lr() == pytest.approx([5e-6])


def test_a_critic_checkpoint_from_before_the_critic_schedule_still_loads_and_continues_the_warmup(
    tiny_llama_dir, tmp_path
):
    backend = _backend(tiny_llama_dir, tiny_llama_dir, warmup_steps=4)
    _one_critic_step(backend)
    backend.save(tmp_path)
    # The old layout: critic/optimizer.pt held only the optimizer, whose LR was the constant critic_lr (no
    # schedule, so no initial_lr); trainer_state.json counted 1 step, and the critic stepped once per step.
    old = torch.load(tmp_path / "critic" / "optimizer.pt", weights_only=True)
    for group in old["optimizer"]["param_groups"]:
        group.pop("initial_lr")
        group["lr"] = 1e-5
    torch.save({"optimizer": old["optimizer"]}, tmp_path / "critic" / "optimizer.pt")
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    (tmp_path / "trainer_state.json").write_text(json.dumps({**state, "step": 1}))
    restored = _backend(tiny_llama_dir, tiny_llama_dir, warmup_steps=4)
    restored.load(tmp_path)
    # Continued at step 1: 1e-5 * min(1, 2/4) = 5e-6 (a fresh schedule would give 2.5e-6, the old code 1e-5).
    assert restored.critic.optimizer.param_groups[0]["lr"] == pytest.approx(5e-6)
    assert restored.critic.scheduler.last_epoch == 1 and restored.critic.num_skipped_steps == 0
    _one_critic_step(restored)
    assert restored.critic.optimizer.param_groups[0]["lr"] == pytest.approx(7.5e-6)
