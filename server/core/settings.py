"""Log settings (applied to Python logging) and trace settings (applied to a request tracer), as in Triton.

Log settings: log_file, log_info, log_warning, log_error, log_verbose_level, log_format.
Trace settings: trace_file, trace_level (list), trace_rate, trace_count, log_frequency, trace_mode; global ones
plus per-model overrides (a `None` value clears a model's override). Traced requests are appended to
`trace_file` as JSON lines with Triton's timestamp names; at level TENSORS, each traced request's input tensors
(`TENSOR_QUEUE_INPUT`) and model outputs (`TENSOR_BACKEND_OUTPUT`) follow as Triton's tensor records. In trace_mode
opentelemetry, traces become spans instead (server/core/otel.py); as in Triton, a request carrying a W3C
`traceparent` is then traced whatever trace_rate and trace_count say, and TENSORS records nothing.
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
from .otel import OtelExporter

log = logging.getLogger("kiln.server.trace")

LOGGER_NAME = "kiln"

_FORMATS = {
    "default": "%(levelname).1s%(asctime)s.%(msecs)03d %(process)d %(name)s] %(message)s",
    "ISO8601": "%(asctime)s %(levelname)s %(process)d %(name)s] %(message)s",
}
_DATE_FORMATS = {"default": "%m%d %H:%M:%S", "ISO8601": "%Y-%m-%dT%H:%M:%S"}


def lowest_level(info: bool, warning: bool, error: bool) -> int:
    """The logging level that lets through the lowest of Triton's levels turned on (INFO, WARNING, ERROR), or
    nothing when all are off."""
    for wanted, level in ((info, logging.INFO), (warning, logging.WARNING), (error, logging.ERROR)):
        if wanted:
            return level
    return logging.CRITICAL + 1


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
        return lowest_level(v["log_info"], v["log_warning"], v["log_error"])

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
        if number < (-1 if key == "trace_count" else 0):  # rate 0: only requests with a traceparent (otel)
            raise invalid(f"trace setting '{key}' is out of range: {number}")
    if key == "trace_mode" and text not in ("triton", "opentelemetry"):
        raise invalid(f"trace_mode must be 'triton' or 'opentelemetry', got {text!r}")
    return text


def _traces(values: dict[str, Any]) -> bool:
    """Whether these settings trace: a level, and somewhere to put traces (a file, or the OpenTelemetry exporter)."""
    return values["trace_level"] != ["OFF"] and (values["trace_mode"] == "opentelemetry" or bool(values["trace_file"]))


def tensor_data(array: Any) -> str:
    """A tensor's elements as Triton's trace file writes them: comma-separated, row-major (bools as 0/1)."""
    values = array.ravel().tolist() if hasattr(array, "ravel") else list(array)
    return ",".join(_element(v) for v in values)


def _element(value: Any) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


@dataclass
class Trace:
    """Timestamps of one traced request (Triton's names: REQUEST_START, QUEUE_START, COMPUTE_START, ...)."""

    id: int
    model_name: str
    model_version: str
    request_id: str
    timestamps: list[dict[str, Any]] = field(default_factory=list)
    levels: tuple[str, ...] = ("TIMESTAMPS",)
    mode: str = "triton"
    traceparent: str = ""  # the client's W3C trace context, continued in opentelemetry mode
    batch_size: int = 0  # of the execution the request ran in (its span says it)
    tensors: list[dict[str, Any]] = field(default_factory=list)

    def mark(self, name: str, ns: int | None = None) -> None:
        self.timestamps.append({"name": name, "ns": time.monotonic_ns() if ns is None else ns})

    def record_tensors(self, activity: str, tensors: list[tuple[str, str, Any]]) -> None:
        """(name, datatype, array) tensors as Triton's TENSORS records (level TENSORS in triton mode only)."""
        if "TENSORS" not in self.levels or self.mode != "triton":
            return
        for name, datatype, array in tensors:
            if not hasattr(array, "ravel"):  # a tensor in CUDA shared memory: not copied out for the trace
                continue
            self.tensors.append({"id": self.id, "activity": activity, "tensor": {
                "name": name, "data": tensor_data(array), "shape": ",".join(str(d) for d in array.shape),
                "dtype": datatype}})

    def executed(self, batch_size: int, queue_ns: int, input_ns: int, infer_ns: int) -> None:
        """The execution's batch size, and its COMPUTE_START / COMPUTE_INPUT_END / COMPUTE_OUTPUT_START told by
        the scheduler's durations from QUEUE_START (bounded by COMPUTE_END: the workers time by thread CPU)."""
        self.batch_size = batch_size
        stamps = {t["name"]: t["ns"] for t in self.timestamps}
        if "QUEUE_START" not in stamps or "COMPUTE_END" not in stamps:
            return
        end = stamps["COMPUTE_END"]
        start = min(stamps["QUEUE_START"] + queue_ns, end)
        input_end = min(start + input_ns, end)
        for name, ns in (("COMPUTE_START", start), ("COMPUTE_INPUT_END", input_end),
                         ("COMPUTE_OUTPUT_START", min(input_end + infer_ns, end))):
            self.mark(name, ns)
        self.timestamps.sort(key=lambda t: t["ns"])


class TraceSettings:
    """Global and per-model trace settings, and the sampler that decides which requests are traced."""

    def __init__(self) -> None:
        self.global_values: dict[str, Any] = dict(TRACE_DEFAULTS)
        self.model_values: dict[str, dict[str, Any]] = {}
        self._seen: dict[str, int] = {}
        self._traced: dict[str, int] = {}
        self._next_id = 1
        self._lock = threading.Lock()
        #: the span exporter of trace_mode opentelemetry, made at start-up (`--trace-config`) or when a
        #: setting first asks for that mode
        self.otel: OtelExporter | None = None
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
            after = {**self.global_values, **staged}
            if after["trace_mode"] == "opentelemetry":
                if self.otel is None:
                    self.otel = OtelExporter()  # refuses the update when the SDK is missing
                if "TENSORS" in after["trace_level"]:
                    log.warning("trace level TENSORS records nothing in trace mode opentelemetry (as in Triton)")
            target.clear()
            target.update(staged)
            self.active = any(_traces(self._effective(scope)) for scope in ["", *self.model_values])
            if "trace_count" in updates or "trace_rate" in updates:
                self._seen.pop(model_name, None)
                self._traced.pop(model_name, None)
            return self._effective(model_name)

    def start(self, model_name: str, model_version: str, request_id: str, traceparent: str = "") -> Trace | None:
        """A Trace if this request is sampled (every trace_rate-th request, up to trace_count; in opentelemetry
        mode also every request that carries a `traceparent`), else None."""
        if not self.active:
            return None
        with self._lock:
            values = self._effective(model_name)
            if not _traces(values):
                return None
            mode = values["trace_mode"]
            scope = model_name if model_name in self.model_values else ""
            seen = self._seen.get(scope, 0) + 1
            self._seen[scope] = seen
            count = int(values["trace_count"])
            propagated = mode == "opentelemetry" and bool(traceparent)
            rate = int(values["trace_rate"])
            if not propagated and (not rate or (seen - 1) % rate
                                   or (count != -1 and self._traced.get(scope, 0) >= count)):
                return None
            self._traced[scope] = self._traced.get(scope, 0) + 1
            trace = Trace(self._next_id, model_name, model_version, request_id, levels=tuple(values["trace_level"]),
                          mode=mode, traceparent=traceparent)
            self._next_id += 1
            return trace

    def finish(self, trace: Trace) -> None:
        """Export the trace's spans (opentelemetry), or append it to the trace file: one JSON line with its
        timestamps (level TIMESTAMPS), then one per tensor record (level TENSORS)."""
        if trace.mode == "opentelemetry":
            if self.otel is not None:
                self.otel.export(trace)
            return
        path = self.current(trace.model_name)["trace_file"]
        record: dict[str, Any] = {"id": trace.id, "model_name": trace.model_name,
                                  "model_version": trace.model_version, "request_id": trace.request_id}
        if "TIMESTAMPS" in trace.levels:
            record["timestamps"] = trace.timestamps
        lines = [json.dumps(record), *(json.dumps(t) for t in trace.tensors)]
        with self._lock, open(path, "a") as f:
            f.write("\n".join(lines) + "\n")


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
