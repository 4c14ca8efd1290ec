"""Where a model version's instances run: `instance_group { count: N kind: KIND_GPU gpus: [0, 1] }` places N
instances on EACH listed GPU, as Triton does.

Triton's normalisation: a KIND_GPU group without `gpus` gets every visible GPU, and KIND_AUTO on a CUDA model becomes
KIND_GPU with every visible GPU; the completed config shows the placement (`/v2/models/<m>/config`). Instances on a
GPU run in an executor process of that GPU (server/core/executor.py), which sees the GPU as its CUDA ordinal 0
(`child_visible_devices`). Models whose executions stay in the server process (`executor.why_in_core`: max_batch_size
0, sequence models, KILN_EXECUTOR=thread) run on device 0 only, so other GPUs are refused for them with the reason.
Every listed GPU must have the build GPU's compute capability: the plan is built once, for device 0's architecture.

Pure functions over an injected `Devices` (count and architecture per ordinal): tests/server/test_gpu_placement.py
runs them without a GPU. `restricted_visible_devices` is `kiln serve --gpus`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from server.protos import model_config_pb2

from .errors import invalid
from .model_config import ModelConfig

InstanceGroup = model_config_pb2.ModelInstanceGroup
T = TypeVar("T")


@dataclass(frozen=True)
class Devices:
    """The CUDA devices this process sees: how many, and each one's architecture ("sm_90") by ordinal."""

    count: int
    arch: Callable[[int], str]


def visible_devices() -> Devices:
    """This process's CUDA devices, asked of the driver (only for CUDA models: the core already initialised CUDA
    to pick the plan's target)."""
    from engine_core.compat import device_arch
    from engine_core.cuda import device_count

    def arch(ordinal: int) -> str:
        found = device_arch(ordinal)  # the form plans record their target in
        assert found is not None, "visible_devices is asked only for CUDA models"
        return found

    return Devices(device_count(), arch)


@dataclass(frozen=True)
class Placement:
    """The instances of one model version on one device: what one executor process runs (`device` None: in the
    server process, or an executor without a GPU of its own: CPU plans, device 0)."""

    device: int | None
    count: int


def place_instances(config: ModelConfig, backend: str, why_in_core: str,
                    devices: Callable[[], Devices] = visible_devices) -> list[Placement]:
    """Normalise `config`'s instance groups in place (kind, `gpus`) and return where the instances run: one
    Placement per GPU for a CUDA model in executors (groups on the same GPU share its process), else one.
    `why_in_core`: why the model's executions stay in the server process ("" when they run in executors).
    INVALID_ARGUMENT names the model, the group and what is wrong."""
    total = sum(group.count for group in config.instance_group) or 1
    if backend != "cuda":
        for group in config.instance_group:
            if list(group.gpus) not in ([], [0]):
                raise invalid(f"model '{config.name}': instance group '{group.name}' lists gpus "
                              f"{list(group.gpus)}, but the model runs on the {backend} backend (no GPU placement); "
                              "remove gpus or use KIND_GPU on a machine with a GPU")
        return [Placement(None, total)]
    found = devices()
    for group in config.instance_group:
        group.kind = InstanceGroup.KIND_GPU  # KIND_AUTO on a CUDA model is KIND_GPU, as Triton completes it
        if why_in_core:
            _keep_on_device_zero(config, group, why_in_core)
        elif not group.gpus:
            group.gpus.extend(range(found.count))
        check_ids(config, group, found.count)
    if why_in_core:
        return [Placement(None, total)]
    _check_one_architecture(config, found)
    counts: dict[int, int] = {}
    for group in config.instance_group:
        for gpu in group.gpus:
            counts[gpu] = counts.get(gpu, 0) + group.count
    return [Placement(gpu, count) for gpu, count in counts.items()]


def _keep_on_device_zero(config: ModelConfig, group: InstanceGroup, why_in_core: str) -> None:
    if list(group.gpus) not in ([], [0]):
        raise invalid(f"model '{config.name}': instance group '{group.name}' lists gpus {list(group.gpus)}, but "
                      f"{why_in_core}, which runs on GPU 0 only; use gpus: [0] (or leave gpus out)")
    if not group.gpus:
        group.gpus.append(0)


def check_ids(config: ModelConfig, group: InstanceGroup, count: int) -> None:
    """INVALID_ARGUMENT when `group` lists a GPU at or past the `count` visible devices."""
    for gpu in group.gpus:
        if not 0 <= gpu < count:
            raise invalid(f"model '{config.name}': instance group '{group.name}' lists GPU {gpu}, but this server "
                          f"sees {count} CUDA device(s) (ids 0..{count - 1}; CUDA_VISIBLE_DEVICES and --gpus decide "
                          "which)")


def _check_one_architecture(config: ModelConfig, found: Devices) -> None:
    """Every listed GPU must run the plan built for device 0 (the one the core targets): one plan per
    architecture is not built."""
    archs = {0: found.arch(0)}
    for group in config.instance_group:
        for gpu in group.gpus:
            archs.setdefault(gpu, found.arch(gpu))
    if len(set(archs.values())) > 1:
        listed = ", ".join(f"GPU {gpu} {arch}" for gpu, arch in sorted(archs.items()))
        raise invalid(f"model '{config.name}': its GPUs differ in compute capability ({listed}); Kiln builds one "
                      "plan per model, for GPU 0's architecture: list GPUs of one kind (or restrict the server "
                      "with --gpus)")


def device_list(parent: str | None, count: int) -> list[str]:
    """The entries of CUDA_VISIBLE_DEVICES (`parent`) the driver uses, or 0..count-1 when it is unset. The driver
    stops at the first entry it cannot use, so only the first `count` count."""
    if parent is None:
        return [str(i) for i in range(count)]
    return _entries(parent)[:count]


def _entries(parent: str) -> list[str]:
    """A CUDA_VISIBLE_DEVICES value's entries, blanks dropped."""
    return [entry.strip() for entry in parent.split(",") if entry.strip()]


def child_visible_devices(device: int, count: int, environ: Mapping[str, str]) -> str:
    """CUDA_VISIBLE_DEVICES for an executor of visible ordinal `device`: that device first (the engine's ordinal
    0 there), the others after it in their order, so a client's CUDA shared memory on another GPU still opens
    (peer access)."""
    entries = device_list(environ.get("CUDA_VISIBLE_DEVICES"), count)
    if not 0 <= device < len(entries):
        raise ValueError(f"device {device} is not one of the {len(entries)} visible CUDA devices")
    return ",".join([entries[device], *entries[:device], *entries[device + 1:]])


def parse_gpu_ids(text: str) -> list[int]:
    """`--gpus 0,1`: distinct ids >= 0, in the given order; ValueError saying what is wrong."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--gpus: expected comma-separated GPU ids such as 0,1, got '{text}'") from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"--gpus: expected distinct GPU ids >= 0 such as 0,1, got '{text}'")
    return ids


def restricted_visible_devices(text: str, parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for `kiln serve --gpus TEXT`: the ids index the devices this process would see
    (`parent`, the current CUDA_VISIBLE_DEVICES, when set; else the machine's ordinals)."""
    ids = parse_gpu_ids(text)
    if parent is None:
        return ",".join(map(str, ids))
    entries = _entries(parent)
    beyond = [i for i in ids if i >= len(entries)]
    if beyond:
        raise ValueError(f"--gpus {text}: GPU {beyond[0]} is not visible (CUDA_VISIBLE_DEVICES={parent} lists "
                         f"{len(entries)} device(s))")
    return ",".join(entries[i] for i in ids)


def start_all(starts: Sequence[Callable[[], T]], close: Callable[[list[T]], None], thread_name: str) -> list[T]:
    """What runs on each placement (an executor process, a generation loop), started together: each start in a
    thread of its own, so loads and warm-ups overlap (one alone runs here). When one fails, `close` gets the started
    ones and the first failure, in order, is raised: a version runs on all its devices or on none."""
    if len(starts) == 1:
        return [starts[0]()]
    with ThreadPoolExecutor(len(starts), thread_name_prefix=thread_name) as pool:
        futures = [pool.submit(start) for start in starts]
    failures = [error for future in futures if (error := future.exception()) is not None]
    started = [future.result() for future in futures if future.exception() is None]
    if failures:
        close(started)
        raise failures[0]
    return started
