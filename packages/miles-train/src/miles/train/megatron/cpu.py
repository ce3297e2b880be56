"""Megatron-core on a machine without CUDA: the few places megatron-core 0.16 hard-codes CUDA, redirected to the CPU.

Used only when ``torch.cuda.is_available()`` is false (``apply_if_no_gpu``); with a GPU, Megatron runs unchanged.
What it changes, and why (each was found by running ``GPTModel`` forward/backward over gloo at TP=1 and TP=2):

1. ``tensor_parallel.random.CudaRNGStatesTracker`` -> ``CPURNGStatesTracker``: the tracker saves and restores
   ``torch.cuda`` RNG states ("Torch not compiled with CUDA"); this one keeps named CPU generator states and
   ``fork()`` swaps the CPU default generator, which is what dropout and init of CPU tensors draw from.
2. ``torch.cuda.current_device`` -> ``torch.device("cpu")``: Megatron allocates buffers with
   ``device=torch.cuda.current_device()`` (the global memory buffer of attention, the DDP gradient buffers, the
   sequence-parallel all-gather buffers); on a CPU-only torch that call always raises, so nothing that works is
   changed by the redirect.
3. ``megatron.core.utils.GlobalMemoryBuffer.get_tensor`` allocates on the CPU (it names the CUDA device itself).

Two more fill gaps of megatron-core without Transformer Engine or Apex (which have no CPU build), for MoE layers:

4. ``moe.moe_utils.te_general_gemm = None`` where the name is missing: the router's gating reads it unconditionally
   and it is only bound when Transformer Engine imports (a NameError otherwise).
5. Torch norms under sequence parallelism (which Megatron requires for MoE layers at tensor parallelism > 1):
   ``WrappedTorchNorm`` refuses ``sequence_parallel``; it is built without it and its parameters are tagged
   ``sequence_parallel`` instead, so ``finalize_model_grads`` sums their partial gradients over the tensor-parallel
   ranks, as it does for Apex / Transformer Engine norms.

One more fills a gap of Megatron's local (no Transformer Engine) layer spec for multi-head latent attention
(DeepSeek-V3), applied to the spec of an MLA model by ``local_mla_spec`` rather than patched into Megatron:

6. ``MLACoreAttention``: ``MLASelfAttention`` builds its core attention with ``k_channels`` / ``v_channels`` (query
   and key heads of nope + rope width, value heads of ``v_head_dim``), which only Transformer Engine's attention
   accepts; this ``DotProductAttention`` takes them and sizes its output by the value heads. The arithmetic is
   Megatron's ``DotProductAttention.forward`` unchanged. At tensor parallelism > 1 the q / kv down-projections
   are Megatron's plain ``Linear`` (every rank the whole weight, over its own sequence chunk: sequence parallelism
   is on), as Transformer Engine's spec duplicates them: with the local spec's ``ColumnParallelLinear`` instead,
   MLA gathers their output without summing the rotary key's gradient over the ranks' heads (measured ~1% off at
   TP=2). Their weights are tagged ``sequence_parallel`` (``tag_mla_down_projections``), so
   ``finalize_model_grads`` sums the ranks' partial gradients.
7. ``multi_latent_attention.HAVE_TE = False`` where Transformer Engine is not installed: megatron-core's TE extension
   module imports without it (its TE classes become mock objects), so MLA's import check passes and its
   ``isinstance(linear_proj, TELinear)`` then raises a TypeError.

Two more for Megatron's pipeline schedule (``forward_backward_pipelining_without_interleaving``), which the backend
runs with pipeline parallelism:

9. ``torch.cuda.synchronize`` -> a no-op: the schedule's point-to-point layer synchronizes the device after
   exchanging tensor shapes (always) and after batched sends (``batch_p2p_sync``); on a CPU-only torch the call
   always raises, and there is no device stream to wait for (gloo's requests were waited on just before).
10. The schedule module's ``torch.zeros(..., device="cuda")`` (its token counter, allocated on every call) makes a
   CPU tensor: ``pipeline_parallel.schedules.torch`` is a view of ``torch`` whose ``zeros`` maps that device to
   the CPU; every other name is torch's own.

One more applies while a pipeline stage's ``GPTModel`` is built (``pipeline_embedding_sync_skipped``):

8. With tied embeddings and pipeline parallelism, ``LanguageModule.setup_embeddings_and_output_layer`` copies the
   first stage's embedding into the last stage's output weight by an all-reduce of ``weight.data.cuda()``, which
   raises on a CPU-only torch. The copy is skipped (``_is_in_embd_group`` answers False during the build): the
   backend loads the HF embedding into both stages right after, which is the same copy. Megatron's gradient sum
   over the embedding group (``finalize_model_grads``) is untouched.

Nothing else is touched: the model, its parallel layers, collectives (gloo), DDP and ``finalize_model_grads`` are
Megatron's own code.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Iterator
from functools import reduce

import torch

_applied = False


class CPURNGStatesTracker:
    """Megatron's ``CudaRNGStatesTracker`` interface over named CPU generator states.

    ``add(name, seed)`` stores the state of a CPU generator seeded with ``seed``; ``fork(name)`` runs its block
    with the CPU default generator in that state and stores where it ended, restoring the default state after.
    Raises: Exception (Megatron's own messages) for a duplicate name or seed, or an unknown name.
    """

    def __init__(self, *args, **kwargs) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def _cpu_buffer_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
    """``GlobalMemoryBuffer.get_tensor`` allocating on the CPU: a reused flat buffer per (name, dtype)."""
    required = reduce(operator.mul, tensor_shape, 1)
    buffer = self.buffer.get((name, dtype))
    if buffer is None or buffer.numel() < required:
        buffer = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, device="cpu")
    return buffer[0:required].view(*tensor_shape)


def _sequence_parallel_norm(build):
    """``WrappedTorchNorm.__new__`` that accepts ``config.sequence_parallel`` (see 5. above)."""

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, eps, **kwargs)
        norm = build(cls, _without_sp(config), hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return new


def _without_sp(config):
    """A shallow copy of a ``TransformerConfig`` with ``sequence_parallel`` off."""
    plain = copy.copy(config)
    object.__setattr__(plain, "sequence_parallel", False)
    return plain


class _TorchWithCpuZeros:
    """``torch`` for Megatron's schedule module: ``zeros(..., device="cuda")`` allocates on the CPU (10. above)."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if str(device).startswith("cuda") else device, **kwargs)


def apply_if_no_gpu() -> bool:
    """Apply the CPU redirects above once per process if there is no CUDA device; returns whether they are active.

    Call before building any Megatron model or parallel state.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core import utils as megatron_utils
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.CudaRNGStatesTracker = CPURNGStatesTracker
    megatron_random._CUDA_RNG_STATE_TRACKER = None
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    megatron_utils.GlobalMemoryBuffer.get_tensor = _cpu_buffer_tensor
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import torch_norm

    schedules.torch = _TorchWithCpuZeros()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(_sequence_parallel_norm(torch_norm.WrappedTorchNorm.__new__))
    _applied = True
    return True


def _core_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLACoreAttention(DotProductAttention):
        """Megatron's local ``DotProductAttention`` for MLA (see 6. above): ``k_channels`` / ``v_channels`` accepted,
        the output [s, b, heads_per_partition * v_channels]."""

        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            if v_channels is not None:
                world = self.tp_group.size()
                self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, world)

    return MLACoreAttention


def local_mla_spec(block_spec, *, tensor_parallel: int = 1):
    """``block_spec`` (Megatron's ``TransformerBlockSubmodules`` from the local spec) with every MLA layer's core
    attention replaced by ``MLACoreAttention`` and, at ``tensor_parallel`` > 1, its down-projections by ``Linear``
    (6. above; and 7.); other layers unchanged. Returns the same object."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False  # 7. above
    from megatron.core.post_training.modelopt.layers import Linear

    core = _core_attention_class()
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        if attention.module is MLASelfAttention:
            attention.submodules.core_attention = core
            if tensor_parallel > 1:
                attention.submodules.linear_q_down_proj = Linear
                attention.submodules.linear_kv_down_proj = Linear
    return block_spec


MLA_DOWN_PROJECTIONS = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def tag_mla_down_projections(model) -> None:
    """Tag the whole-weight MLA down-projections of a sequence-parallel model ``sequence_parallel`` (6. above):
    each rank's gradient covers its own tokens, and ``finalize_model_grads`` sums them."""
    if not model.config.sequence_parallel:
        return
    for name, param in model.named_parameters():
        if name.endswith(MLA_DOWN_PROJECTIONS) and not getattr(param, "tensor_model_parallel", False):
            param.sequence_parallel = True


@contextlib.contextmanager
def pipeline_embedding_sync_skipped() -> Iterator[None]:
    """While a ``GPTModel`` is built without a GPU: skip its initial embedding copy to the last pipeline stage
    (item 8 above; the caller loads both stages' weights). Nothing changes with a GPU or outside the block."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule._is_in_embd_group
    LanguageModule._is_in_embd_group = lambda self: False
    try:
        yield
    finally:
        LanguageModule._is_in_embd_group = original
