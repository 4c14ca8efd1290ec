"""MLServer runtime serving an ONNX model through onnxruntime (runs inside the MLServer venv, not Kiln's).

MLServer ships no ONNX runtime of its own; its documented way to serve a framework it lacks is a custom
`MLModel` like this one: decode the V2 request with `NumpyCodec`, run an `onnxruntime.InferenceSession`,
encode the outputs. The peer benchmark (load_tests/peers.py) points `implementation` here.
"""

from __future__ import annotations

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxModel(MLModel):
    """One InferenceSession per model; CPU execution provider."""

    async def load(self) -> bool:
        uri = await get_model_uri(self._settings)
        self._session = ort.InferenceSession(uri, providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {item.name: NumpyCodec.decode_input(item) for item in payload.inputs}
        results = self._session.run(self._outputs, feeds)
        return InferenceResponse(
            model_name=self.name, model_version=self.version,
            outputs=[NumpyCodec.encode_output(name, value) for name, value in zip(self._outputs, results)])
