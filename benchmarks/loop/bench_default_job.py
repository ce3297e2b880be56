"""The README's default job, side by side with a baseline commit: wall time, peak memory and held-out eval gain.

    uv run --no-sync python benchmarks/loop/bench_default_job.py [--baseline ac39a06] [--repeats 1] [-- ARGS...]

The issue's target (#12): the default job (same steps, samples and evals) at <= 0.5x the wall time of the commit
before the performance work, with the same held-out eval gain. The baseline defaults to ac39a06, the last commit
before it (HF ``generate`` engine with prefill log-prob rescoring, padded trainer, FSDP2-wrapped at world size 1).

The baseline is checked out in a detached git worktree under ``--out`` with its own environment (``uv sync
--locked``, not timed); the current tree runs from this checkout's environment. Each run is ``miles train
--run.progress false`` (plus ``ARGS`` after ``--``, on both sides) in a fresh run directory, the two sides
alternating (baseline first), each timed from process start to exit (model load, evals and the final checkpoint
included; the model must already be cached: run the default job once). Peak memory is the run's maximum resident
set size (``wait4``: the process and the children it waited for). From ``metrics.jsonl``: the step-0 and last eval
rewards and the sums of ``time/rollout`` / ``time/train`` / ``time/eval``. ``--json PATH`` writes every run and the
targets.

Targets: wall time ratio (current / baseline, medians) <= 0.5; held-out eval gain (last eval minus step-0 eval) at
least 0.9x the baseline's (one seed's gain varies by several hundredths, so one run per side shows the gain is not
lost, not that it is equal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WALL_TARGET = 0.5  # current wall time / baseline wall time
GAIN_TARGET = 0.9  # current eval gain / baseline eval gain, at least
DIFF = "train_rollout_logprob_abs_diff"


def run_job(miles: Path, cwd: Path, run_dir: Path, name: str, extra: list[str]) -> dict:
    """One ``miles train`` run; returns wall seconds, peak RSS (MiB) and the summed phase times and eval rewards."""
    command = [str(miles), "train", "--run.progress", "false", "--run.dir", str(run_dir), "--run.name", name, *extra]
    log = run_dir / f"{name}.out"
    run_dir.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{name}: miles train exited {process.returncode}; see {log}")
    rows = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]

    def total(key: str) -> float:
        return sum(r[key] for r in rows if key in r)

    return {
        "name": name,
        "wall_s": wall,
        "peak_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "rollout_s": total("time/rollout"),
        "train_s": total("time/train"),
        "eval_s": total("time/eval"),
        "steps": sum(1 for r in rows if "time/step" in r),
        "eval_before": evals[0] if evals else None,
        "eval_after": evals[-1] if len(evals) > 1 else None,
        "logprob_abs_diff": [r[DIFF] for r in rows if DIFF in r],
    }


def prepare_baseline(ref: str, out: Path) -> Path:
    """A detached worktree of ``ref`` under ``out`` with its own locked environment; returns its ``miles`` script."""
    tree = out / f"baseline-{ref}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    subprocess.run(["uv", "sync", "--locked", "-q"], cwd=tree, env=env, check=True)
    return tree / ".venv" / "bin" / "miles"


def targets(base: list[dict], head: list[dict]) -> list[dict]:
    """The issue's two targets from the runs of each side (medians over repeats)."""
    wall = statistics.median(r["wall_s"] for r in head) / statistics.median(r["wall_s"] for r in base)
    result = [{"name": "default job wall time vs baseline", "value": wall, "target": f"<= {WALL_TARGET}",
               "met": wall <= WALL_TARGET}]  # fmt: skip
    gains = [[r["eval_after"] - r["eval_before"] for r in runs if r["eval_after"] is not None] for runs in (base, head)]
    if all(gains) and statistics.median(gains[0]) > 0:
        ratio = statistics.median(gains[1]) / statistics.median(gains[0])
        result.append({"name": "held-out eval gain vs baseline", "value": ratio, "target": f">= {GAIN_TARGET}",
                       "met": ratio >= GAIN_TARGET})  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="ac39a06", help="git ref of the baseline (default: before #12's work)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side, alternating")
    parser.add_argument("--out", type=Path, default=None, help="runs and the baseline worktree (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run and the targets here")
    parser.add_argument("--keep-worktree", action="store_true", help="keep the baseline's worktree for a rerun")
    parser.add_argument("extra", nargs="*", help="more `miles train` arguments after --, the same on both sides")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="miles-bench-default-job-"))
    out.mkdir(parents=True, exist_ok=True)
    head_miles = Path(sys.executable).parent / "miles"
    if not head_miles.exists():
        sys.exit(f"no miles script next to {sys.executable}: run this with the workspace's python (uv run)")
    base_miles = prepare_baseline(args.baseline, out)
    try:
        run_both(args, out, base_miles, head_miles)
    finally:
        if not args.keep_worktree:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_miles.parents[2])])


def run_both(args: argparse.Namespace, out: Path, base_miles: Path, head_miles: Path) -> None:
    head_ref = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    print(f"runs in {out}; baseline {args.baseline} vs {head_ref} (working tree), load {os.getloadavg()[0]:.2f}")
    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    for i in range(args.repeats):
        for side, miles, cwd in (("baseline", base_miles, base_miles.parents[2]), ("current", head_miles, ROOT)):
            row = run_job(miles, cwd, out / "runs", f"{side}{i}", args.extra)
            runs[side].append(row)
            print(f"{side} run {i}: wall {row['wall_s']:.0f} s, peak {row['peak_rss_mib']:.0f} MiB, eval "
                  f"{row['eval_before']} -> {row['eval_after']}", flush=True)  # fmt: skip

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    print(f"\n| | {args.baseline} | {head_ref} | ratio |\n|---|---|---|---|")
    for key, label in (("wall_s", "whole job, wall s"), ("peak_rss_mib", "peak RSS MiB"),
                       ("rollout_s", "rollout s"), ("train_s", "train s"), ("eval_s", "evals s")):  # fmt: skip
        base, head = med("baseline", key), med("current", key)
        ratio = f"{head / base:.2f}x" if base else ""
        print(f"| {label} | {base:.1f} | {head:.1f} | {ratio} |")
    for side in runs:
        for r in runs[side]:
            print(f"{r['name']}: eval {r['eval_before']} -> {r['eval_after']}")
    result = targets(runs["baseline"], runs["current"])
    print("\n| target | measured | met |\n|---|---|---|")
    for t in result:
        print(f"| {t['name']} {t['target']}x | {t['value']:.2f}x | {'met' if t['met'] else 'not met'} |")
    if args.json:
        summary = {"baseline": args.baseline, "current": head_ref, "runs": runs, "targets": result}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
