"""load_tests/harness.py's /metrics reader and example loader, which the soak, the fault driver, the benchmarks
and tests/support share."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from load_tests.harness import free_ports, load_example, metric_sum, samples_sum

PAGE = """# HELP kiln_worker_restarts_total Worker restarts.
# TYPE kiln_worker_restarts_total counter
kiln_worker_restarts_total{model="a",version="1"} 2
kiln_worker_restarts_total{model="b",version="1"} 3.5
kiln_worker_restarts_total_extra{model="a"} 100
kiln_workers{model="we{i}rd",version="1"} 4
nv_gpu_memory_used_bytes 1024
"""


@contextmanager
def _metrics_page(text: str) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            found = self.path == "/metrics"
            body = text.encode() if found else b"no"
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_samples_sum_matches_name_and_labels_exactly() -> None:
    assert samples_sum(PAGE, "kiln_worker_restarts_total") == 5.5  # not the _extra family
    assert samples_sum(PAGE, "kiln_worker_restarts_total", {"model": "b"}) == 3.5
    assert samples_sum(PAGE, "kiln_worker_restarts_total", {"model": "c"}) is None  # absent, not 0
    assert samples_sum(PAGE, "kiln_workers", {"model": "we{i}rd", "version": "1"}) == 4
    assert samples_sum(PAGE, "nv_gpu_memory_used_bytes") == 1024
    assert samples_sum(PAGE, "nv_gpu_memory_used_bytes", {"gpu_uuid": "x"}) is None


def test_metric_sum_reads_a_page_over_http() -> None:
    with _metrics_page(PAGE) as url:
        assert metric_sum(url + "/metrics", "kiln_worker_restarts_total", {"model": "a"}) == 2
        assert metric_sum(url + "/nothing", "kiln_worker_restarts_total") is None


def test_load_example_runs_the_script_as_a_module() -> None:
    module = load_example("generative.py")
    assert module.__name__ == "generative" and callable(module.write_tiny_decoder)


def test_free_ports_are_all_different() -> None:
    """A server's HTTP, gRPC and metrics ports: picked one at a time, the same just-released port came back twice."""
    for _ in range(50):
        ports = free_ports(3)
        assert len(set(ports)) == 3 and all(1024 < port < 65536 for port in ports)
