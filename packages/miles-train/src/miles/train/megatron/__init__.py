"""Megatron-core training backend (``train.backend megatron``; needs the ``miles-train[megatron]`` extra)."""

from miles.train.megatron.backend import CausalLMView, MegatronBackend, init_parallel_state

__all__ = ["CausalLMView", "MegatronBackend", "init_parallel_state"]
