"""The CUDA runner's run schedule without a GPU: weight-streaming uploads, input-consumed event and
debug-listener positions (``runner.run_schedule``), executed by a two-queue stream/event model over
the numpy emulation of every launch. Why: the GPU path interprets exactly this action list, so the
ordering bugs streaming invites (a slot refilled before its reader ran, a layer reading a slot before
its upload) show up here on every CI machine, under both extreme interleavings of the two streams."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from onnx import TensorProto, helper

import engine_core as kiln
from engine_core.backends.cuda.lowering import lower_graph
from engine_core.backends.cuda.runner import (
    COMPUTE,
    COPY,
    RunSchedule,
    debug_positions,
    last_input_reader,
    run_schedule,
    streamed_reads,
)
from engine_core.ops import TensorInfo
from engine_core.passes import PIPELINE, infer_shapes
from engine_core.types import BuilderFlag
from tests.cuda.emulate import Emulator
from tests.cuda.models import _model, mlp, vi

GARBAGE = 0xA7  # slot bytes before any upload: stale reads turn into wrong numbers, never into zeros


def _lowered(model, shapes):
    net = kiln.Builder().create_network()
    assert kiln.OnnxParser(net).parse(model)
    graph = copy.deepcopy(net.graph)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    infos = infer_shapes(graph, {v.name: TensorInfo(v.dtype, shapes[v.name]) for v in graph.inputs}, values=True)
    return graph, lower_graph(graph, infos)


def tied_mlp(d: int = 48, seed: int = 1):
    """x -> MatMul(W) -> Relu -> MatMul(W) (the same weight twice) -> Add(b) -> Add(x) (x read again at the end)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
    b = rng.standard_normal(d).astype(np.float32)
    n = helper.make_node
    nodes = [n("MatMul", ["x", "W"], ["h"], name="mm1"), n("Relu", ["h"], ["r"], name="relu"),
             n("MatMul", ["r", "W"], ["m"], name="mm2"), n("Add", ["m", "b"], ["a"], name="bias"),
             n("Add", ["a", "x"], ["y"], name="residual")]
    return _model(nodes, [vi("x", TensorProto.FLOAT, ["B", d])], [vi("y", TensorProto.FLOAT, ["B", d])],
                  [("W", w), ("b", b)])


def chain(d: int = 32, layers: int = 4, seed: int = 2):
    """x -> (MatMul(W_i) -> Tanh) x layers: one streamed step per layer, so slots are reused."""
    rng = np.random.default_rng(seed)
    n, nodes, inits, prev = helper.make_node, [], [], "x"
    for i in range(layers):
        inits.append((f"W{i}", (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)))
        nodes += [n("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"mm{i}"), n("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}")]
        prev = f"t{i}"
    nodes.append(n("Identity", [prev], ["y"], name="out"))
    return _model(nodes, [vi("x", TensorProto.FLOAT, ["B", d])], [vi("y", TensorProto.FLOAT, ["B", d])], inits)


def _weight_sizes(graph, lowered, names=None) -> dict[str, int]:
    keys = {loc[1] for loc in lowered.locations.values() if loc[0] == "weight"}
    sizes = {k: int(np.asarray(graph.constants[k]).nbytes) for k in keys if k in graph.constants}
    return {k: v for k, v in sizes.items() if v and (names is None or k in names)}


class StreamedEmulator(Emulator):
    """The emulator with streamed weights absent from 'device' memory: they exist only in the two slots,
    at the (slot, offset) the schedule gives the step being run."""

    def __init__(self, graph, lowered, feeds, schedule: RunSchedule) -> None:
        super().__init__(graph, lowered, feeds)
        self.schedule = schedule
        self.host = {}
        for sstep in schedule.streaming.steps:
            for upload in sstep.uploads:  # only in "host memory" from now on
                if upload.weight not in self.host:
                    self.host[upload.weight] = self.buffers.pop(("weight", upload.weight))
        self.slots = [np.full(max(n, 1), GARBAGE, np.uint8) for n in schedule.streaming.slot_bytes]
        self.current: dict[str, tuple[int, int]] = {}

    def bytes_at(self, ref):
        kind, key = self.lowered.locations[ref.tensor]
        if kind == "weight" and ("weight", key) not in self.buffers:
            assert key in self.current, f"step reads streamed weight '{key}' without an upload for it"
            slot, offset = self.current[key]
            return self.slots[slot][offset + ref.offset:]
        return super().bytes_at(ref)

    def upload(self, k: int) -> None:
        sstep = self.schedule.streaming.steps[k]
        for u in sstep.uploads:
            self.slots[sstep.slot][u.offset:u.offset + u.nbytes] = self.host[u.weight][:u.nbytes]

    def step(self, index: int) -> None:
        self.current = self.schedule.streamed.get(index, {})
        for key, (slot, offset) in self.current.items():  # the bytes a layer reads must be its weight's
            host = self.host[key]
            assert np.array_equal(self.slots[slot][offset:offset + host.size], host), (index, key)
        for op in self.lowered.steps[index].ops:
            getattr(self, "_" + type(op).__name__.lower())(op)

    def outputs(self) -> dict[str, np.ndarray]:
        out = {}
        for name in self.graph.output_names:
            info = self.lowered.infos[name]
            out[name] = self.buffers[("io", name)].view(info.dtype).reshape(info.shape).copy()
        return out


def execute(schedule: RunSchedule, machine: StreamedEmulator, prefer: str) -> list[tuple]:
    """Run the actions as CUDA would: two in-order queues; a wait blocks its queue until the last record of
    that event enqueued before the wait has executed. ``prefer``: the queue that advances whenever both can
    (COPY: uploads run as early as the events allow; COMPUTE: as late). Returns the host-side events
    (("consumed", completed steps), ("debug", name, completed steps)) in the order the host saw them."""
    queues: dict[str, list] = {COMPUTE: [], COPY: []}
    records: dict[str, int] = {}  # event -> how many records were enqueued
    host_seen = []
    for action in schedule.actions:
        kind = action[0]
        if kind == "record":
            records[action[2]] = records.get(action[2], 0) + 1
            queues[action[1]].append(("record", action[2], records[action[2]]))
        elif kind == "wait":
            queues[action[1]].append(("wait", action[2], records.get(action[2], 0)))
        elif kind == "upload":
            queues[COPY].append(action)
        elif kind == "step":
            queues[COMPUTE].append(action)
        else:  # host-side actions: note how far the compute queue is enqueued at that point
            queues[COMPUTE].append(("host", *action))
    done: dict[str, int] = {}
    completed_steps = 0
    order = [prefer, COPY if prefer == COMPUTE else COMPUTE]
    while queues[COMPUTE] or queues[COPY]:
        for name in order:
            queue = queues[name]
            if not queue:
                continue
            head = queue[0]
            if head[0] == "wait" and done.get(head[1], 0) < head[2]:
                continue
            queue.pop(0)
            if head[0] == "record":
                done[head[1]] = head[2]
            elif head[0] == "upload":
                machine.upload(head[1])
            elif head[0] == "step":
                machine.step(head[1])
                completed_steps += 1
            elif head[0] == "host":
                host_seen.append((*head[1:], completed_steps))
            break
        else:
            raise AssertionError(f"deadlock: compute waits {queues[COMPUTE][:1]}, copy waits {queues[COPY][:1]}")
    return host_seen


def _check_streamed_equals_resident(model, feeds, names=None):
    shapes = {k: v.shape for k, v in feeds.items()}
    graph, lowered = _lowered(model, shapes)
    want = Emulator(graph, lowered, feeds).run()
    schedule = run_schedule(lowered, _weight_sizes(graph, lowered, names), graph.input_names)
    assert schedule.uses_copy_stream
    for prefer in (COPY, COMPUTE):
        machine = StreamedEmulator(graph, lowered, feeds, schedule)
        execute(schedule, machine, prefer)
        got = machine.outputs()
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{name} ({prefer} first)")
    return graph, lowered, schedule


def test_streaming_every_weight_gives_the_resident_outputs_under_both_interleavings():
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    graph, lowered, schedule = _check_streamed_equals_resident(mlp(), {"x": x})
    uploaded = {u.weight for s in schedule.streaming.steps for u in s.uploads}
    assert uploaded == set(_weight_sizes(graph, lowered)) and len(uploaded) == 4
    assert [s.slot for s in schedule.streaming.steps] == [i % 2 for i in range(len(schedule.streaming.steps))]
    actions = schedule.actions
    assert actions[:2] == (("record", COMPUTE, "start"), ("wait", COPY, "start"))  # fork: orders after the last run
    for k, sstep in enumerate(schedule.streaming.steps):  # each layer waits for its upload, right before it
        at = actions.index(("step", sstep.layer_index))
        assert actions[at - 1] == ("wait", COMPUTE, f"ready{k}")
        upload = actions.index(("upload", k))
        assert upload < at and actions[upload + 1] == ("record", COPY, f"ready{k}")
        if sstep.issue_after >= 0:  # a slot is refilled only after its previous reader
            assert actions[upload - 1] == ("wait", COPY, f"done{sstep.issue_after}")
            assert actions.index(("record", COMPUTE, f"done{sstep.issue_after}")) < upload - 1


def test_a_tied_weight_is_uploaded_for_each_reader_and_partial_streaming_keeps_the_rest_resident():
    x = np.random.default_rng(1).standard_normal((3, 48)).astype(np.float32)
    _, _, schedule = _check_streamed_equals_resident(tied_mlp(), {"x": x})
    assert [u.weight for s in schedule.streaming.steps for u in s.uploads].count("W") == 2
    _, _, only_w = _check_streamed_equals_resident(tied_mlp(), {"x": x}, names={"W"})
    assert {u.weight for s in only_w.streaming.steps for u in s.uploads} == {"W"}
    assert only_w.streaming.slot_bytes == (48 * 48 * 4, 48 * 48 * 4)


def test_the_checker_catches_a_slot_refilled_before_its_reader_and_a_missing_upload_wait():
    x = np.random.default_rng(2).standard_normal((3, 32)).astype(np.float32)
    _check_streamed_equals_resident(chain(), {"x": x})
    graph, lowered = _lowered(chain(), {"x": x.shape})
    schedule = run_schedule(lowered, _weight_sizes(graph, lowered), graph.input_names)
    assert [s.issue_after >= 0 for s in schedule.streaming.steps] == [False, False, True, True]  # slots reused

    def without(predicate) -> RunSchedule:
        kept = tuple(a for a in schedule.actions if not predicate(a))
        return RunSchedule(kept, schedule.streamed, schedule.streaming, schedule.events)

    no_reuse_wait = without(lambda a: a[0] == "wait" and a[1] == COPY and a[2].startswith("done"))
    with pytest.raises(AssertionError):  # uploads run ahead and overwrite a slot still to be read
        execute(no_reuse_wait, StreamedEmulator(graph, lowered, {"x": x}, no_reuse_wait), COPY)
    no_ready_wait = without(lambda a: a[0] == "wait" and a[1] == COMPUTE)
    with pytest.raises(AssertionError):  # a layer runs before its weights arrived
        execute(no_ready_wait, StreamedEmulator(graph, lowered, {"x": x}, no_ready_wait), COMPUTE)


def test_without_streaming_or_options_a_run_is_just_its_steps():
    graph, lowered = _lowered(mlp(), {"x": (2, 64)})
    schedule = run_schedule(lowered, {}, graph.input_names)
    assert schedule.actions == tuple(("step", i) for i in range(len(lowered.steps)))
    assert not schedule.uses_copy_stream and schedule.events == () and schedule.streaming.scratch_bytes == 0
    assert all(not ws for _, ws in streamed_reads(lowered, {}))


def test_input_consumed_is_recorded_after_the_last_step_reading_an_input():
    graph, lowered = _lowered(mlp(), {"x": (2, 64)})
    first = last_input_reader(lowered, graph.input_names)
    assert first == 0 and len(lowered.steps) > 2  # only the first layer reads x
    actions = run_schedule(lowered, {}, graph.input_names, consumed=True).actions
    assert actions.index(("consumed",)) == actions.index(("step", 0)) + 1
    tied_graph, tied = _lowered(tied_mlp(), {"x": (2, 48)})
    residual = last_input_reader(tied, tied_graph.input_names)
    assert residual == len(tied.steps) - 1  # x is read again by the final Add

    x = np.random.default_rng(3).standard_normal((2, 48)).astype(np.float32)
    streamed = run_schedule(tied, _weight_sizes(tied_graph, tied), tied_graph.input_names, consumed=True)
    machine = StreamedEmulator(tied_graph, tied, {"x": x}, streamed)
    host = execute(streamed, machine, COMPUTE)
    assert [h for h in host if h[0] == "consumed"] == [("consumed", len(tied.steps))]


def test_input_consumed_counts_readers_of_views_of_an_input():
    n = helper.make_node
    nodes = [n("Relu", ["x"], ["r"], name="relu"),
             n("Reshape", ["x", "shape"], ["xv"], name="view"),
             n("Mul", ["r", "r"], ["s"], name="square"),
             n("Add", ["s", "xv"], ["y"], name="late_read")]
    model = _model(nodes, [vi("x", TensorProto.FLOAT, [4, 8])], [vi("y", TensorProto.FLOAT, [4, 8])],
                   [("shape", np.array([4, 8], np.int64))])
    graph, lowered = _lowered(model, {"x": (4, 8)})
    late = next(i for i, s in enumerate(lowered.steps) if s.node.name == "late_read")
    assert last_input_reader(lowered, graph.input_names) == late


def test_debug_tensors_are_reported_right_after_their_producer():
    graph, lowered = _lowered(mlp(), {"x": (2, 64)})
    producer = {o: i for i, s in enumerate(lowered.steps) for o in s.node.outputs if o}
    wanted = [n for n in ("h", "r", "y") if n in producer] + ["x"]
    positions = debug_positions(lowered, wanted)
    assert positions[-1] == ["x"]  # written by no step: reported before the first
    actions = run_schedule(lowered, {}, graph.input_names, debug=tuple(wanted)).actions
    for name in wanted[:-1]:
        assert actions.index(("debug", name)) == actions.index(("step", producer[name])) + 1
    assert actions[0] == ("debug", "x")


def test_engine_reports_the_weights_its_budget_streams_and_keeps_the_input_consumed_event():
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(tied_mlp().SerializeToString())
    config = builder.create_builder_config()
    config.backend = "cpu"
    config.set_flag(BuilderFlag.WEIGHT_STREAMING)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 48), (2, 48), (4, 48))
    config.add_optimization_profile(profile)
    engine = kiln.Runtime().load(kiln.build_plan(network, config))
    assert engine._streamed_weights() == set()  # default budget: everything resident
    engine.weight_streaming_budget_v2 = 0
    assert engine._streamed_weights() == {"W", "b"}
    engine.weight_streaming_budget_v2 = 48 * 48 * 4  # W (two readers) fits and stays
    assert engine._streamed_weights() == {"b"}
    context = engine.create_execution_context()
    assert context.get_input_consumed_event() == 0
    assert context.set_input_consumed_event(0x1234) and context.get_input_consumed_event() == 0x1234
    assert not context.set_input_consumed_event("not an event")
    assert context.get_input_consumed_event() == 0x1234
    x = np.ones((2, 48), np.float32)
    assert context.infer({"x": x})["y"].shape == (2, 48)  # CPU plans run synchronously; the event is kept
