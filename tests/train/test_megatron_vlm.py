"""A Qwen2-VL policy on the Megatron backend (``miles.train.megatron.vision``): Megatron's GPTModel with multimodal
RoPE under the HF vision tower, against the FSDP2 backend on the same tiny random model and the same image rollout:
log-probs, gradients (language model, vision blocks, merger), a step's exported weights, a frozen tower."""

import sys
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.batch import build_train_batch
from miles.core.buffer import generate_samples
from miles.core.config import AlgorithmConfig, SamplingConfig
from miles.rollout.data.visual_tasks import VisualTaskSource
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.generate import ChatRollout
from miles.rollout.multimodal import load_tokenizer
from miles.train import FSDP2Backend, TrainConfig

sys.path.insert(0, str(Path(__file__).parent))

pytest.importorskip("megatron.core")
from miles.train.megatron import MegatronBackend  # noqa: E402
from miles.train.megatron import vision as megatron_vision  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="train.backend megatron trains on the CPU only")

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6)
OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=6)
TRAIN = dict(dtype="fp32", micro_batch_size=4, lr=1e-2)


@pytest.fixture(scope="module")
def rollout(tiny_qwen2_vl_dir):
    """3 image prompts x 2 samples from the embedded engine on the tiny Qwen2-VL, as a padded TrainBatch."""
    engine = EmbeddedEngine(tiny_qwen2_vl_dir, dtype="fp32")
    processor = load_tokenizer(tiny_qwen2_vl_dir)
    source = VisualTaskSource(size=8, seed=0)
    prompts = [source.sample_at(i, i) for i in range(3)]
    samples = generate_samples(prompts, ChatRollout(engine, processor), n_samples_per_prompt=2, sampling=SAMPLING,
                               seed=3)  # fmt: skip
    advantages = torch.tensor([1.0, -1.0] * 3)
    return build_train_batch(samples, advantages, pad_token_id=processor.pad_token_id)


def _megatron(path, **train) -> MegatronBackend:
    return MegatronBackend(path, train=TrainConfig(backend="megatron", **(TRAIN | train)), temperature=1.0)


def _fsdp2(path, **train) -> FSDP2Backend:
    return FSDP2Backend(path, train=TrainConfig(**(TRAIN | train)), temperature=1.0)


def _max_gap(a, b, mask):
    return float(((a - b).abs() * mask).max())


def _run_step(backend, batch):
    """Log-probs, loss, HF-named gradients, one AdamW step, then the exported weights (copies)."""
    backend.lp = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs * batch.loss_mask
    backend.metrics = backend.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    backend.grads = backend.full_gradients()
    backend.step_metrics = backend.optimizer_step()
    backend.exported = {name: tensor.detach().clone() for name, tensor in backend.export_weights()}
    return backend


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_megatron_log_probs_equal_fsdp2s_and_the_engines_from_the_samples_images(tiny_qwen2_vl_dir, rollout, layout):
    megatron = _megatron(tiny_qwen2_vl_dir, batch_layout=layout)
    fsdp2 = _fsdp2(tiny_qwen2_vl_dir, batch_layout=layout)
    mask = rollout.loss_mask
    assert mask.sum() >= 12 and all(m is not None for m in rollout.multimodal_inputs)
    lp = megatron.forward(rollout, outputs={"old_log_probs"}).old_log_probs
    reference = fsdp2.forward(rollout, outputs={"old_log_probs"}).old_log_probs
    assert _max_gap(lp, reference, mask) < 1e-5
    assert _max_gap(lp, rollout.rollout_log_probs, mask) < 1e-5  # the engine's, sampled from these images
    # another prompt's pixels under the same tokens: the log-probs must move (the images reach the language model)
    other = tuple(rollout.multimodal_inputs[(b + 2) % rollout.batch_size] for b in range(rollout.batch_size))
    forged = megatron.forward(rollout.replace(multimodal_inputs=other), outputs={"old_log_probs"}).old_log_probs
    assert _max_gap(forged, reference, mask) > 1e-3


def test_multimodal_rope_positions_are_hfs_and_differ_from_text_positions_at_the_image(tiny_qwen2_vl_dir, rollout):
    from miles.core.multimodal import concat_multimodal
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    config = AutoConfig.from_pretrained(tiny_qwen2_vl_dir)
    grid = concat_multimodal(rollout.multimodal_inputs)["image_grid_thw"]
    positions = megatron_vision.rope_positions(config, rollout.tokens, rollout.attention_mask, grid)
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen2_vl_dir)
    is_image = (rollout.tokens == config.image_token_id).to(torch.int32)
    expected, _ = model.model.get_rope_index(rollout.tokens, is_image, grid, attention_mask=rollout.attention_mask)
    assert positions.shape == (3, *rollout.tokens.shape) and torch.equal(positions, expected)
    # a 64 px image is a 2 x 2 grid of merged tokens: height and width components differ there, not in text
    first = int(is_image[0].nonzero()[0])
    assert positions[:, 0, first : first + 4].tolist() == [[first] * 4, [first, first, first + 1, first + 1],
                                                           [first, first + 1, first, first + 1]]  # fmt: skip


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gradients_and_a_steps_exported_weights_equal_fsdp2s(tiny_qwen2_vl_dir, rollout, layout):
    """adam_eps 1e-4: AdamW's first step is ~lr * g / (|g| + eps); with 1e-8 a 1e-9 rounding difference of a
    gradient entry near 0 would flip the sign of its update."""
    megatron = _run_step(_megatron(tiny_qwen2_vl_dir, adam_eps=1e-4, batch_layout=layout), rollout)
    fsdp2 = _run_step(_fsdp2(tiny_qwen2_vl_dir, adam_eps=1e-4, batch_layout=layout), rollout)
    torch.testing.assert_close(megatron.lp, fsdp2.lp, atol=1e-5, rtol=0)
    for key, value in fsdp2.metrics.items():
        assert megatron.metrics[key] == pytest.approx(value, abs=1e-5), key
    assert set(megatron.grads) == set(fsdp2.grads)
    for prefix in ("model.visual.blocks.", "model.visual.merger.", "model.language_model.layers."):
        assert any(name.startswith(prefix) and g.abs().max() > 0 for name, g in fsdp2.grads.items()), prefix
    for name, grad in fsdp2.grads.items():
        torch.testing.assert_close(megatron.grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert megatron.step_metrics["grad_norm"] == pytest.approx(fsdp2.step_metrics["grad_norm"], rel=1e-5)
    # every tensor FSDP2 pushes, under the same names, equal after the same step
    assert list(megatron.exported) and set(megatron.exported) == set(fsdp2.exported)
    for name, tensor in fsdp2.exported.items():
        torch.testing.assert_close(megatron.exported[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_a_frozen_vision_tower_stays_bit_equal_and_is_still_exported(tiny_qwen2_vl_dir, rollout):
    megatron = _megatron(tiny_qwen2_vl_dir, freeze_vision_tower=True)
    before = {name: tensor.clone() for name, tensor in megatron.export_weights()}
    trainable = {name for name, p in megatron.gpt.named_parameters() if p.requires_grad}
    assert trainable and not any(name.startswith("visual.") for name in trainable)
    _run_step(megatron, rollout)
    tower = [name for name in before if name.startswith("model.visual.")]
    assert any(".merger." in name for name in tower) and any(".blocks." in name for name in tower)
    assert all(torch.equal(megatron.exported[name], before[name]) for name in tower)
    assert not any(name.startswith("model.visual.") for name in megatron.grads)
    moved = [
        n for n in before if n.startswith("model.language_model.") and not torch.equal(megatron.exported[n], before[n])
    ]
    assert moved  # the language model trained


def test_what_megatron_does_not_run_for_vision_language_models_is_refused_in_one_line(tiny_qwen2_vl_dir, tiny_vlm_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_qwen2_vl_dir)
    base = dict(pipeline_parallel=1, expert_parallel=1, lora=False, qat="none")
    megatron_vision.check_supported(config, **base)
    for change, named in (
                          (dict(lora=True), "train.lora"), (dict(pipeline_parallel=2), "pipeline_parallel_size 2"),
                          (dict(qat="int4"), "train.qat int4")):  # fmt: skip
        with pytest.raises(ValueError, match=named) as err:
            megatron_vision.check_supported(config, **(base | change))
        assert "\n" not in str(err.value) and "fsdp2" in str(err.value)
    with pytest.raises(ValueError, match="'qwen3_vl' is not supported \\(only qwen2_vl"):
        megatron_vision.language_config(AutoConfig.from_pretrained(tiny_vlm_dir))


def test_after_a_step_one_push_makes_every_engine_tensor_equal_the_trainers(tiny_qwen2_vl_dir, rollout):
    """Every engine tensor (vision tower, merger, language model, tied head) bit-equal to Megatron's after a step's
    push, and the engine's log-probs on the image prompts equal the trainer's."""
    from miles.core.loop import train_step
    from miles.sync import InProcessTransport, WeightSender

    backend = _megatron(tiny_qwen2_vl_dir)
    train_step(backend, rollout.replace(old_log_probs=rollout.rollout_log_probs), OBJECTIVE)
    after = backend.full_state_dict()
    engine = EmbeddedEngine(tiny_qwen2_vl_dir, dtype="fp32")
    WeightSender(InProcessTransport(engine.receiver)).push(backend.export_weights(), version=1)
    assert engine.weight_version == 1
    held = engine.model.state_dict()
    assert set(held) == set(after) | {"lm_head.weight"}
    assert torch.equal(held["lm_head.weight"], after["model.language_model.embed_tokens.weight"])
    assert [k for k in after if not torch.equal(held[k], after[k])] == []
    starts, ends = rollout.prompt_lengths.tolist(), (rollout.prompt_lengths + rollout.response_lengths).tolist()
    prompts = [rollout.tokens[b, : starts[b]].tolist() for b in range(rollout.batch_size)]
    responses = [rollout.tokens[b, starts[b] : ends[b]].tolist() for b in range(rollout.batch_size)]
    engine_lp = engine.score(prompts, responses, temperature=1.0, multimodal=list(rollout.multimodal_inputs))
    trainer_lp = backend.forward(rollout, outputs={"old_log_probs"}).old_log_probs
    width = engine_lp.shape[1]
    assert _max_gap(engine_lp, trainer_lp[:, :width], rollout.loss_mask[:, :width]) < 1e-5
    assert _max_gap(trainer_lp, rollout.rollout_log_probs, rollout.loss_mask) > 1e-4  # the step moved the policy


@pytest.mark.integration
@pytest.mark.parametrize("parallel", ["2", "1"], ids=["tp2", "dp2"])
def test_two_ranks_equal_one_rank_with_images(tiny_qwen2_vl_dir, rollout, tmp_path, parallel):
    """TP=2 (the language model split, the vision tower replicated on both ranks, its gradient whole on each) and
    DP=2 (half the image rows each, DDP summing the tower's gradients like any other): log-probs, gradients (HF
    names), the clipped step, the push and the checkpoint equal one rank's (``megatron_worker.py``)."""
    import dataclasses
    import subprocess

    batch_file, out = tmp_path / "batch.pt", tmp_path / "rank0.pt"
    torch.save({f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)}, batch_file)
    worker = Path(__file__).parent / "megatron_worker.py"
    args = [str(tmp_path / "init"), str(tiny_qwen2_vl_dir), str(out), parallel, "padded", str(batch_file)]
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", *args], cwd=worker.parent) for r in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    result = torch.load(out, weights_only=True)
    single = _megatron(tiny_qwen2_vl_dir, micro_batch_size=2, adam_eps=1e-4)  # the worker's settings
    mask = rollout.loss_mask
    lp = single.forward(rollout, outputs={"old_log_probs"}).old_log_probs
    assert _max_gap(result["log_probs"], lp, mask) < 1e-5
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)  # the worker's
    metrics = single.forward_backward(rollout, objective, LossCounts.of(rollout))
    assert result["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-5)
    grads = single.full_gradients()
    assert set(result["grads"]) == set(grads) and any(n.startswith("model.visual.merger.") for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    step = single.optimizer_step()
    assert result["step"]["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-5)
    state = single.full_state_dict()
    assert set(result["pushed"]) == set(state)
    for name, tensor in state.items():
        torch.testing.assert_close(result["state"][name], tensor, atol=1e-6, rtol=0, msg=name)
        assert torch.equal(result["pushed"][name], result["state"][name]), name
        assert torch.equal(result["reloaded"][name], result["state"][name]), name
