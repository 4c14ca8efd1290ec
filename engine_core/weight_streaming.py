"""Weight streaming: which weights stay on the device under a budget, and the upload schedule.

Reference semantics (``engine.weight_streaming_budget_v2``): the budget is how many bytes of the
streamable weights stay resident on the device. 0 streams as many as possible; a budget of
``streamable_weights_size`` or more (the default) streams none. Streamed weights stay in host
memory (pinned, for async copies) and are uploaded on every run into a scratch area just before
the layer that reads them, so a model larger than free device memory still runs, slower.

The scratch area has two slots used alternately by consecutive streamed layers (double
buffering): while layer k computes from one slot, the copy stream fills the other with layer
k+1's weights. A slot may be refilled once the layer that last read it has finished, which is
what ``StreamStep.issue_after`` says. Everything here is pure bookkeeping over
``(layer name, [(weight name, nbytes), ...])`` in run order; the CUDA runner does the copies.

Which weights stay resident: each streamed weight costs its size once per layer that reads it,
per run, so weights are kept in order of readers (most first), then of first use (earliest
first: the first streamed layer's upload cannot overlap any compute), while they fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: (layer name, [(weight name, nbytes), ...]) for each layer, in run order
LayerWeights = tuple[str, Sequence[tuple[str, int]]]
#: offset alignment of weights inside a scratch slot (cuBLAS/vector loads want 256)
SCRATCH_ALIGN = 256


@dataclass(frozen=True)
class Upload:
    """One host-to-device copy: ``weight`` goes to ``offset`` in its step's slot."""

    weight: str
    nbytes: int
    offset: int


@dataclass(frozen=True)
class StreamStep:
    """The uploads a layer needs before it runs."""

    layer_index: int
    layer: str
    slot: int
    uploads: tuple[Upload, ...]
    #: the copies may be enqueued once this layer (the slot's previous reader) has run; -1: at run start
    issue_after: int

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.uploads)


@dataclass(frozen=True)
class StreamingPlan:
    """Resident weights and per-run uploads for one budget."""

    budget: int
    streamable_bytes: int
    resident: tuple[str, ...]
    resident_bytes: int
    steps: tuple[StreamStep, ...]
    slot_bytes: tuple[int, int]

    @property
    def scratch_bytes(self) -> int:
        """Device scratch the two slots need (``weight_streaming_scratch_memory_size``)."""
        return sum(self.slot_bytes)

    @property
    def streamed_bytes_per_run(self) -> int:
        return sum(step.nbytes for step in self.steps)

    @property
    def streaming(self) -> bool:
        return bool(self.steps)

    def step_for(self, layer_index: int) -> StreamStep | None:
        return next((s for s in self.steps if s.layer_index == layer_index), None)


def weight_sizes(layers: Sequence[LayerWeights]) -> dict[str, int]:
    """Each distinct weight's size; raises ValueError if a weight has two sizes or a negative one."""
    sizes: dict[str, int] = {}
    for layer, weights in layers:
        for name, nbytes in weights:
            if nbytes < 0:
                raise ValueError(f"weight '{name}' of layer '{layer}' has a negative size {nbytes}")
            if sizes.setdefault(name, int(nbytes)) != nbytes:
                raise ValueError(f"weight '{name}' is listed with sizes {sizes[name]} and {nbytes}")
    return sizes


def choose_resident(layers: Sequence[LayerWeights], budget: int) -> set[str]:
    """The weights kept on the device: most readers first, then earliest first use, while they fit."""
    sizes = weight_sizes(layers)
    readers: dict[str, int] = {}
    first_use: dict[str, int] = {}
    for index, (_, weights) in enumerate(layers):
        for name in dict.fromkeys(n for n, _ in weights):
            readers[name] = readers.get(name, 0) + 1
            first_use.setdefault(name, index)
    resident: set[str] = set()
    left = budget
    for name in sorted(sizes, key=lambda n: (-readers[n], first_use[n], n)):
        if sizes[name] <= left:
            resident.add(name)
            left -= sizes[name]
    return resident


def _align(n: int) -> int:
    return -(-n // SCRATCH_ALIGN) * SCRATCH_ALIGN


def plan_streaming(layers: Sequence[LayerWeights], budget: int) -> StreamingPlan:
    """Resident set and double-buffered upload schedule for ``budget`` bytes of resident weights.

    Raises ValueError for a negative budget (the reference's v2 budget is never negative).
    """
    if budget < 0:
        raise ValueError(f"weight streaming budget must be >= 0, got {budget}")
    sizes = weight_sizes(layers)
    streamable = sum(sizes.values())
    resident = choose_resident(layers, budget) if budget < streamable else set(sizes)
    steps: list[StreamStep] = []
    slot_bytes = [0, 0]
    for index, (layer, weights) in enumerate(layers):
        streamed = [n for n in dict.fromkeys(n for n, _ in weights) if n not in resident]
        if not streamed:
            continue
        slot = len(steps) % 2
        uploads, offset = [], 0
        for name in streamed:
            uploads.append(Upload(name, sizes[name], offset))
            offset += _align(sizes[name])
        issue_after = steps[-2].layer_index if len(steps) >= 2 else -1
        steps.append(StreamStep(index, layer, slot, tuple(uploads), issue_after))
        slot_bytes[slot] = max(slot_bytes[slot], offset)
    resident_names = tuple(sorted(resident))
    return StreamingPlan(budget, streamable, resident_names, sum(sizes[n] for n in resident_names), tuple(steps),
                         (slot_bytes[0], slot_bytes[1]))


def automatic_budget(layers: Sequence[LayerWeights], free_bytes: int, activation_bytes: int,
                     headroom: int = 64 << 20) -> int:
    """A budget that fits the free device memory (``get_weight_streaming_automatic_budget``).

    Free memory minus the activations, the scratch streaming needs at most (budget 0) and some
    headroom; all weights (no streaming) when they fit, 0 when nothing does.
    """
    sizes = weight_sizes(layers)
    streamable = sum(sizes.values())
    if streamable + activation_bytes + headroom <= free_bytes:
        return streamable
    worst_scratch = plan_streaming(layers, 0).scratch_bytes
    return max(0, min(streamable, free_bytes - activation_bytes - worst_scratch - headroom))
