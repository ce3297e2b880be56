"""Reward functions: reasoning-gym scorers and math answer checking."""

from miles.rollout.rewards.math import gold_answer, math_reward
from miles.rollout.rewards.reasoning_gym import extract_answer, reasoning_gym_reward

__all__ = ["extract_answer", "gold_answer", "math_reward", "reasoning_gym_reward"]
