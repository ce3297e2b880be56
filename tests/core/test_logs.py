import logging

from miles.core import logs
from miles.core.logs import warn_once


def test_warn_once_shows_a_message_template_once_whatever_its_arguments(caplog, monkeypatch):
    monkeypatch.setattr(logs, "_warned", set())
    logger = logging.getLogger("miles.test_logs")
    with caplog.at_level(logging.WARNING, logger="miles.test_logs"):
        for step in range(3):
            warn_once(logger, "step %d: nothing to learn", step)
        warn_once(logger, "another warning")
        warn_once(logging.getLogger("miles.test_logs.other"), "step %d: nothing to learn", 5)
    assert [r.getMessage() for r in caplog.records] == [
        "step 0: nothing to learn",
        "another warning",
        "step 5: nothing to learn",  # another logger: its own key
    ]
