"""Write Kiln's example model repository (Triton layout), deterministic so runs and tests agree.

    python examples/make_example_repository.py examples/model_repository

Models:
  add_sub      Triton's "simple": INPUT0, INPUT1 INT32 [16] -> OUTPUT0 = sum, OUTPUT1 = difference;
               max_batch_size 8, with a config.pbtxt.
  add_sub_fp32 the same in FP32 without a config.pbtxt (the server completes it from the ONNX graph).
  simple_cnn   a small CNN classifier: INPUT FP32 [3, 32, 32] -> PROBABILITIES [10] (softmax), with a labels
               file for the classification extension; max_batch_size 8.
  identity     one Identity per KServe datatype (IN_<TYPE> -> OUT_<TYPE>, dims [-1]), incl. FP16, BF16, BYTES.
  tiny_llm     a generative model (backend kiln_llm): examples/generative.py's tiny decoder and tokenizer, seeded random
               weights (its text is noise), for /v1/chat/completions, /v1/completions and generate. Written by the
               command (`make serve`), not by make_repository(), whose callers (tests) serve the ONNX models only.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
SEED = 20240611

CNN_LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

# KServe datatype -> ONNX element type, for the identity model.
IDENTITY_TYPES = {
    "BOOL": TensorProto.BOOL, "UINT8": TensorProto.UINT8, "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32, "UINT64": TensorProto.UINT64, "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16, "INT32": TensorProto.INT32, "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16, "FP32": TensorProto.FLOAT, "FP64": TensorProto.DOUBLE,
    "BF16": TensorProto.BFLOAT16, "BYTES": TensorProto.STRING,
}


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="kiln-examples")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def add_sub_model(elem_type: int) -> onnx.ModelProto:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, batch dim symbolic."""
    io = [helper.make_tensor_value_info(n, elem_type, ["batch", 16]) for n in ("INPUT0", "INPUT1")]
    outs = [helper.make_tensor_value_info(n, elem_type, ["batch", 16]) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"], name="add"),
             helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"], name="sub")]
    return _model(helper.make_graph(nodes, "add_sub", io, outs))


ADD_SUB_CONFIG = """name: "add_sub"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
instance_group [ { kind: KIND_CPU count: 2 } ]
"""


def cnn_model(seed: int = SEED) -> onnx.ModelProto:
    """Conv(3->8, 3x3) Relu MaxPool, Conv(8->16, 3x3) Relu MaxPool, Flatten, Gemm(1024->10), Softmax."""
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int, scale: float) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    weights = [
        weight("conv1_w", 8, 3, 3, 3, scale=0.3), weight("conv1_b", 8, scale=0.1),
        weight("conv2_w", 16, 8, 3, 3, scale=0.15), weight("conv2_b", 16, scale=0.1),
        weight("fc_w", 10, 16 * 8 * 8, scale=0.05), weight("fc_b", 10, scale=0.1),
    ]
    nodes = [
        helper.make_node("Conv", ["INPUT", "conv1_w", "conv1_b"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
        helper.make_node("Conv", ["p1", "conv2_w", "conv2_b"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2], name="pool2"),
        helper.make_node("Flatten", ["p2"], ["flat"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["PROBABILITIES"], axis=1, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes, "simple_cnn",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("PROBABILITIES", TensorProto.FLOAT, ["batch", 10])],
        initializer=weights)
    return _model(graph)


CNN_CONFIG = """name: "simple_cnn"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "PROBABILITIES" data_type: TYPE_FP32 dims: [ 10 ] label_filename: "labels.txt" } ]
"""


def identity_model() -> onnx.ModelProto:
    inputs, outputs, nodes = [], [], []
    for datatype, elem_type in IDENTITY_TYPES.items():
        inputs.append(helper.make_tensor_value_info(f"IN_{datatype}", elem_type, ["n"]))
        outputs.append(helper.make_tensor_value_info(f"OUT_{datatype}", elem_type, ["n"]))
        nodes.append(helper.make_node("Identity", [f"IN_{datatype}"], [f"OUT_{datatype}"], name=datatype.lower()))
    return _model(helper.make_graph(nodes, "identity", inputs, outputs))


IDENTITY_CONFIG = 'name: "identity"\nmax_batch_size: 0\n'


def write_model(repo: Path, name: str, model: onnx.ModelProto, config: str | None = None,
                extra: dict[str, str] | None = None, version: int = 1) -> Path:
    """Write `<repo>/<name>/<version>/model.onnx` (+ config.pbtxt and extra files) and return the model dir."""
    directory = repo / name
    (directory / str(version)).mkdir(parents=True, exist_ok=True)
    onnx.save(model, directory / str(version) / "model.onnx")
    if config is not None:
        (directory / "config.pbtxt").write_text(config)
    for filename, text in (extra or {}).items():
        (directory / filename).write_text(text)
    return directory


def make_repository(repo: str | Path) -> Path:
    repo = Path(repo)
    repo.mkdir(parents=True, exist_ok=True)
    write_model(repo, "add_sub", add_sub_model(TensorProto.INT32), ADD_SUB_CONFIG)
    write_model(repo, "add_sub_fp32", add_sub_model(TensorProto.FLOAT))
    write_model(repo, "simple_cnn", cnn_model(), CNN_CONFIG, {"labels.txt": "\n".join(CNN_LABELS) + "\n"})
    write_model(repo, "identity", identity_model(), IDENTITY_CONFIG)
    return repo


TINY_LLM_CONFIG = """backend: "kiln_llm"
max_batch_size: 8
instance_group [ { kind: KIND_CPU } ]
parameters { key: "max_context" value { string_value: "512" } }
"""


def write_generative_model(repo: Path, name: str = "tiny_llm") -> Path:
    """`<repo>/<name>`: the tiny decoder of examples/generative.py served by the generation loop."""
    spec = importlib.util.spec_from_file_location("generative", Path(__file__).with_name("generative.py"))
    assert spec is not None and spec.loader is not None
    generative = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generative)
    generative.write_tiny_decoder(repo / name / "1", max_positions=512)
    (repo / name / "config.pbtxt").write_text(TINY_LLM_CONFIG)
    return repo / name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="repository directory to write (created if missing)")
    parser.add_argument("--no-llm", action="store_true", help="leave out the generative model tiny_llm")
    args = parser.parse_args(argv)
    repo = make_repository(args.directory)
    if not args.no_llm:
        write_generative_model(repo)
    print(f"wrote example model repository to {repo}: {', '.join(sorted(p.name for p in repo.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
