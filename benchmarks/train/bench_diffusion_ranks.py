"""Flow-GRPO on several ranks on CPU: the step time of ``miles train --recipe tiny_flow_grpo_compressibility`` with
``--run.world-size 2`` (FSDP2 over the transformer, 1 torch thread per rank) against one process, in one run.

    uv run --no-sync python benchmarks/train/bench_diffusion_ranks.py [--rounds 3] [--steps 6]

Variants (each a fresh ``miles train`` per round; variants alternate):

- ``one-process`` (the baseline): ``--run.world-size 1``, 1 torch thread;
- ``one-process-2-threads``: the same with 2 threads (what one process can take of 2 cores);
- ``two-ranks``: ``--run.world-size 2``, 1 thread each: each rank samples and trains half of every mini-batch.

The step time is the median of ``time/step`` over steps 2..N of ``metrics.jsonl`` (start-up and the first step's
warm-up left out; evaluation off). Prints the median over rounds per variant, its ratio to ``one-process``, and
the last step's ``reward/mean`` (equal up to fp32 summation order: the same steps were computed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"one-process": (1, 1), "one-process-2-threads": (1, 2), "two-ranks": (2, 1)}  # (ranks, threads per rank)
MAIN = "import sys; from miles.recipes.cli import main; sys.exit(main(sys.argv[1:]))"


def run(name: str, ranks: int, threads: int, steps: int, out: Path) -> tuple[float, float]:
    """One ``miles train``; returns (median step time in s over steps 2.., the last step's reward/mean)."""
    args = ["train", "--recipe", "tiny_flow_grpo_compressibility", "--run.dir", str(out), "--run.name", name,
            "--loop.num-steps", str(steps), "--eval.interval", "0", "--loop.save-interval", "0", "--run.progress",
            "false", "--run.world-size", str(ranks), "--run.num-threads", str(threads)]  # fmt: skip
    subprocess.run([sys.executable, "-c", MAIN, *args], check=True, capture_output=True)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r]
    return statistics.median(r["time/step"] for r in rows[1:]), rows[-1]["reward/mean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    opts = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    rewards: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(opts.rounds):
            for name, (ranks, threads) in VARIANTS.items():
                seconds, rewards[name] = run(f"{name}-{round_}", ranks, threads, opts.steps, Path(tmp))
                times[name].append(seconds)
    base = statistics.median(times["one-process"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:24s} {median:6.3f} s/step  {median / base:5.2f}x  last reward/mean {rewards[name]:.6f}")  # noqa: T201


if __name__ == "__main__":
    main()
