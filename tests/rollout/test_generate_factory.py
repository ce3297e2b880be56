"""rollout.generate_path: a group-generate factory named module:attr, imported and checked at start-up (the
multi-turn rollout is the built-in one); the function it returns serves training and eval."""

import sys
from pathlib import Path

import pytest
from miles.core.buffer import generate_samples, sample_seed
from miles.core.config import RolloutConfig, SamplingConfig
from miles.core.sample import Sample
from miles.rollout.generate_factory import (
    GenerateContext,
    build_generate_fn,
    generate_factory_path,
    load_generate_factory,
)

sys.path.insert(0, str(Path(__file__).parent))  # generate_plugins, named by module:attr below


def context(rollout, tokenizer=None):
    return GenerateContext(engine=None, tokenizer=tokenizer, rollout=rollout)


def test_the_factory_is_the_plugin_else_the_built_in_one_of_the_mode():
    assert generate_factory_path(RolloutConfig()) is None  # single turn: ChatRollout, no factory
    assert generate_factory_path(RolloutConfig(mode="multi_turn")) == "miles.rollout.multiturn:build_multi_turn"
    mine = RolloutConfig(mode="multi_turn", generate_path="generate_plugins:build_echo")
    assert generate_factory_path(mine) == "generate_plugins:build_echo"
    assert load_generate_factory(RolloutConfig()) is None


def test_the_multi_turn_factory_builds_the_multi_turn_group_function(smollm2_dir):
    from miles.rollout.multiturn import MultiTurnRollout
    from transformers import AutoTokenizer

    generate_group = build_generate_fn(RolloutConfig(mode="multi_turn"), context(RolloutConfig(mode="multi_turn"),
                                       AutoTokenizer.from_pretrained(smollm2_dir)))  # fmt: skip
    assert isinstance(generate_group.__self__, MultiTurnRollout)
    assert list(generate_group.__self__.tools) == ["calculator"]


def test_a_plugin_function_runs_per_prompt_with_position_seeds():
    rollout = RolloutConfig(generate_path="generate_plugins:build_echo")
    generate_group = build_generate_fn(rollout, context(rollout))
    prompts = [Sample(index=0, group_index=5, prompt="a"), Sample(index=1, group_index=6, prompt="b")]
    samples = generate_samples(prompts, generate_group, n_samples_per_prompt=2, sampling=SamplingConfig(), seed=3)
    assert [(s.index, s.group_index) for s in samples] == [(0, 5), (1, 5), (2, 6), (3, 6)]
    assert [s.metadata["seed"] for s in samples] == [sample_seed(3, i) for i in range(4)]


@pytest.mark.parametrize(
    "path, error, message",
    [
        pytest.param("generate_plugins:nope", AttributeError, "rollout.generate_path: module 'generate_plugins' has no",
                     id="missing_attribute"),
        pytest.param("generate_plugins:two_arguments", TypeError,
                     "'generate_plugins:two_arguments' must accept 1 positional", id="signature"),
        pytest.param("generate_plugins:build_sync", TypeError, "returned a function, not an async group-generate",
                     id="not_async"),
        pytest.param("generate_plugins:build_without_seeds", TypeError, "must accept (prompt, *, n, sampling, seeds)",
                     id="missing_seeds"),
    ],
)  # fmt: skip
def test_a_bad_plugin_fails_at_start_up_naming_the_key(path, error, message):
    rollout = RolloutConfig(generate_path=path)
    with pytest.raises(error) as err:
        build_generate_fn(rollout, context(rollout))
    assert message in str(err.value)


def test_the_multi_turn_tools_are_checked_with_the_factory():
    rollout = RolloutConfig.model_validate({"mode": "multi_turn", "multi_turn": {"tools": ["miles.rollout:nope"]}})
    with pytest.raises(AttributeError, match=r"rollout.multi_turn.tools\[0\]: module 'miles.rollout' has no"):
        load_generate_factory(rollout)
