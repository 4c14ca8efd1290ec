"""System shared memory on a server with a CUDA device: regions are page-locked at registration, CUDA models read
inputs from and write outputs into them on the device, and a region unregistered while a run still holds a view of
it stays pinned and mapped until that view goes (engine_core/cuda/host_memory.py)."""

from __future__ import annotations

import gc
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx.reference import ReferenceEvaluator

from server.core import cuda_ipc
from server.core.shared_memory import SharedMemory
from tests.cuda.models import mlp
from tests.server.conftest import examples, require_grpc
from tests.support.servers import run_server

grpcclient = pytest.importorskip("tritonclient.grpc")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_ipc.available(), reason="needs a CUDA device")]


def test_a_region_is_pinned_and_the_device_reads_and_writes_it() -> None:
    from engine_core.cuda.driver import copy_to_device, copy_to_host
    from engine_core.cuda.host_memory import MappedHostView

    block = shared_memory.SharedMemory(create=True, size=8192)
    try:
        regions = SharedMemory(remote=False)  # the core pins it itself (KILN_EXECUTOR=thread): executors do otherwise
        regions.register("pinned", "/" + block.name, 128, 4096)
        data = np.arange(16, dtype=np.float32)
        block.buf[128:192] = data.tobytes()
        view = regions.device_view("pinned", 0, 64, (1, 16), np.dtype(np.float32))
        assert isinstance(view, MappedHostView)
        np.testing.assert_array_equal(copy_to_host(view.ptr, np.dtype(np.float32), (1, 16))[0], data)
        copy_to_device(view.ptr, -data.reshape(1, 16))  # a device write lands in the client's mapping
        np.testing.assert_array_equal(np.frombuffer(block.buf[128:192], np.float32), -data)
        assert regions.device_view("pinned", 0, 64, (1, 16), np.dtype(np.float32), system=False) is None

        registration = weakref.ref(view.owner)
        regions.unregister("pinned")  # a queued run still holds `view`: pinned and mapped until it goes
        assert registration() is not None
        np.testing.assert_array_equal(copy_to_host(view.ptr, np.dtype(np.float32), (1, 16))[0], -data)
        del view
        gc.collect()
        assert registration() is None
        regions.close()
    finally:
        block.close()
        block.unlink()


CONFIG = ('name: "mlp"\nmax_batch_size: 16\ninput [{ name: "x" data_type: TYPE_FP32 dims: [ 64 ] }]\n'
          'output [{ name: "y" data_type: TYPE_FP32 dims: [ 32 ] }]\n'
          'instance_group [{ count: 1 kind: KIND_GPU }]\ndynamic_batching { max_queue_delay_microseconds: 2000 }\n')


@pytest.fixture(scope="module")
def mlp_server(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("pinned")
    model = mlp()
    examples.write_model(base / "models", "mlp", model, CONFIG)
    with run_server(base / "models", base / "server.log", ["mlp"], ["--allow-client-shm", "true"],
                    ready_timeout_s=300) as server:  # a fresh machine compiles the CUDA kernels at the first build
        yield server, ReferenceEvaluator(model)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cuda_model_reads_and_writes_system_shared_memory(protocol: str, mlp_server) -> None:
    server, reference = mlp_server
    module = httpclient if protocol == "http" else grpcclient
    url = server.http_url if protocol == "http" else require_grpc(server).grpc_url
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 1, 64)).astype(np.float32)
    expected = [reference.run(None, {"x": row})[0] for row in x]
    names = [f"{protocol}_pin_in", f"{protocol}_pin_out"]
    sizes = [x.nbytes, 8 * 32 * 4]
    handles = [shm.create_shared_memory_region(name, f"/{name}", size) for name, size in zip(names, sizes)]
    client = module.InferenceServerClient(url)
    try:
        shm.set_shared_memory_region(handles[0], [x])
        for name, size in zip(names, sizes):
            client.register_system_shared_memory(name, f"/{name}", size)

        def one(index: int) -> None:
            inputs = [module.InferInput("x", [1, 64], "FP32")]
            inputs[0].set_shared_memory(names[0], 256, offset=256 * index)
            outputs = [module.InferRequestedOutput("y")]
            outputs[0].set_shared_memory(names[1], 128, offset=128 * index)
            result = client.infer("mlp", inputs, outputs=outputs)
            assert result.get_output("y") is not None
            written = shm.get_contents_as_numpy(handles[1], np.float32, [8, 1, 32])
            np.testing.assert_allclose(written[index], expected[index], rtol=2e-3, atol=2e-3)

        for index in range(8):
            one(index)
        if protocol == "grpc":  # the HTTP client is not for threads
            with ThreadPoolExecutor(8) as pool:  # concurrent requests batch and group: each finds its own rows
                list(pool.map(one, [i % 8 for i in range(64)]))
    finally:
        client.unregister_system_shared_memory()
        client.close()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
