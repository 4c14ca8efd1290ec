"""docs/engine-api-coverage.md against the reference and our classes; format, memory and tempfile queries."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

import engine_core as kiln
from engine_core.runtime import IOutputAllocator, runtime_file
from engine_core.types import TempfileControlFlag, TensorFormat, TensorIOMode
from tests.engine import models
from tests.engine.test_compat import resign
from tests.engine.util import build

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = Path(os.environ.get("KILN_REFERENCE_DIR", ROOT.parent / "shared" / "reference"))
DOC = ROOT / "docs" / "engine-api-coverage.md"
ROW = re.compile(r"^\| `(\w+)` \| (done|not applicable|not yet) \|(.*)\|$")


def doc_rows() -> dict[str, dict[str, str]]:
    """section (reference class) -> entry point -> status."""
    rows: dict[str, dict[str, str]] = {}
    section = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].split(" ", 1)[0]
            rows[section] = {}
        elif (match := ROW.match(line)) is not None:
            assert match[1] not in rows[section], f"{match[1]} listed twice in {section}"
            rows[section][match[1]] = match[2]
    return rows


def bullets(text: str) -> set[str]:
    """Attribute bullets: those before the first method (later bullets are parameters)."""
    return set(re.findall(r"^\s*• (\w+)", text[: text.index("__del__(")], re.M))


def reference_entries() -> dict[str, set[str]]:
    """Entry points of the three reference files, by class (bullet attributes may run into their type)."""
    engine = (REFERENCE / "engine-api.txt").read_text()
    context = (REFERENCE / "execution-context-api.txt").read_text()
    runtime = (REFERENCE / "runtime-api.txt").read_text()
    method = r"^-? ?(\w+)\((?:self|\*args|exc_type)"
    ctx_methods = set(re.findall(method + r"(?!: tensorrt.tensorrt.IOutputAllocator)", context, re.M))
    alloc_methods = set(re.findall(r"^- (\w+)\(self: tensorrt.tensorrt.IOutputAllocator", context, re.M))
    variables = context[context.index("- Variables"): context.index("- __del__")]
    runtime_part = runtime[runtime.index("class tensorrt.Runtime"):]
    return {
        "TensorIOMode": set(re.findall(r"^(NONE|INPUT|OUTPUT) :", engine, re.M)),
        "ICudaEngine": bullets(engine) | set(re.findall(method, engine, re.M)),
        "IOutputAllocator": alloc_methods,
        "IExecutionContext": (ctx_methods - alloc_methods) | set(re.findall(r"(\w+) –", variables)),
        "TempfileControlFlag": set(re.findall(r"^(ALLOW_\w+) :", runtime, re.M)),
        "Runtime": bullets(runtime_part) | set(re.findall(method, runtime_part, re.M)),
    }


def glued_type(rest: str) -> bool:
    """The reference's type word stuck to a bullet's name: "int", "bool", "str", "IErrorRecorder", ..."""
    return rest in ("int", "bool", "str") or rest[:1].isupper()


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="reference texts not present (set KILN_REFERENCE_DIR)")
def test_every_reference_entry_point_is_listed():
    rows = doc_rows()
    for section, entries in reference_entries().items():
        assert entries, f"no entry points parsed for {section}"
        listed = rows[section]
        for entry in entries:  # "num_io_tensorsint": the reference's bullets glue the type to the name
            assert any(entry == name or (entry.startswith(name) and glued_type(entry[len(name):]))
                       for name in listed), f"{section}.{entry} is missing from {DOC.name}"


def test_every_done_entry_exists():
    engine = kiln.Runtime().load(build(models.add_sub(), {"a": ((1, 4),) * 3, "b": ((1, 4),) * 3}))
    objects = {"TensorIOMode": TensorIOMode, "ICudaEngine": engine, "IOutputAllocator": IOutputAllocator,
               "IExecutionContext": engine.create_execution_context(), "TempfileControlFlag": TempfileControlFlag,
               "Runtime": kiln.Runtime()}
    rows = doc_rows()
    assert set(rows) == set(objects)
    done = [(s, n) for s, entries in rows.items() for n, status in entries.items() if status == "done"]
    assert len(done) > 60  # the table parsed (79 done rows when written)
    missing = [f"{s}.{n}" for s, n in done if not hasattr(objects[s], n)]
    assert not missing, f"marked done but absent: {missing}"


# -- tensor formats -------------------------------------------------------------------------------


def test_plans_have_linear_io_formats():
    engine = kiln.Runtime().load(build(models.small_cnn(), {"x": ((1, 3, 16, 16), (2, 3, 16, 16), (2, 3, 16, 16))}))
    assert engine.get_tensor_format("x") == TensorFormat.LINEAR
    assert engine.get_tensor_format_desc("x") == "Row major linear FP32 format"
    assert engine.get_tensor_vectorized_dim("x") == -1
    assert engine.get_tensor_components_per_element("x", 0) == 1
    assert engine.get_tensor_bytes_per_component("x") == 4
    with pytest.raises(KeyError, match="not an input or output"):
        engine.get_tensor_format("nope")


def test_formats_recorded_in_the_plan_are_reported():
    """What the lead's channels-last I/O will record: HWC8 on an NCHW input."""
    plan = build(models.small_cnn(), {"x": ((1, 3, 16, 16),) * 3})

    def hwc8(meta):
        meta["io"][0]["format"] = "HWC8"

    engine = kiln.Runtime().load(resign(plan, hwc8))
    assert engine.get_tensor_format("x") == TensorFormat.HWC8
    assert engine.get_tensor_vectorized_dim("x") == 1  # C of N,C,H,W
    assert engine.get_tensor_components_per_element("x") == 8
    assert engine.get_tensor_format_desc("x") == "Channel major FP32 format where C % 8 == 0"

    def bogus(meta):
        meta["io"][0]["format"] = "ZIGZAG"

    with pytest.raises(kiln.PlanFormatError, match="unknown format 'ZIGZAG'"):
        kiln.Runtime().load(resign(plan, bogus))


# -- device memory per profile --------------------------------------------------------------------


def test_device_memory_per_profile():
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(models.mlp().SerializeToString())
    config = builder.create_builder_config()
    config.backend = "cpu"
    for hi in (2, 64):
        profile = builder.create_optimization_profile()
        profile.set_shape("x", (1, 16), (hi, 16), (hi, 16))
        config.add_optimization_profile(profile)
    engine = kiln.Runtime().load(kiln.build_plan(network, config))
    small, large = engine.get_device_memory_size_for_profile(0), engine.get_device_memory_size_for_profile(1)
    assert 0 < small < large == engine.device_memory_size
    assert large == 32 * small  # activations scale with the max batch: 64 / 2
    assert engine.get_device_memory_size_for_profile_v2(1) == large  # no streaming scratch
    with pytest.raises(IndexError, match="profile 2 does not exist"):
        engine.get_device_memory_size_for_profile(2)


# -- runtime tempfile settings and other small entry points ---------------------------------------


def test_runtime_file_honours_tempfile_settings(tmp_path):
    runtime = kiln.Runtime()
    assert runtime.tempfile_control_flags == 3 and runtime.temporary_directory is None
    with runtime_file(runtime, b"code") as path:
        assert path.startswith("/proc/self/fd/") and Path(path).read_bytes() == b"code"  # in memory
    runtime.tempfile_control_flags = 1 << TempfileControlFlag.ALLOW_TEMPORARY_FILES
    runtime.temporary_directory = str(tmp_path)
    with runtime_file(runtime, b"code", "plugin") as path:
        assert Path(path).parent == tmp_path and Path(path).read_bytes() == b"code"
    assert not list(tmp_path.iterdir())  # removed afterwards
    runtime.tempfile_control_flags = 0
    with pytest.raises(kiln.KilnError, match="allows neither"), runtime_file(runtime, b"code"):
        pass


def test_strides_stream_reader_and_load_runtime(tmp_path):
    plan = build(models.add_sub(), {"a": ((1, 4), (2, 4), (8, 4)), "b": ((1, 4), (2, 4), (8, 4))})
    path = tmp_path / "m.plan"
    path.write_bytes(plan)
    runtime = kiln.Runtime()
    with open(path, "rb") as reader:
        engine = runtime.deserialize_cuda_engine(reader)
    context = engine.create_execution_context()
    context.set_input_shape("a", (3, 4))
    assert context.get_tensor_strides("a") == (4, 1)
    context.set_aux_streams([1, 2])  # no auxiliary streams in Kiln: accepted, unused
    out = context.infer({"a": np.ones((3, 4), np.float32), "b": np.ones((3, 4), np.float32)})
    assert out["sum"].shape == (3, 4)
    runtime.error_recorder = recorder = kiln.ErrorRecorder()
    assert runtime.load_runtime("/opt/liblean.so") is None
    assert "no lean runtime" in recorder.get_error_desc(0)
