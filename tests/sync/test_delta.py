"""Delta weight updates (``WeightSender(delta=True)``): the encoding chosen per bucket, bytes sent, bit-identical
weights after every update, and the full fallback when a receiver lacks the base (a restarted engine, a corrupt
base), in process and through shared memory to another process."""

import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
from miles.sync import InProcessTransport, WeightReceiver, WeightSender
from miles.sync.bucket import BucketMeta, EncodedTensor, pack, packed_nbytes
from miles.sync.delta import NEEDS_FULL_UPDATE, DeltaDecoder, DeltaEncoder
from miles.sync.transports.shared_memory import SharedMemoryTransport

sys.path.insert(0, str(Path(__file__).parent))  # spawned children find sync_processes through the inherited path
import sync_processes  # noqa: E402


class Engine:
    """A receiver that keeps a clone of every applied update."""

    def __init__(self) -> None:
        self.applied: list[dict[str, torch.Tensor]] = []
        self.receiver = WeightReceiver(apply_fn=self.load)

    def load(self, named_tensors) -> None:
        self.applied.append({name: tensor.clone() for name, tensor in named_tensors})


def _model(seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layers.0.q_proj.weight": torch.randn(64, 64, generator=generator).to(dtype),
        "layers.0.norm.weight": torch.ones(64, dtype=dtype),
        "embed.weight": torch.randn(128, 64, generator=generator).to(dtype),
    }


def _step(model: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """An Adam-like update: every element moves by about lr (computed in fp32, stored in the model's dtype)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    return {
        name: (t.float() - lr * torch.randn(t.shape, generator=generator).sign()).to(t.dtype)
        for name, t in model.items()
    }


def _assert_bit_identical(received: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert received.keys() == sent.keys()
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype
        assert torch.equal(received[name].view(torch.uint8), tensor.view(torch.uint8)), name


def _bucket(words: list[int], *, version: int):
    payload = torch.tensor(words, dtype=torch.int32)
    entry = EncodedTensor("w", (len(words),), torch.int32, "identity", (payload,))
    size = packed_nbytes([entry])
    return pack([entry], torch.empty(size, dtype=torch.uint8), version=version, index=0)


def test_a_sparse_delta_holds_the_changed_words_and_their_new_values():
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    base = _bucket(list(range(16)), version=1)  # 16 words = 64 bytes, one aligned block
    meta, payload = encoder.encode(base)
    assert meta.delta.kind == "full" and meta.nbytes == 64
    decoder.decode(type(base)(meta, payload))
    encoder.commit(), decoder.commit()

    changed = list(range(16))
    changed[3], changed[10] = -7, 99
    meta, payload = encoder.encode(_bucket(changed, version=2))
    assert (meta.delta.kind, meta.delta.count, meta.delta.length, meta.delta.base_version) == ("sparse", 2, 16, 1)
    assert payload.numel() == 64 and meta.nbytes == 64  # padded to one aligned block
    assert payload[:16].view(torch.int32).tolist() == [3, 10, -7, 99]  # indices, then the new words
    rebuilt = decoder.decode(type(base)(meta, payload))
    assert isinstance(rebuilt.meta, BucketMeta) and rebuilt.meta.delta is None and rebuilt.meta.nbytes == 64
    assert rebuilt.payload.view(torch.int32).tolist() == changed


def test_the_smaller_of_sparse_and_compressed_xor_goes():
    # Sparse was taken whenever at most a quarter of the words changed, without a look at the compressed XOR: bf16
    # steps went at ~0.32 of the full bytes where the XOR takes ~0.08 (measured by benchmarks/sync/bench_sync_costs).
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    words = torch.arange(4096, dtype=torch.int32) * 65536
    base = _bucket(words.tolist(), version=1)
    decoder.decode(type(base)(*encoder.encode(base)))
    encoder.commit(), decoder.commit()
    changed = words.clone()
    changed[::5] += 1  # a fifth of the words, in their lowest bit: sparse = 0.4 of the bytes, the XOR is ~all zeros
    meta, payload = encoder.encode(_bucket(changed.tolist(), version=2))
    sparse_nbytes = 8 * changed[::5].numel()
    assert meta.delta.kind == "xor_zstd" and meta.nbytes < sparse_nbytes / 4, (meta.delta.kind, meta.nbytes)
    assert decoder.decode(type(base)(meta, payload)).payload.view(torch.int32).tolist() == changed.tolist()


def test_fp32_steps_go_as_compressed_xor_and_bf16_steps_as_sparse_words_bit_identical_every_time():
    for dtype, kind, at_most in ((torch.float32, "xor_zstd", 0.8), (torch.bfloat16, "sparse", 0.1)):
        engine = Engine()
        sender = WeightSender(InProcessTransport(engine.receiver), bucket_bytes=16 * 2**10, delta=True)
        model = _model(dtype=dtype)
        sender.push(list(model.items()))
        assert set(sender.last_push.kinds) == {"full"} and sender.last_push.sent_fraction == 1.0
        for step in range(1, 4):
            model = _step(model, lr=1e-6, seed=step)  # bf16 rounds a 1e-6 move of O(1) weights to no change
            sender.push(list(model.items()))
            stats = sender.last_push
            assert set(stats.kinds) == {kind}, (dtype, stats.kinds)
            assert stats.nbytes <= at_most * stats.full_nbytes, (dtype, stats.sent_fraction)
            _assert_bit_identical(engine.applied[-1], model)
        assert engine.receiver.weight_version == 4


def test_a_restarted_engine_gets_the_update_in_full_and_deltas_resume_after():
    engine = Engine()
    transport = InProcessTransport(engine.receiver)
    sender = WeightSender(transport, bucket_bytes=16 * 2**10, delta=True)
    model = _model()
    sender.push(list(model.items()))
    model = _step(model, 1e-3, seed=1)
    sender.push(list(model.items()))

    restarted = Engine()  # same version counter on the trainer, no bases on the engine
    transport.receiver = restarted.receiver
    model = _step(model, 1e-3, seed=2)
    assert sender.push(list(model.items())) == 3
    assert sender.last_push.full_resends == 1 and set(sender.last_push.kinds) == {"full"}
    _assert_bit_identical(restarted.applied[-1], model)
    model = _step(model, 1e-3, seed=3)
    sender.push(list(model.items()))
    assert set(sender.last_push.kinds) == {"xor_zstd"} and sender.last_push.full_resends == 0
    _assert_bit_identical(restarted.applied[-1], model)


def test_a_corrupt_base_fails_its_checksum_and_the_update_is_resent_in_full():
    engine = Engine()
    sender = WeightSender(InProcessTransport(engine.receiver), bucket_bytes=16 * 2**10, delta=True)
    model = _model()
    sender.push(list(model.items()))
    for base in engine.receiver._delta._bases.values():  # a bit flipped in the engine's copy of the bytes
        base.payload[100] ^= 1
    model = _step(model, 1e-3, seed=1)
    sender.push(list(model.items()))
    assert sender.last_push.full_resends == 1
    _assert_bit_identical(engine.applied[-1], model)


def test_a_rejected_update_keeps_both_sides_on_the_previous_base():
    engine = Engine()
    sender = WeightSender(InProcessTransport(engine.receiver), bucket_bytes=16 * 2**10, delta=True)
    model = _model()
    sender.push(list(model.items()))
    calls = []

    def load(named_tensors):
        calls.append(len(named_tensors))
        if len(calls) == 1:
            raise RuntimeError("engine out of memory")
        engine.load(named_tensors)

    engine.receiver.apply_fn = load
    try:
        sender.push(list(_step(model, 1e-3, seed=1).items()))
        raise AssertionError("the push should have failed")
    except RuntimeError as err:  # WeightUpdateError
        assert "engine out of memory" in str(err) and NEEDS_FULL_UPDATE not in str(err)
    model = _step(model, 1e-3, seed=2)
    sender.push(list(model.items()), version=2)
    assert set(sender.last_push.kinds) == {"xor_zstd"} and sender.last_push.full_resends == 0
    _assert_bit_identical(engine.applied[-1], model)


def test_a_layout_change_is_sent_in_full_and_an_unchanged_model_costs_an_aligned_block_per_bucket():
    engine = Engine()
    sender = WeightSender(InProcessTransport(engine.receiver), bucket_bytes=2**20, delta=True)
    model = _model()
    sender.push(list(model.items()))
    sender.push(list(model.items()))
    assert sender.last_push.kinds == {"sparse": 1} and sender.last_push.nbytes == 64
    grown = {**model, "lm_head.weight": torch.zeros(8, 64)}
    sender.push(list(grown.items()))
    assert set(sender.last_push.kinds) == {"full"} and sender.last_push.full_resends == 0
    _assert_bit_identical(engine.applied[-1], grown)


def test_alignment_padding_is_zero_so_an_unchanged_odd_sized_model_costs_an_aligned_block_per_bucket():
    # The delta sender packed into torch.empty: the padding between odd-sized tensors was whatever memory held, so
    # it could count as changed bytes (and differ between a first send and its full resend).
    engine = Engine()
    sender = WeightSender(InProcessTransport(engine.receiver), bucket_bytes=2**20, delta=True)
    model = {"a": torch.randn(3), "b": torch.randn(5).bfloat16(), "c": torch.arange(7, dtype=torch.int8)}
    sender.push(list(model.items()))
    for _ in range(3):
        torch.full((4096,), 255, dtype=torch.uint8)  # freed memory full of ones, which a torch.empty would reuse
        sender.push(list(model.items()))
        assert sender.last_push.kinds == {"sparse": 3} and sender.last_push.nbytes == 3 * 64  # a bucket per dtype
    _assert_bit_identical(engine.applied[-1], model)


def test_delta_updates_through_shared_memory_reach_another_process_bit_for_bit_with_an_fp8_codec():
    ctx = mp.get_context("spawn")
    sender_conn, receiver_conn = ctx.Pipe()
    results = ctx.Queue()
    process = ctx.Process(target=sync_processes.shared_memory_engine, args=(receiver_conn, results))
    process.start()
    try:
        transport = SharedMemoryTransport(sender_conn, timeout_s=60)
        sender = WeightSender(transport, bucket_bytes=16 * 2**10, codec="fp8", delta=True)
        model = _model()
        sender.push(list(model.items()))
        first = results.get(timeout=60)
        model = _step(model, 1e-2, seed=1)
        sender.push(list(model.items()))
        second = results.get(timeout=60)
        assert "sparse" in sender.last_push.kinds or "xor_zstd" in sender.last_push.kinds
        assert sender.last_push.nbytes < sender.last_push.full_nbytes
        # what an engine decodes from a delta update equals a full fp8 update of the same weights
        reference = Engine()
        WeightSender(InProcessTransport(reference.receiver), bucket_bytes=16 * 2**10, codec="fp8").push(
            list(model.items())
        )
        _assert_bit_identical(second, reference.applied[-1])
        assert not torch.equal(first["layers.0.q_proj.weight"], second["layers.0.q_proj.weight"])
        transport.close()
        assert results.get(timeout=60) == ("closed", 2)
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
