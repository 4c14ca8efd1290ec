"""load_tests/pipeline_bench.py: the pipeline repository both servers load, served for real by Kiln (and by Triton
where the nvidia-pytriton wheel is installed: skipped otherwise), driven by the same perf client."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from load_tests import pipeline_bench
from tests.support.servers import run_server


def test_the_repository_is_an_ensemble_of_three_python_models(tmp_path):
    repo = pipeline_bench.write_repository(tmp_path)
    assert sorted(p.name for p in repo.iterdir()) == ["classifier", "pipeline", "postprocess", "preprocess"]
    ensemble = (repo / "pipeline" / "config.pbtxt").read_text()
    assert 'platform: "ensemble"' in ensemble and ensemble.count("model_name:") == 3
    for name in ("preprocess", "classifier", "postprocess"):
        config = (repo / name / "config.pbtxt").read_text()
        assert 'backend: "python"' in config and "dynamic_batching" in config and "max_batch_size: 8" in config
        assert "class TritonPythonModel" in (repo / name / "1" / "model.py").read_text()


def test_kiln_serves_the_pipeline_with_the_reference_answer(tmp_path):
    """The stock gRPC client against a real Kiln server on the repository: the numpy reference's answer."""
    repo = pipeline_bench.write_repository(tmp_path / "repo")
    images = np.random.default_rng(7).integers(0, 256, (3, *pipeline_bench.IMAGE_SHAPE), dtype=np.uint8)
    with run_server(repo, tmp_path / "kiln.log", None) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            tensor = grpcclient.InferInput("IMAGE", list(images.shape), "UINT8")
            tensor.set_data_from_numpy(images)
            result = client.infer("pipeline", [tensor])
        finally:
            client.close()
    probabilities, top = pipeline_bench.reference(images)
    np.testing.assert_allclose(result.as_numpy("PROBABILITIES"), probabilities, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(result.as_numpy("CLASS"), top)
    assert result.as_numpy("CLASS").shape == (3, 1)


@pytest.mark.parametrize("servers", [["kiln"], ["kiln", "triton"]], ids=["kiln", "kiln_and_triton"])
def test_quick_bench_writes_rows_and_a_summary(tmp_path, servers):
    """One quick round (0.3 s windows, c=2): every server that can run here answers without errors and the JSON
    has its rows and the per-level summary (Kiln over Triton where both ran)."""
    if "triton" in servers and pipeline_bench.available("triton"):
        pytest.skip(f"no Triton here: {pipeline_bench.available('triton')}")
    document = pipeline_bench.bench(servers, 1, "2", tmp_path / "out", quick=True, work=tmp_path / "work")
    written = json.loads((tmp_path / "out").joinpath(document["path"].rsplit("/", 1)[1]).read_text())
    assert written["benchmark"] == "pipeline_cpu" and written["protocol"] == "grpc"
    assert {r["server"] for r in written["rows"]} == set(servers)
    assert all(r["errors"] == 0 and r["requests_per_s"] > 0 for r in written["rows"])
    summary = written["summary"][0]
    assert summary["concurrency"] == 2 and all(summary[name]["requests_per_s"] > 0 for name in servers)
    assert ("kiln_over_triton" in summary) == ("triton" in servers)
