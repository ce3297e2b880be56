"""One objective, two backends: the RL objective of ``miles.core`` gives the FSDP2 backend the same gradients as a
minimal plain-torch backend (tests only), for each family of losses, corrections and aggregations."""

import sys
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective, accumulate_policy_loss, reduce_policy_metrics
from miles.core.batch import TrainBatch
from miles.core.config import AlgorithmConfig, KLConfig, LossConfig, RolloutCorrectionConfig
from miles.core.log_probs import model_response_log_probs
from miles.train import FSDP2Backend, TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402


class ReferenceBackend:
    """The smallest ``forward_backward``: an unsharded HF model, plain ``loss.backward()``, no FSDP, one process."""

    def __init__(self, model_dir, *, micro_batch_size: int, temperature: float = 1.0) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.config.use_cache = False
        self.micro_batch_size, self.temperature = micro_batch_size, temperature

    def forward_backward(self, batch: TrainBatch, objective: PolicyObjective, counts: LossCounts) -> dict:
        sums = accumulate_policy_loss(
            objective,
            batch,
            counts,
            world_size=1,
            micro_batch_size=self.micro_batch_size,
            log_probs_fn=lambda mb: model_response_log_probs(
                self.model,
                mb.tokens,
                mb.attention_mask,
                mb.prompt_lengths,
                num_response_columns=mb.loss_mask.shape[1],
                temperature=self.temperature,
                with_entropy=True,
            ),
            backward=lambda loss, i, n: loss.backward(),
        )
        return reduce_policy_metrics(objective, sums, counts)

    def gradients(self) -> dict[str, torch.Tensor]:
        return {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}


ALGORITHMS = {
    "grpo": AlgorithmConfig(),
    "dapo_clip_higher_dual_clip": AlgorithmConfig(loss=LossConfig(clip_high=0.28, dual_clip_c=3.0)),
    "kl_loss_entropy_bonus": AlgorithmConfig(kl=KLConfig(coef=0.1, estimator="k3"), loss=LossConfig(entropy_coef=0.01)),
    "gspo": AlgorithmConfig(
        loss=LossConfig(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean")
    ),
    "cispo_dr_grpo_norm": AlgorithmConfig(loss=LossConfig(policy_loss="cispo", aggregation="seq_mean_token_sum_norm")),
    "tis_sequence": AlgorithmConfig(
        rollout_correction=RolloutCorrectionConfig(importance_sampling="tis", level="sequence", upper=2.0)
    ),
    "icepop_opsm": AlgorithmConfig(
        rollout_correction=RolloutCorrectionConfig(
            importance_sampling="icepop", lower=0.5, upper=5.0, opsm=True, opsm_threshold=0.01
        )
    ),
}


def _off_policy(batch: TrainBatch, *, ref: bool) -> TrainBatch:
    """Old (and reference) log-probs away from the current policy, so ratios clip and KL/IS terms are nonzero."""
    gen = torch.Generator().manual_seed(7)
    noise = lambda: torch.randn(batch.loss_mask.shape, generator=gen) * 0.3  # noqa: E731
    old = batch.rollout_log_probs + noise()
    changes = {"old_log_probs": old}
    if ref:
        changes["ref_log_probs"] = old + noise()
    return batch.replace(**changes)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_the_fsdp2_backend_and_a_plain_torch_backend_get_equal_gradients(tiny_llama_dir, name, layout):
    algorithm = ALGORITHMS[name]
    objective = PolicyObjective(algorithm, max_new_tokens=8)
    batch = make_batch()
    # A row of all-zero advantages: rows without signal are skipped where the objective allows it.
    batch = batch.replace(advantages=batch.advantages * torch.tensor([1.0, 0, 1, 1, 1, 1])[:, None])
    # The current policy as the old one for the on-policy case, shifted log-probs for the off-policy one.
    batch = _off_policy(batch, ref=algorithm.kl is not None)
    counts = LossCounts.of(batch)

    reference = ReferenceBackend(tiny_llama_dir, micro_batch_size=4)
    expected = reference.forward_backward(batch, objective, counts)
    fsdp2 = FSDP2Backend(tiny_llama_dir, train=TrainConfig(micro_batch_size=4, batch_layout=layout), temperature=1.0)
    got = fsdp2.forward_backward(batch, objective, counts)

    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    assert got["loss"] != 0.0
    want, have = reference.gradients(), fsdp2.full_gradients()
    assert want.keys() == have.keys() and want
    for param in want:
        torch.testing.assert_close(have[param], want[param], atol=2e-6, rtol=1e-5, msg=param)


def test_gradients_are_those_of_the_loss_formula_written_out(tiny_llama_dir):
    """The reference backend itself, against GRPO's token-mean PPO loss written out by hand on one micro-batch."""
    batch = _off_policy(make_batch(), ref=False)
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
    reference = ReferenceBackend(tiny_llama_dir, micro_batch_size=6)
    reference.forward_backward(batch, objective, LossCounts.of(batch))

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    log_probs, _ = model_response_log_probs(
        model,
        batch.tokens,
        batch.attention_mask,
        batch.prompt_lengths,
        num_response_columns=batch.loss_mask.shape[1],
        temperature=1.0,
    )
    ratio = torch.exp(log_probs - batch.old_log_probs)
    a = batch.advantages
    token_loss = torch.maximum(-ratio * a, -ratio.clamp(0.8, 1.2) * a)
    loss = torch.where(batch.loss_mask, token_loss, 0.0).sum() / batch.loss_mask.sum()
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(reference.gradients()[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


def _shard_sums(objective, shard, counts):
    """accumulate_policy_loss on one rank's shard, with log-probs a leaf tensor (no model needed)."""
    log_probs_fn = lambda mb: (mb.rollout_log_probs.clone().requires_grad_(True), None)  # noqa: E731
    return accumulate_policy_loss(
        objective, shard, counts, world_size=2, micro_batch_size=2, log_probs_fn=log_probs_fn,
        backward=lambda loss, i, n: loss.backward(),
    )  # fmt: skip


def test_a_rank_given_its_own_shard_s_counts_is_caught():
    """Two ranks (all_reduce doubles the sums: equal shards): with the global counts the metrics reduce; with a
    shard's own counts the loss would be scaled up by the number of ranks, and that is refused."""
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
    batch = make_batch()
    shard = batch.slice(0, batch.batch_size // 2)
    two_ranks = lambda totals, op: totals * 2 if op == "sum" else totals  # noqa: E731
    global_counts = LossCounts(num_tokens=2 * shard.num_loss_tokens, num_sequences=batch.batch_size)
    metrics = reduce_policy_metrics(objective, _shard_sums(objective, shard, global_counts), global_counts,
                                    all_reduce=two_ranks)  # fmt: skip
    assert "_rank_loss_tokens" not in metrics and torch.isfinite(torch.tensor(metrics["loss"]))
    local = LossCounts.of(shard)
    with pytest.raises(ValueError, match=r"a rank was given its own shard's counts; pass LossCounts.of\(global"):
        reduce_policy_metrics(objective, _shard_sums(objective, shard, local), local, all_reduce=two_ranks)
