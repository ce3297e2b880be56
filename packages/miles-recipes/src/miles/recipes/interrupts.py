"""Ctrl-C and SIGTERM during a run: the first asks for a clean stop, the second abandons the step.

A clean stop lets the loop finish the current step, save a checkpoint and return, so the run continues exactly
with ``--resume``. A second signal raises ``KeyboardInterrupt`` at once; the run then continues from its last
checkpoint (periodic ones are on by default). While a checkpoint is being written the second signal waits for
the write to end: a checkpoint is published whole or not at all either way (temp dir + rename), but waiting the
few seconds keeps the step that was just trained.

A signal within ``REPEAT_WINDOW_S`` of the one that started a stop (or abandoned the step) is the same request
delivered twice, not a second one: ``uv run`` forwards SIGINT to its child when stdin is not a terminal, so one
``kill -INT`` to the process group (or one Ctrl-C in some IDE consoles) arrives twice within milliseconds.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds after a handled signal in which another one counts as the same request (a duplicate delivery); a person
# pressing Ctrl-C again to stop at once takes longer than this.
REPEAT_WINDOW_S = 1.0


class StopRequest:
    """Installs SIGINT/SIGTERM handlers for the duration of a ``with`` block (main thread only).

    Attributes:
        requested: the name of the first signal received ("SIGINT", "SIGTERM"), or None.
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self._protected = 0
        self._abandon_after = False
        self._abandoned = False
        self._last_signal_at = -float("inf")  # time.monotonic() of the signal that last changed what happens
        self._previous: dict[int, object] = {}

    def __call__(self) -> bool:
        """True once a stop was asked for (the loop polls this between steps)."""
        return self.requested is not None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._abandoned:  # a duplicate of the abandoning signal must not reach the default handler mid-cleanup
            time.sleep(max(0.0, self._last_signal_at + REPEAT_WINDOW_S - time.monotonic()))
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @contextlib.contextmanager
    def protect(self) -> Iterator[None]:
        """A section (a checkpoint write) that a second signal does not cut short; it abandons right after."""
        self._protected += 1
        try:
            yield
        finally:
            self._protected -= 1
        if self._abandon_after and not self._protected:
            self._abandoned = True
            raise KeyboardInterrupt

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if now - self._last_signal_at < REPEAT_WINDOW_S:
            logger.debug("%s within %.1fs of the previous signal: taken as the same request", name, REPEAT_WINDOW_S)
            return
        self._last_signal_at = now
        if self.requested is None:
            self.requested = name
            logger.warning(
                "%s: finishing the current step, then saving a checkpoint and stopping (press Ctrl-C again to stop "
                "at once; the run then continues from its last checkpoint)",
                name,
            )
        elif self._protected:
            self._abandon_after = True
            logger.warning("%s again: stopping as soon as the checkpoint being written is complete", name)
        else:
            self._abandoned = True
            raise KeyboardInterrupt
