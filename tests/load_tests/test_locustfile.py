"""The locustfile's mixed-traffic payloads are valid requests the real server answers correctly."""

from __future__ import annotations

import json
import random

import httpx
import numpy as np
import pytest

from load_tests.locustfile import MIX, pick, request_body


@pytest.mark.parametrize("traffic", MIX, ids=[t.name for t in MIX])
def test_payloads_are_served(kiln_server, traffic):
    batch = max(traffic.batch_sizes)
    body = request_body(traffic, batch)
    answer = httpx.post(f"{kiln_server.base_url}/v2/models/{traffic.model}/infer", content=body,
                        headers={"Content-Type": "application/json"}, timeout=30)
    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: o for o in answer.json()["outputs"]}
    assert all(o["shape"][0] == batch for o in outputs.values())
    if traffic.model.startswith("add_sub"):  # exact check against numpy
        dtype = np.float32 if traffic.inputs[0][1] == "FP32" else np.int32  # the server adds in the model's type
        sent = {i["name"]: np.array(i["data"], dtype).reshape(i["shape"]) for i in json.loads(body)["inputs"]}
        got = np.array(outputs["OUTPUT0"]["data"], dtype).reshape(outputs["OUTPUT0"]["shape"])
        np.testing.assert_array_equal(got, sent["INPUT0"] + sent["INPUT1"])


def test_mix_follows_weights():
    rng = random.Random(0)
    counts: dict[str, int] = {}
    for _ in range(4000):
        traffic, batch = pick(rng)
        assert batch in traffic.batch_sizes
        counts[traffic.name] = counts.get(traffic.name, 0) + 1
    total = sum(t.weight for t in MIX)
    for t in MIX:
        assert counts[t.name] / 4000 == pytest.approx(t.weight / total, abs=0.03)
    assert json.loads(request_body(MIX[0], 1))["parameters"] == {"priority": MIX[0].priority}
