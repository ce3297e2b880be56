import pytest
import torch
from miles.core.batch import build_train_batch
from miles.core.buffer import generate_samples
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest
from miles.core.sample import Sample, SampleStatus
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.generate import ChatRollout, render_prompt
from miles.train import FSDP2Backend, TrainConfig

PROMPTS = ["Calculate 4 + 1.", "Name a colour.", "Write a long story about a cat who learns to fly."]


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_dir):
    return EmbeddedEngine(smollm2_dir, dtype="fp32")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.integration
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_log_probs_equal_trainer_log_probs_on_the_same_tokens(
    smollm2_dir, smollm2_engine, smollm2_tokenizer, temperature
):
    rollout = ChatRollout(smollm2_engine, smollm2_tokenizer)
    prompts = [Sample(index=i, group_index=i, prompt=[{"role": "user", "content": p}]) for i, p in enumerate(PROMPTS)]
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=12)
    samples = generate_samples(prompts, rollout, n_samples_per_prompt=2, sampling=sampling, seed=3)
    batch = build_train_batch(samples, torch.zeros(len(samples)), pad_token_id=0)
    backend = FSDP2Backend(
        smollm2_dir,
        train=TrainConfig(dtype="fp32", micro_batch_size=4),
        temperature=temperature,
    )
    trainer = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    diff = ((trainer - batch.rollout_log_probs).abs() * batch.loss_mask).max()
    # The engine rescores each response alone (unpadded: its numbers do not depend on which rows finished together),
    # the trainer in padded micro-batches of 4; fp32 GEMMs of those shapes put them 1.3e-5 to 1.6e-5 apart here.
    assert diff < 3e-5, f"max |engine - trainer| log-prob = {diff}"
    assert batch.loss_mask.sum() > 20  # the comparison covered real tokens


@pytest.mark.integration
def test_finish_reason_is_stop_with_the_stop_token_kept_and_length_otherwise(smollm2_engine, smollm2_tokenizer):
    ids = render_prompt(smollm2_tokenizer, [{"role": "user", "content": "Say hi."}])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    outputs = smollm2_engine.generate_batch([GenerateRequest(ids, sampling, seed=s) for s in range(8)])
    stop_id = smollm2_engine.stop_token_ids[0]
    for out in outputs:
        assert len(out.response_tokens) == len(out.log_probs) <= 6
        if out.finish_reason == "stop":
            assert out.response_tokens[-1] == stop_id and stop_id not in out.response_tokens[:-1]
        else:
            assert out.finish_reason == "length" and len(out.response_tokens) == 6
            assert stop_id not in out.response_tokens
        assert all(lp <= 0.0 for lp in out.log_probs)


@pytest.mark.integration
def test_the_same_seed_gives_the_same_samples(smollm2_engine, smollm2_tokenizer):
    ids = render_prompt(smollm2_tokenizer, "The capital of France is")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=5)
    first = smollm2_engine.generate_batch([GenerateRequest(ids, sampling, seed=7)] * 2)
    second = smollm2_engine.generate_batch([GenerateRequest(ids, sampling, seed=7)] * 2)
    assert [o.response_tokens for o in first] == [o.response_tokens for o in second]


def test_top_k_1_is_greedy_and_log_probs_stay_those_of_the_untruncated_distribution(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    sampling = SamplingConfig(temperature=0.7, top_k=1, max_new_tokens=3)
    out = engine.generate_batch([GenerateRequest([1, 5, 6], sampling, seed=0)])[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).requires_grad_(False)
    tokens = [1, 5, 6]
    for token, log_prob in zip(out.response_tokens, out.log_probs):
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1] / 0.7
        assert token == int(logits.argmax())
        assert log_prob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)
        tokens.append(token)


def test_weight_updates_through_the_receiver_change_outputs_and_bump_the_version(tiny_llama_dir):
    from miles.sync import InProcessTransport, WeightSender

    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    sender = WeightSender(InProcessTransport(engine.receiver))
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    zeros = {k: torch.zeros_like(v) if k == "lm_head.weight" else v for k, v in state.items()}
    assert engine.weight_version == 0
    assert sender.push(zeros.items()) == 1 and engine.weight_version == 1
    out = engine.generate_batch([GenerateRequest([1, 5], SamplingConfig(max_new_tokens=2), seed=0)])[0]
    # Zero LM head -> uniform distribution over 32 tokens.
    assert out.log_probs[0] == pytest.approx(-torch.log(torch.tensor(32.0)).item(), abs=1e-5)
    assert out.weight_version == 1


def test_token_id_prompts_go_through_unchanged_and_empty_prompts_fail_the_sample(tiny_llama_dir):
    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    rollout = ChatRollout(engine, tokenizer=None)
    prompts = [Sample(index=0, group_index=0, prompt=[1, 7, 9]), Sample(index=1, group_index=1, prompt="")]
    samples = generate_samples(prompts, rollout, n_samples_per_prompt=2, sampling=SamplingConfig(max_new_tokens=3),
                               seed=0)  # fmt: skip
    assert [s.group_index for s in samples] == [0, 0, 1, 1]
    assert samples[0].tokens[:3] == [1, 7, 9] and samples[0].response_length >= 1
    assert samples[2].status == SampleStatus.FAILED and "empty prompt" in samples[2].metadata["failure"]
