"""Response senders in the default (non-decoupled) mode, as Triton's Python backend allows since 24.06: execute()
answers each request through `request.get_response_sender()` (one response, with the final flag or before a bare
one) and returns None. The same model on Kiln and on the real Triton 2.51 (where installed), same answers and the
same refusal texts."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from .test_python_backend import write_python_model
from .test_triton_examples import Urls, kiln_or_triton

SENDING = '''
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def response(text):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text.encode()], dtype=object))])


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0])
            sender = request.get_response_sender()
            if mode == 0:  # the response with the final flag
                sender.send(response("sent final"), flags=FINAL)
            elif mode == 1:  # the response, then a bare final flag
                sender.send(response("sent, then final"))
                sender.send(flags=FINAL)
            else:  # a bare final flag before any response: refused, with Triton's text
                try:
                    sender.send(flags=FINAL)
                    text = "accepted"
                except pb_utils.TritonModelException as e:
                    text = str(e)
                sender.send(response(text), flags=FINAL)
        return None
'''
SENDING_CONFIG = ('backend: "python"\nmax_batch_size: 0\ninput [ { name: "MODE" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                  'output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]\ninstance_group [{ kind: KIND_CPU }]\n')
@pytest.fixture(scope="module", params=["kiln", "triton"])
def server(request, tmp_path_factory) -> Iterator[Urls]:
    base = tmp_path_factory.mktemp(f"default_sender_{request.param}")
    repo = base / "models"
    write_python_model(repo, "sending", SENDING, SENDING_CONFIG)
    yield from kiln_or_triton(request.param, base, repo, ["sending"])


def _infer(protocol, server: Urls, mode: int) -> str:
    client = protocol.InferenceServerClient(server.http if protocol is httpclient else server.grpc)
    tensor = protocol.InferInput("MODE", [1], "INT32")
    tensor.set_data_from_numpy(np.array([mode], np.int32))
    return client.infer("sending", [tensor]).as_numpy("OUT")[0].decode()


@pytest.mark.parametrize("protocol", [httpclient, grpcclient], ids=["http", "grpc"])
def test_execute_answers_through_the_response_sender(server, protocol):
    assert _infer(protocol, server, 0) == "sent final"
    assert _infer(protocol, server, 1) == "sent, then final"
    assert _infer(protocol, server, 2) == ("Unable to send response. Non-decoupled model cannot send complete final "
                                           "before sending a response.")


def test_a_second_response_is_refused_with_tritons_text():
    """What a default-mode sender refuses (pb_utils in this process: the stub's module has no server ties)."""
    from server.python_backend import triton_python_backend_utils as pb

    sender = pb._DefaultModeSender()
    first = pb.InferenceResponse([pb.Tensor("OUT", np.array([1], np.int32))])
    sender.send(first)
    with pytest.raises(pb.TritonModelException, match="Non-decoupled model cannot send more than one response"):
        sender.send(first, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert sender._wait() is first
    with pytest.raises(pb.TritonModelException, match="Response sender has been closed"):
        sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
