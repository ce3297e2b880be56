"""The benchmark runner's target arithmetic (benchmarks/run.py and the scripts' target functions): pure functions,
checked on hand-written results so a wrong comparison or a crashed table cannot pass unnoticed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(relative: str):
    spec = importlib.util.spec_from_file_location(relative.replace("/", "_")[:-3], BENCHMARKS / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_targets_compare_the_same_dtype():
    engines = _load("rollout/bench_engines.py")
    rows = [
        {"key": "embedded", "dtype": "fp32", "tokens_per_s": 150.0, "gemm_fraction": 0.2},
        {"key": "bf16", "dtype": "bf16", "tokens_per_s": 200.0, "gemm_fraction": 0.05},
        {"key": "vllm-fp32", "dtype": "fp32", "tokens_per_s": 100.0, "gemm_fraction": 0.13},
        {"key": "vllm-bf16", "dtype": "bf16", "tokens_per_s": 400.0, "gemm_fraction": 0.1},
    ]
    got = {t["name"]: (t["value"], t["met"]) for t in engines.engine_targets(rows)}
    assert got == {
        "embedded fp32 tokens/s vs vLLM fp32": (1.5, True),
        "embedded fp32 fraction of the GEMM peak": (0.2, False),
        "embedded bf16 tokens/s vs vLLM bf16": (0.5, False),
        "embedded bf16 fraction of the GEMM peak": (0.05, False),
    }
    # vLLM skipped: only the GEMM fractions remain
    assert [t["name"] for t in engines.engine_targets(rows[:1])] == ["embedded fp32 fraction of the GEMM peak"]


def test_default_job_targets_use_medians_and_the_eval_gain():
    job = _load("loop/bench_default_job.py")
    base = [{"wall_s": 500.0, "eval_before": 0.25, "eval_after": 0.85}]
    head = [{"wall_s": 240.0, "eval_before": 0.25, "eval_after": 0.75}]
    wall, gain = job.targets(base, head)
    assert wall["value"] == pytest.approx(0.48) and wall["met"]
    assert gain["value"] == pytest.approx(0.5 / 0.6) and not gain["met"]  # 0.83x < 0.9x the baseline's gain


def test_summary_table_lists_every_target_and_why_a_benchmark_did_not_run():
    runner = _load("run.py")
    results = {
        "push": {
            "status": "ran",
            "targets": [{"name": "shm push vs memcpy", "target": "<= 1.5", "value": 1.64, "met": False}],
        },
        "trl": {"status": "not run", "reason": "trl is not installed: uv sync --locked --inexact --group bench"},
        "engines": {"status": "ran", "targets": []},
    }
    assert runner.summary_table(results).splitlines()[2:] == [
        "| push | shm push vs memcpy <= 1.5 | 1.64 | not met |",
        "| trl | not run: trl is not installed: uv sync --locked --inexact --group bench | | |",
        "| engines | (no target measured: a compared row was skipped) | | |",
    ]


def test_every_benchmark_the_runner_names_exists_and_takes_json():
    runner = _load("run.py")
    for key, command in runner.commands(quick=True, vllm_python=None).items():
        script = BENCHMARKS / command[0]
        assert script.is_file(), key
        assert '"--json"' in script.read_text(), f"{script} has no --json option"
