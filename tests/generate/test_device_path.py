"""The CUDA decode path: the KV cache in device memory, gathered into and scattered out of the engine's own buffers by
two kernels a step, the engine run by device address with shape buckets.

On the CPU the whole path runs with its driver calls emulated (emulated_cuda.py: host memory for device memory, the
kernels' numpy contract for the kernels) on the tiny decoder's CPU engine, which runs by address too; its tokens,
logits and cache must equal the host path's. The GPU tests run the real kernels and a CUDA engine against the CPU
engine, check that device memory is freed on close and that steps of one shape replay a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_core.errors import KilnError
from engine_core.generate import DecoderRunner, KVBlockPool, build_decoder_engine
from engine_core.generate.device_argmax import SAMPLING_KERNEL_FILE
from engine_core.generate.device_kv import KV_KERNEL_FILE, DeviceKVPool
from tests.generate import emulated_cuda

PROMPTS = {"long": list(range(100, 125)), "short": [50, 60, 70, 80, 90, 100, 110], "one": [1, 2, 3]}


def _scenario(runner: DecoderRunner, pool, steps: int = 32) -> tuple[dict[str, list[int]], list[np.ndarray]]:
    """A chunked prefill (the long prompt in 10 + 10 + 5 beside the others, its last chunk in one run with another
    sequence's decode token), then ``steps`` greedy decode steps of all three (pasts of different lengths). Returns
    each sequence's tokens and every run's logits."""
    long, tokens, logits = PROMPTS["long"], {s: [] for s in PROMPTS}, []

    def take(seqs: list[str], rows: np.ndarray) -> None:
        logits.append(rows)
        for seq, row in zip(seqs, rows):
            tokens[seq].append(int(np.argmax(row)))

    runs = [(["long", "one"], [long[:10], PROMPTS["one"]]), (["long", "short"], [long[10:20], PROMPTS["short"]])]
    for seqs, chunks in runs:
        rows = runner.prefill(pool, seqs, chunks)
        take(seqs[1:], rows[1:])
    take(["long", "one"], runner.step(pool, ["long", "one"], [long[20:], [tokens["one"][-1]]]))
    order = ["short", "long", "one"]
    for _ in range(steps):
        take(order, runner.decode(pool, order, [tokens[s][-1] for s in order]))
    return tokens, logits


def _assert_same_cache(got, want, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    seqs = list(PROMPTS)
    assert [got.length(s) for s in seqs] == [want.length(s) for s in seqs]
    for a, b in zip(got.gather(seqs, 64), want.gather(seqs, 64)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# -- on the CPU, driver calls emulated -----------------------------------------------------------------------------

@pytest.fixture
def emulated(monkeypatch):
    emulated_cuda.HostBuffer.alive = 0
    return emulated_cuda.emulate(monkeypatch)


def _device_runner(engine) -> DecoderRunner:
    runner = DecoderRunner(engine)
    runner.on_device = True  # the CPU engine reads the emulated "device" (host) addresses
    return runner


def test_the_emulated_device_path_matches_the_host_path(tiny_engine, emulated):
    host_runner, runner = DecoderRunner(tiny_engine), _device_runner(tiny_engine)
    host_pool = host_runner.new_pool(block_tokens=8, num_blocks=40)
    pool = runner.new_pool(block_tokens=8, num_blocks=40)
    assert isinstance(host_pool, KVBlockPool) and isinstance(pool, DeviceKVPool)
    want_tokens, want_logits = _scenario(host_runner, host_pool)
    got_tokens, got_logits = _scenario(runner, pool)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    _assert_same_cache(pool, host_pool)
    kinds = [name.split("_w")[0] for name, _, _ in emulated.calls]
    runs = 3 + 32
    assert kinds.count("kv_scatter") == runs and kinds.count("kv_gather") == runs - 1  # the first run has no past
    assert {name.split("_w")[1] for name, _, _ in emulated.calls} == {"16"}  # 16 fp32 elements a row: 16-byte words


def _recording(context, shapes: list) -> None:
    set_shape = context.set_input_shape

    def recording(name, shape):
        shapes.append((name, tuple(shape)))
        return set_shape(name, shape)

    context.set_input_shape = recording


def test_decode_steps_of_one_shape_bind_nothing_new(tiny_engine, emulated):
    """While the longest past stays in one bucket a decode step sets no input shape and no address: the CUDA graph
    of the shape is replayed. Buffers are allocated a few times while runs grow, never per step."""
    runner = _device_runner(tiny_engine)
    pool = runner.new_pool(block_tokens=8, num_blocks=40)
    runner.prefill(pool, ["a", "b", "c"], [[1, 2, 3], [4] * 9, [5]])
    stepper = runner._stepper
    assert runner.context.get_tensor_shape("input_ids") == (4, 16)  # 3 rows -> 4, a chunk of 9 -> 16 columns
    context, shapes = stepper.decode_context, []  # decode runs on a context of their own
    _recording(context, shapes)
    tokens = [1, 1, 1]
    runner.decode(pool, ["a", "b", "c"], tokens)  # pasts 3, 9, 1 -> 64 columns, capped at the context: 63
    assert ("input_ids", (4, 1)) in shapes and ("attention_mask", (4, 64)) in shapes
    allocations = [stepper._past.allocations, stepper._present.allocations, stepper._logits.allocations]
    shapes.clear()
    addresses = {name: context.get_tensor_address(name) for name in ("input_ids", "logits", "present.1.value")}
    for _ in range(20):  # longest pasts 10 .. 29: one bucket
        runner.decode(pool, ["a", "b", "c"], tokens)
    assert shapes == []
    assert {name: context.get_tensor_address(name) for name in addresses} == addresses
    assert [stepper._past.allocations, stepper._present.allocations, stepper._logits.allocations] == allocations
    assert runner.context.get_tensor_shape("input_ids") == (4, 16)  # the prefill context kept its shapes


def test_warm_up_runs_every_bucket_on_pad_rows_before_any_sequence(tiny_engine, emulated):
    """Warm-up runs each decode bucket and each prefill bucket without a past (largest first) and leaves the pool
    as it was; the sequences after it run the same tokens as on a cold runner, their decode shapes are warmed ones,
    and no buffer is allocated again (a captured graph keeps its addresses)."""
    from engine_core.generate.kv_layout import bucket_shapes

    runner = _device_runner(tiny_engine)
    pool = runner.new_pool(block_tokens=8, num_blocks=40)
    stepper = runner._device_stepper()
    warmed: list = []
    _recording(stepper.decode_context, warmed)
    _recording(stepper.context, warmed)
    shapes = bucket_shapes(4, 64, 32)
    assert runner.warm_up(pool, max_prefill_tokens=32) == len(shapes)
    assert shapes[0] == (4, 63, 1) and max(b * n for b, _, n in shapes if n > 1) == 4 * 32
    assert pool.used_blocks == 0 and pool.free_blocks == 40
    allocations = [stepper._past.allocations, stepper._present.allocations, stepper._logits.allocations,
                   stepper._inputs.allocations]
    seen: list = []
    _recording(stepper.decode_context, seen)
    got_tokens, _ = _scenario(runner, pool)
    cold = _device_runner(tiny_engine)
    want_tokens, _ = _scenario(cold, cold.new_pool(block_tokens=8, num_blocks=40))
    assert got_tokens == want_tokens
    assert set(seen) <= set(warmed)
    assert [stepper._past.allocations, stepper._present.allocations, stepper._logits.allocations,
            stepper._inputs.allocations] == allocations


def test_closing_frees_the_device_memory(tiny_engine, emulated):
    runner = _device_runner(tiny_engine)
    pool = runner.new_pool(block_tokens=8, num_blocks=40)
    assert emulated_cuda.HostBuffer.alive == pool.nbytes == 40 * pool.bytes_per_block
    runner.prefill(pool, ["a"], [[1, 2, 3]])
    assert emulated_cuda.HostBuffer.alive > pool.nbytes  # the engine-side buffers
    runner.close()
    assert emulated_cuda.HostBuffer.alive == pool.nbytes
    pool.close()
    pool.close()
    assert emulated_cuda.HostBuffer.alive == 0 and pool.closed
    with pytest.raises(KilnError, match="the device KV cache is closed"):
        assert pool.keys_ptr


def test_a_device_pool_needs_an_engine_that_reads_device_addresses(tiny_engine, emulated):
    runner = DecoderRunner(tiny_engine)
    assert not runner.on_device and isinstance(runner.new_pool(block_tokens=8, num_blocks=4), KVBlockPool)
    pool = runner.new_pool(block_tokens=8, num_blocks=4, on_device=True)
    with pytest.raises(ValueError, match="a device KV cache needs a CUDA engine; this one runs on 'cpu'"):
        runner.prefill(pool, ["a"], [[1, 2]])
    assert "a" not in pool


def test_the_kv_kernels_compile_for_sm90(tmp_path, monkeypatch):
    from engine_core.cuda.nvrtc import compile_kernel_file

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    cubin = compile_kernel_file(KV_KERNEL_FILE, arch="sm_90")
    for kind in ("gather", "scatter"):
        for word in (1, 2, 4, 8, 16):
            assert f"kv_{kind}_w{word}".encode() in cubin
    assert b"rows_argmax_f32" in compile_kernel_file(SAMPLING_KERNEL_FILE, arch="sm_90")


# -- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("head_dim", [16, 3])  # 16-byte words; 2- or 4-byte words
def test_the_kv_kernels_match_their_contract(dtype, head_dim):
    from engine_core.cuda.driver import DeviceBuffer, Stream, copy_to_device, copy_to_host
    from engine_core.generate.device_kv import slice_bytes
    from engine_core.generate.kv_layout import gather_reference, scatter_reference

    rng = np.random.default_rng(0)
    layers, heads, block_tokens, itemsize = 3, 2, 4, np.dtype(dtype).itemsize
    pool = DeviceKVPool(layers, heads, head_dim, block_tokens=block_tokens, num_blocks=16, dtype=dtype)
    stream = Stream()
    blocks = rng.standard_normal((2, 16, layers, heads, block_tokens, head_dim)).astype(dtype)
    copy_to_device(pool.keys_ptr, blocks)  # keys, then values
    for seq, length in (("other", 3), ("a", 9), ("b", 0), ("c", 4)):
        pool.reserve(seq, length + 3)
        pool._written(seq, 0, length)
    seqs, past, new = ["a", "b", "c"], 12, 3
    tables = pool.block_tables(seqs, 4)  # and a pad row
    lengths, counts = np.array([9, 0, 4, 0]), np.array([3, 1, 2, 0])
    small = {n: DeviceBuffer.from_array(np.ascontiguousarray(a, np.int32))
             for n, a in (("tables", tables), ("lengths", lengths), ("counts", counts))}
    stride = slice_bytes(4, heads, past, head_dim, itemsize)
    dense = DeviceBuffer(2 * layers * stride)
    pool.gather_into(dense.ptr, stride, small["tables"].ptr, small["lengths"].ptr, batch=4, past_len=past,
                     max_blocks=tables.shape[1], stream=stream.handle)
    stream.synchronize()
    want = gather_reference(blocks[0], blocks[1], tables, lengths, past)
    for slot in range(2 * layers):
        got = copy_to_host(dense.ptr + slot * stride, np.dtype(dtype), (4, heads, past, head_dim))
        np.testing.assert_array_equal(got, want[slot // 2, slot % 2])
    present = rng.standard_normal((layers, 2, 4, heads, past + new, head_dim)).astype(dtype)
    stride = slice_bytes(4, heads, past + new, head_dim, itemsize)
    source = DeviceBuffer(2 * layers * stride)
    for slot in range(2 * layers):
        copy_to_device(source.ptr + slot * stride, present[slot // 2, slot % 2])
    pool.scatter_from(source.ptr, stride, small["tables"].ptr, small["lengths"].ptr, small["counts"].ptr, batch=4,
                      past_len=past, new_len=new, max_blocks=tables.shape[1], stream=stream.handle)
    stream.synchronize()
    scatter_reference(blocks[0], blocks[1], present, tables, lengths, counts, past)
    keys, values = pool.read_blocks()
    np.testing.assert_array_equal(keys, blocks[0])
    np.testing.assert_array_equal(values, blocks[1])


@pytest.mark.gpu
def test_the_argmax_kernel_picks_what_numpy_picks():
    """rows_argmax_f32 on rows that test its rule: ties (the first index), -inf everywhere, a NaN (first NaN wins),
    the maximum in the last element, a vocabulary shorter than a block's threads and one not a multiple of them;
    rows read at element offsets, not in order."""
    from engine_core.cuda.driver import DeviceBuffer, Stream, copy_to_host
    from engine_core.generate.device_argmax import launch_rows_argmax

    rng = np.random.default_rng(3)
    for vocab in (5, 1000, 128_256):
        rows = rng.standard_normal((6, vocab)).astype(np.float32)
        rows[0, [1, 3]] = 9.0  # a tie: index 1
        rows[1] = -np.inf
        rows[2, [2, 4]] = np.nan
        rows[3, -1] = 50.0
        rows[4] = 0.0
        offsets = np.array([5, 0, 3, 1, 4, 2], np.int64)
        logits, starts = DeviceBuffer.from_array(rows), DeviceBuffer.from_array(offsets * vocab)
        out, stream = DeviceBuffer(4 * len(offsets)), Stream()
        launch_rows_argmax(logits.ptr, starts.ptr, len(offsets), vocab, out.ptr, stream.handle)
        stream.synchronize()
        got = copy_to_host(out.ptr, np.dtype(np.int32), (len(offsets),))
        np.testing.assert_array_equal(got, np.argmax(rows[offsets], axis=1), err_msg=f"vocab {vocab}")


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "fp16"])
def cuda_engine(request, tiny_decoder):
    return request.param, build_decoder_engine(tiny_decoder / "model.onnx", max_batch_size=4, max_context=64,
                                               backend="cuda", fp16=request.param, tf32=False)


@pytest.mark.gpu
def test_the_device_path_generates_the_cpu_engines_tokens(tiny_engine, cuda_engine):
    """Batched decode of sequences of different lengths after a chunked prefill: the CUDA engine's greedy tokens on
    the device path equal the CPU engine's (fp32 without TF32: all 32; fp16: the first 16, a near tie may swap
    later), and so do its cached keys and values (fp32)."""
    fp16, engine = cuda_engine
    host_runner, runner = DecoderRunner(tiny_engine), DecoderRunner(engine)
    host_pool = host_runner.new_pool(block_tokens=8, num_blocks=40)
    pool = runner.new_pool(block_tokens=8, num_blocks=40)
    assert runner.on_device and isinstance(pool, DeviceKVPool)
    want, _ = _scenario(host_runner, host_pool)
    got, _ = _scenario(runner, pool)
    steps = 16 if fp16 else 32
    assert {s: t[:steps] for s, t in got.items()} == {s: t[:steps] for s, t in want.items()}
    if not fp16:
        _assert_same_cache(pool, host_pool, rtol=1e-3, atol=1e-3)
    state = runner._stepper.decode_context._backend_context
    if getattr(state, "use_graphs", False):
        assert state.graph_replays > 0, "decode steps of one shape should replay a captured CUDA graph"
    runner.close()
    pool.close()


@pytest.mark.gpu
def test_after_warm_up_decode_steps_bind_and_capture_nothing_new(tiny_engine, cuda_engine):
    """DecoderRunner.warm_up captures every decode bucket: a scenario afterwards (chunked prefill, batched decode of
    pasts of different lengths) adds no binding and no graph to the decode context and replays its graphs, and its
    tokens are the cold runner's."""
    fp16, engine = cuda_engine
    runner = DecoderRunner(engine)
    pool = runner.new_pool(block_tokens=8, num_blocks=40)
    assert runner.warm_up(pool, max_prefill_tokens=32) > 0 and pool.used_blocks == 0
    state = runner._stepper.decode_context._backend_context
    bindings = len(state._bindings)
    graphs = sum(len(b.graphs) for b in state._bindings.values())
    replays = state.graph_replays
    got, _ = _scenario(runner, pool)
    assert len(state._bindings) == bindings and sum(len(b.graphs) for b in state._bindings.values()) == graphs
    if getattr(state, "use_graphs", False):
        assert state.graph_replays >= replays + 32
    cold = DecoderRunner(engine)
    cold_pool = cold.new_pool(block_tokens=8, num_blocks=40)
    want, _ = _scenario(cold, cold_pool)
    steps = 16 if fp16 else 32
    assert {s: t[:steps] for s, t in got.items()} == {s: t[:steps] for s, t in want.items()}
    for each, each_pool in ((runner, pool), (cold, cold_pool)):
        each.close()
        each_pool.close()


@pytest.mark.gpu
def test_the_device_pool_and_buffers_are_freed_on_close(tiny_engine, cuda_engine):
    from engine_core.cuda.driver import memory_info

    _, engine = cuda_engine
    runner = DecoderRunner(engine)
    warm = runner.new_pool(block_tokens=16, num_blocks=8)  # libraries and the context's arena set up first
    runner.prefill(warm, ["w"], [list(range(40))])
    warm.close()
    runner.close()
    before, _ = memory_info()
    pool = runner.new_pool(block_tokens=16, num_blocks=16384)  # 128 MiB of fp32 keys and values
    runner.prefill(pool, ["a"], [list(range(40))])
    during, _ = memory_info()
    assert before - during >= pool.nbytes >= 64 << 20
    runner.close()
    pool.close()
    after, _ = memory_info()
    assert before - after < 16 << 20


def test_the_step_benchmark_runs_on_the_cpu(tiny_decoder, tmp_path):
    """bench/generate_step.py's logic (prefill, truncated steps, table, JSON) on the tiny decoder's CPU engine."""
    import json

    from tests.support.examples import ROOT, load_file

    bench = load_file(ROOT / "bench" / "generate_step.py")
    out = tmp_path / "steps.json"
    assert bench.main([str(tiny_decoder), "--backend", "cpu", "--batches", "1,3", "--pasts", "8,20", "--iters", "2",
                       "--warmup", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["path"], r["batch"], r["past"]) for r in rows] == [("host", 1, 8), ("host", 1, 20), ("host", 3, 8),
                                                                   ("host", 3, 20)]
    assert all(r["median_ms"] > 0 and r["iters"] == 2 for r in rows)


def _generate(engine, budget: int) -> list[list[int]]:
    import threading

    from engine_core.generate import Generator, SamplingParams

    prompts, results = list(PROMPTS.values()), []
    with Generator(engine, max_batch_size=4, max_context=64, eos_token_ids=(), max_prefill_tokens=budget) as generator:
        for prompt in prompts:
            tokens: list[int] = []
            done = threading.Event()

            def on_event(event, tokens=tokens, done=done):
                if event.token_id is not None:
                    tokens.append(event.token_id)
                if event.final:
                    done.set()

            generator.submit(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), on_event)
            results.append((tokens, done))
        for _, done in results:
            assert done.wait(30)
        assert generator.stats().kv_blocks_used == 0
    return [tokens for tokens, _ in results]


@pytest.mark.parametrize("budget", [512, 5])
def test_the_generator_takes_the_device_path_unchanged(tiny_engine, emulated, monkeypatch, budget):
    """A Generator on an engine that reports the CUDA backend steps a DeviceKVPool (emulated) and generates what it
    does on the host path, prompts prefilled whole or in chunks of 5; its greedy decode steps take the argmax on
    the device (device_argmax.py) and bring back only the token ids."""
    from engine_core.runtime import CudaEngine

    want = _generate(tiny_engine, budget)
    monkeypatch.setattr(CudaEngine, "backend", property(lambda self: "cuda"))
    scatters = len([c for c in emulated.calls if c[0].startswith("kv_scatter")])
    assert _generate(tiny_engine, budget) == want
    assert len([c for c in emulated.calls if c[0].startswith("kv_scatter")]) > scatters + 20
    argmaxes = [grid for name, grid, _ in emulated.calls if name == "rows_argmax_f32"]
    assert len(argmaxes) > 20 and max(argmaxes) == len(PROMPTS)  # a row per sequence, every one in one step


def test_a_failed_run_raises_with_its_message_and_writes_nothing(tiny_engine, emulated, monkeypatch):
    from engine_core.errors import ExecutionError

    runner = _device_runner(tiny_engine)
    pool = runner.new_pool(block_tokens=8, num_blocks=40)
    runner.prefill(pool, ["a"], [[1, 2, 3]])

    def boom(ctx, stream):
        raise ExecutionError("boom")

    monkeypatch.setattr(runner._stepper.decode_context._backend_context, "execute_bound", boom)
    with pytest.raises(ExecutionError, match="the decoder engine's run failed: execution failed: boom"):
        runner.decode(pool, ["a"], [4])
    assert pool.length("a") == 3
