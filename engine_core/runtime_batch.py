"""``ExecutionContext.infer_batch``: several requests' feeds run as one batch (see ``infer_batch``).

``BatchExecution`` is a mixin that ``engine_core.runtime.ExecutionContext`` inherits; it checks the parts against
the context's engine, I/O names and input shapes and hands the batch to the context's backend state
(``ContextState.infer_parts``: the CPU backend's gathers and runs through ``infer``). This module does not import the
runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_core.batching import row_spans
from engine_core.cuda.view import DeviceRows, DeviceView
from engine_core.errors import ShapeError


class BatchExecution:
    """The batch path of ``ExecutionContext`` (``infer_batch`` and its checks)."""

    if TYPE_CHECKING:  # what the batch path reads of the context (ExecutionContext sets these)
        engine: Any  # CudaEngine
        profiler: Any  # IProfiler | None
        _backend_context: Any  # the backend's context state (engine_core.backends.base.ContextState)
        _inferred: dict[str, Any] | None
        _input_names: list[str]
        _output_names: list[str]
        _input_shapes: dict[str, tuple[int, ...]]

        def check_input_shape(self, name: str, shape: Sequence[int]) -> tuple[int, ...]: ...

        def infer(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]: ...

        def infer_shapes(self) -> list[str]: ...

    def infer_batch(self, parts: Sequence[Mapping[str, np.ndarray | DeviceView]], pad_to: int | None = None,
                    destinations: Sequence[Mapping[str, DeviceView]] | None = None) -> list[dict[str, np.ndarray]]:
        """Run several requests' feeds as one batch and hand each its share of the outputs.

        ``parts``: per request, every input as a numpy array or a ``DeviceView`` (CUDA backend), all with a
        leading batch dim and the same dims after it. Each input's parts are gathered along axis 0 straight
        into the run's input buffer (CUDA: host parts through its pinned mirror, device parts device to
        device), rows up to ``pad_to`` (None: no padding) are zero, and the batch runs once. Part i gets its
        rows of every output whose leading dim is the total batch, every other output whole (a copy).
        ``destinations`` (CUDA backend): per part, output name -> DeviceView; that part's piece of the output
        is copied there on the device (complete when this returns) and left out of its dict.
        Why: no concatenation or padding copies on the host, and at a padded total batch the run uses the
        same buffers, so the same CUDA graph, as ``infer`` and ``warm_up`` at that batch.
        Raises ShapeError / TypeError naming the input (as ``infer``) or the output and part (destinations).
        """
        parts = list(parts)
        if not parts:
            return []
        inputs, rows = self._batch_inputs(parts)
        used = sum(rows)
        total = used if pad_to is None else int(pad_to)
        if total < used:
            raise ValueError(f"pad_to {pad_to} is below the {used} rows of the parts")
        targets = self._batch_destinations(destinations, len(parts))
        for name, values in inputs.items():
            self._input_shapes[name] = self.check_input_shape(name, (total, *values[0].shape[1:]))
        self._inferred = None
        return self._backend_context.infer_parts(self, inputs, row_spans(rows), total, targets)

    def infer_rows(self, inputs: Mapping[str, np.ndarray | DeviceRows], pad_to: int | None = None,
                   destinations: Mapping[str, DeviceRows] | None = None) -> dict[str, np.ndarray]:
        """Run one batch given whole: each input a host array of all its rows, or ``DeviceRows`` (many parts' rows
        at their own device addresses, CUDA backend), all with the same row count; rows up to ``pad_to`` are zero.
        Returns every output's rows for the batch (not the padding), except the outputs in ``destinations``, which
        are written on the device to each part's address (``DeviceRows`` with the inputs' row counts per part).
        Why beside ``infer_batch``: a server's batch of many requests in shared memory costs a few numpy operations
        here, not a ``DeviceView`` and its checks per request.
        Raises ShapeError / TypeError naming the input or output, as ``infer_batch``."""
        expected = set(self._input_names)
        if set(inputs) != expected:
            raise ShapeError(f"infer_rows needs exactly the inputs {self._input_names}, got {sorted(inputs)}")
        used = None
        for name in self._input_names:
            value = inputs[name]
            tensor = self.engine._tensor(name)
            if tensor.kind != "tensor" or self.engine.is_shape_inference_io(name):
                raise TypeError(f"input '{name}' is not a tensor input: run such engines with infer")
            if value.dtype != tensor.dtype:
                raise TypeError(f"input '{name}' has dtype {value.dtype}, the engine expects {tensor.dtype}")
            if not len(value.shape):
                raise ShapeError(f"input '{name}' is a scalar; infer_rows needs a leading batch dim")
            if used not in (None, value.shape[0]):
                raise ShapeError(f"the inputs have different row counts ({used} and {value.shape[0]} for '{name}')")
            used = int(value.shape[0])
        assert used is not None
        total = used if pad_to is None else int(pad_to)
        if total < used:
            raise ValueError(f"pad_to {pad_to} is below the batch's {used} rows")
        targets = dict(destinations or {})
        for name, rows in targets.items():
            if name not in self._output_names:
                raise ShapeError(f"destination '{name}' is not an output of this engine (outputs: {self._output_names})")
            if not isinstance(rows, DeviceRows) or rows.dtype != self.engine._tensor(name).dtype:
                raise TypeError(f"destination of output '{name}' must be DeviceRows of "
                                f"{self.engine._tensor(name).dtype}")
            if rows.shape[0] != used:
                raise ShapeError(f"destination of output '{name}' holds {rows.shape[0]} rows, the batch has {used}")
        for name in self._input_names:
            self._input_shapes[name] = self.check_input_shape(name, (total, *inputs[name].shape[1:]))
        self._inferred = None
        outputs: dict[str, np.ndarray] = self._backend_context.infer_parts(
            self, {name: [inputs[name]] for name in self._input_names}, [(0, used)], total, [targets])[0]
        return outputs

    def _batch_inputs(self, parts: Sequence[Mapping[str, Any]]) -> tuple[dict[str, list[Any]], list[int]]:
        """Each input's parts in order and each part's rows, checked as ``infer`` checks one feed. A part that
        is a numpy array of the engine's dtype takes the short path: batches of many one-row requests spend
        a few checks per part, not a conversion."""
        names = self._input_names
        expected = set(names)
        dtypes = {name: self.engine._tensor(name).dtype for name in names}
        inputs: dict[str, list[Any]] = {name: [] for name in names}
        tails: dict[str, tuple[int, ...]] = {}
        rows = []
        for index, part in enumerate(parts):
            if part.keys() != expected:
                unknown = set(part) - expected
                if unknown:
                    raise ShapeError(f"part {index}: unknown inputs {sorted(unknown)}; this engine takes {names}")
                raise ShapeError(f"part {index}: missing inputs {[n for n in names if n not in part]}")
            count = -1
            for name in names:
                value = part[name]
                if type(value) is not np.ndarray or value.dtype != dtypes[name] or not value.ndim or index == 0:
                    value = self._batch_part(name, index, value)
                shape = tuple(value.shape)
                tail = tails.setdefault(name, shape[1:])
                if shape[1:] != tail:
                    raise ShapeError(f"input '{name}': part {index} has shape {list(shape)} and part 0 "
                                     f"{list(inputs[name][0].shape)}; the dims after the batch dim must agree")
                if count not in (-1, shape[0]):
                    raise ShapeError(f"part {index}: its inputs have different batch sizes "
                                     f"{sorted({count, shape[0]})}")
                count = shape[0]
                inputs[name].append(value)
            rows.append(max(count, 0))
        return inputs, rows

    def _batch_part(self, name: str, index: int, value: Any) -> np.ndarray | DeviceView:
        """One part of input ``name``: a tensor of the engine's dtype with a batch dim."""
        tensor = self.engine._tensor(name)
        if tensor.kind != "tensor" or self.engine.is_shape_inference_io(name):
            raise TypeError(f"input '{name}' is a {'shape input' if tensor.kind == 'tensor' else tensor.kind}: "
                            "infer_batch stacks tensors along their batch dim; run such engines with infer")
        if not isinstance(value, DeviceView):
            value = np.asarray(value)
            if value.dtype.kind in "OSU" and tensor.dtype.kind == "O":
                value = value.astype(object)
        if value.dtype != tensor.dtype:
            raise TypeError(f"input '{name}' of part {index} has dtype {value.dtype}, the engine expects {tensor.dtype}")
        if not value.shape:
            raise ShapeError(f"input '{name}' of part {index} is a scalar; infer_batch needs a leading batch dim")
        return value

    def _batch_destinations(self, destinations: Sequence[Mapping[str, DeviceView]] | None,
                            count: int) -> list[Mapping[str, DeviceView]]:
        """One (possibly empty) output name -> DeviceView mapping per part, names and dtypes checked."""
        if destinations is None:
            return [{} for _ in range(count)]
        targets = list(destinations)
        if len(targets) != count:
            raise ValueError(f"destinations has {len(targets)} entries for {count} parts")
        for index, target in enumerate(targets):
            for name, view in target.items():
                if name not in self._output_names:
                    raise ShapeError(f"destination for part {index}: '{name}' is not an output of this engine "
                                     f"(outputs: {self._output_names})")
                if not isinstance(view, DeviceView):
                    raise TypeError(f"destination of output '{name}' for part {index} is a {type(view).__name__}, "
                                    "not a DeviceView")
                dtype = self.engine._tensor(name).dtype
                if view.dtype != dtype:
                    raise TypeError(f"destination of output '{name}' for part {index} has dtype {view.dtype}, "
                                    f"the engine's output is {dtype}")
        return targets
