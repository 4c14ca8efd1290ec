"""Engine compatibility: which Kiln versions and which devices may run a plan.

A plan records, in ``build_info["compatibility"]``, the builder's hardware-compatibility level and
whether it was built with ``BuilderFlag.VERSION_COMPATIBLE``. Plans from before this was recorded
read as level NONE, not version-compatible — exactly the rules they were built under.

Version rules (checked when the plan is read, ``engine_core.plan.read_plan_metadata``):

- default: the Kiln that reads a plan must have the builder's major.minor version;
- VERSION_COMPATIBLE: any Kiln from the builder's version up to, not including, the next major
  version (Kiln's plan IR is ONNX ops with ONNX semantics, which later versions keep running).
  CUDA plans carry CUBINs compiled against the building Kiln's kernel ABI, so until the CUDA
  runner can recompile kernels from the plan's graph they run only on the exact building version.

Hardware rules (checked before a CUDA plan's engine state is created; CPU plans run anywhere):

- NONE and SAME_COMPUTE_CAPABILITY: the GPU's compute capability must equal the build GPU's
  (Kiln does not record the GPU model, so the reference's "different model" warning of NONE is
  not given);
- AMPERE_PLUS: compute capability 8.0 or later;
- always: the plan's code must be loadable there — a CUBIN for sm_XY loads only on compute X.y
  with y >= Y, PTX for compute_XY on any GPU of compute capability >= X.Y.

Every check is a pure function of the plan's metadata, the device's arch string and the Kiln
version, so all of it is tested on machines without a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_core.backends import registry
from engine_core.cuda.driver import compute_capability
from engine_core.errors import BuildError
from engine_core.types import BuilderFlag, HardwareCompatibilityLevel

#: build_info key of the compatibility record
COMPAT_KEY = "compatibility"
AMPERE = (8, 0)
_ARCH = re.compile(r"^(sm|compute)_(\d+)(\d)[af]?$")
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)")

Version = tuple[int, int, int]


@dataclass(frozen=True)
class Requirements:
    """What a plan needs from the machine and the Kiln that runs it (shown by `kiln inspect`)."""

    backend: str
    arch: str
    level: HardwareCompatibilityLevel
    version_compatible: bool
    built_by: str
    min_version: str
    below_version: str  # exclusive upper bound

    @property
    def version_range(self) -> str:
        return f">={self.min_version}, <{self.below_version}"

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "arch": self.arch, "hardware_compatibility_level": self.level.name,
                "version_compatible": self.version_compatible, "built_by": self.built_by,
                "kiln_versions": self.version_range, "devices": self.devices}

    @property
    def devices(self) -> str:
        """Human-readable device requirement."""
        if self.backend != "cuda":
            return f"any machine with the {self.backend} backend"
        cc = parse_arch(self.arch)
        code = f"{'PTX' if self.arch.startswith('compute_') else 'CUBIN'} for {self.arch}"
        if cc is None:
            return f"unknown GPU architecture {self.arch!r}"
        if self.level == HardwareCompatibilityLevel.AMPERE_PLUS:
            return f"GPUs of compute capability >= 8.0 that can load its code ({code})"
        return f"GPUs of compute capability {cc[0]}.{cc[1]} ({code})"


# -- versions -----------------------------------------------------------------------------------


def parse_version(text: str) -> Version:
    """``"0.1.0"`` -> (0, 1, 0); raises ValueError for anything else."""
    match = _VERSION.match(str(text))
    if match is None:
        raise ValueError(f"not a Kiln version: {text!r}")
    return int(match[1]), int(match[2]), int(match[3])


def version_range(built_by: str, version_compatible: bool) -> tuple[str, str]:
    """Kiln versions that may run a plan: [first, below) — see the module docstring."""
    major, minor, _ = parse_version(built_by)
    if version_compatible:
        return ".".join(map(str, parse_version(built_by))), f"{major + 1}.0.0"
    return f"{major}.{minor}.0", f"{major}.{minor + 1}.0"


# -- architectures ------------------------------------------------------------------------------


def parse_arch(arch: str) -> tuple[int, int] | None:
    """``"sm_90"`` / ``"compute_80"`` / ``"sm_100a"`` -> compute capability; None if not a GPU arch."""
    match = _ARCH.match(str(arch))
    return (int(match[2]), int(match[3])) if match else None


def _cc(cc: tuple[int, int]) -> str:
    return f"compute {cc[0]}.{cc[1]}"


def code_loadable(plan_arch: str, device: tuple[int, int]) -> bool:
    """Can a GPU of compute capability ``device`` load code compiled for ``plan_arch``?"""
    cc = parse_arch(plan_arch)
    if cc is None:
        return False
    if plan_arch.startswith("compute_"):  # PTX: JIT-compiled by the driver for any later GPU
        return device >= cc
    return device[0] == cc[0] and device[1] >= cc[1]  # CUBIN: same major, same or later minor


# -- the plan's record --------------------------------------------------------------------------


def build_record(config: Any) -> dict[str, Any]:
    """The ``build_info["compatibility"]`` entry for a build with ``config``; raises BuildError for
    a combination the backend cannot honour (so no plan claims more than it can do)."""
    level = HardwareCompatibilityLevel(getattr(config, "hardware_compatibility_level", 0))
    if getattr(config, "backend", "cpu") == "cuda" and level == HardwareCompatibilityLevel.AMPERE_PLUS:
        if not registry.CUDA_AMPERE_PLUS_ARCH:
            raise BuildError("hardware_compatibility_level AMPERE_PLUS needs code every GPU of compute capability "
                             ">= 8.0 can load (PTX for compute_80); the CUDA backend emits CUBINs for the build "
                             "GPU only, so build with level NONE or SAME_COMPUTE_CAPABILITY")
    return {"hardware_compatibility_level": level.name,
            "version_compatible": bool(config.get_flag(BuilderFlag.VERSION_COMPATIBLE))}


def requirements(plan_meta: Mapping[str, Any]) -> Requirements:
    """Read a plan's requirements from its metadata; raises ValueError if they are malformed."""
    if not isinstance(plan_meta, Mapping):
        raise ValueError("plan metadata is not an object")
    build_info = plan_meta.get("build_info") or {}
    record = build_info.get(COMPAT_KEY, {}) if isinstance(build_info, Mapping) else None
    if not isinstance(record, Mapping):
        raise ValueError(f"plan's {COMPAT_KEY} record is malformed")
    level_name = record.get("hardware_compatibility_level", "NONE")
    if not isinstance(level_name, str) or level_name not in HardwareCompatibilityLevel.__members__:
        raise ValueError(f"plan has unknown hardware compatibility level {level_name!r}")
    version_compatible = record.get("version_compatible", False)
    if not isinstance(version_compatible, bool):
        raise ValueError("plan's version_compatible entry is not a boolean")
    built_by = str(plan_meta.get("engine_version"))
    lo, hi = version_range(built_by, version_compatible)
    return Requirements(str(plan_meta.get("backend")), str(plan_meta.get("arch", "any")),
                        HardwareCompatibilityLevel[level_name], version_compatible, built_by, lo, hi)


# -- the checks ---------------------------------------------------------------------------------


def check_version(plan_meta: Mapping[str, Any], kiln_version: str) -> str | None:
    """Why ``kiln_version`` must not run this plan, or None if it may."""
    try:
        req = requirements(plan_meta)
        ours = parse_version(kiln_version)
    except ValueError as e:
        return f"plan was built by Kiln {plan_meta.get('engine_version') if isinstance(plan_meta, Mapping) else '?'}, " \
               f"this is Kiln {kiln_version}, and its version record is unusable ({e}); rebuild it"
    if parse_version(req.min_version) <= ours < parse_version(req.below_version):
        if req.version_compatible and req.backend == "cuda" and ours != parse_version(req.built_by):
            return (f"plan is a version-compatible CUDA plan built by Kiln {req.built_by}, this is Kiln {kiln_version}: "
                    "its CUBINs follow the building version's kernel ABI and this Kiln cannot recompile them yet; "
                    "rebuild it")
        return None
    if not req.version_compatible:
        return (f"plan was built by Kiln {req.built_by}, this is Kiln {kiln_version}; rebuild it "
                f"(it runs on Kiln {req.version_range}; BuilderFlag.VERSION_COMPATIBLE plans also run on later "
                "versions of the same major version)")
    return (f"plan is version-compatible from Kiln {req.built_by} on and runs on Kiln {req.version_range}; "
            f"this is Kiln {kiln_version}, rebuild it")


def check_hardware(plan_meta: Mapping[str, Any], device_arch: str | None) -> str | None:
    """Why this device must not run the plan, or None if it may (``device_arch`` like "sm_90",
    None when the machine has no usable CUDA device)."""
    try:
        req = requirements(plan_meta)
    except ValueError as e:
        return f"plan metadata is malformed: {e}"
    if req.backend != "cuda":
        return None
    if device_arch is None:
        return "plan was built for the 'cuda' backend, which this machine lacks"
    plan_cc, device = parse_arch(req.arch), parse_arch(device_arch)
    if plan_cc is None:
        return f"plan records an unknown GPU architecture {req.arch!r}; rebuild it"
    if device is None:
        return f"this GPU reports an unknown architecture {device_arch!r}"
    if req.level == HardwareCompatibilityLevel.AMPERE_PLUS:
        if device < AMPERE:
            return (f"plan was built with hardware compatibility level AMPERE_PLUS and needs compute 8.0 or later; "
                    f"this GPU is {_cc(device)} ({device_arch})")
    elif device != plan_cc:
        return (f"plan was built on an incompatible device, expecting {_cc(plan_cc)} got {_cc(device)} "
                f"({device_arch}); rebuild it on this GPU (hardware compatibility level {req.level.name})")
    if not code_loadable(req.arch, device):
        return f"plan's kernels are compiled for {req.arch}, which a {_cc(device)} GPU ({device_arch}) cannot load"
    return None


def check_plan_compatibility(plan_meta: Mapping[str, Any], device_arch: str | None, kiln_version: str) -> str | None:
    """The runtime's gate: the first reason this Kiln on this device must refuse the plan, or None.

    ``plan_meta`` is the plan's metadata (``read_plan_metadata``'s dict, or the same keys:
    ``engine_version``, ``backend``, ``arch``, ``build_info``).
    """
    return check_version(plan_meta, kiln_version) or check_hardware(plan_meta, device_arch)


def device_arch(ordinal: int = 0) -> str | None:
    """This machine's GPU ``ordinal`` (as CUDA numbers them here) as "sm_XY", or None without a usable CUDA backend."""
    if "cuda" not in registry.available_backends():
        return None
    major, minor = compute_capability(ordinal)
    return f"sm_{major}{minor}"
