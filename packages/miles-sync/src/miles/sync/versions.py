"""Weight versions: the number a push gets, and the version directories kept on disk.

Weight sinks and senders number their pushes 1, 2, ... (0 before the first) and refuse a version that is not
newer than the last committed one (``next_version``; ``VLLMWeightSink`` through its ``WeightSender``). Sinks that
hand weights over as files publish version ``v`` as the directory ``<root>/v{v:06d}`` (``version_dir``) and keep
the newest few (``prune_versions``).
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

VERSION_DIR = re.compile(r"^v(\d{6,})$")
"""A version directory's name: ``v`` and the version, zero-padded to 6 digits (``v000007``)."""


def version_dir(root: str | Path, version: int) -> Path:
    """``<root>/v{version:06d}``, where a file-handoff sink publishes ``version``."""
    return Path(root) / f"v{version:06d}"


def next_version(version: int | None, current: int, *, holder: str) -> int:
    """The version a push gets: ``current + 1`` when none is asked for, else ``version`` once it is newer.

    Args:
        version: the version the caller asked for, or None for the next one.
        current: the last committed version of ``holder`` (0 before the first push).
        holder: whose version ``current`` is, as the error names it ("this sink", "the engine", "this sender").
    Returns: the version to push, > ``current``.
    Raises: ValueError ``push version {version} is not newer than {holder}'s v{current}`` when ``version <=
        current`` (versions only grow: an engine that saw v5 must never be handed an older v5 or v4).
    """
    if version is None:
        return current + 1
    if version <= current:
        raise ValueError(f"push version {version} is not newer than {holder}'s v{current}")
    return version


def find_versions(root: str | Path, *, marker: str | None = None) -> list[int]:
    """The versions with a directory ``<root>/v000001`` ... (``VERSION_DIR``), ascending; [] when ``root`` does not
    exist.

    Args:
        root: the directory the versions are published in.
        marker: a file a directory must hold to count (``miles.sync.disk``'s ``manifest.json``, written last); None
            counts every version directory.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = (VERSION_DIR.match(entry.name) for entry in root.iterdir())
    dirs = (root / m.group(0) for m in found if m)
    return sorted(int(d.name[1:]) for d in dirs if ((d / marker).is_file() if marker else d.is_dir()))


def prune_versions(root: str | Path, *, keep: int, current: int | None = None, marker: str | None = None) -> list[int]:
    """Delete all but the newest ``keep`` version directories under ``root`` (``find_versions``'s) and return the
    versions deleted, ascending.

    Args:
        root: the directory the versions are published in.
        keep: how many stay: ``current`` and the ``keep - 1`` newest before it (2: a server can still read the
            previous version while the new one is announced).
        current: the version just published. Versions newer than it (an earlier run's, left when a resumed run
            went back) are deleted too, with a warning. None: the newest version found.
        marker: passed to ``find_versions``: a directory without this file is neither counted nor deleted.
    Raises: ValueError for ``keep < 1`` (nothing deleted). A directory that cannot be deleted is left (best effort).
    """
    if keep < 1:
        raise ValueError(f"keep is {keep}; it must be >= 1 (the version just published always stays)")
    versions = find_versions(root, marker=marker)
    if current is None:
        current = versions[-1] if versions else 0
    newer = [v for v in versions if v > current]
    older = [v for v in versions if v < current]
    if newer:
        logger.warning("removing versions %s under %s: newer than v%d just written (an earlier run's)",
                       newer, root, current)  # fmt: skip
    removed = sorted(older[: max(len(older) - (keep - 1), 0)] + newer)
    for v in removed:
        shutil.rmtree(version_dir(root, v), ignore_errors=True)
    return removed
