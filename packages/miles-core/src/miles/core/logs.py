"""Logging helpers for loops: a warning that is worth reading once is not repeated every step; a reason on one line."""

from __future__ import annotations

import logging

# (logger name, message template) pairs already warned about. Process-wide on purpose: a run is one process (the
# CLI), and a loop must not pass state around only to keep a log quiet.
_warned: set[tuple[str, str]] = set()


def warn_once(logger: logging.Logger, msg: str, *args: object) -> None:
    """``logger.warning(msg, *args)`` the first time this logger gets this ``msg`` template in the process.

    The key is the template, not the formatted text, so a message carrying per-step numbers is still shown once.
    """
    key = (logger.name, msg)
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(msg, *args)


def one_line(text: object, limit: int = 200) -> str:
    """``text`` with its white space (newlines included) folded to single spaces, cut to ``limit`` characters with
    "..." at the end: a failure reason fit for a log line or a one-line error."""
    folded = " ".join(str(text).split())
    return folded if len(folded) <= limit else folded[: limit - 3] + "..."
