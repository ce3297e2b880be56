"""The PPO critic under FSDP2 trains without FSDP2's "returned a view tensor" warning (policy tied or untied)."""

import sys
import warnings
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import PolicyObjective
from miles.core.config import AdvantageConfig, AlgorithmConfig, CriticConfig
from miles.core.loop import train_step
from miles.train import FSDP2Backend, TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402


def _tiny_llama(path: Path, *, tie_word_embeddings: bool) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tie_word_embeddings,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("tie_word_embeddings", [False, True], ids=["untied", "tied"])
def test_policy_and_critic_train_steps_raise_no_view_tensor_warning(tmp_path, tie_word_embeddings):
    model_dir = _tiny_llama(tmp_path, tie_word_embeddings=tie_word_embeddings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = FSDP2Backend(model_dir, train=TrainConfig(micro_batch_size=3), temperature=1.0, critic_path=model_dir)
        batch = backend.forward(make_batch(), outputs={"old_log_probs", "values"})
        metrics = train_step(backend, batch.replace(returns=batch.values + 1.0), GAE)
    assert metrics["loss/value"] > 0.0
    views = [str(w.message) for w in caught if "view tensor" in str(w.message)]
    assert not views, views


GAE = PolicyObjective(
    AlgorithmConfig(advantage=AdvantageConfig(estimator="gae")), max_new_tokens=8, critic=CriticConfig()
)


def _critic_backend(model_dir, *, lr=1e-3, **train):
    return FSDP2Backend(
        model_dir, train=TrainConfig(micro_batch_size=3, **train), temperature=1.0, critic_path=model_dir, critic_lr=lr
    )


def _critic_batch(backend, *, returns_offset=1.0):
    batch = make_batch()
    values = backend.critic.compute_values(batch)
    return batch.replace(values=values, returns=values + returns_offset)


def test_the_critic_warms_its_learning_rate_up_like_the_policy(tiny_llama_dir):
    # warmup 4, critic_lr 1e-3: step k uses 1e-3 * min(1, (k + 1) / 4) -> 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3.
    backend = _critic_backend(tiny_llama_dir, warmup_steps=4)
    assert backend.critic.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4)
    lrs = []
    for _ in range(4):
        batch = _critic_batch(backend)
        lrs.append(train_step(backend, batch, GAE)["critic_lr"])
    assert lrs == pytest.approx([5e-4, 7.5e-4, 1e-3, 1e-3])  # as the policy's "lr": the LR of the next step


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nonfinite_critic_step_is_skipped_and_counted_or_stops_the_run(tiny_llama_dir, bad):
    from miles.train.fsdp2.state import full_model_state

    skipping = _critic_backend(tiny_llama_dir)
    before = {k: v.clone() for k, v in full_model_state(skipping.critic.model).items()}
    batch = _critic_batch(skipping, returns_offset=bad)
    metrics = train_step(skipping, batch, GAE)
    assert metrics["critic_skipped_steps"] == 1.0 and metrics["critic_lr"] == pytest.approx(1e-3)
    assert all(torch.equal(before[k], v) for k, v in full_model_state(skipping.critic.model).items())
    assert all(p.grad is None for p in skipping.critic.model.parameters())
    good = _critic_batch(skipping)
    assert train_step(skipping, good, GAE)["critic_skipped_steps"] == 1.0

    stopping = _critic_backend(tiny_llama_dir, skip_nonfinite_steps=False)
    batch = _critic_batch(stopping, returns_offset=bad)
    with pytest.raises(FloatingPointError, match=r"critic loss is .*models.critic.lr.*skip-nonfinite-steps true"):
        train_step(stopping, batch, GAE)
