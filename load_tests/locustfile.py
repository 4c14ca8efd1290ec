"""Mixed traffic for Locust: several models, shapes and priorities against one KServe v2 HTTP server.

    pip install locust            # optional tool, in its own venv; not a Kiln dependency
    locust -f load_tests/locustfile.py --headless -u 32 -r 8 -t 60s --host http://127.0.0.1:8000 \\
        --csv /tmp/kiln-mixed --only-summary

Serves the example repository (examples/make_example_repository.py). The traffic mix (`MIX`) is weighted:
small INT32 requests at two priorities, FP32 add/sub at random batch sizes, and CNN images at batch 1..8.
Payloads are built once per (model, batch) and reused so Locust's own CPU stays low. Without locust installed
the module still imports (the payload builders are plain functions) and says how to get it when run.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache

import numpy as np

try:
    from locust import FastHttpUser, between, task
except ImportError:  # locust is optional: keep the payload helpers importable
    FastHttpUser = None


@dataclass(frozen=True)
class Traffic:
    """One kind of request in the mix."""

    name: str
    model: str
    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, datatype, per-item shape)
    batch_sizes: tuple[int, ...]
    priority: int = 0
    weight: int = 1


MIX = (
    Traffic("add_sub_high", "add_sub", (("INPUT0", "INT32", (16,)), ("INPUT1", "INT32", (16,))), (1,), 1, 4),
    Traffic("add_sub_low", "add_sub", (("INPUT0", "INT32", (16,)), ("INPUT1", "INT32", (16,))), (1, 2, 4), 2, 4),
    Traffic("add_sub_fp32", "add_sub_fp32", (("INPUT0", "FP32", (16,)), ("INPUT1", "FP32", (16,))), (1, 2, 4), 0, 2),
    Traffic("cnn", "simple_cnn", (("INPUT", "FP32", (3, 32, 32)),), (1, 2, 4, 8), 0, 1),
)


def _data(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> list:
    if datatype == "INT32":
        return rng.integers(0, 100, shape, dtype=np.int32).ravel().tolist()
    return rng.standard_normal(shape).astype(np.float32).ravel().tolist()


@cache
def request_body(traffic: Traffic, batch: int) -> bytes:
    """A KServe v2 JSON request for `batch` items; `priority` travels as a request parameter (Triton's)."""
    rng = np.random.default_rng(batch)
    inputs = [{"name": n, "datatype": d, "shape": [batch, *s], "data": _data(d, (batch, *s), rng)}
              for n, d, s in traffic.inputs]
    body: dict = {"inputs": inputs}
    if traffic.priority:
        body["parameters"] = {"priority": traffic.priority}
    return json.dumps(body).encode()


def pick(rng: random.Random) -> tuple[Traffic, int]:
    """A weighted choice of traffic kind, then a batch size among its allowed ones."""
    traffic = rng.choices(MIX, weights=[t.weight for t in MIX])[0]
    return traffic, rng.choice(traffic.batch_sizes)


if FastHttpUser is not None:

    class MixedTrafficUser(FastHttpUser):
        """Sends the weighted mix; each request is named `<traffic> b<batch>` in Locust's statistics."""

        wait_time = between(0.0, 0.01)

        def on_start(self) -> None:
            self.rng = random.Random()

        @task
        def infer(self) -> None:
            traffic, batch = pick(self.rng)
            with self.client.post(f"/v2/models/{traffic.model}/infer", data=request_body(traffic, batch),
                                  headers={"Content-Type": "application/json"},
                                  name=f"{traffic.name} b{batch}", catch_response=True) as response:
                if response.status_code != 200:
                    response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                elif "outputs" not in response.json():
                    response.failure("no outputs in the answer")

elif __name__ == "__main__":
    raise SystemExit("locust is not installed: `pip install locust` (in its own venv), then see this file's docstring")
