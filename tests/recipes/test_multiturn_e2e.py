"""End to end: `miles train` on the multi-turn calculator recipe with the real SmolLM2-135M-Instruct and the embedded
engine, 2 small steps; every scored sample (training and eval) is checked token by token: the prompt is the
template's rendering, model turns carry mask 1 and the engine's log-probs, and every run of masked ids is exactly
the template's rendering of that turn's tool results."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import REPO

IM_END = 2  # SmolLM2's <|im_end|>


def runs(values, mask):
    """Split ``values`` into maximal runs of equal mask: [(mask value, [values])]."""
    out = []
    for value, m in zip(values, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(value)
        else:
            out.append((m, [value]))
    return out


def check_sample(record, renderer, rollout):
    """Token/mask/log-prob alignment of one sample against the chat template (see the module docstring)."""
    n, mask, log_probs = record["response_length"], record["loss_mask"], record["rollout_log_probs"]
    assert len(mask) == len(log_probs) == n > 0
    prompt = rollout.prompt_tokens(record["prompt"])
    tokens = record["tokens"]
    assert len(tokens) == len(prompt) + n and tokens[: len(prompt)] == prompt
    id_runs, log_prob_runs = runs(tokens[len(prompt) :], mask), runs(log_probs, mask)
    assert [m for m, _ in id_runs] == [1, 0] * (len(id_runs) // 2) + [1]  # model, tools, ..., model
    model_runs, env_runs = [r for m, r in id_runs if m], [r for m, r in id_runs if not m]
    assert len(model_runs) == record["num_turns"]
    for m, values in log_prob_runs:
        assert all(v == 0.0 for v in values) if not m else all(math.isfinite(v) and v <= 0.0 for v in values)
    messages = record["messages"]
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    assert len(turns) == len(model_runs)
    for k, start in enumerate(turns):  # each model run is what the engine sampled, decoded as the turn's text
        assert renderer.tokenizer.decode(model_runs[k], skip_special_tokens=True) == messages[start]["content"]
    for k, ids in enumerate(env_runs):  # each environment run: the glue, this turn's tool results, the next header
        tool_messages = messages[turns[k] + 1 : turns[k + 1]]
        assert tool_messages and all(m["role"] == "tool" for m in tool_messages)
        assert model_runs[k][-1] == IM_END
        assert ids == renderer.suffix_tokens(tool_messages, last_token=model_runs[k][-1])


@pytest.mark.e2e
@pytest.mark.slow  # ~3.5 min on 2 idle cores (a ~250-token few-shot prompt per turn): the slow CI step
def test_two_steps_of_the_multi_turn_calculator_recipe_keep_tokens_masks_and_log_probs_aligned(smollm2_dir, tmp_path):
    from miles.recipes.cli import resolve_config
    from miles.rollout.multiturn import MultiTurnRollout
    from miles.rollout.tools import load_tools
    from transformers import AutoTokenizer

    overrides = [
        "--loop.num-steps", "2", "--rollout.rollout-batch-size", "2", "--rollout.n-samples-per-prompt", "2",
        "--rollout.multi-turn.max-response-tokens", "128",  # the recipe's 48 tokens a turn: a call fits in one
        "--eval.num-prompts", "1", "--eval.n-samples-per-prompt", "2",
        "--reward.path", "multiturn_recorder:recording_reward", "--run.progress", "false",
    ]  # fmt: skip
    samples_file = tmp_path / "samples.jsonl"
    env = {**os.environ, "MILES_TEST_SAMPLES": str(samples_file)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "miles.recipes.cli", "train", "--recipe", "smollm2_grpo_multiturn_calculator",
           *overrides, "--run.dir", str(tmp_path), "--run.name", "e2e"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]

    rows = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["samples/failed"] for r in rows[1:]] == [0.0, 0.0]
    assert [rows[0]["eval/failed"], rows[2]["eval/failed"]] == [0.0, 0.0]
    assert [r["weight_version"] for r in rows[1:]] == [1.0, 2.0]
    # Step 2 sampled with the weights pushed after step 1: engine and trainer agree on every trained (model) token;
    # a tool or glue id left in the loss, or a log-prob one position off, would be far from 0 here.
    assert rows[2]["train_rollout_logprob_abs_diff"] < 1e-4

    cfg = resolve_config("smollm2_grpo_multiturn_calculator", overrides)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    rollout = MultiTurnRollout(
        None, tokenizer, config=cfg.rollout.multi_turn, tools=load_tools(cfg.rollout.multi_turn.tools)
    )
    records = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(records) == 2 * 2 * 2 + 2 * 1 * 2  # 2 steps of 2 x 2, evals before and after of 1 x 2: all scored
    for record in records:
        check_sample(record, rollout.renderer, rollout)
    assert sum(r["num_turns"] > 1 for r in records) >= 2, "too few tool calls: the checks above saw single turns"
