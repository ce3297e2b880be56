"""Flow-GRPO / DiffusionNFT on two gloo ranks (FSDP2 over the transformer, each rank sampling its part of every
mini-batch) equal one process: metrics of each step, the trained weights, the optimizer's moments, the held-out
evaluation, and a resume from one process's checkpoint (``miles.diffusion.trainer``, several ranks)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusion_ranks import MODES, PROMPTS, config, reward
from miles.diffusion.models import tiny_flow_model
from miles.diffusion.trainer import FlowGRPOTrainer, rank_rows

WORKER = Path(__file__).parent / "diffusion_ranks_worker.py"
COMPARED = ("reward/mean", "reward/std_in_group", "loss", "grad_norm", "weight_version", "optimizer_steps")


def test_each_rank_holds_an_equal_part_of_every_mini_batch():
    assert rank_rows(8, 2, 0, 2).tolist() == [0, 1, 4, 5]
    assert rank_rows(8, 2, 1, 2).tolist() == [2, 3, 6, 7]
    assert rank_rows(6, 1, 2, 3).tolist() == [4, 5]
    with pytest.raises(ValueError, match="2 mini-batches x 2 ranks must divide the batch of 6"):
        rank_rows(6, 2, 0, 2)


def _close(a, b, what, atol=2e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=what)


@pytest.mark.integration
@pytest.mark.parametrize(
    "mode", ["flow_grpo", *(pytest.param(mode, marks=pytest.mark.slow) for mode in MODES if mode != "flow_grpo")]
)
def test_two_ranks_equal_one_process(tmp_path, mode):
    straight = FlowGRPOTrainer(tiny_flow_model(seed=0), config(mode), reward)
    first = straight.step(PROMPTS)
    torch.save(straight.state_dict(), tmp_path / "after_step_1.pt")  # what the ranks resume from
    second = straight.step(PROMPTS)
    score, images = straight.evaluate(PROMPTS + ["a dark image"], seed=11)
    state = straight.state_dict()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(rank),
                "2",
                str(tmp_path / "init"),
                mode,
                str(tmp_path / "out.pt"),
                str(tmp_path / "after_step_1.pt"),
            ],
            cwd=WORKER.parent,
        )  # fmt: skip
        for rank in range(2)
    ]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    ranks = torch.load(tmp_path / "out.pt", weights_only=True)
    for step, (one, two) in enumerate(zip((first, second), ranks["metrics"]), start=1):
        assert set(one) == set(two)
        for key in COMPARED + tuple(k for k in one if k.startswith(("nft/", "kl", "approx_kl", "clipfrac"))):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (step, key)
    for key, tensor in state["transformer"].items():  # the whole weights (LoRA: the adapters)
        _close(ranks["state"]["transformer"][key], tensor, key)
    for index, moments in state["optimizer"]["state"].items():
        for key, tensor in moments.items():
            _close(ranks["state"]["optimizer"]["state"][index][key], tensor, (index, key))
    for key, tensor in state.get("old_params", {}).items():
        _close(ranks["state"]["old_params"][key], tensor, key)
    with straight.trained_transformer() as transformer:
        for key, tensor in transformer.state_dict().items():
            _close(ranks["trained"][key], tensor, key)
    assert ranks["eval"][0] == pytest.approx(score, abs=1e-5)
    assert (ranks["eval"][1].numpy().astype(int) - images.astype(int)).__abs__().max() <= 1  # uint8 rounding
    # two ranks resumed from one process's checkpoint take the second step one process took
    for key in COMPARED:
        assert ranks["resumed_metrics"][key] == pytest.approx(second[key], rel=1e-4, abs=1e-6), key
    for key, tensor in state["transformer"].items():
        _close(ranks["resumed_state"]["transformer"][key], tensor, key)
