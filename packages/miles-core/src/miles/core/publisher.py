"""``EnginePublisher``: the one owner of the weight version, trainer -> engines.

One publish is: pause every engine -> the backend pushes its weights as version v + 1 (from the ranks that hold
them, through ``miles.sync``) -> flush the engines' caches (prefixes computed with older weights) -> the version
becomes v + 1 -> resume the engines. A failed push leaves the version, and the engines resume on their old
weights. A resumed run starts the counter at its checkpoint's version, so versions never repeat within a run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
    """

    def __init__(
        self, backend: TrainBackend, engines: Sequence[Any] = (), *, version: int = 0, pause_mode: str = "keep"
    ) -> None:
        self.backend = backend
        self.engines = list(engines)
        self.pause_mode = pause_mode
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def publish(self) -> int:
        """Push the backend's weights as ``version + 1`` with the engines paused; returns the new version.

        Raises: whatever the push raises (``WeightUpdateError``, ``TimeoutError``); the version is unchanged and
            the engines are resumed on their previous weights.
        """
        version = self._version + 1
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
