"""Log settings (applied to Python logging) and trace settings (applied to a request tracer), as in Triton.

Log settings: log_file, log_info, log_warning, log_error, log_verbose_level, log_format.
Trace settings: trace_file, trace_level (list), trace_rate, trace_count, log_frequency, trace_mode; global ones
plus per-model overrides (a `None` value clears a model's override). Traced requests are appended to
`trace_file` as JSON lines with Triton's timestamp names.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import invalid

LOGGER_NAME = "kiln"

_FORMATS = {
    "default": "%(levelname).1s%(asctime)s.%(msecs)03d %(process)d %(name)s] %(message)s",
    "ISO8601": "%(asctime)s %(levelname)s %(process)d %(name)s] %(message)s",
}
_DATE_FORMATS = {"default": "%m%d %H:%M:%S", "ISO8601": "%Y-%m-%dT%H:%M:%S"}


class LogSettings:
    """Triton's log settings, applied to the `kiln` logger (and so to every `kiln.*` logger) on each update."""

    def __init__(self, verbose_level: int = 0, log_file: str = "", log_format: str = "default") -> None:
        self.values: dict[str, Any] = {
            "log_file": log_file, "log_info": True, "log_warning": True, "log_error": True,
            "log_verbose_level": verbose_level, "log_format": log_format,
        }
        self._handler: logging.Handler | None = None
        self._lock = threading.Lock()
        self._apply()

    def update(self, updates: dict[str, Any]) -> dict[str, Any]:
        """Validate and apply `updates`; returns all settings. Unknown keys or wrong types: INVALID_ARGUMENT."""
        with self._lock:
            merged = dict(self.values)
            for key, value in updates.items():
                merged[key] = _checked_log_value(key, value)
            self.values = merged
            self._apply()
            return dict(self.values)

    def current(self) -> dict[str, Any]:
        return dict(self.values)

    def level(self) -> int:
        """The logging level the settings amount to: verbose -> DEBUG, then INFO, WARNING, ERROR, or off."""
        v = self.values
        if v["log_verbose_level"] > 0:
            return logging.DEBUG
        for key, level in (("log_info", logging.INFO), ("log_warning", logging.WARNING),
                           ("log_error", logging.ERROR)):
            if v[key]:
                return level
        return logging.CRITICAL + 1

    def _apply(self) -> None:
        logger = logging.getLogger(LOGGER_NAME)
        logger.setLevel(self.level())
        logger.propagate = False
        handler: logging.Handler = (logging.FileHandler(self.values["log_file"]) if self.values["log_file"]
                                    else logging.StreamHandler())
        fmt = self.values["log_format"]
        handler.setFormatter(logging.Formatter(_FORMATS[fmt], _DATE_FORMATS[fmt]))
        if self._handler is not None:
            logger.removeHandler(self._handler)
            self._handler.close()
        logger.addHandler(handler)
        self._handler = handler


def _checked_log_value(key: str, value: Any) -> Any:
    if key in ("log_info", "log_warning", "log_error"):
        if not isinstance(value, bool):
            raise invalid(f"log setting '{key}' must be a boolean, got {value!r}")
        return value
    if key == "log_verbose_level":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise invalid(f"log setting 'log_verbose_level' must be a non-negative integer, got {value!r}")
        return value
    if key == "log_format":
        if value not in _FORMATS:
            raise invalid(f"log setting 'log_format' must be one of {sorted(_FORMATS)}, got {value!r}")
        return value
    if key == "log_file":
        if not isinstance(value, str):
            raise invalid(f"log setting 'log_file' must be a string, got {value!r}")
        if value:
            try:
                open(value, "a").close()
            except OSError as e:
                raise invalid(f"log setting 'log_file': cannot open '{value}': {e.strerror}") from None
        return value
    raise invalid(f"unknown log setting '{key}'")


TRACE_LEVELS = {"OFF", "TIMESTAMPS", "TENSORS"}
TRACE_DEFAULTS: dict[str, Any] = {
    "trace_file": "", "trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
    "log_frequency": "0", "trace_mode": "triton",
}


def _checked_trace_value(key: str, value: Any) -> Any:
    """Normalize one trace setting: trace_level is a list of level names, everything else a string."""
    if key not in TRACE_DEFAULTS:
        raise invalid(f"unknown trace setting '{key}'")
    values = [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    if key == "trace_level":
        unknown = [v for v in values if v not in TRACE_LEVELS]
        if unknown or not values:
            raise invalid(f"trace_level must be a list of {sorted(TRACE_LEVELS)}, got {value!r}")
        return values
    if len(values) != 1:
        raise invalid(f"trace setting '{key}' takes one value, got {value!r}")
    text = values[0]
    if key in ("trace_rate", "trace_count", "log_frequency"):
        try:
            number = int(text)
        except ValueError:
            raise invalid(f"trace setting '{key}' must be an integer, got {text!r}") from None
        if number < (-1 if key == "trace_count" else 0) or (key == "trace_rate" and number == 0):
            raise invalid(f"trace setting '{key}' is out of range: {number}")
    if key == "trace_mode" and text not in ("triton", "opentelemetry"):
        raise invalid(f"trace_mode must be 'triton' or 'opentelemetry', got {text!r}")
    return text


def _traces(values: dict[str, Any]) -> bool:
    return values["trace_level"] != ["OFF"] and bool(values["trace_file"])


@dataclass
class Trace:
    """Timestamps of one traced request (Triton's names: REQUEST_START, QUEUE_START, COMPUTE_START, ...)."""

    id: int
    model_name: str
    model_version: str
    request_id: str
    timestamps: list[dict[str, Any]] = field(default_factory=list)

    def mark(self, name: str, ns: int | None = None) -> None:
        self.timestamps.append({"name": name, "ns": time.monotonic_ns() if ns is None else ns})


class TraceSettings:
    """Global and per-model trace settings, and the sampler that decides which requests are traced."""

    def __init__(self) -> None:
        self.global_values: dict[str, Any] = dict(TRACE_DEFAULTS)
        self.model_values: dict[str, dict[str, Any]] = {}
        self._seen: dict[str, int] = {}
        self._traced: dict[str, int] = {}
        self._next_id = 1
        self._lock = threading.Lock()
        #: whether any scope traces at all (`start` is on every request's path; a frontend's group of requests
        #: runs as separate requests while it does)
        self.active = False

    def current(self, model_name: str = "") -> dict[str, Any]:
        with self._lock:
            return self._effective(model_name)

    def _effective(self, model_name: str) -> dict[str, Any]:
        return {**self.global_values, **self.model_values.get(model_name, {})}

    def update(self, model_name: str, updates: dict[str, Any]) -> dict[str, Any]:
        """Apply updates (global when `model_name` is empty); a None value clears it (a model's override, or
        back to the default globally). Returns the effective settings."""
        with self._lock:
            target = self.model_values.setdefault(model_name, {}) if model_name else self.global_values
            staged = dict(target)
            for key, value in updates.items():
                if value is None or value == []:
                    if key not in TRACE_DEFAULTS:
                        raise invalid(f"unknown trace setting '{key}'")
                    staged.pop(key, None)
                    if not model_name:
                        staged[key] = TRACE_DEFAULTS[key]
                else:
                    staged[key] = _checked_trace_value(key, value)
            target.clear()
            target.update(staged)
            self.active = any(_traces(self._effective(scope)) for scope in ["", *self.model_values])
            if "trace_count" in updates or "trace_rate" in updates:
                self._seen.pop(model_name, None)
                self._traced.pop(model_name, None)
            return self._effective(model_name)

    def start(self, model_name: str, model_version: str, request_id: str) -> Trace | None:
        """A Trace if this request is sampled (every trace_rate-th request, up to trace_count), else None."""
        if not self.active:
            return None
        with self._lock:
            values = self._effective(model_name)
            if not _traces(values):
                return None
            scope = model_name if model_name in self.model_values else ""
            seen = self._seen.get(scope, 0) + 1
            self._seen[scope] = seen
            count = int(values["trace_count"])
            if (seen - 1) % int(values["trace_rate"]) or (count != -1 and self._traced.get(scope, 0) >= count):
                return None
            self._traced[scope] = self._traced.get(scope, 0) + 1
            trace = Trace(self._next_id, model_name, model_version, request_id)
            self._next_id += 1
            return trace

    def finish(self, trace: Trace) -> None:
        """Append the trace to the trace file as one JSON line."""
        path = self.current(trace.model_name)["trace_file"]
        record = {"id": trace.id, "model_name": trace.model_name, "model_version": trace.model_version,
                  "request_id": trace.request_id, "timestamps": trace.timestamps}
        with self._lock, open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


@dataclass
class AdaptiveSettings:
    """Traffic-adaptive optimization profiles (server/core/adaptive.py). Off by default.

    `kiln serve --adaptive-profiles` turns it on; without the flag the environment can (KILN_ADAPTIVE_PROFILES=1,
    and KILN_ADAPTIVE_INTERVAL_S, KILN_ADAPTIVE_MIN_REQUESTS, KILN_ADAPTIVE_MAX_PROFILES for the rest), which
    is how tests and benchmarks start a server with it.
    """

    enabled: bool = False
    interval_s: float = 60.0  # how often the traffic of each model is looked at
    min_requests: int = 1000  # requests seen since the last fit before a model is refitted
    max_profiles: int = 4  # quantile cuts per variable dim (plus one profile up to the declared maximum)

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.min_requests < 1 or not 1 <= self.max_profiles <= 16:
            raise ValueError(f"adaptive profiles: interval_s must be > 0, min_requests >= 1 and max_profiles in "
                             f"1..16, got {self.interval_s}, {self.min_requests}, {self.max_profiles}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> AdaptiveSettings:
        """Settings from KILN_ADAPTIVE_* variables; a malformed value is a ValueError naming the variable."""
        env = os.environ if environ is None else environ

        def read(name: str, kind: type, default: Any) -> Any:
            text = env.get(name, "").strip()
            if not text:
                return default
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{name} must be a {kind.__name__}, got {text!r}") from None

        enabled = env.get("KILN_ADAPTIVE_PROFILES", "").strip().lower() in ("1", "true", "yes", "on")
        return cls(enabled, read("KILN_ADAPTIVE_INTERVAL_S", float, cls.interval_s),
                   read("KILN_ADAPTIVE_MIN_REQUESTS", int, cls.min_requests),
                   read("KILN_ADAPTIVE_MAX_PROFILES", int, cls.max_profiles))
