"""diffusers' SD3 pipelines as flow models (``miles.diffusion.models.sd3_flow_model``), on the random SD3.5-shaped
``tiny-sd3``: our ODE sampler + decoder reproduce the pipeline's own images, the prompt encoding is the pipeline's,
the trained transformer round-trips through a checkpoint and exports as a loadable pipeline, and ``miles train``
runs Flow-GRPO on it."""

import json
import logging
import logging.handlers

import pytest
import torch
from miles.diffusion.models import FLOW_META, export_pipeline, load_flow_model, save_flow_model, sd3_flow_model
from miles.diffusion.sampler import sample_ode
from miles.recipes.cli import main

PROMPTS = ["a red image", "a blue square"]


def pipeline(path, **kwargs):
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None, **kwargs)


def test_the_twin_is_sd35_shaped_and_offline(tiny_sd3_dir):
    index = json.loads((tiny_sd3_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline" and index["text_encoder_3"] == [None, None]
    config = json.loads((tiny_sd3_dir / "transformer" / "config.json").read_text())
    assert config["qk_norm"] == "rms_norm" and config["dual_attention_layers"] == [0]  # SD3.5's MMDiT-X blocks
    model = sd3_flow_model(tiny_sd3_dir, max_sequence_length=8)
    assert model.latent_shape == (4, 16, 16) and model.source["resolution"] == 32
    cond = model.encode(PROMPTS)
    assert cond.prompt_embeds.shape == (2, 77 + 8, 64) and cond.pooled.shape == (2, 64)
    embeds, _, pooled, _ = pipeline(tiny_sd3_dir).encode_prompt(
        PROMPTS, PROMPTS, PROMPTS, do_classifier_free_guidance=False, max_sequence_length=8
    )
    assert torch.equal(cond.prompt_embeds, embeds) and torch.equal(cond.pooled, pooled)
    assert torch.equal(cond.prompt_embeds[:, 77:], torch.zeros(2, 8, 64))  # no T5: zeros, as diffusers does


def test_ode_sampling_and_decoding_reproduce_the_pipelines_images(tiny_sd3_dir):
    model = sd3_flow_model(tiny_sd3_dir, max_sequence_length=8)
    noise = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    ours = model.decode(
        sample_ode(
            model.transformer,
            model.encode(PROMPTS),
            latent_shape=(4, 16, 16),
            num_steps=4,
            generator=torch.Generator().manual_seed(3),
        )  # fmt: skip
    )
    theirs = pipeline(tiny_sd3_dir)(
        PROMPTS, num_inference_steps=4, guidance_scale=1.0, latents=noise.clone(), height=32, width=32,
        output_type="pt", max_sequence_length=8,
    ).images  # fmt: skip
    assert ours.shape == theirs.shape == (2, 3, 32, 32)
    assert torch.allclose((ours + 1) / 2, theirs, atol=1e-5)  # the pipeline returns [0, 1]


def test_a_trained_transformer_round_trips_and_exports_as_a_pipeline(tiny_sd3_dir, tmp_path):
    model = sd3_flow_model(tiny_sd3_dir, max_sequence_length=8)
    with torch.no_grad():
        next(model.transformer.parameters()).add_(0.25)
    save_flow_model(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / FLOW_META).read_text())["kind"] == "sd3"
    loaded = load_flow_model(tmp_path / "m")
    assert loaded.source == model.source
    for (name, a), (_, b) in zip(model.transformer.state_dict().items(), loaded.transformer.state_dict().items()):
        assert torch.equal(a, b), name
    saving = logging.getLogger("diffusers.pipelines.pipeline_utils")  # diffusers' loggers do not propagate
    heard = logging.handlers.BufferingHandler(capacity=1000)
    saving.addHandler(heard)
    try:
        export_pipeline(loaded, tmp_path / "pipe")
    finally:
        saving.removeHandler(heard)
    assert not [r.getMessage() for r in heard.buffer if "cannot be saved" in r.getMessage()]  # the absent T5: silent
    assert json.loads((tmp_path / "pipe" / "model_index.json").read_text())["text_encoder_3"] == [None, None]
    exported = pipeline(tmp_path / "pipe")
    first = next(iter(model.transformer.state_dict()))
    assert torch.equal(exported.transformer.state_dict()[first], model.transformer.state_dict()[first])
    with pytest.raises(ValueError, match="is not a diffusers StableDiffusion3Pipeline"):
        sd3_flow_model(tmp_path / "m")
    with pytest.raises(ValueError, match="resolution 30 must be a multiple of 4"):
        sd3_flow_model(tiny_sd3_dir, resolution=30)


def test_the_tiny_sd3_build_logs_under_its_own_module(tmp_path, monkeypatch, caplog):
    from miles.recipes.models import tiny_sd3

    monkeypatch.setattr(tiny_sd3, "build_tiny_sd3", lambda out: (out / "model_index.json").write_text("{}"))
    caplog.set_level(logging.INFO, logger="miles.recipes.models")
    tiny_sd3.ensure_tiny_sd3(tmp_path)
    built = [r for r in caplog.records if r.getMessage().startswith("built ")]
    assert [(r.name, r.getMessage().split(" in ")[0]) for r in built] == [
        ("miles.recipes.models.tiny_sd3", f"built {tmp_path / 'tiny-sd3-v1'}")
    ]


def test_saving_a_pipeline_drops_only_the_note_on_its_absent_components():
    from miles.diffusion.models import _AbsentComponentNote

    def record(message):
        return logging.LogRecord("diffusers.pipelines.pipeline_utils", logging.WARNING, "", 0, message, (), None)

    note = _AbsentComponentNote(["text_encoder_3", "tokenizer_3"])
    absent = "self.text_encoder_3=None of type <class 'NoneType'> cannot be saved."
    other = "self.text_encoder=None of type <class 'NoneType'> cannot be saved."  # not declared absent: kept
    assert not note.filter(record(absent))
    assert note.filter(record(other)) and note.filter(record("safetensors not installed"))


def test_miles_train_runs_flow_grpo_on_an_sd3_pipeline(tiny_sd3_dir, tmp_path):
    args = ["train", "--recipe", "tiny_flow_grpo_compressibility", "--model.path", str(tiny_sd3_dir),
            "--model.max-sequence-length", "8", "--algorithm.prompts-per-step", "2", "--algorithm.group-size", "2",
            "--algorithm.num-steps", "3", "--loop.num-steps", "2", "--eval.interval", "2",
            "--eval.images-per-prompt", "1", "--run.dir", str(tmp_path), "--run.name", "s",
            "--run.progress", "false"]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert len(train_rows) == 2 and all(r["train_rollout_logprob_max_abs_diff"] < 1e-5 for r in train_rows)
    assert all(r["grad_norm"] > 0 for r in train_rows)
    checkpoint = tmp_path / "s" / "checkpoints" / "step_2"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model_index.json").is_file() and (tmp_path / "exported" / "vae").is_dir()


def test_clip_score_is_clips_logit_for_each_image_and_its_prompt(tiny_clip_dir):
    import numpy as np
    from miles.diffusion.rewards import ClipScore
    from transformers import CLIPModel, CLIPProcessor

    images = np.random.default_rng(0).integers(0, 256, size=(3, 16, 16, 3), dtype=np.uint8)
    prompts = ["a red image", "a dog", "a blue square"]
    score = ClipScore(str(tiny_clip_dir), batch_size=2)(prompts, images)  # two forwards: 2 + 1 images
    model, processor = CLIPModel.from_pretrained(tiny_clip_dir), CLIPProcessor.from_pretrained(tiny_clip_dir)
    from PIL import Image

    inputs = processor(text=prompts, images=[Image.fromarray(i) for i in images], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**inputs)
    text = out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True)
    image = out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
    expected = model.logit_scale.exp() * (text * image).sum(-1)  # PickScore's definition, by hand
    assert score == pytest.approx(expected.tolist(), abs=1e-4)
    assert len(set(round(s, 6) for s in score)) == 3
    with pytest.raises(ValueError, match="2 prompts for 3 images"):
        ClipScore(str(tiny_clip_dir))(prompts[:2], images)


def test_miles_train_with_a_clip_score_reward(tiny_clip_dir, tmp_path, capsys):
    args = ["train", "--recipe", "tiny_flow_grpo_compressibility", "--reward.name", "clip_score",
            "--reward.model-path", str(tiny_clip_dir), "--algorithm.prompts-per-step", "2",
            "--algorithm.group-size", "2", "--algorithm.num-steps", "3", "--loop.num-steps", "1",
            "--eval.images-per-prompt", "1", "--run.dir", str(tmp_path), "--run.progress", "false"]  # fmt: skip
    assert main([*args, "--run.name", "c"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1] and all("eval/reward" in r for r in rows if r["step"] == 0)
    assert main([*args, "--run.name", "d", "--reward.model-path", str(tmp_path / "none")]) == 2
    assert "is not a local model directory" in capsys.readouterr().err
    assert main([*args[:5], "--run.name", "e", "--run.dir", str(tmp_path)]) == 2  # clip_score without its model
    assert "reward.model_path goes with reward.name clip_score" in capsys.readouterr().err
