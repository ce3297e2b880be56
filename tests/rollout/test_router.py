"""The real sglang-router (PyPI sglang-router) in front of two real ``miles serve`` servers on a tiny random Llama.

The servers and the router are shared by the module and run on 127.0.0.1; the router uses round_robin, so N requests
put N/2 on each worker. Waiting is by polling with deadlines (inside ``ServerProcess.start`` and the router's
add/remove), never fixed sleeps.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import sys
import time

import httpx
import pytest
from miles.rollout.engines.router import (
    INSTALL_HINT,
    MonitorReport,
    RouterError,
    SGLangRouter,
    WorkerMonitor,
    normalize_worker_url,
)
from miles.rollout.engines.server import ServerProcess, free_port, port_in_use

NUM_REQUESTS = 6  # even: round_robin gives each of the two workers 3


def _miles_serve(model_dir, log_path) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "miles.rollout.serve", "--model", model_dir, "--host", "127.0.0.1",
               "--port", port]  # fmt: skip
    return ServerProcess("miles serve", command, host="127.0.0.1", port=port, log_path=log_path,
                         startup_timeout_s=120.0, env={"OMP_NUM_THREADS": "1"})  # fmt: skip


def _requests_served(server: ServerProcess) -> int:
    """How many /generate requests the server answered with 200 (miles serve counts them)."""
    return httpx.get(server.url + "/get_server_info", timeout=10.0).json()["num_generate_requests"]


def _generate(router: SGLangRouter, prompt: list[int]) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}}
    response = httpx.post(router.url + "/generate", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    return response.json()


def _assert_valid(output: dict) -> None:
    assert 1 <= len(output["output_ids"]) <= 4
    assert all(0 <= token < 32 for token in output["output_ids"])  # the tiny Llama's vocabulary
    assert output["meta_info"]["finish_reason"]["type"] in ("length", "stop")


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router_test_logs")
    servers = [_miles_serve(tiny_llama_dir, logs / f"miles-serve-{i}.log") for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:  # both load the model at once
        list(pool.map(ServerProcess.start, servers))
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def router(servers, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("router_log") / "sglang-router.log"
    with SGLangRouter([s.url for s in servers], policy="round_robin", log_path=log_path) as router:
        yield router


@pytest.fixture
def both_workers(router, servers):
    """Both servers running and registered, whatever an earlier test left behind (a failure must not cascade)."""
    for server in servers:
        server.start()  # returns at once when it runs
        router.add_worker(server.url)  # a no-op when registered
    return servers


@pytest.mark.integration
def test_generate_through_the_router_returns_valid_outputs_from_both_workers(router, both_workers):
    servers = both_workers
    assert sorted(router.workers()) == sorted(s.url for s in servers)
    before = [_requests_served(s) for s in servers]
    for i in range(NUM_REQUESTS):
        _assert_valid(_generate(router, [1, 5 + i, 7]))
    served = [_requests_served(s) - b for s, b in zip(servers, before)]
    assert served == [NUM_REQUESTS // 2] * 2


@pytest.mark.integration
def test_monitor_removes_a_killed_worker_and_adds_it_back_when_it_restarts_at_the_same_url(router, both_workers):
    servers = both_workers
    monitor = WorkerMonitor(router, [s.url for s in servers], health_timeout_s=2.0)
    assert monitor.check_once() == MonitorReport()  # both alive and registered: nothing to do
    alive, victim = servers

    os.kill(victim.process.pid, signal.SIGKILL)  # a crash, not a clean shutdown
    victim.process.wait(timeout=10)
    victim.stop()
    assert monitor.check_once() == MonitorReport(removed=(victim.url,))
    assert router.workers() == [alive.url]
    before = _requests_served(alive)
    for i in range(NUM_REQUESTS):
        _assert_valid(_generate(router, [1, 9 + i]))
    assert _requests_served(alive) - before == NUM_REQUESTS
    assert monitor.check_once() == MonitorReport()  # still dead: nothing more to remove

    victim.start()  # same port: the restarted server has the same URL
    # Local mode's monitor (readd False): a restarted server holds its initial weights, so it stays out.
    local = WorkerMonitor(router, [s.url for s in servers], health_timeout_s=2.0, readd=False)
    assert local.check_once() == MonitorReport() and router.workers() == [alive.url]
    assert monitor.check_once() == MonitorReport(added=(victim.url,))
    assert sorted(router.workers()) == sorted(s.url for s in servers)
    before = [_requests_served(s) for s in servers]
    for i in range(NUM_REQUESTS):
        _assert_valid(_generate(router, [2, 3 + i]))
    assert [_requests_served(s) - b for s, b in zip(servers, before)] == [NUM_REQUESTS // 2] * 2


@pytest.mark.integration
def test_the_background_monitor_adds_back_a_live_worker_missing_from_the_router(router, both_workers):
    servers = both_workers
    router.remove_worker(servers[0].url)
    assert router.workers() == [servers[1].url]
    with WorkerMonitor(router, [s.url for s in servers], interval_s=0.1):
        deadline = time.monotonic() + 30.0
        while servers[0].url not in router.workers():
            assert time.monotonic() < deadline, f"the monitor thread did not add {servers[0].url} back in 30 s"
            time.sleep(0.05)
    assert sorted(router.workers()) == sorted(s.url for s in servers)


@pytest.mark.integration
def test_adding_a_url_where_nothing_listens_fails_without_queueing_it(router):
    workers = router.workers()
    with pytest.raises(RouterError, match="does not answer GET /health"):
        router.add_worker(f"http://127.0.0.1:{free_port()}")
    assert router.workers() == workers
    router.remove_worker("http://127.0.0.1:1")  # never registered: a no-op


@pytest.mark.integration
def test_the_router_process_is_gone_after_stop(tmp_path):
    router = SGLangRouter(log_path=tmp_path / "router.log").start()
    pid, port = router.pid, router.port
    assert router.workers() == []
    router.stop()
    assert not router.running and not port_in_use("127.0.0.1", port)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    router.stop()  # idempotent


def test_a_missing_sglang_router_is_an_import_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang_router", None)  # what importlib sees when the package is absent
    with pytest.raises(ImportError, match=re.escape(INSTALL_HINT)):
        SGLangRouter()


def test_worker_urls_must_be_http_base_urls():
    assert normalize_worker_url("http://127.0.0.1:30000/") == "http://127.0.0.1:30000"
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        normalize_worker_url("127.0.0.1:30000")
