"""Triton's simple_sequence accumulator as a Python-backend model.

The sequence batcher sends every request of a sequence (one correlation ID) to this model in order, one at a
time, with two control inputs it fills itself: START (1 on the sequence's first request) and READY (0 on a row
without a request, which Triton's direct strategy may send to fill a batch). The model keeps one running sum per
correlation ID: START resets it to the request's INPUT, every other request adds its INPUT; OUTPUT is the sum so
far. The request flagged sequence_end drops the sum.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        output_config = pb_utils.get_output_config_by_name(self.model_config, "OUTPUT")
        self.output_dtype = pb_utils.triton_string_to_numpy(output_config["data_type"])
        self.sums = {}  # correlation ID -> running sum

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()
            corrid = request.correlation_id()
            if not ready.reshape(-1)[0]:  # a row without a request: nothing to add
                total = np.zeros_like(value)
            elif start.reshape(-1)[0] or corrid not in self.sums:
                total = value.copy()
            else:
                total = self.sums[corrid] + value
            if ready.reshape(-1)[0]:
                if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                    self.sums.pop(corrid, None)
                else:
                    self.sums[corrid] = total
            output = pb_utils.Tensor("OUTPUT", total.astype(self.output_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses

    def finalize(self):
        self.sums.clear()
