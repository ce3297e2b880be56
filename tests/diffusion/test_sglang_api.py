"""SGLang-Diffusion's wire format (``miles.diffusion.sglang_api``): tensors travel bit-exact as SGLang's
``_maybe_serialize`` dicts, checksums are SGLang's, requests carry its field names, answers parse into trajectories
or fail naming the field."""

import base64
import hashlib

import numpy as np
import pytest
import torch
from miles.diffusion.sampler import pack_latents
from miles.diffusion.sglang import _as_latents
from miles.diffusion.sglang_api import (
    RolloutSettings,
    decode_tensor,
    encode_tensor,
    image_to_uint8,
    parse_rollout_response,
    rollout_request,
    tensor_sha256,
)
from safetensors.torch import save


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_tensor_travels_bit_exact_as_sglangs_serialized_dict(dtype):
    tensor = (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    wire = encode_tensor(tensor.t())  # non-contiguous in, contiguous on the wire
    assert wire["__tensor__"] is True and wire["shape"] == [4, 3] and wire["dtype"] == str(dtype)
    assert base64.b64decode(wire["data"]) == save({"t": tensor.t().contiguous()})  # SGLang's payload, byte for byte
    back = decode_tensor(wire, field="x")
    assert back.dtype == dtype and torch.equal(back, tensor.t())
    assert torch.equal(decode_tensor(wire["data"], field="x"), tensor.t())  # older servers: a bare base64 string
    raw = {**wire, "data": base64.b64decode(wire["data"])}  # a msgpack answer: the blob as bytes
    assert torch.equal(decode_tensor(raw, field="x"), tensor.t())


def test_a_field_that_is_no_tensor_is_named():
    with pytest.raises(ValueError, match="^rollout_log_probs: expected a serialized tensor"):
        decode_tensor({"shape": [2]}, field="rollout_log_probs")
    with pytest.raises(ValueError, match="^dit_trajectory.latents: not a base64 safetensors tensor"):
        decode_tensor({"__tensor__": True, "data": "bm90IGEgYmxvYg=="}, field="dit_trajectory.latents")


def test_the_checksum_is_sglangs_sha256_of_dtype_shape_and_bytes():
    tensor = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    by_hand = hashlib.sha256(b"torch.float32" + b"(2, 2)" + tensor.numpy().tobytes()).hexdigest()
    assert tensor_sha256(tensor) == by_hand
    assert tensor_sha256(tensor.to(torch.bfloat16)) != by_hand  # a cast is another tensor
    assert tensor_sha256(tensor.reshape(4)) != by_hand  # so is a reshape


def test_the_request_asks_for_sde_steps_with_their_log_probs_and_the_trajectory():
    body = rollout_request("a red square", n=4, seed=7, settings=RolloutSettings(10, 0.7, 4.5, width=64, height=32))
    assert body == {
        "prompt": "a red square", "seed": 7, "num_inference_steps": 10, "num_outputs_per_prompt": 4, "rollout": True,
        "rollout_sde_type": "sde", "rollout_noise_level": 0.7, "rollout_log_prob_no_const": False,
        "rollout_debug_mode": False, "rollout_return_denoising_env": False, "rollout_return_dit_trajectory": True,
        "suppress_logs": True, "negative_prompt": "", "guidance_scale": 4.5, "width": 64, "height": 32,
    }  # fmt: skip
    qwen = rollout_request("x", n=2, seed=0, settings=RolloutSettings(4, 0.7, 4.0, true_cfg=True))
    assert qwen["true_cfg_scale"] == 4.0 and "guidance_scale" not in qwen and "width" not in qwen
    assert rollout_request("x", n=2, seed=0, settings=RolloutSettings(4, 0.7))["guidance_scale"] == 1.0


def _answer(steps: int = 3, *, sigmas: bool = False) -> tuple[dict, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(steps + 1, 4, 2, 2, generator=generator)
    schedule = torch.linspace(1, 0, steps + 1)
    trajectory = {"latents": encode_tensor(latents), "timesteps": encode_tensor(schedule[:-1] * 1000)}
    if sigmas:
        trajectory["sigmas"] = encode_tensor(schedule)
    image = torch.tensor([[[0.0, 1.0]], [[0.5, 0.25]], [[0.998, 0.002]]])  # [3, 1, 2]
    item = {
        "request_id": "r", "prompt": "p", "seed": 0, "generated_output": encode_tensor(image),
        "rollout_log_probs": encode_tensor(torch.tensor([-1.0, -2.0, -3.0][:steps])), "dit_trajectory": trajectory,
    }  # fmt: skip
    return item, latents, schedule


@pytest.mark.parametrize("sigmas", [False, True], ids=["timesteps", "sigmas"])
def test_an_answer_parses_into_the_latents_schedule_log_probs_and_a_uint8_image(sigmas):
    item, latents, schedule = _answer(sigmas=sigmas)
    parsed = parse_rollout_response(item, num_steps=3)
    assert torch.equal(parsed.latents, latents) and torch.equal(parsed.log_probs, torch.tensor([-1.0, -2.0, -3.0]))
    assert torch.allclose(parsed.sigmas, schedule, atol=1e-7) and parsed.sigmas[-1] == 0
    # [0, 1] floats to 0..255, rounded: 0.5 -> 127.5 -> 128, 0.998 -> 254.49 -> 254, 0.002 -> 0.51 -> 1
    assert parsed.image.dtype == np.uint8 and parsed.image.shape == (1, 2, 3)
    assert parsed.image.tolist() == [[[0, 128, 254], [255, 64, 1]]]


def test_an_answer_missing_a_field_or_of_other_steps_says_which():
    item, _, _ = _answer()
    with pytest.raises(ValueError, match="no dit_trajectory .*rollout_return_dit_trajectory"):
        parse_rollout_response({**item, "dit_trajectory": None}, num_steps=3)
    with pytest.raises(ValueError, match=r"4 steps asked, got log-probs \[3\], sigmas \[4\], latents \[4, 4, 2, 2\]"):
        parse_rollout_response(item, num_steps=4)
    with pytest.raises(ValueError, match=r"^generated_output: expected an RGB image \[3, H, W\]"):
        image_to_uint8(torch.zeros(4, 2, 2))


def test_packed_latents_unpack_to_the_models_shape_and_others_are_refused():
    latents = torch.randn(5, 4, 6, 8)  # [T + 1, C, H, W]
    packed = pack_latents(latents)  # Qwen-Image's [T + 1, H W / 4, 4 C]
    assert packed.shape == (5, 12, 16)
    assert torch.equal(_as_latents(packed, (4, 6, 8)), latents)
    assert _as_latents(latents, (4, 6, 8)) is latents
    with pytest.raises(ValueError, match=r"each step's latent is \[4, 6, 8\], the model's is \[4, 8, 8\]"):
        _as_latents(latents, (4, 8, 8))
