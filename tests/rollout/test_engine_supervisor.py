"""Engine fault tolerance: the health watch's schedule and failure count (fake clock), the supervisor's recovery
steps (fake servers and router), and, marked slow, two ``miles serve`` servers owned by Ray actors behind the real
sglang-router, one killed in the middle of a rollout."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest
from miles.core.sample import Sample, SampleStatus
from miles.rollout.engines.server import ServerStartError, free_port
from miles.rollout.engines.server_actor import EngineRestartError, Probe, ServerSpec, end_previous_server
from miles.rollout.engines.supervisor import EngineSupervisor, HealthCheckConfig, watch_health


# -- the watch: schedule and failure count, on a fake clock ---------------------------------------
class FakeTime:
    """A clock that moves only when the watch waits or a probe takes time; stops the watch at ``until``."""

    def __init__(self, until: float) -> None:
        self.now, self.until = 0.0, until

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.now += seconds
        return self.now > self.until


def run_watch(config, outcomes: dict[float, Probe], *, until: float, latency=None, recovery_s=0.0):
    """Probe times, and (time, outcome) of each on_failed; ``outcomes`` maps a probe's start time to its result
    (HEALTHY when absent), ``latency`` a start time to how long that probe takes."""
    fake = FakeTime(until)
    probes, failed = [], []

    def probe() -> Probe:
        probes.append(fake.now)
        outcome = outcomes.get(fake.now, Probe.HEALTHY)
        fake.now += (latency or {}).get(fake.now, 0.0)
        return outcome

    def on_failed(outcome: Probe) -> None:
        failed.append((fake.now, outcome))
        fake.now += recovery_s

    watch_health(probe, config=config, on_failed=on_failed, wait=fake.wait, clock=fake.clock)
    return probes, failed


CONFIG = HealthCheckConfig(first_wait_s=10.0, interval_s=2.0, timeout_s=1.0, max_consecutive_failures=3)


def test_probes_start_after_the_first_wait_and_act_on_the_third_failure_in_a_row():
    # Probes at 10, 12, 14, ...; failures at 14, 16, 18: the third (t=18) recovers the engine, which takes 5 s
    # (until 23); the next probe is an interval later, at 25.
    failures = {14.0: Probe.NO_ANSWER, 16.0: Probe.NO_ANSWER, 18.0: Probe.NO_ANSWER}
    probes, failed = run_watch(CONFIG, failures, until=28.0, recovery_s=5.0)
    assert probes == [10.0, 12.0, 14.0, 16.0, 18.0, 25.0, 27.0]
    assert failed == [(18.0, Probe.NO_ANSWER)]


def test_a_healthy_probe_resets_the_count_and_a_slow_healthy_probe_is_a_failure():
    # Failures at 10 and 12, healthy at 14 (count back to 0); at 16 a healthy answer that takes 1.5 s > timeout 1
    # (UNHEALTHY), the next probe at 18 (start to start), failures at 18 and 20: the third in a row is at 20.
    outcomes = {10.0: Probe.UNHEALTHY, 12.0: Probe.NO_ANSWER, 18.0: Probe.NO_ANSWER, 20.0: Probe.UNHEALTHY}
    probes, failed = run_watch(CONFIG, outcomes, until=21.0, latency={16.0: 1.5})
    assert probes == [10.0, 12.0, 14.0, 16.0, 18.0, 20.0]
    assert failed == [(20.0, Probe.UNHEALTHY)]


def test_a_new_server_process_is_recovered_at_the_first_probe_that_sees_it():
    probes, failed = run_watch(CONFIG, {12.0: Probe.RESTARTED}, until=15.0)
    assert probes == [10.0, 12.0, 14.0]
    assert failed == [(12.0, Probe.RESTARTED)]


def test_a_dead_actor_is_recovered_at_the_first_probe_that_sees_it():
    probes, failed = run_watch(CONFIG, {12.0: Probe.DIED}, until=15.0)
    assert probes == [10.0, 12.0, 14.0]
    assert failed == [(12.0, Probe.DIED)]


def test_the_watch_ends_when_stopped_during_the_first_wait_without_probing():
    assert run_watch(CONFIG, {}, until=5.0) == ([], [])


# -- the supervisor's recovery steps, with fakes ---------------------------------------------------
class FakeServer:
    """A ``SupervisedServer`` whose probes follow a script; ``wait_ready`` returns ``new_pid`` (or times out)."""

    def __init__(self, url, script, *, new_pid=2, ready=True):
        self.url, self.pid, self.new_pid, self.ready = url, 1, new_pid, ready
        self.script, self.calls = list(script), []

    def probe(self, timeout_s):
        return self.script.pop(0) if self.script else Probe.HEALTHY

    def restart(self):
        self.calls.append("restart")

    def wait_ready(self, timeout_s, *, not_pid=None, probe_timeout_s=5.0, cancelled=lambda: False):
        self.calls.append(("wait_ready", not_pid))
        if not self.ready:
            raise EngineRestartError(f"{self.url} did not serve again within {timeout_s:.0f}s")
        self.pid = self.new_pid
        return self.pid


class FakeRouter:
    def __init__(self, urls, log):
        self.urls, self.log = set(urls), log

    def remove_worker(self, url):
        self.log.append(("remove", url))
        self.urls.discard(url)

    def add_worker(self, url):
        self.log.append(("add", url))
        self.urls.add(url)


FAST = HealthCheckConfig(interval_s=0.01, timeout_s=1.0, max_consecutive_failures=2, restart_timeout_s=5.0)


def supervise(servers, until, *, on_restarted=None):
    """Run a supervisor over fakes until ``until(log, supervisor)``; returns (supervisor, log, router). The log
    has the router's ("remove"/"add", url) and the default on_restarted's ("resync", url), in order."""
    log = []
    router = FakeRouter([s.url for s in servers], log)
    on_restarted = on_restarted or (lambda url: log.append(("resync", url)))
    supervisor = EngineSupervisor(servers, config=FAST, router=router, on_restarted=on_restarted)
    with supervisor:
        deadline = time.monotonic() + 10.0
        while not until(log, supervisor):
            assert time.monotonic() < deadline, f"the supervisor did not get there in 10 s: {log}"
            time.sleep(0.01)
    return supervisor, log, router


def failed(log, supervisor) -> bool:
    try:
        supervisor.raise_if_failed()
    except EngineRestartError:
        return True
    return False


def test_a_dead_engine_is_removed_restarted_resynced_then_added_back_and_counted():
    dead = FakeServer("http://a", [Probe.NO_ANSWER, Probe.NO_ANSWER])
    alive = FakeServer("http://b", [])
    supervisor, log, router = supervise([dead, alive], lambda log, s: s.restarts == 1)
    assert log == [("remove", "http://a"), ("resync", "http://a"), ("add", "http://a")]
    assert dead.calls == [("wait_ready", None)]  # Ray restarts a dead actor by itself: no kill
    assert router.urls == {"http://a", "http://b"} and alive.calls == []
    assert supervisor.metrics() == {"engine/restarts": 1.0, "engine/unavailable": 0.0}
    assert supervisor.check() == supervisor.metrics()  # the loop's hook between steps
    supervisor.raise_if_failed()
    supervisor.wait_available(timeout_s=1.0)


def test_an_engine_answering_unhealthy_is_killed_and_must_come_back_as_a_new_process():
    hung = FakeServer("http://a", [Probe.UNHEALTHY, Probe.UNHEALTHY])
    _, log, _ = supervise([hung], lambda log, s: s.restarts == 1)
    assert hung.calls == ["restart", ("wait_ready", 1)]
    assert log == [("remove", "http://a"), ("resync", "http://a"), ("add", "http://a")]


def test_a_stalled_engine_that_answers_again_as_the_same_process_is_re_added_without_a_resync():
    stalled = FakeServer("http://a", [Probe.NO_ANSWER, Probe.NO_ANSWER], new_pid=1)
    supervisor, log, _ = supervise([stalled], lambda log, s: ("add", "http://a") in log)
    assert log == [("remove", "http://a"), ("add", "http://a")]
    assert supervisor.restarts == 0


def test_one_failed_probe_is_not_enough():
    flaky = FakeServer("http://a", [Probe.NO_ANSWER, Probe.HEALTHY, Probe.NO_ANSWER, Probe.HEALTHY])
    supervisor, log, _ = supervise([flaky], lambda log, s: not flaky.script)
    assert log == [] and flaky.calls == [] and supervisor.restarts == 0


def test_an_engine_that_does_not_come_back_stays_out_and_raise_if_failed_names_it():
    gone = FakeServer("http://a", [Probe.NO_ANSWER, Probe.NO_ANSWER], ready=False)
    supervisor, log, router = supervise([gone, FakeServer("http://b", [])], failed)
    assert log == [("remove", "http://a")] and router.urls == {"http://b"}
    assert supervisor.metrics() == {"engine/restarts": 0.0, "engine/unavailable": 1.0}
    with pytest.raises(EngineRestartError, match="engine http://a is out of service: http://a did not serve again"):
        supervisor.raise_if_failed()
    with pytest.raises(EngineRestartError):
        supervisor.wait_available(timeout_s=1.0)
    with pytest.raises(EngineRestartError, match="engine http://a is out of service"):
        supervisor.check()  # the loop stops the run between two steps
    with pytest.raises(EngineRestartError), supervisor.publish_guard(timeout_s=1.0):
        pytest.fail("a push to every server must not start while one is out of service")


def test_a_failed_resync_keeps_the_restarted_engine_out_of_the_router():
    def on_restarted(url):
        raise RuntimeError("weight push failed")

    restarted = FakeServer("http://a", [Probe.RESTARTED])
    supervisor, log, router = supervise([restarted], failed, on_restarted=on_restarted)
    assert log == [("remove", "http://a")] and router.urls == set()
    assert supervisor.restarts == 0
    with pytest.raises(EngineRestartError, match="weight push failed"):
        supervisor.raise_if_failed()


class GatedServer(FakeServer):
    """A FakeServer whose restart takes until ``ready`` is set."""

    def __init__(self, url, script):
        super().__init__(url, script)
        self.gate = threading.Event()

    def wait_ready(self, timeout_s, *, not_pid=None, probe_timeout_s=5.0, cancelled=lambda: False):
        assert self.gate.wait(timeout=10.0)
        return super().wait_ready(timeout_s, not_pid=not_pid, probe_timeout_s=probe_timeout_s, cancelled=cancelled)


def _wait_until(condition, what):
    deadline = time.monotonic() + 10.0
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_publish_waits_for_a_restarting_server_and_pushes_after_its_resync():
    log = []
    server = GatedServer("http://a", [Probe.NO_ANSWER, Probe.NO_ANSWER])
    router = FakeRouter([server.url], log)
    supervisor = EngineSupervisor([server], config=FAST, router=router, on_restarted=lambda url: log.append("resync"))
    with supervisor, concurrent.futures.ThreadPoolExecutor(1) as pool:
        _wait_until(lambda: supervisor.metrics()["engine/unavailable"] == 1.0, "the recovery did not start")

        def publish():
            with supervisor.publish_guard(timeout_s=10.0):
                log.append("push")

        pushed = pool.submit(publish)
        time.sleep(0.2)
        assert log == [("remove", "http://a")]  # the push waits while the server restarts
        server.gate.set()
        pushed.result(timeout=10.0)
    assert log == [("remove", "http://a"), "resync", ("add", "http://a"), "push"]


def test_a_restarted_server_is_resynced_after_the_push_in_progress_with_its_version():
    log, version = [], {"now": 1}
    server = FakeServer("http://a", [])
    router = FakeRouter([server.url], log)
    supervisor = EngineSupervisor(
        [server], config=FAST, router=router, on_restarted=lambda url: log.append(("resync", version["now"]))
    )
    with supervisor:
        with supervisor.publish_guard(timeout_s=10.0):
            server.script.append(Probe.RESTARTED)  # Ray restarted it while the weights are being pushed
            _wait_until(lambda: ("remove", "http://a") in log, "the restart was not seen")
            time.sleep(0.2)
            assert ("resync", 1) not in log and ("resync", 2) not in log
            version["now"] = 2  # the push lands
            log.append("push")
        _wait_until(lambda: supervisor.restarts == 1, "the restarted server was not brought back")
    assert log == [("remove", "http://a"), "push", ("resync", 2), ("add", "http://a")]


def test_a_publish_guard_finds_a_server_that_died_since_its_last_probe_and_waits_until_it_answers():
    server = FakeServer("http://a", [])
    server.probe = lambda timeout_s: server.outcome
    server.outcome = Probe.DIED  # the watch has not probed it yet (first probe in 100 s)
    config = HealthCheckConfig(first_wait_s=100.0, interval_s=0.05, timeout_s=1.0)
    entered = threading.Event()

    def publish():
        with supervisor.publish_guard(timeout_s=10.0):
            entered.set()

    with EngineSupervisor([server], config=config, on_restarted=lambda url: None) as supervisor:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pushed = pool.submit(publish)
            assert not entered.wait(timeout=0.3)  # no push while it does not answer healthy
            server.outcome = Probe.HEALTHY
            pushed.result(timeout=10.0)
        with pytest.raises(TimeoutError, match=r"engines \['http://a'\] were not healthy for a weight push"):
            server.outcome = Probe.NO_ANSWER
            with supervisor.publish_guard(timeout_s=0.2):
                pass


def test_a_publish_guard_that_waits_too_long_names_the_servers():
    server = GatedServer("http://a", [Probe.NO_ANSWER, Probe.NO_ANSWER])
    supervisor = EngineSupervisor([server], config=FAST, on_restarted=lambda url: None)
    with supervisor:
        _wait_until(lambda: supervisor.metrics()["engine/unavailable"] == 1.0, "the recovery did not start")
        with pytest.raises(TimeoutError, match=r"engines \['http://a'\] were still being restarted"):
            with supervisor.publish_guard(timeout_s=0.2):
                pass
        server.gate.set()


def test_health_check_settings_are_validated():
    with pytest.raises(ValueError, match="max_consecutive_failures"):
        HealthCheckConfig(max_consecutive_failures=0)
    with pytest.raises(ValueError, match="interval_s"):
        HealthCheckConfig(interval_s=0.0)
    with pytest.raises(ValueError, match="fixed port"):
        ServerSpec("miles serve", ["x"], port=0, log_path="x.log")


@pytest.mark.parametrize(
    "engine, mode, expected",
    [
        pytest.param(
            {"health_check": {"interval_s": 5.0}},
            "local",
            "engine.health_check.interval_s is 5.0 but execution.mode is 'local': the engine supervisor runs in Ray "
            "mode only, where Ray owns the servers and restarts them. Set --execution.mode ray, or drop "
            "--engine.health-check.interval-s (local mode: --engine.health-check-interval-s).",
            id="supervisor_settings_in_local_mode",
        ),
        pytest.param(
            {"health_check_interval_s": 3.0},
            "ray",
            "engine.health_check_interval_s is 3 but execution.mode is 'ray', where the servers Miles starts are "
            "watched by the engine supervisor instead. Set --engine.health-check.interval-s 3, or drop "
            "--engine.health-check-interval-s.",
            id="worker_monitor_interval_in_ray_mode",
        ),
        pytest.param(
            {"type": "vllm", "health_check": {"timeout_s": 9.0}},
            "local",
            "engine.health_check.timeout_s is 9.0 but execution.mode is 'local': the engine supervisor runs in Ray "
            "mode only, where Ray owns the servers and restarts them. Set --execution.mode ray, or drop "
            "--engine.health-check.timeout-s.",
            id="vllm_supervisor_settings_in_local_mode",
        ),
    ],
)
def test_a_health_setting_the_execution_mode_does_not_read_is_refused_naming_the_key(engine, mode, expected):
    from miles.rollout.config import SGLangEngineConfig, VLLMEngineConfig, check_engine_health_settings

    config = VLLMEngineConfig(**engine) if engine.get("type") == "vllm" else SGLangEngineConfig(**engine)
    with pytest.raises(ValueError) as err:
        check_engine_health_settings(config, execution_mode=mode)
    assert str(err.value) == expected


def test_health_settings_each_mode_reads_are_accepted_and_defaults_written_out_count_as_unset():
    from miles.rollout.config import SGLangEngineConfig, VLLMEngineConfig, check_engine_health_settings

    check_engine_health_settings(SGLangEngineConfig(health_check={"interval_s": 5.0}), execution_mode="ray")
    check_engine_health_settings(SGLangEngineConfig(health_check_interval_s=3.0), execution_mode="local")
    # servers that already run keep the router's worker monitor in Ray mode too
    check_engine_health_settings(
        SGLangEngineConfig(urls=["http://127.0.0.1:30001"], health_check_interval_s=3.0), execution_mode="ray"
    )
    dumped = SGLangEngineConfig().model_dump(mode="json")  # a run's config.yaml lists every default
    check_engine_health_settings(SGLangEngineConfig.model_validate(dumped), execution_mode="local")
    check_engine_health_settings(VLLMEngineConfig(), execution_mode="ray")


def test_supervisor_settings_for_servers_miles_does_not_start_are_refused():
    from miles.rollout.config import SGLangEngineConfig

    with pytest.raises(ValueError, match=r"engine.health_check.max_consecutive_failures is 3 but engine.urls names"):
        SGLangEngineConfig(urls=["http://127.0.0.1:30001"], health_check={"max_consecutive_failures": 3})
    from miles.rollout.config import VLLMEngineConfig

    with pytest.raises(ValueError, match=r"engine.health_check.interval_s is 2.0 but engine.urls names"):
        VLLMEngineConfig(urls=["http://127.0.0.1:30001"], health_check={"interval_s": 2.0})
    check_vllm = VLLMEngineConfig(health_check={"interval_s": 2.0, "restart_timeout_s": 120.0})
    assert check_vllm.health_check.interval_s == 2.0  # servers Miles starts: the supervisor's to read


# -- a restarted actor's clean-up of its previous server -------------------------------------------
def test_a_previous_server_still_running_its_command_is_killed_and_a_reused_pid_is_left_alone(tmp_path):
    pid_path = tmp_path / "serve.log.pid"
    command = ["sleep", "60"]
    previous = subprocess.Popen(command, start_new_session=True)  # the server an earlier incarnation started
    try:
        pid_path.write_text(str(previous.pid))
        cmdline = Path(f"/proc/{previous.pid}/cmdline")
        _wait_for(lambda: cmdline.read_bytes() != b"", timeout_s=10.0, what="sleep did not start")  # exec finishing
        end_previous_server(pid_path, ["sleep", "61"], host="127.0.0.1", port=free_port())  # not our command
        assert previous.poll() is None
        end_previous_server(pid_path, command, host="127.0.0.1", port=free_port())
        assert previous.wait(timeout=10) == -signal.SIGKILL
    finally:
        previous.kill()
    end_previous_server(pid_path, command, host="127.0.0.1", port=free_port())  # it is gone: nothing to do


def test_a_port_that_stays_taken_after_the_previous_server_ended_is_a_start_error(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"127.0.0.1:{port}: the port is still in use"):
            end_previous_server(tmp_path / "none.pid", ["x"], host="127.0.0.1", port=port, wait_s=0.2)


def test_server_actor_options_are_one_mapping_for_all_or_one_per_spec_and_never_the_restart_settings():
    from miles.rollout.engines.server_actor import start_server_actors

    specs = [ServerSpec(f"s{i}", ["x"], port=30000 + i, log_path="/dev/null") for i in range(2)]
    with pytest.raises(ValueError, match="3 actor_options for 2 specs; give one each"):
        start_server_actors(specs, actor_options=[{}, {}, {}])
    with pytest.raises(ValueError, match=r"actor_options sets \['max_restarts'\]"):
        start_server_actors(specs, actor_options=[{}, {"max_restarts": 3}])
    with pytest.raises(ValueError, match=r"actor_options sets \['max_task_retries'\]"):
        start_server_actors(specs, actor_options={"max_task_retries": 1})


# -- two miles serve servers owned by Ray actors, behind the real sglang-router --------------------
NUM_PROMPTS, GROUP_SIZE = 8, 4
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=24)
PROBE_REQUEST = dict(input_ids=[1, 7, 9], sampling_params={"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 5},
                     return_logprob=True)  # fmt: skip


def _log_probs(url: str) -> list[float]:
    """The log-probs a server gives the seeded ``PROBE_REQUEST``."""
    response = httpx.post(url + "/generate", json=PROBE_REQUEST, timeout=60.0)
    assert response.status_code == 200, response.text
    return [entry[0] for entry in response.json()["meta_info"]["output_token_logprobs"]]


def _version(url: str) -> str:
    return httpx.get(url + "/get_weight_version", timeout=10.0).json()["weight_version"]


def _served(url: str) -> int:
    return httpx.get(url + "/get_server_info", timeout=10.0).json()["num_generate_requests"]


def _perturbed_weights(model_dir) -> list[tuple[str, torch.Tensor]]:
    """The tiny model's parameters plus seeded noise: weights v1, whose log-probs differ from v0's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    return [(name, param.detach() + 0.2 * torch.randn(param.shape, generator=generator))
            for name, param in model.named_parameters()]  # fmt: skip


def _miles_serve(model_dir, port: int, log_path, router_url: str) -> ServerSpec:
    command = [sys.executable, "-m", "miles.rollout.serve", "--model", str(model_dir), "--port", str(port)]
    return ServerSpec("miles serve", command, port=port, log_path=log_path, env={"OMP_NUM_THREADS": "1"},
                      startup_timeout_s=120.0, router_url=router_url)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    """Ray, two actor-owned miles serve servers behind a round_robin router, weights v1 on both; yields a dict."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("sglang_router") is None:
        pytest.skip("needs Ray (uv sync --locked --extra ray) and sglang-router (the router extra)")
    from miles.core.execution import ray_session
    from miles.rollout.engines.router import SGLangRouter
    from miles.rollout.engines.server_actor import start_server_actors
    from miles.rollout.engines.sglang import SGLangEngine, SGLangWeightSink

    logs = tmp_path_factory.mktemp("supervisor_logs")
    ports = [free_port(), free_port()]
    router = SGLangRouter([f"http://127.0.0.1:{port}" for port in ports], policy="round_robin",
                          log_path=logs / "router.log", health_check_interval_s=1)  # fmt: skip
    specs = [_miles_serve(tiny_llama_dir, port, logs / f"serve-{i}.log", router.url) for i, port in enumerate(ports)]
    with ray_session(num_cpus=4, include_dashboard=False):
        servers = start_server_actors(specs, actor_options={"num_cpus": 1})
        try:
            with router:
                engine = SGLangEngine([s.url for s in servers], router_url=router.url, stop_token_ids=[2],
                                      request_timeout_s=60.0, max_retries=3)  # fmt: skip
                v0_log_probs = _log_probs(servers[0].url)
                weights = _perturbed_weights(tiny_llama_dir)
                sink = SGLangWeightSink(engine, timeout_s=60.0)
                sink.push(weights, version=1)
                current = {"weights": weights, "version": 1}

                def on_restarted(url: str) -> None:
                    """What the run does: drop the weight group (it had the dead server), push the current
                    weights to the restarted server alone."""
                    sink.close()
                    one = SGLangWeightSink(SGLangEngine([url]), timeout_s=60.0)
                    try:
                        one.push(current["weights"], version=current["version"])
                    finally:
                        one.close()

                config = HealthCheckConfig(interval_s=0.5, timeout_s=2.0, max_consecutive_failures=2,
                                           restart_timeout_s=120.0)  # fmt: skip
                with EngineSupervisor(servers, config=config, router=router, on_restarted=on_restarted) as supervisor:
                    yield dict(servers=servers, router=router, engine=engine, sink=sink, supervisor=supervisor,
                               v0_log_probs=v0_log_probs, current=current)  # fmt: skip
                engine.close()
        finally:
            for server in servers:
                server.stop()


def _wait_for(condition, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f}s"
        time.sleep(0.05)


def _assert_restored(cluster, victim, survivor, *, restarts: int) -> None:
    """The victim is back: counted, in the router, at the current version, with the survivor's log-probs."""
    supervisor, router = cluster["supervisor"], cluster["router"]
    _wait_for(lambda: supervisor.restarts == restarts and victim.url in router.workers(), timeout_s=120.0,
              what=f"the supervisor did not bring {victim.url} back")  # fmt: skip
    supervisor.raise_if_failed()
    assert sorted(router.workers()) == sorted([victim.url, survivor.url])
    assert _version(victim.url) == _version(survivor.url) == str(cluster["current"]["version"])
    torch.testing.assert_close(_log_probs(victim.url), _log_probs(survivor.url), rtol=0, atol=1e-5)
    assert supervisor.metrics()["engine/restarts"] == restarts


@pytest.mark.slow
@pytest.mark.integration
def test_a_server_killed_mid_rollout_is_restarted_resynced_and_its_requests_resubmitted(cluster):
    from miles.core.buffer import generate_samples
    from miles.rollout.generate import ChatRollout

    victim, survivor = cluster["servers"]
    assert _log_probs(survivor.url) != pytest.approx(cluster["v0_log_probs"], abs=1e-3)  # v1 differs from v0
    for server in (victim, survivor):  # ~30 ms per decode step: the rollout takes seconds, requests overlap
        httpx.post(server.url + "/slow_down", json={"forward_sleep_time": 0.03}, timeout=10.0)
    before = _served(survivor.url)
    prompts = [Sample(index=i, group_index=i, prompt=[1, 3 + i, 5]) for i in range(NUM_PROMPTS)]
    rollout = ChatRollout(cluster["engine"], None)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            generate_samples, prompts, rollout, n_samples_per_prompt=GROUP_SIZE, sampling=SAMPLING, seed=0
        )
        _wait_for(lambda: _served(victim.url) >= 2, timeout_s=60.0, what="the victim finished no 2 requests")
        finished_on_victim = _served(victim.url)
        assert finished_on_victim < NUM_PROMPTS * GROUP_SIZE // 2, "the victim finished its share: slow it down"
        os.killpg(victim.pid, signal.SIGKILL)  # its process group: the server and anything it started
        samples = future.result(timeout=180.0)

    assert len(samples) == NUM_PROMPTS * GROUP_SIZE
    assert [s.status for s in samples if s.status is SampleStatus.FAILED] == []
    assert [s.index for s in samples] == list(range(NUM_PROMPTS * GROUP_SIZE))
    for i in range(NUM_PROMPTS):  # each prompt once, its group complete
        group = [s for s in samples if s.group_index == i]
        assert len(group) == GROUP_SIZE and all(s.prompt == [1, 3 + i, 5] for s in group)
        assert all(s.response_length > 0 and len(s.rollout_log_probs) == s.response_length for s in group)
    assert {s.weight_version for s in samples} == {1}  # no answer came from a restarted server before its resync
    # The victim's unfinished requests were resubmitted to the survivor (round_robin gave each server 16).
    assert _served(survivor.url) - before > NUM_PROMPTS * GROUP_SIZE // 2
    httpx.post(survivor.url + "/slow_down", json={"forward_sleep_time": None}, timeout=10.0)

    _assert_restored(cluster, victim, survivor, restarts=1)
    # The run's next weight push forms a new group with both servers.
    cluster["sink"].push(cluster["current"]["weights"], version=2)
    cluster["current"]["version"] = 2
    assert _version(victim.url) == _version(survivor.url) == "2"


@pytest.mark.slow
@pytest.mark.integration
def test_a_killed_server_actor_is_restarted_by_ray_and_its_old_server_dies_with_it(cluster):
    from miles.core.execution import import_ray

    victim, survivor = cluster["servers"]
    old_pid, restarts = victim.pid, cluster["supervisor"].restarts
    import_ray().kill(victim.actor, no_restart=False)
    _assert_restored(cluster, victim, survivor, restarts=restarts + 1)
    assert victim.pid != old_pid
    with pytest.raises(ProcessLookupError):  # PR_SET_PDEATHSIG ended the old server with its actor
        os.kill(old_pid, 0)
    output = asyncio.run(cluster["engine"].generate(GenerateRequest([1, 4], SAMPLING, seed=3)))
    assert output.weight_version == cluster["current"]["version"]
