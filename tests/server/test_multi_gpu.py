"""A model version on two GPUs (server/core/placement.py): one executor process per GPU, each seeing its GPU first in
CUDA_VISIBLE_DEVICES; the completed config lists the GPUs; one batcher feeds both; a sticky CUDA error on one GPU
fails only its batch and restarts that executor alone while the other serves on. `--gpus` narrows the server.

Needs two CUDA devices (skipped otherwise). The model is the fault plugin's (tests/reliability/fault_plugin.py:
Y = X + 1, and a sticky CUDA error on STICKY), as in tests/server/test_executor_process.py; the CPU half of these
checks is tests/server/test_gpu_placement.py.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from server.core import cuda_ipc
from server.core.placement import child_visible_devices

from .conftest import examples, run_server
from .test_executor_process import _executor_pids, exited

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(cuda_ipc.device_count() < 2, reason="needs two CUDA devices")]

ENV = {"KILN_EXECUTOR": "process"}
READY_S = 600.0  # a fresh machine compiles the kernels first
IO = ('input [{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }]\n'
      'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }]\n')


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    from tests.reliability import fault_plugin

    base = tmp_path_factory.mktemp("multi_gpu")
    models = {
        "two": 'max_batch_size: 8\ninstance_group [{ count: 1 kind: KIND_GPU gpus: [0, 1] }]\ndynamic_batching { }\n',
        "every": "max_batch_size: 8\ndynamic_batching { }\n",  # KIND_AUTO: every visible GPU
        "second": 'max_batch_size: 8\ninstance_group [{ kind: KIND_GPU gpus: [1] }]\n',
        "unbatched": 'max_batch_size: 0\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ -1, 4 ] }]\n'
                     'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1, 4 ] }]\n'
                     'instance_group [{ kind: KIND_GPU gpus: [0, 1] }]\n',
    }
    for name, config in models.items():
        examples.write_model(base / "models", name, fault_plugin.model(), config + (IO if "input" not in config else ""))
    return base


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _infer(url: str, value: float) -> np.ndarray:
    tensor = httpclient.InferInput("X", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return httpclient.InferenceServerClient(url, network_timeout=60).infer("two", [tensor]).as_numpy("Y")


def _burst(url: str, count: int, threads: int = 32) -> list[bool]:
    local = threading.local()

    def one(i: int) -> bool:
        if not hasattr(local, "client"):
            local.client = httpclient.InferenceServerClient(url, network_timeout=60)
        tensor = httpclient.InferInput("X", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.full((1, 4), float(i % 10), np.float32))
        y = local.client.infer("two", [tensor]).as_numpy("Y")
        return bool(np.array_equal(y, np.full((1, 4), float(i % 10) + 1, np.float32)))

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(count)))


def test_a_version_on_two_gpus_runs_an_executor_on_each_and_survives_a_sticky_fault_on_one(repository: Path):
    from tests.reliability import fault_plugin

    with run_server(repository / "models", repository / "server.log", ["two"], env=ENV,
                    module="tests.reliability.fault_plugin", ready_timeout_s=READY_S) as server:
        pids = _executor_pids(server.process.pid)
        assert len(pids) == 2, "one executor process per GPU"
        count = cuda_ipc.device_count()
        expected = {child_visible_devices(d, count, os.environ) for d in (0, 1)}
        seen = {pid: _environ(pid).get("CUDA_VISIBLE_DEVICES") for pid in pids}
        assert set(seen.values()) == expected, seen  # e.g. "0,1" and "1,0": each sees its GPU as device 0

        client = httpclient.InferenceServerClient(server.http_url)
        group = client.get_model_config("two")["instance_group"][0]
        assert group["gpus"] == [0, 1] and group["kind"] == "KIND_GPU"

        before = {pid: _cpu_ticks(pid) for pid in pids}
        assert all(_burst(server.http_url, 3000))
        busy = {pid: _cpu_ticks(pid) - before[pid] for pid in pids}
        assert all(ticks > 0 for ticks in busy.values()), f"an executor ran nothing: {busy}"  # one batcher, both GPUs

        with pytest.raises(InferenceServerException, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            _infer(server.http_url, fault_plugin.STICKY)
        deadline = time.monotonic() + 20
        while not any(exited(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = {pid for pid in pids if not exited(pid)}
        assert len(survivors) == 1, "exactly the faulted GPU's executor exited"
        answers = _burst(server.http_url, 400)  # the next requests succeed (the faulted GPU restarts on its next call)
        assert all(answers)
        (survivor,) = survivors
        after = _executor_pids(server.process.pid)
        assert survivor in after and len(after) == 2, "the other GPU's executor kept serving, untouched"
        restarted = next(pid for pid in after if pid != survivor)
        assert _environ(restarted).get("CUDA_VISIBLE_DEVICES") == seen[next(p for p in pids if p != survivor)]


def test_kind_auto_takes_every_gpu_and_refusals_name_the_reason(repository: Path):
    with run_server(repository / "models", repository / "server_auto.log", ["every"], env=ENV,
                    module="tests.reliability.fault_plugin", ready_timeout_s=READY_S) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        group = client.get_model_config("every")["instance_group"][0]
        assert group["kind"] == "KIND_GPU" and group["gpus"] == list(range(cuda_ipc.device_count()))
        assert len(_executor_pids(server.process.pid)) == cuda_ipc.device_count()
        with pytest.raises(InferenceServerException, match=r"lists gpus \[0, 1\], but a model with max_batch_size 0 "
                                                           "runs in the server process"):
            client.load_model("unbatched")


def test_serve_gpus_narrows_the_server_to_those_devices(repository: Path):
    with run_server(repository / "models", repository / "server_gpus.log", ["every"], ["--gpus", "1"], env=ENV,
                    module="tests.reliability.fault_plugin", ready_timeout_s=READY_S) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.get_model_config("every")["instance_group"][0]["gpus"] == [0]  # GPU 1 is its only device
        (pid,) = _executor_pids(server.process.pid)
        parent = os.environ.get("CUDA_VISIBLE_DEVICES")
        expected = "1" if parent is None else parent.split(",")[1].strip()
        assert _environ(pid).get("CUDA_VISIBLE_DEVICES") == expected
        with pytest.raises(InferenceServerException, match="lists GPU 1, but this server sees 1 CUDA device"):
            client.load_model("second")
