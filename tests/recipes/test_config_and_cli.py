import pytest
import yaml
from miles.recipes.cli import main, resolve_config
from miles.recipes.config import MilesConfig
from miles.recipes.overrides import apply_overrides, parse_overrides
from miles.recipes.registry import load_recipe, recipe_names
from pydantic import BaseModel


def test_overrides_parse_dashes_to_underscores_and_values_as_yaml():
    assert parse_overrides(["--rollout.n-samples-per-prompt", "8", "--run.name=x", "--data.task-kwargs", "{a: 1}"]) == {
        "rollout.n_samples_per_prompt": 8,
        "run.name": "x",
        "data.task_kwargs": {"a": 1},
    }
    assert apply_overrides({"a": {"b": 1}}, {"a.c": 2, "d.e": 3}) == {"a": {"b": 1, "c": 2}, "d": {"e": 3}}


def test_an_override_without_value_is_a_clear_error():
    with pytest.raises(ValueError, match="--loop.num-steps has no value"):
        parse_overrides(["--loop.num-steps"])


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_validates(name, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    overrides = ["--data.path", str(data)] if load_recipe(name).get("data", {}).get("source") == "file" else []
    assert isinstance(resolve_config(name, overrides), MilesConfig)


def test_default_recipe_is_grpo_on_basic_arithmetic_with_8x8_rollouts():
    cfg = resolve_config("smollm2_grpo_arithmetic", [])
    assert cfg.data.task == "basic_arithmetic" and cfg.algorithm.advantage_estimator == "grpo"
    assert (cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt) == (8, 8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        pytest.param(["--rollout.n-samples-per-prompt", "1"], "needs at least 2", id="group_of_one"),
        pytest.param(["--rollout.global-batch-size", "7"], "not a multiple", id="batch_arithmetic"),
        pytest.param(["--rollout.sampling.top-p", "0.9"], "rollout.sampling.top_p is 0.9", id="top_p_in_training"),
        pytest.param(["--rollout.sampling.top-k", "50"], "rollout.sampling.top_k is 50", id="top_k_in_training"),
        pytest.param(
            ["--train.lrr", "1"],
            r"train.lrr \[--train.lrr\]: unknown key; valid keys here: lr, warmup_steps",
            id="unknown_key",
        ),
        pytest.param(["--train.lr", "fast"], r"train.lr \[--train.lr\].*got 'fast'", id="wrong_type"),
        pytest.param(["--algorithm.clip-high", "0.1"], "clip_high", id="clip_high_below_clip_low"),
        pytest.param(["--data.source", "file"], "data.path is empty", id="file_without_path"),
        pytest.param(
            ["--data.source", "file", "--data.path", "no/such.jsonl", "--reward.type", "math"],
            "data.path is 'no/such.jsonl', which is not a file",
            id="missing_data_file",
        ),
        pytest.param(
            ["--nosuch.key", "1"],
            r"nosuch \[--nosuch\]: unknown key; valid keys here: model, data",
            id="unknown_section",
        ),
        pytest.param(["--reward.type", "custom"], "--reward.path", id="custom_reward_without_path"),
        pytest.param(["--model.path", "/no/such/model"], r"model.path is '/no/such/model'", id="missing_model_path"),
        pytest.param(["--data.bad-rows", "ignore"], r"data.bad_rows \[--data.bad-rows\]", id="bad_rows_choice"),
        pytest.param(["--reward.timeout-s", "-1"], r"reward.timeout_s", id="negative_reward_timeout"),
        pytest.param(["--loop.keep-checkpoints", "-1"], r"loop.keep_checkpoints", id="negative_keep"),
    ],
)
def test_bad_configs_fail_before_anything_loads_with_the_key_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_config("smollm2_grpo_arithmetic", overrides)


def test_eval_sampling_may_use_top_p_and_top_k():
    cfg = resolve_config("smollm2_grpo_arithmetic", ["--eval.sampling.top-p", "0.95", "--eval.sampling.top-k", "20"])
    assert (cfg.eval.sampling.top_p, cfg.eval.sampling.top_k) == (0.95, 20)


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert main(["train", "--rollout.n-samples-per-prompt", "1"]) == 2
    assert "rollout.n_samples_per_prompt is 1" in capsys.readouterr().err


def test_cli_lists_recipes_and_shows_a_resolved_config(capsys):
    assert main(["recipes", "list"]) == 0
    assert "smollm2_grpo_arithmetic" in capsys.readouterr().out
    assert main(["config", "show", "smollm2_grpo_arithmetic", "--loop.num-steps", "3"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == resolve_config("smollm2_grpo_arithmetic", ["--loop.num-steps", "3"]).model_dump(mode="json")
    assert shown["loop"]["num_steps"] == 3


def test_unknown_recipe_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="smollm2_grpo_arithmetic"):
        load_recipe("nope")


def _undescribed(model: type[BaseModel], prefix: str = "") -> list[str]:
    missing = []
    for name, field in model.model_fields.items():
        if not field.description:
            missing.append(prefix + name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            missing += _undescribed(annotation, prefix + name + ".")
    return missing


def test_every_config_field_is_described():
    assert _undescribed(MilesConfig) == []


def test_model_path_must_be_registered_or_a_model_directory(tmp_path):
    from miles.recipes.registry import resolve_model_path

    with pytest.raises(ValueError, match="model.path"):
        resolve_model_path(str(tmp_path))
