"""``EnginePublisher``: the one owner of the weight version, trainer -> engines.

One publish is: pause every engine -> the backend pushes its weights as version v + 1 (from the ranks that hold
them, through ``miles.sync``) -> flush the engines' caches (prefixes computed with older weights) -> the version
becomes v + 1 -> resume the engines. A failed push leaves the version, and the engines resume on their old
weights. A resumed run starts the counter at its checkpoint's version, so versions never repeat within a run.
The whole publish runs inside the caller's ``guard`` (Ray mode: the engine supervisor's, so that no engine is being
restarted or re-weighted meanwhile).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from miles.core.protocols import TrainBackend

logger = logging.getLogger(__name__)


class EnginePublisher:
    """``WeightPublisher`` over a backend and the engines it feeds.

    Args:
        backend: the ``TrainBackend``; ``push_weights(version)`` sends the weights.
        engines: the engines to pause, flush and resume around each push (an ``Engine`` each); may be empty
            when the push reaches receivers that are not engines.
        version: the version the engines hold now (0 at the start of a run; a checkpoint's on resume).
        pause_mode: how engines pause (``Engine.pause``): "keep" lets running work finish first (the synchronous
            loop has none in flight); "abort" / "retract" stop it (async training).
        guard: called once per publish; the context manager it returns is entered before the engines pause and
            left after they resume. The engine supervisor's ``publish_guard`` (Ray mode) waits there until no
            engine is being restarted and keeps a restarted one from being re-weighted during the push. What
            entering it raises (an engine that could not be brought back) fails the publish before anything ran.
    """

    def __init__(
        self,
        backend: TrainBackend,
        engines: Sequence[Any] = (),
        *,
        version: int = 0,
        pause_mode: str = "keep",
        guard: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.backend = backend
        self.engines = list(engines)
        self.pause_mode = pause_mode
        self.guard = guard
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def metrics(self) -> dict[str, float]:
        """Transfer metrics of the last publish when its weight sink encodes deltas (a ``last_push`` with
        miles.sync's ``PushStats``): ``sync/sent_mib`` (MiB the transport moved) and ``sync/sent_fraction`` (of a
        full update's bytes); {} otherwise, e.g. for a sink that lives in a Ray actor."""
        stats = getattr(getattr(self.backend, "weight_sink", None), "last_push", None)
        if stats is None or not getattr(stats, "delta", False):
            return {}
        return {"sync/sent_mib": stats.nbytes / 2**20, "sync/sent_fraction": stats.sent_fraction}

    def publish(self) -> int:
        """Push the backend's weights as ``version + 1`` with the engines paused; returns the new version.

        Raises: whatever the push raises (``WeightUpdateError``, ``TimeoutError``); the version is unchanged and
            the engines are resumed on their previous weights. What entering ``guard()`` raises.
        """
        version = self._version + 1
        with self.guard():
            for engine in self.engines:
                engine.pause(self.pause_mode)
            try:
                self.backend.push_weights(version)
                for engine in self.engines:
                    engine.flush_cache()
                self._version = version
            finally:
                for engine in self.engines:
                    engine.resume()
        return version
