"""Disk handoff: one weight version as safetensors shards in a shared directory, published atomically, with a manifest.

For engines that reload from a directory (SGLang's ``/update_weights_from_disk``, vLLM's reload, ``miles serve``),
and as the path that needs nothing but a filesystem both sides see. Layout of a root::

    <root>/v000007/model.safetensors              one shard, or
    <root>/v000007/model-00001-of-00003.safetensors ... + model.safetensors.index.json (HF's sharded layout)
    <root>/v000007/config.json, generation_config.json   copied from ``config_from`` (an HF model directory)
    <root>/v000007/manifest.json                  version; per shard: file, bytes, xxh3-64; per tensor: name,
                                                  shard, dtype, shape

A version is written into ``<root>/.tmp-v000007-<random>/``, every file fsynced, ``manifest.json`` last, then
renamed to ``v000007`` with ``os.replace`` (atomic within one filesystem, which the temp directory inside the root
guarantees): a reader sees a complete version or none. With ``config_from`` the directory is an HF checkpoint:
``AutoModelForCausalLM.from_pretrained`` and SGLang's loader (which reads ``config.json`` and every
``*.safetensors`` the index names) load it as they load a model; SGLang needs ``config.json`` there.
``read_weights`` verifies every shard's size and checksum against the manifest before it returns any tensor.

Why a writer under a sink and not a ``Transport``: a transport moves *buckets*, byte payloads packed (and maybe
quantized or delta-encoded) for a ``WeightReceiver`` to decode. A disk consumer is an engine's checkpoint loader,
which wants plain HF tensors by name; a ``DiskTransport`` would have to refuse every codec but identity and
delta, decode each bucket on the sender only to re-serialize it, and learn the tensor layout a bucket hides.
``DiskWeightWriter`` takes the ``(name, tensor)`` pairs a sink's ``push`` gets and writes them as they are; the
engine-specific step (POST the path, check the answer) stays in the engine's sink, e.g.
``miles.rollout.engines.sglang.SGLangDiskWeightSink``.

Costs: the tensors go to host memory one shard at a time (at most ``shard_bytes`` plus one tensor), then to disk;
the checksum reads each file back once (page cache); a reader reads each file twice (checksum, load).
Needs ``safetensors`` and ``xxhash`` (``pip install 'miles-sync[disk]'``), imported on first use.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from miles.sync.errors import WeightUpdateError
from miles.sync.versions import find_versions, prune_versions, version_dir
from torch import Tensor

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "miles.sync.disk"
FORMAT_VERSION = 1
HF_INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
"""Copied from ``config_from``: what a loader needs beside the weights (the tokenizer does not change)."""
HASH_CHUNK_BYTES = 16 * 2**20


@functools.cache
def _libs():
    try:
        import safetensors.torch
        import xxhash
    except ImportError as err:
        raise ImportError(
            f"disk weight handoff needs safetensors and xxhash ({err.name} is missing): pip install 'miles-sync[disk]'"
        ) from err
    return safetensors.torch, xxhash


def list_versions(root: str | Path) -> list[int]:
    """The published versions under ``root`` (directories ``v000001`` ... holding a manifest), ascending; [] when
    ``root`` does not exist."""
    return find_versions(root, marker=MANIFEST)


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One safetensors file of a version: ``file`` (name in the version directory), ``nbytes`` (its size) and
    ``xxh3_64`` (the checksum of its bytes, 16 hex digits)."""

    file: str
    nbytes: int
    xxh3_64: str


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor: its ``name``, the ``shard`` file holding it, ``dtype`` (a torch name: "bfloat16") and ``shape``."""

    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Manifest:
    """What ``manifest.json`` holds: the weight ``version``, its ``shards`` and its ``tensors`` in push order."""

    version: int
    shards: tuple[ShardEntry, ...]
    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": self.version,
            "shards": [{"file": s.file, "bytes": s.nbytes, "xxh3_64": s.xxh3_64} for s in self.shards],
            "tensors": [{"name": t.name, "shard": t.shard, "dtype": t.dtype, "shape": list(t.shape)}
                        for t in self.tensors],
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: object, *, where: Path) -> Manifest:
        """Parse a manifest. Raises: WeightUpdateError naming ``where`` and the bad field."""
        try:
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                found = data.get("format") if isinstance(data, dict) else type(data).__name__
                raise ValueError(f"it is not a {FORMAT} manifest (format {found!r})")
            if data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format_version {data.get('format_version')!r}, this reader knows {FORMAT_VERSION}")
            shards = tuple(ShardEntry(str(s["file"]), int(s["bytes"]), str(s["xxh3_64"])) for s in data["shards"])
            tensors = tuple(
                TensorEntry(str(t["name"]), str(t["shard"]), str(t["dtype"]), tuple(int(n) for n in t["shape"]))
                for t in data["tensors"]
            )
            manifest = cls(int(data["version"]), shards, tensors)
        except (KeyError, TypeError, ValueError) as err:
            raise WeightUpdateError(f"{where} is not a valid manifest: {err!r}") from err
        for shard in shards:
            if shard.file != Path(shard.file).name or not shard.file.endswith(".safetensors"):
                raise WeightUpdateError(f"{where}: shard {shard.file!r} is not the name of a .safetensors file")
        files = {s.file for s in shards}
        for t in tensors:
            if t.shard not in files:
                raise WeightUpdateError(f"{where}: tensor {t.name!r} names shard {t.shard!r}, which it does not list")
        return manifest


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of the version directory ``path``.

    Raises: WeightUpdateError if ``path/manifest.json`` is missing, not JSON or not a valid manifest.
    """
    where = Path(path) / MANIFEST
    try:
        data = json.loads(where.read_text())
    except FileNotFoundError:
        raise WeightUpdateError(f"{where} does not exist: {path} is not a version DiskWeightWriter wrote") from None
    except (OSError, ValueError) as err:
        raise WeightUpdateError(f"{where} cannot be read as JSON: {err}") from err
    return Manifest.from_json(data, where=where)


def _digest(path: Path, *, sync: bool = False) -> tuple[int, str]:
    """(size, xxh3-64 hex) of the file at ``path``, read in chunks; ``sync`` also fsyncs it (the writer: a rename
    must not publish data still in the page cache of a machine that then crashes)."""
    digest = _libs()[1].xxh3_64()
    with open(path, "rb") as file:
        while chunk := file.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
        if sync:
            os.fsync(file.fileno())
        return file.tell(), digest.hexdigest()


def _fsync(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: the renames and new files in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shards(named_tensors: Iterable[tuple[str, Tensor]], shard_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive groups of at most ``shard_bytes`` tensor bytes (a larger tensor alone), as contiguous CPU
    tensors; a tensor sharing storage with an earlier one of its group (tied weights) is cloned, since a
    safetensors file holds each tensor's bytes once. Raises: ValueError for a repeated name or a non-tensor."""
    names: set[str] = set()
    group: list[tuple[str, Tensor]] = []
    storages: set[int] = set()
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, Tensor):
            raise ValueError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in names:
            raise ValueError(f"weight {name!r} appears twice in one push; every name must be unique")
        names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > shard_bytes:
            yield group
            group, storages, size = [], set(), 0
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.numel() and tensor.untyped_storage().data_ptr() in storages:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group


class DiskWeightWriter:
    """Writes weight versions under ``root`` as safetensors shards with a manifest, atomically; keeps the newest.

    Args:
        root: the shared directory (created if missing); one writer per root (a new writer removes the temp
            directories a crashed one left). Readers (the engines) must see it at the same path, or the caller
            maps it.
        shard_bytes: most tensor bytes per safetensors file; a larger tensor gets a file of its own. The host
            holds one shard's tensors at a time. 4 GiB: few files, as HF checkpoints (its default is 5 GB).
        keep: how many versions stay: the one just written and the newest ``keep - 1`` before it (2: the engines
            can still read the previous one while the new one is announced). Versions newer than the one just
            written (left by an earlier run this one resumed before) are removed too, with a warning.
        config_from: an HF model directory whose ``config.json`` (and ``generation_config.json``) are copied
            into every version, so the version is a loadable checkpoint (SGLang's ``update_weights_from_disk``
            reads ``config.json``). None writes the weights and manifest only.
        subdir: write a version's files (weights, manifest, configs) into this subdirectory of its directory,
            ``<root>/v000007/<subdir>/``: a diffusers pipeline's layout, where SGLang-Diffusion's
            ``update_weights_from_disk`` reads ``<model_path>/transformer/*.safetensors``. None: the version
            directory itself.

    Raises: ValueError for shard_bytes <= 0, keep < 1, a ``config_from`` without config.json, or a ``subdir`` that
        is not one plain name.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        shard_bytes: int = 4 * 2**30,
        keep: int = 2,
        config_from: str | Path | None = None,
        subdir: str | None = None,
    ) -> None:
        if subdir is not None and (not subdir or Path(subdir).name != subdir or subdir in {".", ".."}):
            raise ValueError(f"subdir is {subdir!r}; it must be one directory name, e.g. 'transformer'")
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes is {shard_bytes}; it must be > 0 (4 * 2**30 is a good default)")
        if keep < 1:
            raise ValueError(f"keep is {keep}; it must be >= 1 (the version just written always stays)")
        if config_from is not None and not (Path(config_from) / "config.json").is_file():
            raise ValueError(f"config_from {config_from} has no config.json; pass the HF model directory or None")
        _libs()
        self.root = Path(root)
        self.shard_bytes = shard_bytes
        self.keep = keep
        self.config_from = Path(config_from) if config_from is not None else None
        self.subdir = subdir
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in [*self.root.glob(".tmp-v*"), *self.root.glob(".old-v*")]:
            logger.warning("removing %s, left by a writer that crashed", stale)
            shutil.rmtree(stale, ignore_errors=True)

    def write(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int) -> Path:
        """Write ``named_tensors`` as version ``version`` and return its directory, ``<root>/v{version:06d}``.

        Args:
            named_tensors: ``(name, tensor)`` pairs in HF names, any dtype, shape and device, written bit-exact
                in their own dtype; read during the call only (one pass: a generator is fine).
            version: the weight version, >= 1. An existing directory of that version (a push that failed after
                writing, retried) is replaced, atomically as well.

        Returns: the published version directory (its files in ``<it>/<subdir>/`` with ``subdir``).
        Raises: ValueError for a version < 1, no tensors, a repeated name or a non-tensor (nothing is published);
            OSError from the filesystem (nothing is published, the temp directory is removed).
        """
        if version < 1:
            raise ValueError(f"version is {version}; weight versions start at 1")
        start = time.perf_counter()
        final = version_dir(self.root, version)
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            files = tmp / self.subdir if self.subdir is not None else tmp
            files.mkdir(exist_ok=True)
            manifest = self._write_files(files, named_tensors, version)
            if files != tmp:
                _fsync(tmp)
            self._publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        marker = f"{self.subdir}/{MANIFEST}" if self.subdir is not None else MANIFEST
        prune_versions(self.root, keep=self.keep, current=version, marker=marker)
        nbytes = sum(s.nbytes for s in manifest.shards)
        logger.debug(  # per step
            "wrote weights v%d to %s in %.2fs (%d tensors, %d shards, %.1f MiB)",
            version, final, time.perf_counter() - start, len(manifest.tensors), len(manifest.shards), nbytes / 2**20,
        )  # fmt: skip
        return final

    def _write_files(self, tmp: Path, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> Manifest:
        save_file = _libs()[0].save_file
        groups: list[list[TensorEntry]] = []
        for index, group in enumerate(_shards(named_tensors, self.shard_bytes)):
            file = f"shard-{index:05d}.safetensors"  # renamed once the count is known
            save_file(dict(group), tmp / file, metadata={"format": "pt", "miles_version": str(version)})
            groups.append([TensorEntry(name, file, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                           for name, t in group])  # fmt: skip
        if not groups:
            raise ValueError("the push has no tensors; pass the model's (name, tensor) pairs")
        shards, tensors = [], []
        for index, entries in enumerate(groups):
            # HF's names: one file is model.safetensors, several are model-0000i-of-0000n plus an index.
            file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
            os.rename(tmp / entries[0].shard, tmp / file)
            nbytes, digest = _digest(tmp / file, sync=True)
            shards.append(ShardEntry(file, nbytes, digest))
            tensors += [TensorEntry(t.name, file, t.dtype, t.shape) for t in entries]
        extra = []
        if len(shards) > 1:
            total = sum(torch.Size(t.shape).numel() * getattr(torch, t.dtype).itemsize for t in tensors)
            hf_index = {"metadata": {"total_size": total}, "weight_map": {t.name: t.shard for t in tensors}}
            (tmp / HF_INDEX).write_text(json.dumps(hf_index, indent=1))
            extra.append(tmp / HF_INDEX)
        if self.config_from is not None:
            for name in CONFIG_FILES:
                if (self.config_from / name).is_file():
                    extra.append(Path(shutil.copyfile(self.config_from / name, tmp / name)))
        for path in extra:
            _fsync(path)
        manifest = Manifest(version, tuple(shards), tuple(tensors))
        with open(tmp / MANIFEST, "w") as file:  # last: a directory with a manifest has every file it lists
            json.dump(manifest.to_json(), file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        _fsync(tmp)
        return manifest

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rename ``tmp`` to ``final``. An existing ``final`` is first renamed aside (a rename cannot replace a
        non-empty directory): readers see the old version, then for an instant none, then the new, never a mix;
        if the second rename fails, the old version is put back."""
        old = None
        if final.exists():
            old = self.root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            if old is not None:
                os.replace(old, final)
            raise
        _fsync(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def read_weights(path: str | Path) -> dict[str, Tensor]:
    """The tensors of a version directory ``DiskWeightWriter`` wrote, after checking every shard against the manifest.

    Args:
        path: a version directory (``<root>/v000007``).
    Returns: name -> CPU tensor in the manifest's order, bit-identical to what was written, dtype and shape as
        written.
    Raises: WeightUpdateError naming the file: no or invalid manifest; a shard missing, of the wrong size, or
        whose xxh3-64 differs from the manifest's (corrupt or changed after writing); a shard whose tensors do
        not match the manifest's names, dtypes or shapes. Nothing is returned unless every check passed.
    """
    path = Path(path)
    manifest = read_manifest(path)
    for shard in manifest.shards:
        file = path / shard.file
        if not file.is_file():
            raise WeightUpdateError(f"shard {shard.file} of weight version v{manifest.version} is missing from {path}")
        nbytes, digest = _digest(file)
        if nbytes != shard.nbytes:
            raise WeightUpdateError(
                f"shard {file} has {nbytes} bytes, its manifest says {shard.nbytes}: truncated or changed after writing"
            )
        if digest != shard.xxh3_64:
            raise WeightUpdateError(
                f"shard {file} fails its checksum (xxh3-64 {digest}, manifest {shard.xxh3_64}): the file is corrupt "
                "or was changed after writing"
            )
    load_file = _libs()[0].load_file
    loaded: dict[str, Tensor] = {}
    for shard in manifest.shards:
        loaded.update(load_file(path / shard.file))
    out: dict[str, Tensor] = {}
    for entry in manifest.tensors:
        tensor = loaded.pop(entry.name, None)
        if tensor is None:
            raise WeightUpdateError(f"shard {path / entry.shard} lacks tensor {entry.name!r}, which the manifest lists")
        if str(tensor.dtype).removeprefix("torch.") != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise WeightUpdateError(
                f"tensor {entry.name!r} in {path / entry.shard} is {tensor.dtype} {list(tensor.shape)}, "
                f"the manifest says {entry.dtype} {list(entry.shape)}"
            )
        out[entry.name] = tensor
    if loaded:
        raise WeightUpdateError(f"the shards in {path} hold tensors the manifest does not list: {sorted(loaded)[:5]}")
    return out


def read_hf_weights(path: str | Path) -> dict[str, Tensor]:
    """The tensors of a plain HF checkpoint directory: every ``*.safetensors`` file (only those its
    ``model.safetensors.index.json`` names, when it has one), unchecked (it has no checksums).

    Returns: name -> CPU tensor. Raises: WeightUpdateError if ``path`` has no safetensors files, or one cannot be
        read (the message names it).
    """
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if (path / HF_INDEX).is_file():
        try:
            named = set(json.loads((path / HF_INDEX).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise WeightUpdateError(f"{path / HF_INDEX} cannot be read: {err!r}") from err
        files = [file for file in files if file.name in named]
    if not files:
        raise WeightUpdateError(f"{path} has no *.safetensors files: not a safetensors HF checkpoint directory")
    load_file = _libs()[0].load_file
    out: dict[str, Tensor] = {}
    for file in files:
        try:
            out.update(load_file(file))
        except Exception as err:  # safetensors raises its own SafetensorError (and OSError)
            raise WeightUpdateError(f"{file} cannot be read as safetensors: {err}") from err
    return out


__all__ = [
    "MANIFEST",
    "DiskWeightWriter",
    "Manifest",
    "ShardEntry",
    "TensorEntry",
    "list_versions",
    "read_hf_weights",
    "read_manifest",
    "read_weights",
    "version_dir",
]
