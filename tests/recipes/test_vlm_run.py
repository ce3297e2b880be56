"""Vision-language RL end to end: the tiny Qwen3-VL twin and ``miles train --recipe tiny_qwen3_vl_grpo_visual``."""

import json

import pytest
import torch
from miles.recipes.cli import main, resolve_config
from tiny_runs import TINY_RUN_PATH

RECIPE = "tiny_qwen3_vl_grpo_visual"
LENGTH_REWARD = ["--reward.type", "custom", "--reward.path", "reward_plugins:text_length", "--eval.num-prompts", "0"]


def _two_steps(tmp_path, monkeypatch, name, *extra, recipe=RECIPE):
    """Run 2 steps of ``recipe`` with a response-length reward (the random twin scores 0 on the visual questions);
    returns the training rows of metrics.jsonl."""
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    args = [*LENGTH_REWARD, "--run.dir", str(tmp_path), "--run.name", name, "--run.progress", "false", *extra]
    assert main(["train", "--recipe", recipe, *args]) == 0
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 and r["samples/failed"] == 0 for r in rows), rows
    return rows


def test_the_vlm_twin_is_a_qwen3_vl_with_vision_tokens_a_processor_and_a_template(tiny_vlm_dir):
    from miles.recipes.models.smollm2 import ensure_smollm2
    from miles.recipes.models.tiny import VISION_TOKENS
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_vlm_dir)
    assert config.model_type == "qwen3_vl" and config.vision_config.spatial_merge_size == 2
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32)
    # 109,920: the 16 px patch embedding (3 x 2 x 16 x 16 inputs -> 32) is half of it
    visual = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    assert 100_000 < visual < 120_000 and sum(p.numel() for p in model.parameters()) < 2_000_000
    tokenizer, smollm2 = AutoTokenizer.from_pretrained(tiny_vlm_dir), AutoTokenizer.from_pretrained(ensure_smollm2())
    added = [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS]
    assert added == list(range(len(smollm2), len(smollm2) + 4)) == [len(smollm2) + i for i in range(4)]
    assert config.image_token_id == added[2] and config.text_config.vocab_size == len(tokenizer)
    assert type(AutoImageProcessor.from_pretrained(tiny_vlm_dir)).__name__ == "Qwen2VLImageProcessorPil"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi?<|im_end|>\n<|im_start|>assistant\n"


def test_the_vlm_recipe_runs_two_grpo_steps_with_images_and_engine_and_trainer_agree(tmp_path, monkeypatch):
    """2 GRPO steps with a response-length reward (the random twin scores 0 on the visual questions): the trainer
    takes steps, every weight is pushed, and after the step-1 push engine and trainer log-probs agree."""
    rows = _two_steps(tmp_path, monkeypatch, "vlm")
    assert rows[1]["train_rollout_logprob_abs_diff"] < 1e-5, rows
    # the checkpoint's model directory holds the whole processor: training or evaluation can start from it
    from miles.rollout.multimodal import VisionProcessor, load_tokenizer

    processor = load_tokenizer(tmp_path / "vlm" / "checkpoints" / "step_2" / "model")
    assert isinstance(processor, VisionProcessor) and processor.merge_size == 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            ["--engine.type", "vllm", "--engine.weight-transfer", "disk"],
            "image prompts go to vLLM servers for Qwen3-VL and Qwen2-VL with the weight group's full-weight updates "
            "only, not "
            "with engine.weight_transfer disk yet; set --engine.type embedded or sglang",
        ),
        (
            ["--train.backend", "megatron"],
            "vision-language model type 'qwen3_vl' is not supported (only qwen2_vl: Qwen2-VL, its language model a "
            "Qwen2 under multimodal RoPE); use --train.backend fsdp2",
        ),
        (  # was found only when every sample of step 1 failed to render
            ["--models.policy.path", "tiny-qwen3"],
            "is a text-only model but the prompts carry images (data.image_key or the bundled visual task)",
        ),
        (
            [
                "--rollout.mode",
                "sft",
                "--algorithm.loss.policy-loss",
                "sft",
                "--algorithm.loss.clip-high",
                "0.2",
                "--rollout.n-samples-per-prompt",
                "1",
            ],
            "rollout.mode sft does not run vision-language models yet (its renderer does not carry images); use "
            "--rollout.mode generate or multi_turn",
        ),
        (
            ["--rollout.mode", "multi_turn", "--rollout.multi-turn.agent-path", "operator:add"],
            "an agent plugin (rollout.multi_turn.agent_path) talks to the OpenAI-compatible endpoint, which takes no "
            "images yet",
        ),
    ],
)
def test_what_vlms_do_not_run_on_yet_is_refused_before_any_model_loads(tmp_path, capsys, override, message):
    assert main(["train", "--recipe", RECIPE, "--run.dir", str(tmp_path), *override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_vlm_recipe_validates():
    cfg = resolve_config(RECIPE, [])
    assert (cfg.models.policy.path, cfg.engine.type, cfg.train.batch_layout) == ("tiny-qwen3-vl", "embedded", "padded")
    assert cfg.data.source_path == "miles.rollout.data.visual_tasks:build_source" and cfg.reward.type == "exact_match"


def test_a_data_file_row_whose_image_is_missing_fails_its_samples_not_the_step(tmp_path, monkeypatch):
    """Regression (found by a new-user trial): one prompt that cannot render among good ones crashed the step in
    build_train_batch; now its samples are counted in samples/failed and the rest trains."""
    import io

    from PIL import Image

    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (255, 0, 0)).save(buffer, format="PNG")
    (tmp_path / "red.png").write_bytes(buffer.getvalue())
    rows = [{"question": "<image>Colour?", "answer": "red", "images": ["red.png"]} for _ in range(3)]
    rows.append({"question": "<image>Colour?", "answer": "red", "images": ["missing.png"]})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--data.source", "file", "--data.path", str(tmp_path / "rows.jsonl"), "--data.image-key", "images",
            "--data.source-path", "", "--eval.num-prompts", "0", "--loop.num-steps", "1",
            "--reward.type", "custom", "--reward.path", "reward_plugins:text_length",
            "--run.dir", str(tmp_path), "--run.name", "missing", "--run.progress", "false"]  # fmt: skip
    assert main(["train", "--recipe", RECIPE, *args]) == 0
    rows = [json.loads(line) for line in (tmp_path / "missing" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "loss" in r)
    assert step["samples/failed"] == 4 and step["grad_norm"] > 0, step  # the missing image's group of 4


MATH = ["--reward.type", "math"]


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        ([], False),  # reasoning-gym text prompts: a server engine is fine
        (["--data.source", "file", "--data.path", "x.jsonl", "--data.image-key", "images", *MATH], True),
        (
            ["--data.source", "custom", "--data.source-path", "miles.rollout.data.visual_tasks:build_source", *MATH],
            True,
        ),
        (["--eval.sets", '[{"name": "pics", "data": {"source": "file", "path": "x.jsonl", "image_key": "im"}}]'], True),
    ],
)
def test_a_vision_language_checkpoint_takes_vllm_unless_its_prompts_may_carry_images(overrides, refused):
    """Qwen3.5 / Qwen3.6 checkpoints are vision-language models; their text recipes run on any server engine. Image
    prompts go to the embedded engine and SGLang-API servers (as image_data); to vLLM servers only for Qwen3-VL and
    Qwen2-VL."""
    from miles.recipes.models.tiny import ensure_tiny
    from miles.recipes.run import RunSetupError, _check_vision_model

    sglang = ["--engine.type", "sglang", "--engine.server", "miles"]
    _check_vision_model(resolve_config("qwen3_5_35b_a3b_grpo_gsm8k", [*sglang, *overrides], tiny=True),
                        ensure_tiny("qwen3.5-moe"))  # fmt: skip
    cfg = resolve_config("qwen3_5_35b_a3b_grpo_gsm8k", ["--engine.type", "vllm", *overrides], tiny=True)
    if refused:
        with pytest.raises(
            RunSetupError, match=r"\(qwen3_5_moe\): .* not with a model type other than qwen2_vl or qwen3_vl yet"
        ):
            _check_vision_model(cfg, ensure_tiny("qwen3.5-moe"))
    else:
        _check_vision_model(cfg, ensure_tiny("qwen3.5-moe"))
    # several trainer ranks, with or without images (a rank with text rows only runs the tower on a blank image)
    ranks = [*sglang, "--execution.mode", "ray", "--train.world-size", "2", *overrides]
    _check_vision_model(resolve_config("qwen3_5_35b_a3b_grpo_gsm8k", ranks, tiny=True), ensure_tiny("qwen3.5-moe"))


def test_kimi_k2_5_trains_on_text_prompts_and_refuses_image_prompts_in_one_line():
    """Kimi K2.5's MoonViT takes [P, 3, p, p] pixel patches, not the [P, D] rows Miles renders: its recipe trains on
    text (GSM8K), and prompts that may carry images stop the run before anything starts."""
    from miles.recipes.models.tiny import ensure_tiny
    from miles.recipes.run import RunSetupError, _check_vision_model

    path = ensure_tiny("kimi-k2.5")
    _check_vision_model(resolve_config("kimi_k2_5_grpo_gsm8k", [], tiny=True), path)
    visual = ["--data.source", "custom", "--data.source-path", "miles.rollout.data.visual_tasks:build_source", *MATH]
    with pytest.raises(RunSetupError, match=r"\(kimi_k25\) that Miles trains on text prompts only: .* drop "
                       r"data.image_key"):  # fmt: skip
        _check_vision_model(resolve_config("kimi_k2_5_grpo_gsm8k", visual, tiny=True), path)


@pytest.mark.slow
def test_image_prompts_go_to_a_miles_serve_server_as_input_ids_and_image_data(tmp_path, monkeypatch):
    """The SGLang-API path: the client sends the expanded input_ids and the images' files (image_data); `miles serve`
    (SGLang's API; not SGLang) runs the model's own image processor on them: engine = trainer after the push."""
    rows = _two_steps(tmp_path, monkeypatch, "vlm_serve", "--engine.type", "sglang", "--engine.server", "miles")
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in rows), rows  # 4.7e-7 measured


@pytest.mark.vllm
def test_image_prompts_go_to_a_vllm_server_and_engine_and_trainer_agree_after_each_push(tmp_path, monkeypatch):
    """`miles train --engine.type vllm` on the Qwen3-VL twin with head_dim 32 (vLLM's CPU attention needs it): image
    prompts through vLLM's generate endpoint, every weight pushed through the weight group after each step."""
    from miles.recipes.models.tiny import build_tiny
    from servers import VLM_HEAD_DIM_32, vllm_python

    vllm_python()  # skips without vLLM
    model = build_tiny("qwen3-vl", tmp_path / "tiny_vlm_hd32", text_overrides=VLM_HEAD_DIM_32)
    rows = _two_steps(tmp_path, monkeypatch, "vlm_vllm", "--engine.type", "vllm", "--models.policy.path", str(model))
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in rows), rows  # 4.6e-7, 3.1e-7 measured


@pytest.mark.vllm
def test_the_smollm2_vl_recipe_runs_on_a_vllm_server_with_checksums_and_log_probs_equal_after_each_push(
    tmp_path, monkeypatch
):
    """`miles train --recipe smollm2_vl_grpo_visual --engine.type vllm`: a Qwen2-VL (SmolLM2's language model, head_dim
    64, tied embeddings) through vLLM's generate endpoint, 2 tiny steps; each push's checksums equal the trainer's
    tensors (vLLM names them ``language_model.model.*`` / ``visual.*``) and some are checkable on the CPU."""
    from miles.rollout.engines import vllm
    from servers import vllm_python

    vllm_python()  # skips without vLLM
    checked = []

    def verify_servers(*args, **kwargs):
        checked.append(verify(*args, **kwargs))  # raises on any mismatch
        return checked[-1]

    verify = vllm.verify_servers
    monkeypatch.setattr(vllm, "verify_servers", verify_servers)
    tiny = ["--loop.num-steps", "2", "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "4",
            "--data.size", "8", "--eval.num-prompts", "0"]  # fmt: skip
    rows = _two_steps(tmp_path, monkeypatch, "smollm2_vl_vllm", "--engine.type", "vllm", *tiny,
                      recipe="smollm2_vl_grpo_visual")  # fmt: skip
    gaps = [(r["train_rollout_logprob_abs_diff"], r["train_rollout_logprob_abs_diff_max"]) for r in rows]
    print(f"pushes: {checked} (tensors checksum-equal, in CPU GEMM handles); log-prob gaps (mean, max): {gaps}")
    # vLLM's CPU kernels on 30 layers of width 576: ~1e-5 mean, ~3e-5 max per token already before any push (the
    # text SmolLM2's floor too, tests/rollout/test_vllm_engine.py); a tied head left stale by a push is off by ~1
    assert all(r["train_rollout_logprob_abs_diff"] < 5e-5 for r in rows), rows  # 1.1e-5, 1.0e-5 measured
    assert all(r["train_rollout_logprob_abs_diff_max"] < 2e-4 for r in rows), rows  # 3.1e-5, 2.9e-5 measured
    # 113 measured per push: embeddings, norms, the fused q/k/v biases and the tower's non-linear tensors
    assert len(checked) == 2 and all(verified >= 100 for verified, _ in checked), checked


@pytest.mark.slow
def test_the_qwen3_vl_gpu_recipe_validates_and_its_tiny_twin_trains_with_images(tmp_path, monkeypatch):
    gpu = resolve_config("qwen3_vl_2b_grpo_visual", [])
    assert (gpu.models.policy.path, gpu.engine.type, gpu.train.world_size) == ("Qwen/Qwen3-VL-2B-Instruct", "sglang", 1)
    assert (gpu.data.source, gpu.reward.type, gpu.train.dtype) == ("custom", "exact_match", "bf16")
    rows = _two_steps(tmp_path, monkeypatch, "vl2b", "--tiny", recipe="qwen3_vl_2b_grpo_visual")
    assert rows[1]["train_rollout_logprob_abs_diff"] < 1e-5, rows  # packed batches with images


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(["--train.lora.sync", "merged"], id="embedded-merged"),
        pytest.param(["--train.lora.sync", "adapter"], id="embedded-adapter"),
        pytest.param(["--train.lora.sync", "adapter", "--engine.type", "sglang", "--engine.server", "miles"],
                     id="miles-serve-adapter"),
    ],
)  # fmt: skip
def test_lora_on_a_vision_language_policy_trains_with_images_and_the_tower_stays_as_loaded(
    tmp_path, monkeypatch, engine
):
    """peft adapters on the language model's projections (the default targets; the tower's are named qkv / proj /
    linear_fc*): 2 steps with images, engine = trainer after each push, merged or as adapters (the embedded engine;
    `miles serve`, SGLang's API, not SGLang), and the vision tower in the checkpoint equal to the starting model's."""
    from miles.core.multimodal import load_policy_model
    from miles.recipes.models.tiny import ensure_tiny

    rows = _two_steps(tmp_path, monkeypatch, "lora", "--train.lora.rank", "4", *engine)
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in rows), rows  # 0 .. 4.1e-7 measured
    start, end = (
        dict(load_policy_model(path).named_parameters())
        for path in (ensure_tiny("qwen3-vl"), tmp_path / "lora" / "checkpoints" / "step_2" / "model")
    )
    assert start.keys() == end.keys()
    assert all(torch.equal(start[n], end[n]) for n in start if n.startswith("model.visual."))
    assert any(not torch.equal(start[n], end[n]) for n in start if ".self_attn.q_proj." in n)  # merged adapters


def test_the_smolvlm_twin_is_a_small_smolvlm_with_image_tokens_a_pil_processor_and_its_template(tiny_smolvlm_dir):
    from miles.recipes.models.tiny_smolvlm import image_tokens
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_smolvlm_dir)
    assert config.model_type == "smolvlm" and config.scale_factor == 2 and config.vision_config.image_size == 32
    model = AutoModelForImageTextToText.from_pretrained(tiny_smolvlm_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 800_096  # 49,160 x 16 tied embedding: 786,560 of it
    assert model.lm_head.weight is model.model.text_model.embed_tokens.weight
    tokenizer = AutoTokenizer.from_pretrained(tiny_smolvlm_dir)
    assert all(len(tokenizer.tokenize(t)) == 1 for t in image_tokens())
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert tokenizer.eos_token == "<end_of_utterance>"
    processor = AutoImageProcessor.from_pretrained(tiny_smolvlm_dir)
    assert type(processor).__name__ == "SmolVLMImageProcessorPil" and processor.max_image_size == {"longest_edge": 32}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<|im_start|>User:<image>Hi?<end_of_utterance>\nAssistant:"


def test_the_tiny_smolvlm_trains_two_grpo_steps_with_images_and_engine_and_trainer_agree(tmp_path, monkeypatch):
    """The Idefics3 layout end to end: ``--models.policy.path tiny-smolvlm`` on the visual recipe, image tiles
    rendered once, carried to the embedded engine and the trainer; after the step-1 push they agree."""
    rows = _two_steps(tmp_path, monkeypatch, "smolvlm", "--models.policy.path", "tiny-smolvlm")
    assert rows[1]["train_rollout_logprob_abs_diff"] < 1e-5, rows
    from miles.rollout.multimodal import load_tokenizer

    processor = load_tokenizer(tmp_path / "smolvlm" / "checkpoints" / "step_2" / "model")
    assert processor.layout == "idefics3" and processor.image_seq_len == 4


@pytest.mark.slow
def test_the_tiny_smolvlm_takes_image_prompts_on_a_miles_serve_server(tmp_path, monkeypatch):
    """The SGLang-API path with the Idefics3 layout: input_ids with the expanded tile placeholders and the images'
    files; `miles serve` (SGLang's API; not SGLang) tiles them with the model's own image processor."""
    serve = ["--engine.type", "sglang", "--engine.server", "miles"]
    rows = _two_steps(tmp_path, monkeypatch, "smolvlm_serve", "--models.policy.path", "tiny-smolvlm", *serve)
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in rows), rows


@pytest.mark.parametrize(
    ("override", "server"),
    [(["--engine.type", "vllm"], "vLLM"), (["--engine.type", "sglang", "--engine.server", "sglang"], "SGLang")],
    ids=["vllm", "sglang"],
)
def test_smolvlm_image_prompts_on_vllm_and_sglang_servers_are_refused_in_one_line(tmp_path, capsys, override, server):
    args = ["--models.policy.path", "tiny-smolvlm", "--run.dir", str(tmp_path), *override]
    assert main(["train", "--recipe", RECIPE, *args]) == 2
    err = capsys.readouterr().err
    assert f"image prompts run on the embedded engine and miles serve only, not on {server} servers yet" in err
    assert "Traceback" not in err


def test_lora_on_smolvlm_is_refused_in_one_line(tmp_path, capsys):
    args = ["--models.policy.path", "tiny-smolvlm", "--train.lora.rank", "4", "--run.dir", str(tmp_path)]
    assert main(["train", "--recipe", RECIPE, *args]) == 2
    err = capsys.readouterr().err
    assert "(smolvlm): LoRA is not tested on Idefics3 / SmolVLM yet" in err and "Traceback" not in err


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_qwen2_vl_trains_two_grpo_steps_with_images_on_the_megatron_backend(
    tiny_qwen2_vl_dir, tmp_path, monkeypatch, layout
):
    """`miles train --train.backend megatron` on a tiny Qwen2-VL: Megatron's GPTModel (multimodal RoPE) under the HF
    vision tower trains on the images the engine saw, every weight is pushed (HF names), and after the step-1 push
    engine and trainer log-probs agree; the push leaves the engine's tensors checksum-equal to the trainer's."""
    from miles.core.multimodal import load_policy_model

    args = ["--models.policy.path", str(tiny_qwen2_vl_dir), "--train.backend", "megatron", "--train.dtype", "fp32",
            "--train.batch-layout", layout]  # fmt: skip
    rows = _two_steps(tmp_path, monkeypatch, "megatron", *args)
    assert rows[1]["train_rollout_logprob_abs_diff"] < 1e-5, rows
    # the checkpoint loads as the VLM with every tensor; the tower, merger and language model all trained
    saved = load_policy_model(tmp_path / "megatron" / "checkpoints" / "step_2" / "model").state_dict()
    start = load_policy_model(tiny_qwen2_vl_dir).state_dict()
    assert set(saved) == set(start)
    for prefix in ("model.visual.blocks.", "model.visual.merger.", "model.language_model.layers."):
        assert any(n.startswith(prefix) and not torch.equal(saved[n], start[n]) for n in saved), prefix


def test_lora_on_a_qwen2_vl_on_megatron_is_refused_before_any_model_loads(tiny_qwen2_vl_dir, tmp_path, capsys):
    """(The other refusals of miles.train.megatron.vision.check_supported: tests/train/test_megatron_vlm.py.)"""
    args = ["--models.policy.path", str(tiny_qwen2_vl_dir), "--train.backend", "megatron", "--train.lora.rank", "4"]
    assert main(["train", "--recipe", RECIPE, "--run.dir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert "not with train.lora yet; use --train.backend fsdp2" in err and "Traceback" not in err
