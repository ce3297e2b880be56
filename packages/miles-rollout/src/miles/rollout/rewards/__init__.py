"""Reward functions: reasoning-gym scorers, math answer checking (boxed answers included), sandboxed code
execution, SQuAD exact match / token F1, and a remote reward model over HTTP."""

from miles.rollout.rewards.code import CODE_OUTCOMES, code_reward, extract_code
from miles.rollout.rewards.math import gold_answer, last_boxed, math_reward
from miles.rollout.rewards.qa import exact_match_reward, f1_reward, normalize_answer, token_f1
from miles.rollout.rewards.reasoning_gym import extract_answer, reasoning_gym_reward
from miles.rollout.rewards.remote import remote_reward

__all__ = [
    "CODE_OUTCOMES",
    "code_reward",
    "exact_match_reward",
    "extract_answer",
    "extract_code",
    "f1_reward",
    "gold_answer",
    "last_boxed",
    "math_reward",
    "normalize_answer",
    "reasoning_gym_reward",
    "remote_reward",
    "token_f1",
]
