"""Per-token KL estimators between the policy and a reference policy, from log-probs of sampled tokens.

With log_ratio = ref_log_probs - log_probs (log pi_ref/pi_theta of the sampled token), Schulman's estimators of
KL(pi_theta || pi_ref) are k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - log_ratio - 1.
Reference: J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.
``low_var_kl`` is k3 clamped to [-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP] (verl's name), bounding rare huge terms.
"""

from __future__ import annotations

from typing import Literal

import torch
from miles.core.algorithms.ratios import LOG_RATIO_CLAMP
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
# low_var_kl caps each per-token k3 term here (verl, core_algos.kl_penalty): one outlier token cannot dominate.
LOW_VAR_KL_CLAMP = 10.0


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, *, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref); differentiable in ``log_probs``.

    Args:
        log_probs: [B, T] float32 nats, current policy, carries grad.
        ref_log_probs: [B, T] float32 nats, frozen reference policy; no grad.
        estimator: "k1" (unbiased, high variance, can be negative), "k2" (biased, >= 0),
            "k3" (unbiased, >= 0, low variance; used by GRPO), "low_var_kl" (k3 clamped to [-10, 10]).
    Returns: [B, T] float32, unmasked (the caller aggregates with the loss mask).
    Raises: ValueError on shape mismatch or an unknown estimator.
    References: Schulman (2020) k1/k2/k3; GRPO arXiv:2402.03300 Eq. 4 (k3).
    """
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} != ref_log_probs {tuple(ref_log_probs.shape)}")
    log_ratio = ref_log_probs.float() - log_probs.float()
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator in ("k3", "low_var_kl"):
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # keeps exp() and its gradient finite
        k3 = torch.exp(log_ratio) - log_ratio - 1.0
        return k3 if estimator == "k3" else k3.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of 'k1', 'k2', 'k3', 'low_var_kl'")
