"""The model zoo: Kiln fp16 against torch eager and torch.compile on the architectures users bring, same run.

    python -m bench.zoo [--models all|resnet50,vit_b_16,...] [--precompile 8] [--profile] [--out bench/results]

Each model is its library's own ``nn.Module`` (torchvision, transformers; the YOLO-style detector is defined here,
with NonMaxSuppression in its graph) built with seeded random weights, exported to ONNX (opset 17) once with a
dynamic batch; Kiln builds that file (FP16 with fp32 I/O, one profile from batch 1 to the model's throughput
batch), torch runs the module itself in fp16, so both compute with identical weights. Per model and batch (1 and
the throughput batch): CUDA-event medians of Kiln (``execute_async_v3``, graph replay), torch eager and
torch.compile(mode="reduce-overhead", dynamic=False) on one created stream; accuracy of Kiln fp16 and of torch
fp16 against torch fp32 (TF32 off) as relative RMS error (the detector: the selected boxes compared as sets);
Kiln's cold and warm-timing-cache build seconds, device memory and host layers.

Random weights need care to say anything about accuracy: a zero-initialised classifier (ViT's head) gets a
normal(0.02) init; the CNNs' BatchNorm statistics are measured on seeded random images (``calibrate_batchnorm``:
else EfficientNet's and MobileNet's outputs underflow fp16); the detector's heads are scaled so that a few hundred
boxes pass its score threshold.

``--precompile N`` first compiles every (model, batch) in N child processes that share one inductor cache
(``TORCHINDUCTOR_CACHE_DIR``), so the measuring process compiles from cache: compiling is minutes of CPU per
shape and would otherwise take most of a device call. Prints a table and writes ``zoo_<time>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import build_kiln, cuda_time, profile_by_op, set_torch_precision  # noqa: E402

SEQ = 128
DEVICE = "cuda"  # "cpu" checks the exports without a GPU (tests)


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One zoo row's recipe: the module factory, its inputs at a batch, and the batch that measures throughput."""

    name: str
    make: Callable[[], Any]            # () -> nn.Module in eval mode on the GPU, fp32, seeded
    inputs: Callable[[int], tuple]     # batch -> input tensors on the GPU (fp32 where floating)
    names: tuple[str, ...]             # ONNX input names
    throughput_batch: int
    detector: bool = False             # output is NonMaxSuppression's [K, 3] selection (data-dependent rows)


def _images(size: int = 224) -> Callable[[int], tuple]:
    def inputs(batch: int) -> tuple:
        import torch

        g = torch.Generator(device=DEVICE).manual_seed(batch)
        return (torch.randn(batch, 3, size, size, device=DEVICE, generator=g),)
    return inputs


def _token_ids(vocab: int, extra: str = "") -> Callable[[int], tuple]:
    """Random ids [batch, SEQ]; ``extra`` "mask" adds an attention mask of ones (decoders: without one,
    transformers' packed-sequence check calls torch.diff, which the ONNX exporter lacks), "mask_types" also
    BERT's token types."""
    def inputs(batch: int) -> tuple:
        import torch

        g = torch.Generator(device=DEVICE).manual_seed(batch)
        ids = torch.randint(0, vocab, (batch, SEQ), device=DEVICE, generator=g)
        if extra == "mask_types":
            return ids, torch.ones_like(ids), torch.zeros_like(ids)
        return (ids, torch.ones_like(ids)) if extra == "mask" else (ids,)
    return inputs


def _torchvision(name: str) -> Callable[[], Any]:
    def make():
        import torch
        import torchvision

        torch.manual_seed(0)
        module = getattr(torchvision.models, name)(weights=None)
        for layer in module.modules():  # ViT's head starts at zero: all-zero logits would hide any error
            if isinstance(layer, torch.nn.Linear) and not layer.weight.any():
                torch.nn.init.normal_(layer.weight, std=0.02)
        return calibrate_batchnorm(module.to(DEVICE)).eval()
    return make


def calibrate_batchnorm(module, batches: int = 2, batch: int = 8):
    """BatchNorm running statistics measured on seeded random images (train-mode passes, cumulative average).
    Why: a fresh torchvision CNN's BNs are identities in eval mode, and without them EfficientNet-B0's and
    MobileNetV2's activations shrink layer by layer to ~1e-14: fp16 underflows to zeros on both sides, and
    an accuracy comparison against fp32 says nothing (relative error 1.0 for Kiln and torch alike)."""
    import torch

    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return module
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    module.train()
    g = torch.Generator(device=DEVICE).manual_seed(1234)
    with torch.no_grad():
        for _ in range(batches):
            module(torch.randn(batch, 3, 224, 224, device=DEVICE, generator=g))
    return module


def _transformers(model_class: str, config_class: str, encoder_only: bool = False,
                  model_kwargs: dict[str, Any] | None = None, **config: Any) -> Callable[[], Any]:
    """A transformers model from a config (seeded random weights, the library's own init). Attention is the
    library's default (sdpa) exported as the exporter writes it, except BERT-base: eager, as ``bench.engine``
    measures it, so its figures compare with earlier runs."""
    def make():
        import torch
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_class)(**config)
        module = getattr(transformers, model_class)(cfg, **(model_kwargs or {}))
        return (module.get_encoder() if encoder_only else module).eval().to(DEVICE)
    return make


def _whisper_features(batch: int) -> tuple:
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(batch)
    return (torch.randn(batch, 80, 3000, device=DEVICE, generator=g),)


# -- the YOLO-style detector ------------------------------------------------------------------------------


def _yolo_make():
    """A small YOLO-style detector (CSP-free conv backbone with SiLU, heads at strides 16 and 32, 3 anchors, 80
    classes), box decoding, and NonMaxSuppression in the graph: the export path detection models take."""
    import torch
    import torchvision  # here, not under the exporter's tracer: its import calls an op the tracer can't record
    from torch import nn

    class Select(torch.autograd.Function):
        """ONNX NonMaxSuppression's semantics in torch (per image and class), exported as the ONNX op itself."""

        @staticmethod
        def forward(ctx, boxes, scores):  # boxes [B, N, 4] x1y1x2y2, scores [B, C, N] -> [K, 3] (b, c, box)
            if torch.jit.is_tracing():  # exporting: the symbolic below stands for this; torchvision's ops can't be traced
                return torch.zeros((1, 3), dtype=torch.int64, device=boxes.device)
            rows = []
            for b in range(boxes.shape[0]):
                cls, idx = (scores[b] > YOLO_SCORE).nonzero(as_tuple=True)
                keep = torchvision.ops.batched_nms(boxes[b, idx], scores[b, cls, idx], cls, YOLO_IOU)
                cls, idx = cls[keep], idx[keep]
                for c in cls.unique().tolist():
                    chosen = idx[cls == c][:YOLO_MAX_PER_CLASS]
                    rows.append(torch.stack([torch.full_like(chosen, b), torch.full_like(chosen, c), chosen], 1))
            return torch.cat(rows) if rows else torch.zeros((0, 3), dtype=torch.int64, device=boxes.device)

        @staticmethod
        def symbolic(g, boxes, scores):
            def const(value, dtype):
                return g.op("Constant", value_t=torch.tensor([value], dtype=dtype))
            return g.op("NonMaxSuppression", boxes, scores, const(YOLO_MAX_PER_CLASS, torch.int64),
                        const(YOLO_IOU, torch.float32), const(YOLO_SCORE, torch.float32))

    def conv(cin: int, cout: int, stride: int = 1) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.SiLU())

    class Detector(nn.Module):
        anchors = ((30.0, 61.0), (62.0, 45.0), (59.0, 119.0))

        def __init__(self, classes: int = 80) -> None:
            super().__init__()
            self.classes = classes
            self.stem = nn.Sequential(conv(3, 16, 2), conv(16, 32, 2), conv(32, 32), conv(32, 64, 2), conv(64, 64))
            self.p4 = nn.Sequential(conv(64, 128, 2), conv(128, 128))
            self.p5 = nn.Sequential(conv(128, 256, 2), conv(256, 256))
            self.head4 = nn.Conv2d(128, 3 * (5 + classes), 1)
            self.head5 = nn.Conv2d(256, 3 * (5 + classes), 1)
            for m in self.modules():  # features keep their scale through the stack (torchvision's CNN init)
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            for head in (self.head4, self.head5):  # logits spread enough that some boxes pass the threshold
                nn.init.normal_(head.weight, std=HEAD_STD)
                nn.init.zeros_(head.bias)

        def decode(self, raw, stride: int):
            b, _, h, w = raw.shape
            p = raw.view(b, 3, 5 + self.classes, h, w).permute(0, 1, 3, 4, 2).sigmoid()  # [B, 3, H, W, 85]
            ys = torch.arange(h, device=raw.device, dtype=raw.dtype).view(1, 1, h, 1)
            xs = torch.arange(w, device=raw.device, dtype=raw.dtype).view(1, 1, 1, w)
            anchor = torch.tensor(self.anchors, device=raw.device, dtype=raw.dtype).view(1, 3, 1, 1, 2)
            cx = (p[..., 0] * 2 - 0.5 + xs) * stride
            cy = (p[..., 1] * 2 - 0.5 + ys) * stride
            wh = (p[..., 2:4] * 2) ** 2 * anchor
            boxes = torch.stack([cx - wh[..., 0] / 2, cy - wh[..., 1] / 2, cx + wh[..., 0] / 2, cy + wh[..., 1] / 2], -1)
            scores = p[..., 4:5] * p[..., 5:]
            return boxes.reshape(b, -1, 4), scores.reshape(b, -1, self.classes)

        def forward(self, x):
            f4 = self.p4(self.stem(x))
            f5 = self.p5(f4)
            b4, s4 = self.decode(self.head4(f4), 16)
            b5, s5 = self.decode(self.head5(f5), 32)
            boxes = torch.cat([b4, b5], 1)
            scores = torch.cat([s4, s5], 1).transpose(1, 2).contiguous()
            return Select.apply(boxes.float(), scores.float())

    torch.manual_seed(0)
    return Detector().eval().to(DEVICE)


YOLO_MAX_PER_CLASS, YOLO_IOU, YOLO_SCORE, HEAD_STD = 100, 0.45, 0.5, 0.15


ZOO: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("resnet50", _torchvision("resnet50"), _images(), ("input",), 128),
    ZooModel("efficientnet_b0", _torchvision("efficientnet_b0"), _images(), ("input",), 128),
    ZooModel("mobilenet_v2", _torchvision("mobilenet_v2"), _images(), ("input",), 128),
    ZooModel("densenet121", _torchvision("densenet121"), _images(), ("input",), 128),
    ZooModel("vit_b_16", _torchvision("vit_b_16"), _images(), ("input",), 64),
    ZooModel("bert_base", _transformers("BertModel", "BertConfig", model_kwargs={"add_pooling_layer": False},
                                        attn_implementation="eager"), _token_ids(30522, "mask_types"),
             ("input_ids", "attention_mask", "token_type_ids"), 64),
    ZooModel("gpt2", _transformers("GPT2Model", "GPT2Config", use_cache=False), _token_ids(50257, "mask"),
             ("input_ids", "attention_mask"), 32),
    ZooModel("t5_small_encoder", _transformers("T5EncoderModel", "T5Config", d_model=512, d_ff=2048, num_layers=6,
                                               num_heads=8, d_kv=64, use_cache=False),
             _token_ids(32128), ("input_ids",), 64),
    ZooModel("whisper_tiny_encoder", _transformers("WhisperModel", "WhisperConfig", encoder_only=True, d_model=384,
                                                   encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                                                   decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536,
                                                   num_mel_bins=80, max_source_positions=1500, use_cache=False),
             _whisper_features, ("input_features",), 16),
    ZooModel("llama_small", _transformers("LlamaModel", "LlamaConfig", vocab_size=32000, hidden_size=512,
                                          intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                                          num_key_value_heads=2, max_position_embeddings=1024, use_cache=False),
             _token_ids(32000, "mask"), ("input_ids", "attention_mask"), 32),
    ZooModel("yolo_nms", _yolo_make, _images(320), ("images",), 16, detector=True),
)}


# -- measuring --------------------------------------------------------------------------------------------


def export(model: ZooModel, workdir: Path) -> Path:
    """The fp32 module's ONNX file (dynamic batch; the detector's selected rows dynamic too)."""
    import torch

    from bench.engine import export_onnx

    module = model.make()
    wrapped = module if model.detector else keyword_output(module, model.names)
    # nn.MultiheadAttention's inference fast path is one aten op the exporter lacks; exported, it is the math
    torch.backends.mha.set_fastpath_enabled(False)
    path = export_onnx(wrapped, list(model.names), model.inputs(2), workdir / f"{model.name}.onnx",
                       output_axes={0: "selected"} if model.detector else None)
    torch.backends.mha.set_fastpath_enabled(True)
    del module, wrapped
    torch.cuda.empty_cache()
    return path


def precompile(models: list[ZooModel], workers: int) -> float:
    """Compile every (model, batch) with torch.compile in ``workers`` child processes sharing the inductor cache
    (set TORCHINDUCTOR_CACHE_DIR before calling); returns the seconds it took."""
    started = time.perf_counter()
    jobs = [f"{m.name}:{b}" for m in models for b in (1, m.throughput_batch)]
    env = os.environ | {"TORCHINDUCTOR_COMPILE_THREADS": "1"}  # N children, not N pools of a worker per core
    running: list[subprocess.Popen] = []
    for job in jobs:
        while len(running) >= workers:
            running = [p for p in running if p.poll() is None]
            time.sleep(0.2)
        running.append(subprocess.Popen([sys.executable, "-m", "bench.zoo", "--compile-only", job], cwd=ROOT, env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for p in running:
        p.wait()
    return time.perf_counter() - started


def compile_only(job: str) -> None:
    """A child of ``precompile``: compile one model at one batch and run it until its CUDA graph is recorded."""
    import torch

    name, batch = job.split(":")
    model = ZOO[name]
    set_torch_precision("fp16")
    peer = _peer(model)
    compiled = torch.compile(peer, mode="reduce-overhead", dynamic=False)
    inputs = _half(model.inputs(int(batch)))
    with torch.no_grad():
        for _ in range(3):
            compiled(*inputs)
    torch.cuda.synchronize()


def keyword_output(module, names: tuple[str, ...]):
    """``module`` returning one tensor (transformers return a ModelOutput); a transformers model gets its inputs by
    name (GPT-2's second positional parameter is the KV cache), others in order."""
    import torch

    class KeywordOutput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, *args):
            by_name = hasattr(self.inner, "config")  # a transformers PreTrainedModel
            out = self.inner(**dict(zip(names, args))) if by_name else self.inner(*args)
            return out if isinstance(out, torch.Tensor) else out[0]

    return KeywordOutput().eval()


def _peer(model: ZooModel):
    """The torch fp16 module the peers run."""
    module = model.make().half()
    return module if model.detector else keyword_output(module, model.names)


def _half(inputs: tuple) -> tuple:
    return tuple(t.half() if t.is_floating_point() else t for t in inputs)


def relative_error(y, ref) -> float:
    """||y - ref|| / ||ref|| in fp32 (RMS error relative to the reference's size)."""
    y, ref = y.float(), ref.float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def selection_agreement(y, ref) -> float:
    """Intersection over union of two NonMaxSuppression selections ([K, 3] rows as sets)."""
    a, b = {tuple(r) for r in y.tolist()}, {tuple(r) for r in ref.tolist()}
    return len(a & b) / max(1, len(a | b))


class TorchOutputs:
    """An output allocator (IOutputAllocator) over torch tensors: the detector's selection has data-dependent rows."""

    def __init__(self) -> None:
        self.buffers: dict[str, Any] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def reallocate_output_async(self, name: str, memory: int, size: int, alignment: int, stream: int) -> int:
        import torch

        have = self.buffers.get(name)
        if have is None or have.numel() < size:
            self.buffers[name] = have = torch.empty(max(size, 256), dtype=torch.uint8, device="cuda")
        return have.data_ptr()

    def reallocate_output(self, name: str, memory: int, size: int, alignment: int) -> int:
        return self.reallocate_output_async(name, memory, size, alignment, 0)

    def notify_shape(self, name: str, shape: tuple[int, ...]) -> None:
        self.shapes[name] = tuple(shape)

    def tensor(self, name: str):
        import torch

        rows = self.shapes[name]
        return self.buffers[name][: int(torch.tensor(rows).prod()) * 8].view(torch.int64).view(rows)


def kiln_run(engine, model: ZooModel, inputs: tuple):
    """(launcher, output getter, context) of the engine on torch tensors."""
    import engine_core as kiln
    from bench.engine import kiln_runner

    if not model.detector:
        run, y, ctx = kiln_runner(engine, list(model.names), inputs)
        return run, (lambda: y), ctx
    import torch

    class Allocator(TorchOutputs, kiln.IOutputAllocator):
        pass

    ctx = engine.create_execution_context()
    for n, t in zip(model.names, inputs):
        ctx.set_input_shape(n, tuple(t.shape))
        ctx.set_tensor_address(n, t.data_ptr())
    allocator = Allocator()
    ctx.set_output_allocator("output", allocator)

    def run() -> None:
        if not ctx.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("Kiln's execute_async_v3 failed (its log line above says why)")

    return run, (lambda: allocator.tensor("output")), ctx


def measure(model: ZooModel, onnx_path: Path, profile: bool, on_row: Callable[[dict], None]) -> None:
    """Kiln fp16 vs torch fp16 eager and compiled at batch 1 and the throughput batch; one row each."""
    import torch

    batches = [1, model.throughput_batch]
    engine, build_s, warm_s = build_kiln(onnx_path, list(model.names), "fp16", batches, model.inputs(1))
    cuda_info = engine.plan.build_info["cuda"]
    set_torch_precision("fp32")
    reference = model.make()
    if not model.detector:
        reference = keyword_output(reference, model.names)
    set_torch_precision("fp16")
    peer = _peer(model)
    stream = torch.cuda.Stream()
    for batch in batches:
        inputs = model.inputs(batch)
        with torch.cuda.stream(stream):
            run, output, ctx = kiln_run(engine, model, inputs)
        row: dict[str, Any] = {"model": model.name, "batch": batch, "build_s": round(build_s, 2),
                               "warm_cache_build_s": round(warm_s, 2),
                               "device_memory_size": engine.device_memory_size,
                               "host_layers": cuda_info["host_layers"]}
        row["kiln_ms"] = round(cuda_time(run, stream), 4)
        with torch.no_grad():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
            ref = reference(*inputs)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
            half_inputs = _half(inputs)
            fp16 = peer(*half_inputs)
            with torch.cuda.stream(stream):
                run()
            stream.synchronize()
            y = output()
            if model.detector:
                row["kiln_selection_iou"] = round(selection_agreement(y, ref), 4)
                row["torch_fp16_selection_iou"] = round(selection_agreement(fp16, ref), 4)
                row["selected_boxes"] = int(ref.shape[0])
            else:
                row["kiln_rel_err"] = relative_error(y, ref)
                row["torch_fp16_rel_err"] = relative_error(fp16, ref)
                row["err_vs_torch_fp16"] = round(row["kiln_rel_err"] / max(row["torch_fp16_rel_err"], 1e-12), 3)
            row["torch_eager_ms"] = round(cuda_time(lambda f=peer, x=half_inputs: f(*x), stream), 4)
            compiled = torch.compile(peer, mode="reduce-overhead", dynamic=False)
            try:
                started = time.perf_counter()
                compiled(*half_inputs)
                torch.cuda.synchronize()
                row["torch_compile_s"] = round(time.perf_counter() - started, 1)
                row["torch_compile_ms"] = round(cuda_time(lambda f=compiled, x=half_inputs: f(*x), stream), 4)
                row["speedup_vs_compile"] = round(row["torch_compile_ms"] / row["kiln_ms"], 3)
            except Exception as e:  # a compile failure is a result, not a crash
                row["torch_compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["speedup_vs_eager"] = round(row["torch_eager_ms"] / row["kiln_ms"], 3)
        row["kiln_items_per_s"] = round(batch / row["kiln_ms"] * 1000, 1)
        if profile and row.get("speedup_vs_compile", 0.0) < 1.2:
            row["ms_by_layer_type"] = profile_by_op(engine, ctx)
        on_row(row)
        print(json.dumps({k: v for k, v in row.items() if k != "ms_by_layer_type"}), flush=True)
        del ctx, run, output, compiled
        torch._dynamo.reset()
    torch.cuda.empty_cache()


def table(rows: list[dict]) -> str:
    """The zoo as a text table: one line per (model, batch)."""
    head = (f"{'model':<22}{'batch':>6}{'kiln ms':>10}{'eager ms':>10}{'compile ms':>11}{'x compile':>10}"
            f"{'err/torch':>10}{'build s':>9}{'warm s':>8}{'host':>6}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<22}  {r['error'][:100]}")
            continue
        err = r.get("err_vs_torch_fp16", r.get("kiln_selection_iou", float("nan")))
        lines.append(f"{r['model']:<22}{r['batch']:>6}{r['kiln_ms']:>10.3f}{r['torch_eager_ms']:>10.3f}"
                     f"{r.get('torch_compile_ms', float('nan')):>11.3f}{r.get('speedup_vs_compile', float('nan')):>10.2f}"
                     f"{err:>10.2f}{r['build_s']:>9.1f}{r['warm_cache_build_s']:>8.1f}{len(r['host_layers']):>6}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    """Kiln's speed-up over torch.compile per model, batch 1 and throughput batch side by side, as a PNG; False
    without matplotlib (the JSON and the table carry the same numbers)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows if "speedup_vs_compile" in r))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(models) + 1.2))
    for offset, label, pick in ((-0.2, "batch 1", lambda r: r["batch"] == 1),
                                (0.2, "throughput batch", lambda r: r["batch"] > 1)):
        values = [next((r["speedup_vs_compile"] for r in rows if r["model"] == m and pick(r)
                        and "speedup_vs_compile" in r), 0.0) for m in models]
        ax.barh([i + offset for i in range(len(models))], values, height=0.4, label=label)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(models)), models)
    ax.invert_yaxis()
    ax.set_xlabel("Kiln fp16 speed-up over torch.compile reduce-overhead (higher is better)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="all", help=f"comma-separated, or all: {','.join(ZOO)}")
    parser.add_argument("--precompile", type=int, default=0, metavar="N",
                        help="compile every torch peer first in N processes sharing the inductor cache")
    parser.add_argument("--profile", action="store_true", help="per-layer-type times of rows under 1.2x compile")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="start no model after this many seconds")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--compile-only", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_only:
        compile_only(args.compile_only)
        return 0
    import torch

    started = time.perf_counter()
    models = list(ZOO.values()) if args.models == "all" else [ZOO[n] for n in args.models.split(",")]
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "kiln_zoo_inductor"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"zoo_{time.strftime('%Y%m%dT%H%M%S')}.json"
    rows: list[dict] = []
    meta: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "python": platform.python_version(), "argv": sys.argv[1:]}

    def save(row: dict | None = None) -> None:  # after every row: a run cut short keeps what it measured
        if row is not None:
            rows.append(row)
        path.write_text(json.dumps(meta | {"rows": rows}, indent=1))

    if args.precompile:
        meta["precompile_s"] = round(precompile(models, args.precompile), 1)
        print(f"precompiled {len(models) * 2} peers in {meta['precompile_s']} s", flush=True)
    with tempfile.TemporaryDirectory() as work:
        for model in models:
            if args.deadline_s and time.perf_counter() - started > args.deadline_s:
                save({"model": model.name, "error": "skipped: --deadline-s reached"})
                continue
            try:
                measure(model, export(model, Path(work)), args.profile, save)
            except Exception as e:  # one model's failure is a row of the table, and the zoo goes on
                save({"model": model.name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
                print(f"{model.name}: {rows[-1]['error']}", flush=True)
    save()
    if plot(rows, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    print("\n" + table(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
