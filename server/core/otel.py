"""`trace_mode` opentelemetry: a finished trace's timestamps exported as OpenTelemetry spans, Triton's span tree.

Triton (server/src/tracer.cc) makes an `InferRequest` root span (continuing the client's trace when the request
carried a W3C `traceparent`), a child span named after the model (attributes triton.model_name, model_version,
trace_id, trace_parent_id, request_id; its timestamps as events) and under it a `compute` span (COMPUTE_* events).
Kiln builds the same tree when the request is done, from the monotonic timestamps it recorded, shifted to wall
time; the compute span also says the batch size the request ran in (`kiln.batch_size`). Spans leave through the
SDK's BatchSpanProcessor and OTLP/HTTP exporter, configured as Triton's `--trace-config opentelemetry,...`
settings. The SDK is the optional `kiln[otel]` extra, imported only when this mode is asked for.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import invalid

EXTRA_HINT = "install the OpenTelemetry SDK with: pip install 'kiln[otel]'"
_COMPUTE_EVENTS = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")


@dataclass
class OtelSettings:
    """Triton's `--trace-config opentelemetry,<setting>=<value>` settings, with its defaults (OTEL_BSP_* from the
    environment as Triton reads them)."""

    url: str = "http://localhost:4318/v1/traces"
    resource: dict[str, str] = field(default_factory=lambda: {"service.name": "triton-inference-server"})
    bsp_max_queue_size: int = field(default_factory=lambda: int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "2048")))
    bsp_schedule_delay: int = field(default_factory=lambda: int(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "5000")))
    bsp_max_export_batch_size: int = field(
        default_factory=lambda: int(os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512")))

    def set(self, key: str, value: str) -> None:
        """One `opentelemetry,<key>=<value>` setting; ServerError (invalid) for an unknown key or a bad number."""
        if key == "url":
            self.url = value
        elif key == "resource":
            name, sep, text = value.partition("=")
            if not sep or not name:
                raise invalid(f"--trace-config opentelemetry,resource expects <key>=<value>, got '{value}'")
            self.resource[name] = text
        elif key in ("bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size"):
            if not value.isdigit():
                raise invalid(f"--trace-config opentelemetry,{key} must be a non-negative integer, got '{value}'")
            setattr(self, key, int(value))
        else:
            raise invalid(f"unknown --trace-config opentelemetry setting '{key}' (Triton's: url, resource, "
                          "bsp_max_queue_size, bsp_schedule_delay, bsp_max_export_batch_size)")


class OtelExporter:
    """The tracer that turns finished traces into spans. `processor` replaces the batch processor and OTLP
    exporter (tests pass a SimpleSpanProcessor over an InMemorySpanExporter)."""

    def __init__(self, settings: OtelSettings | None = None, processor: Any = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise invalid(f"trace mode 'opentelemetry' needs the OpenTelemetry SDK, which is not installed ({e}); "
                          f"{EXTRA_HINT}") from None
        settings = settings or OtelSettings()
        if processor is None:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as e:
                raise invalid(f"trace mode 'opentelemetry' needs the OTLP/HTTP exporter, which is not installed "
                              f"({e}); {EXTRA_HINT}") from None
            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.url),
                                           max_queue_size=settings.bsp_max_queue_size,
                                           schedule_delay_millis=settings.bsp_schedule_delay,
                                           max_export_batch_size=settings.bsp_max_export_batch_size)
        self.settings = settings
        self.provider = TracerProvider(resource=Resource.create(dict(settings.resource)))
        self.provider.add_span_processor(processor)
        self._tracer = self.provider.get_tracer("kiln")
        self._kind = SpanKind.SERVER
        self._in_context = set_span_in_context
        self._propagator = TraceContextTextMapPropagator()

    def export(self, trace: Any) -> None:
        """One finished `Trace` (server/core/settings.py) as its span tree."""
        stamps = {t["name"]: t["ns"] for t in trace.timestamps}
        if "REQUEST_START" not in stamps or "REQUEST_END" not in stamps:
            return
        shift = time.time_ns() - time.monotonic_ns()  # the recorded monotonic times as wall-clock times
        parent = self._propagator.extract({"traceparent": trace.traceparent}) if trace.traceparent else None
        root = self._tracer.start_span("InferRequest", context=parent, kind=self._kind,
                                       start_time=stamps["REQUEST_START"] + shift)
        attributes = {"triton.model_name": trace.model_name, "triton.trace_id": trace.id,
                      "triton.trace_parent_id": 0}
        if trace.model_version.lstrip("-").isdigit():
            attributes["triton.model_version"] = int(trace.model_version)
        if trace.request_id:
            attributes["triton.request_id"] = trace.request_id
        model = self._tracer.start_span(trace.model_name, context=self._in_context(root), kind=self._kind,
                                        start_time=stamps["REQUEST_START"] + shift, attributes=attributes)
        compute = None
        for stamp in trace.timestamps:
            name, ns = stamp["name"], stamp["ns"] + shift
            if name == "COMPUTE_START":
                compute = self._tracer.start_span("compute", context=self._in_context(model), kind=self._kind,
                                                  start_time=ns)
                if trace.batch_size:
                    compute.set_attribute("kiln.batch_size", trace.batch_size)
            (compute if compute is not None and name in _COMPUTE_EVENTS else model).add_event(name, timestamp=ns)
            if name == "COMPUTE_END" and compute is not None:
                compute.end(end_time=ns)
                compute = None
        end = stamps["REQUEST_END"] + shift
        model.end(end_time=end)
        root.add_event("INFER_RESPONSE_COMPLETE", timestamp=end)
        root.end(end_time=end)

    def shutdown(self) -> None:
        """Flush the spans still batched (at server stop)."""
        self.provider.shutdown()
