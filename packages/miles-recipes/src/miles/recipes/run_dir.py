"""The run directory ``runs/<name>/`` before a run writes into it: one writer at a time (``RunDirLock``), room to
write (``check_room``: writable, free space for one checkpoint), and whether it holds a run worth keeping
(``completed_steps``).

The lock is ``fcntl.flock`` on ``runs/<name>/.lock``, held by the ``miles train`` process for the whole run: the OS
drops it when the process ends however it ends (``kill -9`` included), so a lock file left by a dead process is
simply taken over. The file holds the holder's pid and host for the refusal message; it is not created by (and
never passed to) the processes a run starts: it is opened close-on-exec, and reward workers fork from a separate
fork server.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
# Bytes one trained parameter takes in a checkpoint: fp32 weights (model.safetensors, also under train.dtype bf16,
# whose master weights are fp32) + AdamW's two fp32 moments (optimizer.pt). SmolLM2-135M: 135M x 12 = ~1.6 GB.
CHECKPOINT_BYTES_PER_PARAM = 12
# A LoRA policy's checkpoint: the merged fp32 model (model/, 4 bytes per parameter) + the adapters and their AdamW
# state (adapter/, optimizer.pt: 3 x 4 bytes per adapter parameter, ~1% of the model at rank 16 on a 4096-wide
# model); 5 leaves room for adapters up to ~8% of the model.
LORA_CHECKPOINT_BYTES_PER_PARAM = 5
# Without safetensors headers to count parameters in: a checkpoint is at least this many times the model files.
CHECKPOINT_FILE_FACTOR = 3


class RunDirError(Exception):
    """The run directory cannot be used: another live process writes it, it cannot be written, or its disk is
    too full for a checkpoint. One line naming the path and the fix."""


class RunDirLock:
    """An exclusive ``flock`` on ``run_dir/.lock``, held until ``release()``.

    ``acquire`` creates the run directory (and its missing parents) to hold the lock file; ``release`` removes the
    lock file and, of the directories it created, those still empty (a run refused at build leaves no trace).
    """

    def __init__(self, run_dir: Path, fd: int, created: list[Path]) -> None:
        self.run_dir, self._fd, self._created = run_dir, fd, created

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_FILE

    @classmethod
    def acquire(cls, run_dir: Path, *, busy_hint: str = "pick another --run.name, or wait for it to end") -> RunDirLock:
        """Lock ``run_dir`` for this process, or refuse.

        Args:
            run_dir: the run directory; created with its parents if missing.
            busy_hint: the fix the refusal names (what to do instead of a second writer).
        Raises: RunDirError (nothing created) when another live process holds the lock (naming its pid) or the
            directory cannot be created or written.
        """
        run_dir = Path(run_dir)
        created = _make_dirs(run_dir)
        try:
            fd = _lock_file(run_dir / LOCK_FILE, run_dir=run_dir, busy_hint=busy_hint)
        except BaseException:
            _remove_empty(created)
            raise
        lock = cls(run_dir, fd, created)
        try:
            previous = os.read(fd, 200).decode(errors="replace").split()
            if previous:  # the OS released its lock: that process ended without removing the file
                logger.warning(
                    "%s: taking over the lock file of process %s, which is no longer running (it did not end cleanly)",
                    run_dir,
                    _holder(previous),
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            check_writable(run_dir)
        except BaseException:
            lock.release()
            raise
        return lock

    def release(self) -> None:
        """Remove the lock file (while still holding the lock, so no other process can hold a lock on a file that
        is gone), unlock, and remove the directories ``acquire`` created that are empty now."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = -1
        _remove_empty(self._created)

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock_file(path: Path, *, run_dir: Path, busy_hint: str) -> int:
    """Open and flock ``path``; retried when the file was replaced meanwhile (a holder removes it on release: the
    lock must be on the file the path names now, or two processes could each hold a lock on a different file)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError as err:  # a holder that created it removed the empty directory on release: again
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError:
                raise RunDirError(_unwritable(run_dir, err)) from err
            continue
        except OSError as err:
            raise RunDirError(_unwritable(run_dir, err)) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirError(
                f"run directory {run_dir} is in use by the live run of process {holder}, and a second writer would "
                f"corrupt it (nothing of it was touched); {busy_hint}"
            ) from None
        except OSError as err:
            os.close(fd)
            raise RunDirError(_unwritable(run_dir, err)) from err
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _read_holder(fd: int) -> str:
    """``pid`` (``pid on host`` for another host) from a held lock file; the holder writes it right after locking,
    so an empty file is read again for up to a second."""
    for _ in range(20):
        fields = os.pread(fd, 200, 0).decode(errors="replace").split()
        if fields:
            return _holder(fields)
        time.sleep(0.05)
    return "(pid not written yet)"


def _holder(fields: list[str]) -> str:
    pid, host = fields[0], fields[1] if len(fields) > 1 else ""
    return pid if host in ("", socket.gethostname()) else f"{pid} on host {host}"


def _make_dirs(run_dir: Path) -> list[Path]:
    """Create ``run_dir`` and its missing parents; returns the directories created, deepest first.

    Raises: RunDirError naming the directory that cannot be created and why.
    """
    missing = []
    path = run_dir.absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    created: list[Path] = []
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:  # made meanwhile by another start of the same run: the lock decides
            if not path.is_dir():
                _remove_empty(created[::-1])
                raise RunDirError(_unwritable(run_dir, OSError(errno.ENOTDIR, f"{path} is not a directory"))) from None
            continue
        except OSError as err:
            _remove_empty(created[::-1])
            raise RunDirError(_unwritable(run_dir, err)) from err
        created.append(path)
    return created[::-1]


def _remove_empty(directories: list[Path]) -> None:
    for path in directories:
        with contextlib.suppress(OSError):  # not empty (the run wrote there), or gone
            path.rmdir()


def _unwritable(run_dir: Path, err: OSError) -> str:
    reason = err.strerror or str(err)
    if err.filename:
        reason += f": {err.filename}"
    return (
        f"run directory {run_dir} cannot be written ({reason}); pass --run.dir a writable directory (run.dir is "
        f"{run_dir.parent}), or make it writable"
    )


def check_writable(run_dir: Path) -> None:
    """Refuse a run directory (or, while it does not exist, its nearest existing parent) that this process cannot
    write: the directory itself, its ``checkpoints/``, and the files a run appends to.

    Raises: RunDirError naming the path and the fix.
    """
    run_dir = Path(run_dir)
    existing = _existing_ancestor(run_dir)
    paths = [existing]
    if existing == run_dir:
        paths += [p for p in (run_dir / "checkpoints",) if p.is_dir()]
        paths += [p for p in (run_dir / "metrics.jsonl", run_dir / "train.log") if p.is_file()]
    for path in paths:
        mode = os.W_OK | os.X_OK if path.is_dir() else os.W_OK
        if not os.access(path, mode):
            raise RunDirError(_unwritable(run_dir, OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))))
        if path.is_dir():  # os.access says yes to root on an immutable (chattr +i) or read-only-mounted directory
            try:
                fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
                os.close(fd)
                os.unlink(probe)
            except OSError as err:
                raise RunDirError(_unwritable(run_dir, err)) from None


def check_room(run_dir: Path, *, checkpoint_bytes: int, how: str, keep_checkpoints: int) -> None:
    """Refuse a run whose directory cannot be written or whose disk has less free space than one checkpoint;
    warn when it cannot hold the checkpoints ``loop.keep_checkpoints`` keeps plus the one being written.

    Args:
        run_dir: the run directory (or where it will be).
        checkpoint_bytes: the estimated size of one checkpoint (``checkpoint_size``).
        how: how it was estimated, for the message.
        keep_checkpoints: ``loop.keep_checkpoints`` (0 keeps all).
    Raises: RunDirError naming the sizes and the fix.
    """
    check_writable(run_dir)
    free = shutil.disk_usage(_existing_ancestor(Path(run_dir))).free
    if free < checkpoint_bytes:
        raise RunDirError(
            f"run directory {run_dir}: its disk has {_size(free)} free, but one checkpoint needs about "
            f"{_size(checkpoint_bytes)} ({how}); free some space, or pass --run.dir a directory on a larger disk"
        )
    if keep_checkpoints and free < (keep_checkpoints + 1) * checkpoint_bytes:
        logger.warning(
            "run directory %s: its disk has %s free, room for %d checkpoints of about %s, but "
            "loop.keep_checkpoints %d needs %d while one is written (lower --loop.keep-checkpoints, or free space)",
            run_dir,
            _size(free),
            free // checkpoint_bytes,
            _size(checkpoint_bytes),
            keep_checkpoints,
            keep_checkpoints + 1,
        )


def checkpoint_size(*, resume_from: Path | None, model_dirs: list[Path], lora: bool = False) -> tuple[int, str]:
    """The size of one checkpoint, estimated without loading a model: a resumed run's checkpoint's own size, else
    ``CHECKPOINT_BYTES_PER_PARAM`` per trained parameter (counted in the safetensors headers of ``model_dirs``:
    the policy, and the critic when one is trained; ``LORA_CHECKPOINT_BYTES_PER_PARAM`` for a policy with ``lora``
    adapters, the first of ``model_dirs``), else ``CHECKPOINT_FILE_FACTOR`` x the model files' size.

    Returns: (bytes, how it was estimated, for a message).
    """
    if resume_from is not None:
        return _tree_size(Path(resume_from)), f"the size of {Path(resume_from).name}"
    total, files_only = 0, False
    for i, model_dir in enumerate(model_dirs):
        per_param = LORA_CHECKPOINT_BYTES_PER_PARAM if lora and i == 0 else CHECKPOINT_BYTES_PER_PARAM
        params = _num_params(model_dir)
        if params is None:
            files_only = True
            total += CHECKPOINT_FILE_FACTOR * sum(
                p.stat().st_size for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")
            )
        else:
            total += per_param * params
    if files_only:
        return total, f"{CHECKPOINT_FILE_FACTOR} x the model files"
    if lora:
        return total, (
            f"{LORA_CHECKPOINT_BYTES_PER_PARAM} bytes per parameter: the merged fp32 model, adapters and their AdamW "
            "state"
        )
    return total, f"{CHECKPOINT_BYTES_PER_PARAM} bytes per parameter: fp32 weights and AdamW state"


def completed_steps(run_dir: Path) -> int:
    """The last training step ``metrics.jsonl`` records (0: none; rows of step 0 are the eval before training)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    last = 0
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):  # a line cut by a crash
            last = max(last, int(json.loads(line)["step"]))
    return last


def _num_params(model_dir: Path) -> int | None:
    """Parameters stored in a model directory's ``*.safetensors`` files (read from their headers), or None when it
    has none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                numel = 1
                for dim in entry["shape"]:
                    numel *= dim
                total += numel
    return total


def _tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"
