"""ProcessPoolReward: a reward that hangs, exits, segfaults or over-allocates fails its sample with a counted kind,
the pool replaces the worker and keeps scoring; good rewards score exactly as in-process, in order.

One module-wide pool (2 workers, 1 s per call, 256 MiB) serves most tests: the first start launches the fork
server, which imports torch (a few seconds); a replaced worker starts in well under a second.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from miles.core.reward_pool import ProcessPoolReward
from miles.core.rewards import FAILURE_KINDS, RewardWorkerError, failure_counts, score_samples
from miles.core.sample import Sample, SampleStatus
from miles.rollout.config import RewardConfig
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).parent))  # workers find reward_plugins through the parent's sys.path
import reward_plugins  # noqa: E402

TIMEOUT_S = 1.0


def _samples(labels, status=SampleStatus.COMPLETED):
    return [
        Sample(index=i, group_index=i // 2, prompt="", label=label, response_text="x" * (i + 1), status=status)
        for i, label in enumerate(labels)
    ]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def pool():
    with ProcessPoolReward(
        "reward_plugins:behaved", num_workers=2, timeout_s=TIMEOUT_S, memory_limit_mib=256
    ) as reward_pool:
        yield reward_pool


def test_a_hanging_reward_times_out_within_its_limit_and_the_pool_keeps_scoring(pool):
    samples = _samples([1.0, "hang", 2.0, 3.0])
    t0 = time.perf_counter()
    assert score_samples(samples, pool) == 1
    elapsed = time.perf_counter() - t0
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1.0  # the hung call is killed at its deadline, not at sleep(60)'s end
    assert samples[1].status == SampleStatus.FAILED and samples[1].reward is None
    assert samples[1].metadata["failure_kind"] == "reward_timeout"
    assert samples[1].metadata["failure"] == "reward timed out after 1s (reward.timeout_s); its worker was replaced"
    assert [samples[i].reward for i in (0, 2, 3)] == [1.0, 2.0, 3.0]  # scored by the other worker meanwhile

    again = _samples([4.0, 5.0, 6.0])  # the replacement worker scores too
    assert score_samples(again, pool) == 0
    assert [s.reward for s in again] == [4.0, 5.0, 6.0]
    assert len(pool.worker_pids) == 2 and all(_alive(pid) for pid in pool.worker_pids)


@pytest.mark.parametrize(
    "label, reason",
    [
        pytest.param("exit3", "reward worker died (exit code 3); it was replaced", id="os_exit_3"),
        pytest.param("segfault", "reward worker died (signal SIGSEGV); it was replaced", id="segfault"),
    ],
)
def test_a_reward_that_kills_its_worker_fails_only_its_sample_and_the_worker_is_replaced(pool, label, reason):
    before, restarts = set(pool.worker_pids), pool.num_restarts
    samples = _samples([0.5, label, 1.5])
    assert score_samples(samples, pool) == 1
    assert (samples[1].metadata["failure_kind"], samples[1].metadata["failure"]) == ("reward_crash", reason)
    assert [samples[0].reward, samples[2].reward] == [0.5, 1.5]
    assert pool.num_restarts == restarts + 1
    assert len(set(pool.worker_pids) - before) == 1  # exactly the dead worker was replaced
    again = _samples([7.0, 8.0])
    assert score_samples(again, pool) == 0 and [s.reward for s in again] == [7.0, 8.0]


def test_an_allocation_past_the_memory_limit_fails_with_reward_memory_and_smaller_ones_succeed(pool):
    # 1 GiB > the 256 MiB limit: RLIMIT_AS makes the allocation raise MemoryError in the worker (no OS kill);
    # 16 MiB fits, so the limit is headroom above the worker's start-up size, not its absolute size.
    samples = _samples(["allocate:1024", "allocate:16", 2.5])
    assert score_samples(samples, pool) == 1
    assert samples[0].metadata["failure_kind"] == "reward_memory"
    assert samples[0].metadata["failure"] == "reward exceeded the memory limit of 256 MiB (reward.memory_limit_mib)"
    assert [samples[1].reward, samples[2].reward] == [16.0, 2.5]


def test_pool_results_equal_in_process_scoring_in_order_failure_reasons_included(pool):
    labels = [0.25, "raise", 3, "nan", "none", -1.5, 2.0, 0.0]
    in_process, pooled = _samples(labels), _samples(labels)
    for batch in (in_process, pooled):  # not scored: engine-failed and aborted samples
        batch[6].status, batch[6].metadata["failure"] = SampleStatus.FAILED, "engine error"
        batch[7].status = SampleStatus.ABORTED
    assert score_samples(pooled, pool) == score_samples(in_process, reward_plugins.behaved) == 4
    fields = [(s.status, s.reward, s.metadata) for s in in_process]
    assert [(s.status, s.reward, s.metadata) for s in pooled] == fields
    assert [s.reward for s in pooled[:6]] == [0.25, None, 3.0, None, None, -1.5]
    assert pooled[1].metadata == {"failure_kind": "reward_error", "failure": "reward function raised KeyError: 'label'"}


def test_scoring_from_a_non_main_thread_enforces_the_timeout(pool):
    samples = _samples(["hang", 9.0])
    result = {}
    thread = threading.Thread(target=lambda: result.update(failed=score_samples(samples, pool)))
    t0 = time.perf_counter()
    thread.start()
    thread.join(TIMEOUT_S + 5.0)
    assert not thread.is_alive() and time.perf_counter() - t0 < TIMEOUT_S + 1.0
    assert result["failed"] == 1 and samples[0].metadata["failure_kind"] == "reward_timeout"
    assert samples[1].reward == 9.0


def test_a_single_call_raises_the_worker_error(pool):
    assert pool(_samples([4.5])[0]) == 4.5
    with pytest.raises(RewardWorkerError, match="reward worker died \\(exit code 3\\)") as info:
        pool(_samples(["exit3"])[0])
    assert info.value.kind == "reward_crash"


def test_failure_counts_counts_each_kind_and_reports_every_reward_kind():
    samples = _samples([1.0] * 5)
    kinds = ["reward_timeout", "reward_crash", "reward_timeout", None, "engine_error"]
    for sample, kind in zip(samples[:4] + samples[4:], kinds):
        sample.status = SampleStatus.FAILED
        if kind is not None:
            sample.metadata["failure_kind"] = kind
    samples.append(_samples([1.0])[0])  # scored fine: not counted
    assert failure_counts(samples) == {
        "samples/failed_reward_timeout": 2.0,
        "samples/failed_reward_crash": 1.0,
        "samples/failed_reward_memory": 0.0,
        "samples/failed_reward_error": 0.0,
        "samples/failed_engine_error": 1.0,  # another component's kind; a FAILED sample without a kind is not here
    }
    assert set(failure_counts([])) == {f"samples/failed_{kind}" for kind in FAILURE_KINDS}


def test_close_leaves_no_worker_and_ends_a_call_hanging_in_another_thread(pool):
    errors = []
    with ProcessPoolReward(reward_plugins.behaved, num_workers=1, timeout_s=30.0) as small:
        pids = small.worker_pids

        def call():
            try:
                small(_samples(["hang"])[0])
            except RuntimeError as err:
                errors.append(str(err))

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.3)  # the call is running in the worker
        t0 = time.perf_counter()
        small.close()
        thread.join(5.0)
        assert time.perf_counter() - t0 < 3.0 and not thread.is_alive()
    assert errors == ["the reward pool was closed while it was scoring"]
    assert pids and not any(_alive(pid) for pid in pids)
    assert small.worker_pids == []
    with pytest.raises(RuntimeError, match="after close"):
        small(_samples([1.0])[0])


def test_the_pool_rejects_a_reward_it_cannot_load_or_send_before_starting_workers():
    with pytest.raises(AttributeError, match="reward.path: module 'reward_plugins' has no attribute 'missing'"):
        ProcessPoolReward("reward_plugins:missing", num_workers=1)
    with pytest.raises(TypeError, match="cannot be sent to reward worker processes"):
        ProcessPoolReward(lambda sample: 1.0, num_workers=1)
    with pytest.raises(ValueError, match="reward.workers is 0"):
        ProcessPoolReward(reward_plugins.behaved, num_workers=0)


def test_a_memory_limit_without_workers_is_a_one_line_error_naming_both_keys():
    with pytest.raises(ValidationError) as info:
        RewardConfig(memory_limit_mib=512)
    message = info.value.errors()[0]["msg"]
    assert "reward.memory_limit_mib is 512 but reward.workers is 0" in message and "\n" not in message
    assert RewardConfig(workers=2, memory_limit_mib=512).memory_limit_mib == 512


PARENT = """
import os, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from miles.core.reward_pool import ProcessPoolReward
from miles.core.sample import Sample, SampleStatus
pool = ProcessPoolReward("reward_plugins:behaved", num_workers=2, timeout_s=60.0)
print(*pool.worker_pids, flush=True)
hang = Sample(index=0, group_index=0, prompt="", label="hang", status=SampleStatus.COMPLETED)
threading.Thread(target=pool, args=(hang,), daemon=True).start()
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no close(): only the workers' own watch can end them
"""


@pytest.mark.slow  # a fresh interpreter and fork server import torch: ~15 s on 2 cores
def test_workers_exit_when_the_trainer_process_is_killed_even_in_the_middle_of_a_call():
    result = subprocess.run(
        [sys.executable, "-c", PARENT, str(Path(__file__).parent)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    pids = [int(pid) for pid in result.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5.0
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in pids)


def _running(pid):
    """Alive and not a zombie (an orphaned worker is reparented to an init that may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the state field follows "(comm)"


def test_an_async_reward_is_awaited_in_the_worker_processes():
    # a coroutine cannot be pickled back: the worker awaits it and sends the number
    samples = _samples([0.0, 0.0, 0.0])
    with ProcessPoolReward("reward_plugins:async_index", num_workers=1, timeout_s=30.0) as async_pool:
        assert score_samples(samples, async_pool) == 0
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0]
