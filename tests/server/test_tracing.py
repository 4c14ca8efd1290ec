"""Tracing as Triton does it: OpenTelemetry spans (Triton's tree, the client's `traceparent` continued) and the
TENSORS level of the trace file. The span tree is checked in process with the SDK's in-memory exporter; a real
server exports OTLP/HTTP to a receiver in the test, over HTTP and gRPC requests."""

from __future__ import annotations

import http.server
import json
import threading
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from server.core.otel import OtelExporter  # noqa: E402
from server.core.settings import TraceSettings  # noqa: E402
from server.trace_flags import parse_trace_config  # noqa: E402
from tests.server.conftest import examples, run_server  # noqa: E402

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"


def _otel_settings(exporter: InMemorySpanExporter) -> TraceSettings:
    settings = TraceSettings()
    settings.otel = OtelExporter(processor=SimpleSpanProcessor(exporter))
    settings.update("", {"trace_mode": "opentelemetry", "trace_level": ["TIMESTAMPS"], "trace_rate": "1000"})
    return settings


def test_span_tree_continues_the_clients_trace():
    exporter = InMemorySpanExporter()
    settings = _otel_settings(exporter)
    settings.start("m", "1", "")  # the 1st request is sampled (rate 1000): the next is not ...
    trace = settings.start("m", "3", "req-7", TRACEPARENT)  # ... but one with a traceparent always is
    assert trace is not None
    assert settings.start("m", "3", "") is None
    for name in ("REQUEST_START", "QUEUE_START"):
        trace.mark(name)
    time.sleep(0.002)
    trace.mark("COMPUTE_END")
    trace.executed(4, queue_ns=500_000, input_ns=100_000, infer_ns=300_000)
    trace.mark("REQUEST_END")
    settings.finish(trace)

    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"InferRequest", "m", "compute"}
    root, model, compute = spans["InferRequest"], spans["m"], spans["compute"]
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {TRACE_ID}
    assert format(root.parent.span_id, "016x") == PARENT_SPAN and root.parent.is_remote
    assert model.parent.span_id == root.context.span_id and compute.parent.span_id == model.context.span_id
    assert model.attributes["triton.model_name"] == "m" and model.attributes["triton.model_version"] == 3
    assert model.attributes["triton.request_id"] == "req-7"
    assert compute.attributes["kiln.batch_size"] == 4
    assert [e.name for e in model.events] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    assert [e.name for e in compute.events] == ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
                                                "COMPUTE_END"]
    assert root.start_time <= model.start_time <= compute.start_time <= compute.end_time <= model.end_time
    assert abs(root.start_time - time.time_ns()) < 60e9  # wall-clock times, not monotonic ones


def test_rate_zero_traces_only_propagated_requests():
    exporter = InMemorySpanExporter()
    settings = _otel_settings(exporter)
    settings.update("", {"trace_rate": "0"})
    assert settings.start("m", "1", "") is None
    assert settings.start("m", "1", "", TRACEPARENT) is not None


def test_without_traceparent_a_new_trace_starts():
    exporter = InMemorySpanExporter()
    settings = _otel_settings(exporter)
    trace = settings.start("m", "1", "")
    trace.mark("REQUEST_START")
    trace.mark("REQUEST_END")
    settings.finish(trace)
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "InferRequest"]
    assert root.parent is None


def test_trace_config_flags():
    updates, otel = parse_trace_config(["mode=opentelemetry", "rate=1", "level=TIMESTAMPS", "level=TENSORS",
                                        "count=-1", "triton,file=/tmp/t.json", "triton,log-frequency=5",
                                        "opentelemetry,url=http://collector:4318/v1/traces",
                                        "opentelemetry,resource=service.name=kiln",
                                        "opentelemetry,resource=deployment=prod",
                                        "opentelemetry,bsp_max_export_batch_size=16"])
    assert updates == {"trace_mode": "opentelemetry", "trace_rate": "1", "trace_level": ["TIMESTAMPS", "TENSORS"],
                       "trace_count": "-1", "trace_file": "/tmp/t.json", "log_frequency": "5"}
    assert otel.url == "http://collector:4318/v1/traces" and otel.bsp_max_export_batch_size == 16
    assert otel.resource == {"service.name": "kiln", "deployment": "prod"}
    for bad in ("rate", "opentelemetry,colour=blue", "jaeger,url=x", "triton,url=x", "opentelemetry,bsp_schedule_delay=-1"):
        with pytest.raises(ValueError):
            parse_trace_config([bad])


# -- a real server ----------------------------------------------------------------------------------------------
class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector: keeps the spans it is sent."""

    spans: list = []

    def do_POST(self) -> None:  # noqa: N802 - the handler's name
        request = ExportTraceServiceRequest()
        request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                _Receiver.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _body(rows: int = 1) -> dict:
    data = list(range(16 * rows))
    return {"inputs": [{"name": n, "shape": [rows, 16], "datatype": "INT32", "data": data}
                       for n in ("INPUT0", "INPUT1")]}


def test_a_real_server_exports_spans_continuing_http_and_grpc_traces(tmp_path):
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    _Receiver.spans = []
    repository = examples.make_repository(tmp_path / "models")
    args = ["--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
            "--trace-config", "rate=1000000",  # only the requests with a traceparent (and the very first)
            "--trace-config", f"opentelemetry,url=http://127.0.0.1:{collector.server_port}/v1/traces",
            "--trace-config", "opentelemetry,bsp_schedule_delay=50"]
    grpc_trace = "1" * 32
    try:
        with run_server(repository, tmp_path / "server.log", ["add_sub"], args) as server:
            url = f"http://{server.http_url}/v2/models/add_sub/infer"
            assert httpx.post(url, json=_body(), timeout=30).status_code == 200  # the sampled first one
            assert httpx.post(url, json=_body(), timeout=30).status_code == 200  # not traced
            response = httpx.post(url, json=_body(), headers={"traceparent": TRACEPARENT}, timeout=30)
            assert response.status_code == 200
            grpcclient = pytest.importorskip("tritonclient.grpc")
            client = grpcclient.InferenceServerClient(server.grpc_url)
            inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
            client.infer("add_sub", inputs, headers={"traceparent": f"00-{grpc_trace}-{PARENT_SPAN}-01"})
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(_Receiver.spans) < 9:
                time.sleep(0.05)
    finally:
        collector.shutdown()
    by_trace: dict[str, list] = {}
    for span in _Receiver.spans:
        by_trace.setdefault(span.trace_id.hex(), []).append(span)
    assert len(by_trace) == 3, by_trace.keys()  # the first request's, and the two continued ones
    for trace_id in (TRACE_ID, grpc_trace):
        spans = {s.name: s for s in by_trace[trace_id]}
        assert set(spans) == {"InferRequest", "add_sub", "compute"}
        assert spans["InferRequest"].parent_span_id.hex() == PARENT_SPAN
        assert spans["add_sub"].parent_span_id == spans["InferRequest"].span_id
        assert spans["compute"].parent_span_id == spans["add_sub"].span_id
        assert {a.key: a.value.int_value for a in spans["compute"].attributes} == {"kiln.batch_size": 1}


def test_tensors_level_writes_tritons_tensor_records(tmp_path):
    trace_file = tmp_path / "trace.jsonl"
    repository = examples.make_repository(tmp_path / "models")
    args = ["--trace-config", f"triton,file={trace_file}", "--trace-config", "level=TIMESTAMPS",
            "--trace-config", "level=TENSORS", "--trace-config", "rate=1", "--allow-grpc", "false"]
    with run_server(repository, tmp_path / "server.log", ["add_sub"], args) as server:
        body = _body(2)
        body["id"] = "r1"
        assert httpx.post(f"http://{server.http_url}/v2/models/add_sub/infer", json=body, timeout=30).is_success
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not trace_file.exists():
            time.sleep(0.05)
    records = [json.loads(line) for line in trace_file.read_text().splitlines()]
    head, tensors = records[0], records[1:]
    assert head["model_name"] == "add_sub" and head["request_id"] == "r1"
    assert "REQUEST_START" in [t["name"] for t in head["timestamps"]]
    assert {(t["activity"], t["tensor"]["name"]) for t in tensors} == {
        ("TENSOR_QUEUE_INPUT", "INPUT0"), ("TENSOR_QUEUE_INPUT", "INPUT1"),
        ("TENSOR_BACKEND_OUTPUT", "OUTPUT0"), ("TENSOR_BACKEND_OUTPUT", "OUTPUT1")}
    assert all(t["id"] == head["id"] for t in tensors)
    values = list(range(32))
    by_name = {t["tensor"]["name"]: t["tensor"] for t in tensors}
    assert by_name["INPUT0"] == {"name": "INPUT0", "data": ",".join(map(str, values)), "shape": "2,16",
                                 "dtype": "INT32"}
    assert by_name["OUTPUT0"]["data"] == ",".join(str(2 * v) for v in values)  # INPUT0 + INPUT1
    assert by_name["OUTPUT1"]["data"] == ",".join(["0"] * 32) and by_name["OUTPUT1"]["dtype"] == "INT32"


def test_opentelemetry_mode_without_the_sdk_is_refused(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_sdk(name, *args, **kwargs):
        if name.startswith("opentelemetry.sdk"):
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    from server.trace_flags import apply_trace_config

    with pytest.raises(ValueError, match=r"kiln\[otel\]"):
        apply_trace_config(TraceSettings(), ["mode=opentelemetry"])
