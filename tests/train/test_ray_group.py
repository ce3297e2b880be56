"""RayTrainGroup: two FSDP2 ranks as Ray actors (gloo) give what one in-process FSDP2Backend gives on the same global
batch; checkpoints round-trip; rank 0 pushes weights straight to a receiver; a killed rank is named and close()
releases everything. One local Ray cluster (4 logical CPUs) serves the whole module."""

import functools
import importlib.util
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from miles.core.algorithms.objective import LossCounts, PolicyObjective
from miles.core.batch import TrainBatch
from miles.core.config import AlgorithmConfig
from miles.core.execution import import_ray, placement_group_for, ray_session
from miles.train import FSDP2Backend, TrainConfig
from miles.train.config import MegatronConfig
from miles.train.ray_group import TRAINER_RNG_FILE, RayTrainGroup, TrainerRankFailed, pad_shard, shard_rows

sys.path.insert(0, str(Path(__file__).parent))
from batch_fixture import make_batch  # noqa: E402

OBJECTIVE = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
TRAIN = dict(lr=1e-2, micro_batch_size=2)
WEIGHT_GROUP = "miles_test_ray_group_weights"


def ray_test(test):
    """Marks a test on the module's Ray cluster as slow: here Ray starts in ~20 s and each trainer rank imports torch
    and transformers in ~15 s (a group of 2 ranks: ~35 s), so these run in the `pytest -m slow` step."""
    return pytest.mark.slow(pytest.mark.integration(test))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _batch(num: int = 5) -> TrainBatch:
    """``num`` rows (5 over 2 ranks: 3 + 2) with old log-probs far from the current policy, so ratios clip."""
    batch = make_batch(num=num)
    return batch.replace(old_log_probs=batch.rollout_log_probs)


# -- the weight receiver of the push test: pickled by value into Ray workers (this module is not importable there)
def gloo_weight_sender(address: str, port: int):
    """Runs in rank 0's actor: join a 2-rank weight group as its sender (rank 0)."""
    from miles.sync import WeightSender
    from miles.sync.transports.distributed import DistributedTransport, init_weight_group

    group = init_weight_group(
        backend="gloo",
        master_address=address,
        master_port=port,
        world_size=2,
        rank=0,
        group_name=WEIGHT_GROUP,
        timeout_s=120,
    )
    return WeightSender(DistributedTransport(group, src=0))


class WeightCollector:
    """A stand-in engine (a Ray actor): joins the weight group as rank 1 and returns what one update applied."""

    def receive_one(self, address: str, port: int) -> tuple[int, dict[str, torch.Tensor]]:
        from miles.sync import WeightReceiver
        from miles.sync.transports.distributed import DistributedEndpoint, init_weight_group

        group = init_weight_group(
            backend="gloo",
            master_address=address,
            master_port=port,
            world_size=2,
            rank=1,
            group_name=WEIGHT_GROUP,
            timeout_s=120,
        )
        received: dict[str, torch.Tensor] = {}
        receiver = WeightReceiver(apply_fn=lambda named: received.update({n: t.clone() for n, t in named}))
        DistributedEndpoint(receiver, group, src=0).serve_update()
        return receiver.weight_version, received


# -- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 4 logical CPUs for the module (2-rank groups of 1 CPU each, two at a time)."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed: uv sync")
    ray = import_ray()
    from ray import cloudpickle

    if __name__ in sys.modules:  # the helpers above travel by value: workers cannot import this test module
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with ray_session(num_cpus=4, include_dashboard=False):
        yield ray


@pytest.fixture(scope="module")
def pushing_group(ray_cluster, tiny_llama_dir):
    """A 2-rank group whose rank 0 sends weights to a ``WeightCollector`` actor; yields (group, collector ref)."""
    ray = ray_cluster
    port = _free_port()
    collector = ray.remote(WeightCollector).options(num_cpus=0).remote()
    received = collector.receive_one.remote("127.0.0.1", port)  # waits for the sender to join
    group = RayTrainGroup(
        tiny_llama_dir,
        train=TrainConfig(world_size=2, **TRAIN),
        temperature=1.0,
        weight_sink_factory=functools.partial(gloo_weight_sender, "127.0.0.1", port),
    )
    yield group, received
    group.close()
    ray.kill(collector)


def _in_process_backend(model_dir) -> FSDP2Backend:
    return FSDP2Backend(model_dir, train=TrainConfig(**TRAIN), temperature=1.0)


def _assert_same_tensors(got: dict, want: dict, *, atol: float) -> None:
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=name)


# -- sharding (pure) -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "batch_size, world_size, expected",
    [
        pytest.param(6, 2, [(0, 3), (3, 6)], id="even"),
        pytest.param(5, 2, [(0, 3), (3, 5)], id="uneven_first_rank_gets_the_extra_row"),
        pytest.param(7, 3, [(0, 3), (3, 5), (5, 7)], id="7_over_3_is_3_2_2"),
        pytest.param(1, 2, [(0, 1), (1, 1)], id="fewer_rows_than_ranks_leaves_a_rank_empty"),
    ],
)
def test_shard_rows_gives_contiguous_balanced_slices_in_rank_order(batch_size, world_size, expected):
    assert [(r.start, r.stop) for r in shard_rows(batch_size, world_size)] == expected


def test_pad_shard_fills_with_untrained_copies_of_the_shortest_row():
    batch = make_batch(num=5)  # row lengths (prompt + response) 5, 5, 8, 7, 5 -> shortest is row 0
    shard = pad_shard(batch, range(3, 5), num_rows=3)
    assert torch.equal(shard.tokens[:2], batch.tokens[3:5]) and torch.equal(shard.tokens[2], batch.tokens[0])
    assert torch.equal(shard.loss_mask[:2], batch.loss_mask[3:5])
    assert not shard.loss_mask[2].any()
    for name in ("advantages", "rollout_log_probs"):  # per-token tensors hold 0 where loss_mask is False
        assert torch.equal(getattr(shard, name)[:2], getattr(batch, name)[3:5]) and not getattr(shard, name)[2].any()
    empty = pad_shard(batch, range(5, 5), num_rows=1)  # a rank without rows still runs one (untrained) row
    assert empty.batch_size == 1 and not empty.loss_mask.any()


def test_megatron_replicas_get_their_rows_on_every_tensor_parallel_rank_and_one_rank_answers_for_each():
    """World 4 = TP 2 x 2 replicas (Megatron's layout: a replica's ranks are consecutive): ranks 0, 1 get replica
    0's rows (3 of 5), ranks 2, 3 replica 1's (2, padded to 3); forward keeps one answer per replica, ranks 0 and 2."""
    group = RayTrainGroup.__new__(RayTrainGroup)
    group.world_size, group.replica_of = 4, [MegatronConfig(tensor_parallel_size=2).replica_of(r, 4) for r in range(4)]
    batch = _batch()
    rows, shards = group._shards(batch)
    assert rows == [range(0, 3), range(3, 5)]
    assert [s.batch_size for s in shards] == [3, 3, 3, 3]
    assert torch.equal(shards[0].tokens, shards[1].tokens) and torch.equal(shards[2].tokens, shards[3].tokens)
    assert torch.equal(shards[2].tokens[:2], batch.tokens[3:5])

    def answer(name, per_rank):  # each rank answers with its rank number in every cell
        return [
            {"old_log_probs": torch.full(shard.loss_mask.shape, float(rank))}
            for rank, (shard, _) in enumerate(per_rank)
        ]

    group._call = answer
    got = group.forward(batch, outputs={"old_log_probs"}).old_log_probs
    assert got[:, 0].tolist() == [0.0, 0.0, 0.0, 2.0, 2.0]


def test_import_ray_names_the_install_command_when_ray_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(
        ImportError, match=r"uv sync \(the Miles workspace installs it\) or pip install 'miles-core\[ray\]'"
    ):
        import_ray()


# -- Ray session and placement -------------------------------------------------------------------------
@ray_test
def test_a_nested_ray_session_joins_the_running_one_and_leaves_it_running(ray_cluster):
    with ray_session():
        assert ray_cluster.is_initialized()
    assert ray_cluster.is_initialized()


@ray_test
def test_a_placement_group_larger_than_the_cluster_is_refused_naming_the_cpus(ray_cluster):
    with pytest.raises(ValueError, match=r"asks for 5 CPU, but the Ray cluster has only 4 CPU"):
        with placement_group_for([{"CPU": 1}] * 5):
            pass


@ray_test
def test_a_placement_group_that_cannot_be_placed_now_times_out_naming_what_is_available(ray_cluster):
    free = ray_cluster.available_resources()["CPU"]
    with placement_group_for([{"CPU": free - 1}]):  # leaves 1 CPU free
        with pytest.raises(TimeoutError, match=r"asking for 2 CPU was not placed within 0.5s: 1 CPU are available"):
            with placement_group_for([{"CPU": 1}] * 2, timeout_s=0.5):
                pass


# -- the group against the in-process backend ---------------------------------------------------------
@ray_test
@pytest.mark.parametrize("num_rows", [5, 1], ids=["uneven_3_plus_2", "one_row_for_two_ranks"])
def test_forward_old_log_probs_equal_the_in_process_backend(pushing_group, tiny_llama_dir, num_rows):
    group, _ = pushing_group
    batch = make_batch(num=num_rows)
    got = group.forward(batch, outputs={"old_log_probs"})
    want = _in_process_backend(tiny_llama_dir).forward(batch, outputs={"old_log_probs"})
    assert got.old_log_probs.shape == batch.loss_mask.shape
    torch.testing.assert_close(got.old_log_probs, want.old_log_probs, atol=1e-5, rtol=0)
    assert torch.equal(got.tokens, batch.tokens) and got.ref_log_probs is None  # nothing else computed


@ray_test
def test_forward_of_an_output_no_rank_holds_raises_value_error(pushing_group):
    group, _ = pushing_group
    assert group.available_outputs == frozenset({"old_log_probs"})
    with pytest.raises(ValueError, match=r"cannot compute \['ref_log_probs'\]"):
        group.forward(make_batch(num=2), outputs={"ref_log_probs"})


@ray_test
def test_an_objective_that_does_not_pickle_is_refused_before_any_rank_runs(pushing_group):
    group, _ = pushing_group
    objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=8)
    objective.lock = threading.Lock()  # e.g. a plugin object holding a lock
    batch = _batch()
    with pytest.raises(TypeError, match="must pickle to reach the trainer actors"):
        group.forward_backward(batch, objective, LossCounts.of(batch))


@ray_test
def test_two_ranks_give_the_in_process_gradients_metrics_and_updated_weights(pushing_group, tiny_llama_dir):
    """5 rows over 2 ranks (3 + 2, the short rank padded with an untrained row) with the global counts."""
    group, _ = pushing_group
    reference = _in_process_backend(tiny_llama_dir)
    batch = _batch()
    _assert_same_tensors(group.full_state_dict(), reference.full_state_dict(), atol=0)  # same start

    got = group.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    want = reference.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    assert got.keys() == want.keys()
    assert want["pg_clipfrac"] > 0  # the ratios are far from 1: the clipped branch is exercised
    for name in want:
        assert got[name] == pytest.approx(want[name], abs=1e-5), name
    _assert_same_tensors(group.full_gradients(), reference.full_gradients(), atol=1e-5)

    got_step, want_step = group.optimizer_step(), reference.optimizer_step()
    assert got_step == pytest.approx(want_step, abs=1e-5)
    _assert_same_tensors(group.full_state_dict(), reference.full_state_dict(), atol=1e-5)


@ray_test
@pytest.mark.parametrize("tensor_parallel", [2, 1], ids=["megatron_tp2", "megatron_dp2"])
def test_megatron_ranks_give_the_in_process_megatron_backend(ray_cluster, tiny_llama_dir, tensor_parallel):
    """train.backend megatron on 2 actors: one tensor-parallel replica (both ranks get all 5 rows) or two
    data-parallel replicas (3 + 2 rows, the short one padded): log-probs, metrics, gradients and a step equal one
    in-process rank's."""
    pytest.importorskip("megatron.core")
    from miles.train.megatron import MegatronBackend

    train = dict(TRAIN, backend="megatron", adam_eps=1e-4)
    reference = MegatronBackend(tiny_llama_dir, train=TrainConfig(**train), temperature=1.0)
    batch = _batch()
    layout = TrainConfig(world_size=2, megatron={"tensor_parallel_size": tensor_parallel}, **train)
    with RayTrainGroup(tiny_llama_dir, train=layout, temperature=1.0) as group:
        want = reference.forward(batch, outputs={"old_log_probs"}).old_log_probs * batch.loss_mask
        got = group.forward(batch, outputs={"old_log_probs"}).old_log_probs * batch.loss_mask
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        got, want = (b.forward_backward(batch, OBJECTIVE, LossCounts.of(batch)) for b in (group, reference))
        assert got == pytest.approx(want, abs=1e-5)
        _assert_same_tensors(group.full_gradients(), reference.full_gradients(), atol=1e-5)
        assert group.optimizer_step() == pytest.approx(reference.optimizer_step(), abs=1e-5)
        _assert_same_tensors(group.full_state_dict(), reference.full_state_dict(), atol=1e-5)


@ray_test
def test_push_weights_goes_from_rank_0_to_the_receiver_bit_for_bit(pushing_group):
    ray = import_ray()
    group, received = pushing_group
    group.push_weights(1)
    version, tensors = ray.get(received, timeout=120)
    assert version == 1
    _assert_same_tensors(tensors, group.full_state_dict(), atol=0)


@ray_test
def test_save_then_load_into_a_fresh_group_restores_weights_optimizer_and_rng(pushing_group, tiny_llama_dir, tmp_path):
    group, _ = pushing_group
    batch = _batch()
    group.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    group.optimizer_step()  # a non-trivial optimizer state to restore
    group.save(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("trainer_rng_rank*.json")) == [
        TRAINER_RNG_FILE.format(rank=r) for r in range(2)
    ]
    with RayTrainGroup(tiny_llama_dir, train=TrainConfig(world_size=2, **TRAIN), temperature=1.0, seed=1) as restored:
        restored.load(tmp_path)
        _assert_same_tensors(restored.full_state_dict(), group.full_state_dict(), atol=0)
        for rank, actor in enumerate(restored.actors):  # seeded differently, then continued from the checkpoint
            saved = json.loads((tmp_path / TRAINER_RNG_FILE.format(rank=rank)).read_text())
            assert import_ray().get(actor.rng_state.remote()) == saved
        # Same weights, optimizer and schedule state -> the next step lands on the same weights exactly.
        next_batch = _batch().replace(advantages=-_batch().advantages)
        for trainer in (group, restored):
            trainer.forward_backward(next_batch, OBJECTIVE, LossCounts.of(next_batch))
            trainer.optimizer_step()
        _assert_same_tensors(restored.full_state_dict(), group.full_state_dict(), atol=0)


# -- failures ----------------------------------------------------------------------------------------------
@ray_test
def test_a_killed_rank_fails_every_later_call_naming_it_and_close_releases_actors_and_bundles(
    ray_cluster, tiny_llama_dir
):
    ray = ray_cluster
    from ray.exceptions import RayActorError

    def placed() -> set:
        return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"}

    placed_before, cpus_before = placed(), ray.available_resources().get("CPU", 0.0)
    group = RayTrainGroup(tiny_llama_dir, train=TrainConfig(world_size=2, **TRAIN), temperature=1.0)
    assert len(placed() - placed_before) == 1
    actors = group.actors
    ray.kill(actors[1])
    batch = _batch()
    with pytest.raises(TrainerRankFailed, match="trainer rank 1 of 2 died during forward_backward") as failed:
        group.forward_backward(batch, OBJECTIVE, LossCounts.of(batch))
    assert failed.value.rank == 1
    with pytest.raises(TrainerRankFailed, match="trainer rank 1 of 2 died"):  # the group stays failed
        group.optimizer_step()

    group.close()
    group.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        group.full_state_dict()
    for actor in actors:
        with pytest.raises(RayActorError):
            ray.get(actor.rendezvous_address.remote(), timeout=60)
    assert placed() == placed_before
    deadline = time.monotonic() + 30  # the raylet reports freed resources asynchronously
    while ray.available_resources().get("CPU", 0.0) < cpus_before and time.monotonic() < deadline:
        time.sleep(0.2)
    # at least what was free before: earlier tests' actors may free theirs meanwhile (a loaded CI run measured 0 free
    # CPUs before and 2 after), while bundles the group kept would leave fewer
    assert ray.available_resources().get("CPU", 0.0) >= cpus_before


def test_megatron_rank_order_puts_a_replicas_pipeline_stages_world_over_pp_apart():
    """Megatron's order tp-cp-ep-dp-pp, rank = t + TP * (d + DP * p). World 8 = TP 2 x PP 2 x 2 replicas: ranks 0, 1
    (stage 0) and 4, 5 (stage 1) are replica 0; 2, 3 and 6, 7 replica 1. PP 2 x 2 replicas (TP 1, e.g. with EP 2):
    replica 0 = ranks 0 and 2. Forward keeps the answer of each replica's first rank (0 and 1 below)."""
    layout = MegatronConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [layout.replica_of(rank, 8) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    group = RayTrainGroup.__new__(RayTrainGroup)
    pipeline = MegatronConfig(pipeline_parallel_size=2, expert_parallel_size=2)
    group.world_size, group.replica_of = 4, [pipeline.replica_of(r, 4) for r in range(4)]
    assert group.replica_of == [0, 1, 0, 1]
    batch = _batch()
    rows, shards = group._shards(batch)
    assert rows == [range(0, 3), range(3, 5)]
    assert torch.equal(shards[0].tokens, shards[2].tokens) and torch.equal(shards[1].tokens[:2], batch.tokens[3:5])

    def answer(name, per_rank):
        return [
            {"old_log_probs": torch.full(shard.loss_mask.shape, float(rank))}
            for rank, (shard, _) in enumerate(per_rank)
        ]

    group._call = answer
    got = group.forward(batch, outputs={"old_log_probs"}).old_log_probs
    assert got[:, 0].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="not a multiple of train.megatron.tensor_parallel_size x"):
        layout.replica_of(0, 6)


def test_megatron_rank_order_gives_a_replicas_context_parallel_ranks_the_same_rows():
    """rank = t + TP * (c + CP * (d + DP * p)). World 8 = TP 2 x CP 2 x 2 replicas: ranks 0-3 (t, c in {0, 1}) are
    replica 0, 4-7 replica 1. CP 2 x PP 2 x 2 replicas: ranks 0, 1 (stage 0) and 4, 5 (stage 1) are replica 0."""
    layout = MegatronConfig(tensor_parallel_size=2, context_parallel_size=2)
    assert [layout.replica_of(rank, 8) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    pipeline = MegatronConfig(context_parallel_size=2, pipeline_parallel_size=2)
    assert [pipeline.replica_of(rank, 8) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [MegatronConfig(context_parallel_size=2).replica_of(rank, 2) for rank in range(2)] == [0, 0]
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size x context_parallel_size x pipeline_parallel_size \(4\)"
    ):
        layout.replica_of(0, 6)
