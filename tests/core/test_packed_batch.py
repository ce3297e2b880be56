"""The packed (varlen) layout: ``pack_sequences``, packed log-probs equal to padded ones, new ``TrainBatch`` fields."""

import numpy as np
import pytest
import torch
from miles.core.batch import PackedSequences, build_train_batch, pack_sequences
from miles.core.log_probs import model_response_log_probs, packed_model_response_log_probs
from miles.core.sample import Sample

NUM_GPUS = 0
ATOL = 1e-5  # fp32: the two layouts differ only in summation order (measured ~1e-6)


def _sample(i, prompt, response, **kw):
    return Sample(index=i, group_index=0, prompt="", tokens=prompt + response, response_length=len(response), **kw)


def test_pack_sequences_concatenates_real_tokens_and_restarts_positions_per_row():
    tokens = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    attention_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    packed = pack_sequences(tokens, attention_mask)
    # Lengths 3, 2, 4 -> N = 9, cu_seqlens = [0, 3, 3+2, 3+2+4].
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert packed.max_seqlen == 4
    assert packed.tokens.dtype == torch.int64 and packed.position_ids.dtype == torch.int64
    assert packed.cu_seqlens.dtype == torch.int32  # flash-attn varlen convention
    assert isinstance(packed, PackedSequences)


def test_pack_sequences_accepts_int_masks_and_empty_rows():
    packed = pack_sequences(torch.tensor([[4, 0], [0, 0], [5, 6]]), torch.tensor([[1, 0], [0, 0], [1, 1]]))
    assert packed.tokens.tolist() == [[4, 5, 6]]
    assert packed.cu_seqlens.tolist() == [0, 1, 1, 3]  # the empty row is a zero-length sequence
    assert packed.position_ids.tolist() == [[0, 0, 1]]


def test_pack_sequences_rejects_left_padding_naming_the_row():
    tokens = torch.tensor([[5, 6], [0, 7]])
    with pytest.raises(ValueError, match="attention_mask row 1 is not a prefix"):
        pack_sequences(tokens, torch.tensor([[True, True], [False, True]]))


def test_pack_sequences_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[B, L\] shape"):
        pack_sequences(torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 4, dtype=torch.bool))


@pytest.fixture(scope="module", params=["sdpa", "eager", "miles_varlen_sdpa"])
def tiny_llama(request, tiny_llama_dir):
    """The tiny random Llama in fp32 with each CPU attention implementation (and SDPA per packed sequence, what the
    trainer uses for packed batches: ``miles.core.varlen_attention``)."""
    from miles.core.varlen_attention import register_varlen_sdpa
    from transformers import AutoModelForCausalLM

    register_varlen_sdpa()

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation=request.param)
    assert model.config._attn_implementation == request.param
    return model


@pytest.fixture(scope="module")
def ragged_batch():
    """Rows of different prompt (1-6) and response (1-7) lengths, so packing moves every row but the first."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 7), (6, 1), (3, 4), (2, 2), (5, 6)]
    samples = [
        _sample(
            i, torch.randint(3, 32, (p,), generator=gen).tolist(), torch.randint(3, 32, (r,), generator=gen).tolist()
        )
        for i, (p, r) in enumerate(shapes)
    ]
    return build_train_batch(samples, torch.ones(len(samples)), pad_token_id=0)


def _log_probs(fn, model, batch):
    return fn(
        model,
        batch.tokens,
        batch.attention_mask,
        batch.prompt_lengths,
        num_response_columns=batch.loss_mask.shape[1],
        temperature=0.7,
        with_entropy=True,
    )


def test_packed_log_probs_and_entropy_equal_padded_ones(tiny_llama, ragged_batch):
    with torch.no_grad():
        padded, padded_entropy = _log_probs(model_response_log_probs, tiny_llama, ragged_batch)
        packed, packed_entropy = _log_probs(packed_model_response_log_probs, tiny_llama, ragged_batch)
    assert packed.shape == padded.shape == ragged_batch.loss_mask.shape and packed.dtype == torch.float32
    real = ragged_batch.loss_mask  # every response token is trained here, so this marks the real columns
    assert int(real.sum()) == 7 + 1 + 4 + 2 + 6
    torch.testing.assert_close(packed[real], padded[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed_entropy[real], padded_entropy[real], atol=ATOL, rtol=0)
    assert (packed[~real] == 0).all() and (packed_entropy[~real] == 0).all()


def test_packed_gradients_of_masked_log_prob_sum_equal_padded_ones(tiny_llama, ragged_batch):
    params = [p for p in tiny_llama.parameters() if p.requires_grad]
    grads = []
    for fn in (model_response_log_probs, packed_model_response_log_probs):
        log_probs, _ = _log_probs(fn, tiny_llama, ragged_batch)
        # Selection, not multiplication: the padded path's padding columns hold unspecified values.
        loss = torch.where(ragged_batch.loss_mask, log_probs, 0.0).sum()
        grads.append(torch.autograd.grad(loss, params))
    for (name, _), padded, packed in zip(tiny_llama.named_parameters(), *grads):
        assert padded.abs().max() > 0, name  # every parameter is reached, so equality is not vacuous
        torch.testing.assert_close(packed, padded, atol=ATOL, rtol=1e-5, msg=name)


def test_packed_attention_stays_within_each_sequence(tiny_llama, ragged_batch):
    # The same packed row and per-sequence positions, but a 2-D all-ones mask: transformers then builds a plain
    # causal mask over all N tokens, so every row after the first also attends to the rows packed before it.
    packed = pack_sequences(ragged_batch.tokens, ragged_batch.attention_mask)
    with torch.no_grad():
        leaked = tiny_llama(
            input_ids=packed.tokens,
            position_ids=packed.position_ids,
            attention_mask=torch.ones_like(packed.tokens),
            use_cache=False,
        ).logits[0]  # [N, V]
        isolated = tiny_llama(input_ids=packed.tokens, position_ids=packed.position_ids, use_cache=False).logits[0]
        padded = tiny_llama(input_ids=ragged_batch.tokens, attention_mask=ragged_batch.attention_mask.long()).logits
    starts, ends = packed.cu_seqlens[:-1].tolist(), packed.cu_seqlens[1:].tolist()
    for b, (start, end) in enumerate(zip(starts, ends)):
        torch.testing.assert_close(isolated[start:end], padded[b, : end - start], atol=ATOL, rtol=0)
        if b == 0:  # nothing is packed before row 0: the leak cannot show there
            torch.testing.assert_close(leaked[start:end], isolated[start:end], atol=ATOL, rtol=0)
        else:
            assert (leaked[start:end] - isolated[start:end]).abs().max() > 1e-3, f"row {b} did not see the leak"


def test_packed_log_probs_reject_an_attention_that_would_cross_sequences(tiny_llama, ragged_batch):
    impl = tiny_llama.config._attn_implementation
    tiny_llama.config._attn_implementation = "paged|sdpa"  # continuous batching: no mask is built from positions
    try:
        with pytest.raises(ValueError, match="'paged\\|sdpa'.*attend across sequences"):
            _log_probs(packed_model_response_log_probs, tiny_llama, ragged_batch)
    finally:
        tiny_llama.config._attn_implementation = impl


def test_build_train_batch_fills_weight_versions_with_the_oldest_segment():
    samples = [_sample(0, [1], [2], weight_version=3), _sample(1, [1], [2, 3], weight_version=5)]
    samples[1].weight_versions = [7, 4, 6]  # a partial rollout resumed over versions 7, 4, 6 (newer Samples)
    batch = build_train_batch(samples, torch.ones(2), pad_token_id=0)
    assert batch.weight_versions.tolist() == [3, 4] and batch.weight_versions.dtype == torch.int64
    assert batch.select(torch.tensor([1])).weight_versions.tolist() == [4]
    assert batch.slice(1, 2).weight_versions.tolist() == [4]


def _experts(num_tokens, base):
    """[num_tokens, 2 layers, 1 expert] with distinct values base + 10 * token + layer."""
    return [[[base + 10 * t + layer] for layer in range(2)] for t in range(num_tokens)]


def test_build_train_batch_right_pads_routed_experts_with_minus_one_and_slices_them_like_tokens():
    samples = [
        _sample(0, [1, 2], [3], rollout_routed_experts=_experts(3, 0)),  # a nested list
        _sample(1, [1, 2, 3], [4, 5], rollout_routed_experts=np.array(_experts(5, 100))),  # an ndarray
    ]
    batch = build_train_batch(samples, torch.ones(2), pad_token_id=0)
    assert batch.routed_experts.shape == (2, 5, 2, 1) and batch.routed_experts.dtype == torch.int32
    assert batch.routed_experts[0, :3, :, 0].tolist() == [[0, 1], [10, 11], [20, 21]]
    assert (batch.routed_experts[0, 3:] == -1).all()  # padding tokens 3-4 of row 0
    assert batch.routed_experts[1, :, 0, 0].tolist() == [100, 110, 120, 130, 140]
    assert torch.equal(batch.select(torch.tensor([1, 0])).routed_experts, batch.routed_experts[[1, 0]])
    first = batch.slice(0, 1)  # row 0 has 3 tokens: trimmed to [1, 3, 2, 1] like tokens
    assert first.tokens.shape == (1, 3) and torch.equal(first.routed_experts, batch.routed_experts[:1, :3])
    assert batch.replace(routed_experts=None).routed_experts is None


def test_a_sample_without_routed_experts_gets_unrecorded_rows_and_none_have_none():
    # Regression: one failed sample (no routing) made the whole batch's routing None, silently turning replay off
    samples = [_sample(0, [1], [2], rollout_routed_experts=_experts(2, 0)), _sample(1, [1], [2, 3])]
    routed = build_train_batch(samples, torch.ones(2), pad_token_id=0).routed_experts
    assert routed.shape == (2, 3, 2, 1)
    assert routed[0, :2, :, 0].tolist() == [[0, 1], [10, 11]] and (routed[1] == -1).all()
    assert build_train_batch([_sample(1, [1], [2])], torch.ones(1), pad_token_id=0).routed_experts is None


def test_routed_experts_of_the_wrong_length_are_a_clear_error():
    samples = [_sample(0, [1], [2, 3], rollout_routed_experts=_experts(2, 0))]
    with pytest.raises(ValueError, match=r"sample 0: rollout_routed_experts has shape \(2, 2, 1\).*len\(tokens\)=3"):
        build_train_batch(samples, torch.ones(1), pad_token_id=0)


def test_models_that_packing_would_compute_wrongly_are_refused_and_the_refusal_is_real(ragged_batch, monkeypatch):
    import importlib.util

    from miles.core.log_probs import packing_refusal
    from moe_models import make_moe_model
    from transformers import AutoConfig

    assert packing_refusal(AutoConfig.for_model("qwen3")) is None
    hybrid = AutoConfig.for_model("qwen3_5_text")  # Gated DeltaNet layers: fla's varlen kernels or nothing
    assert "linear-attention (Gated DeltaNet) layers" in packing_refusal(hybrid)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "fla" else real_find_spec(name))
    assert packing_refusal(hybrid) is None  # with flash-linear-attention installed, packing is allowed
    monkeypatch.undo()
    # DeepSeek-V4: the refusal is not a guess; its packed log-probs differ from the padded layout's
    model = make_moe_model("deepseek_v4")
    assert "DeepSeek-V4 compressed attention" in packing_refusal(model.config)
    with pytest.raises(
        ValueError, match="train.batch_layout 'packed': transformers' DeepSeek-V4.*--train.batch-layout padded"
    ):
        _log_probs(packed_model_response_log_probs, model, ragged_batch)
    monkeypatch.setattr("miles.core.log_probs.packing_refusal", lambda config: None)
    gen = torch.Generator().manual_seed(0)
    rows = [(torch.randint(3, 32, (p,), generator=gen).tolist(), torch.randint(3, 32, (r,), generator=gen).tolist())
            for p, r in [(12, 28), (10, 30)]]  # fmt: skip
    batch = build_train_batch([_sample(i, p, r) for i, (p, r) in enumerate(rows)], torch.ones(2), pad_token_id=0)
    with torch.no_grad():
        padded, _ = _log_probs(model_response_log_probs, model, batch)
        packed, _ = _log_probs(packed_model_response_log_probs, model, batch)
    real = batch.loss_mask
    diff = (packed - padded).abs() * real
    assert diff[0].max() < ATOL  # the first sequence has nothing packed before it
    assert diff[1].max() > 1e-4  # the second sees the first: 5e-4 measured here, 2e-2 at 4 layers; fp32 noise ~1e-6
