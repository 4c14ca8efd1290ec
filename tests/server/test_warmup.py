"""Warm-up at load: Triton's `model_warmup` samples (zero, random and file data) run on every instance before
the model is READY, a sample that does not fit fails the load naming it, and warm-up is not counted in the
model's statistics. (Batch-bucket capture is a CUDA feature: tests/cuda/test_serving_gpu.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from server import plan_cache
from server.core.errors import ServerError
from server.core.model import load_model_version
from server.core.model_config import parse_config_text
from server.core.scheduler import INLINE_AFTER
from server.core.warmup import warm_up_buckets
from server.repository import read_source

from .conftest import examples


def _double() -> onnx.ModelProto:
    nodes = [helper.make_node("Add", ["X", "X"], ["Y"])]
    graph = helper.make_graph(nodes, "double", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _config(warmup: str, instances: int = 2) -> str:
    return ('name: "double"\nmax_batch_size: 8\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }]\n'
            'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }]\n'
            f'instance_group [{{ count: {instances} kind: KIND_CPU }}]\n{warmup}\n')


class _Counting:
    """Wraps an execution context and counts the inputs it runs."""

    def __init__(self, context) -> None:
        self.context, self.seen = context, []

    def __getattr__(self, name: str):
        return getattr(self.context, name)

    def infer(self, feeds):
        self.seen.append({k: np.array(v) for k, v in feeds.items()})
        return self.context.infer(feeds)


@pytest.fixture
def load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """load(config_text, files) -> ModelVersion, counting what every instance ran during warm-up."""
    monkeypatch.setattr(plan_cache, "_default", plan_cache.PlanCache(tmp_path / "plans"))
    contexts: list[_Counting] = []
    from engine_core.runtime import CudaEngine

    real = CudaEngine.create_execution_context

    def counting(self, *args, **kwargs):
        contexts.append(_Counting(real(self, *args, **kwargs)))
        return contexts[-1]

    monkeypatch.setattr(CudaEngine, "create_execution_context", counting)

    def go(config: str, files: dict[str, bytes] | None = None):
        directory = examples.write_model(tmp_path / "models", "double", _double(), config)
        for name, data in (files or {}).items():
            (directory / "warmup").mkdir(exist_ok=True)
            (directory / "warmup" / name).write_bytes(data)
        source = read_source("double", directory)
        return load_model_version(source, 1, parse_config_text(source.config_text, "double"), 4), contexts

    return go


def test_samples_run_count_times_on_every_instance_with_their_data(load):
    row = np.array([1, 2, 3, 4], np.float32)
    config = _config('model_warmup [\n'
                     '  { name: "zeros" batch_size: 2 count: 3 inputs { key: "X" value { data_type: TYPE_FP32 '
                     'dims: [ 4 ] zero_data: true } } },\n'
                     '  { name: "file" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 4 ] '
                     'input_data_file: "row.bin" } } },\n'
                     '  { name: "random" batch_size: 4 inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 4 ] '
                     'random_data: true } } }\n]')
    model, contexts = load(config, {"row.bin": row.tobytes()})
    assert len(contexts) == 2
    for index, context in enumerate(contexts):
        shapes = [seen["X"].shape for seen in context.seen]
        primed = INLINE_AFTER if index == 0 else 0  # prime_inline's zero rows, on the first instance only
        assert shapes == [(2, 4)] * 3 + [(1, 4), (4, 4)] + [(1, 4)] * primed
        assert not context.seen[0]["X"].any()
        np.testing.assert_array_equal(context.seen[3]["X"], row[None])
        assert context.seen[4]["X"].std() > 0  # random, not zeros
    stats = model.statistics.as_dict()
    assert stats["inference_count"] == 0 and stats["execution_count"] == 0  # warm-up is not traffic
    model.close()


@pytest.mark.parametrize("sample, message", [
    ('{ name: "wide" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 5 ] zero_data: true } } }',
     "warmup sample 'wide' failed: unexpected shape for input 'X'"),
    ('{ name: "typed" batch_size: 1 inputs { key: "X" value { data_type: TYPE_INT32 dims: [ 4 ] zero_data: true } } }',
     "warmup sample 'typed' failed: inference input 'X' data-type is 'INT32'"),
    ('{ name: "nofile" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 4 ] '
     'input_data_file: "../config.pbtxt" } } }', "warmup sample 'nofile': input 'X': data file '../config.pbtxt'"),
    ('{ name: "short" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 4 ] '
     'input_data_file: "short.bin" } } }', "warmup sample 'short' failed"),
    ('{ name: "empty" batch_size: 1 }', "warmup sample 'empty' has no inputs"),
])
def test_a_sample_that_does_not_fit_fails_the_load_naming_it(load, sample: str, message: str):
    with pytest.raises(ServerError) as error:
        load(_config(f"model_warmup [ {sample} ]"), {"short.bin": b"\0" * 12})
    assert message in error.value.message


def test_bucket_warmup_is_for_cuda_models_and_checks_its_parameter(load):
    model, contexts = load(_config(""))
    seen = [len(c.seen) for c in contexts]
    assert warm_up_buckets(model.config, contexts, model.engine) == 0  # CPU plans run numpy on actual shapes
    assert [len(c.seen) for c in contexts] == seen
    model.close()
    with pytest.raises(ServerError, match="kiln_warmup_buckets must be 'true' or 'false'"):
        load(_config('parameters { key: "kiln_warmup_buckets" value { string_value: "sometimes" } }'))


def test_a_fast_cpu_model_is_primed_to_run_inline_from_its_first_request(load):
    """The scheduler runs a fast CPU model's batches on the event loop after INLINE_AFTER fast executions; the load
    makes them on zeros, so live requests start there. Not traffic: the statistics stay empty."""
    model, contexts = load(_config(""))
    assert model.workers.runs_inline()
    first = [seen["X"] for seen in contexts[0].seen]
    assert len(first) == INLINE_AFTER and all(x.shape == (1, 4) and not x.any() for x in first)
    assert not contexts[1].seen and model.statistics.as_dict()["execution_count"] == 0
    model.close()


def test_priming_stops_at_a_slow_execution(load, monkeypatch):
    monkeypatch.setattr("server.core.warmup.time.thread_time_ns", iter(range(0, 10**12, 5 * 10**6)).__next__)
    model, contexts = load(_config(""))  # every execution "takes" 5 ms of CPU: slower than inline allows
    assert len(contexts[0].seen) == 1 and not model.workers.runs_inline()
    model.close()
