"""IErrorRecorder: errors collected per object (builder, runtime, engine, context, refitter).

Every Kiln object that logs errors has an ``error_recorder`` attribute (None by default). When one
is attached, each error that object logs is also recorded there, with a reference ``ErrorCode``.
An engine takes its runtime's recorder when it is deserialized, a context its engine's, unless
the application attaches another one.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

from engine_core.logger import DEFAULT_LOGGER, Severity


class ErrorCode(enum.IntEnum):
    """The reference's error codes."""

    SUCCESS = 0
    UNSPECIFIED_ERROR = 1
    INTERNAL_ERROR = 2
    INVALID_ARGUMENT = 3
    INVALID_CONFIG = 4
    FAILED_ALLOCATION = 5
    FAILED_INITIALIZATION = 6
    FAILED_EXECUTION = 7
    FAILED_COMPUTATION = 8
    INVALID_STATE = 9
    UNSUPPORTED_STATE = 10


class IErrorRecorder:
    """Application interface; subclass it, or use ``ErrorRecorder``, the bounded default."""

    #: the reference's maximum description length
    MAX_DESC_LENGTH = 127

    def num_errors(self) -> int:
        raise NotImplementedError

    def get_error_code(self, error_idx: int) -> ErrorCode:
        raise NotImplementedError

    def get_error_desc(self, error_idx: int) -> str:
        raise NotImplementedError

    def has_overflowed(self) -> bool:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def report_error(self, val: ErrorCode, desc: str) -> bool:
        """Record one error; returning True asks the caller to stop (Kiln stops anyway: it raises)."""
        raise NotImplementedError


class ErrorRecorder(IErrorRecorder):
    """Thread-safe recorder keeping the first ``capacity`` errors; later ones set the overflow flag."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._errors: list[tuple[ErrorCode, str]] = []
        self._overflowed = False
        self._lock = threading.Lock()

    def num_errors(self) -> int:
        return len(self._errors)

    def get_error_code(self, error_idx: int) -> ErrorCode:
        return self._errors[error_idx][0] if 0 <= error_idx < len(self._errors) else ErrorCode.INVALID_ARGUMENT

    def get_error_desc(self, error_idx: int) -> str:
        return self._errors[error_idx][1] if 0 <= error_idx < len(self._errors) else ""

    def has_overflowed(self) -> bool:
        return self._overflowed

    def clear(self) -> None:
        with self._lock:
            self._errors.clear()
            self._overflowed = False

    def report_error(self, val: ErrorCode, desc: str) -> bool:
        with self._lock:
            if len(self._errors) >= self.capacity:
                self._overflowed = True
            else:
                self._errors.append((ErrorCode(val), desc[: self.MAX_DESC_LENGTH]))
        return False


def report_error(obj: Any, code: ErrorCode, msg: str, logger: Any = None) -> None:
    """Log ``msg`` as an error through ``obj``'s logger and record it in ``obj.error_recorder``."""
    logger = logger or getattr(obj, "logger", None) or getattr(getattr(obj, "engine", None), "logger", None)
    (logger or DEFAULT_LOGGER).log(Severity.ERROR, msg)
    recorder = getattr(obj, "error_recorder", None)
    if recorder is not None:
        recorder.report_error(code, msg)


class RecorderSlot:
    """``error_recorder`` attribute: the object's own recorder, else its parent's (``parent`` attr)."""

    def __init__(self, parent: str | None = None) -> None:
        self.parent = parent

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        own = obj.__dict__.get("_error_recorder")
        if own is not None or self.parent is None:
            return own
        return getattr(getattr(obj, self.parent, None), "error_recorder", None)

    def __set__(self, obj: Any, recorder: IErrorRecorder | None) -> None:
        obj.__dict__["_error_recorder"] = recorder
