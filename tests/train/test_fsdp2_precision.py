"""bf16 mixed precision: bf16 compute, fp32 master weights and optimizer state."""

import sys
from pathlib import Path

import torch
from miles.core.algorithms.objective import PolicyObjective
from miles.core.config import AlgorithmConfig
from miles.core.loop import train_step
from miles.train import FSDP2Backend, TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402


def _backend(model_dir, dtype):
    return FSDP2Backend(
        model_dir,
        train=TrainConfig(dtype=dtype, lr=1e-3, micro_batch_size=3),
        temperature=1.0,
    )


def test_bf16_keeps_fp32_master_weights_and_tracks_fp32_log_probs(tiny_llama_dir):
    batch = make_batch()
    bf16, fp32 = _backend(tiny_llama_dir, "bf16"), _backend(tiny_llama_dir, "fp32")
    low = bf16.forward(batch, outputs={"old_log_probs"}).old_log_probs
    high = fp32.forward(batch, outputs={"old_log_probs"}).old_log_probs
    assert low.dtype == torch.float32
    diff = ((low - high).abs() * batch.loss_mask).max()
    assert 0 < diff < 0.05  # bf16 rounding is visible but small on a 32-token vocabulary
    metrics = train_step(bf16, batch, PolicyObjective(AlgorithmConfig(), max_new_tokens=8))
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    state = bf16.full_state_dict()
    assert all(t.dtype == torch.float32 for t in state.values())
    moments = [s["exp_avg"] for s in bf16.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
