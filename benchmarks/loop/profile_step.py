"""Profile one step of the default job with ``torch.profiler``: the top costs of rollout, reward, train and sync.

    uv run --no-sync python benchmarks/loop/profile_step.py [--steps 2] [--out /tmp/profile_step] [--top 15]

Runs ``miles train --recipe smollm2_grpo_arithmetic`` in this process with eval and periodic checkpoints off and a
train hook (this file's ``build_hooks``) that starts the profiler when step ``--steps - 1`` ends (the earlier
steps are warm-up) and stops it when the last step ends, so exactly one step is recorded: the rollout (the
embedded engine's worker thread: ``profile_all_threads``), the reward, the trainer's forward/backward and
AdamW, and the weight push. Prints, and writes to ``--out``/profile.md:

- the step's phases from ``metrics.jsonl`` (``time/rollout``, ``time/train``, ``time/sync``, ``time/step``);
- the top operators by self CPU time (all threads), with their share of the summed self time;
- a Chrome trace (``--out``/trace.json, open in https://ui.perfetto.dev) for the whole step.

The share is of the summed self time of all recorded ops (threads overlap, so it can exceed the step's wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RECIPE = "smollm2_grpo_arithmetic"


class ProfileOneStep:
    """Train hooks: profile the step after ``warmup_steps`` (1-based step numbers, as the loop passes them)."""

    def __init__(self, out: Path, *, last_step: int, top: int) -> None:
        self.out, self.last_step, self.top = out, last_step, top
        self.profiler = None

    def on_train_step_end(self, step: int, metrics: dict[str, float]) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if step == self.last_step - 1:
            experimental = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            self.profiler = profile(activities=[ProfilerActivity.CPU], experimental_config=experimental)
            self.profiler.__enter__()
        elif step == self.last_step and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler.export_chrome_trace(str(self.out / "trace.json"))
            table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=self.top)
            (self.out / "ops.txt").write_text(table)
            events = sorted(self.profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            total = sum(e.self_cpu_time_total for e in events) or 1.0
            rows = [(e.key, e.count, e.self_cpu_time_total / 1e6, e.self_cpu_time_total / total) for e in events]
            (self.out / "ops.json").write_text(json.dumps(rows[: self.top * 4]))
            threads: dict[int, list] = {}  # thread id -> [self CPU us, calls, most expensive op names]
            for event in self.profiler.events():
                entry = threads.setdefault(event.thread, [0.0, 0, {}])
                entry[0] += event.self_cpu_time_total
                entry[1] += 1
                entry[2][event.name] = entry[2].get(event.name, 0.0) + event.self_cpu_time_total
            summary = [
                (tid, us / 1e6, calls, [n for n, _ in sorted(ops.items(), key=lambda x: -x[1])[:3]])
                for tid, (us, calls, ops) in sorted(threads.items(), key=lambda x: -x[1][0])
            ]
            (self.out / "threads.json").write_text(json.dumps(summary))
            self.profiler = None


def build_hooks(context):
    """(context: RunContext) -> TrainHooks, configured by the ``MILES_PROFILE_*`` variables this script sets."""
    return ProfileOneStep(
        Path(os.environ["MILES_PROFILE_OUT"]),
        last_step=int(os.environ["MILES_PROFILE_LAST_STEP"]),
        top=int(os.environ["MILES_PROFILE_TOP"]),
    )


def report(out: Path, run_dir: Path, steps: int, top: int) -> str:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == steps)
    ops = json.loads((out / "ops.json").read_text())
    lines = [
        f"Profiled step {steps} of `{RECIPE}` (steps before it are warm-up).",
        "",
        "| phase | s |",
        "|---|---|",
        *(f"| {k} | {step[k]:.2f} |" for k in ("time/rollout", "time/train", "time/sync", "time/step") if k in step),
        "",
        f"Rollout {step.get('throughput/rollout_tokens_per_s', float('nan')):.1f} response tokens/s, train "
        f"{step.get('throughput/train_tokens_per_s', float('nan')):.1f} tokens/s.",
        "",
        "| thread | self CPU s | ops | top ops |",
        "|---|---|---|---|",
        *(
            f"| {tid} | {secs:.2f} | {calls} | {', '.join(f'`{n}`' for n in names)} |"
            for tid, secs, calls, names in json.loads((out / "threads.json").read_text())[:4]
        ),
        "",
        "| op (all threads) | calls | self CPU s | share of summed self time |",
        "|---|---|---|---|",
        *(f"| `{name}` | {count} | {secs:.2f} | {share:.1%} |" for name, count, secs, share in ops[:top]),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="steps to run; the last one is profiled (>= 2)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/profile_step"))
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up)")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(
        MILES_PROFILE_OUT=str(args.out), MILES_PROFILE_LAST_STEP=str(args.steps), MILES_PROFILE_TOP=str(args.top)
    )
    sys.path.insert(0, str(Path(__file__).parent))  # so that run.hooks can import this file as profile_step
    from miles.recipes.cli import main as miles_main

    run_name = "profile"
    code = miles_main(
        ["train", "--recipe", RECIPE, "--loop.num-steps", str(args.steps), "--eval.num-prompts", "0"]
        + ["--loop.save-interval", "0", "--run.progress", "false", "--run.dir", str(args.out)]
        + ["--run.name", run_name, "--run.hooks", '["profile_step:build_hooks"]']
    )
    if code:
        sys.exit(code)
    text = report(args.out, args.out / run_name, args.steps, args.top)
    (args.out / "profile.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
