"""Warm-up when a model version loads, so that no live request pays for binding, kernel choice or graph capture.

- **Batch buckets** (CUDA models that batch, every non-batch dim fixed): every bucket the model runs at
  (`execution.batch_buckets`) is bound and its CUDA graph captured and verified on every instance
  (`ExecutionContext.warm_up`). Without it the first request of each bucket size took the lowering, the cuDNN
  plan builds and the capture: hundreds of ms, on live traffic. Config parameter `kiln_warmup_buckets: "false"`
  skips it (faster loads, slow first requests).
- **`model_warmup`** (Triton's config field): each sample runs `count` times (once when 0) on every instance,
  with zero, random or file data; files are read from `<model>/warmup/` as raw tensor bytes (BYTES elements
  length-prefixed), as Triton reads them. A sample that does not fit the model fails the load, naming it.
- **Inline priming** (CPU models): fast models run their batches on the event loop once the scheduler has timed
  enough fast executions; `prime_inline` makes those at load, so the first live requests skip the thread hand-offs.
Warm-up executions are not counted in the model's statistics (as in Triton).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from server.protos import model_config_pb2

from . import execution
from .errors import ServerError, invalid
from .model_config import ModelConfig, bool_parameter, model_shape
from .scheduler import INLINE_AFTER, Job
from .sequence_config import server_filled_inputs
from .statistics import ModelStatistics
from .tensors import element_count, from_raw
from .types import DATATYPE_OF_CONFIG_TYPE, InferInput, InferRequest, numpy_dtype

log = logging.getLogger("kiln.server.warmup")

# Model config parameter: "false" skips binding and capturing every batch bucket at load (see the module docstring).
WARMUP_BUCKETS = "kiln_warmup_buckets"


def warm_up_buckets(config: ModelConfig, contexts: list, engine) -> int:
    """Bind every batch bucket on every context; returns how many bindings were prepared (0 when skipped)."""
    wanted = bool_parameter(config, WARMUP_BUCKETS, default=True)
    if not wanted or engine.backend != "cuda" or config.max_batch_size <= 0:
        return 0
    items = {t.name: tuple(model_shape(t)) for t in [*config.input, *server_filled_inputs(config)]}
    if any(d < 0 for dims in items.values() for d in dims):
        log.info("model '%s': variable non-batch dims, so batch buckets are bound on first use", config.name)
        return 0
    started = time.perf_counter()
    highest = execution.highest_batch(engine, list(items))
    buckets = execution.batch_buckets(highest)
    for context in contexts:
        for bucket in reversed(buckets):  # largest first: a larger cuDNN workspace would drop earlier graphs
            shapes = {name: (bucket, *dims) for name, dims in items.items()}
            execution.use_profile_for(context, shapes)
            context.warm_up(shapes)
    log.info("model '%s': batch buckets %s bound and captured on %d instance(s) in %.1f s", config.name, buckets,
             len(contexts), time.perf_counter() - started)
    return len(buckets) * len(contexts)


def prime_inline(model, contexts: list) -> int:
    """CPU models whose executions are fast run them on the event loop once the scheduler has timed `INLINE_AFTER`
    fast ones in a row (`scheduler.Workers.runs_inline`); before that each batch goes to a worker thread and back.
    So that the first live requests are not those slower hand-offs, run that many executions on zeros (batch 1)
    at load and hand the workers their times. Stops at the first slow run (such a model never runs inline), where
    zeros cannot stand for a request (strings, variable dims, sequence models) and at any error (live requests
    will say what is wrong). Returns the executions made; they are not counted in the statistics."""
    workers = model.workers
    if not workers.inline_below_ns or model.sequence is not None or not contexts:
        return 0
    zeros = _zero_inputs(model.config, model_shape)  # as the model runs them: after any reshape
    if zeros is None:
        return 0
    arrays = {name: array for name, (_, array) in zeros.items()}
    datatypes = {name: datatype for name, (datatype, _) in zeros.items()}
    runs = 0
    try:
        feeds = _feeds(model, arrays, datatypes)
        for _ in range(INLINE_AFTER):
            started = time.thread_time_ns()
            model.execute(contexts[0], feeds)
            elapsed = time.thread_time_ns() - started
            workers.timed(elapsed)
            runs += 1
            if elapsed >= workers.inline_below_ns:
                break
    except Exception as e:  # noqa: BLE001 - a model zeros do not suit: it just starts in worker threads
        log.debug("model '%s': no inline priming on zeros (%s: %s)", model.name, type(e).__name__, e)
    return runs


def run_model_warmup(model, contexts: list, directory: Path) -> None:
    """Run the config's `model_warmup` samples on every context (`model` is the ModelVersion)."""
    for sample in model.config.model_warmup:
        label = f"model '{model.name}': warmup sample '{sample.name}'"
        try:
            arrays, datatypes = sample_inputs(sample, model.config, directory, label)
            inputs = _feeds(model, arrays, datatypes)
            for context in contexts:
                for _ in range(max(sample.count, 1)):
                    model.execute(context, inputs)
        except ServerError as e:
            raise invalid(e.message if e.message.startswith(label) else f"{label} failed: {e.message}") from None
        except Exception as e:  # noqa: BLE001 - the engine's refusal, said against the sample
            raise invalid(f"{label} failed: {type(e).__name__}: {e}") from None
        log.info("%s ran %d time(s) on %d instance(s)", label, max(sample.count, 1), len(contexts))


def _feeds(model, arrays: dict[str, np.ndarray], datatypes: dict[str, str]) -> dict[str, np.ndarray]:
    """A sample's engine inputs. A sequence model's control and state inputs are the server's: taken from the
    sample where it names them (Triton hands a warm-up sample to the model as it is), the others filled as a batch
    row without a request (every control false, the initial state)."""
    settings = model.sequence
    if settings is None:
        return model.check_inputs(arrays, datatypes)[0]
    given = {name: a for name, a in arrays.items() if name in settings.server_inputs}
    inputs, batch = model.check_inputs({n: a for n, a in arrays.items() if n not in given}, datatypes)
    states = {name: np.repeat(a, batch, axis=0) if settings.batched else a
              for name, a in settings.initial_states().items()}
    return {**inputs, **settings.controls([None] * batch), **states, **given}


def sample_inputs(sample: model_config_pb2.ModelWarmup, config: ModelConfig, directory: Path,
                  label: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """One sample's request inputs (with the batch dim when the model batches) and their datatypes."""
    if not sample.inputs:
        raise invalid(f"{label} has no inputs")
    arrays, datatypes = {}, {}
    rng = np.random.default_rng(0)
    for name, spec in sample.inputs.items():
        datatype = DATATYPE_OF_CONFIG_TYPE.get(model_config_pb2.DataType.Name(spec.data_type))
        if datatype is None:
            raise invalid(f"{label}: input '{name}' has no valid data_type")
        item = _item(spec, datatype, directory, f"{label}: input '{name}'", rng)
        # Triton runs batch_size requests of one item each, all with the same data: the same rows here
        arrays[name] = np.repeat(item[None], max(sample.batch_size, 1), axis=0) if config.max_batch_size > 0 else item
        datatypes[name] = datatype
    return arrays, datatypes


def _item(spec: model_config_pb2.ModelWarmup.Input, datatype: str, directory: Path, label: str,
          rng: np.random.Generator) -> np.ndarray:
    """One batch item of a warmup input: zeros (Triton's default), random values, or the file's raw bytes."""
    shape = tuple(spec.dims)
    kind = spec.WhichOneof("input_data_type")
    if kind == "input_data_file":
        folder = (directory / "warmup").resolve()
        path = (folder / spec.input_data_file).resolve()
        if not path.is_relative_to(folder) or not path.is_file():
            raise invalid(f"{label}: data file '{spec.input_data_file}' is not a file in {folder}")
        return from_raw(path.read_bytes(), datatype, shape)
    if datatype == "BYTES":
        return np.array([b"kiln" if kind == "random_data" else b""] * element_count(shape), dtype=object).reshape(shape)
    dtype = numpy_dtype(datatype)
    if kind == "random_data":
        values = rng.random(shape) if dtype.kind == "f" else rng.integers(0, 2 if dtype.kind == "b" else 8, shape)
        return values.astype(dtype)
    return np.zeros(shape, dtype)


def zeros_request(model) -> InferRequest | None:
    """A request of zeros (one row when the model batches) for every input, or None where zeros cannot stand for
    one (strings, variable dims, sequence models, whose requests need correlation ids)."""
    if getattr(model, "sequence", None) is not None:
        return None
    zeros = _zero_inputs(model.config, lambda tensor: tensor.dims)  # as a client sends them: the config's dims
    if not zeros:
        return None
    inputs = [InferInput(name, datatype, array.shape, array) for name, (datatype, array) in zeros.items()]
    return InferRequest(model.name, inputs)


def _zero_inputs(config: ModelConfig, dims_of: Callable[[Any], Any]) -> dict[str, tuple[str, np.ndarray]] | None:
    """Every input's datatype and zeros of `dims_of(input)` (one row first when the model batches), or None when
    zeros cannot stand for an input (strings, unknown types, variable dims)."""
    zeros = {}
    for tensor in config.input:
        datatype = DATATYPE_OF_CONFIG_TYPE.get(model_config_pb2.DataType.Name(tensor.data_type))
        dims = tuple(dims_of(tensor))
        if datatype in (None, "BYTES") or any(d < 0 for d in dims):
            return None
        shape = ((1,) if config.max_batch_size > 0 else ()) + dims
        zeros[tensor.name] = (datatype, np.zeros(shape, numpy_dtype(datatype)))
    return zeros


async def prime_request_path(model, checked: Callable, outputs: Callable) -> bool:
    """One request of zeros through the core's own path (`checked`: the request checks; the scheduler and its
    batcher; `outputs`: the output conversion) before the version reports ready, kept out of its statistics and
    traffic. Why: engine warm-up leaves those code paths cold, and the first live request paid for them (CPU,
    traced: its output post-processing 0.89 ms against ~0.2 steady; issue #30 asks the first request within 1.2x of
    the hundredth). Returns whether it ran; a model zeros do not suit just starts cold (the log says why)."""
    request = zeros_request(model)
    if request is None:
        return False
    statistics = model.statistics
    model.statistics = ModelStatistics(model.name, str(model.version))  # thrown away
    try:
        inputs, batch, requested = checked(model, request)
        result = await model.scheduler.enqueue(Job(inputs, batch, outputs=tuple(o.name for o in requested)))
        outputs(model, requested, result.outputs, {})
    except Exception as e:  # noqa: BLE001 - a model zeros do not suit: its first live request says what is wrong
        log.debug("model '%s': no request-path priming on zeros (%s: %s)", model.name, type(e).__name__, e)
        return False
    finally:
        model.statistics = statistics
    return True
