"""Codec round trips against straightforward per-block reference implementations written here, plus error bounds."""

import math

import pytest
import torch
from miles.sync import InProcessTransport, WeightReceiver, WeightSender
from miles.sync.codecs import CODECS, fp8, int4, mxfp8, nvfp4
from miles.sync.codecs.blocks import pack_nibbles, unpack_nibbles


def _sample(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights with a spread of magnitudes: normal values scaled per row by 1e-3 .. 1e2."""
    generator = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-3, 2, rows)[:, None]
    return torch.randn(rows, cols, generator=generator) * row_scale


def _round_trip(codec: str, tensor: torch.Tensor) -> torch.Tensor:
    parts = CODECS[codec].encode(tensor)
    return CODECS[codec].decode(parts, shape=tuple(tensor.shape), dtype=tensor.dtype)


# ---------------------------------------------------------------- references (loops over blocks, scalar math)


def _reference_fp8(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], block):
        for j in range(0, x.shape[1], block):
            tile = x[i : i + block, j : j + block]
            amax = tile.abs().max()
            scale = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            quantized = (tile / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[i : i + block, j : j + block] = quantized.float() * scale
    return out


def _reference_mxfp8(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        for j in range(0, x.shape[1], 32):
            block = x[i, j : j + 32]
            amax = float(block.abs().max())
            exponent = 0
            if amax > 0:  # the smallest e with amax <= 448 * 2**e
                exponent = math.ceil(math.log2(amax / 448.0))
                while 448.0 * 2.0 ** (exponent - 1) >= amax:
                    exponent -= 1
                while 448.0 * 2.0**exponent < amax:
                    exponent += 1
            quantized = (block / 2.0**exponent).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[i, j : j + 32] = quantized.float() * 2.0**exponent
    return out


def _nearest_e2m1(value: float) -> float:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    magnitude = min(abs(value), 6.0)
    distances = [abs(magnitude - g) for g in grid]
    best = min(distances)
    index = [k for k, d in enumerate(distances) if d == best]
    chosen = index[0] if len(index) == 1 else next(k for k in index if k % 2 == 0)  # tie: even code
    return math.copysign(grid[chosen], value)


def _reference_nvfp4(x: torch.Tensor) -> torch.Tensor:
    tensor_amax = x.abs().max()
    tensor_scale = tensor_amax / (448.0 * 6.0) if tensor_amax > 0 else torch.tensor(1.0)
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        for j in range(0, x.shape[1], 16):
            block = x[i, j : j + 16]
            block_scale = (block.abs().max() / 6.0 / tensor_scale).clamp(max=448).to(torch.float8_e4m3fn).float()
            scale = block_scale * tensor_scale
            for k in range(block.numel()):
                q = _nearest_e2m1(float(block[k] / scale)) if scale > 0 else 0.0
                out[i, j + k] = torch.tensor(q) * scale
    return out


def _reference_int4(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        for j in range(0, x.shape[1], group):
            chunk = x[i, j : j + group]
            amax = chunk.abs().max()
            scale = amax / 7.0 if amax > 0 else torch.tensor(1.0)
            out[i, j : j + group] = torch.round(chunk / scale).clamp(-7, 7) * scale
    return out


@pytest.mark.parametrize(
    "codec, reference, shape",
    [
        pytest.param("fp8", _reference_fp8, (200, 300), id="fp8_ragged_tiles"),
        pytest.param("mxfp8", _reference_mxfp8, (6, 100), id="mxfp8_ragged_blocks"),
        pytest.param("nvfp4", _reference_nvfp4, (5, 40), id="nvfp4_ragged_blocks"),
        pytest.param("int4", _reference_int4, (6, 300), id="int4_ragged_groups"),
    ],
)
def test_codec_round_trip_equals_the_reference_implementation(codec, reference, shape):
    x = _sample(*shape)
    torch.testing.assert_close(_round_trip(codec, x), reference(x), atol=0, rtol=0)


def _error_bound(codec: str, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound from each codec's module docstring, computed from the encoded scales."""
    if codec == "fp8":
        _, scales = fp8.encode(x)
        scale = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[: x.shape[0], : x.shape[1]]
        return torch.maximum(2**-4 * x.abs(), 2**-10 * scale)
    if codec == "mxfp8":
        _, scales = mxfp8.encode(x)
        scale = torch.exp2(scales.float() - 127).repeat_interleave(32, 1)[:, : x.shape[1]]
        return torch.maximum(2**-4 * x.abs(), 2**-10 * scale)
    if codec == "nvfp4":
        _, block_scales, tensor_scale = nvfp4.encode(x)
        scale = (block_scales.float() * tensor_scale).repeat_interleave(16, 1)[:, : x.shape[1]]
        block_amax = torch.nn.functional.pad(x.abs(), (0, -x.shape[1] % 16)).view(x.shape[0], -1, 16).amax(-1)
        block_amax = block_amax.repeat_interleave(16, 1)[:, : x.shape[1]]
        bound = torch.maximum(x.abs() / 4, scale / 4) + block_amax / 15
        # Documented exception: a block whose E4M3 scale is subnormal (< 2**-6) loses relative precision.
        normal_scale = (block_scales.float() >= 2**-6).repeat_interleave(16, 1)[:, : x.shape[1]]
        assert normal_scale.float().mean() > 0.8  # the sample spans 1e-3 .. 1e2
        return torch.where(normal_scale, bound, torch.inf)
    if codec == "int4":
        _, scales = int4.encode(x)
        return scales.repeat_interleave(128, 1)[:, : x.shape[1]] / 2
    raise AssertionError(codec)


@pytest.mark.parametrize("codec", ["fp8", "mxfp8", "nvfp4", "int4"])
def test_codec_error_stays_within_its_documented_bound(codec):
    x = _sample(64, 200, seed=1)
    error = (_round_trip(codec, x) - x).abs()
    assert (error <= _error_bound(codec, x) * (1 + 1e-6)).all()


@pytest.mark.parametrize(
    "codec, max_relative_rms_error",
    [("bf16", 2**-8), ("fp16", 2**-11), ("fp8", 0.05), ("mxfp8", 0.05), ("nvfp4", 0.2), ("int4", 0.2)],
)
def test_codec_rms_error_on_gaussian_weights_is_small(codec, max_relative_rms_error):
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(2))
    error = _round_trip(codec, x) - x
    assert error.pow(2).mean().sqrt() / x.pow(2).mean().sqrt() < max_relative_rms_error


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 33)], ids=["scalar", "vector", "matrix", "three_dims"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_codec_restores_shape_and_dtype(codec, shape, dtype):
    x = torch.randn(shape).to(dtype)
    y = _round_trip(codec, x)
    assert y.shape == x.shape and y.dtype == dtype


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_codec_keeps_zeros_exact(codec):
    x = torch.zeros(4, 64)
    x[1, 3] = 1.0
    assert torch.equal(_round_trip(codec, x), x)


@pytest.mark.parametrize(
    "scaled_value, expected",
    [
        pytest.param(0.25, 0.0, id="tie_0.25_to_even_code_0"),
        pytest.param(0.75, 1.0, id="tie_0.75_to_even_code_2"),
        pytest.param(1.25, 1.0, id="tie_1.25_to_even_code_2"),
        pytest.param(2.5, 2.0, id="tie_2.5_to_even_code_4"),
        pytest.param(5.0, 4.0, id="tie_5_to_even_code_6"),
        pytest.param(5.1, 6.0, id="above_tie_rounds_up"),
        pytest.param(-1.6, -1.5, id="negative_nearest"),
        pytest.param(100.0, 6.0, id="saturates_at_6"),
    ],
)
def test_e2m1_rounds_to_nearest_with_ties_to_even(scaled_value, expected):
    codes = nvfp4.e2m1_codes(torch.tensor([scaled_value]))
    assert nvfp4.e2m1_values(codes).item() == expected


def test_nibbles_pack_the_even_element_into_the_low_bits():
    codes = torch.tensor([[0x1, 0xA, 0xF, 0x0]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0xA1, 0x0F]]
    assert torch.equal(unpack_nibbles(packed), codes)


def test_int4_codes_a_hand_computed_group():
    # amax 7 -> scale 1; q = round(x) with ties to even: 2.5 -> 2, -0.5 -> -0; codes q + 8.
    x = torch.tensor([[7.0, 2.5, -0.5, -7.0]])
    data, scales = int4.encode(x, group=4)
    assert scales.tolist() == [[1.0]]
    assert unpack_nibbles(data).tolist() == [[15, 10, 8, 1]]


def test_mxfp8_scale_is_the_power_of_two_that_fits_the_block_maximum():
    # amax 1.0: the smallest e with 448 * 2**e >= 1 is e = -8 (448 / 256 = 1.75 >= 1, 448 / 512 < 1).
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    _, scales = mxfp8.encode(x)
    assert scales.tolist() == [[127 - 8]]


@pytest.mark.parametrize(
    "codec, bytes_per_element",
    [("fp8", 1 + 4 / 128**2), ("mxfp8", 1 + 1 / 32), ("nvfp4", 0.5 + 1 / 16), ("int4", 0.5 + 4 / 128)],
)
def test_codec_payload_size_matches_its_layout(codec, bytes_per_element):
    x = torch.randn(256, 256)
    parts = CODECS[codec].encode(x)
    nbytes = sum(part.numel() * part.element_size() for part in parts)
    assert nbytes == pytest.approx(x.numel() * bytes_per_element, abs=8)


def test_sender_quantizes_matrices_but_keeps_excluded_names_and_integers_exact():
    received = {}

    def load(named_tensors):
        received.update({name: tensor.clone() for name, tensor in named_tensors})

    state = {
        "layers.0.mlp.up_proj.weight": torch.randn(64, 64),
        "layers.0.input_layernorm.weight": torch.randn(64),
        "embed_tokens.weight": torch.randn(10, 64),
        "position_ids": torch.arange(5),
    }
    receiver = WeightReceiver(apply_fn=load)
    WeightSender(InProcessTransport(receiver), codec="fp8").push(state.items())

    up_proj = state["layers.0.mlp.up_proj.weight"]
    assert not torch.equal(received["layers.0.mlp.up_proj.weight"], up_proj)
    torch.testing.assert_close(
        received["layers.0.mlp.up_proj.weight"], up_proj, atol=0.07 * up_proj.abs().max(), rtol=0
    )
    for name in ("layers.0.input_layernorm.weight", "embed_tokens.weight", "position_ids"):
        assert torch.equal(received[name], state[name]), name


def test_default_exclusion_keeps_every_moe_router_tensor_exact():
    """HF MoE routers (``mlp.gate``): the weight and DeepSeek-V3's score-correction bias (regression: the bias, a
    float [experts] tensor, matched no pattern and travelled int4 / fp8) stay exact; the experts do not."""
    from miles.sync import DEFAULT_CODEC_EXCLUDE, uses_codec

    bias = torch.randn(8)
    for codec in ("int4", "fp8"):
        assert not uses_codec("model.layers.1.mlp.gate.e_score_correction_bias", bias, codec, DEFAULT_CODEC_EXCLUDE)
        assert not uses_codec("model.layers.1.mlp.gate.weight", torch.randn(8, 32), codec, DEFAULT_CODEC_EXCLUDE)
        experts = torch.randn(8, 64, 32)
        assert uses_codec("model.layers.1.mlp.experts.gate_up_proj", experts, codec, DEFAULT_CODEC_EXCLUDE)
        assert uses_codec("model.layers.1.mlp.gate_proj.weight", torch.randn(64, 32), codec, DEFAULT_CODEC_EXCLUDE)
