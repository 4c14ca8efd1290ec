"""The server's GPU execution path: every batch bucket is bound and captured when the model loads, so live
requests of any batch size replay a CUDA graph without binding anything; batched jobs are gathered by the
engine and answered exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from server import plan_cache
from server.core import execution
from server.core.model import load_model_version
from server.core.model_config import parse_config_text
from server.repository import read_source
from tests.cuda.models import mlp
from tests.server.conftest import examples

pytestmark = pytest.mark.gpu

CONFIG = ('name: "mlp"\nmax_batch_size: 16\ninput [{ name: "x" data_type: TYPE_FP32 dims: [ 64 ] }]\n'
          'output [{ name: "y" data_type: TYPE_FP32 dims: [ 32 ] }]\n'
          'instance_group [{ count: 2 kind: KIND_GPU }]\ndynamic_batching { }\n')


def _state(context):
    return context._backend_context


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The version with its contexts in this process (KILN_EXECUTOR=thread), so the tests can look inside them;
    an executor process runs the same contexts the same way (tests/server/test_executor_process.py)."""
    monkeypatch.setenv("KILN_EXECUTOR", "thread")
    monkeypatch.setattr(plan_cache, "_default", plan_cache.PlanCache(tmp_path / "plans"))
    directory = examples.write_model(tmp_path / "models", "mlp", mlp(), CONFIG)
    source = read_source("mlp", directory)
    version = load_model_version(source, 1, parse_config_text(source.config_text, "mlp"), 4)
    yield version
    version.close()


def test_every_bucket_is_captured_at_load_and_live_batches_only_replay(model):
    contexts = list(dict.fromkeys(model.workers.initial))
    assert model.engine.backend == "cuda" and len(contexts) == 2
    assert len(model.workers.initial) == 4  # two workers (lanes) per CUDA context: one gathers while one runs
    buckets = execution.batch_buckets(16)
    for context in contexts:
        state = _state(context)
        assert len(state._bindings) == len(buckets)
        assert all(binding.verified and binding.graphs for binding in state._bindings.values())
    context = contexts[0]
    state = _state(context)
    bindings, replays = len(state._bindings), state.graph_replays
    rng = np.random.default_rng(0)
    reference = model.engine.create_execution_context()
    for rows in (1, 3, 5, 16, 7):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        out = model.execute(context, {"x": x})["y"]
        np.testing.assert_allclose(out, reference.infer({"x": x})["y"], rtol=2e-3, atol=2e-3)
        assert out.shape[0] == rows
    assert len(state._bindings) == bindings  # no new binding: every size ran in a bucket bound at load
    assert state.graph_replays == replays + 5  # and each run was one graph launch


def test_jobs_of_a_batch_are_gathered_by_the_engine(model):
    context = list(dict.fromkeys(model.workers.initial))[1]
    rng = np.random.default_rng(1)
    parts = [{"x": rng.standard_normal((n, 64)).astype(np.float32)} for n in (2, 1, 3)]
    before = _state(context).graph_replays
    outs = execution.execute_parts(context, parts, bucketed=True)
    assert _state(context).graph_replays == before + 1  # six rows ran once, in the bucket of 8
    reference = model.engine.create_execution_context()
    for part, out in zip(parts, outs):
        np.testing.assert_allclose(out["y"], reference.infer(part)["y"], rtol=2e-3, atol=2e-3)


def test_a_job_of_parts_reads_and_writes_each_members_device_memory(model):
    """A group of requests in CUDA shared memory is one batcher job of parts (server/core/part_groups.py): the
    engine gathers each member's rows from its own device memory and writes its outputs back there."""
    import asyncio

    import engine_core as kiln
    from engine_core.cuda.driver import DeviceBuffer
    from server.core.scheduler import Job

    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((n, 64)).astype(np.float32) for n in (2, 1, 3)]
    sources = [DeviceBuffer.from_array(x) for x in xs]
    targets = [DeviceBuffer(x.shape[0] * 32 * 4) for x in xs]
    parts = [({"x": kiln.DeviceView(s.ptr, x.shape, np.float32)},
              {"y": kiln.DeviceView(t.ptr, (x.shape[0], 32), np.float32)}) for x, s, t in zip(xs, sources, targets)]
    parts[1] = (parts[1][0], {})  # this member's output comes back on the host
    plain = rng.standard_normal((2, 64)).astype(np.float32)

    async def go():
        group = model.scheduler.enqueue(Job(parts[0][0], 6, requests=3, parts=parts))
        alone = model.scheduler.enqueue(Job({"x": plain}, 2))
        return await group, await alone

    group, alone = asyncio.run(go())
    reference = model.engine.create_execution_context()
    want = [reference.infer({"x": x})["y"] for x in xs]
    assert [list(outputs) for outputs in group.outputs] == [[], ["y"], []]
    np.testing.assert_allclose(group.outputs[1]["y"], want[1], rtol=2e-3, atol=2e-3)
    for index in (0, 2):
        got = targets[index].to_array(np.float32, (xs[index].shape[0], 32))
        np.testing.assert_allclose(got, want[index], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(alone.outputs["y"], reference.infer({"x": plain})["y"], rtol=2e-3, atol=2e-3)
