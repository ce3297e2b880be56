"""execution.mode ray, without a cluster: the config refuses what Ray mode cannot run (one line naming both keys
and the fix), a trainer failure reaches the user as one `miles:` line with the command that continues the run, and
a trainer restart (execution.ray.max_trainer_restarts) restores and rewinds the run's state (with fakes). The run
itself is tested end to end in tests/e2e/test_ray_mode.py (`-m slow`)."""

import json

import pytest
import torch
import yaml
from doubles import FakeBackend, NullSink, TokenPrompts
from miles.core.loop import Components
from miles.recipes.cli import command_prefix, main, resolve_config
from miles.recipes.config import MilesConfig

RAY = ["--execution.mode", "ray", "--engine.type", "sglang", "--engine.server", "miles"]


def _error(overrides: list[str]) -> str:
    with pytest.raises(ValueError) as err:
        resolve_config("smollm2_grpo_arithmetic", overrides)
    message = str(err.value).removeprefix("invalid configuration:\n  ")
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        pytest.param(
            ["--train.world-size", "2"],
            "train.world_size is 2 but execution.mode is 'local', which trains in this one process (world size 1). "
            "Set --execution.mode ray to run 2 FSDP2 ranks as Ray actors (with a server engine: --engine.type sglang "
            "--engine.server miles on CPU), or --train.world-size 1.",
            id="world_size_2_in_local_mode",
        ),
        pytest.param(
            ["--execution.mode", "ray"],
            "execution.mode is 'ray' but engine.type is 'embedded': the embedded engine lives in the driver process "
            "and its in-process weight transfer cannot reach it from the trainer's rank-0 actor. Use a server "
            "engine: --engine.type sglang --engine.server miles (CPU; --engine.type vllm or sglang on GPU), or "
            "--execution.mode local.",
            id="ray_with_the_embedded_engine",
        ),
        pytest.param(
            ["--execution.ray.num-cpus", "4"],
            "execution.ray.num_cpus is 4 but execution.mode is 'local', and it applies to Ray execution only. Set "
            "--execution.mode ray, or drop --execution.ray.num-cpus.",
            id="ray_setting_in_local_mode",
        ),
        pytest.param(
            ["--execution.ray.placement-strategy", "SPREAD"],
            "execution.ray.placement_strategy is 'SPREAD' but execution.mode is 'local', and it applies to Ray "
            "execution only. Set --execution.mode ray, or drop --execution.ray.placement-strategy.",
            id="placement_in_local_mode",
        ),
        pytest.param(
            ["--execution.ray.max-trainer-restarts", "2"],
            "execution.ray.max_trainer_restarts is 2 but execution.mode is 'local', and it applies to Ray execution "
            "only. Set --execution.mode ray, or drop --execution.ray.max-trainer-restarts.",
            id="trainer_restarts_in_local_mode",
        ),
        pytest.param(
            [*RAY, "--execution.ray.max-trainer-restarts", "-1"],
            "execution.ray.max_trainer_restarts [--execution.ray.max-trainer-restarts]: Input should be greater than "
            "or equal to 0 (got -1)",
            id="negative_trainer_restarts",
        ),
        pytest.param(
            [*RAY, "--execution.ray.address", "auto", "--execution.ray.num-cpus", "4"],
            "execution.ray.num_cpus is 4 but execution.ray.address is 'auto': a running cluster's resources are its "
            "own. Drop --execution.ray.num-cpus, or drop --execution.ray.address to start a local cluster with that "
            "many CPUs.",
            id="cpus_of_a_cluster_that_is_joined",
        ),
        pytest.param(
            [*RAY, "--train.world-size", "4", "--execution.ray.num-cpus", "2"],
            "execution.ray.num_cpus is 2, but the trainer's bundles need train.world_size x "
            "execution.ray.trainer_cpus_per_rank = 4 x 1 = 4 CPUs, so they could never be placed. Set "
            "--execution.ray.num-cpus 4 (or more; logical CPUs may exceed the cores), or lower "
            "--execution.ray.trainer-cpus-per-rank.",
            id="bundles_larger_than_the_cluster",
        ),
        pytest.param(
            ["--execution.ray.colocate", "true"],
            "execution.ray.colocate is True but execution.mode is 'local', and it applies to Ray execution only. Set "
            "--execution.mode ray, or drop --execution.ray.colocate.",
            id="colocate_in_local_mode",
        ),
        pytest.param(
            [*RAY, "--execution.ray.colocate", "true", "--loop.mode", "one_step_off"],
            "execution.ray.colocate is true but loop.mode is 'one_step_off': colocated engines and trainer take "
            "turns on the same devices, so rollout and training cannot overlap. Set --loop.mode sync, or "
            "--execution.ray.colocate false (engines on devices of their own).",
            id="colocate_with_an_async_loop",
        ),
        pytest.param(
            ["--execution.mode", "ray", "--engine.type", "vllm", "--execution.ray.colocate", "true"],
            "execution.ray.colocate is true but engine.type is 'vllm': colocation places the engine servers Miles "
            "starts in Ray actors and frees their memory through SGLang's /release_memory_occupation. Use "
            "--engine.type sglang (--engine.server miles on CPU), or --execution.ray.colocate false.",
            id="colocate_with_vllm",
        ),
        pytest.param(
            [*RAY, "--execution.ray.colocate", "true", "--engine.urls", "[http://127.0.0.1:30000]"],
            "execution.ray.colocate is true but engine.urls names servers already running: colocation places the "
            "servers it starts in the trainer's bundles. Drop --engine.urls, or --execution.ray.colocate false.",
            id="colocate_with_running_servers",
        ),
        pytest.param(
            [*RAY, "--execution.ray.colocate", "true", "--execution.ray.engine-cpus-per-server", "1"],
            "execution.ray.engine_cpus_per_server is 1 but execution.ray.colocate is true, which puts the servers in "
            "the trainer's bundles instead. Drop --execution.ray.engine-cpus-per-server, or --execution.ray.colocate.",
            id="engine_bundles_and_colocation",
        ),
        pytest.param(
            [*RAY, "--execution.ray.engine-gpus-per-server", "1", "--engine.urls", "[http://127.0.0.1:30000]"],
            "execution.ray.engine_gpus_per_server is 1 but engine.urls names servers already running: engine bundles "
            "hold the servers Miles starts. Drop --execution.ray.engine-gpus-per-server, or --engine.urls.",
            id="engine_bundles_for_running_servers",
        ),
        pytest.param(
            [
                *RAY,
                "--train.world-size",
                "2",
                "--execution.ray.num-cpus",
                "3",
                "--engine.num-servers",
                "2",
                "--execution.ray.engine-cpus-per-server",
                "1",
            ],
            "execution.ray.num_cpus is 3, but the trainer's bundles (2 CPUs) and the engine bundles "
            "(engine.num_servers x execution.ray.engine_cpus_per_server = 2 x 1 = 2 CPUs) need 4, so they could "
            "never all be placed. Set "
            "--execution.ray.num-cpus 4 (or more; logical CPUs may exceed the cores), or lower "
            "--execution.ray.engine-cpus-per-server.",
            id="engine_and_trainer_bundles_larger_than_the_cluster",
        ),  # fmt: skip
        pytest.param(
            ["--execution.ray.engine-cpus-per-server", "1"],
            "execution.ray.engine_cpus_per_server is 1.0 but execution.mode is 'local', and it applies to Ray "
            "execution only. Set --execution.mode ray, or drop --execution.ray.engine-cpus-per-server.",
            id="engine_bundles_in_local_mode",
        ),
    ],
)
def test_what_ray_mode_cannot_run_is_refused_with_one_line_naming_the_keys_and_the_fix(overrides, expected):
    assert _error(overrides) == expected


def test_ray_mode_with_a_server_engine_and_two_ranks_validates_and_round_trips_through_its_dump():
    cfg = resolve_config(
        "smollm2_grpo_arithmetic",
        [*RAY, "--train.world-size", "2", "--execution.ray.num-cpus", "4", "--execution.ray.placement-strategy",
         "SPREAD", "--execution.ray.trainer-cpus-per-rank", "0.5"],
    )  # fmt: skip
    ray = cfg.execution.ray
    assert (cfg.execution.mode, cfg.train.world_size, ray.num_cpus, ray.placement_strategy) == ("ray", 2, 4, "SPREAD")
    assert (ray.address, ray.namespace, ray.log_to_driver, ray.trainer_cpus_per_rank) == (None, None, True, 0.5)
    assert MilesConfig.model_validate(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))) == cfg


def test_engine_bundles_are_off_by_default_and_hold_the_cpus_and_gpus_asked_for():
    ray = resolve_config("smollm2_grpo_arithmetic", RAY).execution.ray
    assert (ray.engine_cpus_per_server, ray.engine_gpus_per_server, ray.engine_bundle) == (0.0, 0.0, {})
    ray = resolve_config(
        "smollm2_grpo_arithmetic", [*RAY, "--execution.ray.engine-cpus-per-server", "2",
                                    "--execution.ray.engine-gpus-per-server", "1"],
    ).execution.ray  # fmt: skip
    assert ray.engine_bundle == {"CPU": 2.0, "GPU": 1.0}
    gpus_only = resolve_config("smollm2_grpo_arithmetic", [*RAY, "--execution.ray.engine-gpus-per-server", "1"])
    assert gpus_only.execution.ray.engine_bundle == {"GPU": 1.0}


def test_trainer_restarts_default_to_stopping_and_need_no_checkpoints():
    """0 (stop, as before) by default; with loop.save_interval 0 a restart goes back to step 0, so it is accepted."""
    assert resolve_config("smollm2_grpo_arithmetic", RAY).execution.ray.max_trainer_restarts == 0
    overrides = [*RAY, "--execution.ray.max-trainer-restarts", "3", "--loop.save-interval", "0"]
    cfg = resolve_config("smollm2_grpo_arithmetic", overrides)
    assert (cfg.execution.ray.max_trainer_restarts, cfg.loop.save_interval) == (3, 0)


def test_a_local_runs_dump_with_the_ray_defaults_written_out_validates():
    """A local run's config.yaml lists execution.ray at its defaults; resuming it must not count them as set."""
    dump = resolve_config("smollm2_grpo_arithmetic", []).model_dump(mode="json")
    assert dump["execution"]["mode"] == "local" and dump["execution"]["ray"]["placement_strategy"] == "PACK"
    assert MilesConfig.model_validate(dump).execution.mode == "local"


def test_a_failed_trainer_rank_reaches_the_user_as_one_line_with_the_command_that_continues(
    tmp_path, monkeypatch, capsys
):
    import miles.recipes.run as run_module

    def failing_run(cfg, run_dir, **kwargs):
        raise run_module.RunFailed(
            f"trainer rank 1 of 2 died during forward: The actor died; the run stopped and its last checkpoint is "
            f"{run_dir}/checkpoints/step_1"
        )

    monkeypatch.setattr(run_module, "run", failing_run)
    assert main(["train", *RAY, "--train.world-size", "2", "--run.dir", str(tmp_path), "--run.name", "r"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"miles: trainer rank 1 of 2 died during forward: The actor died; the run stopped and its last checkpoint "
        f"is {tmp_path}/r/checkpoints/step_1. Continue with: {command_prefix()}miles train --run.name r --run.dir "
        f"{tmp_path} --resume"
    )


class _Trainer(FakeBackend):
    """A trainer whose ranks can be closed, recording the versions it pushed."""

    def __init__(self) -> None:
        super().__init__()
        self.closed, self.pushed = False, []

    def push_weights(self, version):
        self.pushed.append(version)

    def close(self):
        self.closed = True


class _Engine:
    def __init__(self, weight_version: int) -> None:
        self.weight_version = weight_version

    async def pause(self, mode):
        pass

    async def flush_cache(self):
        pass

    async def resume(self):
        pass


def _components(backend, data_source, *, version: int) -> Components:
    from miles.core.publisher import EnginePublisher

    publisher = EnginePublisher(backend, [_Engine(version)], version=version)
    return Components(
        data_source=data_source, generate_group=None, reward_fn=None, backend=backend, publisher=publisher,
        sink=NullSink(),
    )  # fmt: skip


def test_a_trainer_restart_restores_the_newest_checkpoint_and_gives_the_engine_its_weights_at_its_version(tmp_path):
    from miles.recipes.checkpoint import save_run_checkpoint
    from miles.recipes.run import _restart_trainer

    prompts, saved = TokenPrompts(), _Trainer()
    prompts.next_prompts(2)
    saved.steps = 1
    checkpoint = save_run_checkpoint(tmp_path, 1, backend=saved, data_source=prompts, weight_version=1)
    prompts.next_prompts(2)  # step 2 drew its prompts, then a rank died; the engine holds v2 (pushed after step 2)
    old, new = _Trainer(), _Trainer()
    engine = _Engine(2)
    components = _components(old, prompts, version=2)
    step = _restart_trainer(
        components, build_backend=lambda: new, checkpoint=checkpoint, initial_state=({}, {}), engine=engine,
        pause_mode="keep",
    )  # fmt: skip
    assert step == 1 and old.closed and components.backend is new and new.steps == 1
    assert prompts.count == 2  # step 2's prompts are drawn again
    assert new.pushed == [1] and components.publisher.version == 1  # the next step's push is v2 again


def test_a_trainer_restart_before_any_checkpoint_starts_over_at_step_0_and_pushes_the_initial_weights_anew():
    from miles.core.rng import capture_rng_state
    from miles.recipes.run import _restart_trainer

    prompts = TokenPrompts()
    initial_state = (prompts.state_dict(), capture_rng_state())
    expected_draw = torch.rand(3)
    prompts.next_prompts(4)
    old, new = _Trainer(), _Trainer()
    components = _components(old, prompts, version=3)
    step = _restart_trainer(
        components, build_backend=lambda: new, checkpoint=None, initial_state=initial_state, engine=_Engine(3),
        pause_mode="keep",
    )  # fmt: skip
    assert step == 0 and old.closed and components.backend is new
    assert prompts.count == 0 and torch.equal(torch.rand(3), expected_draw)  # data and RNG as before step 1
    assert new.pushed == [4] and components.publisher.version == 4  # versions never repeat


def test_after_a_restart_the_redone_rows_are_dropped_and_every_record_counts_the_restarts(tmp_path):
    from miles.recipes.run import _RunSink
    from miles.recipes.sinks import ConsoleSink

    path = tmp_path / "metrics.jsonl"
    sink = _RunSink(path, ConsoleSink(3, enabled=False))
    for step in (0, 1, 2):
        sink.log({"loss": float(step)}, step=step)
    sink.rewind(1, restarts=1)
    sink.log({"loss": 2.5}, step=2)
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"step": 0, "loss": 0.0},
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.5, "trainer/restarts": 1.0},  # written after the rewind: to the rewritten file
    ]

    sink = _RunSink(path, ConsoleSink(3, enabled=False))
    sink.rewind(0, restarts=2)  # from step 0 the step-0 eval is logged again too
    sink.close()
    assert path.read_text() == ""


def test_an_engine_the_supervisor_could_not_bring_back_stops_the_run_with_one_line(
    tiny_smollm2_dir, tmp_path, monkeypatch, capsys
):
    import miles.recipes.run as run_module
    from miles.rollout.engines.server_actor import EngineRestartError

    def dead_engine(*args, **kwargs):  # what the loop's engine_health raises after a failed recovery
        raise EngineRestartError(
            "engine http://127.0.0.1:30001 is out of service: no incarnation served within 600s.\nserver log: ..."
        )

    monkeypatch.setattr(run_module, "train", dead_engine)
    args = ["--models.policy.path", str(tiny_smollm2_dir), "--data.size", "4", "--eval.num-prompts", "0"]
    assert main(["train", *args, "--run.dir", str(tmp_path), "--run.name", "e", "--run.progress", "false"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "miles: engine http://127.0.0.1:30001 is out of service: no incarnation served within 600s; the run stopped "
        "and no checkpoint was written (it starts at step 0). Continue with: "
        f"{command_prefix()}miles train --run.name e --run.dir {tmp_path} --resume"
    )
