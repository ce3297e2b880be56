"""Disk handoff (``miles.sync.disk``): a version is published whole or not at all, read back bit-identical, every
shard checked against the manifest, the newest ``keep`` versions kept, and the directory loads as an HF model."""

import json
import os

import pytest
import torch
from miles.sync import DiskWeightWriter, WeightUpdateError, list_versions, read_hf_weights, read_manifest, read_weights


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layers.0.q_proj.weight": torch.randn(64, 32, generator=generator),
        "layers.0.k_proj.weight": torch.randn(16, 32, generator=generator).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(32, generator=generator).to(torch.float16),
        "positions": torch.randint(-(2**40), 2**40, (7,), generator=generator),  # int64 beyond fp32's exact range
        "codes": torch.randint(-128, 128, (3, 5), generator=generator, dtype=torch.int8),
        "mask": torch.rand(4, generator=generator) > 0.5,
        "scale": torch.tensor(0.125),  # 0-dim
        "empty": torch.empty(0, 8),
    }


def _assert_bit_identical(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("shard_bytes", [pytest.param(2**30, id="one_shard"), pytest.param(1024, id="many_shards")])
def test_a_written_version_reads_back_bit_identical_for_float_int_and_bool_tensors(tmp_path, shard_bytes):
    weights = _weights()
    path = DiskWeightWriter(tmp_path, shard_bytes=shard_bytes).write(weights.items(), version=3)
    assert path == tmp_path / "v000003" and list_versions(tmp_path) == [3]
    _assert_bit_identical(read_weights(path), weights)
    manifest = read_manifest(path)
    assert manifest.version == 3
    assert [(t.name, t.dtype, t.shape) for t in manifest.tensors] == [
        (name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in weights.items()
    ]
    assert all(s.nbytes == (path / s.file).stat().st_size and len(s.xxh3_64) == 16 for s in manifest.shards)


def test_shards_are_bounded_and_named_as_an_hf_sharded_checkpoint_with_its_index(tmp_path):
    # 64x32 fp32 = 8192 bytes, larger than shard_bytes: alone in shard 1; the 7 small tensors (1024 + 64 + 56 + 15
    # + 4 + 4 + 0 = 1167 bytes) fill shard 2 up to 1200 bytes, so 2 files.
    path = DiskWeightWriter(tmp_path, shard_bytes=1200).write(_weights().items(), version=1)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["layers.0.q_proj.weight"] == "model-00001-of-00002.safetensors"
    assert set(index["weight_map"].values()) == set(files) and index["metadata"]["total_size"] == 8192 + 1167
    _assert_bit_identical(dict(sorted(read_hf_weights(path).items())), dict(sorted(_weights().items())))


def test_tied_and_non_contiguous_tensors_are_written_by_value(tmp_path):
    embed = torch.randn(8, 4)
    transposed = torch.randn(4, 6).t()
    named = [("embed.weight", embed), ("lm_head.weight", embed), ("proj.weight", transposed)]
    path = DiskWeightWriter(tmp_path).write(named, version=1)
    got = read_weights(path)
    assert torch.equal(got["embed.weight"], embed) and torch.equal(got["lm_head.weight"], embed)
    assert torch.equal(got["proj.weight"], transposed)


def test_a_writer_that_fails_mid_version_publishes_nothing_and_keeps_the_previous_version(tmp_path):
    writer = DiskWeightWriter(tmp_path, shard_bytes=1024)
    writer.write(_weights(0).items(), version=1)

    def dies_after_two_tensors():
        for i, item in enumerate(_weights(1).items()):
            if i == 2:
                raise RuntimeError("trainer killed")
            yield item

    with pytest.raises(RuntimeError, match="trainer killed"):
        writer.write(dies_after_two_tensors(), version=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001"]  # no v000002, no temp directory
    _assert_bit_identical(read_weights(tmp_path / "v000001"), _weights(0))


def test_a_crash_before_the_rename_leaves_no_visible_version_and_the_next_writer_cleans_up(tmp_path, monkeypatch):
    writer = DiskWeightWriter(tmp_path)
    real_replace = os.replace

    def crash(src, dst):
        raise OSError("power lost before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power lost"):
        writer.write(_weights().items(), version=1)
    monkeypatch.setattr(os, "replace", real_replace)
    assert list_versions(tmp_path) == [] and list(tmp_path.iterdir()) == []
    # A killed process leaves its temp directory behind: invisible to readers, removed by the next writer.
    (tmp_path / ".tmp-v000001-deadbeef").mkdir()
    assert list_versions(tmp_path) == []
    DiskWeightWriter(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_rewriting_a_version_replaces_it_whole(tmp_path):
    writer = DiskWeightWriter(tmp_path, shard_bytes=1024)
    writer.write(_weights(0).items(), version=1)
    writer.write(_weights(1).items(), version=1)  # a retried push after the engines failed to load it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001"]
    _assert_bit_identical(read_weights(tmp_path / "v000001"), _weights(1))


def test_a_rewrite_whose_rename_fails_puts_the_old_version_back(tmp_path, monkeypatch):
    writer = DiskWeightWriter(tmp_path)
    writer.write(_weights(0).items(), version=1)
    real_replace, calls = os.replace, []

    def second_fails(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # 1: the old version aside, 2: the new one into place
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(OSError, match="disk full"):
        writer.write(_weights(1).items(), version=1)
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001"]
    _assert_bit_identical(read_weights(tmp_path / "v000001"), _weights(0))


def test_keep_leaves_the_newest_versions_and_removes_newer_ones_an_earlier_run_left(tmp_path):
    writer = DiskWeightWriter(tmp_path, keep=2)
    for version in (1, 2, 3, 4):
        writer.write(_weights(version).items(), version=version)
    assert list_versions(tmp_path) == [3, 4]
    writer.write(_weights(9).items(), version=3)  # a run resumed from version 2 rewrites 3: 4 is from the old run
    assert list_versions(tmp_path) == [3]
    DiskWeightWriter(tmp_path, keep=1).write(_weights(5).items(), version=5)
    assert list_versions(tmp_path) == [5]


def test_a_flipped_byte_in_a_shard_fails_the_checksum_naming_the_file(tmp_path):
    path = DiskWeightWriter(tmp_path, shard_bytes=1200).write(_weights().items(), version=1)
    shard = path / "model-00002-of-00002.safetensors"
    _flip_byte(shard, shard.stat().st_size - 1)  # the last tensor byte: the header still parses
    with pytest.raises(WeightUpdateError) as err:
        read_weights(path)
    assert f"shard {shard} fails its checksum" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "damage, message",
    [
        pytest.param(
            lambda p: (p / "model.safetensors").unlink(),
            "shard model.safetensors of weight version v1 is missing from",
            id="missing_shard",
        ),
        pytest.param(
            lambda p: os.truncate(p / "model.safetensors", 100),
            "has 100 bytes, its manifest says",
            id="truncated_shard",
        ),
        pytest.param(lambda p: (p / "manifest.json").unlink(), "manifest.json does not exist", id="no_manifest"),
        pytest.param(
            lambda p: (p / "manifest.json").write_text('{"format": "miles.sync.disk", "version"'),
            "manifest.json cannot be read as JSON",
            id="manifest_not_json",
        ),
        pytest.param(
            lambda p: (p / "manifest.json").write_text(
                (p / "manifest.json").read_text().replace('"model.safetensors"', '"../../etc/passwd.safetensors"', 1)
            ),
            "is not the name of a .safetensors file",
            id="shard_path_escapes",
        ),
    ],
)
def test_a_damaged_version_is_refused_in_one_line_naming_what_is_wrong(tmp_path, damage, message):
    path = DiskWeightWriter(tmp_path).write(_weights().items(), version=1)
    damage(path)
    with pytest.raises(WeightUpdateError) as err:
        read_weights(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="shard_bytes is 0; it must be > 0"):
        DiskWeightWriter(tmp_path, shard_bytes=0)
    with pytest.raises(ValueError, match="keep is 0; it must be >= 1"):
        DiskWeightWriter(tmp_path, keep=0)
    with pytest.raises(ValueError, match="has no config.json"):
        DiskWeightWriter(tmp_path, config_from=tmp_path)
    writer = DiskWeightWriter(tmp_path)
    with pytest.raises(ValueError, match="version is 0; weight versions start at 1"):
        writer.write(_weights().items(), version=0)
    with pytest.raises(ValueError, match="the push has no tensors"):
        writer.write([], version=1)
    with pytest.raises(ValueError, match="'a' appears twice"):
        writer.write([("a", torch.ones(1)), ("a", torch.ones(1))], version=1)
    assert list(tmp_path.iterdir()) == []


def test_a_version_written_with_config_from_loads_as_an_hf_model(tmp_path, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    state = model.state_dict()
    path = DiskWeightWriter(tmp_path, shard_bytes=20_000, config_from=tiny_llama_dir).write(state.items(), version=2)
    assert (path / "config.json").read_text() == (tiny_llama_dir / "config.json").read_text()
    assert len(read_manifest(path).shards) > 1
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


def test_a_subdir_writes_each_version_in_a_pipelines_layout_and_keeps_the_newest(tmp_path):
    # SGLang-Diffusion reads <model_path>/transformer/*.safetensors: the version directory is the model_path.
    writer = DiskWeightWriter(tmp_path, keep=2, subdir="transformer")
    for version in (1, 2, 3):
        path = writer.write(_weights(version).items(), version=version)
        assert path == tmp_path / f"v{version:06d}"
        assert sorted(p.name for p in path.iterdir()) == ["transformer"]
        assert sorted(p.name for p in (path / "transformer").iterdir()) == ["manifest.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003"]  # keep=2 counts subdir manifests
    _assert_bit_identical(read_weights(tmp_path / "v000003" / "transformer"), _weights(3))
    for bad in ("", "a/b", "..", "."):
        with pytest.raises(ValueError, match="subdir is"):
            DiskWeightWriter(tmp_path, subdir=bad)
