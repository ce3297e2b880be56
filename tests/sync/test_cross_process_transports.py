import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from miles.sync import WeightSender, WeightUpdateError
from miles.sync.transports.shared_memory import SharedMemoryTransport

sys.path.insert(0, str(Path(__file__).parent))  # spawned children find sync_processes through the inherited path
import sync_processes  # noqa: E402

pytestmark = pytest.mark.integration


def _assert_same(received: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert received.keys() == sent.keys()
    for name in sent:
        assert received[name].dtype == sent[name].dtype and torch.equal(received[name], sent[name]), name


def test_shared_memory_updates_reach_another_process_bit_for_bit_and_slots_persist():
    context = mp.get_context("spawn")
    sender_conn, engine_conn = context.Pipe()
    results = context.Queue()
    engine = context.Process(target=sync_processes.shared_memory_engine, args=(engine_conn, results))
    engine.start()
    try:
        transport = SharedMemoryTransport(sender_conn, timeout_s=60)
        sender = WeightSender(transport, bucket_bytes=256)

        assert sender.push(sync_processes.small_state(1).items()) == 1
        _assert_same(results.get(timeout=60), sync_processes.small_state(1))
        first_slots = [slot.data_ptr() for slot in transport.slots]

        assert sender.push(sync_processes.small_state(2).items()) == 2
        _assert_same(results.get(timeout=60), sync_processes.small_state(2))
        assert [slot.data_ptr() for slot in transport.slots] == first_slots  # same buffers, no reallocation

        rejected = {**sync_processes.small_state(3), "bogus": torch.zeros(2)}
        with pytest.raises(WeightUpdateError, match="receiver 0: apply_fn failed on update v3 .*no parameter 'bogus'"):
            sender.push(rejected.items())
        assert sender.version == 2

        assert sender.push(sync_processes.small_state(3, wide=True).items()) == 3  # outgrows slot 0
        _assert_same(results.get(timeout=60), sync_processes.small_state(3, wide=True))

        transport.close()
        assert results.get(timeout=60) == ("closed", 3)
    finally:
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    assert engine.exitcode == 0


def test_shared_memory_commit_times_out_when_no_endpoint_serves():
    sender_conn, _engine_conn = mp.get_context("spawn").Pipe()
    sender = WeightSender(SharedMemoryTransport(sender_conn, timeout_s=0.2))
    with pytest.raises(TimeoutError, match="did not acknowledge update v1 within 0.2s"):
        sender.push([("a", torch.ones(4))])
    assert sender.version == 0


@pytest.mark.parametrize(
    "world_size", [2, pytest.param(3, marks=pytest.mark.slow, id="two_engine_ranks")], ids=lambda n: f"{n}_ranks"
)
def test_gloo_broadcast_delivers_updates_to_every_engine_rank(tmp_path, world_size):
    context = mp.get_context("spawn")
    results = context.Queue()
    init_file = str(tmp_path / "init")
    ranks = [
        context.Process(target=sync_processes.gloo_rank, args=(rank, world_size, init_file, results))
        for rank in range(world_size)
    ]
    for process in ranks:
        process.start()
    try:
        reports = {}
        for _ in range(world_size):
            report = results.get(timeout=120)
            reports[report[0]] = report[1:]
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()

    assert reports["sender"] == ([1, 2, 3],)
    for rank in range(1, world_size):
        assert reports[f"engine{rank}"] == (3, [True, True, True])


def test_a_weight_group_reaches_engine_ranks_without_a_default_group_beside_the_trainers_own(tmp_path):
    """The trainer keeps its default (FSDP) world of 1; two engine processes with no process group of their own
    join a separate weight group and receive both updates bit for bit."""
    from miles.rollout.engines.server import free_port

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=sync_processes.weight_group_rank, args=(rank, 3, port, str(tmp_path / "init"), results))
        for rank in range(3)
    ]
    for process in ranks:
        process.start()
    try:
        reports = {}
        for _ in range(3):
            report = results.get(timeout=120)
            reports[report[0]] = report[1:]
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert reports["sender"] == ([1, 2], 1)  # the trainer's own world is untouched
    assert reports["engine1"] == reports["engine2"] == (2, [True, True], False)
