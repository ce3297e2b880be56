"""Sync vs one-step-off vs fully async on the default task, per engine: trained samples/s and reward curves.

    uv run python benchmarks/loop/bench_async_task.py [--engines embedded vllm] [--steps 10] [--out DIR]

Each run is the README's default job (``miles train``: GRPO on SmolLM2-135M-Instruct, basic arithmetic, 8 prompts
x 8 samples per step, 128 held-out eval samples before and after) with ``--engine.type`` and ``--loop.mode`` set,
one run after another on the same cores. The rate is trained samples between the first step's metrics row and the
second-to-last one's, over the wall time between their arrival in ``metrics.jsonl`` (polled every 0.1 s): the
step-0 eval, model loading, the vLLM server's startup and the last row (which carries the final eval) are not
timed. The reward curve is each step's ``reward/mean`` (the rollout reward of the samples trained that step);
``eval/reward`` before and after shows the policy learned. Ratios are to the same engine's sync run in this run.
Prints markdown tables for docs/performance.md; each run's directory (metrics.jsonl, train.log) stays in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

MODES = ["sync", "one_step_off", "fully_async"]


def run_job(name: str, args: list[str], out: Path) -> dict:
    """Run one ``miles train --run.dir out --run.name name *args``, polling its ``metrics.jsonl``; return the per-step
    rows, their arrival times (``time.perf_counter``), the exit code, the run directory and ``peak_mib``: the most
    memory the machine had in use during the run (total - available, sampled every 0.1 s) above what it had in use
    before it started, in MiB (the whole run: driver, servers, Ray's processes and actors)."""
    run_dir = out / name
    command = [sys.executable, "-m", "miles.recipes.cli", "train", "--run.dir", str(out), "--run.name", name, *args]
    metrics = run_dir / "metrics.jsonl"
    rows: dict[int, dict] = {}
    arrival: dict[int, float] = {}
    in_use = psutil.virtual_memory()
    before, peak = in_use.total - in_use.available, 0
    with (out / f"{name}.out").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        seen = 0
        while True:
            done = process.poll() is not None
            in_use = psutil.virtual_memory()
            peak = max(peak, in_use.total - in_use.available - before)
            if metrics.exists():
                lines = metrics.read_text().splitlines()
                now = time.perf_counter()
                for line in lines[seen:]:
                    if line.endswith("}"):
                        row = json.loads(line)
                        rows[row["step"]] = rows.get(row["step"], {}) | row
                        arrival.setdefault(row["step"], now)
                        seen += 1
                    else:
                        break  # a line being written: read it next time
            if done:
                break
            time.sleep(0.1)
    return {
        "rows": rows,
        "arrival": arrival,
        "returncode": process.returncode,
        "dir": run_dir,
        "peak_mib": peak / 2**20,
    }


def summarize(result: dict, steps: int, samples_per_step: int) -> dict:
    rows, arrival = result["rows"], result["arrival"]
    first, last = 1, steps - 1  # the last row waits for the final eval
    seconds = arrival[last] - arrival[first]
    trained = [rows[s] for s in range(1, steps + 1)]
    return {
        "samples_per_s": samples_per_step * (last - first) / seconds,
        "seconds_per_step": seconds / (last - first),
        "reward": [r["reward/mean"] for r in trained],
        "eval_before": rows.get(0, {}).get("eval/reward"),
        "eval_after": rows[steps].get("eval/reward"),
        "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in trained) / len(trained),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in trained),
        "idle": [r["engine/idle_fraction"] for r in trained if r.get("engine/idle_fraction") is not None],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["embedded", "vllm"], choices=["embedded", "vllm"])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--steps", type=int, default=10, help="steps per run (at least 3)")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a new temp directory)")
    parser.add_argument("extra", nargs="*", help="more `miles train` arguments after --, the same for every run")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first and last steps are not timed)")
    out = args.out or Path(tempfile.mkdtemp(prefix="miles-bench-async-"))
    out.mkdir(parents=True, exist_ok=True)
    samples_per_step = 64  # the default recipe: rollout_batch_size 8 x n_samples_per_prompt 8
    print(f"runs in {out}", flush=True)
    results: dict[tuple[str, str], dict] = {}
    for engine in args.engines:
        for mode in args.modes:
            start = time.perf_counter()
            job = ["--engine.type", engine, "--loop.mode", mode, "--loop.num-steps", str(args.steps), *args.extra]
            result = run_job(f"{engine}-{mode}", job, out)
            if result["returncode"] != 0:
                sys.exit(f"{engine} {mode} failed with exit {result['returncode']}: see {out}/{engine}-{mode}.out")
            results[engine, mode] = summary = summarize(result, args.steps, samples_per_step)
            print(f"{engine} {mode} ({time.perf_counter() - start:.0f} s): {json.dumps(summary)}", flush=True)

    print(f"\n| engine | loop | trained samples/s (steps 2-{args.steps - 1}) | vs sync | s/step | staleness mean / max "
          "| eval/reward before -> after |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for (engine, mode), r in results.items():
        base = results.get((engine, "sync"), r)["samples_per_s"]
        print(
            f"| {engine} | {mode} | {r['samples_per_s']:.3f} | {r['samples_per_s'] / base:.2f}x "
            f"| {r['seconds_per_step']:.1f} | {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} "
            f"| {r['eval_before']:.3f} -> {r['eval_after']:.3f} |"
        )
    print("\nreward/mean per step:\n")
    print("| engine | loop | " + " | ".join(str(s) for s in range(1, args.steps + 1)) + " |")
    print("|---|---|" + "---|" * args.steps)
    for (engine, mode), r in results.items():
        print(f"| {engine} | {mode} | " + " | ".join(f"{v:.2f}" for v in r["reward"]) + " |")


if __name__ == "__main__":
    main()
