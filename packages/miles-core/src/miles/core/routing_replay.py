"""Rollout routing replay (R3): record the MoE experts an engine routed each token to, and make the trainer use them.

An MoE layer's router picks top-k experts per token from its logits. Engine and trainer compute those logits with
slightly different kernels (and after a weight update, with different weights), so near-ties pick different experts
and the trainer's log-probs drift from the engine's far more than in a dense model. R3 (Ma et al., "Stabilizing MoE
Reinforcement Learning by Aligning Training and Inference Routers", arXiv 2510.11370) records the engine's choice
and replays it in the trainer's forward: the experts are the recorded ones, while the gating weights are gathered
from the trainer's live router logits, so the router still gets gradients.

Both sides hook the router module of each MoE layer (``model.layers.<i>.mlp.gate`` in transformers, which returns
``(router_logits, top_k_weights, top_k_indices)``): recording keeps the indices the router returned (for
DeepSeek-V3 / GLM families, the group-limited choice with the score-correction bias, not a top-k of the logits;
for DeepSeek-V4's hash-routed layers, the token-id table's experts);
replaying swaps them for the recorded ones and recomputes the weights the way that router family does. Routing is
``[tokens, num_layers, top_k]`` int32 with every decoder layer (SGLang's layout): rows of dense layers, and
positions nothing recorded (a sequence's last token, environment tokens), are -1, where the live router decides.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

NOT_RECORDED = -1  # an expert id meaning "no recorded routing here": the live router decides

# Router classes whose forward Miles mirrors, and how each turns logits into the weights of chosen experts:
# "softmax": softmax over all experts, gather, renormalize when ``norm_topk_prob`` (or always);
# "sigmoid": sigmoid scores, gather, renormalize (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``;
# "score_fn": the router's own ``score_fn`` (DeepSeek-V4: sqrt(softplus)), then as "sigmoid".
_ROUTER_FAMILIES: dict[str, tuple[str, bool | None]] = {
    # class name: (family, renormalize: True always, None = read module.norm_topk_prob)
    "Qwen2MoeTopKRouter": ("softmax", None),
    "Qwen3MoeTopKRouter": ("softmax", None),
    "Qwen3_5MoeTopKRouter": ("softmax", True),
    "OlmoeTopKRouter": ("softmax", None),
    "MixtralTopKRouter": ("softmax", True),
    "DeepseekV3TopkRouter": ("sigmoid", None),
    "Glm4MoeTopkRouter": ("sigmoid", None),
    "GlmMoeDsaTopkRouter": ("sigmoid", None),
    "DeepseekV4TopKRouter": ("score_fn", True),
    "DeepseekV4HashRouter": ("score_fn", True),  # experts from a fixed token-id table: replay re-picks the same
}
_GATE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


@dataclass(frozen=True)
class RoutingLayout:
    """Where a model's MoE routers are: ``routers`` maps decoder-layer index -> router module."""

    num_layers: int
    top_k: int
    routers: dict[int, torch.nn.Module]

    @property
    def shape(self) -> tuple[int, int]:
        """(num_layers, top_k): the trailing shape of a routing array."""
        return self.num_layers, self.top_k


def routing_layout(model: torch.nn.Module) -> RoutingLayout | None:
    """The MoE routers of an HF causal LM, or None for a dense model (no ``layers.<i>.mlp.gate`` router).

    Raises: ValueError when a layer's router is a class Miles cannot replay (its weights would be recomputed
        wrongly), naming the class and the ones it knows.
    """
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    routers: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        match = _GATE_NAME.search(name)
        if match is None or isinstance(module, torch.nn.Linear):  # a dense gate_proj-style Linear is no router
            continue
        cls = type(module).__name__
        if cls not in _ROUTER_FAMILIES:
            raise ValueError(
                f"routing replay: {name} is a {cls}, a router Miles does not know how to replay (known: "
                f"{', '.join(sorted(_ROUTER_FAMILIES))}); run this model without engine.routed_experts"
            )
        routers[int(match.group(1))] = module
    if not routers:
        return None
    return RoutingLayout(config.num_hidden_layers, int(config.num_experts_per_tok), routers)


def replayed_weights(router: torch.nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Gating weights of the experts ``indices`` from the live ``logits``, as ``router``'s own forward computes them
    for the experts it chooses (so replaying a router's own choice gives its own weights, bit for bit).

    Args:
        router: a router module of a class in ``_ROUTER_FAMILIES``.
        logits: [T, num_experts] router logits (carry grad).
        indices: [T, top_k] int64 expert ids.
    Returns: [T, top_k] float32 weights (cast to the router's output dtype by the caller).
    """
    family, renormalize = _ROUTER_FAMILIES[type(router).__name__]
    if renormalize is None:
        renormalize = bool(getattr(router, "norm_topk_prob", False))
    if family == "softmax":
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, indices)
        return weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights
    scores = router.score_fn(logits.float()) if family == "score_fn" else logits.float().sigmoid()
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


class RoutingRecorder:
    """Records what every router returns while active (``with recorder:``): one routing per forward call.

    ``take()`` returns the calls since the last ``take``, each [tokens of the call, num_layers, top_k] int32 (tokens
    in the order the router saw them: row-major over [batch, seq]); dense layers' rows are -1.
    """

    def __init__(self, layout: RoutingLayout) -> None:
        self.layout = layout
        self._calls: dict[int, list[Tensor]] = {layer: [] for layer in layout.routers}
        self._handles: list = []

    def __enter__(self) -> RoutingRecorder:
        for layer, router in self.layout.routers.items():
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def record(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            self._calls[layer].append(output[2].detach())  # to the host in take(): no sync per layer and step

        return record

    def take(self) -> list[Tensor]:
        """The routing of each forward call since the last ``take``, oldest first (see the class docstring).

        Raises: RuntimeError if the routers were not called equally often (a forward stopped half-way).
        """
        counts = {len(calls) for calls in self._calls.values()}
        if len(counts) != 1:
            raise RuntimeError(f"routing recorder: routers were called unequally often ({sorted(counts)})")
        taken = []
        for i in range(counts.pop()):
            first = next(iter(self._calls.values()))[i]
            routed = torch.full((first.shape[0], *self.layout.shape), NOT_RECORDED, dtype=torch.int32)
            for layer, calls in self._calls.items():
                routed[:, layer] = calls[i].to(device="cpu", dtype=torch.int32)
            taken.append(routed)
        for calls in self._calls.values():
            calls.clear()
        return taken


@contextmanager
def replay_routing(model: torch.nn.Module, routed: Tensor | None) -> Iterator[None]:
    """Within the block, every forward of ``model`` routes its tokens to the experts ``routed`` gives.

    Each router's output indices are replaced by the recorded ones (where a token's row is not -1) and its weights
    are ``replayed_weights`` of its live logits, so gradients reach the router through the gathered logits.

    Args:
        model: an HF causal LM (or an FSDP2-sharded one; the hooks sit on the router modules).
        routed: [T, num_layers, top_k] int expert ids, T = the tokens of each forward in the order its routers see
            them (row-major [batch, seq]: a padded batch flattened, or the packed row); None replays nothing.
    Raises: ValueError on entering when the model has no MoE router or ``routed`` has another [layers, top_k] or
        an expert id outside [-1, num_experts); at the forward when its token count is not T.
    """
    if routed is None:
        yield
        return
    layout = routing_layout(model)
    if layout is None:
        raise ValueError("routing replay: the batch carries routed experts but the model has no MoE router")
    if routed.dim() != 3 or tuple(routed.shape[1:]) != layout.shape:
        raise ValueError(
            f"routing replay: routed experts have shape {tuple(routed.shape)}, expected [tokens, num_layers, top_k] "
            f"with (num_layers, top_k) = {layout.shape} from the model's config"
        )

    num_experts = {int(getattr(router, "num_experts", 0)) for router in layout.routers.values()}
    low, high = int(routed.min()), int(routed.max())  # one host sync per replayed forward
    if low < NOT_RECORDED or (num_experts and high >= min(num_experts)):
        raise ValueError(
            f"routing replay: routed expert ids span [{low}, {high}], but the model's routers have "
            f"{min(num_experts)} experts (and -1 means unrecorded); was the routing recorded with this model?"
        )

    def hook_for(layer: int):
        def replay(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
            logits, weights, indices = output
            recorded = routed[:, layer].to(device=indices.device, dtype=indices.dtype)  # [T, top_k]
            if recorded.shape[0] != indices.shape[0]:
                raise ValueError(
                    f"routing replay: layer {layer}'s router sees {indices.shape[0]} tokens but the routed experts "
                    f"cover {recorded.shape[0]}; routing must be [tokens of the forward, layers, top_k]"
                )
            known = (recorded >= 0).all(dim=-1, keepdim=True)  # [T, 1]
            chosen = torch.where(known, recorded, indices)
            return logits, replayed_weights(module, logits, chosen).to(weights.dtype), chosen

        return replay

    handles = [router.register_forward_hook(hook_for(layer)) for layer, router in layout.routers.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def merge_routing(earlier: np.ndarray | Tensor | None, later: np.ndarray | Tensor | None) -> np.ndarray | None:
    """One sequence's routing from two records: ``later`` (e.g. the next turn's request, whose prefill routed every
    earlier token again) with each position ``earlier`` recorded kept from ``earlier``.

    A later turn's prefill must not overwrite routing recorded when the tokens were decoded: the replayed forward
    should see the experts that produced the log-probs the sample carries.

    Args:
        earlier: [n, num_layers, top_k] int, -1 where nothing was recorded; None for no record.
        later: [m, num_layers, top_k] int, m >= n; None for no record.
    Returns: [max(n, m), num_layers, top_k] int32 (``earlier`` padded with -1 when ``later`` is None), or None when
        both are None.
    Raises: ValueError when the trailing shapes differ or ``later`` is shorter than ``earlier``.
    """
    if later is None:
        return None if earlier is None else np.asarray(earlier, dtype=np.int32).copy()
    merged = np.asarray(later, dtype=np.int32).copy()
    if earlier is None:
        return merged
    earlier = np.asarray(earlier, dtype=np.int32)
    if earlier.shape[1:] != merged.shape[1:] or earlier.shape[0] > merged.shape[0]:
        raise ValueError(
            f"routing records do not line up: earlier {earlier.shape}, later {merged.shape} (the later one must cover "
            "at least the earlier tokens, with the same [num_layers, top_k])"
        )
    recorded = (earlier >= 0).all(axis=-1, keepdims=True)  # [n, L, 1]: per token and layer
    merged[: earlier.shape[0]] = np.where(recorded, earlier, merged[: earlier.shape[0]])
    return merged


def pad_routing(routed: np.ndarray | Tensor, num_tokens: int) -> np.ndarray:
    """``routed`` ([n, layers, top_k], n <= num_tokens) extended with -1 rows to ``num_tokens`` rows (int32)."""
    routed = np.asarray(routed, dtype=np.int32)
    if routed.shape[0] >= num_tokens:
        return routed
    pad = np.full((num_tokens - routed.shape[0], *routed.shape[1:]), NOT_RECORDED, dtype=np.int32)
    return np.concatenate([routed, pad])


def token_routing(batch, *, packed: bool) -> Tensor:
    """A ``TrainBatch``'s ``routed_experts`` ([B, L, layers, top_k]) in the token order its forward's routers see:
    [B * L, layers, top_k] for the padded [B, L] forward, [N, layers, top_k] (the real tokens, row by row) for the
    packed one (``pack_sequences``).

    Raises: ValueError when the batch carries no routed experts.
    """
    routed = batch.routed_experts
    if routed is None:
        raise ValueError("token_routing: the batch carries no routed experts (TrainBatch.routed_experts is None)")
    if packed:
        return routed[batch.attention_mask.bool()]
    return routed.reshape(-1, *routed.shape[2:])
