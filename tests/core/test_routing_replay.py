"""Routing replay (R3) hooks on tiny Qwen3-MoE, DeepSeek-V3 and GLM-5 models: recording keeps what each router
returned, replaying its own routing changes nothing (bit for bit, gradients too), replaying a recorded routing
makes the routers choose it after the weights moved, and gradients still reach the routers. The same for
Qwen3.5-MoE and DeepSeek-V4 (hash-routed layer, sqrt(softplus) routers), whose layers are all MoE."""

import numpy as np
import pytest
import torch
from miles.core.routing_replay import (
    RoutingRecorder,
    merge_routing,
    pad_routing,
    replay_routing,
    replayed_weights,
    routing_layout,
)
from moe_models import FAMILIES, HYBRID_FAMILIES, VOCAB, make_moe_model

ALL_FAMILIES = FAMILIES + HYBRID_FAMILIES

TOKENS = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))  # [B=2, L=10]


def _record(model, tokens=TOKENS):
    with torch.no_grad(), RoutingRecorder(routing_layout(model)) as recorder:
        logits = model(input_ids=tokens).logits
    (routed,) = recorder.take()
    return logits, routed


def _perturb_routers(model, scale: float, seed: int = 1) -> None:
    """Move the router weights only: the engine/trainer router mismatch R3 is for (kernels, a weight update)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp.gate." in name:
                param.add_(torch.randn(param.shape, generator=gen) * scale)


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_finds_the_moe_layers_and_recording_marks_dense_rows(family):
    model = make_moe_model(family)
    layout = routing_layout(model)
    assert layout.shape == (3, 2) and sorted(layout.routers) == [1, 2]  # layer 0 is dense in all three
    _, routed = _record(model)
    assert routed.shape == (20, 3, 2) and routed.dtype == torch.int32  # B * L tokens, row-major
    assert (routed[:, 0] == -1).all()  # the dense layer has no routing
    assert ((routed[:, 1:] >= 0) & (routed[:, 1:] < 8)).all()
    assert (routed[:, 1:, 0] != routed[:, 1:, 1]).all()  # two distinct experts per token


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_layout_of_models_whose_every_layer_is_moe(family):
    model = make_moe_model(family)
    layout = routing_layout(model)
    assert layout.shape == (3, 2) and sorted(layout.routers) == [0, 1, 2]
    _, routed = _record(model)
    assert routed.shape == (20, 3, 2) and ((routed >= 0) & (routed < 8)).all()
    assert (routed[..., 0] != routed[..., 1]).all()
    if family == "deepseek_v4":  # layer 0 routes by token id: the table's experts, whatever the hidden state
        table = layout.routers[0].tid2eid
        assert torch.equal(routed[:, 0], table[TOKENS.reshape(-1)].to(torch.int32))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_recorded_indices_are_what_the_router_returned(family):
    model = make_moe_model(family)
    router = routing_layout(model).routers[1]
    hidden = torch.randn(7, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), RoutingRecorder(routing_layout(model)) as recorder:
        _, weights, indices = router(hidden)
    (routed,) = [call for call in recorder._calls[1]]
    assert torch.equal(routed, indices.to(torch.int32))
    # and its weights are what replayed_weights computes from the logits for those experts
    with torch.no_grad():
        logits = router(hidden)[0]
    assert torch.equal(replayed_weights(router, logits, indices).to(weights.dtype), weights)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_replaying_a_models_own_routing_changes_nothing_bit_for_bit(family):
    model = make_moe_model(family)
    logits, routed = _record(model)
    with torch.no_grad(), replay_routing(model, routed):
        replayed = model(input_ids=TOKENS).logits
    assert torch.equal(replayed, logits)
    # gradients too: the replayed gating weights are the router's own, from the same live logits
    grads = []
    for routing in (None, routed):
        model.zero_grad()
        with replay_routing(model, routing):
            model(input_ids=TOKENS).logits.logsumexp(-1).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_after_a_weight_change_replay_routes_to_the_recorded_experts_and_tracks_the_old_logits(family):
    tokens = torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    model = make_moe_model(family)
    old_logits, routed = _record(model, tokens)
    _perturb_routers(model, 0.03)
    live_logits, live = _record(model, tokens)
    assert (live[:, 1:] != routed[:, 1:]).any(-1).sum() >= 10  # some tokens flip: the case replay exists for
    layout = routing_layout(model)
    with torch.no_grad(), replay_routing(model, routed), RoutingRecorder(layout) as recorder:
        replayed_logits = model(input_ids=tokens).logits  # the recorder hooks after replay: it sees the result
    (chosen,) = recorder.take()
    assert torch.equal(chosen, routed)

    def drift(logits):  # mean |log-prob change| over every position and token
        return (logits.log_softmax(-1) - old_logits.log_softmax(-1)).abs().mean()

    # the rollout's experts: closer to its numbers (measured: 0.92x the drift for Qwen3's softmax gate, whose
    # weights move with the logits; ~0.2x for the sigmoid gates of DeepSeek-V3 and GLM-5)
    assert drift(replayed_logits) < drift(live_logits)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_replay_sends_gradients_to_the_router_through_the_live_logits(family):
    model = make_moe_model(family)
    _, routed = _record(model)
    _perturb_routers(model, 0.05)
    with replay_routing(model, routed):
        model(input_ids=TOKENS).logits.logsumexp(-1).sum().backward()
    router = routing_layout(model).routers[2]
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_unrecorded_rows_are_routed_by_the_live_router():
    model = make_moe_model("qwen3_moe")
    logits, routed = _record(model)
    other = make_moe_model("qwen3_moe", seed=1)
    _, foreign = _record(other)
    foreign[:10] = -1  # the first sequence unrecorded: routed live, exactly as without replay
    with torch.no_grad(), replay_routing(model, foreign):
        mixed = model(input_ids=TOKENS).logits
    # row 0 as without replay (up to the float order of the experts' token sums), row 1 routed elsewhere
    torch.testing.assert_close(mixed[0], logits[0], atol=1e-6, rtol=0)
    assert (mixed[1] - logits[1]).abs().max() > 1e-2


def test_replay_refuses_routing_of_the_wrong_size_or_a_dense_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = make_moe_model("qwen3_moe")
    _, routed = _record(model)
    with torch.no_grad(), replay_routing(model, routed[:-1]):
        with pytest.raises(ValueError, match="sees 20 tokens but the routed experts cover 19"):
            model(input_ids=TOKENS)
    with pytest.raises(ValueError, match=r"with \(num_layers, top_k\) = \(3, 2\) from the model's config"):
        with replay_routing(model, routed[:, :2]):
            pass
    dense = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert routing_layout(dense) is None
    with pytest.raises(ValueError, match="has no MoE router"):
        with replay_routing(dense, routed):
            pass


def test_an_unknown_router_class_is_refused_by_name():
    class FancyRouter(torch.nn.Module):
        pass

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp = torch.nn.Module()
    model.layers[0].mlp.gate = FancyRouter()
    with pytest.raises(ValueError, match="layers.0.mlp.gate is a FancyRouter, a router Miles does not know"):
        routing_layout(model)


def test_merge_keeps_what_an_earlier_turn_recorded_and_pads_unrouted_tokens():
    # one layer, top-1: turn 1 recorded tokens 0-2 (the last, never fed back, is -1)
    earlier = np.array([[[4]], [[5]], [[-1]]], dtype=np.int32)
    # turn 2's prefill routed tokens 0-2 again (differently: the weights moved) and decoded tokens 3-4
    later = np.array([[[0]], [[1]], [[2]], [[3]], [[-1]]], dtype=np.int32)
    merged = merge_routing(earlier, later)
    assert merged[:, 0, 0].tolist() == [4, 5, 2, 3, -1]
    assert merge_routing(None, later).tolist() == later.tolist()
    assert merge_routing(earlier, None).tolist() == earlier.tolist()
    assert merge_routing(None, None) is None
    assert pad_routing(earlier, 5)[:, 0, 0].tolist() == [4, 5, -1, -1, -1]
    with pytest.raises(ValueError, match="must cover at least the earlier tokens"):
        merge_routing(later, earlier)


def test_expert_ids_outside_the_models_range_are_refused_on_entering():
    model = make_moe_model("qwen3_moe")
    _, routed = _record(model)
    routed[3, 1, 0] = 8  # 8 experts: ids 0-7
    with pytest.raises(ValueError, match=r"span \[-1, 8\], but the model's routers have 8 experts"):
        with replay_routing(model, routed):
            pass
