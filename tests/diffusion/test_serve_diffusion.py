"""``miles serve-diffusion`` (``miles.diffusion.serve``): one real server of the tiny twin on a free local port,
spoken to over HTTP with SGLang-Diffusion's post-training API, checked against an identical tiny twin built here.

The agreement tests are the engine/trainer contract: the log-probs the server sends are the ones the trainer
recomputes (``step_log_probs``) from the latents and sigmas it sends, and its image is the final latent decoded.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from miles.diffusion.models import tiny_flow_model
from miles.diffusion.sampler import Trajectories, flow_sigmas, step_log_probs
from miles.diffusion.sglang_api import decode_tensor, parse_rollout_response, tensor_sha256
from miles.rollout.engines.server import free_port
from safetensors.torch import save_file

PROMPT = "a red square"
STEPS = 4
NOISE_LEVEL = 0.7


def rollout_body(**overrides) -> dict:
    body = {"prompt": PROMPT, "seed": 7, "num_inference_steps": STEPS, "num_outputs_per_prompt": 3,
            "rollout_noise_level": NOISE_LEVEL, "rollout_debug_mode": False,
            "rollout_return_dit_trajectory": True}  # fmt: skip
    return body | overrides


@pytest.fixture(scope="module")
def local():
    """The same tiny twin the server built (tiny-flow, seed 0)."""
    return tiny_flow_model(seed=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def rollout(server, **overrides) -> list:
    answer = post(server, "/rollout/generate", rollout_body(**overrides))
    assert answer.status_code == 200, answer.text
    return answer.json()


def as_trajectories(items: list) -> Trajectories:
    parsed = [parse_rollout_response(item, num_steps=STEPS) for item in items]
    return Trajectories(torch.stack([p.latents for p in parsed]), parsed[0].sigmas,
                        torch.stack([p.log_probs for p in parsed]))  # fmt: skip


def write_transformer(model_path: Path, named: dict[str, torch.Tensor]) -> Path:
    (model_path / "transformer").mkdir(parents=True)
    save_file({name: t.contiguous() for name, t in named.items()}, model_path / "transformer" / "model.safetensors")
    return model_path


def sha256_manifest(module: torch.nn.Module) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in module.state_dict().items()}


def test_health_answers_200(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_the_answer_has_sglang_diffusions_fields_and_shapes(server):
    items = rollout(server)
    assert len(items) == 3
    item = items[0]
    assert set(item) == {"request_id", "prompt", "seed", "generated_output", "rollout_log_probs",
                         "rollout_debug_tensors", "denoising_env", "dit_trajectory", "inference_time_s",
                         "peak_memory_mb"}  # fmt: skip
    assert (item["prompt"], item["seed"], item["denoising_env"], item["rollout_debug_tensors"]) == (
        PROMPT,
        7,
        None,
        None,
    )
    assert isinstance(item["inference_time_s"], float) and item["inference_time_s"] > 0
    assert len({i["request_id"] for i in items}) == 1  # one request, one id (SGLang's)
    image = decode_tensor(item["generated_output"], field="generated_output")
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and 0 <= image.min() and image.max() <= 1
    trajectory = item["dit_trajectory"]
    assert decode_tensor(trajectory["latents"], field="latents").shape == (STEPS + 1, 3, 16, 16)
    timesteps = decode_tensor(trajectory["timesteps"], field="timesteps")
    sigmas = decode_tensor(trajectory["sigmas"], field="sigmas")
    # By hand: T + 1 sigmas from 1 down to 0 (SD3's shift-3 schedule), the scheduler's timesteps 1000 x sigma.
    torch.testing.assert_close(sigmas, flow_sigmas(STEPS, shift=3.0), atol=0, rtol=0)
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000, atol=0, rtol=0)
    assert decode_tensor(item["rollout_log_probs"], field="rollout_log_probs").shape == (STEPS,)


@pytest.mark.parametrize("guidance", [1.0, 3.0], ids=["no_guidance", "guidance_3"])
def test_returned_log_probs_are_what_the_trainer_recomputes_from_the_returned_trajectory(server, local, guidance):
    items = rollout(server, guidance_scale=guidance, negative_prompt="")
    trajectories = as_trajectories(items)
    uncond = local.encode([""] * 3) if guidance != 1.0 else None
    recomputed = step_log_probs(local.transformer, trajectories, local.encode([PROMPT] * 3), range(STEPS),
                                noise_level=NOISE_LEVEL, uncond=uncond, guidance_scale=guidance)  # fmt: skip
    torch.testing.assert_close(recomputed, trajectories.log_probs, atol=1e-5, rtol=0)


def test_the_first_and_last_steps_log_probs_match_a_hand_computed_gaussian(server):
    # A sampled step's log-prob is mean_j log N(scale eps_j; 0, scale^2) = -mean(eps^2) / 2 - ln(scale) - ln sqrt(2 pi)
    # with mean(eps^2) ~ 1 (768 elements: sd 0.05). Sigmas 1, 0.8577, 0.6022, 0.00893, 0 (shift 3, T 4); a = 0.7.
    # Step 0 (t = 1, sigma_max 0.8577): scale = a sqrt(1 / (1 - 0.8577)) sqrt(1 - 0.8577) = a: -0.5 + 0.357 - 0.919.
    # Step 3: std = 0.7 sqrt(0.00893 / 0.99107) = 0.0664, scale = 0.0664 sqrt(0.00893) = 0.00628: -0.5 + 5.071 - 0.919.
    log_probs = as_trajectories(rollout(server)).log_probs
    torch.testing.assert_close(log_probs[:, 0], torch.full((3,), -1.062), atol=0.1, rtol=0)
    torch.testing.assert_close(log_probs[:, 3], torch.full((3,), 3.652), atol=0.1, rtol=0)


def test_sigmas_from_timesteps_alone_agree_with_the_sent_sigmas(server):
    item = rollout(server)[0]
    older = item | {"dit_trajectory": {k: v for k, v in item["dit_trajectory"].items() if k != "sigmas"}}
    torch.testing.assert_close(parse_rollout_response(older, num_steps=STEPS).sigmas, flow_sigmas(STEPS, shift=3.0),
                               atol=1e-6, rtol=0)  # fmt: skip


def test_the_image_is_the_final_latent_decoded(server, local):
    for item in rollout(server):
        parsed = parse_rollout_response(item, num_steps=STEPS)
        pixels = ((local.decode(parsed.latents[-1:]) + 1) / 2).clamp(0, 1)[0]  # [3, H, W]
        expected = (pixels * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        assert np.abs(parsed.image.astype(int) - expected.astype(int)).max() <= 1


def test_the_same_seed_gives_the_same_answer_and_another_seed_another(server):
    first, again, other = rollout(server, seed=11), rollout(server, seed=11), rollout(server, seed=12)
    for a, b, c in zip(first, again, other, strict=True):
        for key in ("generated_output", "rollout_log_probs"):
            assert a[key]["data"] == b[key]["data"]
            assert a[key]["data"] != c[key]["data"]


def test_rollout_false_samples_the_ode_and_sends_the_image_only(server):
    items = rollout(server, rollout=False)
    assert [i["rollout_log_probs"] for i in items] == [None] * 3 and items[0]["dit_trajectory"] is None
    sde = rollout(server)
    assert items[0]["generated_output"]["data"] != sde[0]["generated_output"]["data"]


def test_a_weight_push_changes_the_rollout_and_the_checker_sees_it(server, local, tmp_path):
    from miles.sync.disk import DiskWeightWriter

    before = as_trajectories(rollout(server))
    old_manifest = sha256_manifest(local.transformer)
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        n: t + 0.05 * torch.randn(t.shape, generator=generator) for n, t in local.transformer.state_dict().items()
    }
    new_dir = write_transformer(tmp_path / "new", perturbed)
    answer = post(server, "/update_weights_from_disk", {"model_path": str(new_dir), "target_modules": ["transformer"]})
    assert (answer.status_code, answer.json()) == (
        200,
        {"success": True, "message": "Updated 1 modules (transformer)."},
    )
    new_manifest = {name: tensor_sha256(t) for name, t in perturbed.items()}
    check = post(server, "/update_weights_from_tensor_checker",
                 {"target_module": "transformer", "expected_named_tensors_sha256": new_manifest})  # fmt: skip
    assert (check.status_code, check.json()["message"]) == (
        200,
        "Verified module 'transformer' update for 95 tensor(s).",
    )
    check = post(server, "/update_weights_from_tensor_checker",
                 {"target_module": "transformer", "expected_named_tensors_sha256": old_manifest})  # fmt: skip
    assert check.status_code == 400 and not check.json()["success"]
    message = check.json()["message"]
    assert message.startswith("Module 'transformer' update weight check failed: checksum mismatch for 95 tensor(s): ")
    assert sorted(old_manifest)[0] in message
    after = as_trajectories(rollout(server))
    # Same seed, same noise: the sampled log-prob is the noise's alone (x_next - mean = scale x noise), so the
    # weights show in the latents, not in the log-probs the server sends.
    assert (after.latents[:, 1:] - before.latents[:, 1:]).abs().max() > 1e-3
    # The trainer with the pushed weights recomputes the new log-probs, and not the old trajectory's.
    pushed = tiny_flow_model(seed=0)
    pushed.transformer.load_state_dict(perturbed)
    cond = pushed.encode([PROMPT] * 3)
    recompute = dict(steps=range(STEPS), noise_level=NOISE_LEVEL)
    torch.testing.assert_close(step_log_probs(pushed.transformer, after, cond, **recompute), after.log_probs,
                               atol=1e-5, rtol=0)  # fmt: skip
    stale = step_log_probs(pushed.transformer, before, cond, **recompute)
    assert (stale - before.log_probs).abs().max() > 1e-3
    # Back to the original weights through a checked Miles version directory (manifest.json, xxh3 per shard).
    version = DiskWeightWriter(tmp_path / "versions").write(local.transformer.state_dict().items(), version=1)
    (tmp_path / "orig").mkdir()
    os.symlink(version, tmp_path / "orig" / "transformer")
    answer = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "orig")})
    assert answer.status_code == 200, answer.text
    check = post(server, "/update_weights_from_tensor_checker",
                 {"target_module": "transformer", "expected_named_tensors_sha256": old_manifest})  # fmt: skip
    assert check.status_code == 200, check.text
    torch.testing.assert_close(as_trajectories(rollout(server)).latents, before.latents, atol=0, rtol=0)


def _bad_weights(local, tmp_path: Path, case: str) -> dict:
    state = local.transformer.state_dict()
    if case == "unknown_module":
        return {"model_path": str(write_transformer(tmp_path, state)), "target_modules": ["vae"]}
    if case == "missing_weight_files":
        return {"model_path": str(tmp_path)}
    if case == "wrong_shape":
        return {"model_path": str(write_transformer(tmp_path, state | {"proj_out.weight": torch.zeros(3, 3)}))}
    if case == "unknown_tensor":
        return {"model_path": str(write_transformer(tmp_path, state | {"not.a.weight": torch.zeros(3)}))}
    assert case == "corrupt_shard"
    from miles.sync.disk import DiskWeightWriter

    version = DiskWeightWriter(tmp_path / "versions").write(state.items(), version=1)
    shard = next(version.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tmp_path / "model").mkdir()
    os.symlink(version, tmp_path / "model" / "transformer")
    return {"model_path": str(tmp_path / "model")}


@pytest.mark.parametrize("case, expected", [
    pytest.param("unknown_module", "not found in pipeline: ['vae']. Available Module(s): ['transformer']", id="vae"),
    pytest.param("missing_weight_files", "missing weight files for modules: ['transformer']", id="no_files"),
    pytest.param("wrong_shape", "'proj_out.weight' has shape [3, 3]", id="wrong_shape"),
    pytest.param("unknown_tensor", "'not.a.weight', which is no parameter or buffer", id="unknown_tensor"),
    pytest.param("corrupt_shard", "fails its checksum", id="corrupt_shard"),
])  # fmt: skip
def test_a_bad_weight_push_is_refused_and_loads_nothing(server, local, tmp_path, case, expected):
    answer = post(server, "/update_weights_from_disk", _bad_weights(local, tmp_path, case))
    assert answer.status_code == 400 and answer.json()["success"] is False
    assert expected in answer.json()["message"]
    current = sha256_manifest(local.transformer)
    check = post(server, "/update_weights_from_tensor_checker",
                 {"target_module": "transformer", "expected_named_tensors_sha256": current})  # fmt: skip
    assert check.status_code == 200, check.text


@pytest.mark.parametrize("overrides, field", [
    pytest.param({"rollout_sde_type": "cps"}, "rollout_sde_type 'cps'", id="sde_type_cps"),
    pytest.param({"width": 32}, "width 32 is not this model's image width 16", id="wrong_width"),
    pytest.param({"prompt": None}, "prompt: ", id="no_prompt"),
    pytest.param({"num_inference_steps": 1}, "num_inference_steps must be an integer >= 2", id="one_step"),
    pytest.param({"rollout_noise_level": 0.0}, "rollout_noise_level must be > 0", id="no_noise"),
    pytest.param({"rollout_log_prob_no_const": True}, "rollout_log_prob_no_const", id="no_const"),
    pytest.param({"rollout_sde_step_indices": [0, 1]}, "rollout_sde_step_indices [0, 1]", id="some_steps"),
    pytest.param({"true_cfg_scale": 4.0}, "true_cfg_scale 4.0 is not this model's guidance", id="true_cfg_on_sd3"),
    pytest.param({"seed": None}, "seed is required", id="no_seed"),
    pytest.param({"rollout_noise_levle": 0.5}, "rollout_noise_levle: Extra inputs are not permitted", id="typo"),
])  # fmt: skip
def test_a_rollout_the_server_cannot_do_is_a_400_naming_the_field(server, overrides, field):
    body = {k: v for k, v in rollout_body(**overrides).items() if v is not None}
    answer = post(server, "/rollout/generate", body)
    assert answer.status_code == 400
    detail = answer.json()["detail"]
    assert detail.startswith("Invalid sampling params: ") and field in detail and "\n" not in detail


@pytest.mark.parametrize("body, message", [
    pytest.param({"expected_named_tensors_sha256": {"a": "b"}}, "target_module is required", id="no_module"),
    pytest.param({"target_module": "transformer", "expected_named_tensors_sha256": {}},
                 "expected_named_tensors_sha256 is required", id="empty_manifest"),
    pytest.param({"target_module": "vae", "expected_named_tensors_sha256": {"a": "b"}},
                 "Module 'vae' is not initialized", id="unknown_module"),
    pytest.param({"target_module": "transformer", "expected_named_tensors_sha256": {"nope": "0"}},
                 "Module 'transformer' update weight check failed: missing 1 tensor(s): nope", id="missing_tensor"),
])  # fmt: skip
def test_the_checker_answers_sglangs_messages(server, body, message):
    answer = post(server, "/update_weights_from_tensor_checker", body)
    assert (answer.status_code, answer.json()) == (400, {"success": False, "message": message})


def test_serve_diffusion_with_an_unknown_model_prints_one_line_and_exits_2(capsys):
    from miles.recipes.cli import main

    assert main(["serve-diffusion", "--model", "nope", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("miles serve-diffusion: --model 'nope' is neither 'tiny-flow'")


def test_serve_diffusion_on_a_taken_port_names_the_flag(server, capsys):
    from miles.recipes.serve_diffusion import main

    assert main(["--model", "tiny-flow", "--port", str(server.port)]) == 2
    assert capsys.readouterr().err.startswith(f"miles serve-diffusion: --port {server.port}: something already listens")
