"""Agent rollouts (rollout.multi_turn.agent_path): the factory is selected and checked from the config, each sample is
one session an agent drives over HTTP (async or sync agents), an agent that raises fails only its sample, the server
listens only while groups are generated, and the example agent trains through the real loop on the tiny model."""

import math
import sys
import threading
from pathlib import Path

import pytest
from miles.core.buffer import generate_samples, sample_seed
from miles.core.config import RolloutConfig, SamplingConfig
from miles.core.protocols import GenerateOutput
from miles.core.sample import Sample, SampleStatus
from miles.rollout.generate_factory import (
    GenerateContext,
    build_generate_fn,
    generate_factory_path,
    load_generate_factory,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))  # agent_plugins, named by module:attr below
IM_END = 2


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


class EchoEngine:
    """Answers every request with ids [28, <|im_end|>]; records the requests."""

    weight_version = 0

    def __init__(self):
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        return GenerateOutput([28, IM_END], [-0.5, -0.1], "stop")


def agent_rollout(agent_path, engine, tokenizer, **multi_turn):
    rollout = RolloutConfig(mode="multi_turn", multi_turn={"agent_path": agent_path, **multi_turn})
    return build_generate_fn(rollout, GenerateContext(engine=engine, tokenizer=tokenizer, rollout=rollout))


def sessions_running():
    return any(t.name == "miles-sessions" for t in threading.enumerate())


def test_an_agent_path_selects_the_agent_factory_and_a_bad_one_fails_naming_the_key():
    rollout = RolloutConfig(mode="multi_turn", multi_turn={"agent_path": "agent_plugins:two_turns"})
    assert generate_factory_path(rollout) == "miles.rollout.agents:build_agent_generate"
    assert callable(load_generate_factory(rollout))
    with pytest.raises(AttributeError, match="^rollout.multi_turn.agent_path: module 'agent_plugins' has no"):
        load_generate_factory(rollout.model_copy(update={"multi_turn": rollout.multi_turn.model_copy(
            update={"agent_path": "agent_plugins:nope"})}))  # fmt: skip
    with pytest.raises(ValueError, match="rollout.multi_turn.few_shot is .* but rollout.multi_turn.agent_path is set"):
        RolloutConfig(
            mode="multi_turn", multi_turn={"agent_path": "a:b", "few_shot": [{"role": "user", "content": "x"}]}
        )
    with pytest.raises(ValueError, match="rollout.multi_turn.agent_path is 'a:b' but rollout.mode is 'generate'"):
        RolloutConfig(multi_turn={"agent_path": "a:b"})


@pytest.mark.parametrize("agent, num_turns", [("agent_plugins:two_turns", 2), ("agent_plugins:sync_one_turn", 1)])
def test_each_sample_is_one_session_its_agent_drives(tokenizer, agent, num_turns):
    engine = EchoEngine()
    generate_group = agent_rollout(agent, engine, tokenizer)
    samples = generate_samples(
        [Sample(index=0, group_index=7, prompt="What is 2 + 3?", label="5")], generate_group, n_samples_per_prompt=2,
        sampling=SamplingConfig(max_new_tokens=8), seed=3,
    )  # fmt: skip
    assert [(s.index, s.group_index, s.label) for s in samples] == [(0, 7, "5"), (1, 7, "5")]
    assert not sessions_running()  # the server stops with the last group
    assert sorted(r.seed for r in engine.requests) == sorted(
        sample_seed(sample_seed(3, j), k) for j in range(2) for k in range(num_turns)
    )
    for sample in samples:
        assert sample.status == SampleStatus.COMPLETED and sample.metadata["num_turns"] == num_turns
        assert sample.loss_mask.count(1) == 2 * num_turns and sample.rollout_log_probs.count(-0.5) == num_turns
        assert sample.response_tokens[-2:] == [28, IM_END] and sample.response_text == tokenizer.decode([28])


def test_an_agent_that_raises_fails_only_its_sample_and_the_server_restarts_for_the_next_group(tokenizer):
    generate_group = agent_rollout("agent_plugins:raises", EchoEngine(), tokenizer)
    prompts = [Sample(index=0, group_index=0, prompt="Hi")]
    for _ in range(2):  # each call its own event loop (as eval's): the server starts and stops each time
        [sample] = generate_samples(prompts, generate_group, n_samples_per_prompt=1, sampling=SamplingConfig(), seed=0)
        assert (sample.status, sample.metadata["failure"]) == (
            SampleStatus.FAILED,
            "the agent raised RuntimeError: boom",
        )
        assert (sample.response_length, sample.loss_mask, sample.rollout_log_probs) == (0, None, [])
        assert sample.tokens and not sessions_running()


def test_the_example_agent_trains_through_the_real_loop_with_exact_ids_and_masks(tiny_smollm2_dir, tmp_path,
                                                                                  monkeypatch, tokenizer):  # fmt: skip
    """2 steps of GRPO on the tiny model, each sample one session of examples/plugins/session_agent.py: the random
    model calls no tool, so each sample is turn 1, the agent's check message (mask 0), turn 2."""
    import agent_plugins
    from miles.recipes.cli import resolve_config
    from miles.recipes.run import run

    monkeypatch.syspath_prepend(str(ROOT / "examples" / "plugins"))
    from session_agent import CHECK

    agent_plugins.SAMPLES.clear()
    cfg = resolve_config(
        "smollm2_grpo_arithmetic",
        [
            "--models.policy.path", str(tiny_smollm2_dir),
            "--loop.num-steps", "2", "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "2",
            "--rollout.sampling.max-new-tokens", "4", "--train.micro-batch-size", "8", "--run.progress", "false",
            "--eval.num-prompts", "1", "--eval.n-samples-per-prompt", "1", "--eval.sampling.max-new-tokens", "4",
            "--algorithm.dynamic-sampling", "null",
            "--rollout.mode", "multi_turn", "--rollout.multi-turn.agent-path", "session_agent:agent",
            "--rollout.sample-hook-path", "agent_plugins:record_sample",
        ],
    )  # fmt: skip
    assert run(cfg, tmp_path / "run").steps_done == 2
    assert not sessions_running()
    records = agent_plugins.SAMPLES
    assert len(records) >= 8  # 2 steps x 2 prompts x 2 samples, and the eval samples
    for record in records:
        assert record["status"] in ("completed", "truncated") and record["num_turns"] == 2
        roles = [m["role"] for m in record["messages"]]
        assert roles[-3:] == ["assistant", "user", "assistant"] and record["messages"][-2]["content"] == CHECK
        prompt_messages = record["messages"][: len(roles) - 3]
        prompt = tokenizer(tokenizer.apply_chat_template(prompt_messages, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]  # fmt: skip
        tokens, mask, log_probs = record["tokens"], record["loss_mask"], record["rollout_log_probs"]
        assert tokens[: len(prompt)] == prompt and len(tokens) == len(prompt) + record["response_length"]
        assert len(mask) == len(log_probs) == record["response_length"]
        first = mask.index(0)
        second = first + mask[first:].index(1)
        assert mask == [1] * first + [0] * (second - first) + [1] * (len(mask) - second)  # model, check, model
        glue = "\n" if tokens[len(prompt) + first - 1] == IM_END else "<|im_end|>\n"
        check = f"{glue}<|im_start|>user\n{CHECK}<|im_end|>\n<|im_start|>assistant\n"
        assert (
            tokens[len(prompt) + first : len(prompt) + second]
            == tokenizer(check, add_special_tokens=False)["input_ids"]
        )
        assert all(math.isfinite(v) and v <= 0.0 if m else v == 0.0 for v, m in zip(log_probs, mask))


@pytest.mark.parametrize("agent", ["agent_plugins:sync_hangs", "agent_plugins:async_hangs"])
def test_an_agent_past_its_timeout_fails_its_sample_and_the_round_ends_while_it_still_hangs(tokenizer, agent):
    import time

    import agent_plugins

    agent_plugins.RELEASE.clear()
    generate_group = agent_rollout(agent, EchoEngine(), tokenizer, agent_timeout_s=0.5)
    started = time.monotonic()
    samples = generate_samples(
        [Sample(index=0, group_index=0, prompt="Hi")], generate_group, n_samples_per_prompt=2,
        sampling=SamplingConfig(max_new_tokens=8), seed=0,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    try:
        assert elapsed < 10  # the sync agent's thread still blocks (up to 60 s): the round did not wait for it
        for sample in samples:
            assert (sample.status, sample.metadata["failure"]) == (
                SampleStatus.FAILED,
                "the agent ran past rollout.multi_turn.agent_timeout_s (0.5 s)",
            )
            assert (sample.response_length, sample.loss_mask) == (0, None)
        assert not sessions_running()
    finally:
        agent_plugins.RELEASE.set()


def test_an_agent_timeout_without_an_agent_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match="rollout.multi_turn.agent_timeout_s is set but rollout.multi_turn.agent_path"):
        RolloutConfig(mode="multi_turn", multi_turn={"agent_timeout_s": 5})
