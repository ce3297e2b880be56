"""An Idefics3-layout policy (SmolVLM: image tiles ``pixel_values`` [N, C, H, W] with ``pixel_attention_mask``) in the
FSDP2 trainer and the embedded engine: rendering equal to transformers' own processor, log-probs recomputed from
exactly the engine's tiles, image tokens outside the loss, every parameter group (vision tower, connector, text
model, tied embedding) pushed, the tower and connector frozen by config. The tiny random SmolVLM twin."""

import pytest
import torch
from miles.core.algorithms.objective import PolicyObjective
from miles.core.batch import build_train_batch
from miles.core.buffer import generate_samples
from miles.core.config import AlgorithmConfig, SamplingConfig
from miles.core.loop import train_step
from miles.core.multimodal import concat_multimodal, multimodal_forward_kwargs
from miles.core.sample import Sample
from miles.rollout.data.visual_tasks import VisualTaskSource
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.generate import ChatRollout
from miles.rollout.multimodal import load_image, load_tokenizer
from miles.sync import InProcessTransport, WeightSender
from vlm_checks import check_two_ranks_give_the_one_rank_gradient, fsdp2_backend, max_gap

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6)
OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=6)
GROUPS = ("model.vision_model.", "model.connector.", "model.text_model.")  # + the tied lm_head


@pytest.fixture(scope="module")
def rollout(tiny_smolvlm_dir):
    """Engine, processor and a batch of 3 image prompts x 2 samples generated on it."""
    engine = EmbeddedEngine(tiny_smolvlm_dir, dtype="fp32")
    processor = load_tokenizer(tiny_smolvlm_dir)
    source = VisualTaskSource(size=8, seed=0)
    prompts = [source.sample_at(i, i) for i in range(3)]
    samples = generate_samples(prompts, ChatRollout(engine, processor), n_samples_per_prompt=2, sampling=SAMPLING,
                               seed=3)  # fmt: skip
    advantages = torch.tensor([1.0, -1.0] * 3)  # a spread within each group, so the step moves every weight
    batch = build_train_batch(samples, advantages, pad_token_id=processor.pad_token_id)
    return engine, processor, batch


def _engine_log_probs(engine, batch):
    """The engine's prefill log-probs of the batch's responses, scored on the batch's own tiles."""
    starts = batch.prompt_lengths.tolist()
    ends = (batch.prompt_lengths + batch.response_lengths).tolist()
    prompts = [batch.tokens[b, : starts[b]].tolist() for b in range(batch.batch_size)]
    responses = [batch.tokens[b, starts[b] : ends[b]].tolist() for b in range(batch.batch_size)]
    return engine.score(prompts, responses, temperature=1.0, multimodal=list(batch.multimodal_inputs))


def test_rendering_equals_transformers_idefics3_processor_tokens_and_tiles(tiny_smolvlm_dir):
    """Token ids, tiles and pixel mask are what transformers' Idefics3Processor gives for the same prompt (SmolVLM's
    writes the same image text, but needs num2words and a torchvision video processor): a 64 px picture is 2 x 2
    tiles plus the global view, 5 tiles of 32 x 32, 4 placeholders each."""
    from transformers import Idefics3Processor

    processor = load_tokenizer(tiny_smolvlm_dir)
    assert processor.layout == "idefics3" and processor.image_seq_len == 4
    sample = VisualTaskSource(size=8, seed=0).sample_at(0, 0)
    tokens, inputs = processor.render_sample(sample)
    assert inputs["pixel_values"].shape == (5, 3, 32, 32) and inputs["pixel_values"].dtype == torch.float32
    assert inputs["pixel_attention_mask"].shape == (5, 32, 32) and inputs["pixel_attention_mask"].dtype == torch.bool
    reference = Idefics3Processor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                                  image_seq_len=4)  # fmt: skip
    text = processor.apply_chat_template(sample.prompt, add_generation_prompt=True, tokenize=False)
    images = [[load_image(entry) for entry in sample.metadata["images"]]]
    expected = reference(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    assert expected["input_ids"][0].tolist() == tokens
    assert torch.equal(expected["pixel_values"][0], inputs["pixel_values"])
    assert torch.equal(expected["pixel_attention_mask"][0].bool(), inputs["pixel_attention_mask"])
    ids = processor.convert_tokens_to_ids
    assert tokens.count(ids("<image>")) == 5 * 4
    assert tokens.count(ids("<fake_token_around_image>")) == 5 + 1  # before each tile, and after the global view
    assert [tokens.count(ids(f"<row_{r}_col_{c}>")) for r in (1, 2) for c in (1, 2)] == [1, 1, 1, 1]
    assert tokens.count(ids("<global-img>")) == 1


def test_two_images_of_other_shapes_give_their_own_tile_counts_in_prompt_order(tiny_smolvlm_dir):
    """A 64 x 64 picture is 5 tiles (2 x 2 + global), a 40 x 20 one 3 (1 x 2 + global): 8 tiles, 32 placeholders,
    the first image's tiles first."""
    from PIL import Image

    processor = load_tokenizer(tiny_smolvlm_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    square, wide = Image.new("RGB", (64, 64), (255, 0, 0)), Image.new("RGB", (40, 20), (0, 0, 255))
    tokens, inputs = processor.render(messages, [square, wide])
    assert inputs["pixel_values"].shape == (8, 3, 32, 32)
    assert tokens.count(processor.convert_tokens_to_ids("<image>")) == 8 * 4
    red = inputs["pixel_values"][:5, 0].mean().item()  # normalized: (1 - 0.5) / 0.5 = 1.0 in the red channel
    assert red == pytest.approx(1.0, abs=1e-6) and inputs["pixel_values"][5:, 0].mean().item() == pytest.approx(-1.0)


def test_rows_concatenate_along_the_tile_axis_and_a_batch_equals_each_row_alone(tiny_smolvlm_dir, rollout):
    """Fault class: tiles scattered into another row's placeholders. The batch's [1, sum N, C, H, W] input gives
    each row the logits it gets alone."""
    from miles.core.multimodal import load_policy_model

    _, _, batch = rollout
    model = load_policy_model(tiny_smolvlm_dir, dtype=torch.float32).eval()
    rows = list(batch.multimodal_inputs[:3])
    merged = concat_multimodal(rows)
    assert merged["pixel_values"].shape == (1, 15, 3, 32, 32) and merged["pixel_attention_mask"].shape == (
        1,
        15,
        32,
        32,
    )
    tokens, mask = batch.tokens[:3], batch.attention_mask[:3].long()
    with torch.no_grad():
        together = model(input_ids=tokens, attention_mask=mask, **multimodal_forward_kwargs(model, tokens, rows)).logits
        for b in range(3):
            n = int(mask[b].sum())
            row = tokens[b : b + 1, :n]
            alone = model(input_ids=row, **multimodal_forward_kwargs(model, row, rows[b : b + 1])).logits
            torch.testing.assert_close(together[b, :n], alone[0], atol=1e-5, rtol=0)


def test_the_trainer_recomputes_the_engines_log_probs_from_the_samples_tiles(tiny_smolvlm_dir, rollout):
    _, _, batch = rollout
    assert all(m is not None and m["pixel_values"].shape[0] == 5 for m in batch.multimodal_inputs)
    backend = fsdp2_backend(tiny_smolvlm_dir)
    trainer = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    assert batch.loss_mask.sum() >= 12  # real response tokens compared
    assert max_gap(trainer, batch.rollout_log_probs, batch.loss_mask) < 1e-5
    # Fault class: the two sides see different pixels. Other prompts' tiles under the same tokens move the log-probs.
    other = tuple(batch.multimodal_inputs[(b + 2) % batch.batch_size] for b in range(batch.batch_size))
    forged = backend.forward(batch.replace(multimodal_inputs=other), outputs={"old_log_probs"}).old_log_probs
    assert max_gap(forged, batch.rollout_log_probs, batch.loss_mask) > 1e-3


def test_the_packed_layout_gives_the_padded_log_probs_with_image_and_text_rows(tiny_smolvlm_dir, rollout):
    engine, processor, batch = rollout
    text = Sample(index=9, group_index=9, prompt=[{"role": "user", "content": "Say hi."}])
    text_samples = generate_samples([text], ChatRollout(engine, processor), n_samples_per_prompt=2, sampling=SAMPLING,
                                    seed=5)  # fmt: skip
    image_samples = [
        Sample(index=b, group_index=b // 2, prompt="", tokens=batch.tokens[b, : int(batch.attention_mask[b].sum())]
               .tolist(), response_length=int(batch.response_lengths[b]),
               rollout_log_probs=batch.rollout_log_probs[b, : int(batch.response_lengths[b])].tolist(),
               multimodal_inputs=batch.multimodal_inputs[b])
        for b in range(batch.batch_size)
    ]  # fmt: skip
    mixed = build_train_batch(image_samples[:3] + text_samples + image_samples[3:], torch.zeros(8),
                              pad_token_id=processor.pad_token_id)  # fmt: skip
    padded = fsdp2_backend(tiny_smolvlm_dir).forward(mixed, outputs={"old_log_probs"}).old_log_probs
    packed_backend = fsdp2_backend(tiny_smolvlm_dir, batch_layout="packed")
    packed = packed_backend.forward(mixed, outputs={"old_log_probs"}).old_log_probs
    assert max_gap(packed, padded, mixed.loss_mask) < 1e-5
    assert max_gap(packed, mixed.rollout_log_probs, mixed.loss_mask) < 1e-5


def test_image_tokens_are_prompt_tokens_and_never_in_the_loss_mask(rollout):
    """Every placeholder and marker (``<image>``, ``<fake_token_around_image>``, ``<global-img>``, tile positions)
    sits in the prompt, as many as the processor wrote; the trained columns are the response tokens only."""
    _, processor, batch = rollout
    ids = torch.tensor([processor.convert_tokens_to_ids(t) for t in ("<image>", "<fake_token_around_image>",
                                                                       "<global-img>", "<row_1_col_1>")])  # fmt: skip
    image_id = int(ids[0])
    for b in range(batch.batch_size):
        prompt_len, resp_len = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        row = batch.tokens[b]
        assert int((row[:prompt_len] == image_id).sum()) == batch.multimodal_inputs[b]["pixel_values"].shape[0] * 4
        response = row[prompt_len : prompt_len + resp_len]
        assert not bool(torch.isin(response[batch.loss_mask[b, :resp_len]], ids[:1]).any())
    assert batch.num_loss_tokens == int(batch.response_lengths.sum())


def _push(backend, engine, *, skip: str = "") -> None:
    """Push the backend's weights to ``engine``, leaving out every tensor whose name starts with ``skip`` ("" keeps
    all): the push a sender that forgot a parameter group would make."""
    weights = [(k, v) for k, v in backend.export_weights() if not (skip and k.startswith(skip))]
    WeightSender(InProcessTransport(engine.receiver)).push(iter(weights), version=engine.weight_version + 1)


def _perturb(backend, scale: float = 0.5) -> None:
    """Add seeded noise to every trainer parameter (vision tower, connector, text model, tied embedding)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in backend.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.abs().mean().clamp(min=1e-3))


@pytest.mark.parametrize("skip", ["", *GROUPS], ids=["all", "no_vision_tower", "no_connector", "no_text_model"])
def test_after_a_push_of_perturbed_weights_the_engine_equals_the_trainer_only_when_every_group_is_pushed(
    tiny_smolvlm_dir, rollout, skip
):
    """Fault class: vision weights missing or stale after a push. After perturbing every weight and pushing them
    all, every engine tensor (vision tower, connector, text model, tied embedding / lm_head) equals the trainer's and
    the engine's log-probs on the image prompts equal the trainer's (1e-5). A push that leaves one group out (by
    construction: the sender drops its tensors) leaves engine and trainer apart by > 1e-3."""
    _, _, batch = rollout
    backend = fsdp2_backend(tiny_smolvlm_dir)
    _perturb(backend)
    trained = backend.full_state_dict()
    assert {g for g in GROUPS if any(k.startswith(g) for k in trained)} == set(GROUPS)
    engine = EmbeddedEngine(tiny_smolvlm_dir, dtype="fp32")
    _push(backend, engine, skip=skip)
    held = engine.model.state_dict()
    stale = sorted({g for g in GROUPS for k in trained if k.startswith(g) and not torch.equal(held[k], trained[k])})
    trainer_lp = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    engine_lp = _engine_log_probs(engine, batch)
    width = engine_lp.shape[1]
    gap = max_gap(engine_lp, trainer_lp[:, :width], batch.loss_mask[:, :width])
    if not skip:
        assert sorted(held) == sorted(trained) and stale == []
        assert torch.equal(held["lm_head.weight"], trained["model.text_model.embed_tokens.weight"])  # tied
        assert gap < 1e-5
    else:
        assert stale == [skip]
        assert gap > 1e-3


def test_a_step_moves_the_tower_and_connector_and_one_push_brings_every_weight(tiny_smolvlm_dir, rollout):
    _, _, batch = rollout
    backend = fsdp2_backend(tiny_smolvlm_dir)
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}
    train_step(backend, batch.replace(old_log_probs=batch.rollout_log_probs), OBJECTIVE)
    after = backend.full_state_dict()
    moved = {g for g in GROUPS for k in after if k.startswith(g) and not torch.equal(after[k], before[k])}
    assert moved == set(GROUPS)
    engine = EmbeddedEngine(tiny_smolvlm_dir, dtype="fp32")
    _push(backend, engine)
    assert engine.weight_version == 1
    held = engine.model.state_dict()
    assert all(torch.equal(held[k], after[k]) for k in after)
    trainer_lp = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    engine_lp = _engine_log_probs(engine, batch)
    width = engine_lp.shape[1]
    assert max_gap(engine_lp, trainer_lp[:, :width], batch.loss_mask[:, :width]) < 1e-5


def test_a_frozen_vision_tower_freezes_smolvlms_vision_model_and_connector(tiny_smolvlm_dir, rollout):
    _, _, batch = rollout
    backend = fsdp2_backend(tiny_smolvlm_dir, freeze_vision_tower=True)
    params = dict(backend.model.named_parameters())
    assert {n.split(".")[1] for n, p in params.items() if not p.requires_grad} == {"vision_model", "connector"}
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}
    train_step(backend, batch.replace(old_log_probs=batch.rollout_log_probs), OBJECTIVE)
    after = backend.full_state_dict()
    frozen = ("model.vision_model.", "model.connector.")
    assert all(torch.equal(after[k], before[k]) for k in after if k.startswith(frozen))
    assert any(not torch.equal(after[k], before[k]) for k in after if k.startswith("model.text_model."))
    assert {k.split(".")[1] for k, _ in backend.export_weights() if k.startswith(frozen)} == {  # still pushed
        "vision_model",
        "connector",
    }


def test_the_tower_keepalive_runs_smolvlms_tower_on_text_rows_and_changes_no_value(tiny_smolvlm_dir):
    """keep_vision_tower_in_step on the Idefics3 layout: a text-only forward runs the tower and connector on one
    blank tile (for sharded ranks to stay in step), logits and text-model gradients bit-equal, zero gradients on
    every tower and connector weight."""
    from miles.core.multimodal import load_policy_model
    from miles.train.fsdp2.parallelize import keep_vision_tower_in_step

    plain, kept = (load_policy_model(tiny_smolvlm_dir, dtype=torch.float32) for _ in range(2))
    assert keep_vision_tower_in_step(kept)
    calls = []
    kept.model.vision_model.register_forward_hook(lambda *_: calls.append(1))
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    logits = {}
    for name, model in (("plain", plain), ("kept", kept)):
        logits[name] = model(input_ids=tokens).logits
        logits[name].float().logsumexp(-1).sum().backward()
    assert len(calls) == 1 and torch.equal(logits["kept"], logits["plain"])
    grads = {n: p.grad for n, p in kept.named_parameters()}
    for name, p in plain.named_parameters():
        if name.startswith(("model.vision_model.", "model.connector.")):
            assert p.grad is None and grads[name] is not None and not grads[name].any(), name
        else:
            assert torch.equal(grads[name], p.grad), name


def test_a_row_whose_placeholders_do_not_match_its_tiles_is_refused_naming_the_row(tiny_smolvlm_dir, rollout):
    """Fault class: prompt tokens and pixels from different processor calls. A row given 4 of its 5 tiles (16
    placeholders' worth for 20 placeholders) is refused before the model runs."""
    from miles.core.multimodal import load_policy_model

    _, _, batch = rollout
    model = load_policy_model(tiny_smolvlm_dir, dtype=torch.float32)
    rows = list(batch.multimodal_inputs[:2])
    rows[1] = {key: value[:4] for key, value in rows[1].items()}
    with pytest.raises(ValueError, match="row 1 has 20 image placeholder tokens but its images fill 16"):
        multimodal_forward_kwargs(model, batch.tokens[:2], rows)


def _mixed_rows(rollout):
    """2 image rows then 2 text rows (a mixture of visual and text prompts), advantages +1, -1, +1, -1."""
    engine, processor, batch = rollout
    text = Sample(index=9, group_index=9, prompt=[{"role": "user", "content": "Say hi."}])
    text_samples = generate_samples([text], ChatRollout(engine, processor), n_samples_per_prompt=2, sampling=SAMPLING,
                                    seed=5)  # fmt: skip
    image_samples = [
        Sample(index=b, group_index=0, prompt="", tokens=batch.tokens[b, : int(batch.attention_mask[b].sum())].tolist(),
               response_length=int(batch.response_lengths[b]),
               rollout_log_probs=batch.rollout_log_probs[b, : int(batch.response_lengths[b])].tolist(),
               multimodal_inputs=batch.multimodal_inputs[b])
        for b in range(2)
    ]  # fmt: skip
    rows = image_samples + text_samples
    return build_train_batch(rows, torch.tensor([1.0, -1.0, 1.0, -1.0]), pad_token_id=processor.pad_token_id)


@pytest.mark.integration
def test_two_ranks_one_with_image_rows_one_with_text_rows_give_the_one_rank_gradient(
    tiny_smolvlm_dir, rollout, tmp_path
):
    """Two gloo ranks, rank 0 holding the image rows and rank 1 the text rows (which alone never call SmolVLM's
    vision model): neither waits forever in the tower's collectives, each rank's log-probs equal the one-rank ones,
    and the reduced gradient (vision tower and connector included) equals the one-rank gradient of the batch."""
    check_two_ranks_give_the_one_rank_gradient(
        tiny_smolvlm_dir,
        _mixed_rows(rollout),
        tmp_path,
        OBJECTIVE,
        ("model.vision_model.encoder.layers.", "model.connector."),
    )
