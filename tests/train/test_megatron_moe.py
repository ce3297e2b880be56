"""Megatron-core backend on tiny MoE models (CPU, gloo) of two families: Qwen3-MoE (softmax router) and DeepSeek-V3
(multi-head latent attention, sigmoid group-limited router with score-correction bias and scaling, shared experts):
the conversion, and routing replay (R3) with the same semantics as the FSDP2 trainer's. Rollouts of the embedded
engine carry their routing into the batch; with replay Megatron's log-probs equal the engine's, and with perturbed
routers Megatron and FSDP2 replay to the same log-probs and gradients."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.batch import build_train_batch
from miles.core.config import AlgorithmConfig
from miles.train import FSDP2Backend, TrainConfig
from moe_models import VOCAB, engine_rollout, save_moe_model

pytest.importorskip("megatron.core")

from miles.train.megatron import CausalLMView, MegatronBackend  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="train.backend megatron trains on the CPU only")

OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def moe_dir(request, tmp_path_factory):
    """The tiny model of the family, its norms moved off 1 (so a mis-mapped norm shows in the logits)."""
    from transformers import AutoModelForCausalLM

    path = save_moe_model(request.param, tmp_path_factory.mktemp(f"tiny_{request.param}"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def perturbed_dir(moe_dir, tmp_path_factory):
    """The same model with its routers moved by N(0, 0.03): enough to change some tokens' experts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * 0.03)
    path = tmp_path_factory.mktemp(f"{moe_dir.name}_perturbed")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rollout(moe_dir):
    """8 samples (4 prompts x 2) of the embedded engine with their routing."""
    samples = engine_rollout(moe_dir)
    return build_train_batch(samples, torch.tensor([1.0, -1.0] * 4), pad_token_id=0)


def _megatron(path, layout="packed", **train) -> MegatronBackend:
    train = TrainConfig(backend="megatron", batch_layout=layout, **{"micro_batch_size": 4, **train})
    return MegatronBackend(path, train=train, temperature=1.0)


def _gap(batch, log_probs) -> float:
    mask = batch.loss_mask.bool()
    return float((log_probs - batch.rollout_log_probs)[mask].abs().mean())


def test_megatron_moe_logits_equal_the_hf_model_and_experts_convert_back_exactly(moe_dir):
    from transformers import AutoModelForCausalLM

    backend = _megatron(moe_dir)
    assert sorted(n for n, _ in backend.gpt.named_parameters() if n.endswith("router.weight")) == [
        "decoder.layers.1.mlp.router.weight",
        "decoder.layers.2.mlp.router.weight",
    ]  # layer 0 is dense (mlp_only_layers)
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        got = CausalLMView(backend.gpt, VOCAB)(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    if hf.config.model_type == "deepseek_v3":  # the router's score-correction bias is a Megatron buffer
        bias = backend.gpt.decoder.layers[1].mlp.router.expert_bias
        assert torch.equal(bias, hf.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"])
        assert bias.abs().sum() > 0
    exported, state = dict(backend.export_weights()), hf.state_dict()
    assert exported.keys() == state.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[name]), name


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_with_replay_megatron_log_probs_equal_the_engines(moe_dir, rollout, layout):
    assert rollout.routed_experts is not None and rollout.routed_experts.shape[2:] == (3, 2)
    replayed = _megatron(moe_dir, layout).forward(rollout, outputs={"old_log_probs"}).old_log_probs
    mask = rollout.loss_mask.bool()
    torch.testing.assert_close(replayed[mask], rollout.rollout_log_probs[mask], atol=1e-5, rtol=0)


def test_with_perturbed_routers_megatron_replays_as_fsdp2_does_and_closes_the_gap(perturbed_dir, rollout):
    """The trainer's routers differ from the engine's: replay gives Megatron and FSDP2 the same log-probs and the
    same gradients (the routers' included: gating weights come from the live logits), and a smaller gap to the
    engine than routing live."""
    megatron = _megatron(perturbed_dir, lr=1e-2)
    fsdp2 = FSDP2Backend(
        perturbed_dir, train=TrainConfig(micro_batch_size=4, batch_layout="packed", lr=1e-2), temperature=1.0
    )
    live = rollout.replace(routed_experts=None)
    mask = rollout.loss_mask.bool()
    m_replay = megatron.forward(rollout, outputs={"old_log_probs"}).old_log_probs
    f_replay = fsdp2.forward(rollout, outputs={"old_log_probs"}).old_log_probs
    torch.testing.assert_close(m_replay[mask], f_replay[mask], atol=1e-5, rtol=0)
    m_live = megatron.forward(live, outputs={"old_log_probs"}).old_log_probs
    assert _gap(live, m_live) > 1e-3  # the routers' change shows in the log-probs
    assert (m_replay - m_live)[mask].abs().max() > 1e-3  # replay changed some tokens' experts
    # smaller, not much smaller: Qwen3-MoE's gating weights are a softmax of the (perturbed) logits either way
    assert _gap(rollout, m_replay) < _gap(live, m_live)
    batch = rollout.replace(old_log_probs=rollout.rollout_log_probs)
    for backend in (megatron, fsdp2):
        backend.metrics = backend.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    for key, value in fsdp2.metrics.items():
        assert megatron.metrics[key] == pytest.approx(value, abs=1e-5), key
    f_grads, m_grads = fsdp2.full_gradients(), megatron.full_gradients()
    assert any(name.endswith("mlp.gate.weight") and grad.abs().sum() > 0 for name, grad in m_grads.items())
    for name, grad in f_grads.items():
        # fp32 noise: on an AVX-512 CPU one embedding element of 1024 differs by 1.3e-6 (largest gradient 0.78)
        torch.testing.assert_close(m_grads[name], grad, atol=5e-6, rtol=1e-4, msg=name)


def test_routing_that_does_not_fit_the_model_is_refused_naming_the_shape(moe_dir, rollout):
    backend = _megatron(moe_dir)
    bad = rollout.replace(routed_experts=rollout.routed_experts.clamp(min=0) + 8)
    with pytest.raises(ValueError, match=r"routed expert ids span \[8, .*8 experts"):
        backend.forward(bad, outputs={"old_log_probs"})


@pytest.mark.integration
@pytest.mark.parametrize("parallel", ["2", "1x2"], ids=["tensor_parallel_2", "expert_parallel_2"])
def test_two_ranks_replaying_the_engines_routing_equal_one_rank(moe_dir, rollout, tmp_path, parallel):
    """TP=2 (sequence parallelism on, each expert's weights split over both ranks, the packed row padded to an even
    length) or EP=2 (two data-parallel replicas of 4 rows each, 4 of the 8 experts on each rank, tokens all-gathered
    to them) on the MoE model, replaying the engine's routing: log-probs, metrics, gradients, a step and the
    checkpoint's optimizer files equal / match one rank's. DeepSeek-V3 at TP=2 is the regression test of MLA's
    down-projections (``miles.train.megatron.cpu``, 6.): with the local spec's column-parallel ones the rotary key's
    gradient was each rank's heads' part only (kv_a_proj_with_mqa's gradient 4.8e-4 off of 0.05, measured)."""
    expected = {"2": {"tp0_ep0.pt", "tp1_ep0.pt"}, "1x2": {"tp0_ep0.pt", "tp0_ep1.pt"}}[parallel]
    _two_ranks_equal_one_rank(moe_dir, rollout, tmp_path, parallel, expected)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def four_layer_moe_dir(request, tmp_path_factory):
    """The tiny model of the family with 4 decoder layers (layer 0 dense), so 2 pipeline stages hold 2 each."""
    return save_moe_model(request.param, tmp_path_factory.mktemp(f"four_{request.param}"), num_hidden_layers=4)


@pytest.mark.integration
def test_two_pipeline_stages_replaying_the_engines_routing_equal_one_rank(four_layer_moe_dir, tmp_path):
    """PP=2 on the MoE model (stage 0: the dense layer 0 and MoE layer 1, stage 1: MoE layers 2-3), each stage's
    routers replaying the engine's routing of their own (global) layers, a reference through the same stages:
    log-probs, metrics, gradients, a step and a checkpoint per stage equal / match one rank's."""
    rollout = build_train_batch(engine_rollout(four_layer_moe_dir), torch.tensor([1.0, -1.0] * 4), pad_token_id=0)
    assert rollout.routed_experts.shape[-2] == 4
    _two_ranks_equal_one_rank(four_layer_moe_dir, rollout, tmp_path, "1p2", {"tp0_pp0_ep0.pt", "tp0_pp1_ep0.pt"})


@pytest.mark.integration
@pytest.mark.slow
def test_pipeline_stages_with_their_experts_split_over_two_replicas_equal_one_rank(four_layer_moe_dir, tmp_path):
    """PP=2 x EP=2 on 4 ranks (Megatron's rank order tp-cp-ep-dp-pp: stage 0 on ranks 0-1, stage 1 on ranks 2-3;
    replica 0 = ranks 0 and 2, replica 1 = ranks 1 and 3, each with half the rows; each stage's MoE layers hold 4
    of the 8 experts per rank), replaying the engine's routing: log-probs, metrics, gradients, a step, the push of
    every stage's every expert and a checkpoint per stage and expert rank equal / match one rank's."""
    rollout = build_train_batch(engine_rollout(four_layer_moe_dir), torch.tensor([1.0, -1.0] * 4), pad_token_id=0)
    expected = {f"tp0_pp{stage}_ep{ep}.pt" for stage in range(2) for ep in range(2)}
    _two_ranks_equal_one_rank(four_layer_moe_dir, rollout, tmp_path, "1x2p2", expected, world=4)


def _two_ranks_equal_one_rank(moe_dir, rollout, tmp_path, parallel: str, expected: set[str], *, world: int = 2) -> None:
    """Run ``megatron_worker.py`` on ``world`` ranks with ``parallel`` and check it against one rank (see the
    callers)."""
    batch_file = tmp_path / "batch.pt"
    batch = rollout.replace(old_log_probs=rollout.rollout_log_probs)
    torch.save({f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}, batch_file)
    worker = Path(__file__).parent / "megatron_worker.py"
    out = tmp_path / "rank0.pt"
    args = [str(tmp_path / "init"), str(moe_dir), str(out), parallel, "packed", str(batch_file)]
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(r), str(world), *args], cwd=worker.parent)
        for r in range(world)
    ]
    assert [p.wait(timeout=600) for p in procs] == [0] * world
    result = torch.load(out, weights_only=True)
    single = _megatron(moe_dir, micro_batch_size=2, lr=1e-2, adam_eps=1e-4)  # the worker's settings
    mask = batch.loss_mask.bool()
    lp = single.forward(batch, outputs={"old_log_probs"}).old_log_probs
    torch.testing.assert_close(result["log_probs"][mask], lp[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[mask], batch.rollout_log_probs[mask], atol=1e-5, rtol=0)  # replayed
    metrics = single.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    for key in ("loss", "loss/pg"):  # the worker's two accumulations add up to the one-rank single call's
        assert result["metrics"][key] == pytest.approx(metrics[key], abs=1e-5), key
    # atol 1e-5: sequence-parallel reductions sum in another order; measured up to 3.4e-6 (2 of 1024 entries of the
    # embedding gradient) on an AVX2 AMD EPYC, ~1e-7 on an AVX-512 CPU
    for name, grad in single.full_gradients().items():
        torch.testing.assert_close(result["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    single.optimizer_step()
    # atol 1e-5: the gradients' rounding differences, which the first AdamW step (~lr * g / (|g| + eps), lr 1e-2,
    # eps 1e-4) can scale by up to lr / eps = 100 for small entries
    for name, tensor in single.full_state_dict().items():
        torch.testing.assert_close(result["state"][name], tensor, atol=1e-5, rtol=0, msg=name)
        assert torch.equal(result["pushed"][name], result["state"][name]), name  # every expert pushed, in place
    assert {p.name for p in (Path(str(out) + ".ckpt") / "optimizer").iterdir()} == expected


@pytest.mark.parametrize(
    "yarn",
    [
        # HF keeps the legacy "type" beside rope_type (DeepSeek-V3's own config.json); only mscale_all_dim set:
        # cos/sin scaled by mscale(factor) as HF does, not by 1 / mscale(factor, mscale_all_dim)
        {"type": "yarn", "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
         "original_max_position_embeddings": 32, "mscale_all_dim": 1.0},
        # only mscale set: cos/sin by mscale(factor), the softmax unscaled
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
         "mscale": 0.7},
    ],
    ids=["legacy_type_mscale_all_dim_only", "mscale_only"],
)  # fmt: skip
def test_yarn_variants_of_real_configs_convert_to_the_hf_logits(tmp_path, yarn):
    from miles.train.megatron.backend import CausalLMView
    from moe_models import make_moe_model

    hf = make_moe_model("deepseek_v3", rope_parameters=yarn)
    hf.save_pretrained(tmp_path)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    view = CausalLMView(_megatron(tmp_path).gpt, VOCAB)
    with torch.no_grad():
        got = view(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
        torch.testing.assert_close(got, hf(input_ids=tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "what"),
    [
        ({"n_shared_experts": 0}, "n_shared_experts 0"),
        ({"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}, "norm_topk_prob true with num_experts_per_tok 1"),
        ({"norm_topk_prob": False}, "norm_topk_prob false"),
        ({"rope_interleave": False}, "rope_interleave false"),
    ],
)
def test_deepseek_configs_megatron_would_compute_differently_are_refused(overrides, what):
    from miles.train.megatron.convert import transformer_config_kwargs
    from moe_models import moe_config

    config = moe_config("deepseek_v3")
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=f"this DeepSeek-V3 config has {what}, which Megatron"):
        transformer_config_kwargs(config, tensor_parallel=1, dtype=torch.float32)


def test_deepseek_yarn_rope_logits_equal_the_hf_model_padded_and_packed(tmp_path):
    """DeepSeek-V3's YaRN RoPE (factor 8 over 32 original positions, mscale_all_dim 1: cos/sin and the softmax
    scaled) on 40-token sequences, past the original length: Megatron's logits equal HF's (measured 2.5e-7), one
    sequence alone and two packed in a row, each from its own position 0."""
    from miles.train.megatron.backend import CausalLMView
    from moe_models import make_moe_model

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    hf = make_moe_model("deepseek_v3", rope_parameters=yarn)
    hf.save_pretrained(tmp_path)
    view = CausalLMView(_megatron(tmp_path).gpt, VOCAB)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40).repeat(2)[None]  # [1, 80]: two sequences packed, each from position 0
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        plain = make_moe_model("deepseek_v3")(input_ids=tokens).logits  # the same weights with the default RoPE
        padded = view(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
        packed = view(input_ids=tokens.reshape(1, 80), position_ids=positions).logits.reshape(2, 40, -1)
    assert (plain - expected).abs().max() > 1e-3  # YaRN changes the logits (measured 1.5e-3: tiny rotary half)
    torch.testing.assert_close(padded, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
