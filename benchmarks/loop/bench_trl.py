"""Miles vs TRL's GRPOTrainer on the same GRPO job: step time and generated tokens/s, in one run.

    uv sync --locked --inexact --group bench   # once: installs trl (nothing else changes)
    uv run --no-sync python benchmarks/loop/bench_trl.py [--repeats 1] [--steps 3] [--threads 2]

Both sides run the default recipe's task (``smollm2_grpo_arithmetic``: SmolLM2-135M-Instruct fp32, reasoning-gym
1-digit sums, binary reward) shrunk to ``--prompts`` x ``--samples`` per step, ``--max-new-tokens`` per completion
and ``--steps`` steps, each in its own child process with the same thread count; Miles and TRL alternate
(Miles, TRL, Miles, TRL, ...) ``--repeats`` times so that load from other processes hits both alike.

- Miles: ``python -m miles.recipes.cli train`` with overrides (eval off, no periodic checkpoints); its step times
  and response lengths come from the run's ``metrics.jsonl`` (``time/step`` = rollout + reward + train + weight
  push; the final checkpoint Miles always writes after the last step is outside every step time).
- TRL: ``GRPOTrainer`` (HF ``generate``, no vLLM) in this file's ``--_trl-child`` mode, configured from the same
  resolved Miles config (see ``trl_config``): the same prompts in the same order (Miles' own data source, written
  to a dataset TRL reads without shuffling), Miles' reward function wrapped as a TRL reward function, same group
  size, completion length, temperature, learning rate, AdamW betas/eps, weight decay, grad clip, clip range, KL
  off, token-mean loss, one optimizer step per rollout in one micro-batch. A step is the time from the Trainer's
  ``on_step_begin`` to ``on_step_end`` (generation + reward + forward/backward + optimizer step).

The first step of each run is a warm-up, reported separately; the rest are averaged. Tokens/s = generated
(response) tokens of a step / the step's time. Prints a markdown table for docs/performance.md with the ratio
Miles/TRL and whether the target (Miles step time <= 0.5x TRL's) is met.
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

RECIPE = "smollm2_grpo_arithmetic"
TARGET = 0.5  # Miles step time / TRL step time


def miles_overrides(args: argparse.Namespace) -> list[str]:
    """The ``miles train`` overrides of the benchmark job (TRL is configured from the config they resolve to)."""
    return [
        "--loop.num-steps", str(args.steps),
        "--rollout.rollout-batch-size", str(args.prompts),
        "--rollout.n-samples-per-prompt", str(args.samples),
        "--rollout.sampling.max-new-tokens", str(args.max_new_tokens),
        "--train.micro-batch-size", str(args.prompts * args.samples),
        "--eval.num-prompts", "0",
        "--loop.save-interval", "0",
        "--run.num-threads", str(args.threads),
        "--run.progress", "false",
        "--run.tensorboard", "false",
    ]  # fmt: skip


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
    )
    return env


def run_miles(args: argparse.Namespace, workdir: Path, name: str) -> dict:
    cmd = [sys.executable, "-m", "miles.recipes.cli", "train", "--recipe", RECIPE, *miles_overrides(args)]
    cmd += ["--run.dir", str(workdir), "--run.name", name]
    t0 = time.perf_counter()
    with open(workdir / f"{name}.log", "w") as log:
        subprocess.run(cmd, env=child_env(args.threads), stdout=log, stderr=subprocess.STDOUT, check=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    n = args.prompts * args.samples
    return {
        "step_s": [r["time/step"] for r in rows],
        "tokens": [r["response_length/mean"] * n for r in rows],
        "reward": [r["reward/mean"] for r in rows],
        "parts": {k: [r[f"time/{k}"] for r in rows] for k in ("rollout", "train", "sync")},
        "wall_s": wall,
    }


def run_trl(args: argparse.Namespace, workdir: Path, name: str) -> dict:
    out = workdir / f"{name}.json"
    cmd = [args.trl_python, os.path.abspath(__file__), "--_trl-child", str(out), "--workdir", str(workdir / name)]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in ARGS]
    t0 = time.perf_counter()
    with open(workdir / f"{name}.log", "w") as log:
        subprocess.run(cmd, env=child_env(args.threads), stdout=log, stderr=subprocess.STDOUT, check=True)
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


ARGS = ("steps", "prompts", "samples", "max_new_tokens", "threads")


def trl_config(cfg, args: argparse.Namespace, output_dir: str):
    """GRPOConfig matching the resolved Miles config ``cfg`` setting by setting; refuses what it cannot match."""
    from trl import GRPOConfig

    rollout, algo, train = cfg.rollout, cfg.algorithm, cfg.train
    sampling = rollout.sampling
    assert algo.kl is None, "the benchmark matches Miles' default: no KL term (TRL beta 0, no reference model)"
    assert algo.advantage.estimator == "grpo" and algo.loss.policy_loss == "ppo"
    assert algo.loss.aggregation == "token_mean" and algo.loss.entropy_coef == 0.0
    assert rollout.global_batch_size in (0, rollout.rollout_batch_size * rollout.n_samples_per_prompt)
    assert train.warmup_steps == 0 and train.dtype == "fp32"
    assert not algo.overlong.filter and algo.dynamic_sampling is None
    batch = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    return GRPOConfig(
        output_dir=output_dir,
        max_steps=cfg.loop.num_steps,
        # one rollout of rollout_batch_size x n_samples per step, one optimizer step on it, one micro-batch
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=rollout.n_samples_per_prompt,
        shuffle_dataset=False,  # the dataset is already Miles' prompt order
        max_completion_length=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=None,
        repetition_penalty=1.0,
        use_vllm=False,
        # loss: PPO clip, token mean over the batch (dapo = active tokens of the global batch), group-std advantages
        loss_type="dapo",
        epsilon=algo.loss.clip_low,
        epsilon_high=algo.loss.clip_high,
        scale_rewards="group",
        beta=0.0,
        mask_truncated_completions=False,
        # optimizer: AdamW, constant LR, no warm-up
        learning_rate=train.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_epsilon=train.adam_eps,
        max_grad_norm=train.grad_clip,
        optim="adamw_torch",
        # fp32 on CPU, no activation checkpointing (TRL's defaults are bf16 and gradient checkpointing)
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=rollout.seed,
        # no eval, no checkpoints, no reporting
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def trl_child(args: argparse.Namespace) -> None:
    """One TRL run (in its own process): writes per-step times, generated tokens and rewards to ``args._trl_child``."""
    import torch
    from datasets import Dataset
    from miles.core.sample import Sample
    from miles.recipes.cli import resolve_config
    from miles.recipes.run import build_data_sources
    from miles.rollout.rewards import reasoning_gym_reward
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    torch.set_num_threads(args.threads)
    cfg = resolve_config(RECIPE, miles_overrides(args))
    from miles.recipes.registry import resolve_model_path

    model_dir = resolve_model_path(cfg.models.policy.path)
    # Miles' own training data source, drawn exactly as its loop draws it: rollout_batch_size prompts per step.
    source, _ = build_data_sources(cfg.data, num_eval_prompts=0)
    rows = []
    for _ in range(cfg.loop.num_steps):
        for s in source.next_prompts(cfg.rollout.rollout_batch_size):
            rows.append({"prompt": s.prompt, "entry": json.dumps(s.label)})
    dataset = Dataset.from_list(rows)

    tokens: list[int] = []
    rewards: list[float] = []

    def miles_reward(prompts, completions, entry, completion_ids, **kwargs):
        """Miles' reasoning-gym reward on each completion (decoded like Miles': special tokens skipped)."""
        scores = [
            reasoning_gym_reward(Sample(i, i, prompt=p, label=json.loads(e), response_text=c[0]["content"]))
            for i, (p, c, e) in enumerate(zip(prompts, completions, entry))
        ]
        tokens.append(sum(len(ids) for ids in completion_ids))
        rewards.append(sum(scores) / len(scores))
        return scores

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.step_s: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self.t0)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=miles_reward,
        args=trl_config(cfg, args, args.workdir),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    generate_s: list[float] = []
    generate = trainer._generate_single_turn

    def timed_generate(*a, **k):  # the generation part of each step (HF generate + padding/decoding)
        t = time.perf_counter()
        out = generate(*a, **k)
        generate_s.append(time.perf_counter() - t)
        return out

    trainer._generate_single_turn = timed_generate
    trainer.train()
    parts = {"generate": generate_s, "rest": [s - g for s, g in zip(timer.step_s, generate_s)]}
    result = {"step_s": timer.step_s, "tokens": tokens, "reward": rewards, "parts": parts}
    Path(args._trl_child).write_text(json.dumps(result))


def summarize(side: str, runs: list[dict]) -> dict:
    warm = [r["step_s"][0] for r in runs]
    steps = [s for r in runs for s in r["step_s"][1:]]
    tokens = [t for r in runs for t in r["tokens"][1:]]
    parts = {k: statistics.fmean(v for r in runs for v in r["parts"][k][1:]) for k in runs[0]["parts"]}
    return {
        "side": side,
        "warmup_s": statistics.fmean(warm),
        "step_s": statistics.fmean(steps),
        "step_median_s": statistics.median(steps),
        "step_min_s": min(steps),
        "step_max_s": max(steps),
        "tokens_per_s": sum(tokens) / sum(steps),
        "tokens_per_step": statistics.fmean(tokens),
        "parts": parts,
        "wall_s": statistics.fmean(r["wall_s"] for r in runs),
        "reward": statistics.fmean(x for r in runs for x in r["reward"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="Miles/TRL pairs, alternating")
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is a warm-up")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="group size (TRL num_generations)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trl-python", default=sys.executable, help="python of an environment with trl")
    parser.add_argument("--out", default="", help="keep the runs' logs and metrics here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write both sides' summaries and the ratios here")
    parser.add_argument("--_trl-child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up)")
    if args._trl_child:
        trl_child(args)
        return

    workdir = Path(args.out or tempfile.mkdtemp(prefix="bench_trl_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"runs in {workdir}; loadavg before: {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    results: dict[str, list[dict]] = {"Miles": [], "TRL": []}
    for i in range(args.repeats):
        for side, fn in (("Miles", run_miles), ("TRL", run_trl)):
            r = fn(args, workdir, f"{side.lower()}{i}")
            results[side].append(r)
            print(f"{side} run {i}: step_s {[round(s, 2) for s in r['step_s']]}, wall {r['wall_s']:.1f}s", flush=True)
    print(f"loadavg after: {Path('/proc/loadavg').read_text().split()[:3]}")
    miles, trl = summarize("Miles", results["Miles"]), summarize("TRL", results["TRL"])
    n = args.repeats * (args.steps - 1)
    print(
        f"\n{args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new tokens, {args.steps} steps "
        f"(first = warm-up), {args.threads} threads, {args.repeats} run(s) per side; means over {n} steps per side\n"
    )
    print("| | warm-up step (s) | step (s), mean / median [min-max] | generated tokens/step | tokens/s "
          "| step parts, mean (s) | process wall (s) | reward mean |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for s in (miles, trl):
        parts = ", ".join(f"{k} {v:.1f}" for k, v in s["parts"].items())
        print(
            f"| {s['side']} | {s['warmup_s']:.1f} | {s['step_s']:.1f} / {s['step_median_s']:.1f} "
            f"[{s['step_min_s']:.1f}-{s['step_max_s']:.1f}] | {s['tokens_per_step']:.0f} | {s['tokens_per_s']:.1f} "
            f"| {parts} | {s['wall_s']:.0f} | {s['reward']:.2f} |"
        )
    # The two sides sample different completions, so their lengths (the work of a step) drift apart after the
    # first update; the per-token ratio (TRL tokens/s / Miles tokens/s) is the step-time ratio at equal work.
    ratios = {
        "mean step time": miles["step_s"] / trl["step_s"],
        "median step time": miles["step_median_s"] / trl["step_median_s"],
        "time per generated token": trl["tokens_per_s"] / miles["tokens_per_s"],
    }
    print()
    targets = []
    for name, ratio in ratios.items():
        print(f"Miles/TRL {name}: {ratio:.2f}x; target <= {TARGET}x: {'met' if ratio <= TARGET else 'NOT met'}")
        targets.append({"name": f"Miles/TRL {name}", "value": ratio, "target": f"<= {TARGET}", "met": ratio <= TARGET})
    if args.json:
        summary = {"miles": miles, "trl": trl, "targets": targets, "runs": results}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
