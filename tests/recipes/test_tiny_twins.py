"""Frontier recipes composed from bases (model x algorithm x task) and their tiny twins: random-init models of each
family's architecture that run the recipe's whole loop on the CPU (``miles train --recipe NAME --tiny``)."""

import json

import pytest
import torch
import yaml
from miles.recipes.cli import main, resolve_config
from miles.recipes.models.tiny import FAMILIES, ensure_tiny
from miles.recipes.registry import load_recipe, merge_recipe, recipe_bases, tiny_recipe_names
from tiny_runs import TINY_RUN_PATH

FRONTIER = {  # recipe: (GPU model, twin, the twin's backend, model base, batch layout)
    "qwen3_30b_a3b_grpo_gsm8k": ("Qwen/Qwen3-30B-A3B", "tiny-qwen3-moe", "fsdp2", "qwen3_moe", "packed"),
    "kimi_k2_grpo_gsm8k": ("moonshotai/Kimi-K2-Instruct", "tiny-deepseek-v3", "megatron", "kimi_k2", "packed"),
    "kimi_k2_5_grpo_gsm8k": ("moonshotai/Kimi-K2.5", "tiny-kimi-k2.5", "fsdp2", "kimi_k2_5", "packed"),
    "kimi_k2_6_grpo_gsm8k": ("moonshotai/Kimi-K2.6", "tiny-kimi-k2.5", "fsdp2", "kimi_k2_6", "packed"),  # K2.5's
    "glm_5_grpo_gsm8k": ("zai-org/GLM-5", "tiny-glm-5", "fsdp2", "glm_5", "packed"),
    "glm_5_1_grpo_gsm8k": ("zai-org/GLM-5.1", "tiny-glm-5", "fsdp2", "glm_5_1", "packed"),  # GLM-5's architecture
    "deepseek_v4_flash_grpo_gsm8k": (
        "deepseek-ai/DeepSeek-V4-Flash", "tiny-deepseek-v4", "fsdp2", "deepseek_v4_flash", "padded",
    ),
    "qwen3_5_35b_a3b_grpo_gsm8k": ("Qwen/Qwen3.5-35B-A3B", "tiny-qwen3.5-moe", "fsdp2", "qwen3_5_moe", "padded"),
    "qwen3_6_35b_a3b_grpo_gsm8k": ("Qwen/Qwen3.6-35B-A3B", "tiny-qwen3.5-moe", "fsdp2", "qwen3_6_moe", "padded"),
    "qwen3_5_27b_grpo_gsm8k": ("Qwen/Qwen3.5-27B", "tiny-qwen3.5", "fsdp2", "qwen3_5", "padded"),
}  # fmt: skip
# their twins' loops run for another recipe
SAME_TWIN = {"glm_5_1_grpo_gsm8k", "qwen3_6_35b_a3b_grpo_gsm8k", "kimi_k2_6_grpo_gsm8k"}
DENSE = {"qwen3_5_27b_grpo_gsm8k"}  # no routing replay
MODEL_TYPES = {"qwen3": "qwen3", "qwen3-moe": "qwen3_moe", "deepseek-v3": "deepseek_v3", "glm-5": "glm_moe_dsa",
               "qwen3.5": "qwen3_5", "qwen3.5-moe": "qwen3_5_moe", "deepseek-v4": "deepseek_v4",
               "kimi-k2.5": "kimi_k25"}  # fmt: skip
VISION_TWINS = {
    "qwen3.5",
    "qwen3.5-moe",
    "kimi-k2.5",
}  # as the released checkpoints: a vision tower over the language model
DENSE_TWINS = {"qwen3", "qwen3.5"}


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"qwen3-vl"}))  # the VLM twin: tests/recipes/test_vlm_run.py
def test_each_twin_has_its_familys_architecture_at_toy_size_and_is_built_once(family, tmp_path):
    from miles.core.multimodal import auto_model_class
    from miles.recipes.models.smollm2 import ensure_smollm2
    from transformers import AutoConfig, AutoTokenizer

    path = ensure_tiny(family, tmp_path)
    assert ensure_tiny(family, tmp_path) == path  # cached: the second call builds nothing
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary directory left behind
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == MODEL_TYPES[family]
    assert (getattr(config, "vision_config", None) is not None) == (family in VISION_TWINS)
    model = auto_model_class(config).from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000  # 1.60-1.79 M, nearly all the tied embedding
    smollm2 = AutoTokenizer.from_pretrained(ensure_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = getattr(config, "text_config", config)
    extra = 4 if family in VISION_TWINS else 0  # the vision tokens (<|vision_start|>, <|image_pad|>, ...)
    assert len(tokenizer) == len(smollm2) + extra and text.vocab_size == len(tokenizer)
    assert all(tokenizer.convert_tokens_to_ids(t) == i for t, i in smollm2.get_vocab().items())
    assert (text.eos_token_id, text.pad_token_id) == (smollm2.eos_token_id, smollm2.pad_token_id)
    if family == "deepseek-v4":  # the hash router's table: distinct experts per token id, every expert in use
        table = model.model.layers[0].mlp.gate.tid2eid
        assert (table[:, 0] != table[:, 1]).all() and table.unique().tolist() == list(range(8))
    if family not in DENSE_TWINS:  # routers drawn with std 1, so tokens of one prompt go to different experts
        router = next(p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
        assert 0.8 < float(router.detach().std()) < 1.2


def test_an_unknown_family_is_refused_naming_the_families(tmp_path):
    with pytest.raises(
        ValueError, match=r"no tiny twin of family 'llama4'; families: \['deepseek-v3', 'deepseek-v4', 'glm-5'"
    ):
        ensure_tiny("llama4", tmp_path)


def test_a_list_of_bases_composes_left_to_right_and_a_type_switch_replaces_the_section(tmp_path):
    (tmp_path / "model.yaml").write_text(
        "engine: {type: sglang, num_servers: 2, routed_experts: true}\ntrain: {lr: 1.0}\n"
        "tiny: {engine: {type: embedded, dtype: fp32}, train: {lr: 3.0}}\n"
    )
    (tmp_path / "algo.yaml").write_text("train: {lr: 2.0, grad_clip: 0.5}\ntiny: {train: {grad_clip: 9.0}}\n")
    (tmp_path / "recipe.yaml").write_text("base: [model.yaml, algo.yaml]\ntrain: {micro_batch_size: 3}\n")
    recipe = str(tmp_path / "recipe.yaml")
    assert load_recipe(recipe) == {
        "engine": {"type": "sglang", "num_servers": 2, "routed_experts": True},
        "train": {"lr": 2.0, "grad_clip": 0.5, "micro_batch_size": 3},  # algo after model, the recipe last
    }
    assert load_recipe(recipe, tiny=True) == {
        "engine": {"type": "embedded", "dtype": "fp32"},  # another type: the sglang fields do not carry over
        "train": {"lr": 3.0, "grad_clip": 9.0, "micro_batch_size": 3},
    }
    assert merge_recipe({"reward": {"type": "math", "x": 1}}, {"reward": {"x": 2}}) == {
        "reward": {"type": "math", "x": 2}
    }
    # a type over a base that names none merges (as command-line overrides do): the base's fields stay
    assert merge_recipe({"engine": {"max_batch_size": 8}}, {"engine": {"type": "embedded"}}) == {
        "engine": {"max_batch_size": 8, "type": "embedded"}
    }


def test_a_base_cycle_through_a_list_is_named(tmp_path):
    (tmp_path / "a.yaml").write_text("base: [b.yaml]\n")
    (tmp_path / "b.yaml").write_text("base: [a.yaml]\n")
    with pytest.raises(ValueError, match=r"base chain .*a.yaml -> .*b.yaml -> .*a.yaml is a cycle"):
        load_recipe(str(tmp_path / "a.yaml"))


@pytest.mark.parametrize("name", sorted(FRONTIER))
def test_frontier_recipes_validate_for_gpus_and_as_tiny_twins(name):
    path, twin, backend, base, layout = FRONTIER[name]
    assert recipe_bases(name) == [f"bases/model/{base}", "bases/algo/grpo", "bases/task/gsm8k"]
    routed = name not in DENSE
    gpu = resolve_config(name, [])
    assert (gpu.models.policy.path, gpu.engine.type, gpu.engine.routed_experts) == (path, "sglang", routed)
    assert (gpu.train.dtype, gpu.execution.mode, gpu.data.source, gpu.reward.type) == ("bf16", "ray", "file", "math")
    tiny = resolve_config(name, [], tiny=True)
    assert (tiny.models.policy.path, tiny.engine.type, tiny.engine.routed_experts) == (twin, "embedded", routed)
    assert (tiny.train.backend, tiny.train.dtype, tiny.execution.mode) == (backend, "fp32", "local")
    assert gpu.train.batch_layout == tiny.train.batch_layout == layout
    # Kimi's tokenizer is its checkpoint's own code (tokenization_kimi.py); Miles' twins are not
    assert (gpu.models.policy.trust_remote_code, tiny.models.policy.trust_remote_code) == (
        name.startswith("kimi"),
        False,
    )
    assert (
        gpu.train.freeze_vision_tower
        == tiny.train.freeze_vision_tower
        == name.startswith(("qwen3_5", "qwen3_6", "kimi_k2_5", "kimi_k2_6"))
    )
    assert (tiny.data.source, tiny.loop.num_steps, tiny.rollout.rollout_batch_size) == ("reasoning_gym", 2, 2)
    assert tiny.algorithm.loss.clip_high == gpu.algorithm.loss.clip_high == 0.28  # the algorithm base, unchanged


def test_tiny_needs_a_tiny_section_and_a_new_run(capsys):
    assert set(FRONTIER) <= set(tiny_recipe_names())
    assert "smollm2_grpo_arithmetic" not in tiny_recipe_names()
    assert main(["train", "--recipe", "smollm2_grpo_arithmetic", "--tiny"]) == 2
    assert "has no tiny twin (no `tiny:` section); --tiny works with" in capsys.readouterr().err
    assert main(["train", "--recipe", "kimi_k2_grpo_gsm8k", "--tiny", "--resume", "x"]) == 2
    assert "--tiny starts a new run" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (  # the recipe says padded; packed on this twin is refused before anything loads
            ["--train.batch-layout", "packed"],
            "train.batch_layout packed: transformers' DeepSeek-V4 compressed attention does not keep packed "
            "sequences apart; set --train.batch-layout padded",
        ),
        (  # a dense model has nothing to record (was a traceback from the engine)
            ["--models.policy.path", "tiny-qwen3"],
            "engine.routed_experts is true but models.policy.path (",
        ),
        (  # a setting of a part the model does not have (was accepted silently)
            ["--train.freeze-vision-tower", "true"],
            "train.freeze_vision_tower is true but models.policy.path (",
        ),
    ],
)
def test_what_a_twin_cannot_run_is_refused_in_one_line_before_any_model_loads(override, message, tmp_path, capsys):
    args = ["train", "--recipe", "deepseek_v4_flash_grpo_gsm8k", "--tiny", "--run.dir", str(tmp_path), *override]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # no run directory: refused before the run started


def test_recipes_show_prints_the_composition_and_the_merged_recipe(capsys):
    assert main(["recipes", "show", "kimi_k2_grpo_gsm8k", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert "# composes: bases/model/kimi_k2 + bases/algo/grpo + bases/task/gsm8k" in out
    assert "#   train:\n#     world_size: 256   # ~16 bytes per parameter for full fine-tuning" in out  # a base's note
    assert yaml.safe_load(out) == load_recipe("kimi_k2_grpo_gsm8k", tiny=True)
    assert main(["recipes", "list"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert listed["kimi_k2_grpo_gsm8k"].endswith("[--tiny]")
    assert not listed["smollm2_grpo_arithmetic"].endswith("[--tiny]")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[] if n == "kimi_k2_grpo_gsm8k" else [pytest.mark.slow])
        for n in sorted(set(FRONTIER) - SAME_TWIN)
    ],
)
def test_each_tiny_twin_runs_its_recipes_loop_with_routing_replay(name, tmp_path, monkeypatch):
    """2 GRPO steps of the recipe on its twin (Kimi K2's on Megatron: MLA, the sigmoid router, R3), with a
    response-length reward so groups have a spread (a random twin scores 0 on arithmetic): the trainer takes steps
    and replays the engine's experts, so after the step-1 push engine and trainer log-probs agree."""
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    args = ["--reward.type", "custom", "--reward.path", "reward_plugins:text_length", "--eval.num-prompts", "0"]
    args += ["--rollout.rollout-batch-size", "4", "--rollout.n-samples-per-prompt", "4"]
    args += ["--run.dir", str(tmp_path), "--run.name", "tiny"]
    assert main(["train", "--recipe", name, "--tiny", *args]) == 0
    rows = [json.loads(line) for line in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 and r["samples/failed"] == 0 for r in rows), rows
    if name == "glm_5_grpo_gsm8k":
        # GLM-5's DSA indexer keeps the top index_topk (8) keys per query: its ReLU scores tie at 0, and the engine's
        # decode and the trainer's full forward break the ties differently (measured gap 4.6e-3 padded, 2.4e-2
        # packed; 0 with index_topk 2048 >= every length): engine-trainer agreement for DSA needs the indexer's
        # choices replayed too, which nothing does yet
        assert rows[1]["train_rollout_logprob_abs_diff"] < 0.1, rows
    else:
        assert rows[1]["train_rollout_logprob_abs_diff"] < 1e-4, rows


def test_a_failed_build_publishes_nothing_and_leaves_no_temporary_directory(tmp_path):
    from miles.recipes.models.cache import publish_model_dir

    def build(tmp):
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish_model_dir(tmp_path / "model", build)
    assert list(tmp_path.iterdir()) == []
    published = publish_model_dir(tmp_path / "model", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert published == tmp_path / "model" and [p.name for p in tmp_path.iterdir()] == ["model"]
