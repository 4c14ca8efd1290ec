"""Large request tensors from frontend processes to the core through each frontend's shared-memory arena
(server/core/tensor_arena.py): the ring's allocation order, a group's inputs written into the arena, the rows of a
member of such a group, the arena hidden from clients, and real servers answering exactly with and without it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from server.core.errors import ServerError
from server.core.grouping import member_request
from server.core.shared_memory import SharedMemory
from server.core.tensor_arena import ARENA_PREFIX, TensorArena, _Ring
from server.core.types import InferInput, InferRequest

from .conftest import examples, run_server

grpcclient = pytest.importorskip("tritonclient.grpc")

WIDTH = 32768  # FP32 elements a row: 128 KB, above MIN_ARENA_BYTES
CONFIG = (f'name: "wide_add"\nmax_batch_size: 8\n'
          f'input [{{ name: "A" data_type: TYPE_FP32 dims: [ {WIDTH} ] }}, {{ name: "B" data_type: TYPE_FP32 dims: [ 4 ] }}]\n'
          f'output [{{ name: "SUM" data_type: TYPE_FP32 dims: [ {WIDTH} ] }}]\n'
          'dynamic_batching { max_queue_delay_microseconds: 2000 }\n')


def _wide_add():
    """SUM = A + B[:, :1] (B small: it stays in the message while A goes through the arena)."""
    nodes = [helper.make_node("Slice", ["B", "zero", "one", "one"], ["B0"]),
             helper.make_node("Add", ["A", "B0"], ["SUM"])]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [1], [0]), helper.make_tensor("one", TensorProto.INT64, [1], [1])]
    graph = helper.make_graph(nodes, "wide_add", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["n", WIDTH]),
                                                  helper.make_tensor_value_info("B", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("SUM", TensorProto.FLOAT, ["n", WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_the_ring_hands_out_space_in_order_and_wraps_once_the_oldest_is_freed() -> None:
    ring = _Ring(4096)
    a, b, c = ring.allocate(1000), ring.allocate(1000), ring.allocate(1000)
    assert (a.start, b.start, c.start) == (0, 1024, 2048)  # 256-byte aligned
    assert ring.allocate(2000) is None  # 1024 left at the end, nothing free before the oldest
    ring.free(b)  # not the oldest: its space comes back only with a's
    assert ring.allocate(1500) is None
    ring.free(a)
    d = ring.allocate(1500)
    assert d is not None and d.start == 0  # wrapped to the front
    assert ring.allocate(600) is None  # [1536, 2048) is free but only 512 bytes
    e = ring.allocate(512)
    assert e is not None and e.start == 1536
    ring.free(e)  # the newest: its space is free again at once
    assert ring.allocate(512).start == 1536
    ring.free(c)
    ring.free(d)
    assert ring.used == 1  # the 512 bytes still live, behind the freed ones
    ring.free(ring._spans[-1])
    assert ring.used == 0 and ring.allocate(4096).start == 0  # empty: from the start again


def test_a_group_is_written_into_the_arena_and_a_member_is_its_rows_of_the_region() -> None:
    arena = TensorArena(1 << 20)
    try:
        rng = np.random.default_rng(0)
        wide = [rng.standard_normal((n, WIDTH)).astype(np.float32) for n in (1, 2)]
        small = [np.full((n, 4), i, np.float32) for i, n in enumerate((1, 2))]
        requests = [InferRequest("m", [InferInput("A", "FP32", w.shape, w), InferInput("B", "FP32", s.shape, s)])
                    for w, s in zip(wide, small)]
        placed = arena.place(requests)
        assert placed is not None
        request, spans = placed
        a, b = request.inputs
        assert a.data is None and a.parameters["shared_memory_region"] == arena.name and a.shape == (3, WIDTH)
        np.testing.assert_array_equal(b.data, np.concatenate(small))  # under MIN_ARENA_BYTES: in the message
        regions = SharedMemory()
        regions.register_arena(arena.name, arena.key, arena.nbytes)
        whole = np.frombuffer(regions.read(arena.name, a.parameters["shared_memory_offset"],
                                           a.parameters["shared_memory_byte_size"]), np.float32).reshape(3, WIDTH)
        np.testing.assert_array_equal(whole, np.concatenate(wide))
        second = member_request(request, 1, 3).inputs[0]  # the core running members one by one
        rows = np.frombuffer(regions.read(arena.name, second.parameters["shared_memory_offset"],
                                          second.parameters["shared_memory_byte_size"]), np.float32)
        np.testing.assert_array_equal(rows.reshape(2, WIDTH), wide[1])
        arena.release(spans)
        regions.unregister_arena(arena.name)
        assert arena.place([InferRequest("m", [InferInput("B", "FP32", (1, 4), small[0])])]) is None  # too small
        del whole, rows
    finally:
        arena.close()


def test_an_arena_is_hidden_from_clients() -> None:
    arena = TensorArena(1 << 16)
    try:
        regions = SharedMemory()
        regions.register_arena(arena.name, arena.key, arena.nbytes)
        assert regions.status() == []
        with pytest.raises(ServerError, match="Unable to find system shared memory region"):
            regions.status(arena.name)
        regions.unregister()  # a client's unregister-all leaves it
        regions.unregister(arena.name)  # and so does naming it
        assert regions.read(arena.name, 0, 16) is not None
        with pytest.raises(ServerError, match="reserved for the server"):
            regions.register(f"{ARENA_PREFIX}mine", arena.key, 0, 16)
        regions.unregister_arena(arena.name)
        with pytest.raises(ServerError, match="not registered"):
            regions.read(arena.name, 0, 16)
    finally:
        arena.close()


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("arena")
    examples.write_model(base / "models", "wide_add", _wide_add(), CONFIG)
    return base


@pytest.mark.parametrize("arena_mb", ["64", "0"])
def test_servers_answer_exactly_with_and_without_arenas(repository: Path, arena_mb: str) -> None:
    with run_server(repository / "models", repository / f"server_{arena_mb}.log", ["wide_add"],
                    ["--frontend-processes", "2", "--frontend-arena-mb", arena_mb, "--allow-client-shm", "true"]) as server:
        maps = "".join(Path(f"/proc/{pid}/maps").read_text() for pid in [server.process.pid])
        assert ("kiln_arena_" in maps) == (arena_mb != "0")  # the core mapped one arena per frontend, or none
        rng = np.random.default_rng(1)
        cases = [(rng.standard_normal((1 + i % 3, WIDTH)).astype(np.float32),
                  np.full((1 + i % 3, 4), float(i), np.float32)) for i in range(48)]
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        http = httpclient.InferenceServerClient(server.http_url)

        def one(case: tuple[np.ndarray, np.ndarray], index: int) -> None:
            module, client = (grpcclient, grpc) if index % 2 else (httpclient, http)
            a, b = case
            inputs = [module.InferInput("A", list(a.shape), "FP32"), module.InferInput("B", list(b.shape), "FP32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            np.testing.assert_array_equal(client.infer("wide_add", inputs).as_numpy("SUM"), a + b[:, :1])

        with ThreadPoolExecutor(16) as pool:  # concurrent gRPC: frontends group them, groups share the arena
            list(pool.map(one, cases, [1] * len(cases)))
        for index, case in enumerate(cases[:6]):  # HTTP (its client is not for threads): each alone
            one(case, 2 * index)
        assert grpc.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
        grpc.unregister_system_shared_memory()  # a client's unregister-all: the arenas stay
        one(cases[0], 1)
        stats = grpc.get_inference_statistics("wide_add", as_json=True)["model_stats"][0]["inference_stats"]
        assert int(stats["success"]["count"]) == len(cases) + 7
        grpc.close()
        http.close()
        frontends = {pid for task in Path(f"/proc/{server.process.pid}/task").iterdir()
                     for pid in (task / "children").read_text().split()}
        left = [name for name in os.listdir("/dev/shm") if name.split("_")[2:3] and name.split("_")[2] in frontends]
        assert not left  # unlinked once the core mapped them: nothing stays behind when a process dies


def test_an_arena_that_does_not_fit_shrinks_then_goes(monkeypatch) -> None:
    """/dev/shm without room (ENOSPC from the reservation): half the size is tried down to MIN_ARENA_MB, then no
    arena at all; nothing is left behind in /dev/shm."""
    from server.core import tensor_arena

    sizes: list[int] = []
    reserve = os.posix_fallocate

    def no_room(fd: int, offset: int, nbytes: int) -> None:
        sizes.append(nbytes)
        if nbytes > 16 << 20:
            raise OSError(28, "No space left on device")
        reserve(fd, offset, nbytes)

    monkeypatch.setattr(tensor_arena.os, "posix_fallocate", no_room)
    before = set(os.listdir("/dev/shm"))
    arena = tensor_arena.open_arena(64)
    assert arena is not None and arena.nbytes == 16 << 20 and sizes == [64 << 20, 32 << 20, 16 << 20]
    arena.close()
    monkeypatch.setattr(tensor_arena, "MIN_ARENA_MB", 32)
    assert tensor_arena.open_arena(64) is None
    assert set(os.listdir("/dev/shm")) == before
    assert tensor_arena.open_arena(0) is None
