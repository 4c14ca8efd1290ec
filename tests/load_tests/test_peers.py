"""load_tests/peers.py: the add_sub models Kiln and MLServer serve next to Triton, and peers missing here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from load_tests import peers


def test_add_sub_matches_the_triton_peer(tmp_path):
    """Same tensors and batching as ../shared/tools/triton-peer/triton_repo/add_sub (max batch 8, 100 us)."""
    peers.write_add_sub(tmp_path)
    config = (tmp_path / "kiln" / "add_sub" / "config.pbtxt").read_text()
    assert "max_batch_size: 8" in config and "max_queue_delay_microseconds: 100" in config and "KIND_CPU" in config
    assert config.count("TYPE_FP32 dims: [ 16 ]") == 4
    settings = json.loads((tmp_path / "mlserver" / "add_sub" / "model-settings.json").read_text())
    assert settings["max_batch_size"] == 8 and settings["max_batch_time"] == 0.0001
    session = ort.InferenceSession(str(tmp_path / "kiln" / "add_sub" / "1" / "model.onnx"))
    a, b = np.arange(32, dtype=np.float32).reshape(2, 16), np.full((2, 16), 3, np.float32)
    total, difference = session.run(["OUTPUT0", "OUTPUT1"], {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(difference, a - b)


def test_triton_scenarios_alternate_three_rounds():
    scenarios = {s.name: s for s in peers.SCENARIOS}
    for name in ("add_sub_http_json", "add_sub_grpc"):
        assert scenarios[name].rounds == 3 and scenarios[name].servers[:2] == ("kiln", "triton")
        assert "16,64" in scenarios[name].args
    assert all("triton" not in s.servers for s in peers.SCENARIOS if not s.name.startswith("add_sub"))


def test_missing_peers_are_named(monkeypatch, tmp_path):
    assert peers.available("kiln") == ""
    monkeypatch.setitem(peers.PEERS, "triton", (tmp_path / "none", peers.TRITON_PACKAGES))
    assert "no venv" in peers.available("triton")
    (tmp_path / "none" / "bin").mkdir(parents=True)
    (tmp_path / "none" / "bin" / "python").touch()
    monkeypatch.setattr(peers, "TRITON_SERVE", Path(tmp_path / "serve.sh"))
    assert "serve.sh" in peers.available("triton")
