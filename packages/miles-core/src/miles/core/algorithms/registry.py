"""The one registry of algorithm names: advantage estimators and policy losses, with what each needs and is.

Every place that asks "which estimators have a group baseline?", "does this loss vanish at zero advantage?" or
"which log-probs must the backend compute before the advantages?" reads the entries here; config choices
(``miles.core.algorithms.config``), validation, the loop and the objective derive from them, and no other module
matches a name.
A new estimator or loss is one entry (or a ``module:attr`` plugin with the same signature).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.algorithms.advantages import (
    AdvantageFn,
    _gae,
    _grouped,
    _opd,
    _reinforce_pp,
    grpo_advantages,
    rloo_advantages,
)
from miles.core.algorithms.losses import PolicyLossFn, cispo_loss, gspo_loss, ppo_clip, sft_loss

# Fields of ``TrainBatch`` an estimator may need from the backend before advantages (``TrainBackend.forward``).
BACKEND_OUTPUTS = frozenset({"old_log_probs", "ref_log_probs", "teacher_log_probs", "values"})


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and what it needs.

    Attributes:
        fn: ``fn(inputs: AdvantageInputs, params: AdvantageParams) -> (advantages [B, T], returns [B, T] | None)``.
        needs: ``TrainBatch`` fields the backend must compute before the estimator runs (subset of
            ``BACKEND_OUTPUTS``); a KL-in-reward penalty adds old and reference log-probs on top.
        group_baseline: the baseline is the prompt's group, so a group of one sample always gets advantage 0.
        critic: needs a critic model (its ``values``) and trains it on the returned ``returns``.
        params: the ``AdvantageParams`` fields (``algorithm.advantage`` keys) it reads; setting another one is a
            config error.
    """

    fn: AdvantageFn
    needs: frozenset[str] = frozenset()
    group_baseline: bool = False
    critic: bool = False
    params: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PolicyLoss:
    """A per-token policy loss and its properties.

    Attributes:
        fn: ``fn(log_probs, old_log_probs, advantages, loss_mask, params: LossParams) -> (token_loss [B, T],
            clipped [B, T] bool)``.
        advantage_weighted: the token loss and its gradient are exactly 0 where the advantage is 0, so rows of
            zero advantage may be skipped without changing the update (when no KL or entropy term is on).
        params: the ``LossParams`` fields (``algorithm.loss`` keys) it reads; setting another one is a config error.
        supervised: trains on reference answers (teacher forcing), advantages unused (``rollout.mode`` sft).
    """

    fn: PolicyLossFn
    advantage_weighted: bool
    params: frozenset[str] = frozenset({"clip_low", "clip_high"})
    supervised: bool = False


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(
        _grouped(lambda r, g, p: grpo_advantages(r, g, normalize_std=True, eps=p.eps)),
        group_baseline=True,
        params=frozenset({"eps"}),
    ),
    "dr_grpo": Estimator(_grouped(lambda r, g, p: grpo_advantages(r, g, normalize_std=False)), group_baseline=True),
    "rloo": Estimator(_grouped(lambda r, g, p: rloo_advantages(r, g)), group_baseline=True),
    "reinforce_plus_plus": Estimator(_reinforce_pp(baseline=False), params=frozenset({"eps", "gamma"})),
    "reinforce_plus_plus_baseline": Estimator(
        _reinforce_pp(baseline=True), group_baseline=True, params=frozenset({"eps", "gamma"})
    ),
    "gae": Estimator(
        _gae, needs=frozenset({"old_log_probs", "values"}), critic=True, params=frozenset({"gamma", "lam"})
    ),
    "opd": Estimator(_opd, needs=frozenset({"old_log_probs", "teacher_log_probs"})),
}

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(
        lambda lp, old, adv, mask, p: ppo_clip(
            lp, old, adv, clip_low=p.clip_low, clip_high=p.clip_high, dual_clip_c=p.dual_clip_c
        ),
        advantage_weighted=True,
        params=frozenset({"clip_low", "clip_high", "dual_clip_c"}),
    ),
    "gspo": PolicyLoss(
        lambda lp, old, adv, mask, p: gspo_loss(lp, old, adv, mask, clip_low=p.clip_low, clip_high=p.clip_high),
        advantage_weighted=True,
    ),
    "cispo": PolicyLoss(
        lambda lp, old, adv, mask, p: cispo_loss(lp, old, adv, clip_low=p.clip_low, clip_high=p.clip_high),
        advantage_weighted=True,
    ),
    "sft": PolicyLoss(
        lambda lp, old, adv, mask, p: sft_loss(lp), advantage_weighted=False, params=frozenset(), supervised=True
    ),
}


def get_estimator(name: str) -> Estimator:
    """The registered estimator called ``name``. Raises: ValueError naming the choices."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss called ``name``. Raises: ValueError naming the choices."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]
