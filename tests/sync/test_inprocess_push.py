import threading

import pytest
import torch
from miles.sync import InProcessTransport, WeightReceiver, WeightSender, WeightUpdateError
from miles.sync.bucket import Bucket


def _model_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed_tokens.weight": torch.randn(64, 16, generator=generator),
        "layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=generator).to(torch.bfloat16),
        "layers.0.mlp.down_proj.weight": torch.randn(16, 32, generator=generator),
        "layers.0.input_layernorm.weight": torch.ones(16),
        "rotary.inv_freq": torch.arange(8, dtype=torch.float64),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
    }


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []

    def __call__(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.calls.append({name: tensor.clone() for name, tensor in named_tensors})


def _assert_bitwise_equal(received: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert received.keys() == sent.keys()
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype, name
        assert received[name].shape == tensor.shape, name
        assert torch.equal(received[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_receiver_starts_at_version_zero():
    assert WeightReceiver(apply_fn=_Recorder()).weight_version == 0


@pytest.mark.parametrize("bucket_bytes", [64, 1024, 512 * 2**20], ids=["one_tensor_per_bucket", "small", "default"])
def test_identity_push_delivers_every_tensor_bit_for_bit_in_one_apply_call(bucket_bytes):
    state = _model_state()
    apply = _Recorder()
    receiver = WeightReceiver(apply_fn=apply)
    sender = WeightSender(InProcessTransport(receiver), bucket_bytes=bucket_bytes, codec="identity")

    version = sender.push(state.items())

    assert version == 1 and receiver.weight_version == 1
    assert len(apply.calls) == 1
    _assert_bitwise_equal(apply.calls[0], state)


def test_versions_increase_by_one_per_push():
    receiver = WeightReceiver(apply_fn=_Recorder())
    sender = WeightSender(InProcessTransport(receiver))
    versions = [sender.push(_model_state().items()) for _ in range(3)]
    assert versions == [1, 2, 3]
    assert receiver.weight_version == 3


def test_push_of_a_module_state_dict_updates_a_second_module_exactly():
    torch.manual_seed(0)
    trainer_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    engine_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))

    def load(named_tensors):
        engine_model.load_state_dict(dict(named_tensors))

    receiver = WeightReceiver(apply_fn=load)
    WeightSender(InProcessTransport(receiver), bucket_bytes=256).push(trainer_model.state_dict().items())

    inputs = torch.randn(4, 8)
    assert torch.equal(engine_model(inputs), trainer_model(inputs))


def test_non_contiguous_tensors_arrive_with_their_logical_values():
    base = torch.arange(12.0).view(3, 4)
    apply = _Recorder()
    receiver = WeightReceiver(apply_fn=apply)
    WeightSender(InProcessTransport(receiver)).push([("transposed", base.t()), ("strided", base[:, ::2])])
    assert torch.equal(apply.calls[0]["transposed"], base.t())
    assert torch.equal(apply.calls[0]["strided"], base[:, ::2])


def test_buckets_never_mix_source_dtypes_and_respect_the_size_limit():
    buckets: list[Bucket] = []

    class Spy(InProcessTransport):
        def send(self, bucket):
            buckets.append(bucket)
            super().send(bucket)

    state = {f"w{i}": torch.zeros(16, dtype=torch.float32 if i % 2 else torch.bfloat16) for i in range(8)}
    # Each tensor packs to 64 bytes (float32 16 x 4 = 64, bf16 16 x 2 = 32 -> aligned to 64); 128 fits two.
    WeightSender(Spy(WeightReceiver(apply_fn=_Recorder())), bucket_bytes=128).push(state.items())

    assert len(buckets) == 4
    for bucket in buckets:
        assert {tensor.dtype for tensor in bucket.meta.tensors} == {bucket.meta.dtype}
        assert bucket.meta.nbytes <= 128
    assert [bucket.meta.index for bucket in buckets] == [0, 1, 2, 3]


def test_identity_bucket_payload_is_the_flattened_tensors_of_its_dtype():
    buckets: list[Bucket] = []

    class Spy(InProcessTransport):
        def send(self, bucket):
            buckets.append(bucket)
            super().send(bucket)

    a, b = torch.arange(16.0), torch.arange(16.0, 48.0)  # 64 and 128 bytes: both already aligned
    WeightSender(Spy(WeightReceiver(apply_fn=_Recorder()))).push([("a", a), ("b", b)])
    assert torch.equal(buckets[0].payload.view(torch.float32), torch.cat([a, b]))


def test_a_failed_bucket_keeps_the_old_version_and_names_the_bucket():
    apply = _Recorder()
    receiver = WeightReceiver(apply_fn=apply)

    class Truncating(InProcessTransport):
        def send(self, bucket):
            if bucket.meta.index == 1:
                bucket = Bucket(bucket.meta, bucket.payload[:-1])
            super().send(bucket)

    sender = WeightSender(InProcessTransport(receiver), bucket_bytes=64)
    assert sender.push(_model_state().items()) == 1
    sender.transport = Truncating(receiver)

    with pytest.raises(WeightUpdateError, match=r"bucket 1 of update v2 .*payload is \(\d+,\) torch.uint8"):
        sender.push(_model_state().items())

    assert receiver.weight_version == 1
    assert sender.version == 1
    assert len(apply.calls) == 1


def test_a_lost_bucket_is_detected_and_the_update_not_applied():
    apply = _Recorder()
    receiver = WeightReceiver(apply_fn=apply)

    class Dropping(InProcessTransport):
        def send(self, bucket):
            if bucket.meta.index != 2:
                super().send(bucket)

    with pytest.raises(WeightUpdateError, match="bucket 3 of update v1 rejected: expected bucket 2 next"):
        WeightSender(Dropping(receiver), bucket_bytes=64).push(_model_state().items())
    assert receiver.weight_version == 0 and apply.calls == []


def test_a_sender_crash_mid_update_aborts_without_applying():
    apply = _Recorder()
    receiver = WeightReceiver(apply_fn=apply)

    def crashing_tensors():
        yield "a", torch.zeros(64)
        yield "b", torch.zeros(64)
        raise RuntimeError("trainer died while gathering")

    with pytest.raises(RuntimeError, match="trainer died"):
        WeightSender(InProcessTransport(receiver), bucket_bytes=256).push(crashing_tensors())
    assert receiver.weight_version == 0 and apply.calls == []
    # The receiver accepts the next complete update.
    assert WeightSender(InProcessTransport(receiver)).push([("a", torch.ones(64))]) == 1


def test_an_apply_fn_error_is_reported_and_the_version_stays():
    def failing_load(named_tensors):
        raise KeyError("model has no parameter 'a'")

    receiver = WeightReceiver(apply_fn=failing_load)
    with pytest.raises(WeightUpdateError, match="apply_fn failed on update v1 .*no parameter 'a'"):
        WeightSender(InProcessTransport(receiver)).push([("a", torch.ones(2))])
    assert receiver.weight_version == 0


def test_a_duplicate_name_in_one_update_is_rejected():
    receiver = WeightReceiver(apply_fn=_Recorder())
    with pytest.raises(WeightUpdateError, match="tensor 'a' was already received"):
        WeightSender(InProcessTransport(receiver)).push([("a", torch.ones(2)), ("a", torch.ones(2))])
    assert receiver.weight_version == 0


def test_a_stale_version_is_rejected_by_the_receiver():
    receiver = WeightReceiver(apply_fn=_Recorder())
    WeightSender(InProcessTransport(receiver)).push([("a", torch.ones(2))])
    with pytest.raises(WeightUpdateError, match="update v1 is not newer than the applied weights v1"):
        WeightSender(InProcessTransport(receiver)).push([("a", torch.ones(2))])


def test_retries_resend_a_failed_update_from_the_start():
    apply = _Recorder()
    receiver = WeightReceiver(apply_fn=apply)
    failures = [1]

    class FlakyOnce(InProcessTransport):
        def send(self, bucket):
            if failures and bucket.meta.index == 1:
                failures.pop()
                raise ConnectionError("link reset")
            super().send(bucket)

    state = _model_state()
    version = WeightSender(FlakyOnce(receiver), bucket_bytes=64, retries=1).push(list(state.items()))
    assert version == 1 and receiver.weight_version == 1
    _assert_bitwise_equal(apply.calls[0], state)


def test_receiver_places_decoded_tensors_on_its_device():
    apply = _Recorder()
    receiver = WeightReceiver(apply_fn=apply, device="meta")
    WeightSender(InProcessTransport(receiver)).push([("a", torch.ones(3))])
    assert apply.calls[0]["a"].device.type == "meta"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"bucket_bytes": 0}, "bucket_bytes is 0", id="zero_bucket"),
        pytest.param({"retries": -1}, "retries is -1", id="negative_retries"),
        pytest.param({"codec": "fp3"}, "codec is 'fp3'", id="unknown_codec"),
    ],
)
def test_sender_rejects_bad_settings_with_the_value_received(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightSender(InProcessTransport(WeightReceiver(apply_fn=_Recorder())), **kwargs)


def _layers(step: int, *, mlp: int = 32, num_layers: int = 3) -> dict[str, torch.Tensor]:
    """float32 weights whose values encode (step, layer, element), so a stale or shifted byte shows."""
    state = {}
    for layer in range(num_layers):
        base = 1000.0 * step + 100.0 * layer
        state[f"layers.{layer}.mlp.weight"] = base + torch.arange(16 * mlp, dtype=torch.float32).view(16, mlp)
        state[f"layers.{layer}.norm.weight"] = base + torch.arange(16, dtype=torch.float32)
    return state


def test_host_bucket_slots_are_reused_across_pushes_and_regrown_when_a_shape_grows():
    apply = _Recorder()
    transport = InProcessTransport(WeightReceiver(apply_fn=apply))
    # Per layer 16 x 32 float32 (2048 bytes) + 16 float32 (64 bytes): one layer per 2112-byte bucket.
    sender = WeightSender(transport, bucket_bytes=2112)

    sender.push(_layers(1).items())
    first = [slot.data_ptr() for slot in transport.slots]
    sender.push(_layers(2).items())

    assert len(first) == 3 and [slot.data_ptr() for slot in transport.slots] == first  # no new buffers
    _assert_bitwise_equal(apply.calls[1], _layers(2))

    sender.bucket_bytes = 4160  # still one layer per bucket: 16 x 64 x 4 + 64 bytes, outgrowing every slot
    sender.push(_layers(3, mlp=64).items())
    assert [slot.numel() for slot in transport.slots] == [4160] * 3
    assert not set(first) & {slot.data_ptr() for slot in transport.slots}  # each slot was reallocated
    _assert_bitwise_equal(apply.calls[2], _layers(3, mlp=64))

    sender.push(_layers(4, num_layers=1).items())  # one bucket now: the other two slots are freed
    assert len(transport.slots) == 1
    _assert_bitwise_equal(apply.calls[3], _layers(4, num_layers=1))


class _OverlappedInProcess(InProcessTransport):
    """Lets the sender overlap: records what each send saw, and proves bucket k+1 was allocated during send k."""

    overlap_send = True

    def __init__(self, receiver: WeightReceiver, num_buckets: int, *, wait_for_next: bool) -> None:
        super().__init__(receiver)
        self.wait_for_next = wait_for_next
        self.allocated = [threading.Event() for _ in range(num_buckets)]
        self.sent: list[tuple[str, object, torch.Tensor]] = []  # (thread name, meta, payload copy)
        self.overlapped: list[bool] = []

    def begin(self, version: int) -> None:
        for event in self.allocated:
            event.clear()
        super().begin(version)

    def allocate(self, nbytes, device):
        self.allocated[self._next_slot].set()
        return super().allocate(nbytes, device)

    def send(self, bucket):
        self.sent.append((threading.current_thread().name, bucket.meta, bucket.payload.clone()))
        if self.wait_for_next and bucket.meta.index + 1 < len(self.allocated):
            self.overlapped.append(self.allocated[bucket.meta.index + 1].wait(timeout=10))
        super().send(bucket)


def test_overlapped_sends_deliver_the_same_bytes_as_serial_sends_while_the_next_bucket_is_packed():
    serial_apply, overlapped_apply = _Recorder(), _Recorder()
    serial = _OverlappedInProcess(WeightReceiver(apply_fn=serial_apply), num_buckets=3, wait_for_next=False)
    overlapped = _OverlappedInProcess(WeightReceiver(apply_fn=overlapped_apply), num_buckets=3, wait_for_next=True)
    serial_sender = WeightSender(serial, bucket_bytes=2112, overlap_send=False)
    overlapped_sender = WeightSender(overlapped, bucket_bytes=2112)

    for step in (1, 2):
        serial_sender.push(_layers(step).items())
        overlapped_sender.push(_layers(step).items())

    assert [meta for _, meta, _ in overlapped.sent] == [meta for _, meta, _ in serial.sent]
    for (_, _, got), (_, _, want) in zip(overlapped.sent, serial.sent, strict=True):
        assert torch.equal(got, want)
    assert {thread for thread, _, _ in overlapped.sent} == {"miles-sync-send_0"}
    assert {thread for thread, _, _ in serial.sent} == {threading.main_thread().name}
    assert overlapped.overlapped == [True, True] * 2  # buckets 1 and 2 were allocated while 0 and 1 were sent
    _assert_bitwise_equal(overlapped_apply.calls[1], _layers(2))
    assert overlapped_sender.last_push.num_buckets == 3 and overlapped_sender.last_push.full_nbytes == 3 * 2112


def test_an_overlapped_send_that_fails_aborts_the_update_with_the_receivers_message():
    apply = _Recorder()
    receiver = WeightReceiver(apply_fn=apply)

    class Dropping(InProcessTransport):
        overlap_send = True

        def send(self, bucket):
            if bucket.meta.index != 2:
                super().send(bucket)

    sender = WeightSender(Dropping(receiver), bucket_bytes=64)
    with pytest.raises(WeightUpdateError, match="bucket 3 of update v1 rejected: expected bucket 2 next"):
        sender.push(_model_state().items())
    assert receiver.weight_version == 0 and apply.calls == [] and sender.version == 0
    sender.transport = InProcessTransport(receiver)
    assert sender.push(_model_state().items()) == 1
    _assert_bitwise_equal(apply.calls[0], _model_state())
