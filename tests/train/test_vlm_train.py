"""A vision-language policy in the FSDP2 trainer: log-probs recomputed from exactly the engine's inputs, image tokens
outside the loss, every weight (vision tower included) pushed through miles-sync, the tower frozen by config. The
tiny random Qwen3-VL twin; one regression test per fault class VLM RL frameworks are known for."""

import pytest
import torch
from miles.core.algorithms.objective import PolicyObjective
from miles.core.batch import build_train_batch
from miles.core.buffer import generate_samples
from miles.core.config import AlgorithmConfig, SamplingConfig
from miles.core.loop import train_step
from miles.core.sample import Sample
from miles.rollout.data.visual_tasks import VisualTaskSource
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.generate import ChatRollout
from miles.rollout.multimodal import load_tokenizer
from miles.sync import InProcessTransport, WeightSender
from transformers import AutoModelForCausalLM
from vlm_checks import check_two_ranks_give_the_one_rank_gradient, fsdp2_backend, max_gap

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6)
OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=6)


@pytest.fixture(scope="module")
def rollout(tiny_vlm_dir):
    """Engine, processor and a batch of 3 image prompts x 2 samples generated on it."""
    engine = EmbeddedEngine(tiny_vlm_dir, dtype="fp32")
    processor = load_tokenizer(tiny_vlm_dir)
    source = VisualTaskSource(size=8, seed=0)
    prompts = [source.sample_at(i, i) for i in range(3)]
    samples = generate_samples(prompts, ChatRollout(engine, processor), n_samples_per_prompt=2, sampling=SAMPLING,
                               seed=3)  # fmt: skip
    advantages = torch.tensor([1.0, -1.0] * 3)  # a spread within each group, so the step moves every weight
    batch = build_train_batch(samples, advantages, pad_token_id=processor.pad_token_id)
    return engine, processor, batch


def _samples(rollout):
    """The rollout's samples again, rebuilt from its batch (the fixture keeps only the batch)."""
    _, _, batch = rollout
    samples = []
    for b in range(batch.batch_size):
        n = int(batch.prompt_lengths[b] + batch.response_lengths[b])
        resp = int(batch.response_lengths[b])
        samples.append(Sample(index=b, group_index=b // 2, prompt="", tokens=batch.tokens[b, :n].tolist(),
                              response_length=resp, rollout_log_probs=batch.rollout_log_probs[b, :resp].tolist(),
                              multimodal_inputs=batch.multimodal_inputs[b]))  # fmt: skip
    return samples


def test_the_trainer_recomputes_the_engines_log_probs_from_the_samples_images(tiny_vlm_dir, rollout):
    _, _, batch = rollout
    assert len(batch.multimodal_inputs) == batch.batch_size and all(m is not None for m in batch.multimodal_inputs)
    backend = fsdp2_backend(tiny_vlm_dir)
    trainer = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    assert batch.loss_mask.sum() >= 12  # real response tokens compared
    assert max_gap(trainer, batch.rollout_log_probs, batch.loss_mask) < 1e-5
    # Fault class: the two sides process images differently. Other pixels under the same tokens (what a trainer that
    # re-ran a different processor, or lost the images, would see) give measurably different log-probs.
    other = tuple(batch.multimodal_inputs[(b + 2) % batch.batch_size] for b in range(batch.batch_size))
    forged = backend.forward(batch.replace(multimodal_inputs=other), outputs={"old_log_probs"}).old_log_probs
    assert max_gap(forged, batch.rollout_log_probs, batch.loss_mask) > 1e-3


def test_image_placeholder_tokens_are_never_in_the_loss_mask(rollout):
    """Fault class: image tokens counted into the loss. The loss mask covers response columns only; every image
    placeholder sits in the prompt, and the trained columns hold none."""
    _, processor, batch = rollout
    image_id = processor.convert_tokens_to_ids("<|image_pad|>")
    for b in range(batch.batch_size):
        prompt_len, resp_len = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        row = batch.tokens[b]
        assert int((row[:prompt_len] == image_id).sum()) == 4
        response = row[prompt_len : prompt_len + resp_len]
        assert not bool((response[batch.loss_mask[b, :resp_len]] == image_id).any())
    assert batch.num_loss_tokens == int(batch.response_lengths.sum())  # exactly the response tokens


def test_a_step_moves_the_vision_tower_and_the_push_brings_every_weight_to_the_engine(tiny_vlm_dir, rollout):
    """Fault class: vision weights missing or stale after a push. After one step every engine tensor (vision tower,
    merger, language model, tied embedding) equals the trainer's, and the engine's log-probs equal the trainer's."""
    _, _, batch = rollout
    backend = fsdp2_backend(tiny_vlm_dir)
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}
    train_step(backend, batch.replace(old_log_probs=batch.rollout_log_probs), OBJECTIVE)
    after = backend.full_state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert any(k.startswith("model.visual.blocks.") for k in moved)
    assert any(k.startswith("model.visual.merger.") for k in moved)
    assert any(k.startswith("model.language_model.layers.") for k in moved)

    engine = EmbeddedEngine(tiny_vlm_dir, dtype="fp32")  # a fresh one: the module's engine stays at version 0
    WeightSender(InProcessTransport(engine.receiver)).push(backend.export_weights(), version=1)
    assert engine.weight_version == 1
    held = engine.model.state_dict()
    assert sorted(held) == sorted(after)
    assert all(torch.equal(held[k], after[k]) for k in after), [k for k in after if not torch.equal(held[k], after[k])]
    ends = (batch.prompt_lengths + batch.response_lengths).tolist()
    starts = batch.prompt_lengths.tolist()
    prompts = [batch.tokens[b, : starts[b]].tolist() for b in range(batch.batch_size)]
    responses = [batch.tokens[b, starts[b] : ends[b]].tolist() for b in range(batch.batch_size)]
    engine_lp = engine.score(prompts, responses, temperature=1.0, multimodal=list(batch.multimodal_inputs))
    trainer_lp = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    width = engine_lp.shape[1]
    assert max_gap(engine_lp, trainer_lp[:, :width], batch.loss_mask[:, :width]) < 1e-5


def test_a_frozen_vision_tower_stays_as_loaded_while_the_language_model_trains(tiny_vlm_dir, rollout):
    _, _, batch = rollout
    backend = fsdp2_backend(tiny_vlm_dir, freeze_vision_tower=True)
    assert all(not p.requires_grad for n, p in backend.model.named_parameters() if n.startswith("model.visual."))
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}
    train_step(backend, batch.replace(old_log_probs=batch.rollout_log_probs), OBJECTIVE)
    after = backend.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in after if k.startswith("model.visual."))
    assert any(not torch.equal(after[k], before[k]) for k in after if k.startswith("model.language_model."))
    assert sum(1 for k, _ in backend.export_weights() if k.startswith("model.visual.")) > 0  # still pushed


def test_freezing_kimi_k25s_vision_tower_freezes_its_projector_too(tmp_path):
    """Kimi K2.5's projector (``mm_projector``) is a sibling of its tower, not inside it as Qwen-VL's merger is."""
    from miles.recipes.models.tiny import ensure_tiny

    backend = fsdp2_backend(ensure_tiny("kimi-k2.5", tmp_path), freeze_vision_tower=True)
    frozen = ("model.vision_tower.", "model.mm_projector.")
    params = dict(backend.model.named_parameters())
    assert {n.split(".")[1] for n, p in params.items() if not p.requires_grad} == {"vision_tower", "mm_projector"}
    assert all(p.requires_grad for n, p in params.items() if n.startswith("model.language_model."))
    assert {k.split(".")[1] for k, _ in backend.export_weights() if k.startswith(frozen)} == {  # still pushed
        "vision_tower",
        "mm_projector",
    }


def test_the_packed_layout_gives_the_padded_log_probs_with_images_and_text_rows(tiny_vlm_dir, rollout):
    """Packed rows keep each sample's multimodal RoPE positions (computed on the row alone) behind text positions
    that restart per row; a text-only row packs beside image rows."""
    engine, processor, batch = rollout
    text = Sample(index=9, group_index=9, prompt=[{"role": "user", "content": "Say hi."}])
    text_samples = generate_samples([text], ChatRollout(engine, processor), n_samples_per_prompt=2, sampling=SAMPLING,
                                    seed=5)  # fmt: skip
    image_samples = [s for s in _samples(rollout)]
    mixed = build_train_batch(image_samples[:3] + text_samples + image_samples[3:], torch.zeros(8),
                              pad_token_id=processor.pad_token_id)  # fmt: skip
    assert [m is None for m in mixed.multimodal_inputs] == [False] * 3 + [True] * 2 + [False] * 3
    padded = fsdp2_backend(tiny_vlm_dir).forward(mixed, outputs={"old_log_probs"}).old_log_probs
    packed_backend = fsdp2_backend(tiny_vlm_dir, batch_layout="packed")
    packed = packed_backend.forward(mixed, outputs={"old_log_probs"}).old_log_probs
    assert max_gap(packed, padded, mixed.loss_mask) < 1e-5
    assert max_gap(packed, mixed.rollout_log_probs, mixed.loss_mask) < 1e-5
    rows = mixed.multimodal_inputs
    image_rows = [0, 1, 2, 5, 6, 7]
    swap = dict(zip(image_rows, image_rows[2:] + image_rows[:2]))  # each image row gets another prompt's pictures
    forged = tuple(rows[swap[b]] if b in swap else None for b in range(8))
    other = packed_backend.forward(mixed.replace(multimodal_inputs=forged), outputs={"old_log_probs"}).old_log_probs
    assert max_gap(other, padded, mixed.loss_mask) > 1e-3


def _mixed_rows(rollout):
    """2 image rows then 2 text rows (a mixture of visual and text prompts), advantages +1, -1, +1, -1."""
    engine, processor, _ = rollout
    text = Sample(index=9, group_index=9, prompt=[{"role": "user", "content": "Say hi."}])
    text_samples = generate_samples([text], ChatRollout(engine, processor), n_samples_per_prompt=2, sampling=SAMPLING,
                                    seed=5)  # fmt: skip
    rows = _samples(rollout)[:2] + text_samples
    return build_train_batch(rows, torch.tensor([1.0, -1.0, 1.0, -1.0]), pad_token_id=processor.pad_token_id)


def test_the_tower_keepalive_runs_the_tower_on_text_rows_and_changes_no_value(tiny_vlm_dir, tiny_llama_dir, rollout):
    """keep_vision_tower_in_step: a text-only forward runs the tower once more (on a blank image) so sharded ranks
    stay in step, with logits and language-model gradients bit-equal and a zero gradient on every tower weight; a
    forward with images runs the tower once, as without the hooks."""
    from miles.core.multimodal import load_policy_model, multimodal_forward_kwargs
    from miles.train.fsdp2.parallelize import keep_vision_tower_in_step

    batch = _mixed_rows(rollout)
    plain, kept = (load_policy_model(tiny_vlm_dir, dtype=torch.float32) for _ in range(2))
    assert keep_vision_tower_in_step(kept)
    calls = []
    kept.model.visual.register_forward_hook(lambda *_: calls.append(1))
    text = batch.slice(2, 4)
    logits = {}
    for name, model in (("plain", plain), ("kept", kept)):
        logits[name] = model(input_ids=text.tokens, attention_mask=text.attention_mask.long()).logits
        logits[name].float().logsumexp(-1).sum().backward()
    assert len(calls) == 1
    assert torch.equal(logits["kept"], logits["plain"])
    grads = {n: p.grad for n, p in kept.named_parameters()}
    for name, p in plain.named_parameters():
        if name.startswith("model.visual."):
            assert p.grad is None and grads[name] is not None and not grads[name].any(), name
        else:
            assert torch.equal(grads[name], p.grad), name
    images = batch.slice(0, 2)
    kwargs = multimodal_forward_kwargs(kept, images.tokens, images.multimodal_inputs)
    with torch.no_grad():
        out = kept(input_ids=images.tokens, attention_mask=images.attention_mask.long(), **kwargs).logits
        ref = plain(input_ids=images.tokens, attention_mask=images.attention_mask.long(), **kwargs).logits
    assert len(calls) == 2 and torch.equal(out, ref)
    assert not keep_vision_tower_in_step(AutoModelForCausalLM.from_pretrained(tiny_llama_dir))


@pytest.mark.integration
def test_two_ranks_one_with_image_rows_one_with_text_rows_give_the_one_rank_gradient(tiny_vlm_dir, rollout, tmp_path):
    """Two gloo ranks, rank 0 holding the image rows and rank 1 the text rows (which alone never call the vision
    tower): neither waits forever in the tower's collectives, each rank's log-probs equal the one-rank ones, and the
    reduced gradient (vision tower included) equals the one-rank gradient of the whole batch."""
    check_two_ranks_give_the_one_rank_gradient(
        tiny_vlm_dir, _mixed_rows(rollout), tmp_path, OBJECTIVE, ("model.visual.blocks.",)
    )
