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
