from miles.rollout.sft import multi_turn_tokens


def test_multi_turn_loss_mask_trains_only_the_assistant_turns(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    tokens, prompt_length, loss_mask = multi_turn_tokens(tokenizer, messages)
    response = tokens[prompt_length:]
    assert len(loss_mask) == len(response)
    trained = tokenizer.decode([t for t, m in zip(response, loss_mask) if m])
    untrained = tokenizer.decode([t for t, m in zip(response, loss_mask) if not m])
    # Assistant contents and their end-of-turn tokens are trained; the user turn between them is not.
    assert "4" in trained and "6" in trained and trained.count("<|im_end|>") == 2
    assert "and 3+3?" in untrained and "3+3" not in trained
    assert loss_mask[0] == 1  # the prompt ends right after the first assistant header


def test_sft_rollout_is_a_group_function_of_n_identical_samples(smollm2_dir):
    from miles.core.buffer import generate_samples
    from miles.core.config import SamplingConfig
    from miles.core.sample import Sample, SampleStatus
    from miles.rollout.sft import SFTRollout
    from transformers import AutoTokenizer

    rollout = SFTRollout(AutoTokenizer.from_pretrained(smollm2_dir))
    prompts = [Sample(index=i, group_index=i, prompt=f"{i}+1?", label=str(i + 1)) for i in range(2)]
    samples = generate_samples(prompts, rollout, n_samples_per_prompt=3, sampling=SamplingConfig(), seed=0)
    assert [(s.index, s.group_index) for s in samples] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    assert all(s.status == SampleStatus.COMPLETED for s in samples)
    assert samples[0].tokens == samples[2].tokens != samples[3].tokens
    assert samples[0].response_length == sum(samples[0].loss_mask) > 0
