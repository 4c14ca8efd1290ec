"""A plugin op that fails on a magic value, to make a worker fault on demand in a real server.

`kiln.test::FailOnMagic` returns X + 1, and raises RuntimeError when any element of X equals MAGIC (13): the
worker that runs such a request faults exactly like a context whose kernel failed. An element equal to STALL (42)
blocks the execution for STALL_S seconds instead: a worker stuck in a call. STICKY (77) raises the text of a CUDA
fault that poisons the device context; ILLEGAL_ADDRESS (99) makes one for real on a GPU (a kernel that writes through
a bad pointer, then a synchronize that reports CUDA_ERROR_ILLEGAL_ADDRESS: every later call in that process fails
too, which is what the executor's restart is for). `python -m
tests.reliability.fault_plugin <server flags>` is `python -m server` with the plugin registered (a server
loads plugins by importing them, as TensorRT's trtexec does with --plugins; importing this module registers it).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

from engine_core.ops import TensorInfo
from engine_core.plugins import get_plugin_registry, register_plugin

MAGIC = 13.0
#: an input holding STALL makes the execution block for STALL_S seconds (kiln_execution_timeout_ms tests)
STALL, STALL_S = 42.0, 3.0
#: an input holding STICKY raises what a CUDA fault that poisons the process's device context raises (an executor
#: process then answers and exits: tests/server/test_executor_process.py)
STICKY = 77.0
#: an input holding ILLEGAL_ADDRESS runs a kernel that writes to an unmapped address (needs a GPU): a real sticky fault
ILLEGAL_ADDRESS = 99.0
#: the kernel: one thread stores through the pointer it is given (an address no allocation holds)
_POISON_SOURCE = 'extern "C" __global__ void kiln_test_poison(int* p) { *(volatile int*)p = 1; }'
DOMAIN = "kiln.test"
OP = "FailOnMagic"


def _infer(node, x: TensorInfo) -> TensorInfo:
    return TensorInfo(x.dtype, x.shape)


def _cpu(node, x: np.ndarray) -> np.ndarray:
    if np.any(x == MAGIC):
        raise RuntimeError(f"magic value {MAGIC:g} in the input")
    if np.any(x == STICKY):
        from engine_core.cuda.driver import CudaError

        raise CudaError("cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)")
    if np.any(x == ILLEGAL_ADDRESS):
        _illegal_address()
    if np.any(x == STALL):  # a stuck execution (a plugin or driver call that does not return for a while)
        time.sleep(STALL_S)
    return x + 1


def _illegal_address() -> None:
    """Fault the process's device context for real: launch the poison kernel on a bad address and synchronize
    (raises CudaError naming CUDA_ERROR_ILLEGAL_ADDRESS). Without a GPU, says so."""
    import ctypes

    from engine_core.cuda import is_available
    from engine_core.cuda.driver import Module, launch, synchronize
    from engine_core.cuda.nvrtc import compile_cubin

    if not is_available():
        raise RuntimeError(f"input value {ILLEGAL_ADDRESS:g} needs a GPU (it runs a kernel that faults)")
    function = Module(compile_cubin(_POISON_SOURCE, "poison.cu")).function("kiln_test_poison")
    launch(function, (1, 1, 1), (1, 1, 1), [(0x10, ctypes.c_void_p)])
    synchronize()
    raise RuntimeError("the poison kernel did not fault")  # not reached on a GPU: the synchronize raised


def register() -> None:
    """Register the plugin (once per process)."""
    if get_plugin_registry().get_plugin(OP, domain=DOMAIN) is None:
        register_plugin(OP, "1", DOMAIN, _infer, _cpu, doc="fails when the input holds the magic value 13")


def model(width: int = 4) -> onnx.ModelProto:
    """Y = FailOnMagic(X), X and Y [n, width] FP32."""
    graph = helper.make_graph([helper.make_node(OP, ["X"], ["Y"], domain=DOMAIN)], "fault",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", width])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", width])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    proto.ir_version = 8
    return proto


register()  # on import: builds run in forked children that import this module, not the server's __main__

if __name__ == "__main__":
    from server.cli import main

    sys.exit(main(sys.argv[1:]))
