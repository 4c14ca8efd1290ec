"""ILogger-style logger: severities as in the reference, messages go to Python logging."""

from __future__ import annotations

import enum
import logging


class Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


_PY_LEVEL = {
    Severity.INTERNAL_ERROR: logging.CRITICAL,
    Severity.ERROR: logging.ERROR,
    Severity.WARNING: logging.WARNING,
    Severity.INFO: logging.INFO,
    Severity.VERBOSE: logging.DEBUG,
}


class Logger:
    """Logs messages at or above ``min_severity``; subclass and override ``log`` to capture them."""

    Severity = Severity

    def __init__(self, min_severity: Severity = Severity.WARNING) -> None:
        self.min_severity = Severity(min_severity)
        self._py = logging.getLogger("kiln")

    def log(self, severity: Severity, msg: str) -> None:
        if severity <= self.min_severity:
            self._py.log(_PY_LEVEL[Severity(severity)], msg)


DEFAULT_LOGGER = Logger()
