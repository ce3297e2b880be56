"""`miles train --dry-run`: the launch plan of a config, snapshot-tested (tests/recipes/dry_run/*.txt), built by the
same function the real launch uses for the servers' command lines. MILES_UPDATE_SNAPSHOTS=1 rewrites the snapshots
(review the diff)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from miles.recipes.cli import main, resolve_config
from miles.recipes.plan import launch_plan

SNAPSHOTS = Path(__file__).parent / "dry_run"
MODEL = ["--models.policy.path", "/models/policy"]
VLLM_PYTHON = ["--engine.python", "/opt/vllm/bin/python"]  # else the machine's vLLM venv path
CASES = {
    "qwen3_30b_a3b_grpo_gsm8k": ("qwen3_30b_a3b_grpo_gsm8k", MODEL),
    "kimi_k2_grpo_gsm8k": ("kimi_k2_grpo_gsm8k", MODEL),
    "kimi_k2_5_grpo_gsm8k": ("kimi_k2_5_grpo_gsm8k", MODEL),
    "glm_5_grpo_gsm8k": ("glm_5_grpo_gsm8k", MODEL),
    "glm_5_1_grpo_gsm8k": ("glm_5_1_grpo_gsm8k", MODEL),
    "deepseek_v4_flash_grpo_gsm8k": ("deepseek_v4_flash_grpo_gsm8k", MODEL),
    "qwen3_5_35b_a3b_grpo_gsm8k": ("qwen3_5_35b_a3b_grpo_gsm8k", MODEL),
    "qwen3_5_27b_grpo_gsm8k": ("qwen3_5_27b_grpo_gsm8k", MODEL),
    "qwen3_vl_2b_grpo_visual": ("qwen3_vl_2b_grpo_visual", MODEL),
    "default_embedded": ("smollm2_grpo_arithmetic", []),
    "vllm_two_servers_delta": (
        "smollm2_grpo_arithmetic",
        [*MODEL, *VLLM_PYTHON, "--engine.type", "vllm", "--engine.num-servers", "2", "--engine.port", "30000",
         "--engine.delta-weights", "true", "--engine.threads", "2"],
    ),
    "miles_serve_router_ray_async": (
        "smollm2_grpo_arithmetic",
        [*MODEL, "--engine.type", "sglang", "--engine.server", "miles", "--engine.router", "true",
         "--engine.num-servers", "2", "--execution.mode", "ray", "--train.world-size", "2",
         "--loop.mode", "fully_async", "--loop.max-weight-staleness", "2",
         "--execution.ray.engine-cpus-per-server", "1"],
    ),
    "vllm_lora_adapters_ray": (
        "smollm2_grpo_arithmetic",
        [*MODEL, *VLLM_PYTHON, "--engine.type", "vllm", "--execution.mode", "ray", "--train.lora.rank", "8",
         "--train.lora.sync", "adapter"],
    ),
    "embedded_int4_qat_fp16": (
        "smollm2_grpo_arithmetic",
        ["--engine.weight-codec", "int4", "--train.qat", "int4", "--train.dtype", "fp16"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_launch_plan_matches_its_snapshot(case):
    recipe, overrides = CASES[case]
    plan = launch_plan(resolve_config(recipe, overrides))
    path = SNAPSHOTS / f"{case}.txt"
    if os.environ.get("MILES_UPDATE_SNAPSHOTS") == "1":
        path.write_text(plan)
    assert plan == path.read_text(), f"{case}: the plan changed; MILES_UPDATE_SNAPSHOTS=1 rewrites {path}"


def test_the_snapshots_are_exactly_the_cases():
    assert sorted(p.stem for p in SNAPSHOTS.glob("*.txt")) == sorted(CASES)


def test_the_plan_holds_the_servers_real_command_lines():
    # The plan's vLLM line is vllm_command's argv for the same settings, flag for flag.
    from miles.rollout.engines.vllm import vllm_command

    cfg = resolve_config("smollm2_grpo_arithmetic", CASES["vllm_two_servers_delta"][1])
    argv = vllm_command("/models/policy", python="/opt/vllm/bin/python", port=30001, seed=cfg.rollout.seed)
    assert " ".join(argv) in launch_plan(cfg).replace("'", "")


def test_cli_dry_run_prints_the_plan_and_starts_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--recipe", "kimi_k2_grpo_gsm8k", "--dry-run", *MODEL, "--run.name", "k2"]) == 0
    out = capsys.readouterr().out
    assert out == (SNAPSHOTS / "kimi_k2_grpo_gsm8k.txt").read_text() + "run directory: runs/k2\n"
    assert not (tmp_path / "runs").exists()  # no run directory, no lock
    assert main(["train", "--recipe", "tiny_flow_grpo_compressibility", "--dry-run"]) == 0
    assert "a diffusion run trains in this process" in capsys.readouterr().out
    assert main(["train", "--recipe", "qwen_image_flow_grpo_compressibility", "--dry-run", "--run.name", "q"]) == 0
    gpu = torch.cuda.is_available()
    assert capsys.readouterr().out == (
        "# miles train --dry-run: a diffusion run trains in 8 rank processes it spawns (FSDP2 over the transformer, "
        "one GPU each); nothing else\n"  # run.world_size 8
        "model: /models/Qwen-Image NOT FOUND here: miles train would stop; pass a local diffusers pipeline directory\n"
        f"device: {'cuda' if gpu else 'cuda (no GPU visible here: miles train would stop)'}; precision: trained "
        "float32, sampling copy bfloat16, text encoders and VAE bfloat16\n"
        "algorithm: flow_grpo, 8 prompts x 16 images a step, 10 denoising steps (6 trained), LoRA r 64 on 12 module "
        "names\n"
        "loop: 100 steps, a checkpoint every 10, eval every 10\n"
        "run directory: runs/q\n"
    )
    assert main(["train", "--recipe", "qwen_image_flow_grpo_compressibility", "--tiny", "--dry-run"]) == 0
    assert "\nmodel: tiny-qwen-image (random, built offline into the model cache)\ndevice: cpu;" in (
        capsys.readouterr().out
    )


def test_cli_dry_run_of_a_bad_config_is_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "miles.recipes.cli", "train", "--dry-run", "--train.qat", "int4"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result
    assert result.stderr.strip().count("\n") == 0 and "train.qat is 'int4'" in result.stderr
