"""The PPO critic (weights + optimizer) is saved with the policy and restored on load."""

import sys
from pathlib import Path

import pytest
import torch
from miles.core.config import AlgorithmConfig
from miles.train import FSDP2Backend, TrainConfig
from miles.train.fsdp2.state import full_model_state

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402


def _backend(model_dir, critic_path):
    algorithm = AlgorithmConfig(advantage_estimator="gae", critic_path=str(critic_path) if critic_path else "")
    return FSDP2Backend(
        model_dir,
        train=TrainConfig(micro_batch_size=3),
        algorithm=algorithm,
        temperature=1.0,
        max_new_tokens=8,
        critic_path=critic_path,
    )


def test_critic_weights_and_optimizer_survive_save_and_load(tiny_llama_dir, tmp_path):
    backend = _backend(tiny_llama_dir, tiny_llama_dir)
    batch = make_batch()
    values = backend.critic.compute_values(batch)
    backend.critic.train_step(batch.replace(values=values, returns=values + 1.0), num_tokens=batch.num_loss_tokens)
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
    FSDP2Backend(
        tiny_llama_dir, train=TrainConfig(), algorithm=AlgorithmConfig(), temperature=1.0, max_new_tokens=8
    ).save(tmp_path)
    with pytest.raises(FileNotFoundError, match="no critic"):
        _backend(tiny_llama_dir, tiny_llama_dir).load(tmp_path)
