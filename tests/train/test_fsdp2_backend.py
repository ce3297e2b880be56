import subprocess
import sys
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.config import AlgorithmConfig
from miles.core.loop import train_step
from miles.train import FSDP2Backend, TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402

OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)


def _backend(model_dir, **train_kwargs) -> FSDP2Backend:
    return FSDP2Backend(model_dir, train=TrainConfig(**train_kwargs), temperature=1.0)


def _grads(model_dir, batch, micro_batch_size, **train_kwargs) -> dict[str, torch.Tensor]:
    backend = _backend(model_dir, micro_batch_size=micro_batch_size, **train_kwargs)
    backend.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    return backend.full_gradients()


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_accumulated_gradient_does_not_depend_on_the_micro_batch_split(tiny_llama_dir, micro_batch_size):
    batch = make_batch()
    whole = _grads(tiny_llama_dir, batch, micro_batch_size=6)
    split = _grads(tiny_llama_dir, batch, micro_batch_size=micro_batch_size)  # 4 -> uneven 4 + 2
    assert whole.keys() == split.keys() and len(whole) > 0
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-5, msg=name)


def test_log_probs_equal_a_plain_hf_forward_of_the_same_tokens(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    got = _backend(tiny_llama_dir).forward(batch, outputs={"old_log_probs"}).old_log_probs
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    for b in range(batch.batch_size):
        p, n = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        logits = model(input_ids=batch.tokens[b : b + 1, : p + n]).logits[0]
        expected = torch.log_softmax(logits[p - 1 : p + n - 1], -1).gather(-1, batch.tokens[b, p : p + n, None])[:, 0]
        torch.testing.assert_close(got[b, :n], expected, atol=1e-5, rtol=0)


def test_train_step_changes_weights_and_reports_finite_metrics(tiny_llama_dir):
    backend = _backend(tiny_llama_dir, lr=1e-2, micro_batch_size=4)
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}
    metrics = train_step(backend, make_batch(), OBJECTIVE)
    after = backend.full_state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before if "norm" not in k)
    for key in ("loss", "loss/pg", "entropy", "pg_clipfrac", "grad_norm", "train_rollout_logprob_abs_diff"):
        assert torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["pg_clipfrac"] == 0.0  # on-policy: ratio is exactly 1
    assert metrics["lr"] == pytest.approx(1e-2)


def test_save_then_load_restores_weights_optimizer_and_step(tiny_llama_dir, tmp_path):
    backend = _backend(tiny_llama_dir, lr=1e-2)
    train_step(backend, make_batch(), OBJECTIVE)
    backend.save(tmp_path)
    restored = _backend(tiny_llama_dir, lr=1e-2)
    restored.load(tmp_path)
    assert restored.step == 1
    for name, tensor in backend.full_state_dict().items():
        torch.testing.assert_close(restored.full_state_dict()[name], tensor, atol=0, rtol=0)
    # Same state -> the next step gives identical weights.
    train_step(backend, make_batch(seed=1), OBJECTIVE)
    train_step(restored, make_batch(seed=1), OBJECTIVE)
    for name, tensor in backend.full_state_dict().items():
        torch.testing.assert_close(restored.full_state_dict()[name], tensor, atol=0, rtol=0)


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_fsdp2_world_size_2_matches_the_unsharded_model(tiny_llama_dir, tmp_path, layout):
    """Two gloo ranks: logits equal the plain HF model; each rank's half batch (with the global loss counts)
    gives the one-rank padded gradient, in the padded and in the packed (varlen) layout."""
    from transformers import AutoModelForCausalLM

    worker = Path(__file__).parent / "fsdp2_worker.py"
    out = tmp_path / "rank0.pt"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                str(rank),
                "2",
                str(tmp_path / "init"),
                str(tiny_llama_dir),
                str(out),
                layout,
            ],
            cwd=worker.parent,
        )
        for rank in range(2)
    ]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    result = torch.load(out, weights_only=True)
    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = model(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits
    torch.testing.assert_close(result["logits"], expected, atol=1e-6, rtol=0)
    single = _grads(tiny_llama_dir, batch, micro_batch_size=6)
    for name, grad in single.items():
        torch.testing.assert_close(result["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    # Reduced with max over the ranks, not summed: the worst token of the whole batch.
    expected_max = _max_abs_diff(_backend(tiny_llama_dir), batch)
    assert result["metrics"]["train_rollout_logprob_abs_diff_max"] == pytest.approx(expected_max, abs=1e-6)
    # The push streams: every tensor gathered as the sink reads it, none of the earlier ones kept alive by the
    # trainer (a list of the whole model would keep all of them: alive == 0, 1, 2, ...), each equal to the full
    # state; the tied LM head is sent once, under the embedding's name.
    state = result["state"]
    names = list(dict.fromkeys(n for n in state if n != "lm_head.weight" or not _tied(tiny_llama_dir)))
    assert list(result["pushed"]) == names
    assert max(result["alive"]) <= 1, result["alive"]
    for name, tensor in result["pushed"].items():
        torch.testing.assert_close(tensor, state[name], atol=0, rtol=0, msg=name)


def _tied(model_dir) -> bool:
    from transformers import AutoConfig

    return bool(AutoConfig.from_pretrained(model_dir).tie_word_embeddings)


def _max_abs_diff(backend: FSDP2Backend, batch) -> float:
    """max over trained tokens of |trainer - rollout| log-prob, computed from the whole batch at once."""
    old = backend.forward(batch, outputs={"old_log_probs"}).old_log_probs
    return float((old - batch.rollout_log_probs).abs()[batch.loss_mask].max())


@pytest.mark.parametrize("micro_batch_size", [1, 6])
def test_the_max_mismatch_metric_is_the_worst_token_of_the_batch(tiny_llama_dir, micro_batch_size):
    """train_rollout_logprob_abs_diff_max is the max over micro-batches (a sum over 6 micro-batches would be ~6x)."""
    batch = make_batch()
    backend = _backend(tiny_llama_dir, micro_batch_size=micro_batch_size)
    expected = _max_abs_diff(backend, batch)
    assert expected > 0.1  # the fixture's rollout log-probs are not the model's
    metrics = backend.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    assert metrics["train_rollout_logprob_abs_diff_max"] == pytest.approx(expected, abs=1e-6)
    assert metrics["train_rollout_logprob_abs_diff"] < expected


def test_skipping_zero_advantage_rows_leaves_loss_and_gradient_unchanged(tiny_llama_dir, monkeypatch):
    batch = make_batch()
    zeroed = batch.replace(advantages=batch.advantages * torch.tensor([1.0, 0, 0, 1, 0, 1])[:, None])
    skipping = _backend(tiny_llama_dir, micro_batch_size=2)
    metrics = skipping.forward_backward(zeroed, OBJECTIVE, LossCounts.of(zeroed))
    assert metrics["skipped_zero_advantage_samples"] == 3
    reference = _backend(tiny_llama_dir, micro_batch_size=2)
    keep_all = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
    monkeypatch.setattr(keep_all, "select_rows", lambda b, world_size: (b, 0))
    expected = reference.forward_backward(zeroed, keep_all, LossCounts.of(zeroed))
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-7)
    got, want = skipping.full_gradients(), reference.full_gradients()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-7, rtol=1e-6, msg=name)


def test_a_batch_without_any_signal_trains_nothing_and_does_not_crash(tiny_llama_dir):
    backend = _backend(tiny_llama_dir)
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}
    batch = make_batch()
    metrics = train_step(backend, batch.replace(advantages=torch.zeros_like(batch.advantages)), OBJECTIVE)
    assert metrics["loss"] == 0.0 and metrics["skipped_zero_advantage_samples"] == 5  # one row kept for metrics
    assert metrics["entropy"] > 0
    assert all(torch.equal(before[k], v) for k, v in backend.full_state_dict().items())


def test_world_size_1_fp32_is_not_wrapped_bf16_is_and_states_are_copies(tiny_llama_dir):
    from torch.distributed.fsdp import FSDPModule

    fp32 = _backend(tiny_llama_dir, lr=1e-2)
    assert not isinstance(fp32.model, FSDPModule)  # nothing to shard or cast at 1 rank: no all-gather copies
    assert isinstance(_backend(tiny_llama_dir, dtype="bf16").model, FSDPModule)  # its mixed-precision policy
    state = fp32.full_state_dict()
    params = {p.data_ptr() for p in fp32.model.parameters()}
    assert not params & {t.data_ptr() for t in state.values()}  # copies, not the live parameters
    tied = fp32.model.config.tie_word_embeddings
    assert (state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()) == tied
    before = {k: v.clone() for k, v in state.items()}
    train_step(fp32, make_batch(), OBJECTIVE)
    assert all(torch.equal(before[k], state[k]) for k in state)  # training did not move the returned copy


def test_world_size_1_exports_the_live_weights_once_each_without_copies_and_plain_tensors_under_bf16(tiny_llama_dir):
    """At one rank the push reads the parameters themselves (nothing to gather, no second copy of the model), as a
    list a sender may resend; bf16's 1-rank FSDP2 wrapper exports plain fp32 tensors, not DTensors."""
    from torch.distributed.tensor import DTensor

    fp32 = _backend(tiny_llama_dir)
    exported = fp32.export_weights()
    assert isinstance(exported, list)
    params = {p.data_ptr() for p in fp32.model.parameters()}
    assert {t.data_ptr() for _, t in exported} == params
    state = fp32.full_state_dict()
    tied = fp32.model.config.tie_word_embeddings
    assert [n for n, _ in exported] == [n for n in state if not (tied and n == "lm_head.weight")]
    bf16 = _backend(tiny_llama_dir, dtype="bf16")
    exported = dict(bf16.export_weights())
    assert not any(isinstance(t, DTensor) for t in exported.values())
    for name, tensor in bf16.full_state_dict().items():
        if name in exported:
            assert exported[name].dtype == torch.float32
            torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0)
