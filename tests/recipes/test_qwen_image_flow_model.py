"""diffusers' Qwen-Image pipelines as flow models (``miles.diffusion.models.qwen_image_flow_model``), on the random
Qwen-Image-shaped ``tiny-qwen-image``: our ODE sampler + decoder reproduce the pipeline's own images with and without
its true CFG, on its dynamically shifted schedule; the prompt encoding is the pipeline's and its template cut lands at
the prompt; padded prompts condition as they do alone; the trained transformer round-trips and exports; ``miles train``
runs the Qwen-Image recipe's tiny twin."""

import json
import logging
import re

import pytest
import torch
from miles.diffusion.models import (
    FLOW_META,
    export_pipeline,
    load_flow_model,
    qwen_image_flow_model,
    save_flow_model,
)
from miles.diffusion.sampler import pack_latents, sample, sample_ode, step_log_probs, unpack_latents, velocity
from miles.recipes.cli import main

PROMPTS = ["a red image", "a blue square on a green field"]  # two lengths: the batch is padded


def pipeline(path):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(path, dtype=torch.float32)


def model_of(path):
    return qwen_image_flow_model(path, resolution=16, max_sequence_length=64)


def test_the_twin_is_qwen_image_shaped_and_the_template_cut_lands_at_the_prompt(tiny_qwen_image_dir):
    from miles.recipes.models.tiny_qwen_image import TEMPLATE

    index = json.loads((tiny_qwen_image_dir / "model_index.json").read_text())
    assert (
        index["_class_name"] == "QwenImagePipeline" and index["text_encoder"][1] == "Qwen2_5_VLForConditionalGeneration"
    )
    pipe = pipeline(tiny_qwen_image_dir)
    assert pipe.prompt_template_encode == TEMPLATE  # the template the tokenizer's merges spell
    ids = pipe.tokenizer(TEMPLATE.format("a red image")).input_ids
    start = pipe.prompt_template_encode_start_idx
    assert start == 34 and pipe.tokenizer.decode(ids[start:]) == "a red image<|im_end|>\n<|im_start|>assistant\n"
    model = model_of(tiny_qwen_image_dir)
    assert model.latent_shape == (4, 8, 8) and model.source["resolution"] == 16
    cond = model.encode(PROMPTS)
    embeds, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=64)
    assert torch.equal(cond.prompt_embeds, embeds) and torch.equal(cond.mask, mask.bool())
    lengths = [len(pipe.tokenizer(TEMPLATE.format(p)).input_ids) - start for p in PROMPTS]
    assert cond.pooled is None and cond.mask.sum(1).tolist() == lengths == [9, 31]  # prompt + 5 template tokens


def test_the_schedule_is_the_pipelines_dynamically_shifted_one(tiny_qwen_image_dir):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    model = model_of(tiny_qwen_image_dir)
    scheduler = pipeline(tiny_qwen_image_dir).scheduler
    mu = calculate_shift(16, 256, 8192, 0.5, 0.9)  # 16 packed patches of the 8 x 8 latent
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=mu)
    assert torch.equal(model.schedule(4), scheduler.sigmas.float())
    assert model.schedule(4)[-2].item() == pytest.approx(0.02)  # shift_terminal: the last step ends at 0.02, then 0
    with pytest.raises(ValueError, match="num_steps must be >= 2"):
        model.schedule(1)


def test_packing_is_the_pipelines_and_unpacking_inverts_it():
    from diffusers import QwenImagePipeline

    x = torch.randn(2, 4, 8, 6)
    packed = pack_latents(x)
    assert torch.equal(packed, QwenImagePipeline._pack_latents(x, 2, 4, 8, 6)) and packed.shape == (2, 12, 16)
    assert torch.equal(unpack_latents(packed, (8, 6)), x)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_sampling_and_decoding_reproduce_the_pipelines_images(tiny_qwen_image_dir, guidance):
    model = model_of(tiny_qwen_image_dir)
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    uncond = model.encode([" "] * 2) if guidance != 1.0 else None
    latents = sample_ode(
        model.transformer, model.encode(PROMPTS), latent_shape=(4, 8, 8), num_steps=4, uncond=uncond,
        guidance_scale=guidance, generator=torch.Generator().manual_seed(3), sigmas=model.schedule(4),
    )  # fmt: skip
    ours = model.decode(latents)
    theirs = pipeline(tiny_qwen_image_dir)(
        PROMPTS, negative_prompt=[" "] * 2 if guidance != 1.0 else None, true_cfg_scale=guidance,
        num_inference_steps=4, latents=pack_latents(noise), height=16, width=16, output_type="pt",
        max_sequence_length=64,
    ).images  # fmt: skip
    assert ours.shape == theirs.shape == (2, 3, 16, 16)
    assert torch.allclose((ours + 1) / 2, theirs, atol=1e-5)  # the pipeline returns [0, 1]
    if guidance != 1.0:  # true CFG keeps each patch's norm at the conditional velocity's
        cond = model.encode(PROMPTS)
        x = torch.randn(2, 4, 8, 8)
        guided = velocity(model.transformer, x, 0.5, cond, uncond=uncond, guidance_scale=guidance)
        plain = velocity(model.transformer, x, 0.5, cond)
        assert torch.allclose(pack_latents(guided).norm(dim=-1), pack_latents(plain).norm(dim=-1), rtol=1e-5)
        assert not torch.allclose(guided, plain, atol=1e-3)


def test_a_padded_prompt_conditions_as_it_does_alone_and_log_probs_recompute_exactly(tiny_qwen_image_dir):
    model = model_of(tiny_qwen_image_dir)
    cond = model.encode(PROMPTS)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    batched = velocity(model.transformer, x.expand(2, -1, -1, -1), 0.7, cond)[0]  # row 0 padded by 19 tokens
    alone = velocity(model.transformer, x, 0.7, model.encode(PROMPTS[:1]))[0]
    assert torch.allclose(batched, alone, atol=1e-5)
    assert not torch.allclose(batched, velocity(model.transformer, x, 0.7, model.encode(PROMPTS[1:]))[0], atol=1e-3)
    uncond = model.encode([""] * 2)
    kwargs = dict(guidance_scale=4.0, noise_level=0.7)
    trajectories = sample(model.transformer, cond, latent_shape=(4, 8, 8), num_steps=4, sigmas=model.schedule(4),
                          uncond=uncond, generator=torch.Generator().manual_seed(1), **kwargs)  # fmt: skip
    rows = type(trajectories)(trajectories.latents[1:], trajectories.sigmas, trajectories.log_probs[1:])
    recomputed = step_log_probs(model.transformer, rows, cond.rows(slice(1, 2)), range(4),
                                uncond=uncond.rows(slice(1, 2)), **kwargs)  # fmt: skip
    assert torch.allclose(recomputed, trajectories.log_probs[1:], atol=1e-5)
    assert torch.equal(trajectories.sigmas, model.schedule(4))


def test_a_trained_transformer_round_trips_and_exports_as_a_pipeline(tiny_qwen_image_dir, tmp_path):
    model = model_of(tiny_qwen_image_dir)
    with torch.no_grad():
        next(model.transformer.parameters()).add_(0.25)
    save_flow_model(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / FLOW_META).read_text())["kind"] == "qwen_image"
    loaded = load_flow_model(tmp_path / "m")
    assert loaded.source == model.source and loaded.latent_shape == model.latent_shape
    assert torch.equal(loaded.schedule(4), model.schedule(4))
    for (name, a), (_, b) in zip(model.transformer.state_dict().items(), loaded.transformer.state_dict().items()):
        assert torch.equal(a, b), name
    export_pipeline(loaded, tmp_path / "pipe")
    exported = pipeline(tmp_path / "pipe")
    first = next(iter(model.transformer.state_dict()))
    assert torch.equal(exported.transformer.state_dict()[first], model.transformer.state_dict()[first])
    with pytest.raises(ValueError, match="is not a diffusers QwenImagePipeline"):
        qwen_image_flow_model(tmp_path / "m")
    with pytest.raises(ValueError, match="resolution 18 must be a multiple of 4"):
        qwen_image_flow_model(tiny_qwen_image_dir, resolution=18)
    with pytest.raises(ValueError, match="max_sequence_length must lie in"):
        qwen_image_flow_model(tiny_qwen_image_dir, max_sequence_length=2048)


def test_miles_train_runs_the_qwen_image_recipes_tiny_twin(tmp_path, monkeypatch, caplog):
    from miles.recipes.cli import resolve_config

    cfg = resolve_config("qwen_image_flow_grpo_compressibility", [])
    assert (cfg.model.device, cfg.model.resolution, cfg.run.world_size, cfg.algorithm.lora.rank) == ("cuda", 512, 8, 64)
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))  # tiny-qwen-image is built there
    args = ["train", "--recipe", "qwen_image_flow_grpo_compressibility", "--tiny", "--run.dir", str(tmp_path),
            "--run.name", "q", "--run.progress", "false"]  # fmt: skip
    caplog.set_level(logging.INFO, logger="miles.recipes.diffusion")
    assert main(args) == 0
    said = "schedule: the pipeline's own (sigmas [1.0, 0.7431, 0.4248, 0.02, 0.0] for 4 steps); algorithm.shift is"
    assert any(r.getMessage().startswith(said) for r in caplog.records)
    rows = [json.loads(line) for line in (tmp_path / "q" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    # true CFG 4 and the KL to the adapters-off transformer ran: 0 on the first step, > 0 after one update; sampled
    # in bf16 with old log-probs recomputed in fp32, so the ratio starts at 1
    assert train_rows[0]["kl"] == 0 and train_rows[1]["kl"] > 0
    assert all(r["grad_norm"] > 0 and r["approx_kl"] == 0 and r["clipfrac"] == 0 for r in train_rows)
    assert all(0 < r["train_rollout_logprob_max_abs_diff"] < 1 for r in train_rows)  # sampled in bf16: measured
    assert (tmp_path / "cache" / "models" / "tiny-qwen-image-v1" / "model_index.json").is_file()
    checkpoint = tmp_path / "q" / "checkpoints" / "step_2"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "exported")]) == 0
    assert json.loads((tmp_path / "exported" / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"


def test_a_size_the_pipeline_refuses_names_the_config_key_and_its_flag(tmp_path, monkeypatch):
    from miles.recipes.cli import resolve_config
    from miles.recipes.diffusion import build_model

    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    for flag, value, said in (
        ("--model.resolution", "18", "model.resolution [--model.resolution]: 18 must be a multiple of 4"),
        ("--model.max-sequence-length", "2000", "model.max_sequence_length [--model.max-sequence-length]: must lie"),
    ):
        cfg = resolve_config("qwen_image_flow_grpo_compressibility", [flag, value], tiny=True)
        with pytest.raises(ValueError, match=re.escape(said)):
            build_model(cfg)


def test_another_pipeline_class_is_one_line_naming_the_two_it_takes(tmp_path):
    from miles.recipes.cli import resolve_config
    from miles.recipes.diffusion import build_model

    (tmp_path / "flux").mkdir()
    (tmp_path / "flux" / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    cfg = resolve_config("tiny_flow_grpo_compressibility", ["--model.path", str(tmp_path / "flux")])
    with pytest.raises(ValueError, match="holds a diffusers FluxPipeline; Miles trains StableDiffusion3Pipeline"):
        build_model(cfg)
