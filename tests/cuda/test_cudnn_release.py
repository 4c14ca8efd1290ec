"""cuDNN frontend objects (nanobind) are released before the interpreter finalizes nanobind: contexts a program
keeps until exit (a server's) no longer print "nanobind: leaked N instances" at shutdown."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_exit_hook_drops_graphs_of_convs_still_alive():
    """Without a GPU: a CudnnConvs kept in a global until exit has its built graphs dropped by the atexit hook,
    before module teardown (the checker, registered first, runs after the hook: atexit is last in, first out)."""
    result = _run("""
        import atexit
        released = []
        atexit.register(lambda: print("released before teardown" if released else "still held at exit"))

        from engine_core.backends.cuda import cudnn_conv, cudnn_graph

        class Graph:  # stands in for a cuDNN frontend graph
            def __del__(self):
                released.append(True)

        convs = cudnn_conv.CudnnConvs.__new__(cudnn_conv.CudnnConvs)  # no cuDNN handle needed here
        convs._built, convs._fusable, convs._unfusable = {("key", 0): Graph()}, {"key"}, set()
        cudnn_graph._LIVE.add(convs)
        KEPT = convs
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "released before teardown", result.stdout + result.stderr


@pytest.mark.gpu
def test_no_leaked_cudnn_instances_at_exit_with_a_context_kept_alive():
    from engine_core.backends.cuda.cudnn_conv import available

    if not available():
        pytest.skip("needs the cuDNN frontend (pip install kiln[gpu])")
    result = _run("""
        import engine_core as kiln
        from tests.cuda.models import build_engine, resnet_small, small_model_feeds, small_model_profiles

        ENGINES, CONTEXTS = [], []  # kept until exit, as a server keeps its models
        for flags in ([], [kiln.BuilderFlag.TF32]):  # strict fp32 (NCHW graphs) and TF32 (NHWC graphs)
            engine = build_engine(resnet_small(), "cuda", small_model_profiles("resnet50"), flags=flags)
            context = engine.create_execution_context()
            for seed in range(3):  # eager, captured, replayed
                context.infer(small_model_feeds("resnet50", 2, seed))
            ENGINES.append(engine)
            CONTEXTS.append(context)
        assert "conv:cudnn" in {layer["tactic"] for layer in ENGINES[0].plan.layers}
        print("ran")
    """)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ran")
    assert "leaked" not in result.stderr, result.stderr[-4000:]
