"""Preprocessing in Python in front of an ONNX model (Triton's Python backend, served by Kiln): 32x32 RGB images as
uint8 (height, width, channel) in, the example `simple_cnn` classifier's top label and score out.

execute() gets every request the dynamic batcher gathered. Their images are normalized, turned channel-first and
sent to simple_cnn as one BLS request; its probabilities are cut back per request. Serve it beside the example
repository (examples/make_example_repository.py writes that one):

    kiln serve --model-repository examples/model_repository --model-repository examples/python_models
"""

import numpy as np
import triton_python_backend_utils as pb_utils

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
MEAN, STD = 0.5, 0.25  # per channel, on pixel values scaled to [0, 1]


def preprocess(images: np.ndarray) -> np.ndarray:
    """uint8 NHWC -> normalized float32 NCHW, what simple_cnn takes."""
    scaled = images.astype(np.float32) / 255.0
    return np.ascontiguousarray(((scaled - MEAN) / STD).transpose(0, 3, 1, 2))


class TritonPythonModel:
    def execute(self, requests):
        images = [pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy() for request in requests]
        batch = pb_utils.Tensor("INPUT", preprocess(np.concatenate(images)))
        response = pb_utils.InferenceRequest(model_name="simple_cnn", requested_output_names=["PROBABILITIES"],
                                             inputs=[batch]).exec()
        if response.has_error():  # every request hears why
            return [pb_utils.InferenceResponse(error=response.error()) for _ in requests]
        probabilities = pb_utils.get_output_tensor_by_name(response, "PROBABILITIES").as_numpy()
        responses, row = [], 0
        for image in images:
            rows = probabilities[row:row + len(image)]
            row += len(image)
            top = rows.argmax(axis=1)
            labels = np.array([[LABELS[i].encode()] for i in top], dtype=object)
            scores = rows[np.arange(len(rows)), top].reshape(-1, 1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("LABEL", labels),
                                                         pb_utils.Tensor("SCORE", scores)]))
        return responses
