"""One log-ratio clamp for every ratio: the PPO ratio, the rollout importance weights and the k3 KL."""

import ast
import math
from pathlib import Path

import pytest
import torch
from miles.core.algorithms import importance, kl, losses
from miles.core.algorithms.ratios import LOG_RATIO_CLAMP

PACKAGES = Path(__file__).resolve().parents[3] / "packages"


def test_the_log_ratio_clamp_is_assigned_in_ratios_py_only_and_imported_elsewhere():
    assigned = []
    for path in PACKAGES.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == "LOG_RATIO_CLAMP" for t in targets):
                assigned.append(path.relative_to(PACKAGES).as_posix())
    assert assigned == ["miles-core/src/miles/core/algorithms/ratios.py"]
    assert losses.LOG_RATIO_CLAMP is importance.LOG_RATIO_CLAMP is kl.LOG_RATIO_CLAMP is LOG_RATIO_CLAMP


def test_every_ratio_saturates_at_the_same_clamp():
    # log ratio 50 -> clamped to 20: ratio e^20 = 4.85165e8 for the PPO ratio (A = -1: loss r), the TIS weight
    # (upper bound above it) and k3 = e^20 - 20 - 1.
    big = torch.tensor([[50.0]])
    ppo, _ = losses.ppo_clip(big, torch.zeros(1, 1), -torch.ones(1, 1), clip_low=0.2, clip_high=0.2)
    weights, _ = importance.importance_weights(
        big, torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), mode="tis", level="token", lower=0.0, upper=1e9
    )
    k3 = kl.kl_estimate(torch.zeros(1, 1), big, estimator="k3")
    assert LOG_RATIO_CLAMP == 20.0
    assert ppo.item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert weights.item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert k3.item() == pytest.approx(math.exp(20.0) - 21.0, rel=1e-6)
