"""EnginePublisher: pause -> push -> flush -> version bump -> resume, the version owned in one place, inside the
guard the caller gives (Ray mode: the engine supervisor's)."""

import asyncio
import contextlib

import pytest
import torch
from miles.core.publisher import Colocation, EnginePublisher, run_sync
from miles.sync import WeightUpdateError


class RecordingEngine:
    def __init__(self, name, log):
        self.name, self.log = name, log

    async def pause(self, mode):
        self.log.append((self.name, "pause", mode))
        return []

    async def flush_cache(self):
        self.log.append((self.name, "flush"))

    async def resume(self):
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


class CorruptingSender:
    """A weight sink that damages one tensor on the way (a transfer bug the probe must catch)."""

    def __init__(self, sender, name=None):
        self.sender, self.name = sender, name

    def push(self, named_tensors, *, version=None):
        named = [(n, torch.randn_like(t) if n == self.name else t) for n, t in named_tensors]
        return self.sender.push(named, version=version)


def _probed_publisher(tiny_llama_dir, *, corrupt=None, max_abs_diff=0.1):
    from miles.core.publisher import LogProbProbe
    from miles.rollout.engines import EmbeddedEngine
    from miles.sync import InProcessTransport, WeightSender
    from miles.train import FSDP2Backend, TrainConfig

    engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2], logprob_mode="decode")
    sink = CorruptingSender(WeightSender(InProcessTransport(engine.receiver)), corrupt)
    backend = FSDP2Backend(tiny_llama_dir, train=TrainConfig(), temperature=0.7, weight_sink=sink)
    probe = LogProbProbe([1, 5, 9, 3], temperature=0.7, max_new_tokens=12, max_abs_diff=max_abs_diff, seed=5)
    return EnginePublisher(backend, [engine], probe=probe), engine


def test_the_probe_reports_the_engine_trainer_log_prob_difference_after_each_update(tiny_llama_dir):
    publisher, engine = _probed_publisher(tiny_llama_dir)
    assert publisher.metrics() == {}  # nothing published yet
    assert publisher.publish() == 1
    diff = publisher.metrics()["sync/probe_logprob_max_abs_diff"]
    assert 0.0 <= diff < 1e-4  # fp32 decode-step log-probs vs the trainer's forward, same weights


def test_the_probe_fails_an_update_whose_transfer_damaged_a_linear_layer(tiny_llama_dir):
    publisher, engine = _probed_publisher(tiny_llama_dir, corrupt="model.layers.0.mlp.down_proj.weight")
    with pytest.raises(WeightUpdateError, match=r"log-probs of the probe prompt differ from the trainer's by up to"):
        publisher.publish()
    report_only, _ = _probed_publisher(tiny_llama_dir, corrupt="model.layers.0.mlp.down_proj.weight", max_abs_diff=None)
    assert report_only.publish() == 1 and report_only.metrics()["sync/probe_logprob_max_abs_diff"] > 0.1


class StaleEngine(RecordingEngine):
    """Answers the probe from weights older than the ones just published."""

    weight_version = 0

    async def generate(self, request):
        from miles.core.protocols import GenerateOutput

        return GenerateOutput(response_tokens=[3], log_probs=[-1.0], finish_reason="length", weight_version=0)


def test_the_probe_fails_an_engine_that_answers_from_older_weights():
    from miles.core.publisher import LogProbProbe

    log = []
    probe = LogProbProbe([1, 2], max_new_tokens=1)
    publisher = EnginePublisher(PushingBackend(log), [StaleEngine("a", log)], probe=probe)
    with pytest.raises(WeightUpdateError, match=r"the weight probe on engine 0 ran on weights v0, not the v1"):
        publisher.publish()


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


class RendezvousEngine(RecordingEngine):
    """Its pause returns only once every engine's pause has started: publishing one engine after another hangs."""

    def __init__(self, name, log, started, count):
        super().__init__(name, log)
        self.started, self.count = started, count

    async def pause(self, mode):
        self.started.append(self.name)
        while len(self.started) < self.count:
            await asyncio.sleep(0.01)
        return await super().pause(mode)


def test_engines_pause_concurrently():
    log, started = [], []
    engines = [RendezvousEngine(name, log, started, 3) for name in "abc"]
    publisher = EnginePublisher(PushingBackend(log), engines)
    assert run_sync(asyncio.wait_for(asyncio.to_thread(publisher.publish), 10)) == 1
    assert sorted(started) == ["a", "b", "c"] and log[-3:] == [(n, "resume") for n in "abc"]


class FailingPauseEngine(RecordingEngine):
    async def pause(self, mode):
        raise RuntimeError(f"{self.name}: POST /pause failed")


def test_an_engine_that_fails_to_pause_leaves_no_engine_paused_and_nothing_pushed():
    log = []
    engines = [RecordingEngine("a", log), FailingPauseEngine("b", log)]
    publisher = EnginePublisher(PushingBackend(log), engines)
    with pytest.raises(RuntimeError, match="b: POST /pause failed"):
        publisher.publish()
    assert log == [("a", "pause", "keep"), ("a", "resume"), ("b", "resume")]
    assert publisher.version == 0


def test_run_sync_works_inside_a_running_event_loop():
    async def inner():
        return run_sync(asyncio.sleep(0, result=7))  # a sync caller (publish) reached from async code

    assert asyncio.run(inner()) == 7


# -- colocation ----------------------------------------------------------------------------------------------------
class MemoryEngine(RecordingEngine):
    """An engine that frees and re-allocates its memory (``SGLangEngine.release_memory`` / ``resume_memory``)."""

    def release_memory(self, tags):
        self.log.append((self.name, "release", tags))

    def resume_memory(self, tags):
        self.log.append((self.name, "resume_memory", tags))


class OffloadingBackend(PushingBackend):
    def offload(self):
        self.log.append(("backend", "offload"))

    def onload(self):
        self.log.append(("backend", "onload"))


def test_colocation_frees_the_engines_for_training_and_pushes_into_weights_before_the_kv_cache():
    """slime's --colocate order: release everything -> trainer onload; then (engines paused) trainer offload ->
    weights re-allocated -> push -> KV cache re-allocated -> flush -> resume."""
    log = []
    engines = [MemoryEngine("a", log), MemoryEngine("b", log)]
    backend = OffloadingBackend(log)
    colocation = Colocation(engines)
    publisher = EnginePublisher(backend, engines, colocation=colocation)
    colocation.start(backend)
    assert log == [("backend", "offload")]  # the trainer leaves the devices to the first rollout
    log.clear()
    colocation.to_trainer(backend)
    colocation.to_trainer(backend)  # once per rollout: a second call frees nothing twice
    assert log == [("a", "release", None), ("b", "release", None), ("backend", "onload")]
    assert colocation.released
    log.clear()
    assert publisher.publish() == 1
    assert log == [
        ("a", "pause", "keep"),
        ("b", "pause", "keep"),
        ("backend", "offload"),
        ("a", "resume_memory", ["weights"]),
        ("b", "resume_memory", ["weights"]),
        ("backend", "push", 1),
        ("a", "resume_memory", ["kv_cache"]),
        ("b", "resume_memory", ["kv_cache"]),
        ("a", "flush"),
        ("b", "flush"),
        ("a", "resume"),
        ("b", "resume"),
    ]
    assert not colocation.released
    assert set(publisher.metrics()) == {"time/colocation"} and publisher.metrics()["time/colocation"] == 0.0
    # nothing released (a resume's checkpoint push, a re-weighted server): a plain publish
    log.clear()
    assert publisher.publish() == 2
    assert [entry[1] for entry in log] == ["pause", "pause", "push", "flush", "flush", "resume", "resume"]


def test_colocation_with_a_trainer_that_holds_no_accelerator_memory_only_moves_the_engines():
    log = []
    engine = MemoryEngine("a", log)
    backend = PushingBackend(log)  # no offload / onload: the CPU FSDP2 trainer
    colocation = Colocation([engine])
    publisher = EnginePublisher(backend, [engine], colocation=colocation)
    colocation.start(backend)
    colocation.to_trainer(backend)
    publisher.publish()
    assert [entry[1:] for entry in log] == [
        ("release", None),
        ("pause", "keep"),
        ("resume_memory", ["weights"]),
        ("push", 1),
        ("resume_memory", ["kv_cache"]),
        ("flush",),
        ("resume",),
    ]


def test_a_failed_colocated_push_leaves_the_kv_cache_released_and_keeps_the_version():
    log = []
    engine = MemoryEngine("a", log)
    backend = PushingBackend(log, fail_at={1})
    colocation = Colocation([engine])
    publisher = EnginePublisher(backend, [engine], colocation=colocation)
    colocation.to_trainer(backend)
    with pytest.raises(WeightUpdateError):
        publisher.publish()
    assert publisher.version == 0 and colocation.released == {"kv_cache"}
    assert ("a", "resume_memory", ["kv_cache"]) not in log and log[-1] == ("a", "resume")
    # the next publish (a restarted trainer's) pushes into the weights already re-allocated, then the KV cache
    log.clear()
    publisher.backend = PushingBackend(log)
    assert publisher.publish() == 1
    assert [entry[1:] for entry in log] == [
        ("pause", "keep"),
        ("push", 1),
        ("resume_memory", ["kv_cache"]),
        ("flush",),
        ("resume",),
    ]
    assert not colocation.released


def test_the_loop_frees_the_colocated_engines_after_the_rollout_and_before_the_trainers_first_forward():
    from doubles import FakeBackend, NullSink, TokenPrompts
    from miles.core.config import AlgorithmConfig, RolloutConfig
    from miles.core.loop import Components, run_step
    from miles.core.sample import Sample, SampleStatus

    log = []

    class LoggedBackend(FakeBackend):
        def forward_backward(self, batch, objective, counts):
            assert colocation.released, "the trainer ran while the engines held their memory"
            return super().forward_backward(batch, objective, counts)

        def push_weights(self, version):
            log.append(("backend", "push", version))

    async def generate_group(prompt, n, sampling, seeds):
        log.append(("engine", "generate"))
        return [
            Sample(index=j, group_index=prompt.group_index, prompt=prompt.prompt, tokens=[*prompt.prompt, 5 + j],
                   response_length=1, rollout_log_probs=[-1.0], status=SampleStatus.COMPLETED)
            for j in range(n)
        ]  # fmt: skip

    engine = MemoryEngine("a", log)
    backend = LoggedBackend()
    colocation = Colocation([engine])
    c = Components(
        data_source=TokenPrompts(),
        generate_group=generate_group,
        reward_fn=lambda sample: float(sample.response_tokens[0] == 5),
        backend=backend,
        publisher=EnginePublisher(backend, [engine], colocation=colocation),
        sink=NullSink(),
        colocation=colocation,
    )
    metrics = run_step(c, step=0, rollout=RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2),
                       algorithm=AlgorithmConfig())  # fmt: skip
    order = [entry[1] for entry in log]
    # the trainer's work (forward for old log-probs, forward_backward) runs between the release and the pause
    assert order == ["generate", "release", "pause", "resume_memory", "push", "resume_memory", "flush", "resume"]
    assert len(backend.batches) == 1 and backend.steps == 1
    assert metrics["weight_version"] == 1.0 and "time/colocation" in metrics
