"""Config of multi-turn rollouts: rollout.mode multi_turn, its rollout.multi_turn section and rollout.generate_path;
bad settings are one line naming the key, and plugin paths fail in build_inputs, before any model loads."""

import pytest
from miles.recipes.cli import resolve_config
from miles.recipes.run import RunSetupError, build_inputs

RECIPE = "smollm2_grpo_multiturn_calculator"


def test_the_calculator_recipe_runs_multi_turn_with_the_calculator_and_the_final_answer_reward():
    cfg = resolve_config(RECIPE, [])
    assert cfg.rollout.mode == "multi_turn" and cfg.rollout.generate_path == ""
    assert cfg.rollout.multi_turn.tools == ["miles.rollout.calculator:calculator"]
    assert (cfg.rollout.multi_turn.max_turns, cfg.rollout.multi_turn.max_response_tokens) == (3, 160)
    assert [m["role"] for m in cfg.rollout.multi_turn.few_shot] == ["user", "assistant", "tool", "assistant"] * 2
    assert cfg.reward.path == "miles.rollout.rewards.final_answer:final_answer_reward"
    assert cfg.data.task_kwargs["operators"] == ["+", "-", "*"]


@pytest.mark.parametrize(
    "recipe, overrides, keys",
    [
        pytest.param("smollm2_grpo_arithmetic", ["--rollout.multi-turn.max-turns", "2"],
                     ("rollout.multi_turn.max_turns is 2", "rollout.mode is 'generate'", "--rollout.mode multi_turn",
                      "--rollout.multi-turn.max-turns"), id="multi_turn_setting_without_the_mode"),
        pytest.param("smollm2_sft_arithmetic", ["--rollout.generate-path", "my.agent:build"],
                     ("rollout.generate_path is 'my.agent:build'", "rollout.mode is 'sft'", "--rollout.generate-path"),
                     id="generate_path_with_sft"),
        pytest.param("smollm2_grpo_arithmetic", ["--rollout.generate-path", "my_agent"],
                     ("rollout.generate_path is 'my_agent'", "module:attr"), id="generate_path_without_attr"),
        pytest.param(RECIPE, ["--algorithm.overlong.buffer-len", "8"],
                     ("algorithm.overlong.buffer_len is 8", "rollout.mode is 'multi_turn'",
                      "rollout.multi_turn.max_response_tokens", "--algorithm.overlong.buffer-len 0"),
                     id="overlong_penalty_with_multi_turn"),
        pytest.param(RECIPE, ["--rollout.multi-turn.max-turns", "0"], ("rollout.multi_turn.max_turns",),
                     id="no_turns"),
    ],
)  # fmt: skip
def test_a_bad_multi_turn_setting_is_one_line_naming_the_keys_and_the_fix(recipe, overrides, keys):
    with pytest.raises(ValueError) as err:
        resolve_config(recipe, overrides)
    message = str(err.value).removeprefix("invalid configuration:\n  ")
    assert "\n" not in message, message
    for key in keys:
        assert key in message, (key, message)


@pytest.mark.parametrize(
    "overrides, message",
    [
        pytest.param(["--rollout.multi-turn.tools", "[miles.rollout.calculator:calculate]"],
                     r"rollout.multi_turn.tools\[0\]: 'miles.rollout.calculator:calculate' is a function, not a",
                     id="tool_is_not_a_tool"),
        pytest.param(["--rollout.generate-path", "miles.rollout.nope:build"],
                     r"rollout.generate_path: cannot import module 'miles.rollout.nope'", id="factory_missing"),
    ],
)  # fmt: skip
def test_a_plugin_that_does_not_load_fails_in_build_inputs_naming_the_key(overrides, message):
    cfg = resolve_config(RECIPE, [*overrides, "--eval.num-prompts", "0", "--data.size", "8"])
    with pytest.raises(RunSetupError, match=message):
        build_inputs(cfg)
