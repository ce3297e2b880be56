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


def test_fp16_scales_the_loss_and_unscales_the_gradients_before_the_step(tiny_llama_dir):
    # The same step in fp16 (loss x 65536 in the backward, gradients divided by 65536 before clipping) and fp32:
    # equal gradient norms up to fp16 rounding; an unscaled gradient would be 65536x the fp32 norm.
    batch = make_batch()
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
    fp16, fp32 = _backend(tiny_llama_dir, "fp16"), _backend(tiny_llama_dir, "fp32")
    low, high = train_step(fp16, batch, objective), train_step(fp32, batch, objective)
    assert low["loss_scale"] == 2.0**16 and "loss_scale" not in high
    assert low["skipped_steps"] == 0
    assert abs(low["grad_norm"] - high["grad_norm"]) < 0.02 * high["grad_norm"], (low, high)
    assert all(t.dtype == torch.float32 for t in fp16.full_state_dict().values())  # fp32 master weights


def test_fp16_overflow_skips_the_step_and_halves_the_scale_and_resume_keeps_the_scale(tiny_llama_dir, tmp_path, caplog):
    # A scale of 2^40 overflows fp16's 65504 in the backward: the step is skipped (even with skip_nonfinite_steps
    # false: overflow is part of fp16 training), the weights stay, the scale halves; a checkpoint keeps the scale.
    batch = make_batch()
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
    train = TrainConfig(dtype="fp16", lr=1e-3, micro_batch_size=3, fp16_initial_loss_scale=2.0**40)
    backend = FSDP2Backend(
        tiny_llama_dir, train=train.model_copy(update={"skip_nonfinite_steps": False}), temperature=1.0
    )
    before = backend.full_state_dict()
    with caplog.at_level("WARNING"):
        metrics = train_step(backend, batch, objective)
    assert metrics["skipped_steps"] == 1 and metrics["loss_scale"] == 2.0**39
    # the run's step number (1, not the 0 steps done before it), and what it was: an overflow, not a NaN loss
    assert any(
        r.getMessage().startswith("step 1: non-finite policy")
        and "an fp16 overflow of the backward at loss scale 1.09951e+12; the scale halves to 5.49756e+11"
        in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    after = backend.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    backend.save(tmp_path / "ckpt")
    resumed = FSDP2Backend(tiny_llama_dir, train=train, temperature=1.0)
    resumed.load(tmp_path / "ckpt")
    assert resumed.loss_scaler.scale == 2.0**39 and resumed.num_skipped_steps == 1


def test_dynamic_loss_scaler_backs_off_grows_and_floors_as_hand_computed():
    from miles.train.loss_scale import DynamicLossScaler

    scaler = DynamicLossScaler(scale=8.0, growth_interval=3, min_scale=2.0)
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert (scaler.scale, scaler.good_steps) == (8.0, 2)
    scaler.update(overflow=True)  # back off, and the count restarts
    assert (scaler.scale, scaler.good_steps) == (4.0, 0)
    for _ in range(3):
        scaler.update(overflow=False)
    assert (scaler.scale, scaler.good_steps) == (8.0, 0)  # grown after 3 good steps
    for _ in range(5):
        scaler.update(overflow=True)
    assert scaler.scale == 2.0  # floored at min_scale
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([2.0, 4.0, 6.0])
    scaler.unscale_([param, torch.nn.Parameter(torch.ones(1))])  # a parameter without a gradient is skipped
    assert param.grad.tolist() == [1.0, 2.0, 3.0]
    clone = DynamicLossScaler()
    clone.load_state_dict(scaler.state_dict())
    assert (clone.scale, clone.good_steps) == (2.0, 0)
