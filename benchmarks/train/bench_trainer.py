"""Trainer step vs a plain HF forward + backward + AdamW on the same batch: tokens/s and peak memory, in one run.

    uv run --no-sync python benchmarks/train/bench_trainer.py [--rounds 3] [--sequences 32] [--threads 2]

One optimizer step of SmolLM2-135M-Instruct (fp32, from ``~/.cache/miles/models``) on ``--sequences`` sequences
(seed 0; prompts of 30-60 and responses of 10-60 random tokens, every response token trained, advantages +-1), in
right-padded micro-batches of ``--micro-batch-size`` rows, for each variant:

- ``hf`` (the baseline): ``model(input_ids, attention_mask).logits`` of each micro-batch, fp32 ``log_softmax`` and
  a gather of the response tokens, the on-policy policy-gradient loss (token mean over the whole batch),
  ``backward``; then ``clip_grad_norm_`` and ``AdamW.step``;
- ``miles``: ``FSDP2Backend`` (world size 1: the model unwrapped, see ``parallelize``) ``forward_backward`` +
  ``optimizer_step`` with the default GRPO objective on the same batch;
- ``miles-fsdp2``: the same with ``fully_shard`` applied anyway (what world size 1 ran before);
- ``hf-packed``: ``hf`` on the packed batch: each micro-batch's rows concatenated into one row without padding,
  ``position_ids`` restarting per sequence (transformers then masks attention within each sequence), the same loss;
  the baseline of ``miles-packed``;
- ``miles-packed``: ``miles`` with ``train.batch_layout packed`` (the same packed rows, varlen attention).
  ``--variants hf-packed miles-packed`` is the issue's comparison ("the same packed batch"); not the default.

Every (variant, round) is a fresh subprocess with the same thread count: load, a warm-up step, then one timed step;
peak memory is the RSS high-water mark over the timed step (reset at its start through ``/proc/self/clear_refs``).
Variants alternate, their order rotating each round; medians over rounds. The first step's gradient norm is
printed for each variant: equal norms mean the same gradient was computed. Prints a markdown table with the
ratios to the first variant (``hf``) and the targets (Miles tokens/s >= 0.95x the plain loop on the same layout, peak
memory <= 1.0x); ``--json PATH`` also writes the medians and the targets' ratios there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = Path.home() / ".cache" / "miles" / "models" / "SmolLM2-135M-Instruct"
VARIANTS = ("hf", "miles", "miles-fsdp2", "miles-packed", "hf-packed")
BASELINE = {"miles": "hf", "miles-fsdp2": "hf", "miles-packed": "hf-packed"}  # the plain loop of the same layout


def make_samples(num: int, vocab: int):
    import torch
    from miles.core.sample import Sample

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(num):
        prompt_len = int(torch.randint(30, 61, (1,), generator=gen))
        response_len = int(torch.randint(10, 61, (1,), generator=gen))
        tokens = torch.randint(10, vocab, (prompt_len + response_len,), generator=gen).tolist()
        samples.append(Sample(index=i, group_index=i // 4, prompt="", tokens=tokens, response_length=response_len))
    advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(num)])
    return samples, advantages


def _rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def hf_step(model, optimizer, batch, micro_batch_size: int) -> float:
    import torch

    num_tokens = batch.loss_mask.sum()
    for start in range(0, batch.batch_size, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        tokens, mask, loss_mask = batch.tokens[rows], batch.attention_mask[rows], batch.loss_mask[rows]
        prompt_lengths, adv = batch.prompt_lengths[rows], batch.advantages[rows]
        width = int(mask.sum(1).max())
        logits = model(input_ids=tokens[:, :width], attention_mask=mask[:, :width]).logits
        log_probs = torch.log_softmax(logits.float(), -1)
        loss = torch.zeros(())
        for b in range(tokens.shape[0]):  # response positions of row b
            p, n = int(prompt_lengths[b]), int(loss_mask[b].sum())
            lp = log_probs[b, p - 1 : p + n - 1].gather(-1, tokens[b, p : p + n, None])[:, 0]
            loss = loss - (adv[b, :n] * torch.exp(lp - lp.detach())).sum()  # on-policy PPO ratio = 1
        (loss / num_tokens).backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def hf_packed_step(model, optimizer, batch, micro_batch_size: int) -> float:
    """``hf_step`` on packed rows: each micro-batch one row of its sequences' tokens, positions restarting."""
    import torch

    num_tokens = batch.loss_mask.sum()
    for start in range(0, batch.batch_size, micro_batch_size):
        rows = range(start, min(start + micro_batch_size, batch.batch_size))
        lengths = [int(batch.attention_mask[b].sum()) for b in rows]
        tokens = torch.cat([batch.tokens[b, :n] for b, n in zip(rows, lengths)])[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        logits = model(input_ids=tokens, position_ids=positions).logits
        log_probs = torch.log_softmax(logits.float(), -1)[0]
        loss, offset = torch.zeros(()), 0
        for b, length in zip(rows, lengths):
            p, n = int(batch.prompt_lengths[b]), int(batch.loss_mask[b].sum())
            lp = log_probs[offset + p - 1 : offset + p + n - 1].gather(-1, tokens[0, offset + p : offset + p + n, None])
            loss = loss - (batch.advantages[b, :n] * torch.exp(lp[:, 0] - lp[:, 0].detach())).sum()
            offset += length
        (loss / num_tokens).backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def child(variant: str, args: argparse.Namespace) -> dict:
    import torch
    from miles.core.batch import build_train_batch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if variant in ("hf", "hf-packed"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        model.config.use_cache = False
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
        vocab = model.config.vocab_size

        plain_step = hf_packed_step if variant == "hf-packed" else hf_step

        def step(batch):
            return plain_step(model, optimizer, batch, args.micro_batch_size)
    else:
        import miles.train.fsdp2.parallelize as parallelize_module
        from miles.core.algorithms.objective import LossCounts, PolicyObjective
        from miles.core.config import AlgorithmConfig
        from miles.train import FSDP2Backend, TrainConfig

        if variant == "miles-fsdp2":

            def shard_anyway(model, *, mesh, param_dtype):
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
                for layer in model.model.layers:
                    fully_shard(layer, mesh=mesh, mp_policy=policy)
                return fully_shard(model, mesh=mesh, mp_policy=policy)

            parallelize_module.parallelize = shard_anyway
        layout = "packed" if variant == "miles-packed" else "padded"
        train = TrainConfig(micro_batch_size=args.micro_batch_size, batch_layout=layout)
        backend = FSDP2Backend(MODEL, train=train, temperature=1.0)
        objective = PolicyObjective(AlgorithmConfig(), max_new_tokens=64)
        vocab = backend.model.config.vocab_size

        def step(batch):
            backend.forward_backward(batch, objective, LossCounts.of(batch))
            return backend.optimizer_step()["grad_norm"]

    samples, advantages = make_samples(args.sequences, vocab)
    batch = build_train_batch(samples, advantages, pad_token_id=0)
    warmup_norm = step(batch)
    _rss_reset()
    rss0 = _rss_mib("VmRSS")
    t0 = time.perf_counter()
    step(batch)
    seconds = time.perf_counter() - t0
    peak = _rss_mib("VmHWM")
    return {
        "variant": variant,
        "seconds": seconds,
        "tokens": int(batch.attention_mask.sum()),
        "peak_mib": peak,
        "step_mib": peak - rss0,
        "first_grad_norm": warmup_norm,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS[:3]), choices=VARIANTS)
    parser.add_argument("--json", type=Path, default=None, help="also write the medians and target ratios here")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        print(json.dumps(child(args._child, args)))
        return
    if not (MODEL / "config.json").is_file():
        sys.exit(f"no model at {MODEL}: run the default job once (it caches SmolLM2-135M-Instruct there)")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
        for variant in order:
            cmd = [sys.executable, __file__, "--_child", variant, "--sequences", str(args.sequences)]
            cmd += ["--micro-batch-size", str(args.micro_batch_size), "--threads", str(args.threads)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results[variant].append(result)
            print(f"round {r + 1} {variant}: {result}", file=sys.stderr)

    def median(variant: str, key: str) -> float:
        return statistics.median(x[key] for x in results[variant])

    base = "hf" if "hf" in results else args.variants[0]
    tokens = results[base][0]["tokens"]
    print(f"\n{args.sequences} sequences, {tokens} tokens, micro-batches of {args.micro_batch_size}, "
          f"{args.threads} threads, medians of {args.rounds} rounds\n")  # fmt: skip
    print(f"| variant | step s | tokens/s | vs {base} | peak RSS MiB | vs {base} | step + MiB | vs {base} "
          "| first grad norm |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for v in args.variants:
        s, peak, extra = median(v, "seconds"), median(v, "peak_mib"), median(v, "step_mib")
        print(
            f"| {v} | {s:.2f} | {tokens / s:.0f} | {median(base, 'seconds') / s:.2f}x | {peak:.0f} | "
            f"{peak / median(base, 'peak_mib'):.2f}x | {extra:.0f} | {extra / max(median(base, 'step_mib'), 1):.2f}x | "
            f"{results[v][0]['first_grad_norm']:.6f} |"
        )
    targets = []
    for v in args.variants:
        plain = BASELINE.get(v)
        if plain in results:
            speed = median(plain, "seconds") / median(v, "seconds")
            memory = median(v, "peak_mib") / median(plain, "peak_mib")
            targets.append({"name": f"{v} tokens/s vs {plain}", "value": speed, "target": ">= 0.95"})
            targets.append({"name": f"{v} peak memory vs {plain}", "value": memory, "target": "<= 1.0"})
    if targets:
        print("\n| target | measured | met |\n|---|---|---|")
        for t in targets:
            bound = float(t["target"].split()[1])
            t["met"] = t["value"] >= bound if t["target"].startswith(">=") else t["value"] <= bound
            print(f"| {t['name']} {t['target']}x | {t['value']:.2f}x | {'met' if t['met'] else 'not met'} |")
    if args.json:
        medians = {v: {k: median(v, k) for k in ("seconds", "peak_mib", "step_mib")} for v in args.variants}
        summary = {"tokens": tokens, "medians": medians, "targets": targets, "runs": results}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
