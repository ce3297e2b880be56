"""EnginePublisher: pause -> push -> flush -> version bump -> resume, the version owned in one place, inside the
guard the caller gives (Ray mode: the engine supervisor's)."""

import contextlib

import pytest
from miles.core.publisher import EnginePublisher
from miles.sync import WeightUpdateError


class RecordingEngine:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def pause(self, mode):
        self.log.append((self.name, "pause", mode))
        return []

    def flush_cache(self):
        self.log.append((self.name, "flush"))

    def resume(self):
        self.log.append((self.name, "resume"))


class PushingBackend:
    def __init__(self, log, fail_at=()):
        self.log, self.fail_at = log, set(fail_at)

    def push_weights(self, version):
        self.log.append(("backend", "push", version))
        if version in self.fail_at:
            raise WeightUpdateError(f"update v{version} rejected")


def test_a_publish_pauses_pushes_flushes_bumps_and_resumes_in_that_order():
    log = []
    engines = [RecordingEngine("a", log), RecordingEngine("b", log)]
    publisher = EnginePublisher(PushingBackend(log), engines)
    assert publisher.version == 0
    assert publisher.publish() == 1 and publisher.version == 1
    assert log == [
        ("a", "pause", "keep"),
        ("b", "pause", "keep"),
        ("backend", "push", 1),
        ("a", "flush"),
        ("b", "flush"),
        ("a", "resume"),
        ("b", "resume"),
    ]
    assert publisher.publish() == 2


def test_a_failed_push_keeps_the_version_and_resumes_the_engines():
    log = []
    publisher = EnginePublisher(PushingBackend(log, fail_at={2}), [RecordingEngine("a", log)], version=1)
    with pytest.raises(WeightUpdateError, match="v2 rejected"):
        publisher.publish()
    assert publisher.version == 1
    assert log[-1] == ("a", "resume") and ("a", "flush") not in log
    publisher.backend.fail_at.clear()
    assert publisher.publish() == 2  # the retry reuses the version that never landed


def test_a_resumed_run_continues_the_version_counter_from_its_checkpoint():
    log = []
    publisher = EnginePublisher(PushingBackend(log), [], version=7, pause_mode="abort")
    assert publisher.publish() == 8
    assert log == [("backend", "push", 8)]


def test_the_weights_reach_a_real_receiver_with_the_publisher_s_versions(tiny_llama_dir):
    """FSDP2 backend -> WeightSender -> the embedded engine's receiver: the engine holds the published version."""
    from miles.rollout.engines import EmbeddedEngine
    from miles.sync import InProcessTransport, WeightSender
    from miles.train import FSDP2Backend, TrainConfig

    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    backend = FSDP2Backend(
        tiny_llama_dir,
        train=TrainConfig(),
        temperature=1.0,
        weight_sink=WeightSender(InProcessTransport(engine.receiver)),
    )
    publisher = EnginePublisher(backend, [engine], version=4)  # as after a resume from a v4 checkpoint
    assert publisher.publish() == 5 and engine.weight_version == 5
    assert publisher.publish() == 6 and engine.weight_version == 6


class RecordingGuard:
    """A publish guard that logs when it is entered and left, and can refuse (an engine that stayed dead)."""

    def __init__(self, log, refuse=False):
        self.log, self.refuse = log, refuse

    @contextlib.contextmanager
    def __call__(self):
        if self.refuse:
            raise RuntimeError("engine http://a is out of service")
        self.log.append(("guard", "enter"))
        try:
            yield
        finally:
            self.log.append(("guard", "exit"))


def test_the_guard_is_held_from_before_the_pause_until_after_the_resume():
    log = []
    engine = RecordingEngine("a", log)
    publisher = EnginePublisher(PushingBackend(log), [engine], guard=RecordingGuard(log))
    assert publisher.publish() == 1
    assert log == [
        ("guard", "enter"),
        ("a", "pause", "keep"),
        ("backend", "push", 1),
        ("a", "flush"),
        ("a", "resume"),
        ("guard", "exit"),
    ]


def test_a_failed_push_leaves_the_guard_after_the_engines_resume():
    log = []
    publisher = EnginePublisher(
        PushingBackend(log, fail_at={1}), [RecordingEngine("a", log)], guard=RecordingGuard(log)
    )
    with pytest.raises(WeightUpdateError):
        publisher.publish()
    assert log[-2:] == [("a", "resume"), ("guard", "exit")] and publisher.version == 0


def test_a_guard_that_refuses_stops_the_publish_before_any_engine_pauses():
    log = []
    publisher = EnginePublisher(
        PushingBackend(log), [RecordingEngine("a", log)], guard=RecordingGuard(log, refuse=True)
    )
    with pytest.raises(RuntimeError, match="out of service"):
        publisher.publish()
    assert log == [] and publisher.version == 0
