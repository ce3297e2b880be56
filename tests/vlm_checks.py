"""Checks shared by the trainer tests of the VLM families (Qwen-VL: test_vlm_train.py, SmolVLM / Idefics3:
test_smolvlm_train.py)."""

import subprocess
import sys
from pathlib import Path

import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.train import FSDP2Backend, TrainConfig


def fsdp2_backend(path, **train) -> FSDP2Backend:
    """One fp32 FSDP2 rank on the model at ``path`` (micro-batches of 4, lr 1e-3, ``train`` overrides)."""
    return FSDP2Backend(path, train=TrainConfig(dtype="fp32", micro_batch_size=4, lr=1e-3, **train), temperature=1.0)


def max_gap(a, b, mask) -> float:
    """The largest |a - b| where ``mask`` is set."""
    return float(((a - b).abs() * mask).max())


def check_two_ranks_give_the_one_rank_gradient(
    model_dir: Path, batch, tmp_path: Path, objective: PolicyObjective, trained_prefixes: tuple[str, ...]
) -> None:
    """Run ``fsdp2_vlm_worker.py`` on two gloo ranks over ``batch``'s 4 rows (rank 0 the first two, rank 1 the last
    two: image rows and text rows, so one rank alone never calls the vision tower) and check that neither hangs,
    each rank's log-probs equal the one-rank ones (1e-6) and the reduced gradient equals the one-rank gradient of the
    whole batch, with a nonzero gradient under each of ``trained_prefixes`` (HF names)."""
    torch.save(batch, tmp_path / "batch.pt")
    worker = Path(__file__).parent / "train" / "fsdp2_vlm_worker.py"
    args = [str(tmp_path / "init"), str(model_dir), str(tmp_path / "batch.pt"), str(tmp_path / "rank")]
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", *args], cwd=worker.parent) for r in range(2)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0]
    single = fsdp2_backend(model_dir)
    old = single.forward(batch, outputs={"old_log_probs"}).old_log_probs
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)["old_log_probs"]
        width = got.shape[1]
        rows = batch.slice(2 * rank, 2 * rank + 2)
        assert max_gap(got, old[2 * rank : 2 * rank + 2, :width], rows.loss_mask[:, :width]) < 1e-6
    single.forward_backward(batch.replace(old_log_probs=old), objective, LossCounts.of(batch))
    expected = single.full_gradients()
    grads = torch.load(tmp_path / "rank0.pt", weights_only=True)["grads"]
    assert sorted(grads) == sorted(expected)
    for prefix in trained_prefixes:
        assert any(n.startswith(prefix) and grads[n].abs().sum() > 0 for n in grads), prefix
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
