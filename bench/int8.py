"""Kiln INT8 vs Kiln fp16/fp32 on real models: throughput, accuracy and what actually ran INT8 (issue #7).

    python -m bench.int8 [--models resnet50,bert_base] [--variants fp16,int8_implicit,int8_explicit]
                         [--batches 1,32,128] [--images 1024] [--sequences 256] [--peer-batches 128,64]
                         [--device cuda|cpu] [--small] [--out bench/results]

Models: on the GPU the real torch modules of ``bench.engine.torch_model`` (torchvision ResNet-50,
transformers BERT-base, seeded weights), exported to ONNX once; with ``--small`` (or ``--device cpu``) the
``tools/make_models.py`` builders instead (no torch needed), so the whole harness runs on the CPU backend.

Kiln variants, one engine each (one optimization profile over the batches):
  fp32           the reference (TF32 off), what every other variant is compared with
  fp16           BuilderFlag.FP16 (+TF32), fp32 I/O: the speed baseline of issue #7
  int8_implicit  INT8 + FP16 (TensorRT's "int8 with fp16 fallback") + an IInt8EntropyCalibrator2 over seeded
                 calibration batches; the cache is written next to the JSON and reused by later runs
                 (``int8_implicit_minmax`` / ``int8_implicit_percentile``: those calibrators instead)
  int8_explicit  INT8 + FP16 on the ONNX made Q/DQ the way ``tools/make_models.py`` quantizes its
                 ``*_qdq`` models (its helpers: BN folded, per-channel int8 weights, per-tensor activations
                 with max |x| / 127 scales from onnxruntime over the same calibration batches)
                 (convolutions as the builder chooses: INT8 kiln.QConv on CUDA builds with cuDNN INT8)
  int8_explicit_residual  transformers: also both operands of every residual Add (make_models.residual_adds), so
                 the residual stream between layers is int8 too (the output projections and FFN2 write int8, the
                 SkipLayerNorms read and write int8 only)
  int8_explicit_floatgemm  the same with KILN_INT8_GEMM=0: Q/DQ MatMuls stay fake-quantized float GEMMs
  int8_explicit_cublaslt   the same with KILN_QGEMM=0: INT8 MatMuls as cuBLASLt IMMA + a dequantizing kernel,
                           not Kiln's sm_90 GEMM with the epilogue in registers
  int8_explicit_qconv / int8_explicit_floatconv  the same with KILN_INT8_CONV=1 / 0: convolutions forced into
                 INT8 (kiln.QConv) / kept as float convolutions of the dequantized weights (fake quantization)

Per (variant, batch): Kiln ms (GPU: CUDA-event median of ``execute_async_v3`` with graph replay, through
bench.engine's helpers; CPU: wall-clock median of ``context.infer``), items/s, ``speedup_vs_kiln_fp16``
(Kiln fp16 ms / this row's ms at that batch). Per variant: top-1 agreement with Kiln fp32 over ``--images``
seeded images (ResNet; also how many distinct classes fp32 predicts, so 100 % agreement on one class is
visible), max abs and relative L2 error, cosine similarity per image / token (BERT: of the hidden states),
and the plan's layers (INT8 GEMMs, conv tactics, host layers, unfused Q/DQ layers, all tactics counted) so a
run shows what ran in INT8. Peer (GPU, torch models only): torch fp16 ``torch.compile(mode="reduce-overhead")``
at ``--peer-batches``, measured after the Kiln rows of every model (its compiles take minutes).
Prints a table and writes JSON (device, versions, argv, rows) after every row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.engine import SEQ

ROOT = Path(__file__).resolve().parents[1]

#: int8_implicit calibrates with the entropy calibrator; the _minmax / _percentile forms with those instead
VARIANTS = ("fp32", "fp16", "int8_implicit", "int8_implicit_minmax", "int8_implicit_percentile", "int8_explicit",
            "int8_explicit_residual", "int8_explicit_qconv", "int8_explicit_floatconv", "int8_explicit_floatgemm", "int8_explicit_cublaslt")
#: variant suffix -> the environment variable it sets during its build
FORCED = {"_qconv": ("KILN_INT8_CONV", "1"), "_floatconv": ("KILN_INT8_CONV", "0"),
          "_floatgemm": ("KILN_INT8_GEMM", "0"), "_cublaslt": ("KILN_QGEMM", "0")}
#: issue #7's batch sizes; ``--small`` ones keep the CPU run to seconds
BATCHES = {"resnet50": [1, 32, 128], "bert_base": [1, 8, 64]}
SMALL_BATCHES = {"resnet50": [1, 4], "bert_base": [1, 4]}
SMALL_SEQ = 16
#: seeds: evaluation batch k uses EVAL_SEED + k (as bench.accuracy), calibration batch k CALIB_SEED + k
EVAL_SEED, CALIB_SEED = 1000, 5000


# -- models -----------------------------------------------------------------------------------------------


@dataclass
class ModelSpec:
    """A float ONNX file and how to feed it: seeded numpy batches shared by every variant and device."""

    name: str
    path: Path
    names: list[str]
    output: str
    feeds: Callable[[int, int], dict[str, np.ndarray]]  # (batch, seed) -> inputs
    classifier: bool  # top-1 agreement (ResNet) or hidden-state error (BERT)
    torch_peer: bool  # a torch module exists to compare with


def _image_feeds(size: int) -> Callable[[int, int], dict[str, np.ndarray]]:
    def feeds(batch: int, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {"input": rng.standard_normal((batch, 3, size, size), dtype=np.float32)}
    return feeds


def _token_feeds(vocab: int, seq: int) -> Callable[[int, int], dict[str, np.ndarray]]:
    """Random ids, full attention mask, token type 0 (what bench.engine feeds BERT)."""
    def feeds(batch: int, seed: int) -> dict[str, np.ndarray]:
        ids = np.random.default_rng(seed).integers(0, vocab, (batch, seq), dtype=np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return feeds


def torch_spec(name: str, workdir: Path) -> ModelSpec:
    """The real torch module of bench.engine exported to ONNX (then dropped: the peer builds its own)."""
    import torch

    from bench.engine import export_onnx, single_output, torch_model

    module, names, make_inputs = torch_model(name)
    path = export_onnx(single_output(module), names, make_inputs(2), workdir / f"{name}.onnx")
    del module
    torch.cuda.empty_cache()
    if name == "resnet50":
        return ModelSpec(name, path, names, "output", _image_feeds(224), True, True)
    from transformers import BertConfig

    return ModelSpec(name, path, names, "output", _token_feeds(BertConfig().vocab_size, SEQ), False, True)


def make_models_spec(name: str, workdir: Path, small: bool = True) -> ModelSpec:
    """tools/make_models.py's architecture (small variant by default): no torch needed."""
    import onnx

    from tools.make_models import MODELS

    path = workdir / f"{name}.onnx"
    onnx.save(MODELS[name][1 if small else 0](), str(path))
    if name == "resnet50":
        return ModelSpec(name, path, ["input"], "logits", _image_feeds(64 if small else 224), True, False)
    vocab, seq = (1000, SMALL_SEQ) if small else (30522, SEQ)
    return ModelSpec(name, path, ["input_ids", "attention_mask", "token_type_ids"], "last_hidden_state",
                     _token_feeds(vocab, seq), False, False)


# -- explicit quantization (tools/make_models.py's Q/DQ helpers on any float model) --------------------------


def qdq_targets(graph, classifier: bool, residual: bool = False) -> tuple[dict[int, list[tuple[int, int | None]]], int]:
    """Which inputs of which nodes to quantize, as make_models' ``resnet50_qdq`` / ``bert_qdq`` choose them:
    {node index: [(input index, weight axis, or None for an activation)]}, and how many candidates were skipped.

    CNNs (``classifier``): every Conv/Gemm input and weight plus the residual input of every Add; transformers:
    every MatMul with a constant 2-D weight (attention's activation x activation MatMuls stay float), and with
    ``residual`` both operands of every residual Add (``make_models.residual_adds``). A weight
    that is not an initializer, or that several nodes read, leaves its layer float (its int8 replacement would
    change the other readers)."""
    weights = {t.name: t for t in graph.initializer}
    readers = Counter(i for n in graph.node for i in n.input)
    targets: dict[int, list[tuple[int, int | None]]] = {}
    skipped = 0
    for k, node in enumerate(graph.node):
        if classifier and node.op_type in ("Conv", "Gemm"):
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            wanted = [(0, None), (1, 0 if node.op_type == "Conv" or trans_b else 1)]
        elif classifier and node.op_type == "Add" and node.input[1] not in weights:
            wanted = [(1, None)]
        elif not classifier and node.op_type == "MatMul" and node.input[1] in weights \
                and len(weights[node.input[1]].dims) == 2:
            wanted = [(0, None), (1, 1)]
        else:
            continue
        if any(axis is not None and (node.input[i] not in weights or readers[node.input[i]] > 1)
               for i, axis in wanted):
            skipped += 1
        else:
            targets[k] = wanted
    if residual and not classifier:
        from tools.make_models import residual_adds

        targets |= {k: [(0, None), (1, None)] for k in residual_adds(graph)}
    return targets, skipped


def quantize_explicitly(model, classifier: bool, feeds: list[dict[str, np.ndarray]],
                        residual: bool = False) -> tuple[object, dict[str, int]]:
    """``model`` (an onnx.ModelProto, changed in place) made Q/DQ the way make_models' ``resnet50_qdq`` /
    ``bert_qdq`` are (BN folded, ``qdq_targets``, make_models.insert_qdq with onnxruntime scales over
    ``feeds``); returns it and what was quantized."""
    import onnx

    from tools.make_models import _fold_batchnorm, insert_qdq

    _fold_batchnorm(model.graph)
    targets, skipped = qdq_targets(model.graph, classifier, residual)
    activations = {model.graph.node[k].input[i] for k, wanted in targets.items() for i, axis in wanted if axis is None}
    insert_qdq(model, targets, feeds)
    onnx.checker.check_model(model)
    return model, {"quantized_layers": len(targets), "quantized_activations": len(activations),
                   "skipped_shared_or_nonconstant_weight": skipped}


def explicit_model(spec: ModelSpec, calib: list[dict[str, np.ndarray]], workdir: Path,
                   residual: bool = False) -> tuple[Path, dict]:
    """The Q/DQ copy of ``spec``'s ONNX file (written to ``workdir``) and its quantization counts."""
    import onnx

    model, counts = quantize_explicitly(onnx.load(str(spec.path)), spec.classifier, calib, residual)
    path = workdir / f"{spec.name}_qdq{'_residual' if residual else ''}.onnx"
    onnx.save(model, str(path))
    return path, counts


# -- building ------------------------------------------------------------------------------------------------


def calibration_cache_path(out: Path, spec: ModelSpec, algorithm: str, calib_batches: int, calib_batch: int) -> Path:
    """Next to the JSON, keyed by the graph's structure (the tensor names a cache refers to) and the batches,
    so a later run of the same model reuses it and a changed export never reads a stale table."""
    import onnx

    graph = onnx.load(str(spec.path), load_external_data=False).graph
    key = hashlib.sha256()
    for node in graph.node:
        key.update(f"{node.op_type}|{','.join(node.input)}|{','.join(node.output)};".encode())
    for init in graph.initializer:
        key.update(f"{init.name}{list(init.dims)};".encode())
    key.update(f"{calib_batches}x{calib_batch}".encode())
    return out / f"int8_calib_{spec.name}_{algorithm}_{key.hexdigest()[:12]}.cache"


def build_engine(path: Path, spec: ModelSpec, variant: str, batches: list[int], backend: str,
                 calibrator=None, timing_cache=None):
    """(engine, build seconds) for one variant, one profile covering ``batches`` (opt: the middle one)."""
    import engine_core as kiln

    builder = kiln.Builder()
    network = builder.create_network()
    parser = kiln.OnnxParser(network)
    if not parser.parse_from_file(str(path)):
        raise RuntimeError(f"Kiln could not parse {path}: " + "; ".join(str(e) for e in parser.errors))
    config = builder.create_builder_config()
    config.backend = backend
    if variant == "fp32":  # the reference: TF32 off (a new config allows it), like bench.engine's fp32
        config.clear_flag(kiln.BuilderFlag.TF32)
    else:
        config.set_flag(kiln.BuilderFlag.FP16)
    if variant.startswith("int8"):
        config.set_flag(kiln.BuilderFlag.INT8)
    if calibrator is not None:
        config.int8_calibrator = calibrator
    if timing_cache is not None:
        config.set_timing_cache(timing_cache)
    sample = spec.feeds(1, 0)
    profile = builder.create_optimization_profile()
    lo, opt, hi = min(batches), batches[len(batches) // 2], max(batches)
    for name in spec.names:
        rest = sample[name].shape[1:]
        profile.set_shape(name, (lo, *rest), (opt, *rest), (hi, *rest))
    config.add_optimization_profile(profile)
    started = time.perf_counter()
    plan = kiln.build_plan(network, config)
    return kiln.Runtime().load(plan), time.perf_counter() - started


def layer_summary(engine) -> dict:
    """What the plan runs: INT8 GEMM layers (fused QMatMul; on the GPU tactic ``gemm:cublaslt_int8``), the
    tactic of every convolution, host fallbacks, Q/DQ layers left as pointwise steps, all tactics counted."""
    layers = engine.plan.layers
    tactics = Counter(str(layer["tactic"]) for layer in layers)
    types = Counter(layer["type"] for layer in layers)
    info = engine.plan.build_info
    return {
        "layers": len(layers),
        "int8_gemm_layers": types.get("QMatMul", 0),
        "int8_gemm_cublaslt": tactics.get("gemm:cublaslt_int8", 0),
        "conv_tactics": dict(Counter(str(layer["tactic"]) for layer in layers if "Conv" in layer["type"])),
        "qdq_layers": types.get("QuantizeLinear", 0) + types.get("DequantizeLinear", 0),
        "host_layers": tactics.get("host", 0),
        "int8": info.get("int8"),
        "passes": {k: v for k, v in info.get("passes", {}).items() if k in ("quantize_implicit", "fuse_qdq_matmul")},
        # whether the int8-output cuBLASLt GEMMs ran the requantizing convolutions, and if not, why
        "int8_requant": {k: info.get("cuda", {}).get(k) for k in ("int8_requant_unsupported", "int8_requant_fallback")},
        "tactics": dict(tactics.most_common()),
    }


# -- running: one binding = one context on fixed input buffers -------------------------------------------------


class CpuBinding:
    """The CPU backend: ``context.infer`` on host arrays; wall-clock times."""

    def __init__(self, engine, spec: ModelSpec, feeds: dict[str, np.ndarray]) -> None:
        self.context = engine.create_execution_context()
        self.output = spec.output
        self.feeds = feeds
        self.result: np.ndarray | None = None

    def load(self, feeds: dict[str, np.ndarray]) -> None:
        self.feeds = feeds

    def run(self) -> None:
        self.result = self.context.infer(self.feeds)[self.output]

    def fetch(self) -> np.ndarray:
        assert self.result is not None, "run() first"
        return np.asarray(self.result, dtype=np.float32)

    def time_ms(self, iters: int) -> float:
        self.run()  # warm-up
        times = []
        for _ in range(iters):
            started = time.perf_counter()
            self.run()
            times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times)


class CudaBinding:
    """bench.engine's ``kiln_runner`` on device copies of the inputs: new batches are copied into the same
    buffers, so one context (and its captured CUDA graph) serves every accuracy batch."""

    def __init__(self, engine, spec: ModelSpec, feeds: dict[str, np.ndarray]) -> None:
        import torch

        from bench.engine import kiln_runner

        self.stream = torch.cuda.Stream()
        self.names = spec.names
        self.inputs = tuple(torch.from_numpy(feeds[n]).cuda() for n in spec.names)
        with torch.cuda.stream(self.stream):
            self.launch, self.y, self.context = kiln_runner(engine, spec.names, self.inputs)
        outputs = [t for t in engine.plan.io if t.mode.name == "OUTPUT"]
        if outputs[0].name != spec.output:  # kiln_runner binds the first output to self.y
            raise ValueError(f"the engine's first output is '{outputs[0].name}', expected '{spec.output}'")
        self.extra = []  # outputs kiln_runner leaves unbound (make_models' BERT has two)
        for tensor in outputs[1:]:
            dtype = torch.float16 if np.dtype(tensor.dtype) == np.float16 else torch.float32
            buffer = torch.empty(self.context.get_tensor_shape(tensor.name), dtype=dtype, device="cuda")
            self.context.set_tensor_address(tensor.name, buffer.data_ptr())
            self.extra.append(buffer)
        torch.cuda.synchronize()  # the input copies ran on the default stream; ours does not wait for it

    def load(self, feeds: dict[str, np.ndarray]) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            for tensor, name in zip(self.inputs, self.names):
                tensor.copy_(torch.from_numpy(feeds[name]), non_blocking=False)

    def run(self) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            self.launch()

    def fetch(self) -> np.ndarray:
        self.stream.synchronize()
        return self.y.float().cpu().numpy()

    def time_ms(self, iters: int) -> float:
        from bench.engine import cuda_time

        return cuda_time(self.launch, self.stream, iters=iters)


def bind(device: str, engine, spec: ModelSpec, feeds: dict[str, np.ndarray]):
    return (CudaBinding if device == "cuda" else CpuBinding)(engine, spec, feeds)


def outputs_over(binding, batches: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """The engine's output for every evaluation batch, on the host."""
    result = []
    for feeds in batches:
        binding.load(feeds)
        binding.run()
        result.append(binding.fetch())
    return result


def accuracy(outputs: list[np.ndarray], reference: list[np.ndarray], classifier: bool) -> dict:
    """Errors vs the reference: max abs, relative L2, cosine similarity per output row (an image's logits, a
    token's hidden state); for a classifier also top-1 agreement and how many classes the reference predicts."""
    y = np.concatenate(outputs).astype(np.float64)
    ref = np.concatenate(reference).astype(np.float64)
    a, b = y.reshape(-1, y.shape[-1]), ref.reshape(-1, ref.shape[-1])
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    result = {"items": int(ref.shape[0]), "max_abs_err": float(np.abs(y - ref).max()),
              "ref_max_abs": float(np.abs(ref).max()),
              "rel_l2_err": float(np.linalg.norm(y - ref) / max(float(np.linalg.norm(ref)), 1e-30)),
              "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min())}
    if classifier:
        top1 = ref.argmax(-1)
        result |= {"top1_agreement": float(np.mean(y.argmax(-1) == top1)),
                   "distinct_top1_classes": int(np.unique(top1).size)}
    return result


# -- the benchmark -------------------------------------------------------------------------------------------


@dataclass
class Settings:
    device: str
    small: bool
    variants: list[str]
    batches: dict[str, list[int]]
    images: int
    sequences: int
    calib_batches: int
    calib_batch: int
    peer_batches: list[int]
    iters: int
    out: Path
    #: at the largest batch, per-layer-type times and the top GPU kernels (``--profile``)
    profile: bool = False


def build_variant(spec: ModelSpec, variant: str, s: Settings, calib: list[dict[str, np.ndarray]], workdir: Path,
                  timing_cache) -> tuple[object, float, dict]:
    """(engine, build seconds, what the row records about its quantization) for one variant."""
    path, extra, calibrator = spec.path, {}, None
    if variant.startswith("int8_implicit"):
        from engine_core.calibration import make_calibrator

        algorithm = variant.removeprefix("int8_implicit").lstrip("_") or "entropy"
        cache = calibration_cache_path(s.out, spec, algorithm, s.calib_batches, s.calib_batch)
        extra["calibration"] = {"algorithm": algorithm, "batches": s.calib_batches, "batch_size": s.calib_batch,
                                "cache": str(cache), "reused": cache.exists()}
        calibrator = make_calibrator(calib, algorithm, str(cache))
    elif variant.startswith("int8_explicit"):
        started = time.perf_counter()
        path, counts = explicit_model(spec, calib, workdir, residual=variant == "int8_explicit_residual")
        extra["qdq"] = counts | {"scales": "max|x|/127, onnxruntime over the calibration batches",
                                 "seconds": round(time.perf_counter() - started, 2)}
    forced = {name: value for suffix, (name, value) in FORCED.items() if variant.endswith(suffix)}
    previous = {name: os.environ.get(name) for name, _ in FORCED.values()}
    for name in previous:  # unforced: the builder's choice
        os.environ.pop(name, None)
    os.environ.update(forced)
    try:
        engine, build_s = build_engine(path, spec, variant, s.batches[spec.name], s.device, calibrator, timing_cache)
    finally:
        for name, value in previous.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    return engine, build_s, extra


def bench_model(spec: ModelSpec, s: Settings, workdir: Path,
                emit: Callable[[dict], None]) -> Callable[[], None] | None:
    """Every variant of one model: build, accuracy against fp32, one timed row per batch. Returns the torch
    peer's measurement (None without one), which main runs after every model's Kiln rows: its compiles take
    minutes, and a run cut short by a time limit should lose the context figures, not the INT8 ones."""
    import engine_core as kiln

    batches = s.batches[spec.name]
    eval_batch = max(batches)
    count = math.ceil((s.images if spec.classifier else s.sequences) / eval_batch)
    evaluation = [spec.feeds(eval_batch, EVAL_SEED + k) for k in range(count)]
    calib = [spec.feeds(s.calib_batch, CALIB_SEED + k) for k in range(s.calib_batches)]
    timing_cache = kiln.Builder().create_builder_config().create_timing_cache(b"") if s.device == "cuda" else None
    reference: list[np.ndarray] | None = None
    fp16_ms: dict[int, float] = {}
    for variant in ["fp32", *[v for v in s.variants if v != "fp32"]]:
        base = {"model": spec.name, "variant": variant}
        try:
            engine, build_s, extra = build_variant(spec, variant, s, calib, workdir, timing_cache)
            binding = bind(s.device, engine, spec, evaluation[0])
            outputs = outputs_over(binding, evaluation)
        except Exception as e:  # a variant that cannot be built or run is a result, not the end of the run
            emit(base | {"error": f"{type(e).__name__}: {str(e)[:400]}"})
            continue
        reference = outputs if variant == "fp32" else reference
        info = {"build_s": round(build_s, 2), "plan": layer_summary(engine), **extra,
                "accuracy": accuracy(outputs, reference, spec.classifier) if reference is not None else None}
        del outputs
        for batch in batches:
            feeds = {n: v[:batch] for n, v in evaluation[0].items()}
            try:
                timed = binding if batch == eval_batch else bind(s.device, engine, spec, feeds)
                timed.load(feeds)
                ms = timed.time_ms(s.iters)
            except Exception as e:  # one failing shape does not hide the others
                emit(base | {"batch": batch, "error": f"{type(e).__name__}: {str(e)[:400]}"} | info)
                continue
            fp16_ms |= {batch: ms} if variant == "fp16" else {}
            profiled = {}
            if s.profile and s.device == "cuda" and batch == eval_batch:
                from bench.engine import kernel_profile, profile_by_op

                profiled = {"ms_by_layer_type": profile_by_op(engine, timed.context),
                            "kernels": kernel_profile(timed.launch, timed.stream)}
            emit(base | {"batch": batch, "kiln_ms": round(ms, 4), "items_per_s": round(batch / ms * 1000, 1),
                         "speedup_vs_kiln_fp16": round(fp16_ms[batch] / ms, 3) if batch in fp16_ms else None}
                 | info | profiled)
        del binding, engine
    peer_batches = [b for b in batches if b in s.peer_batches]
    if s.device != "cuda" or not spec.torch_peer or not peer_batches:
        return None
    feeds = evaluation[0]

    def peer() -> None:
        for row in torch_peer_rows(spec, peer_batches, feeds, fp16_ms, s):
            emit(row)

    return peer


def torch_peer_rows(spec: ModelSpec, batches: list[int], feeds: dict[str, np.ndarray], fp16_ms: dict[int, float],
                    s: Settings) -> Iterator[dict]:
    """torch fp16 under torch.compile(mode="reduce-overhead"), one compile per shape (as bench.engine)."""
    import torch

    from bench.engine import cuda_time, set_torch_precision, single_output, torch_model

    set_torch_precision("fp16")
    module = single_output(torch_model(spec.name)[0].half())
    compiled = torch.compile(module, mode="reduce-overhead", dynamic=False)
    stream = torch.cuda.Stream()
    for batch in batches:
        row = {"model": spec.name, "variant": "torch_fp16_reduce-overhead", "batch": batch}
        inputs = tuple(torch.from_numpy(feeds[n][:batch]).cuda() for n in spec.names)
        inputs = tuple(t.half() if t.is_floating_point() else t for t in inputs)
        try:
            with torch.no_grad():
                started = time.perf_counter()
                compiled(*inputs)
                torch.cuda.synchronize()
                row["compile_s"] = round(time.perf_counter() - started, 1)
                ms = cuda_time(lambda f=compiled, x=inputs: f(*x), stream, iters=s.iters)
            row |= {"kiln_ms": None, "torch_ms": round(ms, 4), "items_per_s": round(batch / ms * 1000, 1),
                    "speedup_vs_kiln_fp16": round(fp16_ms[batch] / ms, 3) if batch in fp16_ms else None}
        except Exception as e:  # a compile failure is a result, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        yield row
    del compiled, module
    torch.cuda.empty_cache()


# -- output ----------------------------------------------------------------------------------------------------


def environment(device: str) -> dict:
    """Device name and library versions recorded with the figures."""
    import onnx

    import engine_core as kiln

    versions = {"python": platform.python_version(), "numpy": np.__version__, "onnx": onnx.__version__,
                "kiln": kiln.__version__}
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        versions["onnxruntime"] = None
    if device == "cuda":
        import torch

        versions["torch"] = torch.__version__
        return {"device": torch.cuda.get_device_name(), "versions": versions}
    return {"device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "versions": versions}


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':<10}{'variant':>27}{'batch':>6}{'ms':>10}{'items/s':>10}{'x fp16':>7}{'top1/cos':>10}"
          f"{'rel err':>9}{'int8 gemm':>10}{'qdq':>5}{'host':>5}  conv tactics")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<10}{r['variant']:>27}{r.get('batch', ''):>6}  error: {r['error'][:80]}")
            continue
        ms = r["kiln_ms"] if r.get("kiln_ms") is not None else r.get("torch_ms")
        speed = r.get("speedup_vs_kiln_fp16")
        quality = r.get("accuracy") or {}
        agree = quality.get("top1_agreement", quality.get("cosine_mean"))
        plan = r.get("plan") or {}
        print(f"{r['model']:<10}{r['variant']:>27}{r['batch']:>6}{ms:>10.3f}{r['items_per_s']:>10.1f}"
              f"{_fmt(speed, '.2f'):>7}{_fmt(agree, '.4f'):>10}{_fmt(quality.get('rel_l2_err'), '.2e'):>9}"
              f"{plan.get('int8_gemm_layers', ''):>10}{plan.get('qdq_layers', ''):>5}{plan.get('host_layers', ''):>5}"
              f"  {','.join(f'{k}:{v}' for k, v in (plan.get('conv_tactics') or {}).items())}")


def _missing_for(settings: Settings) -> str | None:
    """What this machine lacks for the asked-for run (None: nothing), checked before minutes of work."""
    import importlib.util

    import engine_core as kiln

    if settings.device == "cuda" and "cuda" not in kiln.available_backends():
        return "Kiln's CUDA backend, not available here (run with --device cpu --small)"
    torch_models = settings.device == "cuda" and not settings.small
    needed = ["torch", "torchvision", "transformers"] if torch_models else []
    needed += ["onnxruntime"] if any(v.startswith("int8_explicit") for v in settings.variants) else []
    absent = [m for m in needed if importlib.util.find_spec(m) is None]
    return f"the {', '.join(absent)} package(s)" if absent else None


def _default(value: int | None, default: int) -> int:
    return default if value is None else value


def parse_args(argv: list[str] | None) -> tuple[Settings, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet50,bert_base")
    parser.add_argument("--variants", default="fp16,int8_implicit,int8_explicit",
                        help="besides fp32, which always runs (the accuracy reference)")
    parser.add_argument("--batches", help="for every model (default: ResNet 1,32,128; BERT 1,8,64; --small 1,4)")
    parser.add_argument("--images", type=int, help="ResNet images for top-1 agreement (default 1024; --small 32)")
    parser.add_argument("--sequences", type=int, help="BERT sequences for the error figures (default 256; --small 8)")
    parser.add_argument("--calib-batches", type=int, default=4, help="seeded calibration batches")
    parser.add_argument("--calib-batch-size", type=int, help="samples per calibration batch (default 8; --small 2)")
    parser.add_argument("--peer-batches", default="128,64", help="batches measured with the torch.compile peer")
    parser.add_argument("--iters", type=int, help="timed runs per row (default 30 on cuda, 5 on cpu)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--small", action="store_true", help="tools/make_models.py small models (no torch)")
    parser.add_argument("--profile", action="store_true",
                        help="at the largest batch: per-layer-type times and the top GPU kernels (CUPTI)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    models = args.models.split(",")
    variants = args.variants.split(",") if args.variants else []
    for name in models:
        if name not in BATCHES:
            parser.error(f"unknown model '{name}' (choose from {', '.join(BATCHES)})")
    for variant in variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant '{variant}' (choose from {', '.join(VARIANTS)})")
    try:
        custom = sorted({int(b) for b in args.batches.split(",")}) if args.batches else None
        peers = [int(b) for b in args.peer_batches.split(",") if b]
    except ValueError:
        parser.error("--batches and --peer-batches take comma-separated integers")
    if custom is not None and min(custom) < 1:
        parser.error("batch sizes must be >= 1")
    table = SMALL_BATCHES if args.small else BATCHES
    settings = Settings(
        device=args.device, small=args.small, variants=variants,
        batches={name: custom or table[name] for name in models},
        images=_default(args.images, 32 if args.small else 1024),
        sequences=_default(args.sequences, 8 if args.small else 256), calib_batches=args.calib_batches,
        calib_batch=_default(args.calib_batch_size, 2 if args.small else 8), peer_batches=peers,
        iters=_default(args.iters, 30 if args.device == "cuda" else 5), out=Path(args.out), profile=args.profile)
    if min(settings.images, settings.sequences, settings.calib_batches, settings.calib_batch, settings.iters) < 1:
        parser.error("--images, --sequences, --calib-batches, --calib-batch-size and --iters must be >= 1")
    missing = _missing_for(settings)
    if missing:
        parser.error(f"--device {settings.device}{' --small' if settings.small else ''} needs {missing}")
    return settings, models


def main(argv: list[str] | None = None) -> int:
    settings, models = parse_args(argv)
    settings.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = settings.out / f"int8_{stamp}.json"
    for k in range(1, 100):  # two runs in one second (tests, scripted sweeps) keep both files
        if not path.exists():
            break
        path = settings.out / f"int8_{stamp}_{k}.json"
    header = environment(settings.device) | {"argv": sys.argv[1:] if argv is None else list(argv),
                                             "backend": settings.device, "small": settings.small}
    rows: list[dict] = []

    def emit(row: dict) -> None:  # after every row: a run cut short keeps what it measured
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("plan", "calibration", "qdq")}), flush=True)
        path.write_text(json.dumps(header | {"rows": rows}, indent=1))

    peers = []
    with tempfile.TemporaryDirectory() as work:
        for name in models:
            torch_models = settings.device == "cuda" and not settings.small
            spec = torch_spec(name, Path(work)) if torch_models else make_models_spec(name, Path(work), settings.small)
            peers.append(bench_model(spec, settings, Path(work), emit))
    for peer in filter(None, peers):
        peer()
    print_table(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
