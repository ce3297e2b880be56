"""MultiEngineSender: one sender feeding N engines through per-engine transports, with per-engine versions and delta
bases. In-process receivers for the semantics, three engine processes over shared memory for the real thing (one
killed and restarted mid-run). After every push every engine holds the trainer's tensors bit for bit."""

import copy
import random
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from miles.sync import (
    FanOutError,
    InProcessTransport,
    MultiEngineSender,
    WeightReceiver,
    WeightUpdateError,
)
from miles.sync.delta import NEEDS_FULL_UPDATE, DeltaEncoder
from miles.sync.transports.shared_memory import SharedMemoryTransport

sys.path.insert(0, str(Path(__file__).parent))  # spawned children find sync_processes through the inherited path
import sync_processes  # noqa: E402

NAMES = ("engine0", "engine1", "engine2")


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small random model, 3.1 MiB: fp32 and bf16 weights, a norm and an integer buffer."""
    generator = torch.Generator().manual_seed(seed)
    state = {"embed.weight": torch.randn(1024, 256, generator=generator)}  # 1 MiB
    for i in range(4):
        state[f"layers.{i}.q_proj.weight"] = torch.randn(256, 256, generator=generator)
        state[f"layers.{i}.mlp.weight"] = torch.randn(512, 256, generator=generator).to(torch.bfloat16)
        state[f"layers.{i}.norm.weight"] = torch.ones(256)
    state["step"] = torch.tensor([seed], dtype=torch.int64)
    return state


def _many_small(seed: int = 0) -> dict[str, torch.Tensor]:
    """200 fp32 tensors of 16 KiB (3.1 MiB): with 32 KiB buckets, 100 buckets."""
    generator = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(64, 64, generator=generator) for i in range(200)}


def _step(model: dict[str, torch.Tensor], seed: int, lr: float = 1e-4) -> dict[str, torch.Tensor]:
    """An Adam-like step: every floating element moves by about lr (in fp32, stored in the model's dtype)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    return {
        name: (t.float() - lr * torch.randn(t.shape, generator=generator).sign()).to(t.dtype)
        if t.is_floating_point()
        else t + 1
        for name, t in model.items()
    }


class Engine:
    """An in-process engine: a receiver that copies every applied update into a model of its own."""

    def __init__(self) -> None:
        self.model: dict[str, torch.Tensor] = {}
        self.receiver = WeightReceiver(apply_fn=self.load)
        self.fail_next_apply: str | None = None

    def load(self, named_tensors) -> None:
        if self.fail_next_apply is not None:
            message, self.fail_next_apply = self.fail_next_apply, None
            raise RuntimeError(message)
        for name, tensor in named_tensors:
            self.model[name] = tensor.clone()


def _assert_holds(engine_model: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert engine_model.keys() == sent.keys()
    for name, tensor in sent.items():
        assert engine_model[name].dtype == tensor.dtype, name
        assert torch.equal(engine_model[name].view(torch.uint8), tensor.view(torch.uint8)), name


def _setup(n: int = 3, **kwargs) -> tuple[MultiEngineSender, dict[str, Engine]]:
    engines = {name: Engine() for name in NAMES[:n]}
    sender = MultiEngineSender(
        {name: InProcessTransport(engine.receiver) for name, engine in engines.items()},
        bucket_bytes=kwargs.pop("bucket_bytes", 256 * 2**10),
        **kwargs,
    )
    return sender, engines


def _kind(kinds) -> str:
    """ "full" if every bucket went in full, "delta" if every one went as a delta (sparse or xor_zstd)."""
    kinds = set(kinds)
    return "full" if kinds == {"full"} else "delta" if kinds <= {"sparse", "xor_zstd"} else f"mixed {sorted(kinds)}"


def _kinds(sender: MultiEngineSender) -> dict[str, str]:
    return {name: _kind(stats.kinds) for name, stats in sender.last_push.engines.items()}


def test_without_delta_every_engine_gets_every_update_bit_for_bit_and_tracks_its_version():
    sender, engines = _setup()
    model = _model()
    for step in range(3):
        assert sender.push(list(model.items())) == step + 1
        for engine in engines.values():
            _assert_holds(engine.model, model)
        assert _kinds(sender) == dict.fromkeys(NAMES, "full")
        assert sender.last_push.nbytes == 3 * sender.last_push.full_nbytes
        model = _step(model, seed=step)
    assert sender.versions == dict.fromkeys(NAMES, 3)
    assert all(engine.receiver.weight_version == 3 for engine in engines.values())


def test_a_reset_engine_gets_the_update_in_full_while_the_others_get_the_delta():
    sender, engines = _setup(delta=True)
    model = _model()
    sender.push(list(model.items()))
    assert _kinds(sender) == dict.fromkeys(NAMES, "full")
    model = _step(model, seed=1)
    sender.push(list(model.items()))
    full = sender.last_push.full_nbytes
    assert _kinds(sender) == dict.fromkeys(NAMES, "delta")
    assert all(stats.nbytes < 0.5 * full for stats in sender.last_push.engines.values())

    restarted = Engine()  # a new engine process: empty weights, no delta base
    sender.reset_engine("engine1", InProcessTransport(restarted.receiver))
    assert sender.versions == {"engine0": 2, "engine1": 0, "engine2": 2}
    model = _step(model, seed=2)
    assert sender.push(list(model.items())) == 3
    stats = sender.last_push.engines
    assert _kind(stats["engine1"].kinds) == "full" and stats["engine1"].nbytes == full
    assert not stats["engine1"].full_resend  # it was known to need a full update: no delta was wasted on it
    for name in ("engine0", "engine2"):
        assert _kind(stats[name].kinds) == "delta" and stats[name].nbytes < 0.5 * full
    _assert_holds(restarted.model, model)
    for name in ("engine0", "engine2"):
        _assert_holds(engines[name].model, model)
    assert sender.versions == dict.fromkeys(NAMES, 3)

    model = _step(model, seed=3)  # the restarted engine holds the base now
    sender.push(list(model.items()))
    assert _kinds(sender) == dict.fromkeys(NAMES, "delta")
    _assert_holds(restarted.model, model)


def test_a_restart_the_sender_was_not_told_about_is_caught_by_the_base_check_and_resent_to_that_engine_only():
    sender, engines = _setup(delta=True)
    model = _model()
    sender.push(list(model.items()))
    restarted = Engine()
    sender.transport("engine2").receiver = restarted.receiver  # behind the sender's back
    model = _step(model, seed=1)
    assert sender.push(list(model.items())) == 2
    stats = sender.last_push.engines
    assert stats["engine2"].full_resend and _kind(stats["engine2"].kinds) == "full"
    assert stats["engine2"].nbytes == sender.last_push.full_nbytes
    for name in ("engine0", "engine1"):
        assert not stats[name].full_resend and _kind(stats[name].kinds) == "delta"
        _assert_holds(engines[name].model, model)
    _assert_holds(restarted.model, model)
    assert sender.versions == dict.fromkeys(NAMES, 2)


def test_a_lone_engine_restarted_behind_the_senders_back_gets_the_whole_update_in_full_and_deltas_resume():
    sender, engines = _setup(n=1, delta=True, bucket_bytes=64 * 2**10)
    model = _model()
    sender.push(list(model.items()))
    restarted = Engine()
    sender.transport("engine0").receiver = restarted.receiver  # it rejects the first delta bucket
    model = _step(model, seed=1)
    sender.push(list(model.items()))
    stats = sender.last_push.engines["engine0"]
    assert stats.full_resend and _kind(stats.kinds) == "full" and stats.nbytes == sender.last_push.full_nbytes
    _assert_holds(restarted.model, model)
    model = _step(model, seed=2)
    sender.push(list(model.items()))
    assert _kinds(sender) == {"engine0": "delta"}
    _assert_holds(restarted.model, model)


@pytest.mark.parametrize("where", ["apply", "send"])
def test_a_failing_engine_is_named_the_others_commit_and_it_catches_up_in_full_next_push(where):
    sender, engines = _setup(delta=True)
    model = _model()
    sender.push(list(model.items()))
    v1 = dict(model)

    class DroppingLink(InProcessTransport):
        broken = False

        def send(self, bucket):
            if self.broken and bucket.meta.index == 2:
                raise ConnectionError("link to engine1 reset")
            super().send(bucket)

    if where == "apply":
        engines["engine1"].fail_next_apply = "engine out of memory"
    else:
        sender.reset_engine("engine1", DroppingLink(engines["engine1"].receiver))
        sender.push(list(model.items()))  # engine1 gets v2 in full; the link breaks from v3 on
        sender.transport("engine1").broken = True
    before = sender.versions["engine1"]
    model = _step(model, seed=1)
    with pytest.raises(FanOutError) as raised:
        sender.push(list(model.items()))
    err = raised.value
    version = sender.version
    assert isinstance(err, WeightUpdateError) and err.version == version
    assert list(err.failed) == ["engine1"] and err.committed == ["engine0", "engine2"]
    reason = "engine out of memory" if where == "apply" else "ConnectionError: link to engine1 reset"
    assert reason in err.failed["engine1"] and "engine 'engine1'" in str(err) and reason in str(err)
    assert sender.versions == {"engine0": version, "engine1": before, "engine2": version}
    assert engines["engine1"].receiver.weight_version == before  # kept its old weights, whole
    _assert_holds(engines["engine1"].model, v1)
    assert sender.last_push.failed == {"engine1": err.failed["engine1"]}
    copied = copy.deepcopy(err)  # the reduce protocol pickling uses: it crosses process (Ray actor) boundaries
    assert str(copied) == str(err) and copied.failed == err.failed and copied.committed == err.committed
    for name in ("engine0", "engine2"):
        _assert_holds(engines[name].model, model)

    if where == "send":
        sender.transport("engine1").broken = False
    model = _step(model, seed=2)
    assert sender.push(list(model.items())) == version + 1
    stats = sender.last_push.engines
    assert _kind(stats["engine1"].kinds) == "full" and not stats["engine1"].full_resend
    assert _kind(stats["engine0"].kinds) == _kind(stats["engine2"].kinds) == "delta"
    for engine in engines.values():
        _assert_holds(engine.model, model)
    assert sender.versions == dict.fromkeys(NAMES, version + 1)


def test_when_every_engine_fails_the_bases_stay_and_the_next_push_is_still_a_delta():
    sender, engines = _setup(n=2, delta=True)
    model = _model()
    sender.push(list(model.items()))
    for engine in engines.values():
        engine.fail_next_apply = "disk full"
    with pytest.raises(FanOutError, match="failed on 2 of 2 engine.*no engine applied it") as raised:
        sender.push(list(_step(model, seed=1).items()))
    assert raised.value.committed == [] and sender.versions == {"engine0": 1, "engine1": 1} and sender.version == 2
    # A failed engine's base is unknown to the sender (it may have applied the update unacknowledged): full again.
    model = _step(model, seed=2)
    assert sender.push(list(model.items())) == 3
    assert _kinds(sender) == {"engine0": "full", "engine1": "full"}
    for engine in engines.values():
        _assert_holds(engine.model, model)


def test_a_sender_crash_mid_update_aborts_every_engine_and_keeps_their_bases():
    sender, engines = _setup(delta=True, bucket_bytes=64 * 2**10)
    model = _model()
    sender.push(list(model.items()))

    def crashing():
        for i, item in enumerate(_step(model, seed=1).items()):
            if i == 5:
                raise RuntimeError("trainer died while gathering")
            yield item

    with pytest.raises(RuntimeError, match="trainer died"):
        sender.push(crashing())
    assert all(engine.receiver.weight_version == 1 for engine in engines.values())
    assert sender.versions == dict.fromkeys(NAMES, 1)
    model = _step(model, seed=2)
    sender.push(list(model.items()))
    assert _kinds(sender) == dict.fromkeys(NAMES, "delta")
    for engine in engines.values():
        _assert_holds(engine.model, model)


def test_concurrent_sends_keep_each_engines_buckets_in_order_intact_and_encode_each_bucket_once(monkeypatch):
    """100 buckets of 32 KiB, sends that sleep at random: the engines' sends overlap, yet each engine sees its
    buckets in order and the delta engines all get the same bytes, encoded once."""
    calls = []
    original_encode = DeltaEncoder.encode
    monkeypatch.setattr(DeltaEncoder, "encode", lambda self, bucket: calls.append(1) or original_encode(self, bucket))
    lock = threading.Lock()
    active, overlaps = [0], [0]

    class Jittery(InProcessTransport):
        def __init__(self, receiver, seed):
            super().__init__(receiver)
            self.rng, self.seen = random.Random(seed), []

        def send(self, bucket):
            with lock:
                active[0] += 1
                overlaps[0] += active[0] > 1
            time.sleep(self.rng.random() * 1e-3)
            with lock:
                active[0] -= 1
            self.seen.append((bucket.meta.index, bucket.meta.delta.kind, bucket.payload.clone()))
            super().send(bucket)

    engines = {name: Engine() for name in NAMES}
    transports = {name: Jittery(engine.receiver, seed) for seed, (name, engine) in enumerate(engines.items())}
    sender = MultiEngineSender(transports, bucket_bytes=32 * 2**10, delta=True)
    model = _many_small()
    sender.push(list(model.items()))
    restarted = Engine()
    sender.reset_engine("engine1", Jittery(restarted.receiver, seed=7))
    for transport in transports.values():
        transport.seen.clear()
    calls.clear()
    model = _step(model, seed=1)
    sender.push(list(model.items()))

    num_buckets = sender.last_push.num_buckets
    assert num_buckets == 100 and len(calls) == num_buckets  # one encode per bucket, not per engine
    assert overlaps[0] > 0  # sends to different engines ran at the same time
    seen = {name: sender.transport(name).seen for name in NAMES}
    for name in NAMES:
        assert [index for index, _, _ in seen[name]] == list(range(num_buckets)), name
    assert {kind for _, kind, _ in seen["engine1"]} == {"full"}
    assert {kind for _, kind, _ in seen["engine0"]} - {"full"}  # deltas (a bucket may be smaller in full)
    for (_, _, a), (_, _, b) in zip(seen["engine0"], seen["engine2"], strict=True):
        assert torch.equal(a, b)  # the same delta bytes to both
    for engine in (engines["engine0"], restarted, engines["engine2"]):
        _assert_holds(engine.model, model)


def test_one_worker_thread_sends_the_same_updates():
    sender, engines = _setup(delta=True, max_workers=1)
    model = _model()
    for step in range(3):
        sender.push(list(model.items()))
        for engine in engines.values():
            _assert_holds(engine.model, model)
        model = _step(model, seed=step)
    assert _kinds(sender) == dict.fromkeys(NAMES, "delta")


def test_a_lacking_base_with_a_one_shot_iterator_names_the_engine_and_the_fix():
    sender, engines = _setup(n=2, delta=True)
    model = _model()
    sender.push(list(model.items()))
    sender.transport("engine1").receiver = Engine().receiver
    with pytest.raises(FanOutError, match=f"engine 'engine1': .*{NEEDS_FULL_UPDATE}.*re-iterable") as raised:
        sender.push(iter(list(_step(model, seed=1).items())))
    assert raised.value.committed == ["engine0"] and sender.versions == {"engine0": 2, "engine1": 1}


def test_engine_management_and_bad_arguments():
    sender, engines = _setup(n=2)
    with pytest.raises(ValueError, match="already exists"):
        sender.add_engine("engine0", InProcessTransport(Engine().receiver))
    with pytest.raises(KeyError, match="no engine 'nope'; the engines are"):
        sender.reset_engine("nope")
    late = Engine()
    sender.push([("w", torch.ones(4))])
    sender.add_engine("late", InProcessTransport(late.receiver))
    assert sender.versions == {"engine0": 1, "engine1": 1, "late": 0}
    sender.push([("w", torch.full((4,), 2.0))])
    assert sender.versions == {"engine0": 2, "engine1": 2, "late": 2} and torch.equal(
        late.model["w"], torch.full((4,), 2.0)
    )
    assert isinstance(sender.remove_engine("engine1"), InProcessTransport) and sender.engines == ["engine0", "late"]
    with pytest.raises(ValueError, match="push version 2 is not newer"):
        sender.push([("w", torch.ones(4))], version=2)
    assert sender.push([("w", torch.ones(4))], version=10) == 10
    with pytest.raises(ValueError, match="no engines"):
        MultiEngineSender({}).push([("w", torch.ones(4))])
    with pytest.raises(ValueError, match="max_workers is 0"):
        MultiEngineSender({}, max_workers=0)


def _expect_reports(results, names, version, model) -> None:
    """Each engine in ``names`` reports once, on its own queue, that it applied ``version`` and holds ``model`` bit
    for bit."""
    want = sync_processes.tensor_digests(model.items())
    reports = {}
    for name in names:
        reported, applied, digests = results[name].get(timeout=60)
        reports[reported] = (applied, digests == want)
    assert reports == dict.fromkeys(names, (version, True))


@pytest.mark.integration
def test_three_engine_processes_over_shared_memory_with_one_killed_and_restarted_mid_run():
    ctx = mp.get_context("spawn")
    # A queue per engine: a process killed while its queue's feeder thread holds the queue's lock leaves that lock
    # taken, so a shared queue would hang the other engines' reports (as one CI run did).
    results = {}

    def start(name):
        sender_conn, engine_conn = ctx.Pipe()
        results[name] = ctx.Queue()
        process = ctx.Process(target=sync_processes.shared_memory_model_engine, args=(name, engine_conn, results[name]))
        process.start()
        engine_conn.close()  # the child's end: a dead child then closes the connection for good
        return process, SharedMemoryTransport(sender_conn, timeout_s=180)  # spawning torch is slow on a busy machine

    processes, transports = {}, {}
    for name in NAMES:
        processes[name], transports[name] = start(name)
    sender = MultiEngineSender(transports, bucket_bytes=512 * 2**10, delta=True)
    try:
        model = _model()
        assert sender.push(list(model.items())) == 1
        _expect_reports(results, NAMES, 1, model)
        full = sender.last_push.full_nbytes
        assert _kinds(sender) == dict.fromkeys(NAMES, "full") and full > 3 * 2**20

        model = _step(model, seed=1)
        sender.push(list(model.items()))
        _expect_reports(results, NAMES, 2, model)
        assert _kinds(sender) == dict.fromkeys(NAMES, "delta")
        assert all(stats.nbytes < 0.5 * full for stats in sender.last_push.engines.values())

        processes["engine1"].kill()  # mid-run: the next push fails on it alone, and names it
        processes["engine1"].join(timeout=30)
        model = _step(model, seed=2)
        with pytest.raises(FanOutError) as raised:
            sender.push(list(model.items()))
        assert list(raised.value.failed) == ["engine1"] and raised.value.committed == ["engine0", "engine2"]
        assert "engine 'engine1'" in str(raised.value)
        _expect_reports(results, ("engine0", "engine2"), 3, model)
        assert sender.versions == {"engine0": 3, "engine1": 2, "engine2": 3}

        processes["engine1"], new_transport = start("engine1")  # a new process with empty weights
        sender.reset_engine("engine1", new_transport)
        model = _step(model, seed=3)
        assert sender.push(list(model.items())) == 4
        _expect_reports(results, NAMES, 4, model)
        stats = sender.last_push.engines
        assert _kind(stats["engine1"].kinds) == "full" and stats["engine1"].nbytes == full
        for name in ("engine0", "engine2"):
            assert _kind(stats[name].kinds) == "delta" and stats[name].nbytes < 0.5 * full
        assert sender.versions == dict.fromkeys(NAMES, 4)

        model = _step(model, seed=4)
        sender.push(list(model.items()))
        _expect_reports(results, NAMES, 5, model)
        assert _kinds(sender) == dict.fromkeys(NAMES, "delta")

        sender.close()
        closed = {results[name].get(timeout=60)[1:] for name in NAMES}
        assert closed == {(name, 5) for name in NAMES}
    finally:
        for process in processes.values():
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
