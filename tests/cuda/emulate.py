"""A numpy emulation of lowered CUDA steps: runs the exact launches, strides, offsets and arena
placement the GPU would, on host bytes. Why: the index math, aliasing and memory reuse (the parts
most likely to go wrong) are then checked on every CI machine, not only on the device."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numpy.lib.stride_tricks import as_strided

from engine_core.backends.cuda import qgemm
from engine_core.backends.cuda.int8_gemm import Int8Gemm
from engine_core.backends.cuda.lower_rules.movement import CONCAT_MAX_RANK, CONCAT_ROW
from engine_core.backends.cuda.lowering import Conv, Copy, Gemm, Host, Launch, Lowered, Ref, transform_weight
from engine_core.backends.cuda.pointwise import C_TYPES, PointwiseKernel
from engine_core.interpret import run_node
from engine_core.ir import Graph, Node
from engine_core.ops.fused import activate
from tools.fit_gelu import gelu_fp32, gelu_sigmoid_fp32

_SUFFIX = {suffix: dtype for dtype, (_, suffix, _) in C_TYPES.items()}


class Emulator:
    def __init__(self, graph: Graph, lowered: Lowered, feeds: dict[str, np.ndarray],
                 unfused_convs: bool | str = False) -> None:
        """``unfused_convs``: True runs convolutions as when cuDNN has no engine for the fused graph (the bare
        convolution, then the conv's fallback kernels); "bias_only" as a binding whose capture did not
        reproduce (conv + bias in cuDNN, then the ``rest`` kernels)."""
        self.graph, self.lowered = graph, lowered
        self.unfused_convs = unfused_convs
        self.arena = np.zeros(max(lowered.memory.size, 1), np.uint8)
        self.buffers: dict[tuple[str, str], np.ndarray] = {}
        for name, value in graph.constants.items():
            self.buffers[("weight", name)] = _bytes(value)
        for name, (source, transform) in lowered.weight_transforms.items():
            self.buffers[("weight", name)] = _bytes(transform_weight(graph.constants[source], transform))
        for name, value in lowered.folded.items():
            self.buffers[("folded", name)] = _bytes(value)
        for name, value in feeds.items():
            self.buffers[("io", name)] = _bytes(value)
        for name in graph.output_names:
            info = lowered.infos[name]
            self.buffers[("io", name)] = np.zeros(int(np.prod(info.shape)) * info.dtype.itemsize, np.uint8)

    def bytes_at(self, ref: Ref) -> np.ndarray:
        kind, key = self.lowered.locations[ref.tensor]
        if kind == "arena":
            return self.arena[key + ref.offset:]
        return self.buffers[(kind, key)][ref.offset:]

    def view(self, ref: Ref, dtype: np.dtype, shape, strides) -> np.ndarray:
        raw = self.bytes_at(ref)
        base = raw.view(np.uint8)[: raw.size - raw.size % dtype.itemsize].view(dtype)
        return as_strided(base, shape=tuple(shape), strides=tuple(s * dtype.itemsize for s in strides))

    def run(self) -> dict[str, np.ndarray]:
        for step in self.lowered.steps:
            for op in step.ops:
                getattr(self, "_" + type(op).__name__.lower())(op)
        out = {}
        for name in self.graph.output_names:
            info = self.lowered.infos[name]
            out[name] = self.buffers[("io", name)].view(info.dtype).reshape(info.shape).copy()
        return out

    def _copy(self, op: Copy) -> None:
        self.bytes_at(op.dst)[: op.nbytes] = self.bytes_at(op.src)[: op.nbytes]

    def _host(self, op: Host) -> None:
        infos, args = self.lowered.infos, []
        for name in op.node.inputs:
            info = infos.get(name) if name else None
            if info is None:
                args.append(None)
            elif info.value is not None:
                args.append(info.value)
            else:
                args.append(self.view(Ref(name), info.dtype, info.shape, _contig(info.shape)).copy())
        for name, value in zip(op.node.outputs, run_node(op.node, args)):
            if name:
                info = infos[name]
                self.view(Ref(name), info.dtype, info.shape, _contig(info.shape))[...] = value

    def _gemm(self, op: Gemm) -> None:
        dt = op.dtype
        a = self.view(op.a, dt, (op.batch, op.m, op.k), (op.a_strides[2], *op.a_strides[:2])).astype(np.float64)
        b = self.view(op.b, dt, (op.batch, op.k, op.n), (op.b_strides[2], *op.b_strides[:2])).astype(np.float64)
        y = self.view(op.y, dt, (op.batch, op.m, op.n), (op.m * op.n, op.n, 1))
        result = op.alpha * (a @ b) + (op.beta * y.astype(np.float64) if op.beta else 0)
        if op.bias is not None:
            result = result + self.view(op.bias, dt, (op.n,), (1,)).astype(np.float64)
        if op.epilogue == "relu_bias":
            result = np.maximum(result, 0)
        elif op.epilogue == "gelu_bias":
            result = 0.5 * result * (1 + np.tanh(0.7978845608028654 * (result + 0.044715 * result ** 3)))
        y[...] = result

    def _int8gemm(self, op: Int8Gemm) -> None:
        """int8 x int8 -> exact int32 sums (float64 products of int8 values are exact)."""
        x = self.view(op.x, np.dtype(np.int8), (op.m, op.k), (op.k, 1)).astype(np.float64)
        w = self.view(op.w, np.dtype(np.int8), (op.n, op.k), (op.k, 1)).astype(np.float64)
        self.view(op.y, np.dtype(np.int32), (op.m, op.n), (op.n, 1))[...] = (x @ w.T).astype(np.int32)

    def _int8gemmrequant(self, op) -> None:
        """A model of cuBLASLt's int8-output IMMA: exact int32 sums, then in float32 alpha[n] * acc + beta * c +
        bias[n], ReLU, round to nearest even, saturate to int8 (the library's own float order may differ by an
        ulp: outputs by one quantization step)."""
        x = self.view(op.x, np.dtype(np.int8), (op.m, op.k), (op.k, 1)).astype(np.float64)
        w = self.view(op.w, np.dtype(np.int8), (op.n, op.k), (op.k, 1)).astype(np.float64)
        f32 = np.float32
        value = (x @ w.T).astype(np.int32).astype(f32) * self.view(op.alpha, np.dtype(f32), (op.n,), (1,))
        if op.c is not None:
            value = value + f32(op.beta) * self.view(op.c, np.dtype(np.int8), (op.m, op.n), (op.n, 1)).astype(f32)
        if op.bias is not None:
            value = value + self.view(op.bias, np.dtype(f32), (op.n,), (1,))
        if op.relu:
            value = np.maximum(value, f32(0))
        self.view(op.y, np.dtype(np.int8), (op.m, op.n), (op.n, 1))[...] = _saturate_int8(value)

    def _fp8gemm(self, op) -> None:
        """e4m3 x e4m3 -> float32: exact float64 sums rounded once (the CPU op's accumulator; cuBLASLt's float32
        sums differ by at most K * 2**-24 * sum|x_k * w_k|)."""
        fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
        x = self.view(op.x, fp8, (op.m, op.k), (op.k, 1)).astype(np.float64)
        w = self.view(op.w, fp8, (op.n, op.k), (op.k, 1)).astype(np.float64)
        self.view(op.y, np.dtype(np.float32), (op.m, op.n), (op.n, 1))[...] = (x @ w.T).astype(np.float32)

    def _conv(self, op: Conv) -> None:
        if self.unfused_convs == "bias_only" and op.rest:
            self._conv(op.bias_only())
            for launch in op.rest:
                self._launch(launch)
            return
        if self.unfused_convs and op.fallback:
            self._conv(op.bare())
            for launch in op.fallback:
                self._launch(launch)
            return
        if op.int8:
            self._int8_conv(op)
            return
        dt = op.dtype
        x = self.view(op.x, dt, op.x_dims, op.x_strides).astype(np.float32)
        w = self.view(op.w, dt, op.w_dims, op.w_strides).astype(np.float32)
        attrs = {"pads": [*op.pads_begin, *op.pads_end], "strides": list(op.strides),
                 "dilations": list(op.dilations), "group": op.x_dims[1] // op.w_dims[1]}
        y = run_node(Node("Conv", ["x", "w"], ["y"], attrs, "conv", "", 11, []), [x, w])[0]
        if op.b is not None:
            y = y + self.view(op.b, dt, (op.y_dims[1],), (1,)).astype(np.float32).reshape(1, -1, 1, 1)
        if op.z is not None:
            y = y + self.view(op.z, dt, op.y_dims, op.z_strides).astype(np.float32)
        if op.activation == "Relu":
            y = np.maximum(y, 0)
        self.view(op.y, dt, op.y_dims, op.y_strides)[...] = y

    def _int8_conv(self, op: Conv) -> None:
        """A model of cuDNN's INT8 graph: exact int32 sums, then in float32 ``* scale[k] + b[k] + z * z_scale[k]``,
        ReLU, and int8 outputs rounded to nearest even and saturated (cuDNN's float order may differ by an ulp:
        outputs by one quantization step)."""
        f32, channel = np.dtype(np.float32), (1, -1, 1, 1)
        x = self.view(op.x, op.dtype, op.x_dims, op.x_strides).astype(np.float64)
        w = self.view(op.w, op.dtype, op.w_dims, op.w_strides).astype(np.float64)
        attrs = {"pads": [*op.pads_begin, *op.pads_end], "strides": list(op.strides), "dilations": list(op.dilations)}
        acc = run_node(Node("Conv", ["x", "w"], ["y"], attrs, "conv", "", 11, []), [x, w])[0]
        k = op.y_dims[1]
        y = np.rint(acc).astype(np.int32).astype(f32) * self.view(op.scale, f32, (k,), (1,)).reshape(channel)
        if op.b is not None:
            y = y + self.view(op.b, f32, (k,), (1,)).reshape(channel)
        if op.z is not None:
            z = self.view(op.z, np.dtype(op.z_dtype), op.y_dims, op.z_strides).astype(f32)
            y = y + z * self.view(op.z_scale, f32, (k,), (1,)).reshape(channel)
        if op.activation == "Relu":
            y = np.maximum(y, np.float32(0))
        if np.dtype(op.y_dtype) == np.int8:
            y = _saturate_int8(y)
        self.view(op.y, np.dtype(op.y_dtype), op.y_dims, op.y_strides)[...] = y

    def _sdpalaunch(self, op: Launch) -> None:
        """cuDNN's SDPA, or where it declines the flash launch: the same attention, emulated as the launch
        (test_cudnn_attention_cpu.py checks the cuDNN description itself)."""
        self._launch(op)

    def _launch(self, op: Launch) -> None:
        name = op.function
        args = [v for v, _ in op.args]
        if op.program is not None:
            self._program(op.program, args)
        elif name.startswith("gather_w"):
            y, x, idx, outer, nidx, axis_len, inner = args
            word = int(name.split("_")[1][1:])
            idx_dtype = np.dtype(np.int64 if name.endswith("i64") else np.int32)
            ind = self.view(idx, idx_dtype, (nidx,), (1,)).astype(np.int64)
            ind = np.where(ind < 0, ind + axis_len, ind)
            src = self.view(x, np.dtype(np.uint8), (outer, axis_len, inner * word), (axis_len * inner * word, inner * word, 1))
            dst = self.view(y, np.dtype(np.uint8), (outer, nidx, inner * word), (nidx * inner * word, inner * word, 1))
            dst[...] = src[:, ind, :]
        elif name == "concat_copy":
            self._concat(args)
        elif name.startswith(("max_pool_", "avg_pool_")):
            self._pool(name, args)
        elif name.startswith("depthwise_conv_"):
            self._depthwise(name, args)
        elif name.startswith("flash_attention_"):
            self._flash_attention(name, args, op.grid)
        elif name.startswith("qgemm_sm90_"):
            self._qgemm(name, args)
        else:
            self._row_kernel(name, args, op.grid[0])

    def _qgemm(self, name: str, args: list) -> None:
        """cuda_kernels/qgemm_sm90.cu: exact int32 sums, then its float32 epilogue step by step."""
        y0, y1, y2, split, x_map, w_map, w_scale, bias, m, n, k, x_scale, y_scale = args
        code = name.rsplit("_", 2)[1]  # <act><round>: the epilogue compiled into the kernel
        act, round_to = int(code[0]), int(code[1])
        assert (x_map.rows, x_map.cols, w_map.rows, w_map.cols) == (m, k, n, k), "TMA descriptors of x [M, K], w [N, K]"
        acc = self.view(x_map.ref, np.dtype(np.int8), (m, k), (k, 1)).astype(np.int64) \
            @ self.view(w_map.ref, np.dtype(np.int8), (n, k), (k, 1)).astype(np.int64).T
        f32 = np.float32
        acc, w_scale = acc.astype(np.int32).astype(f32), self.view(w_scale, np.dtype(f32), (n,), (1,))
        bias = self.view(bias, np.dtype(f32), (n,), (1,))  # zeros folded for a layer without bias
        if act == qgemm.GELU_Q:  # the int8-output kernels' GELU (kiln_gelu_q), folded (KilnQgFold): fma(acc,
            # x_scale * w_scale, bias), whose product a double holds exactly
            v = (acc.astype(np.float64) * (f32(x_scale) * w_scale).astype(np.float64) + bias).astype(f32)
            v = gelu_sigmoid_fp32(v, np.array(qgemm.GELU_SIGMOID, f32), qgemm.GELU_SIGMOID_T_MAX)
        else:
            v = acc * f32(x_scale) * w_scale + bias
            if act == qgemm.ACTIVATIONS["Gelu"]:  # the kernel's polynomial GELU (kiln_gelu), not the CPU op's erf
                v = gelu_fp32(v, np.array(qgemm.GELU_LOG2_PHI, f32), qgemm.GELU_LIMIT)
            else:
                activation = next(name for name, code in qgemm.ACTIVATIONS.items() if code == act)
                v = activate(Node("QMatMul", [], [], {"activation": activation}, "qgemm", "kiln", 1, []), v).astype(f32)
        out = _SUFFIX[name.rsplit("_", 1)[1]]
        if out == np.int8:
            rounded = {0: f32, 1: np.float16, 2: ml_dtypes.bfloat16}[round_to]
            v = v.astype(rounded).astype(f32)
            v = _saturate_int8(v * (f32(1) / f32(y_scale)) if act == qgemm.GELU_Q else v / f32(y_scale))
        if split == 0:
            self.view(y0, out, (m, n), (n, 1))[...] = v.astype(out)
            return
        for part, y in enumerate((y0, y1, y2)[:n // split]):  # kiln_qg_out: the Split of the columns
            self.view(y, out, (m, split), (split, 1))[...] = v[:, part * split:(part + 1) * split].astype(out)

    def _concat(self, args: list) -> None:
        """cuda_kernels/concat.cu: each table row's input, in its units, through its strides into the output (the
        arena is aligned: the vector units as the table says)."""
        y, table, count, _, *sources = args
        rows = self.view(table, np.dtype(np.int64), (count, CONCAT_ROW), (CONCAT_ROW, 1))
        for row, src in zip(rows, sources):
            rank, unit, r = int(row[4]), int(row[5]), CONCAT_MAX_RANK
            shape, dst, strides = (tuple(int(v) for v in row[6 + r * k + r - rank:6 + r * k + r]) for k in range(3))
            out = self.view(Ref(y.tensor, y.offset + int(row[3]) * unit), np.dtype(np.uint8), (*shape, unit),
                            (*(s * unit for s in dst), 1))
            out[...] = self.view(src, np.dtype(np.uint8), (*shape, unit), (*(s * unit for s in strides), 1))

    def _pool(self, name: str, args: list) -> None:
        x, y, g = args
        dt = _SUFFIX[name.rsplit("_", 1)[1]]
        xv = self.view(x, dt, (g.n, g.c, g.h, g.w), list(g.xs)).astype(np.float32)
        kind = "MaxPool" if name.startswith("max") else "AveragePool"
        attrs = {"kernel_shape": [g.kh, g.kw], "strides": [g.sh, g.sw], "pads": [g.ph, g.pw, g.ph_end, g.pw_end],
                 "count_include_pad": g.count_include_pad}
        if kind == "MaxPool":
            attrs["dilations"] = [g.dh, g.dw]
        out = run_node(Node(kind, ["x"], ["y"], attrs, "pool", "", 19, []), [xv])[0]
        self.view(y, dt, (g.n, g.c, g.oh, g.ow), list(g.ys))[...] = out[:, :, : g.oh, : g.ow]

    def _depthwise(self, name: str, args: list) -> None:
        """cuda_kernels/depthwise_conv.cu: channels-last x, y and residual z, the "rskc" filters [kh, kw, C]; fp32
        sums, bias, residual and activation (KilnDwGeom.activation) before one rounding to the storage type."""
        x, w, bias, z, y, g = args
        dt = _SUFFIX[name.rsplit("_", 1)[1]]
        nhwc = lambda c, h, w: (h * w * c, 1, w * c, c)  # noqa: E731
        xv = self.view(x, dt, (g.n, g.c, g.h, g.w), nhwc(g.c, g.h, g.w)).astype(np.float32)
        taps = self.view(w, dt, (g.kh, g.kw, g.c), (g.kw * g.c, g.c, 1)).astype(np.float32)
        ends = [max(0, (o - 1) * s + (k - 1) * d + 1 - i - p) for o, s, k, d, i, p in
                ((g.oh, g.sh, g.kh, g.dh, g.h, g.ph), (g.ow, g.sw, g.kw, g.dw, g.w, g.pw))]
        attrs = {"pads": [g.ph, g.pw, *ends], "strides": [g.sh, g.sw], "dilations": [g.dh, g.dw], "group": g.c}
        out = run_node(Node("Conv", ["x", "w"], ["y"], attrs, "depthwise", "", 11, []),
                       [xv, np.transpose(taps, (2, 0, 1))[:, None]])[0][:, :, :g.oh, :g.ow]
        if bias:
            out = out + self.view(bias, dt, (g.c,), (1,)).astype(np.float32).reshape(1, -1, 1, 1)
        if z:
            out = out + self.view(z, dt, (g.n, g.c, g.oh, g.ow), nhwc(g.c, g.oh, g.ow)).astype(np.float32)
        out = {0: lambda v: v, 1: lambda v: np.maximum(v, 0), 2: lambda v: np.clip(v, g.alpha, g.beta),
               3: lambda v: np.where(v < 0, v * np.float32(g.alpha), v),
               4: lambda v: 1 / (1 + np.exp(-v))}[g.activation](out)
        self.view(y, dt, (g.n, g.c, g.oh, g.ow), nhwc(g.c, g.oh, g.ow))[...] = out

    def _flash_attention(self, name: str, args: list, grid) -> None:
        """softmax(scale Q K^T + mask) V per (batch, head) through the launch's strides; TF32 operands as fp32.
        flash_attention_q_*: Y rounded to the storage type, then quantized to int8 by the scale argument."""
        q, k, v, y, mask, g, *y_scale = args
        _, dim, suffix = name.rsplit("_", 2)
        dt, d = (np.dtype(np.float32) if suffix == "tf32" else _SUFFIX[suffix]), int(dim)
        batch, heads, sq, skv = grid[2], g.heads, g.sq, g.skv
        kvh = heads // g.kv_group
        qv = self.view(q, dt, (batch, heads, sq, d), (g.qb, g.qh, g.qs, 1)).astype(np.float64)
        kv = self.view(k, dt, (batch, kvh, skv, d), (g.kb, g.kh, g.ks, 1)).astype(np.float64)
        vv = self.view(v, dt, (batch, kvh, skv, d), (g.vb, g.vh, g.vs, 1)).astype(np.float64)
        kv, vv = np.repeat(kv, g.kv_group, axis=1), np.repeat(vv, g.kv_group, axis=1)
        s = np.einsum("bhqd,bhkd->bhqk", qv, kv) * g.scale
        if g.mask_kind:
            mdt = np.dtype(np.bool_) if g.mask_kind == 2 else dt
            m = self.view(mask, mdt, (batch, heads, sq, skv), (g.mb, g.mh, g.mq, g.mk))
            s = np.where(m, s, -np.inf) if g.mask_kind == 2 else s + m.astype(np.float64)
        if g.causal:
            s = np.where(np.arange(skv)[None, :] > np.arange(sq)[:, None] + g.causal_offset, -np.inf, s)
        top = s.max(-1, keepdims=True)
        e = np.exp(s - np.where(np.isneginf(top), 0, top))
        total = e.sum(-1, keepdims=True)
        p = e / np.where(total > 0, total, 1)
        out = np.einsum("bhqk,bhkd->bhqd", p, vv)
        if y_scale:
            scale = self.view(y_scale[0], np.dtype(np.float32), (1,), (1,))[0]
            out, dt = _saturate_int8(out.astype(dt).astype(np.float32) / scale), np.dtype(np.int8)
        self.view(y, dt, (batch, heads, sq, d), (g.ob, g.oh, g.os, 1))[...] = out

    def _row_kernel(self, name: str, args: list, rows: int) -> None:
        kind, suffix = name.rsplit("_", 1)
        dt = _SUFFIX[suffix]
        if kind.endswith("_warp"):  # one warp per row: the row count is the last argument
            kind, rows, args = kind[: -len("_warp")], args[-1], args[:-1]
        if kind in ("softmax", "attn_softmax", "attn_softmax_add", "attn_softmax_bool"):
            x, y, cols = args[:3]
            v = self.view(x, dt, (rows, cols), (cols, 1)).astype(np.float64)
            if kind != "softmax":
                scale, g = args[3], args[-1]
                v = v * scale
                r = np.arange(rows)
                q, bh = r % g.queries, r // g.queries
                b, h = bh // g.heads, bh % g.heads
                k = np.arange(cols)
                if kind != "attn_softmax":
                    mdt = np.dtype(np.bool_) if kind.endswith("bool") else dt
                    base = (b * g.mb + h * g.mh + q * g.mq)[:, None] + k[None, :] * g.mk
                    flat = self.view(args[4], mdt, (int(base.max()) + 1,), (1,))
                    m = flat[base]
                    v = np.where(m, v, -np.inf) if mdt == np.bool_ else v + m.astype(np.float64)
                if g.causal:
                    v = np.where(k[None, :] > q[:, None] + g.causal_offset, -np.inf, v)
            top = v.max(-1, keepdims=True)
            e = np.exp(v - np.where(np.isneginf(top), 0, top))
            total = e.sum(-1, keepdims=True)
            self.view(y, dt, (rows, cols), (cols, 1))[...] = e / np.where(total > 0, total, 1)
        elif kind in ("layer_norm", "rms_norm", "skip_layer_norm", "skip_layer_norm_q", "skip_layer_norm_dq"):
            quantized, operand_scales = None, (None, None)
            if kind == "skip_layer_norm_dq":  # (int8 x, int8 skip, their scales, gamma, beta, y, int8 y, its scale, ...)
                operand_scales, args = args[2:4], [*args[:2], *args[4:]]
                kind = "skip_layer_norm_q"
            if kind == "skip_layer_norm_q":  # (x, skip, gamma, beta, y, int8 y, its scale, cols, eps)
                quantized, args, kind = args[5:7], [*args[:5], *args[7:]], "skip_layer_norm"
            if kind == "skip_layer_norm":  # the sum rounded to the storage type, as the kernel keeps it
                x, skip, gamma, beta, y, cols, eps = args

                def operand(ref: Ref, scale: Ref | None) -> np.ndarray:  # an int8 one as DequantizeLinear stores it
                    if scale is None:
                        return self.view(ref, dt, (rows, cols), (cols, 1)).astype(np.float32)
                    value = self.view(ref, np.dtype(np.int8), (rows, cols), (cols, 1)).astype(np.float32)
                    scale_value = self.view(scale, np.dtype(np.float32), (1,), (1,))[0]
                    return (value * scale_value).astype(dt).astype(np.float32)

                v = (operand(x, operand_scales[0]) + operand(skip, operand_scales[1])).astype(dt).astype(np.float64)
            else:
                x, gamma, beta, y, cols, eps = args
                v = self.view(x, dt, (rows, cols), (cols, 1)).astype(np.float64)
            if kind != "rms_norm":
                norm = (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + eps)
            else:
                norm = v / np.sqrt((v * v).mean(-1, keepdims=True) + eps)
            norm = norm * self.view(gamma, dt, (cols,), (1,)).astype(np.float64)
            if isinstance(beta, Ref):
                norm = norm + self.view(beta, dt, (cols,), (1,)).astype(np.float64)
            if isinstance(y, Ref):  # a SkipLayerNorm's float output may be absent (null)
                self.view(y, dt, (rows, cols), (cols, 1))[...] = norm
            if quantized is not None and isinstance(quantized[0], Ref):  # QuantizeLinear of y as stored
                yq, q_scale = quantized
                stored = norm.astype(dt).astype(np.float32)
                scale = self.view(q_scale, np.dtype(np.float32), (1,), (1,))[0]
                self.view(yq, np.dtype(np.int8), (rows, cols), (cols, 1))[...] = _saturate_int8(stored / scale)
        elif kind in ("reduce_rows", "reduce_max_rows", "reduce_min_rows"):
            x, y, cols, scale = args
            v = self.view(x, dt, (rows, cols), (cols, 1)).astype(np.float64)
            r = {"reduce_rows": lambda: v.sum(-1) * scale, "reduce_max_rows": lambda: v.max(-1),
                 "reduce_min_rows": lambda: v.min(-1)}[kind]()
            self.view(y, dt, (rows,), (1,))[...] = r
        else:
            raise NotImplementedError(name)

    def _program(self, kernel: PointwiseKernel, args: list) -> None:
        """Evaluate a generated pointwise kernel's program with the CPU backend's op implementations."""
        n_in = len(kernel.ins)
        y, xs, ix = args[0], args[1:1 + n_in], args[-1]
        rank = args[-2]
        shape = [ix.shape[d] for d in range(rank)]
        values = [self.view(ref, dt, shape, [ix.inp[i][d] for d in range(rank)]).copy()
                  for i, (ref, dt) in enumerate(zip(xs, kernel.ins))]
        with np.errstate(all="ignore"):
            for pw in kernel.nodes:
                ins = [values[a] if a >= 0 else None for a in pw.args]
                if pw.op in ("QuantizeLinear", "DequantizeLinear"):  # elementwise scales: the formula itself
                    values.append(_qdq(pw, ins))
                    continue
                node = Node(pw.op, [f"i{k}" if a >= 0 else "" for k, a in enumerate(pw.args)], ["o"],
                            {k: list(v) if isinstance(v, tuple) else v for k, v in pw.attrs}, pw.op, "", pw.opset, [])
                values.append(np.asarray(run_node(node, ins)[0]).astype(pw.dtype))
        out = self.view(y, kernel.out, shape, [ix.out[d] for d in range(rank)])
        out[...] = np.broadcast_to(values[-1], out.shape).astype(kernel.out)


def _qdq(pw, ins: list) -> np.ndarray:
    x, scale, zero = ins[0], ins[1].astype(np.float32), ins[2] if len(ins) > 2 and ins[2] is not None else 0
    if pw.op == "DequantizeLinear":
        return ((x.astype(np.float32) - np.asarray(zero, np.float32)) * scale).astype(pw.dtype)
    if pw.dtype == np.dtype(ml_dtypes.float8_e4m3fn):  # saturate=1: clamp to the largest finite E4M3, then round
        return np.clip(x.astype(np.float32) / scale + np.asarray(zero, np.float32), -448, 448).astype(pw.dtype)
    info = np.iinfo(pw.dtype)
    return np.clip(np.rint(x.astype(np.float32) / scale) + np.asarray(zero, np.float32), info.min, info.max).astype(pw.dtype)


def _saturate_int8(v: np.ndarray) -> np.ndarray:
    """Round half to even and saturate to int8's range, as the kernels' requantizing stores do (still float)."""
    return np.clip(np.rint(v), -128, 127)


def _bytes(value: np.ndarray) -> np.ndarray:
    return np.frombuffer(bytearray(np.ascontiguousarray(value).tobytes()), np.uint8)


def _contig(shape) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return list(reversed(strides))
