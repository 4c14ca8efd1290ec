"""Engine compatibility: hardware levels and version-compatible plans, refused with the reason."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest

import engine_core as kiln
from engine_core import cli, compat
from engine_core.compat import check_hardware, check_plan_compatibility, check_version
from engine_core.plan import _HEADER, ALIGN, MAGIC, read_plan_metadata
from engine_core.types import BuilderFlag, HardwareCompatibilityLevel
from engine_core.version import PLAN_FORMAT_VERSION
from tests.engine import models


def resign(plan: bytes, edit) -> bytes:
    """The plan with its metadata changed by ``edit(meta)`` and a valid digest (a plan as another
    Kiln, or another machine, would have written it)."""
    meta, blob = read_plan_metadata(plan, check_version=False)
    edit(meta)
    meta_bytes = json.dumps(meta).encode()
    pad = b"\0" * ((-(_HEADER.size + len(meta_bytes))) % ALIGN)
    digest = hashlib.sha256(meta_bytes + pad + bytes(blob)).digest()
    return _HEADER.pack(MAGIC, PLAN_FORMAT_VERSION, 0, len(meta_bytes), len(blob), digest) + meta_bytes + pad + bytes(blob)


def build(flags=(), level=HardwareCompatibilityLevel.NONE) -> bytes:
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(models.add_sub().SerializeToString())
    config = builder.create_builder_config()
    config.backend = "cpu"
    config.hardware_compatibility_level = level
    for flag in flags:
        config.set_flag(flag)
    profile = builder.create_optimization_profile()
    for name in ("a", "b"):
        profile.set_shape(name, (1, 4), (2, 4), (8, 4))
    config.add_optimization_profile(profile)
    return kiln.build_plan(network, config)


def meta(backend="cuda", arch="sm_90", level="NONE", vc=False, version="0.1.0", record=True) -> dict:
    info = {"compatibility": {"hardware_compatibility_level": level, "version_compatible": vc}} if record else {}
    return {"engine_version": version, "backend": backend, "arch": arch, "build_info": info}


# -- the pure checks, with fake archs --------------------------------------------------------------


@pytest.mark.parametrize("plan_arch,level,device,refusal", [
    ("sm_90", "NONE", "sm_90", None),
    ("sm_90", "NONE", "sm_86", "expecting compute 9.0 got compute 8.6"),
    ("sm_86", "SAME_COMPUTE_CAPABILITY", "sm_86", None),
    ("sm_86", "SAME_COMPUTE_CAPABILITY", "sm_89", "expecting compute 8.6 got compute 8.9"),
    ("compute_80", "AMPERE_PLUS", "sm_90", None),
    ("compute_80", "AMPERE_PLUS", "sm_80", None),
    ("compute_80", "AMPERE_PLUS", "sm_120", None),
    ("compute_80", "AMPERE_PLUS", "sm_75", "needs compute 8.0 or later; this GPU is compute 7.5"),
    ("sm_80", "AMPERE_PLUS", "sm_86", None),  # a CUBIN loads on later minors of its major
    ("sm_90", "AMPERE_PLUS", "sm_100", "compiled for sm_90, which a compute 10.0 GPU (sm_100) cannot load"),
    ("sm_90", "NONE", None, "built for the 'cuda' backend, which this machine lacks"),
    ("gfx90a", "NONE", "sm_90", "unknown GPU architecture 'gfx90a'"),
])
def test_hardware_levels(plan_arch, level, device, refusal):
    reason = check_plan_compatibility(meta(arch=plan_arch, level=level), device, "0.1.0")
    if refusal is None:
        assert reason is None
    else:
        assert refusal in reason


def test_cpu_plans_run_anywhere_and_old_plans_read_as_level_none():
    assert check_hardware(meta(backend="cpu", arch="any", level="AMPERE_PLUS"), None) is None
    old = meta(record=False)  # a plan from before the compatibility record
    assert compat.requirements(old).level == HardwareCompatibilityLevel.NONE
    assert not compat.requirements(old).version_compatible
    assert "expecting compute 9.0 got compute 8.0" in check_hardware(old, "sm_80")


@pytest.mark.parametrize("built_by,vc,backend,kiln_version,refusal", [
    ("0.1.0", False, "cpu", "0.1.7", None),
    ("0.1.3", False, "cpu", "0.1.0", None),  # same major.minor, as before
    ("0.1.0", False, "cpu", "0.2.0", "built by Kiln 0.1.0, this is Kiln 0.2.0; rebuild it (it runs on Kiln >=0.1.0, <0.2.0"),
    ("0.1.0", True, "cpu", "0.4.2", None),
    ("0.1.0", True, "cpu", "1.0.0", "runs on Kiln >=0.1.0, <1.0.0; this is Kiln 1.0.0"),
    ("0.3.0", True, "cpu", "0.2.9", "runs on Kiln >=0.3.0, <1.0.0; this is Kiln 0.2.9"),
    ("0.1.0", True, "cuda", "0.1.0", None),
    ("0.1.0", True, "cuda", "0.2.0", "kernel ABI"),
    ("nonsense", False, "cpu", "0.1.0", "version record is unusable"),
])
def test_version_rules(built_by, vc, backend, kiln_version, refusal):
    reason = check_version(meta(backend=backend, vc=vc, version=built_by), kiln_version)
    if refusal is None:
        assert reason is None
    else:
        assert refusal in reason


def test_malformed_records_are_refused_not_crashed():
    bad = meta()
    bad["build_info"]["compatibility"]["hardware_compatibility_level"] = "EVERYTHING"
    assert "unknown hardware compatibility level" in check_plan_compatibility(bad, "sm_90", "0.1.0")
    bad["build_info"]["compatibility"]["hardware_compatibility_level"] = ["AMPERE_PLUS"]  # not hashable
    assert "unknown hardware compatibility level" in check_plan_compatibility(bad, "sm_90", "0.1.0")
    bad["build_info"] = {"compatibility": [1, 2]}
    assert "malformed" in check_plan_compatibility(bad, "sm_90", "0.1.0")


# -- builds, the runtime and the CLI --------------------------------------------------------------


def test_builder_config_level_is_validated_and_recorded():
    config = kiln.Builder().create_builder_config()
    assert config.hardware_compatibility_level == HardwareCompatibilityLevel.NONE
    with pytest.raises(ValueError, match="unknown hardware compatibility level 7"):
        config.hardware_compatibility_level = 7
    plan = build([BuilderFlag.VERSION_COMPATIBLE], HardwareCompatibilityLevel.AMPERE_PLUS)
    engine = kiln.Runtime().load(plan)
    assert engine.hardware_compatibility_level == HardwareCompatibilityLevel.AMPERE_PLUS
    assert read_plan_metadata(plan)[0]["build_info"]["compatibility"] == {
        "hardware_compatibility_level": "AMPERE_PLUS", "version_compatible": True}


def test_cuda_ampere_plus_build_is_refused_until_the_backend_emits_ptx():
    config = SimpleNamespace(backend="cuda", hardware_compatibility_level=HardwareCompatibilityLevel.AMPERE_PLUS,
                             get_flag=lambda flag: False)
    with pytest.raises(kiln.BuildError, match="PTX for compute_80"):
        compat.build_record(config)


def test_version_compatible_plan_runs_on_a_later_kiln_and_others_are_refused(monkeypatch):
    import engine_core.plan as plan_module

    plain, portable = build(), build([BuilderFlag.VERSION_COMPATIBLE])
    monkeypatch.setattr(plan_module, "__version__", "0.3.0")  # this process plays a later Kiln
    engine = kiln.Runtime().load(portable)
    out = engine.create_execution_context().infer({"a": np.ones((2, 4), np.float32), "b": np.ones((2, 4), np.float32)})
    np.testing.assert_array_equal(out["sum"], np.full((2, 4), 2, np.float32))
    runtime = kiln.Runtime()
    runtime.error_recorder = recorder = kiln.ErrorRecorder()
    assert runtime.deserialize_cuda_engine(plain) is None
    assert "built by Kiln 0.1.0, this is Kiln 0.3.0" in recorder.get_error_desc(0)
    monkeypatch.setattr(plan_module, "__version__", "1.0.0")
    with pytest.raises(kiln.PlanFormatError, match="runs on Kiln >=0.1.0, <1.0.0"):
        kiln.Runtime().load(portable)


def test_runtime_checks_the_gpu_arch_before_creating_cuda_state(monkeypatch):
    """A CUDA plan built on sm_90, loaded on a (fake) sm_86: refused with the reason, no driver call."""
    import engine_core.backends.cuda as cuda_backend
    import engine_core.backends.cuda.backend as cuda_backend_class  # CudaBackend.load checks the plan
    import engine_core.runtime as runtime_module

    cuda_plan = resign(build(), lambda m: m.update(backend="cuda", arch="sm_90"))
    monkeypatch.setattr(runtime_module, "available_backends", lambda: ["cuda", "cpu"])
    monkeypatch.setattr(cuda_backend_class, "device_arch", lambda: "sm_86")
    monkeypatch.setattr(cuda_backend, "engine_state", lambda plan: pytest.fail("engine state created"))
    runtime = kiln.Runtime()
    runtime.error_recorder = recorder = kiln.ErrorRecorder()
    assert runtime.deserialize_cuda_engine(cuda_plan) is None
    assert "expecting compute 9.0 got compute 8.6" in recorder.get_error_desc(0)
    monkeypatch.setattr(cuda_backend_class, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(cuda_backend, "engine_state", lambda plan: "device state")
    assert runtime.deserialize_cuda_engine(cuda_plan).backend_state == "device state"


def test_kiln_inspect_shows_what_a_plan_needs(tmp_path, capsys):
    path = tmp_path / "other.plan"
    path.write_bytes(resign(build(), lambda m: m.update(engine_version="0.3.0")))
    assert cli.main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "needs: Kiln >=0.3.0, <0.4.0 (version_compatible=False)" in text
    assert "runs here (Kiln 0.1.0): no: plan was built by Kiln 0.3.0" in text
    path.write_bytes(build([BuilderFlag.VERSION_COMPATIBLE]))
    assert cli.main(["inspect", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requirements"]["kiln_versions"] == ">=0.1.0, <1.0.0"
    assert summary["runs_here"] == {"ok": True, "reason": None}


def test_kiln_inspect_lists_the_gpus_a_cuda_plan_can_be_placed_on(tmp_path, capsys, monkeypatch):
    """`kiln inspect` names each GPU this process sees and whether the plan runs there (what instance_group gpus
    may list), here one sm_90 and one sm_86 GPU for an sm_90 plan."""
    import engine_core.cuda
    import engine_core.cuda.driver

    path = tmp_path / "gpu.plan"
    path.write_bytes(resign(build(), lambda m: m.update(backend="cuda", arch="sm_90")))
    archs = ["sm_90", "sm_86"]
    monkeypatch.setattr(cli.kiln, "available_backends", lambda: ["cuda", "cpu"])
    monkeypatch.setattr(cli, "device_arch", lambda ordinal=0: archs[ordinal])
    monkeypatch.setattr(engine_core.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(engine_core.cuda.driver, "device_name", lambda ordinal=0: f"GPU model {ordinal}")
    assert cli.main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "GPU 0 (GPU model 0, sm_90): can run it" in text
    assert "GPU 1 (GPU model 1, sm_86): cannot: plan was built on an incompatible device" in text
    assert cli.main(["inspect", str(path), "--json"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus_here"]
    assert [(g["gpu"], g["ok"]) for g in gpus] == [(0, True), (1, False)]


def test_kiln_build_compatibility_flags(tmp_path, capsys):
    import onnx

    model = tmp_path / "m.onnx"
    onnx.save(models.add_sub(), model)
    out = tmp_path / "m.plan"
    assert cli.main(["build", str(model), "-o", str(out), "--shapes", "a:2x4,b:2x4", "--version-compatible",
                     "--hardware-compatibility-level", "same_compute_capability", "--weight-streaming"]) == 0
    info = read_plan_metadata(out.read_bytes())[0]["build_info"]
    assert info["compatibility"] == {"hardware_compatibility_level": "SAME_COMPUTE_CAPABILITY",
                                     "version_compatible": True}
    assert {"VERSION_COMPATIBLE", "WEIGHT_STREAMING"} <= set(info["flags"])
