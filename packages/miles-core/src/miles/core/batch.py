"""``TrainBatch``: the padded tensor form of a list of samples that every training backend consumes.

Layout (B sequences, L = longest prompt + response, T = longest response):
``tokens[b, :prompt_lengths[b] + response_lengths[b]]`` holds the real ids, right-padded with ``pad_token_id``.
Per-response-token tensors are ``[B, T]``: column t of row b is response token t of sample b, i.e. the
token at ``tokens[b, prompt_lengths[b] + t]``; columns past ``response_lengths[b]`` are padding (loss_mask False).

``PackedSequences`` (``pack_sequences``) is the varlen form of the same rows for the model forward: the N real
tokens of all rows concatenated into one row, no padding; per-token results are gathered back to ``[B, T]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from miles.core.sample import Sample
from torch import Tensor


@dataclass(frozen=True)
class TrainBatch:
    """Padded tensors for B samples; built only by ``build_train_batch``.

    Attributes:
        tokens: [B, L] int64, prompt + response ids, right-padded.
        attention_mask: [B, L] bool, True at real tokens.
        prompt_lengths: [B] int64.
        response_lengths: [B] int64, response tokens incl. tool tokens.
        loss_mask: [B, T] bool, True = trained (False: padding, tool output, filtered samples).
        advantages: [B, T] float32, 0 at masked positions.
        rewards: [B] float32 (failed samples: 0, and fully masked).
        rollout_log_probs: [B, T] float32 nats from the engine, 0 at padding; None if the engine gave none.
        old_log_probs: [B, T] float32 nats, trainer recompute before the update (PPO denominator); None until set.
        ref_log_probs: [B, T] float32 nats under the frozen reference model; None unless KL is used.
        teacher_log_probs: [B, T] float32 nats under the teacher (on-policy distillation); None without a teacher.
        values: [B, T] float32 critic values V(s_t) at rollout time (PPO/GAE); None without a critic.
        returns: [B, T] float32 critic targets (GAE advantages + values); None without a critic.
        weight_versions: [B] int64, the policy weight version each sample was generated with. A sample generated
            across several versions (a partial rollout resumed after a weight push) gets its oldest one, so
            staleness (trainer version - weight_versions) is measured from its oldest segment.
        routed_experts: [B, L, num_layers, top_k] int32 MoE experts chosen at rollout for each token (routing
            replay, R3), laid out like ``tokens`` and right-padded with -1; None unless every sample has them.
        multimodal_inputs: B entries, each row's image inputs (``miles.core.multimodal``: ``pixel_values`` [P, D],
            ``image_grid_thw`` [I, 3], or Idefics3 tiles ``pixel_values`` [N, C, H, W], ``pixel_attention_mask``
            [N, H, W]; their placeholder tokens are in the row's prompt) or None for a text-only row; None when no
            row has images. A tuple, not a tensor: rows hold different numbers of patches or tiles.
    """

    tokens: Tensor
    attention_mask: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor
    loss_mask: Tensor
    advantages: Tensor
    rewards: Tensor
    rollout_log_probs: Tensor | None = None
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    teacher_log_probs: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None
    weight_versions: Tensor | None = None
    routed_experts: Tensor | None = None
    multimodal_inputs: tuple[dict[str, Tensor] | None, ...] | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_loss_tokens(self) -> int:
        """Number of trained tokens (host sync)."""
        return int(self.loss_mask.sum())

    def replace(self, **changes: Tensor | None) -> TrainBatch:
        """A copy with some fields replaced (e.g. ``old_log_probs`` after the recompute)."""
        return dataclasses.replace(self, **changes)

    def select(self, rows: Tensor) -> TrainBatch:
        """The rows given by an int64 index tensor (columns untrimmed)."""
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):  # per-row entries (multimodal_inputs)
                fields[f.name] = tuple(value[i] for i in rows.tolist())
            else:
                fields[f.name] = None if value is None else value[rows]
        return TrainBatch(**fields)

    def slice(self, start: int, end: int) -> TrainBatch:
        """Rows ``start:end``, with columns trimmed to the longest sequence/response in the slice.

        Trimming only drops padding, so per-token values are unchanged; it saves compute on short micro-batches.
        """
        rows = slice(start, end)
        seq_len = int((self.prompt_lengths[rows] + self.response_lengths[rows]).max())  # host sync
        resp_len = int(self.response_lengths[rows].max())
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or isinstance(value, tuple):  # a tuple holds one entry per row
                fields[f.name] = value if value is None else value[rows]
            elif f.name in ("tokens", "attention_mask", "routed_experts"):  # [B, L, ...]
                fields[f.name] = value[rows, :seq_len]
            elif value.dim() == 2:
                fields[f.name] = value[rows, :resp_len]
            else:
                fields[f.name] = value[rows]
        return TrainBatch(**fields)


def build_train_batch(
    samples: Sequence[Sample], advantages: Tensor, *, pad_token_id: int, trained: Sequence[bool] | None = None
) -> TrainBatch:
    """Pack samples into a ``TrainBatch``; per-sample advantages are broadcast over each response's tokens.

    Args:
        samples: B samples with ``tokens`` and ``response_length`` set.
        advantages: [B] float32 (one per sample) or [B, T] float32 (per token, e.g. GAE); T >= longest response.
            Any value (NaN/inf included) where the result's ``loss_mask`` is False: those slots become exactly 0.
        pad_token_id: id used to right-pad ``tokens``.
        trained: per sample, False excludes it from the loss (e.g. a failed reward); default all True.
    Returns: the padded batch; ``loss_mask`` is ``sample.loss_mask`` (or all ones) AND ``trained``;
        ``weight_versions`` always set; ``routed_experts`` set when every sample has ``rollout_routed_experts``.
        An untrained sample without tokens (its prompt failed before generation: unreadable image, too long) is a
        row of one ``pad_token_id`` prompt token and no response, so the rest of its step still trains.
    Raises: ValueError if a trained sample has no prompt tokens, lengths disagree, or shapes mismatch.
    """
    num = len(samples)
    if num == 0:
        raise ValueError("build_train_batch got no samples")
    if advantages.shape[0] != num:
        raise ValueError(f"advantages has {advantages.shape[0]} rows for {num} samples")
    trained = [True] * num if trained is None else list(trained)
    # An untrained sample that never got tokens stands in as [pad]: a row must hold a prompt token.
    empty = [not s.tokens and not t for s, t in zip(samples, trained)]
    prompt_lengths = torch.tensor([1 if e else s.prompt_length for s, e in zip(samples, empty)], dtype=torch.int64)
    response_lengths = torch.tensor([s.response_length for s in samples], dtype=torch.int64)
    seq_len = int((prompt_lengths + response_lengths).max())
    resp_len = max(1, int(response_lengths.max()))
    tokens = torch.full((num, seq_len), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros(num, seq_len, dtype=torch.bool)
    loss_mask = torch.zeros(num, resp_len, dtype=torch.bool)
    rollout_log_probs = torch.zeros(num, resp_len, dtype=torch.float32)
    has_rollout_log_probs = all(s.rollout_log_probs is not None for s, e in zip(samples, empty) if not e)
    for b, sample in enumerate(samples):
        n_tok, n_resp = len(sample.tokens), sample.response_length
        if empty[b]:
            attention_mask[b, 0] = True
            continue
        if sample.prompt_length <= 0:
            raise ValueError(f"sample {sample.index} has no prompt tokens (tokens={n_tok}, response={n_resp})")
        tokens[b, :n_tok] = torch.tensor(sample.tokens, dtype=torch.int64)
        attention_mask[b, :n_tok] = True
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * n_resp
        if len(mask) != n_resp:
            raise ValueError(f"sample {sample.index}: loss_mask has {len(mask)} entries for {n_resp} response tokens")
        if trained[b] and n_resp > 0:
            loss_mask[b, :n_resp] = torch.tensor(mask, dtype=torch.bool)
        if has_rollout_log_probs:
            if len(sample.rollout_log_probs) != n_resp:
                raise ValueError(
                    f"sample {sample.index}: {len(sample.rollout_log_probs)} rollout_log_probs for "
                    f"{n_resp} response tokens"
                )
            rollout_log_probs[b, :n_resp] = torch.tensor(sample.rollout_log_probs, dtype=torch.float32)
    advantages = advantages.to(torch.float32)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand(num, resp_len)
    else:
        advantages = advantages[:, :resp_len]
    # Selection, not multiplication: NaN * 0 is NaN, and a masked slot (padding, an untrained sample) must hold 0.
    advantages = torch.where(loss_mask, advantages, torch.zeros((), dtype=torch.float32))
    rewards = torch.tensor([_scalar_reward(s) if t else 0.0 for s, t in zip(samples, trained)], dtype=torch.float32)
    # ``weight_versions`` (one per generation segment) may exist on newer Samples; the oldest bounds staleness.
    weight_versions = torch.tensor(
        [min(getattr(s, "weight_versions", None) or [s.weight_version]) for s in samples], dtype=torch.int64
    )
    return TrainBatch(
        tokens=tokens,
        attention_mask=attention_mask,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        loss_mask=loss_mask,
        advantages=advantages.contiguous(),
        rewards=rewards,
        rollout_log_probs=rollout_log_probs if has_rollout_log_probs else None,
        weight_versions=weight_versions,
        routed_experts=_routed_experts(samples, seq_len),
        multimodal_inputs=_multimodal_inputs(samples),
    )


def _multimodal_inputs(samples: Sequence[Sample]) -> tuple[dict[str, Tensor] | None, ...] | None:
    """Each sample's image inputs, checked (``validate_multimodal``); None when no sample has any.

    Raises: ValueError naming the sample whose inputs are malformed.
    """
    from miles.core.multimodal import validate_multimodal

    if all(s.multimodal_inputs is None for s in samples):
        return None
    for s in samples:
        if s.multimodal_inputs is not None:
            validate_multimodal(s.multimodal_inputs, where=f"sample {s.index}: multimodal_inputs")
    return tuple(s.multimodal_inputs for s in samples)


def _routed_experts(samples: Sequence[Sample], seq_len: int) -> Tensor | None:
    """[B, seq_len, num_layers, top_k] int32 from each sample's [len(tokens), num_layers, top_k] ids, -1 padded.

    None when no sample has ``rollout_routed_experts``. A sample without them (failed or aborted before its engine
    answered: an untrained row) gets -1 rows, where the trainer's router decides, so one failure does not turn
    replay off for the rest of the batch.
    Raises: ValueError if a sample's array is not [len(tokens), num_layers, top_k] with the batch's num_layers, top_k.
    """
    recorded = [s for s in samples if s.rollout_routed_experts is not None]
    if not recorded:
        return None
    # int32: expert ids are small, and this is num_layers * top_k ints per token (e.g. 48 * 8), the batch's largest.
    trailing = torch.as_tensor(recorded[0].rollout_routed_experts).shape[1:]
    per_sample = [
        torch.full((len(s.tokens), *trailing), -1, dtype=torch.int32)
        if s.rollout_routed_experts is None
        else torch.as_tensor(s.rollout_routed_experts).to(torch.int32)
        for s in samples
    ]
    for sample, experts in zip(samples, per_sample):
        if experts.dim() != 3 or experts.shape[0] != len(sample.tokens) or experts.shape[1:] != trailing:
            raise ValueError(
                f"sample {sample.index}: rollout_routed_experts has shape {tuple(experts.shape)}, expected "
                f"[len(tokens)={len(sample.tokens)}, num_layers, top_k] with (num_layers, top_k) = {tuple(trailing)} "
                "as in the first sample; the engine must report one routing per token of prompt + response"
            )
    routed = torch.full((len(samples), seq_len, *trailing), -1, dtype=torch.int32)
    for b, experts in enumerate(per_sample):
        routed[b, : experts.shape[0]] = experts
    return routed


def _scalar_reward(sample: Sample) -> float:
    reward = sample.reward
    if isinstance(reward, dict):
        return float(reward.get("score", 0.0))
    return float(reward) if reward is not None else 0.0


def split_micro_batches(batch: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
    """Consecutive row slices of at most ``micro_batch_size`` rows, each trimmed of column padding."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [
        batch.slice(i, min(i + micro_batch_size, batch.batch_size))
        for i in range(0, batch.batch_size, micro_batch_size)
    ]


@dataclass(frozen=True)
class PackedSequences:
    """B right-padded rows as one row of their N real tokens (varlen layout; flash-attn conventions).

    Sequence b is ``tokens[0, cu_seqlens[b]:cu_seqlens[b + 1]]``; attention must stay within each sequence.

    Attributes:
        tokens: [1, N] int64, the real tokens of rows 0..B-1 concatenated, no padding.
        cu_seqlens: [B + 1] int32, cumulative sequence lengths, ``cu_seqlens[0] == 0`` and ``cu_seqlens[B] == N``.
        position_ids: [1, N] int64, each token's position in its own sequence (restarts at 0 per sequence).
        max_seqlen: the longest sequence's length (flash-attn's ``max_seqlen``), a host int.
    """

    tokens: Tensor
    cu_seqlens: Tensor
    position_ids: Tensor
    max_seqlen: int


def pack_sequences(tokens: Tensor, attention_mask: Tensor) -> PackedSequences:
    """Concatenate the real tokens of right-padded rows (``TrainBatch.tokens``) into one packed row.

    Args:
        tokens: [B, L] int64, right-padded ids.
        attention_mask: [B, L] bool/int, True (nonzero) at real tokens: a prefix of each row.
    Returns: ``PackedSequences`` on ``tokens.device``; a row with no real token is an empty sequence.
    Raises: ValueError if the shapes differ or a row's mask is not a prefix (left padding or holes).
    """
    if tokens.shape != attention_mask.shape or tokens.dim() != 2:
        raise ValueError(
            f"pack_sequences needs tokens and attention_mask of one [B, L] shape, got {tuple(tokens.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    real = attention_mask.bool()
    seq_lengths = real.sum(dim=1)  # [B]
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    prefix = columns[None, :] < seq_lengths[:, None]  # [B, L], what a right-padded mask must be
    if not torch.equal(real, prefix):  # host sync; packing needs N on the host anyway
        bad = int((real != prefix).any(dim=1).nonzero()[0])
        raise ValueError(
            f"pack_sequences needs right-padded rows, but attention_mask row {bad} is not a prefix of True: "
            f"{real[bad].int().tolist()}; pack TrainBatch rows (build_train_batch right-pads) or move padding right"
        )
    cu_seqlens = torch.zeros(tokens.shape[0] + 1, dtype=torch.int32, device=tokens.device)
    cu_seqlens[1:] = seq_lengths.cumsum(0)
    # Boolean indexing walks rows in order, so row b's tokens land at cu_seqlens[b]:cu_seqlens[b + 1].
    return PackedSequences(
        tokens=tokens[real][None, :],
        cu_seqlens=cu_seqlens,
        position_ids=columns.expand_as(real)[real][None, :],
        max_seqlen=int(seq_lengths.max()) if tokens.shape[0] > 0 else 0,
    )
