"""The remote reward against a real HTTP server on 127.0.0.1: the score is read from the reply, 5xx replies and
connection errors are retried with backoff, and a server that fails or never answers fails the sample with a
counted reason after the last try."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from miles.core.rewards import score_samples
from miles.core.sample import Sample, SampleStatus
from miles.recipes.run import build_reward
from miles.rollout.config import RewardConfig
from miles.rollout.rewards import remote_reward


class _Scorer(BaseHTTPRequestHandler):
    """POST /ok: score 0.75; /nested: {"output": {"score": 1}}; /flaky: 500 twice, then 0.5; /down: always 503;
    /bad: 400; /text: not JSON; /hang: waits until the test ends. Every request body is recorded."""

    def do_POST(self):  # noqa: N802 - http.server's name
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append((self.path, body))
            num_calls = sum(path == self.path for path, _ in server.requests)
        if self.path == "/hang":
            server.release.wait(30)
            return
        status, reply = {
            "/ok": (200, {"score": 0.75}),
            "/nested": (200, {"output": {"score": 1}}),
            "/flaky": (500, {"error": "busy"}) if num_calls <= 2 else (200, {"score": 0.5}),
            "/down": (503, {"error": "overloaded"}),
            "/bad": (400, {"error": "missing prompt"}),
            "/text": (200, "not json"),
        }[self.path]
        data = json.dumps(reply).encode() if isinstance(reply, dict) else reply.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    httpd.daemon_threads = True
    httpd.requests, httpd.lock, httpd.release = [], threading.Lock(), threading.Event()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield httpd
    finally:
        httpd.release.set()  # /hang handlers return
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def _sample(index: int = 0) -> Sample:
    return Sample(
        index=index,
        group_index=0,
        prompt="What is 2 + 2?",
        label="4",
        response_text="4",
        status=SampleStatus.COMPLETED,
        metadata={"task": "add"},
    )


def test_the_score_is_the_reply_field_and_the_request_carries_the_sample(server):
    assert remote_reward(_sample(), url=server.url + "/ok") == 0.75
    assert server.requests == [
        ("/ok", {"prompt": "What is 2 + 2?", "response": "4", "label": "4", "metadata": {"task": "add"}})
    ]
    assert remote_reward(_sample(), url=server.url + "/nested", score_key="output.score") == 1.0


def test_two_5xx_replies_are_retried_with_backoff_and_the_third_try_scores(server):
    t0 = time.perf_counter()
    assert remote_reward(_sample(), url=server.url + "/flaky", max_retries=2, backoff_s=0.05) == 0.5
    assert [path for path, _ in server.requests] == ["/flaky"] * 3
    assert time.perf_counter() - t0 >= 0.05 + 0.1  # waits 0.05 s, then 0.1 s


def test_a_server_that_never_answers_fails_the_sample_as_a_timeout_after_the_last_try(server):
    reward_fn = build_reward(
        RewardConfig(
            type="remote", remote={"url": server.url + "/hang", "timeout_s": 0.2, "max_retries": 1, "backoff_s": 0}
        )
    )
    samples = [_sample()]
    t0 = time.perf_counter()
    assert score_samples(samples, reward_fn) == 1
    assert time.perf_counter() - t0 < 2.0  # two attempts of 0.2 s
    assert len(server.requests) == 2
    assert samples[0].status == SampleStatus.FAILED and samples[0].metadata["failure_kind"] == "reward_timeout"
    assert samples[0].metadata["failure"] == (
        f"reward function raised RewardTimeoutError: reward.remote.url {server.url}/hang did not answer within "
        "reward.remote.timeout_s=0.2s (ReadTimeout) in 2 attempts"
    )


def test_a_server_that_keeps_failing_or_is_down_fails_only_its_sample_and_scoring_goes_on(server):
    with socket.socket() as free:  # a port nothing listens on: connection refused
        free.bind(("127.0.0.1", 0))
        closed_url = f"http://127.0.0.1:{free.getsockname()[1]}"
    samples = [_sample(0), _sample(1), _sample(2)]
    urls = {0: server.url + "/down", 1: closed_url, 2: server.url + "/ok"}
    assert score_samples(samples, lambda s: remote_reward(s, url=urls[s.index], max_retries=1, backoff_s=0)) == 2
    assert samples[0].metadata["failure"] == (
        f"reward function raised ConnectionError: reward.remote.url {server.url}/down answered HTTP 503 to 2 "
        'attempts: {"error": "overloaded"}'
    )
    assert (
        samples[1]
        .metadata["failure"]
        .startswith(f"reward function raised ConnectionError: reward.remote.url {closed_url}: ConnectError:")
    )
    assert [s.metadata["failure_kind"] for s in samples[:2]] == ["reward_error", "reward_error"]
    assert samples[2].reward == 0.75
    assert [path for path, _ in server.requests] == ["/down", "/down", "/ok"]


@pytest.mark.parametrize(
    "path, score_key, message",
    [
        pytest.param("/bad", "score", 'answered HTTP 400: {"error": "missing prompt"}', id="4xx_not_retried"),
        pytest.param("/text", "score", "answered non-JSON: not json", id="not_json"),
        pytest.param("/ok", "reward", "answered without reward.remote.score_key 'reward'", id="missing_field"),
        pytest.param("/nested", "output", "gave output={'score': 1}, expected a finite number", id="not_a_number"),
    ],
)
def test_a_bad_reply_is_a_value_error_at_once(server, path, score_key, message):
    with pytest.raises(ValueError, match=message):
        remote_reward(_sample(), url=server.url + path, score_key=score_key, max_retries=3, backoff_s=0)
    assert len(server.requests) == 1


def test_reward_type_remote_needs_an_http_url_and_its_settings_need_the_type():
    with pytest.raises(ValueError, match=r"reward.remote.url is '', not an http\(s\) URL; set --reward.remote.url"):
        RewardConfig(type="remote")
    with pytest.raises(ValueError, match=r"reward.remote.url is 'http://x' but reward.type is 'math'"):
        RewardConfig(type="math", remote={"url": "http://x"})
