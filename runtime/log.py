"""rung's log lines: INFO and up from every ``rung.*`` logger to stderr, as vLLM does.

Set ``RUNG_LOGGING_LEVEL`` (e.g. WARNING) to see less, or ``RUNG_CONFIGURE_LOGGING=0`` to
leave logging to the application. An application that configured logging itself (a handler
on the root or on the ``rung`` logger) is left alone.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (so redirection and
    progress bars on stderr see the lines in order)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging() -> None:
    """Idempotent: the first call adds one handler, later calls do nothing."""
    logger = logging.getLogger("rung")
    if os.environ.get("RUNG_CONFIGURE_LOGGING", "1") == "0":
        return
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, "%H:%M:%S"))
    logger.addHandler(handler)
    level = os.environ.get("RUNG_LOGGING_LEVEL", "INFO").upper()
    logger.setLevel(level if level in logging.getLevelNamesMapping() else logging.INFO)
    logger.propagate = False
