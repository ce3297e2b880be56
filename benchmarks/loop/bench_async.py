"""Trained samples/s of the sync, one-step-off and fully async loops on one workload, as ratios to sync, in one run.

    uv run python benchmarks/loop/bench_async.py [--steps 5] [--threads 2]

Workload: GRPO on SmolLM2-135M-Instruct fp32 (embedded engine + FSDP2 in this process, weights pushed in-process
by miles-sync), 4 GSM8K-style prompts x 4 samples per step, temperature 1, up to 48 new tokens. Each loop runs
``--steps`` steps; the first is a warm-up, the rate is over the rest (wall time between the first and last step's
metrics). Engine and trainer share the same cores: on a 2-core CPU overlap gains little, since generation and
training compete for the cores; on GPUs they run on separate devices. Prints a markdown table for
docs/performance.md.
"""

from __future__ import annotations

import argparse
import time

import torch

PROMPTS = [f"What is {a} + {b}? Answer with the number." for a, b in zip(range(11, 200), range(40, 300))]


class Prompts:
    def __init__(self) -> None:
        self.count = 0

    def next_prompts(self, num):
        from miles.core.sample import Sample

        out = [
            Sample(index=i, group_index=self.count + i, prompt=[{"role": "user", "content": PROMPTS[self.count + i]}])
            for i in range(num)
        ]
        self.count += num
        return out

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def _reward(sample) -> float:
    return float(len(sample.response_tokens) % 2)  # any reward with variance: the loop's cost, not learning


class TimingSink:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.rows: list[dict] = []

    def log(self, metrics, step):
        self.times.append(time.perf_counter())
        self.rows.append(metrics)

    def close(self):
        pass


def run_loop(model_dir, mode: str, staleness: int | None, steps: int) -> dict:
    from miles.core.config import AlgorithmConfig, EvalConfig, LoopConfig, RolloutConfig, SamplingConfig
    from miles.core.loop import Components, train
    from miles.core.publisher import EnginePublisher
    from miles.rollout.engines import EmbeddedEngine
    from miles.rollout.generate import ChatRollout
    from miles.sync import InProcessTransport, WeightSender
    from miles.train import FSDP2Backend, TrainConfig
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    engine = EmbeddedEngine(model_dir, dtype="fp32")
    backend = FSDP2Backend(
        model_dir,
        train=TrainConfig(lr=1e-6, micro_batch_size=8),
        temperature=1.0,
        weight_sink=WeightSender(InProcessTransport(engine.receiver)),
    )
    loop = LoopConfig(mode=mode, max_weight_staleness=staleness, num_steps=steps, save_interval=0)
    chat = ChatRollout(engine, AutoTokenizer.from_pretrained(model_dir), max_resubmits=2)
    sink = TimingSink()
    components = Components(
        data_source=Prompts(),
        generate_group=chat,
        reward_fn=_reward,
        backend=backend,
        publisher=EnginePublisher(backend, [engine], pause_mode=loop.pause_mode or "keep"),
        sink=sink,
    )
    rollout = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=4, sampling=SamplingConfig(max_new_tokens=48))
    train(components, loop=loop, rollout=rollout, algorithm=AlgorithmConfig(), evaluation=EvalConfig(num_prompts=0))
    seconds = sink.times[-1] - sink.times[0]
    samples = 16 * (steps - 1)
    rows = sink.rows[1:]
    return {
        "samples_per_s": samples / seconds,
        "staleness_mean": sum(r["staleness/mean"] for r in rows) / len(rows),
        "idle": sum(r.get("engine/idle_fraction", float("nan")) for r in rows) / len(rows),
        "train_s": sum(r["time/train"] for r in rows) / len(rows),
        "wait_s": sum(r["time/rollout"] for r in rows) / len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from miles.recipes.models.smollm2 import ensure_smollm2

    model_dir = ensure_smollm2()
    loops = [("sync", None), ("one_step_off", None), ("fully_async", 1), ("fully_async", 2)]
    results = {}
    for mode, staleness in loops:
        name = mode if staleness is None else f"{mode} (staleness {staleness})"
        results[name] = run_loop(model_dir, mode, staleness, args.steps)
        print(name, results[name], flush=True)
    base = results["sync"]["samples_per_s"]
    print("\n| loop | trained samples/s | vs sync | staleness/mean | rollout wait s/step | train s/step |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['samples_per_s']:.2f} | {r['samples_per_s'] / base:.2f}x | {r['staleness_mean']:.2f} "
            f"| {r['wait_s']:.1f} | {r['train_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
