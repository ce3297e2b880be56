"""The arithmetic of sync_model.py against hand-computed numbers (no torch, no processes; well under a second).

Run: uv run --no-sync pytest benchmarks/sync/test_sync_model.py -p no:cacheprovider
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import sync_model as m  # noqa: E402

SEVEN_B = m.ModelSpec("7B", 7e9, wire_bytes_per_param=2.0)  # 14 GB on the wire
LINK_50 = m.Assumptions(link_gbps=50.0, fixed_s=0.0, per_bucket_s=0.0)


def test_14_gb_over_one_50_gb_per_s_link_from_one_sender_takes_0_28_s():
    cluster = m.ClusterSpec("1 -> 1", trainer_gpus=1, engine_replicas=1, engine_gpus_per_replica=1)
    for topology in ("p2p", "broadcast"):
        p = m.predict(SEVEN_B, cluster, m.Scenario(topology), LINK_50)
        assert p.stages["transfer"] == pytest.approx(0.28)


def test_broadcast_costs_one_model_per_engine_gpu_whatever_the_engine_count():
    cluster = m.ClusterSpec("1 -> 8 x 1", trainer_gpus=8, engine_replicas=8, engine_gpus_per_replica=1)
    for senders in (1, 4):
        p = m.predict(SEVEN_B, cluster, m.Scenario("broadcast", senders), LINK_50)
        assert p.stages["transfer"] == pytest.approx(0.28)  # a ring relays; each engine GPU still receives 14 GB


def test_p2p_spreads_the_replicas_over_the_senders_and_shards_over_engine_gpus():
    # 8 replicas from 1 sender: 8 x 14 GB leave one link
    one_sender = m.ClusterSpec("1 -> 8 x 1", trainer_gpus=1, engine_replicas=8, engine_gpus_per_replica=1)
    assert m.predict(SEVEN_B, one_sender, m.Scenario("p2p"), LINK_50).stages["transfer"] == pytest.approx(2.24)
    # 8 senders share it: 14 GB each
    eight = m.ClusterSpec("8 -> 8 x 1", trainer_gpus=8, engine_replicas=8, engine_gpus_per_replica=1)
    assert m.predict(SEVEN_B, eight, m.Scenario("p2p"), LINK_50).stages["transfer"] == pytest.approx(0.28)
    # one replica sharded over 4 GPUs, 4 senders: 3.5 GB per link on both sides
    sharded = m.ClusterSpec("4 -> 1 x 4", trainer_gpus=4, engine_replicas=1, engine_gpus_per_replica=4)
    p = m.predict(SEVEN_B, sharded, m.Scenario("p2p"), LINK_50)
    assert p.stages["transfer"] == pytest.approx(0.07)
    assert p.stages["apply"] == pytest.approx(3.5e9 / 1000e9)  # each engine GPU copies its 3.5 GB at 1 TB/s


def test_pipelining_takes_the_slowest_stage_plus_the_fill_and_no_overlap_the_sum():
    assert m.pipelined([1.0, 2.0, 3.0], 1) == pytest.approx(6.0)  # one bucket: nothing overlaps
    assert m.pipelined([1.0, 2.0, 3.0], 4) == pytest.approx(3.0 + 3.0 / 4)
    assert m.pipelined([1.0, 2.0, 3.0], 10**6) == pytest.approx(3.0, abs=1e-5)
    assert m.pipelined([], 3) == 0.0
    p = m.Prediction({"a": 1.0, "b": 2.0, "c": 3.0}, fixed=0.5, num_buckets=4)
    assert (p.pipelined, p.serial, p.slowest) == (pytest.approx(4.25), pytest.approx(6.5), "c")


def test_buckets_and_fixed_costs():
    cluster = m.ClusterSpec("1 -> 1", 1, 1, 1)
    a = m.Assumptions(fixed_s=0.5, post_process_s=0.25, per_bucket_s=0.01, bucket_bytes=1e9)
    p = m.predict(SEVEN_B, cluster, m.Scenario("p2p"), a)
    assert p.num_buckets == 14
    assert p.fixed == pytest.approx(0.5 + 0.25 + 14 * 0.01)


def test_delta_scales_the_transfer_and_adds_its_encode_and_decode():
    cluster = m.ClusterSpec("1 -> 1", 1, 1, 1)
    a = m.Assumptions(link_gbps=50.0, pcie_gbps=40.0, cpu_delta_encode_gbps=0.2, cpu_delta_decode_gbps=0.5)
    gpu = m.predict(SEVEN_B, cluster, m.Scenario("p2p", delta="gpu", sent_fraction=0.25), a)
    assert gpu.stages["transfer"] == pytest.approx(0.07)
    assert gpu.stages["delta encode"] == pytest.approx(14e9 / 500e9)
    assert gpu.stages["delta decode"] == pytest.approx(14e9 / 500e9)
    cpu = m.predict(SEVEN_B, cluster, m.Scenario("p2p", delta="cpu", sent_fraction=0.25), a)
    assert cpu.stages["delta encode"] == pytest.approx(14 / 40 + 14 / 0.2 + 0.25 * 14 / 40)  # d2h, encode, h2d
    assert cpu.stages["delta decode"] == pytest.approx(14 / 0.5 + 14 / 40)  # rebuild on the host, h2d
    full = m.predict(SEVEN_B, cluster, m.Scenario("p2p", sent_fraction=0.25), a)  # no delta: fraction ignored
    assert full.stages["transfer"] == pytest.approx(0.28) and "delta encode" not in full.stages


def test_local_delta_gathers_only_the_delta():
    cluster = m.ClusterSpec("4 -> 1 x 1", 4, 1, 1)
    a = m.Assumptions(gather_gbps=40.0)
    p = m.predict(SEVEN_B, cluster, m.Scenario("p2p", delta="gpu", sent_fraction=0.1, local_delta=True), a)
    assert p.stages["delta encode"] == pytest.approx(3.5e9 / 500e9)  # each trainer GPU diffs its quarter
    assert p.stages["gather"] == pytest.approx(1.4e9 / 40e9)
    assert "pack/encode" not in p.stages


def test_unknown_topology_or_delta_is_rejected():
    cluster = m.ClusterSpec("1 -> 1", 1, 1, 1)
    with pytest.raises(ValueError, match="topology"):
        m.predict(SEVEN_B, cluster, m.Scenario("mesh"), m.Assumptions())
    with pytest.raises(ValueError, match="delta"):
        m.predict(SEVEN_B, cluster, m.Scenario("p2p", delta="tpu"), m.Assumptions())


def test_costs_file_inputs_are_converted_from_gib_to_gb(tmp_path):
    costs = {
        "rows": [
            {"stage": "delta_encode", "variant": "bf16 auto", "gib_per_s": 1.0, "seconds": 1.0},
            {"stage": "delta_decode", "variant": "bf16 auto", "gib_per_s": 2.0, "seconds": 0.5},
            {"stage": "fixed", "variant": "gloo control message", "gib_per_s": None, "seconds": 0.003},
        ],
        "delta_fractions": [
            {"wire": "fp32", "change": "adam1", "kind": "auto", "sent_fraction": 0.7},
            {"wire": "bf16", "change": "rel1e-4", "kind": "auto", "sent_fraction": 0.2},
            {"wire": "bf16", "change": "adam1", "kind": "sparse", "sent_fraction": 0.3},
            {"wire": "bf16", "change": "adam1", "kind": "auto", "sent_fraction": 0.4},
        ],
    }
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    a, fraction = m.assumptions_from_costs(path, m.Assumptions())
    assert a.cpu_delta_encode_gbps == pytest.approx(2**30 / 1e9)
    assert a.cpu_delta_decode_gbps == pytest.approx(2 * 2**30 / 1e9)
    assert (a.per_bucket_s, fraction) == (0.003, 0.4)  # bf16, default kind, the change the rates were timed on


def test_defaults_are_the_measured_bf16_default_delta():
    a = m.Assumptions()
    assert (a.cpu_delta_encode_gbps, a.cpu_delta_decode_gbps, a.per_bucket_s) == (0.20, 0.29, 0.00105)
    assert m.MEASURED_CPU["sent_fraction_bf16"] == 0.08
    # 7B, 1 -> 1, CPU delta: 14 GB to the host at 38.4 GB/s, encoded at 0.2 GB/s, 0.08 of it back
    p = m.predict(SEVEN_B, m.ClusterSpec("1 -> 1", 1, 1, 1), m.Scenario("p2p", delta="cpu", sent_fraction=0.08), a)
    assert p.stages["delta encode"] == pytest.approx(14 / 38.4 + 14 / 0.2 + 0.08 * 14 / 38.4)
    assert p.stages["delta decode"] == pytest.approx(14 / 0.29 + 14 / 38.4)


def test_the_tables_render():
    a = m.Assumptions()
    assert len(m.format_predictions(a, 0.08)) == 2 + len(m.MODELS) * len(m.main_scenarios(0.08))
    assert len(m.format_anchors(a)) == 2 + len(m.anchors(a))
    assert len(m.format_sensitivity(a, 0.08)) == 6
