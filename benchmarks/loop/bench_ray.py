"""Ray mode (disaggregated and colocated) vs local mode on the default task: the overhead of Ray, as a ratio of
trained samples/s, and the peak memory each needs, in one run.

    uv run python benchmarks/loop/bench_ray.py [--steps 6] [--repeats 1] [--out DIR]

All runs are the README's default job (``miles train``: GRPO on SmolLM2-135M-Instruct, 8 prompts x 8 samples per
step) with the same engines and trainer: two ``miles serve`` servers behind the real sglang-router and one FSDP2
trainer rank. Local mode starts the servers as child processes and trains in the driver; Ray mode
(``--execution.mode ray``) starts a local Ray cluster, places the trainer rank in an actor and each server in an
actor of its own, and pushes the weights from the trainer actor to the servers; Ray colocated
(``--execution.ray.colocate true``) puts each server's actor in the trainer's bundle and has the servers free their
weights while the trainer trains. What differs is only where the processes live, how they are called and who holds
memory when. The rate is measured as in ``bench_async_task.py`` (steps 2 .. N-1; startup, evals and the last row
not timed), and so is the peak memory (in use on the machine during the run, above what was in use before it);
with ``--repeats`` > 1 the modes alternate and the medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_async_task import run_job, summarize  # the same runner, rate and reward curve

ENGINES = [
    "--engine.type", "sglang", "--engine.server", "miles", "--engine.num-servers", "2",
    "--engine.router", "true", "--engine.router-policy", "round_robin",
]  # fmt: skip
MODES = {
    "local": [],
    "ray": ["--execution.mode", "ray"],
    "ray colocated": ["--execution.mode", "ray", "--execution.ray.colocate", "true"],
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (at least 3)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a new temp directory)")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first and last steps are not timed)")
    out = args.out or Path(tempfile.mkdtemp(prefix="miles-bench-ray-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"runs in {out}", flush=True)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode, extra in MODES.items():
            start = time.perf_counter()
            job = [*ENGINES, *extra, "--loop.num-steps", str(args.steps)]
            result = run_job(f"{mode.replace(' ', '_')}-{repeat}", job, out)
            if result["returncode"] != 0:
                sys.exit(f"{mode} failed with exit {result['returncode']}: see {out}/{mode}-{repeat}.out")
            summary = summarize(result, args.steps, 64) | {"peak_mib": result["peak_mib"]}
            results[mode].append(summary)
            rate, reward, peak = summary["samples_per_s"], summary["reward"], summary["peak_mib"]
            print(f"{mode} #{repeat} ({time.perf_counter() - start:.0f} s): {rate:.3f} samples/s, reward {reward}, "
                  f"peak memory +{peak:.0f} MiB")  # fmt: skip

    rate = {mode: statistics.median(r["samples_per_s"] for r in runs) for mode, runs in results.items()}
    header = f"trained samples/s (median of {args.repeats})"
    print(f"\n| execution | {header} | vs local | s/step | peak memory in use, MiB | eval/reward after |")
    print("|---|---|---|---|---|---|")
    for mode, runs in results.items():
        seconds = statistics.median(r["seconds_per_step"] for r in runs)
        peak = statistics.median(r["peak_mib"] for r in runs)
        evals = ", ".join(f"{r['eval_after']:.3f}" for r in runs)
        ratio = rate[mode] / rate["local"]
        print(f"| {mode} | {rate[mode]:.3f} | {ratio:.2f}x | {seconds:.1f} | {peak:.0f} | {evals} |")


if __name__ == "__main__":
    main()
