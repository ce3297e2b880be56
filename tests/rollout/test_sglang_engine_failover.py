"""``SGLangEngine`` when a server dies: a refused or dropped request is resubmitted (same rid and seed) to another
worker, or again to the router when it answered that no worker could take it, after a short backoff; the worker's
own errors still fail the request at once. Mocked servers (``httpx.MockTransport``), no processes."""

import asyncio
import json

import httpx
import pytest
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateOutput, GenerateRequest, RequestFailed
from miles.rollout.engines.sglang import SGLangEngine
from miles.rollout.engines.sglang_api import generate_response

ROUTER_UPSTREAM_ERROR = {"error": {"type": "Internal Server Error", "code": "call_upstream_request_error",
                                   "message": "error sending request for url (http://w1/generate)"}}  # fmt: skip
ROUTER_NO_WORKERS = {"error": {"type": "Service Unavailable", "code": "no_available_workers",
                               "message": "No available workers (all circuits open or unhealthy)"}}  # fmt: skip


class Servers:
    """Answers /generate per host from a script of outcomes ("ok", "refused", "dropped", "timeout", or a
    (status, body) answer); the last outcome repeats. Records (host, body) of each /generate."""

    def __init__(self, **scripts):
        self.scripts = {host: list(script) for host, script in scripts.items()}
        self.generates = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/generate":
            return httpx.Response(200, json={"success": True})
        body = json.loads(request.content)
        self.generates.append((request.url.host, body))
        script = self.scripts[request.url.host]
        outcome = script.pop(0) if len(script) > 1 else script[0]
        if outcome == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if outcome == "dropped":
            raise httpx.RemoteProtocolError("server disconnected without sending a response", request=request)
        if outcome == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        if outcome != "ok":
            status, answer = outcome
            return httpx.Response(status, json=answer)
        parsed = GenerateRequest(body["input_ids"], SamplingConfig(max_new_tokens=2), request_id=body["rid"])
        output = GenerateOutput([7, 2], [-0.25, -0.5], "stop", weight_versions=[1])
        return httpx.Response(200, json=generate_response(output, parsed, return_logprob=True, latency_s=0.0))


@pytest.fixture
def sleeps(monkeypatch):
    """The backoff waits the engine asks for (they do not really wait)."""
    waited, real_sleep = [], asyncio.sleep

    async def sleep(seconds, *args):
        waited.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return waited


def request(seed=11):
    return GenerateRequest([1, 5], SamplingConfig(max_new_tokens=2), seed=seed)


def test_a_request_dropped_by_a_dying_worker_is_resubmitted_to_the_other_one_with_the_same_rid_and_seed(sleeps):
    servers = Servers(w1=["dropped"], w2=["ok"])
    engine = SGLangEngine(["http://w1", "http://w2"], transport=httpx.MockTransport(servers))
    sent = request()
    output = asyncio.run(engine.generate(sent))
    assert output.response_tokens == [7, 2]
    assert [host for host, _ in servers.generates] == ["w1", "w2"]
    first, second = (body for _, body in servers.generates)
    assert first == second and first["rid"] == sent.request_id and first["sampling_params"]["sampling_seed"] == 11
    assert sleeps == [0.5]  # retry_backoff_s before the first retry


def test_without_a_router_a_retry_skips_workers_that_already_failed_the_request(sleeps):
    # Two requests at once: A takes w1 (refused), B takes w2. A's retry would be w1 again in round-robin order;
    # it goes to w2, which has not failed it.
    servers = Servers(w1=["refused"], w2=["ok"])
    engine = SGLangEngine(["http://w1", "http://w2"], transport=httpx.MockTransport(servers))

    async def both():
        return await asyncio.gather(engine.generate(request(1)), engine.generate(request(2)))

    outputs = asyncio.run(both())
    assert [o.response_tokens for o in outputs] == [[7, 2], [7, 2]]
    assert sorted(host for host, _ in servers.generates) == ["w1", "w2", "w2"]


def test_the_routers_no_worker_answers_are_retried_with_a_doubling_backoff(sleeps):
    servers = Servers(router=[(500, ROUTER_UPSTREAM_ERROR), (503, ROUTER_NO_WORKERS), "ok"])
    engine = SGLangEngine(["http://w1"], router_url="http://router", max_retries=2,
                          transport=httpx.MockTransport(servers))  # fmt: skip
    assert asyncio.run(engine.generate(request())).response_tokens == [7, 2]
    assert len(servers.generates) == 3 and sleeps == [0.5, 1.0]


def test_a_router_that_never_finds_a_worker_fails_the_request_after_its_retries(sleeps):
    servers = Servers(router=[(503, ROUTER_NO_WORKERS)])
    engine = SGLangEngine(["http://w1"], router_url="http://router", max_retries=2, retry_backoff_s=0.25,
                          transport=httpx.MockTransport(servers))  # fmt: skip
    with pytest.raises(RequestFailed, match="got no answer in 3 attempts .*No available workers"):
        asyncio.run(engine.generate(request()))
    assert sleeps == [0.25, 0.5]


def test_a_workers_own_server_error_through_the_router_fails_at_once():
    worker_error = {"object": "error", "message": "generation failed: boom", "type": "Internal Server Error",
                    "code": 500}  # fmt: skip
    servers = Servers(router=[(500, worker_error)])
    engine = SGLangEngine(["http://w1"], router_url="http://router", transport=httpx.MockTransport(servers))
    with pytest.raises(RequestFailed, match="answered 500 .*generation failed: boom"):
        asyncio.run(engine.generate(request()))
    assert len(servers.generates) == 1


def test_a_timed_out_attempt_is_retried_without_a_backoff(sleeps):
    servers = Servers(w1=["timeout", "ok"])
    engine = SGLangEngine(["http://w1"], max_retries=1, transport=httpx.MockTransport(servers))
    assert asyncio.run(engine.generate(request())).response_tokens == [7, 2]
    assert sleeps == []


def test_a_negative_backoff_is_refused():
    with pytest.raises(ValueError, match="retry_backoff_s is -1"):
        SGLangEngine(["http://w1"], retry_backoff_s=-1)
