"""KServe Python model server serving ONNX models through onnxruntime (runs inside the KServe venv, not Kiln's).

KServe's Python server has no ONNX runtime of its own (its ONNX path in a cluster is Triton); the documented
way to serve a framework with the `kserve` package is a custom `kserve.Model`, as here: decode the V2 request
with `InferInput.as_numpy()`, run an `onnxruntime.InferenceSession`, answer with `InferOutput`s. Every
`<dir>/<model>/model.onnx` is served, with the tensor metadata from `<dir>/<model>/io.json`
(`{"inputs": [{name, datatype, shape}], "outputs": [...]}`), so `kiln perf` can read fixed shapes.

    python kserve_onnx.py --model_dir DIR --http_port 8080 --grpc_port 8081

KServe's own flags (--http_port, --grpc_port, --workers, ...) pass through to `kserve.ModelServer`, which
parses them itself at import.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import kserve
import onnxruntime as ort
from kserve import InferOutput, InferRequest, InferResponse


class OnnxModel(kserve.Model):
    """One InferenceSession per model; CPU execution provider."""

    def __init__(self, name: str, directory: Path) -> None:
        super().__init__(name)
        self._path = directory / "model.onnx"
        self._io = json.loads((directory / "io.json").read_text())
        self._session: ort.InferenceSession | None = None
        self._outputs: list[str] = []

    def load(self) -> bool:
        self._session = ort.InferenceSession(str(self._path), providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self._session.get_outputs()]
        self.ready = True
        return self.ready

    def get_input_types(self) -> list[dict]:
        return self._io["inputs"]

    def get_output_types(self) -> list[dict]:
        return self._io["outputs"]

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None,
                response_headers: dict[str, str] | None = None) -> InferResponse:
        feeds = {item.name: item.as_numpy() for item in payload.inputs}
        results = self._session.run(self._outputs, feeds)
        binary = payload.from_grpc or bool((payload.parameters or {}).get("binary_data_output", False))
        outputs = []
        for name, value in zip(self._outputs, results):
            output = InferOutput(name=name, shape=list(value.shape), datatype=_v2_datatype(value.dtype))
            output.set_data_from_numpy(value, binary_data=binary)
            outputs.append(output)
        return InferResponse(response_id=payload.id or "", model_name=self.name, infer_outputs=outputs,
                             use_binary_outputs=binary)


_DATATYPES = {"float32": "FP32", "float64": "FP64", "float16": "FP16", "int64": "INT64", "int32": "INT32",
              "int8": "INT8", "uint8": "UINT8", "bool": "BOOL"}


def _v2_datatype(dtype) -> str:
    return _DATATYPES[str(dtype)]


def main() -> None:
    parser = argparse.ArgumentParser(parents=[kserve.model_server.parser], conflict_handler="resolve")
    parser.add_argument("--model_dir", type=Path, required=True, help="one sub-directory per model")
    args, _ = parser.parse_known_args()
    models = []
    for directory in sorted(p for p in args.model_dir.iterdir() if (p / "model.onnx").exists()):
        model = OnnxModel(directory.name, directory)
        model.load()
        models.append(model)
    kserve.ModelServer().start(models)


if __name__ == "__main__":
    main()
