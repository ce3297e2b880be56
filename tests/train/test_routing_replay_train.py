"""Routing replay (R3) through the FSDP2 trainer: rollouts of the embedded engine on a tiny DeepSeek-V3 carry their
routing into the batch; with replay the trainer's log-probs equal the engine's, and when the trainer's routers
differ from the engine's (as kernels or a weight update make them) replay closes part of the gap, as the
train_rollout mismatch metric shows."""

import pytest
import torch
from miles.core.algorithms.objective import PolicyObjective
from miles.core.batch import build_train_batch
from miles.core.config import AlgorithmConfig
from miles.core.loop import train_step
from miles.train import FSDP2Backend, TrainConfig
from moe_models import engine_rollout, save_moe_model

OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_moe_model("deepseek_v3", tmp_path_factory.mktemp("tiny_deepseek_v3"))


@pytest.fixture(scope="module")
def rollout(moe_dir):
    """8 samples (4 prompts x 2) of the engine in "prefill" log-prob mode, with routing."""
    samples = engine_rollout(moe_dir)
    assert all(s.response_length > 0 for s in samples)
    return samples


def _batch(samples):
    return build_train_batch(samples, torch.tensor([1.0, -1.0] * 4), pad_token_id=0)


def _backend(moe_dir, layout="packed") -> FSDP2Backend:
    return FSDP2Backend(moe_dir, train=TrainConfig(lr=1e-3, micro_batch_size=4, batch_layout=layout), temperature=1.0)


def _perturb_routers(backend: FSDP2Backend, scale: float = 0.03) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in backend.model.named_parameters():
            if ".mlp.gate." in name:
                param.add_(torch.randn(param.shape, generator=gen) * scale)


def _gap(batch, log_probs) -> float:
    """Mean |trainer - engine| log-prob over the loss tokens."""
    mask = batch.loss_mask.bool()
    return float((log_probs - batch.rollout_log_probs)[mask].abs().mean())


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_with_replay_the_trainer_log_probs_equal_the_engines(moe_dir, rollout, layout):
    batch = _batch(rollout)
    assert batch.routed_experts is not None and batch.routed_experts.shape[2:] == (3, 2)
    backend = _backend(moe_dir, layout)
    replayed = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(replayed[mask], batch.rollout_log_probs[mask], atol=1e-5, rtol=0)


def test_when_the_routers_differ_replay_closes_part_of_the_gap_in_the_mismatch_metric(moe_dir, rollout):
    batch = _batch(rollout)
    gaps, metrics = {}, {}
    for name, routed in (("live", None), ("replay", batch.routed_experts)):
        backend = _backend(moe_dir)
        _perturb_routers(backend)
        run = batch.replace(routed_experts=routed)
        gaps[name] = _gap(run, backend.forward(run, outputs={"old_log_probs"}).old_log_probs)
        run = backend.forward(run, outputs={"old_log_probs"})
        metrics[name] = train_step(backend, run, OBJECTIVE)["train_rollout_logprob_abs_diff"]
    assert gaps["live"] > 1e-3  # the routers' change shows in the log-probs
    assert gaps["replay"] < 0.5 * gaps["live"]
    assert metrics["replay"] == pytest.approx(gaps["replay"], rel=1e-4)  # the metric measures the same gap
    assert metrics["live"] == pytest.approx(gaps["live"], rel=1e-4)


def test_training_with_replay_moves_the_routers(moe_dir, rollout):
    backend = _backend(moe_dir)
    batch = backend.forward(_batch(rollout), outputs={"old_log_probs"})
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters() if n.endswith("mlp.gate.weight")}
    train_step(backend, batch, OBJECTIVE)
    after = dict(backend.model.named_parameters())
    assert before and all(not torch.equal(before[n], after[n].detach()) for n in before)


def test_a_reference_of_another_architecture_routes_itself(moe_dir, rollout, tiny_llama_dir):
    # Regression (review): a dense reference model got the policy's routing and its forward raised
    backend = FSDP2Backend(
        moe_dir, train=TrainConfig(micro_batch_size=4), temperature=1.0, reference_path=tiny_llama_dir
    )
    batch = backend.forward(_batch(rollout), outputs={"ref_log_probs", "old_log_probs"})
    assert torch.isfinite(batch.ref_log_probs).all()
    assert backend._replays(backend.model) and not backend._replays(backend.ref_model)
