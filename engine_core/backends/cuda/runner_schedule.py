"""What one run of a lowered plan enqueues, in host order: a pure ``RunSchedule`` (no driver; the CPU tests check it
without a GPU): the steps, the weight-streaming uploads on the copy stream and the events ordering them, the
input-consumed event and the debug-listener reports. runner_launch.py interprets it on the device.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from engine_core.backends.cuda.int8_gemm import Int8Gemm
from engine_core.backends.cuda.lowering_context import (
    Conv,
    Copy,
    Gemm,
    Host,
    Launch,
    Lowered,
    Step,
)
from engine_core.weight_streaming import LayerWeights, StreamingPlan, plan_streaming

#: the two streams a run uses: the context's (compute) stream and its copy stream
COMPUTE, COPY = "compute", "copy"
#: one enqueue action, in host order:
#:   ("step", i)                      run lowered step i on the compute stream
#:   ("record", stream, event)        record an internal event ("start", "ready<k>", "done<i>")
#:   ("wait", stream, event)          make ``stream`` wait for an internal event
#:   ("upload", k)                    copy streaming step k's weights into its slot (copy stream)
#:   ("consumed",)                    record the user's input-consumed event (compute stream)
#:   ("debug", name)                  hand debug tensor ``name`` to the debug listener
Action = tuple


@dataclass(frozen=True)
class RunSchedule:
    """One run's actions in host order, and where each step finds its streamed weights."""

    actions: tuple[Action, ...]
    #: step index -> {weight key: (slot, byte offset in the slot)} for the weights it reads streamed
    streamed: dict[int, dict[str, tuple[int, int]]]
    #: the upload schedule over lowered steps (its layer indices are step indices)
    streaming: StreamingPlan
    #: internal events the actions record, by name
    events: tuple[str, ...]

    @property
    def uses_copy_stream(self) -> bool:
        return self.streaming.streaming


def step_reads(step: Step) -> list[str]:
    """Tensors a step addresses on the device (outputs too, harmlessly): every Ref of its ops, and a
    host layer's inputs (it fetches them itself)."""
    names = [n for n in step.node.inputs if n] if any(isinstance(op, Host) for op in step.ops) else []
    for op in step.ops:
        if isinstance(op, Launch):
            names += [r.tensor for r in op.refs()]
        elif isinstance(op, Gemm):
            names += [r.tensor for r in (op.a, op.b, op.y, op.bias) if r is not None]
        elif isinstance(op, Conv):
            names += [r.tensor for r in op.refs()]
            names += [r.tensor for launch in op.fallback for r in launch.refs()]
        elif isinstance(op, Copy):
            names.append(op.src.tensor)
        elif isinstance(op, Int8Gemm):
            names += [r.tensor for r in op.refs()]
    return names


def _located(lowered: Lowered, step: Step, kind: str) -> list[str]:
    """Keys of the given location kind ("weight", "io") that a step reads, in first-use order."""
    keys = []
    for name in step_reads(step):
        location = lowered.locations.get(name)
        if location is not None and location[0] == kind:
            keys.append(location[1])
    return list(dict.fromkeys(keys))


def streamed_reads(lowered: Lowered, streamed: Mapping[str, int]) -> list[LayerWeights]:
    """Per lowered step (named by its index), the streamed weights it reads: ``(key, nbytes)``."""
    return [(str(index), [(key, streamed[key]) for key in _located(lowered, step, "weight") if key in streamed])
            for index, step in enumerate(lowered.steps)]


def last_input_reader(lowered: Lowered, inputs: Collection[str]) -> int:
    """Index of the last step that reads a graph input (views of inputs included); -1 when none does."""
    last = -1
    for index, step in enumerate(lowered.steps):
        if any(key in inputs for key in _located(lowered, step, "io")):
            last = index
    return last


def debug_positions(lowered: Lowered, names: Iterable[str]) -> dict[int, list[str]]:
    """Step index after which each debug tensor is reported: its (last) producer; -1 (before the first
    step) for tensors no step writes (inputs, weights, values known on the host)."""
    producer: dict[str, int] = {}
    for index, step in enumerate(lowered.steps):
        for name in step.node.outputs:
            if name:
                producer[name] = index
    positions: dict[int, list[str]] = {}
    for name in sorted(names, key=lambda n: (producer.get(n, -1), n)):
        positions.setdefault(producer.get(name, -1), []).append(name)
    return positions


def run_schedule(lowered: Lowered, streamed: Mapping[str, int], inputs: Collection[str] = (),
                 consumed: bool = False, debug: Sequence[str] = ()) -> RunSchedule:
    """The actions of one run.

    ``streamed``: weight key -> nbytes of the weights that live in host memory (all > 0). Their
    uploads follow ``plan_streaming`` over the lowered steps: step k's uploads are enqueued on the copy
    stream right after the compute stream recorded "done" of the slot's previous reader (or, for the
    first two, after "start", which also orders them after the previous run), and step k waits for
    "ready<k>". The waits are also what puts the copy stream into a CUDA-graph capture (fork at
    "start") and back (every "ready" is joined by the compute stream). ``consumed``: record the
    input-consumed event after the last step reading a graph input. ``debug``: report those tensors
    right after the step producing them, while stream order still guarantees their bytes.
    """
    plan = plan_streaming(streamed_reads(lowered, streamed), 0)
    by_after: dict[int, list[int]] = {}
    for k, sstep in enumerate(plan.steps):
        by_after.setdefault(sstep.issue_after, []).append(k)
    ready_for = {sstep.layer_index: k for k, sstep in enumerate(plan.steps)}
    done_after = {sstep.issue_after for sstep in plan.steps if sstep.issue_after >= 0}
    reports = debug_positions(lowered, debug)
    consumed_after = last_input_reader(lowered, inputs) if consumed else None
    actions: list[Action] = []

    def issue(k: int) -> None:
        after = plan.steps[k].issue_after
        if after >= 0:
            actions.append(("wait", COPY, f"done{after}"))
        actions.append(("upload", k))
        actions.append(("record", COPY, f"ready{k}"))

    if plan.steps:
        actions += [("record", COMPUTE, "start"), ("wait", COPY, "start")]
        for k in by_after.get(-1, []):
            issue(k)
    if consumed_after == -1:
        actions.append(("consumed",))
    actions += [("debug", name) for name in reports.get(-1, [])]
    for index in range(len(lowered.steps)):
        if index in ready_for:
            actions.append(("wait", COMPUTE, f"ready{ready_for[index]}"))
        actions.append(("step", index))
        if index in done_after:
            actions.append(("record", COMPUTE, f"done{index}"))
        if consumed_after == index:
            actions.append(("consumed",))
        actions += [("debug", name) for name in reports.get(index, [])]
        for k in by_after.get(index, []):
            issue(k)
    placed = {s.layer_index: {u.weight: (s.slot, u.offset) for u in s.uploads} for s in plan.steps}
    events = tuple(dict.fromkeys(a[2] for a in actions if a[0] == "record"))
    return RunSchedule(tuple(actions), placed, plan, events)
