"""The one clamp applied to log-ratios before ``exp()``: the PPO/GSPO/CISPO ratio (``losses.py``), the rollout
importance weights (``importance.py``) and the k3 KL estimator (``kl.py``)."""

from __future__ import annotations

# |log ratio| <= 20 nats before exp(): e^20 = 4.9e8 is far past every clip (PPO 1 +- 0.2), cap (TIS ~2) and bound
# (MIS/IcePop ~5), so the clamp changes no clipped result, while float32 exp() (and its gradient) overflows to inf
# past ~88.7, e.g. for the summed log-ratio of a long sequence.
LOG_RATIO_CLAMP = 20.0
