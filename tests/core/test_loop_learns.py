"""Learnability: the whole loop (embedded engine -> rewards -> GRPO -> FSDP2 -> miles-sync push) raises the reward
of a tiny random-init model on a toy task within seconds."""

import pytest
import torch
from doubles import ListSink, TokenPrompts, first_token_reward
from miles.core.config import AlgorithmConfig, EvalConfig, LoopConfig, RolloutConfig, SamplingConfig
from miles.core.loop import Components, train
from miles.core.publisher import EnginePublisher
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.generate import ChatRollout
from miles.sync import InProcessTransport, WeightSender
from miles.train import FSDP2Backend, TrainConfig


def test_grpo_raises_the_reward_of_a_tiny_random_model_on_a_toy_task(tiny_llama_dir):
    torch.manual_seed(0)
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    backend = FSDP2Backend(
        tiny_llama_dir,
        train=TrainConfig(lr=3e-3, micro_batch_size=32),
        temperature=1.0,
        weight_sink=WeightSender(InProcessTransport(engine.receiver)),
    )
    sink = ListSink()
    components = Components(
        data_source=TokenPrompts(),
        generate_group=ChatRollout(engine, tokenizer=None),
        reward_fn=first_token_reward,
        backend=backend,
        publisher=EnginePublisher(backend, [engine]),
        sink=sink,
        eval_prompts=TokenPrompts().next_prompts(8),
    )
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=2)
    train(
        components,
        loop=LoopConfig(num_steps=15),
        rollout=RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=8, sampling=sampling),
        algorithm=AlgorithmConfig(),
        evaluation=EvalConfig(num_prompts=8, n_samples_per_prompt=8, sampling=sampling),
    )
    rows = sink.rows
    first_eval, last_eval = rows[0]["eval/reward"], rows[-1]["eval/reward"]
    assert first_eval < 0.5, f"task too easy for a random model: {first_eval}"
    assert last_eval > first_eval + 0.35, f"eval reward {first_eval:.2f} -> {last_eval:.2f}"
    assert engine.weight_version == 15  # one push per step
    # After each push the engine holds the trainer's weights, so their log-probs agree.
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows[1:]) < 1e-5
    assert all(r["grad_norm"] >= 0 for r in rows[1:])


def test_a_batch_where_every_reward_fails_stops_with_a_clear_message(tiny_llama_dir):
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])

    def broken_reward(sample):
        raise RuntimeError("scorer is down")

    components = Components(
        data_source=TokenPrompts(),
        generate_group=ChatRollout(engine, tokenizer=None),
        reward_fn=broken_reward,
        backend=None,
        publisher=None,
        sink=ListSink(),
    )
    with pytest.raises(RuntimeError, match="all 4 samples failed.*scorer is down"):
        train(
            components,
            loop=LoopConfig(num_steps=1),
            rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2),
            algorithm=AlgorithmConfig(),
            evaluation=EvalConfig(num_prompts=0),
        )
