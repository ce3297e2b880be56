"""Recipes compose: a recipe names a ``base`` and gives its differences (deep merge, ``null`` turns a section off).
The shipped algorithm variants are the GRPO recipe plus overrides, and each resolves to exactly the values its
stand-alone flat-layout copy resolved to before the nested config."""

from pathlib import Path

import pytest
import yaml
from miles.recipes.cli import resolve_config
from miles.recipes.registry import commented_lines, load_recipe, merge_recipe, recipe_files, recipe_names
from miles.rollout.config import ProbeConfig

FLAT = yaml.safe_load((Path(__file__).parent / "flat_resolved_configs.yaml").read_text())
# Shipped recipes added after the nested config: they have no flat predecessor.
NESTED_ONLY = {
    "smollm2_grpo_multiturn_calculator",
    "smollm2_grpo_code",
    "qwen3_30b_a3b_grpo_gsm8k",  # the frontier recipes, composed from bases/ (tests/recipes/test_tiny_twins.py)
    "kimi_k2_grpo_gsm8k",
    "kimi_k2_5_grpo_gsm8k",
    "kimi_k2_6_grpo_gsm8k",
    "glm_5_grpo_gsm8k",
    "glm_5_1_grpo_gsm8k",
    "deepseek_v4_flash_grpo_gsm8k",
    "qwen3_5_35b_a3b_grpo_gsm8k",
    "qwen3_6_35b_a3b_grpo_gsm8k",
    "qwen3_5_27b_grpo_gsm8k",
    "qwen3_vl_2b_grpo_visual",
    "tiny_qwen3_vl_grpo_visual",  # vision-language RL (tests/recipes/test_vlm_run.py)
    "tiny_flow_grpo_compressibility",  # diffusion (tests/recipes/test_diffusion_run.py)
    "tiny_flow_nft_compressibility",
    "sd35_medium_flow_grpo_compressibility",
    "qwen_image_flow_grpo_compressibility",
    "smollm2_vl_grpo_visual",
}
# Changed on purpose since: the OPD recipe named the policy as its teacher (every advantage 0); now its user passes one.
TEACHER = "/models/stronger-teacher"
REQUIRED = {"smollm2_opd_arithmetic": ["--models.teacher.path", TEACHER]}


def _nested(flat: dict) -> dict:
    """A flat-layout resolved config as the nested tree: every value kept; a feature whose flat switch was off
    (kl_coef 0, importance_sampling none without opsm, dynamic_sampling false, no critic or teacher) becomes a
    null section, dropping the settings it did not read."""
    a = flat["algorithm"]
    gae = a["advantage_estimator"] == "gae" and not a["advantage_estimator_path"]
    tree = {key: value for key, value in flat.items() if key not in ("model", "algorithm", "loop")}
    no_code = {"trust_remote_code": False}  # models.*.trust_remote_code: added later, off
    critic = {"path": a["critic_path"], "lr": a["critic_lr"], "value_clip": a["value_clip"], **no_code}
    teacher = {"path": a["teacher_path"], "temperature": a["teacher_temperature"], **no_code}
    tree["models"] = {
        "policy": {"path": flat["model"]["path"], **no_code},
        "reference": {"path": "", **no_code},  # the flat layout's reference was always the initial policy
        "critic": critic if gae else None,
        "teacher": teacher if a["teacher_path"] else None,
    }
    correction = a["importance_sampling"] != "none" or a["opsm"]
    tree["algorithm"] = {
        "advantage": {
            "estimator": a["advantage_estimator"],
            "estimator_path": a["advantage_estimator_path"],
            "eps": a["advantage_eps"],
            "gamma": a["gamma"],
            "lam": a["lam"],
        },
        "loss": {
            "policy_loss": a["policy_loss"],
            "policy_loss_path": a["policy_loss_path"],
            "reducer_path": a["loss_reducer_path"],
            "clip_low": a["clip_low"],
            "clip_high": a["clip_high"],
            "dual_clip_c": a["dual_clip_c"],
            "aggregation": a["aggregation"],
            "entropy_coef": a["entropy_coef"],
        },
        "kl": {"coef": a["kl_coef"], "estimator": a["kl_estimator"], "mode": a["kl_mode"]} if a["kl_coef"] else None,
        "rollout_correction": {
            "importance_sampling": a["importance_sampling"],
            "level": a["importance_level"],
            "lower": a["importance_lower"],
            "upper": a["importance_upper"],
            "opsm": a["opsm"],
            "opsm_threshold": a["opsm_threshold"],
        }
        if correction
        else None,
        "dynamic_sampling": {
            "max_rounds": a["dynamic_sampling_max_rounds"],
            "over_sample": a["dynamic_sampling_over_sample"],
            "filter_path": a["dynamic_sampling_filter_path"],
        }
        if a["dynamic_sampling"]
        else None,
        "overlong": {
            "filter": a["overlong_filter"],
            "buffer_len": a["overlong_buffer_len"],
            "penalty_factor": a["overlong_penalty_factor"],
        },
        "reward_post_process_path": a["reward_post_process_path"],
        "buffer_filter_path": "",  # added later, like the other extension points below: off
    }
    # Added after the flat layout, at their defaults: resubmits, the generate plugin key, the multi-turn section.
    multi_turn = {"max_turns": 4, "max_response_tokens": 256, "tool_timeout_s": 30.0}
    multi_turn |= {"tools": ["miles.rollout.calculator:calculator"]}
    multi_turn |= {"few_shot": [], "chat_template_kwargs": {}}
    multi_turn |= {"agent_path": "", "agent_timeout_s": None}  # added later: no agent, no limit
    tree["rollout"] = {**flat["rollout"], "max_resubmits": 2, "generate_path": "", "multi_turn": multi_turn}
    tree["rollout"] |= {"sample_hook_path": ""}
    tree["data"] = {**flat["data"], "source_path": "", "mixture": [], "image_key": ""}  # added later: off
    tree["eval"] = {**flat["eval"], "path": "", "pass_k": [1], "pass_threshold": 1.0, "sets": []}
    ray = {"address": None, "num_cpus": None, "log_to_driver": True, "namespace": None}
    ray |= {"trainer_cpus_per_rank": 1.0, "placement_strategy": "PACK", "colocate": False, "max_trainer_restarts": 0}
    ray |= {"engine_cpus_per_server": 0.0, "engine_gpus_per_server": 0.0}  # engine bundles: added later, off
    tree["execution"] = {"mode": "local", "ray": ray}  # execution.ray: added after the flat layout, at its defaults
    async_defaults = {
        "max_weight_staleness": None, "partial_rollout": False, "stale_groups": "regenerate",
        "mask_stale_segments": False,
    }  # fmt: skip
    tree["loop"] = {"mode": "sync", **async_defaults, **flat["loop"]}  # the async loops' fields, at their defaults
    tree["reward"] = {**flat["reward"], "workers": 0, "memory_limit_mib": None}  # the reward pool's, at defaults
    probe = {"tokens": 16, "max_abs_diff": None, "prompt": ProbeConfig().prompt}  # the weight probe: added later
    tree["engine"] = {**flat["engine"], "delta_weights": False, "probe": probe}  # delta updates: added later, off
    tree["engine"] |= {"routed_experts": False}  # routing replay (R3): added later, off
    tree["engine"] |= {"weight_codec": "identity"}  # quantized rollout: added later, off
    tree["run"] = {**flat["run"], "tensorboard": False, "wandb": None}  # TensorBoard, W&B: added later, off
    tree["reward"] |= {"group_path": ""}
    code = {"time_limit_s": 5.0, "memory_limit_mib": 1024}  # reward.type code and remote: added later, at defaults
    remote = {"url": "", "score_key": "score", "timeout_s": 30.0, "max_retries": 3, "backoff_s": 0.5}
    tree["reward"] |= {"code": code, "remote": remote}
    tree["run"] |= {"hooks": [], "sinks": []}
    tree["train"] = {  # added later: LoRA off (full fine-tuning), the FSDP2 backend
        **flat["train"],
        "lora": None,
        "backend": "fsdp2",
        "freeze_vision_tower": False,
        "qat": "none",
        "fp16_initial_loss_scale": 65536.0,
        "megatron": {
            "tensor_parallel_size": 1,
            "expert_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "context_parallel_size": 1,
        },
    }
    return tree


def test_the_flat_snapshot_covers_every_shipped_recipe():
    assert sorted(FLAT) == sorted(set(recipe_names()) - NESTED_ONLY)


@pytest.mark.parametrize("name", sorted(FLAT))
def test_each_shipped_recipe_resolves_to_its_flat_predecessor_field_for_field(name):
    expected = _nested(FLAT[name])
    if name in REQUIRED:
        expected["models"]["teacher"]["path"] = TEACHER
    got = resolve_config(name, REQUIRED.get(name, [])).model_dump(mode="json")
    assert got.keys() == expected.keys()
    for section in expected:
        assert got[section] == expected[section], section


@pytest.mark.parametrize("name", [n for n in sorted(FLAT) if n.endswith("_arithmetic") and "_grpo_" not in n])
def test_the_algorithm_variants_are_the_grpo_recipe_plus_overrides(name):
    from importlib import resources

    text = (resources.files("miles.recipes") / "recipes" / f"{name}.yaml").read_text()
    raw = yaml.safe_load(text)
    assert raw["base"] == "smollm2_grpo_arithmetic"
    assert set(raw) - {"description", "base"} <= {"models", "rollout", "algorithm"}, sorted(raw)


def test_a_recipe_overrides_its_base_deeply_and_null_turns_a_section_off(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "base: smollm2_dapo_arithmetic\n"
        "algorithm:\n  loss: {clip_high: 0.3}\n  dynamic_sampling: null\n"
        "data:\n  task_kwargs: {max_digits: 2}\n"
    )
    (tmp_path / "child.yaml").write_text(
        "description: a file base, relative to this file\nbase: mine.yaml\nloop: {num_steps: 3}\n"
    )
    cfg = resolve_config(str(tmp_path / "child.yaml"), ["--algorithm.loss.entropy-coef", "0.01"])
    dapo = resolve_config("smollm2_dapo_arithmetic", [])
    loss = cfg.algorithm.loss
    assert (loss.clip_high, loss.dual_clip_c, loss.entropy_coef) == (0.3, 3.0, 0.01)  # merged key by key
    assert cfg.algorithm.dynamic_sampling is None and dapo.algorithm.dynamic_sampling is not None
    assert cfg.algorithm.overlong == dapo.algorithm.overlong and cfg.loop.num_steps == 3
    assert cfg.data.task_kwargs == {**dapo.data.task_kwargs, "max_digits": 2}


def test_a_base_cycle_is_a_clear_error(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ValueError, match=r"base chain .*a.yaml -> .*b.yaml -> .*a.yaml is a cycle"):
        load_recipe(str(tmp_path / "a.yaml"))


def test_merge_replaces_lists_and_scalars_and_merges_mappings():
    base = {"a": {"b": 1, "c": [1, 2]}, "d": {"e": 1}}
    assert merge_recipe(base, {"a": {"c": [3]}, "d": None}) == {"a": {"b": 1, "c": [3]}, "d": None}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": {"e": 1}}  # the base is not changed


def test_commented_lines_keep_each_comment_with_the_keys_that_place_it():
    text = (
        'description: "Kimi\'s # not a comment"\n'
        "# a note on the model\n"
        "models:\n"
        "  policy: {path: x}\n"
        "train:\n"
        "  lr: 1.0e-6\n"
        "  world_size: 8   # 16 bytes a parameter\n"
        "rollout:\n"
        "  # the group size\n"
        "  n_samples_per_prompt: 8\n"
        "  label: it's # a comment after a plain scalar's apostrophe\n"
    )
    assert commented_lines(text) == [
        "# a note on the model",
        "models:",  # the key under the note
        "train:",  # the parent of a commented line
        "  world_size: 8   # 16 bytes a parameter",
        "rollout:",
        "  # the group size",
        "  n_samples_per_prompt: 8",
        "  label: it's # a comment after a plain scalar's apostrophe",
    ]


def test_recipe_files_are_its_bases_depth_first_then_itself_each_once(tmp_path):
    (tmp_path / "shared.yaml").write_text("# shared\nloop: {num_steps: 1}\n")
    (tmp_path / "a.yaml").write_text("base: shared.yaml\n")
    (tmp_path / "top.yaml").write_text("base: [a.yaml, shared.yaml]\n# mine\n")
    labels = [Path(label).name for label, _ in recipe_files(str(tmp_path / "top.yaml"))]
    assert labels == ["shared.yaml", "a.yaml", "top.yaml"]
    assert [label for label, _ in recipe_files("kimi_k2_grpo_gsm8k")] == [
        "recipes/bases/model/kimi_k2.yaml",
        "recipes/bases/algo/grpo.yaml",
        "recipes/bases/task/gsm8k.yaml",
        "recipes/kimi_k2_grpo_gsm8k.yaml",
    ]


def test_recipes_show_prints_the_recipe_files_comments_and_still_loads_as_the_merged_recipe(capsys):
    from miles.recipes.cli import main

    assert main(["recipes", "show", "sd35_medium_flow_grpo_compressibility"]) == 0
    out = capsys.readouterr().out
    assert "# recipes/sd35_medium_flow_grpo_compressibility.yaml, its comments:" in out
    assert "#   # Memory: the 2.5 B transformer in fp32 (10 GB) and its bf16 rollout copy (5 GB)" in out
    assert "# merged (what miles train starts from):" in out
    assert yaml.safe_load(out) == load_recipe("sd35_medium_flow_grpo_compressibility")
