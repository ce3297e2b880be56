"""``miles train`` on a diffusion recipe (``kind: diffusion``, ``miles.recipes.diffusion``): the run directory, exact
resume, Ctrl-C, bad input in one line, and (slow) the shipped tiny recipe raising held-out JPEG compressibility."""

import json
import os
import re
import signal

import numpy as np
import pytest
import torch
import yaml
from miles.recipes.cli import main, resolve_config
from miles.recipes.diffusion import DiffusionConfig, image_grid

RECIPE = "tiny_flow_grpo_compressibility"
CUDA = torch.cuda.is_available()
# 2 prompts x 2 images, 3 denoising steps: ~0.1 s a step
SMALL = ["--algorithm.prompts-per-step", "2", "--algorithm.group-size", "2", "--algorithm.num-steps", "3",
         "--eval.images-per-prompt", "1", "--run.progress", "false"]  # fmt: skip


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def transformer_weights(checkpoint):
    from safetensors.torch import load_file

    return load_file(checkpoint / "model" / "transformer" / "diffusion_pytorch_model.safetensors")


def train(tmp_path, name, *extra):
    return main(["train", "--recipe", RECIPE, "--run.dir", str(tmp_path), "--run.name", name, *SMALL, *extra])


def test_the_recipes_resolve_to_diffusion_configs():
    cfg = resolve_config(RECIPE, [])
    assert isinstance(cfg, DiffusionConfig) and cfg.reward.name == "jpeg_compressibility"
    assert cfg.algorithm.batch_size == 32 and cfg.loop.num_steps == 30 and cfg.algorithm.loss == "flow_grpo"
    nft = resolve_config("tiny_flow_nft_compressibility", [])
    assert nft.algorithm.loss == "diffusion_nft" and nft.model_copy(update={"algorithm": cfg.algorithm}) == cfg


def test_a_run_writes_metrics_samples_checkpoints_and_the_reward_plot(tmp_path):
    assert train(tmp_path, "a", "--loop.num-steps", "3", "--loop.save-interval", "2", "--eval.interval", "2") == 0
    run = tmp_path / "a"
    logged = rows(run)
    assert [r["step"] for r in logged if "eval/reward" in r] == [0, 2, 3]
    train_rows = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert all(r["train_rollout_logprob_max_abs_diff"] < 1e-5 for r in train_rows)  # miles.sync kept the copy equal
    assert [r["weight_version"] for r in train_rows] == [2, 3, 4]
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_0.png", "step_2.png", "step_3.png"]
    from PIL import Image

    # 4 eval prompts x 1 image of 16 px (+2 border) at 4x, and the labels' strip: 8 + 6 x len("a yellow picture")
    assert Image.open(run / "samples" / "step_3.png").size == (4 * 18 + 8 + 6 * 16, 4 * 4 * 18)
    assert (run / "reward.png").stat().st_size > 0 and (run / "train.log").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_3"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_2", "step_3"]
    state = json.loads((run / "checkpoints" / "step_3" / "run_state.json").read_text())
    assert state["step"] == 3 and state["weight_version"] == 4 and state["data_source"] == {"position": 6}
    # the checkpoint's model directory is a flow model: export copies it, and a run can start from it
    assert main(["export", "--checkpoint", str(run / "checkpoints" / "step_3"), "--out", str(tmp_path / "x")]) == 0
    assert train(tmp_path, "b", "--loop.num-steps", "1", "--model.path", str(tmp_path / "x")) == 0
    assert main(["eval", "--checkpoint", str(run / "checkpoints" / "step_3")]) == 2


def test_resume_continues_exactly(tmp_path):
    assert train(tmp_path, "straight", "--loop.num-steps", "4", "--algorithm.updates-per-rollout", "2") == 0
    assert train(tmp_path, "split", "--loop.num-steps", "2", "--algorithm.updates-per-rollout", "2") == 0
    assert main(["train", "--run.dir", str(tmp_path), "--run.name", "split", "--resume", "--loop.num-steps", "4"]) == 0
    straight, split = rows(tmp_path / "straight"), rows(tmp_path / "split")
    steps = [r for r in straight if "loss" in r]
    assert [r["step"] for r in steps] == [r["step"] for r in split if "loss" in r] == [1, 2, 3, 4]
    for a, b in zip(steps, [r for r in split if "loss" in r]):
        for key in ("reward/mean", "loss", "grad_norm", "approx_kl", "weight_version"):
            assert a[key] == b[key], (a["step"], key)
    evals = {r["step"]: r["eval/reward"] for r in split if "eval/reward" in r}  # the first run's end evaluated at 2
    assert evals == {0: evals[0], 2: evals[2], 4: straight[-1]["eval/reward"]} and straight[-1]["step"] == 4
    final_a = transformer_weights(tmp_path / "straight" / "checkpoints" / "step_4")
    final_b = transformer_weights(tmp_path / "split" / "checkpoints" / "step_4")
    assert all(torch.equal(final_a[name], final_b[name]) for name in final_a)


def test_ctrl_c_finishes_the_step_saves_and_the_run_continues(tmp_path, monkeypatch):
    plugin = tmp_path / "diffusion_interrupting_reward.py"
    plugin.write_text(
        "import os, signal\ncalls = []\n"
        "def reward(prompts, images):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return [float(i) for i in range(len(images))]\n"
    )
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs in the background
    code = train(tmp_path, "c", "--loop.num-steps", "5", "--reward.path", f"{plugin}:reward", "--eval.interval", "0")
    assert code == 130
    run = tmp_path / "c"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"  # the step in progress finished, saved
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert signal.getsignal(signal.SIGINT) is before  # the run put back the handler it found
    assert main(["train", "--run.dir", str(tmp_path), "--run.name", "c", "--resume"]) == 0
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4, 5]
    assert os.path.isdir(run / "checkpoints" / "step_5")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--algorithm.lora.target-modules", "['q_proj']"],
            "algorithm.lora.target_modules: 'q_proj' matches no module",
        ),
        (["--algorithm.lora.sync", "adapter"], "algorithm.lora.sync"),
        (["--algorithm.train-steps", "9"], r"algorithm.train_steps \(9\) must be at most algorithm.num_steps \(3\)"),
        (["--reward.path", "no_colon"], "reward.path is 'no_colon'; expected module:attr"),
        (
            ["--model.path", "/nonexistent"],
            "model.path '/nonexistent' is neither 'tiny-flow', 'tiny-sd3', 'tiny-qwen-image', a diffusers",
        ),
        (["--reward.name", "named_colour", "--eval.prompts", "['a dog']"], "eval.prompts: prompt 'a dog' must name"),
        (["--reward.path", "nowhere_module:score"], "reward.path"),
        (["--model.device", "tpu"], "model.device"),
        *([(["--model.device", "cuda"], "model.device is cuda but no GPU is visible")] if not CUDA else []),
    ],
)
def test_bad_input_is_one_line_naming_the_field(tmp_path, capsys, extra, message):
    assert train(tmp_path, "bad", "--loop.num-steps", "1", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("body", "extra", "message"),
    [  # at the step-0 evaluation (2 eval images), and in a training step (4 images)
        (
            "return [1.0]",
            ["--eval.prompts", "[a, b]"],
            "reward.path .*: the reward must return 2 finite floats, got \\[1.0\\]",
        ),
        ("return [1.0]", ["--eval.interval", "0"], "the reward must return 4 finite floats"),
        ("raise RuntimeError('server down')", [], "the reward raised RuntimeError: server down"),
        ("return ['a'] * len(images)", [], "the reward raised ValueError: could not convert"),
        ("return [float('nan')] * len(images)", [], "must return 4 finite floats, got \\[nan, nan, nan, nan\\]"),
    ],
)
def test_a_reward_that_fails_in_the_run_is_one_line(tmp_path, capsys, body, extra, message):
    plugin = tmp_path / "diffusion_broken_reward.py"
    plugin.write_text(f"def reward(prompts, images):\n    {body}\n")
    assert train(tmp_path, "r", "--loop.num-steps", "2", "--reward.path", f"{plugin}:reward", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_resume_takes_overrides_of_the_diffusion_keys(tmp_path):
    assert train(tmp_path, "o", "--loop.num-steps", "1", "--eval.interval", "0") == 0
    args = ["train", "--run.dir", str(tmp_path), "--run.name", "o", "--resume", "--loop.num-steps", "2"]
    assert main([*args, "--algorithm.lr", "0.002", "--run.progress", "false"]) == 0
    recorded = yaml.safe_load((tmp_path / "o" / "config.yaml").read_text())
    assert recorded["algorithm"]["lr"] == 0.002 and recorded["loop"]["num_steps"] == 2
    assert [r["step"] for r in rows(tmp_path / "o")] == [1, 2]
    # the new learning rate is the one that trained step 2 (not the checkpoint's optimizer's)
    saved = torch.load(tmp_path / "o" / "checkpoints" / "step_2" / "optimizer.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.002


def test_a_resume_keeps_its_model(tmp_path, capsys):
    assert train(tmp_path, "k", "--loop.num-steps", "1", "--eval.interval", "0") == 0
    before = (tmp_path / "k" / "config.yaml").read_text()
    args = ["train", "--run.dir", str(tmp_path), "--run.name", "k", "--resume", "--loop.num-steps", "2"]
    assert main([*args, "--model.path", "tiny-sd3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.path is 'tiny-sd3' but the checkpoint" in err[0] and "trained 'tiny-flow'" in err[0]
    assert (tmp_path / "k" / "config.yaml").read_text() == before  # nothing rewritten
    assert main([*args, "--model.seed", "3"]) == 2
    assert "model.seed is 3" in capsys.readouterr().err


def test_a_lora_run_resumes_exactly_and_saves_the_merged_transformer(tmp_path, capsys):
    """--algorithm.lora: the checkpoint holds the adapters alone (optimizer.pt) and the merged transformer (model/,
    a plain flow model), a resume loads the adapters onto the run's model and continues exactly, and a resume with
    other adapters is one line."""
    from miles.diffusion.models import load_flow_model, tiny_flow_model

    lora = ["--algorithm.lora.rank", "4", "--eval.interval", "0"]
    assert train(tmp_path, "straight", *lora, "--loop.num-steps", "2") == 0
    assert train(tmp_path, "split", *lora, "--loop.num-steps", "1") == 0
    resume = ["train", "--run.dir", str(tmp_path), "--run.name", "split", "--resume"]
    assert main([*resume, "--loop.num-steps", "2"]) == 0
    a, b = ([r for r in rows(tmp_path / name) if "loss" in r] for name in ("straight", "split"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert all(x[k] == y[k] for x, y in zip(a, b) for k in ("reward/mean", "loss", "grad_norm", "weight_version"))
    step_2 = tmp_path / "split" / "checkpoints" / "step_2"
    merged = transformer_weights(step_2)
    assert merged.keys() == transformer_weights(tmp_path / "straight" / "checkpoints" / "step_2").keys()
    assert all(torch.equal(merged[k], v) for k, v in transformer_weights(tmp_path / "straight" / "checkpoints" /
                                                                           "step_2").items())  # fmt: skip
    start = tiny_flow_model(seed=0).transformer.state_dict()
    assert sorted(merged) == sorted(start)  # plain names: no base_layer / lora_ tensors
    assert any(not torch.equal(merged[k], start[k]) for k in start if ".attn.to_q." in k)
    loaded = load_flow_model(step_2 / "model").transformer.state_dict()
    assert all(torch.equal(loaded[k], merged[k]) for k in merged)
    adapters = torch.load(step_2 / "optimizer.pt", weights_only=True)["adapters"]
    assert adapters and all(".lora_" in name for name in adapters)
    assert main([*resume, "--loop.num-steps", "3", "--algorithm.lora.rank", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("miles: algorithm.lora.rank is 8 but the checkpoint"), err
    assert "trained with 4: a resumed run keeps its adapters' rank" in err[0] and len(err[0]) < 400, err
    assert main([*resume, "--loop.num-steps", "3", "--algorithm.lora", "off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "algorithm.lora is off but the checkpoint" in err[0] and "trained with LoRA (rank 4)" in err[0], err
    assert (
        "algorithm.lora: 23 adapted layers (rank 4, alpha 64), 11.8 k adapter weights train"
        in (tmp_path / "straight" / "train.log").read_text()
    )


def test_a_reward_function_replaces_the_named_reward_and_its_signature_is_checked(tmp_path, capsys):
    plugin = tmp_path / "diffusion_one_arg_reward.py"
    plugin.write_text("def one(images):\n    return []\n")
    cfg = resolve_config(RECIPE, ["--reward.path", f"{plugin}:one"])
    assert cfg.reward.name is None  # the config records what runs
    assert train(tmp_path, "s", "--reward.path", f"{plugin}:one") == 2
    err = capsys.readouterr().err.strip()
    assert "must accept 2 positional argument(s)" in err and "expected (prompts: list[str], images: numpy" in err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"model_type": "clip_text_model"}', "holds a 'clip_text_model' model, not a CLIP model"),
        ("not json", "holds a None model, not a CLIP model"),
        ('{"model_type": "clip"}', "could not be loaded"),
    ],
)
def test_a_clip_score_directory_that_is_not_a_clip_model_is_one_line(tmp_path, capsys, config, message):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(config)
    extra = ["--reward.name", "clip_score", "--reward.model-path", str(tmp_path / "m")]
    assert train(tmp_path, "c", "--loop.num-steps", "1", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "pass a downloaded PickScore / CLIP directory" in err[0], err


def test_export_of_a_missing_checkpoint_says_so(tmp_path, capsys):
    assert main(["export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _flow_checkpoint(run, step, *, weights=True):
    """A diffusion run's checkpoint as ``save_run_checkpoint`` lays it out, with a tiny flow model, named latest."""
    from miles.diffusion.models import FLOW_META
    from safetensors.torch import save_file

    checkpoint = run / "checkpoints" / f"step_{step}"
    (checkpoint / "model" / "transformer").mkdir(parents=True)
    (checkpoint / "run_state.json").write_text(json.dumps({"step": step}))
    (checkpoint / "config.yaml").write_text("kind: diffusion\n")
    (checkpoint / "model" / FLOW_META).write_text(json.dumps({"kind": "tiny"}))
    if weights:
        save_file({"w": torch.zeros(2)}, checkpoint / "model" / "transformer" / "diffusion_pytorch_model.safetensors")
    (run / "checkpoints" / "latest").write_text(f"step_{step}\n")
    return checkpoint


def test_export_of_a_run_directory_exports_its_latest_checkpoint(tmp_path):
    from miles.diffusion.models import FLOW_META

    run = tmp_path / "runs" / "r"
    _flow_checkpoint(run, 2)
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "x")]) == 0
    assert json.loads((tmp_path / "x" / FLOW_META).read_text()) == {"kind": "tiny"}
    assert main(["export", "--checkpoint", str(run / "checkpoints"), "--out", str(tmp_path / "y")]) == 0
    assert (tmp_path / "y" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


@pytest.mark.parametrize(
    "layout, message",
    [
        pytest.param(
            "run_without_checkpoint",
            "that run has no checkpoint yet (one is saved every loop.save_interval steps, after the last step and on "
            "Ctrl-C); pass a runs/<name>/checkpoints/step_N directory of a run that saved one",
            id="run_without_checkpoint",
        ),
        pytest.param(
            "diffusion_checkpoint_without_weights",
            "lacks ['transformer/diffusion_pytorch_model.safetensors']; pass a runs/<name>/checkpoints/step_N",
            id="diffusion_checkpoint_names_flow_files",
        ),
        pytest.param(
            "no_model",
            "no model/ there, so it is not a Miles checkpoint; pass a runs/<name>/checkpoints/step_N directory (or the "
            "run directory runs/<name>: its latest checkpoint)",
            id="not_a_checkpoint",
        ),
    ],
)
def test_export_of_what_is_no_checkpoint_is_one_line_fitting_the_run(layout, message, tmp_path, capsys):
    run = tmp_path / "runs" / "r"
    if layout == "run_without_checkpoint":
        run.mkdir(parents=True)
        (run / "config.yaml").write_text("kind: diffusion\n")
        (run / "metrics.jsonl").write_text("")
    elif layout == "diffusion_checkpoint_without_weights":
        _flow_checkpoint(run, 1, weights=False)
    else:
        run.mkdir(parents=True)
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "tokenizer" not in err[0], err


def test_image_grid_tiles_rows_with_borders():
    images = np.stack([np.full((2, 2, 3), v, dtype=np.uint8) for v in (10, 20, 30)])
    grid = image_grid(images, columns=2)
    assert grid.shape == (2 * 4, 2 * 4, 3)
    assert (grid[0:2, 0:2] == 10).all() and (grid[0:2, 4:6] == 20).all() and (grid[4:6, 0:2] == 30).all()
    assert (grid[4:6, 4:6] == 255).all() and (grid[2:4] == 255).all()  # the empty cell and the borders are white


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none here)")
def test_a_run_on_the_gpu_samples_what_the_cpu_samples(tmp_path):
    """The noise is drawn on the CPU generator whatever the device, so the GPU run's step-0 eval images match the
    CPU run's up to kernel differences, and the weight push keeps the sampler's log-probs (1e-4, TF32 off)."""
    for device in ("cpu", "cuda"):
        assert train(tmp_path, device, "--loop.num-steps", "2", "--model.device", device) == 0
    cpu, gpu = rows(tmp_path / "cpu"), rows(tmp_path / "cuda")
    assert abs(cpu[0]["eval/reward"] - gpu[0]["eval/reward"]) < 0.05
    assert all(r["train_rollout_logprob_max_abs_diff"] < 1e-4 for r in gpu if "loss" in r)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [RECIPE, "tiny_flow_nft_compressibility"])
def test_the_shipped_recipes_raise_held_out_compressibility(tmp_path, recipe):
    """The acceptance on the CPU: 30 steps of each shipped recipe (~1 min on 2 cores) raise the held-out (ODE
    samples of unseen prompts and noise) JPEG compressibility by a clear margin; measured -0.948 -> -0.802 kB
    (Flow-GRPO) and -0.948 -> -0.810 kB (DiffusionNFT)."""
    assert main(["train", "--recipe", recipe, "--run.dir", str(tmp_path), "--run.name", "l", "--run.progress",
                 "false"]) == 0  # fmt: skip
    evals = {r["step"]: r["eval/reward"] for r in rows(tmp_path / "l") if "eval/reward" in r}
    assert sorted(evals) == [0, 10, 20, 30]
    assert evals[30] > evals[0] + 0.08, evals
    assert (tmp_path / "l" / "reward.png").is_file()
    assert {"step_0.png", "step_30.png"} <= {p.name for p in (tmp_path / "l" / "samples").iterdir()}


def test_the_sd35_recipe_is_sized_for_a_gpu_and_its_tiny_twin_runs(tmp_path, monkeypatch):
    cfg = resolve_config("sd35_medium_flow_grpo_compressibility", [])
    assert cfg.model.device == "cuda" and cfg.model.resolution == 512 and cfg.algorithm.guidance_scale == 4.5
    assert (cfg.algorithm.kl_coef, cfg.algorithm.train_steps, cfg.algorithm.num_steps) == (0.04, 6, 10)
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))  # tiny-sd3 is built there
    args = ["train", "--recipe", "sd35_medium_flow_grpo_compressibility", "--tiny", "--run.dir", str(tmp_path)]
    assert main([*args, "--run.name", "t", "--run.progress", "false"]) == 0
    logged = rows(tmp_path / "t")
    train_rows = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    # CFG 4.5 and the KL to the starting model ran: the KL is 0 on the first step, > 0 after one update
    assert train_rows[0]["kl"] == 0 and train_rows[1]["kl"] > 0
    # sampled in bf16, old log-probs recomputed in fp32: the ratio starts at 1, the sampler's gap is logged
    assert all(r["approx_kl"] == 0 and r["clipfrac"] == 0 for r in train_rows)
    assert all(0 < r["train_rollout_logprob_max_abs_diff"] < 1 for r in train_rows)
    assert (tmp_path / "cache" / "models" / "tiny-sd3-v1" / "model_index.json").is_file()


def test_resume_from_a_run_directory_continues_its_latest_checkpoint(tmp_path):
    from miles.recipes.cli import resolve_resume

    run = tmp_path / "runs" / "r"
    checkpoint = _flow_checkpoint(run, 2)
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(resolve_config(RECIPE, []).model_dump(mode="json")))
    cfg, run_dir, resumed_from = resolve_resume(str(run), RECIPE, ["--loop.num-steps", "40"])
    assert (run_dir, resumed_from, cfg.loop.num_steps) == (run, checkpoint, 40)  # not the run's parent's parent


# -- several ranks (--run.world-size 2: spawned ranks, FSDP2 over the transformer, gloo) --------------------------
RANKS_COMPARED = ("reward/mean", "reward/std_in_group", "loss", "grad_norm", "weight_version", "approx_kl", "clipfrac")
TWO = ("--run.world-size", "2", "--run.num-threads", "1")


def _same_rows(one, two):
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        for key in (*RANKS_COMPARED, "eval/reward"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["step"], key)


def _same_weights(a, b):
    for name, tensor in a.items():
        torch.testing.assert_close(b[name], tensor, atol=2e-5, rtol=1e-4, msg=name)


@pytest.fixture
def keep_threads():
    """Restores torch's thread count: ``--run.num-threads`` sets it for the whole process (a later test in it
    would train with 1 thread, and an RL run's result depends on the summation order)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.integration
@pytest.mark.usefixtures("keep_threads")
def test_two_ranks_train_as_one_process_stop_together_and_resume_in_one(tmp_path, monkeypatch):
    """Two ranks, stopped by a SIGINT that only rank 1 gets (in step 2), then resumed in one process, equal a
    straight one-process run: the ranks agree on the step to stop at, rank 0 saves, and a checkpoint holds whole
    tensors whatever the layout."""
    plugin = tmp_path / "diffusion_ranks_interrupting_reward.py"
    plugin.write_text(
        "import os, signal\nfrom miles.diffusion.rewards import IMAGE_REWARDS\n"
        "def reward(prompts, images):\n"
        "    if 'a yellow image' in prompts and not os.path.exists('stopped'):\n"
        "        open('stopped', 'w').close()  # once: a resumed run's ranks are new processes\n"
        "        os.kill(os.getpid(), signal.SIGINT)  # rank 1, which holds step 2's yellow group\n"
        "    return IMAGE_REWARDS['jpeg_compressibility'](prompts, images)\n"
    )
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs in the background
    steps = ("--reward.path", f"{plugin}:reward", "--algorithm.updates-per-rollout", "2", "--eval.interval", "2",
             "--loop.save-interval", "1")  # fmt: skip
    assert train(tmp_path, "two", "--loop.num-steps", "3", *steps, *TWO) == 130
    run = tmp_path / "two"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert [r["step"] for r in rows(run)] == [0, 1, 2, 2]  # step 0's eval, steps 1-2, step 2's eval
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_0.png", "step_2.png"]
    assert signal.getsignal(signal.SIGINT) is before  # the run put back the handler it found
    more = ("--resume", "--run.progress", "false", "--run.world-size", "1")
    assert main(["train", "--run.dir", str(tmp_path), "--run.name", "two", *more]) == 0
    assert train(tmp_path, "one", "--loop.num-steps", "3", *steps, "--run.num-threads", "1") == 0
    _same_rows(rows(tmp_path / "one"), rows(run))
    for step in (2, 3):
        _same_weights(
            *(transformer_weights(tmp_path / name / "checkpoints" / f"step_{step}") for name in ("one", "two"))
        )


@pytest.mark.slow
def test_a_reward_failing_on_one_rank_ends_the_run_in_one_line_naming_it(tmp_path, capsys):
    plugin = tmp_path / "diffusion_one_rank_reward.py"  # rank 1 holds the second prompt's group
    plugin.write_text(
        "def reward(prompts, images):\n"
        "    if 'a blue image' in prompts:\n"
        "        raise RuntimeError('blue is out of stock')\n"
        "    return [1.0] * len(images)\n"
    )
    code = train(tmp_path, "f", "--loop.num-steps", "2", "--eval.interval", "0", "--reward.path", f"{plugin}:reward",
                 *TWO)  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search("the reward raised RuntimeError: blue is out of stock", err[0]), err


def test_the_ranks_must_split_every_mini_batch(capsys):
    with pytest.raises(ValueError, match=r"updates_per_rollout \(2\) x run.world_size \(3\) equal parts"):
        resolve_config(
            "tiny_flow_grpo_compressibility", ["--run.world-size", "3", "--algorithm.updates-per-rollout", "2"]
        )


def _children(pid):
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc; prctl(PR_SET_PDEATHSIG) is Linux's")
def test_ranks_whose_supervisor_is_killed_stop_together_and_the_run_continues(tmp_path):
    """SIGKILL of `miles train` (no handler runs) must not leave its ranks waiting 30 minutes on a dead peer: they
    get SIGTERM from the kernel, stop after the same step, rank 0 saves, and the run resumes."""
    import subprocess
    import sys
    import time

    args = ["train", "--recipe", RECIPE, "--run.dir", str(tmp_path), "--run.name", "k", *SMALL, *TWO,
            "--loop.num-steps", "200", "--loop.save-interval", "1000", "--eval.interval", "0"]  # fmt: skip
    supervisor = subprocess.Popen([sys.executable, "-m", "miles.recipes.cli", *args], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)  # fmt: skip
    run, ranks = tmp_path / "k", []
    try:
        deadline = time.monotonic() + 120
        metrics = run / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().endswith("}\n")):  # a step done: the ranks train
            assert supervisor.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        ranks = [pid for pid in _children(supervisor.pid) if "spawn_main" in _cmdline(pid)]
        assert len(ranks) == 2, ranks
        supervisor.kill()
        supervisor.wait()
        deadline = time.monotonic() + 60
        while any(os.path.exists(f"/proc/{pid}") and "(Z)" not in _state(pid) for pid in ranks):
            assert time.monotonic() < deadline, "the ranks outlived their supervisor"
            time.sleep(0.2)
    finally:  # nothing left running, whatever failed
        supervisor.kill()
        for pid in ranks:
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)
    saved = (run / "checkpoints" / "latest").read_text().strip()  # rank 0 saved the step they stopped after
    step = int(saved.removeprefix("step_"))
    assert 1 <= step < 200 and rows(run)[-1]["step"] == step
    assert main(["train", "--run.dir", str(tmp_path), "--run.name", "k", "--resume", "--loop.num-steps",
                 str(step + 1), "--run.world-size", "1", "--run.progress", "false"]) == 0  # fmt: skip
    assert rows(run)[-1]["step"] == step + 1


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as cmdline:
            return cmdline.read()
    except OSError:
        return ""


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0].join("()")
    except OSError:
        return "(gone)"
