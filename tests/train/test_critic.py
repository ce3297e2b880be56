"""The PPO critic under FSDP2 trains without FSDP2's "returned a view tensor" warning (policy tied or untied)."""

import sys
import warnings
from pathlib import Path

import pytest
import torch
from miles.core.config import AlgorithmConfig
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
        backend = FSDP2Backend(
            model_dir,
            train=TrainConfig(micro_batch_size=3),
            algorithm=AlgorithmConfig(advantage_estimator="gae", critic_path=str(model_dir)),
            temperature=1.0,
            max_new_tokens=8,
            critic_path=model_dir,
        )
        batch = backend.compute_log_probs(make_batch())
        metrics = backend.train_step(batch.replace(returns=batch.values + 1.0))
    assert metrics["loss/value"] > 0.0
    views = [str(w.message) for w in caught if "view tensor" in str(w.message)]
    assert not views, views
