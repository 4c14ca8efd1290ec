"""Reduced precision (FP16/BF16) for weakly typed networks, as one graph pass.

The builder flags FP16/BF16 let float32 compute run in a 16-bit float type. The pass rewrites the
graph so that every layer that can runs in that type: float32 weights are converted, float32 data
tensors become the target type, internal ``Cast(to=FLOAT)`` casts to the target, and Casts
("reformat layers", visible in the plan and the inspector) are inserted at every boundary between
types: ``reformat_in:<input>`` after a graph input, ``reformat_out:<output>`` before a graph output,
``reformat:<tensor>:<dtype>`` inside the network.

Which inputs of a layer follow its compute type comes from the ONNX schema's type constraints: the
inputs that share the type variable of the layer's float output (its data tensors) are converted,
the others keep their type (Resize's ``roi``/``scales``, Pow's exponent, ...). A layer stays float32
when its schema does not allow the target type, when it is a shape computation (all its inputs are
known at build time), when it has a body (Loop/If/Scan), when its op has no schema (custom domains;
kiln-domain fused ops are the exception: all their float inputs are data), or when the user
constrained it (``layer.precision = FLOAT``). Softmax, normalizations and reductions keep 16-bit I/O:
their kernels accumulate in float32. Rotary angles (Sin/Cos of integer positions and the layers computing their
arguments, engine_core/passes/rotary_angles.py) stay float32 by default, as transformers keeps them; a constraint
on one of those layers still wins.

Q/DQ follow TensorRT, not the ONNX schema of their opset: a scale and a zero point are quantization
parameters, never data, so they keep the model's types (an fp32 scale stays exact); QuantizeLinear's data
input takes the compute type and DequantizeLinear's output does too (declared by its ``output_dtype``
attribute, which every opset's implementation here honours). So with FP16 a DequantizeLinear feeds its
fp16 MatMul directly: no reformat Cast sits between them and the Q/DQ -> INT8 GEMM fusion sees the
pattern. A DequantizeLinear of a constant (an int8 weight fold_constants kept for that fusion) is a data
layer, not a shape computation.

Precision constraints follow the reference: with OBEY_PRECISION_CONSTRAINTS a constraint that cannot
be honoured is a BuildError; with PREFER_PRECISION_CONSTRAINTS it is a warning and the layer gets
its default type; with neither flag, constraints are ignored with a warning. User I/O types
(``network.get_input(i).dtype = DataType.HALF``) make the binding itself 16-bit: no reformat layer.
STRONGLY_TYPED networks are never rewritten: their types are exactly the model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
import onnx.defs

from engine_core.errors import BuildError, KilnError
from engine_core.ir import Graph, Node, has_subgraph, subgraph_reads
from engine_core.logger import Logger, Severity
from engine_core.ops import TensorInfo, get_op
from engine_core.passes.rotary_angles import rotary_angle_layers
from engine_core.types import (
    BuilderFlag,
    NetworkDefinitionCreationFlag,
    TensorFormat,
    dtype_name,
    np_to_onnx,
)

if TYPE_CHECKING:
    from engine_core.builder_config import BuilderConfig
    from engine_core.network import NetworkDefinition

FLOAT32 = np.dtype(np.float32)
#: The float types a layer may compute in, by name (numpy dtype names; bfloat16 via ml_dtypes).
FLOAT_TYPES = ("float32", "float16", "bfloat16")
#: Domain of Kiln's fused ops (engine_core/ops/fused.py): every float input is a data input.
KILN_DOMAIN = "kiln"
#: Ops that read their input whatever its float type (its shape, or a conversion): no Cast before them.
_ANY_INPUT_OPS = frozenset({"Cast", "Shape", "Size"})
_QUANTIZE, _DEQUANTIZE = "QuantizeLinear", "DequantizeLinear"

_IGNORED_WARNING = ("Detected layers with precision constraints but neither OBEY_PRECISION_CONSTRAINTS nor "
                    "PREFER_PRECISION_CONSTRAINTS builder flag is set: the constraints are ignored")


@dataclass
class PrecisionPolicy:
    """What the build asks of the pass (from BuilderConfig flags and the network)."""

    #: default compute type of float32 layers: float16 (FP16 flag), bfloat16 (BF16 flag) or None
    target: np.dtype | None = None
    #: float types the flags enable (float32 always): the types a constraint may name
    allowed: frozenset[str] = frozenset({"float32"})
    #: "obey", "prefer" or "ignore" (neither flag: constraints are ignored)
    constraints: str = "ignore"
    #: graph I/O tensor -> dtype of the binding the user feeds/receives (absent: the model's)
    io_dtypes: dict[str, np.dtype] = field(default_factory=dict)
    #: input shapes (and shape-tensor values) of the profile the types are inferred at
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    input_values: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: DIRECT_IO: a reformat at a network boundary is a BuildError
    direct_io: bool = False
    logger: Logger | None = None
    #: filled by the pass: layer name -> the float type it computes in (for build_info / the inspector)
    layer_precisions: dict[str, str] = field(default_factory=dict)
    #: filled by the pass: the warnings it logged
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        if self.logger is not None:
            self.logger.log(Severity.WARNING, message)


# -- the policy ----------------------------------------------------------------------------------


def is_strongly_typed(config: BuilderConfig, network: NetworkDefinition) -> bool:
    """STRONGLY_TYPED as a network creation flag (the reference) or as a builder flag (Kiln's)."""
    return bool(network.flags & (1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED))) or config.get_flag(
        BuilderFlag.STRONGLY_TYPED)


def precision_policy(config: BuilderConfig, network: NetworkDefinition,
                     logger: Logger | None = None) -> PrecisionPolicy | None:
    """The policy for building ``network`` with ``config``; None when the pass has nothing to do.

    Raises BuildError for requests no build can meet (I/O formats without LINEAR, I/O types on a
    strongly typed network that differ from the model's).
    """
    io_dtypes = _io_dtypes(network)
    _check_io_formats(network)
    constrained = [n for n in network.graph.nodes if n.precision_is_set or n.output_type_constraints]
    if is_strongly_typed(config, network):
        return _strongly_typed(config, network, io_dtypes, constrained, logger)
    allowed = {"float32"}
    if config.get_flag(BuilderFlag.FP16):
        allowed.add("float16")
    if config.get_flag(BuilderFlag.BF16):
        allowed.add("bfloat16")
    target = np.dtype(np.float16) if "float16" in allowed else (
        np.dtype(ml_dtypes.bfloat16) if "bfloat16" in allowed else None)
    if config.get_flag(BuilderFlag.OBEY_PRECISION_CONSTRAINTS) or config.get_flag(BuilderFlag.STRICT_TYPES):
        mode = "obey"
    elif config.get_flag(BuilderFlag.PREFER_PRECISION_CONSTRAINTS):
        mode = "prefer"
    else:
        mode = "ignore"
    policy = PrecisionPolicy(target=target, allowed=frozenset(allowed), constraints=mode, io_dtypes=io_dtypes,
                             direct_io=config.get_flag(BuilderFlag.DIRECT_IO), logger=logger)
    if constrained and mode == "ignore":
        policy.warn(_IGNORED_WARNING)
    if target is None and not io_dtypes and (not constrained or mode == "ignore"):
        return None
    policy.input_shapes, policy.input_values = _profile_point(config, network)
    return policy


def _strongly_typed(config: BuilderConfig, network: NetworkDefinition, io_dtypes: dict[str, np.dtype],
                    constrained: list[Node], logger: Logger | None) -> None:
    """Strongly typed: nothing to rewrite; say which requests are ignored, refuse I/O type changes."""
    if io_dtypes:
        names = ", ".join(f"'{k}' -> {dtype_name(v)}" for k, v in io_dtypes.items())
        raise BuildError(f"strongly typed network: I/O types are the model's and cannot be changed ({names})")
    ignored = [f.name for f in (BuilderFlag.FP16, BuilderFlag.BF16) if config.get_flag(f)]
    if constrained:
        ignored.append(f"precision constraints of {len(constrained)} layer(s)")
    if ignored and logger is not None:
        logger.log(Severity.WARNING, f"strongly typed network: {', '.join(ignored)} ignored; "
                                     "tensor types are exactly the model's")
    return None


def _io_dtypes(network: NetworkDefinition) -> dict[str, np.dtype]:
    """The user's I/O binding types that differ from the model's (network.io_dtypes, if present)."""
    requested: Mapping[str, np.dtype] = getattr(network, "io_dtypes", {})
    values = {v.name: v for v in (*network.graph.inputs, *network.graph.outputs)}
    return {name: np.dtype(dtype) for name, dtype in requested.items()
            if name in values and np.dtype(dtype) != values[name].dtype}


def _check_io_formats(network: NetworkDefinition) -> None:
    """Kiln bindings are LINEAR: an allowed-formats mask without LINEAR cannot be built."""
    for name, mask in getattr(network, "io_formats", {}).items():
        if not mask & (1 << int(TensorFormat.LINEAR)):
            formats = [f.name for f in TensorFormat if mask & (1 << int(f))]
            raise BuildError(f"tensor '{name}': allowed formats {formats} do not include LINEAR, the only I/O "
                             "format Kiln plans have")


def _profile_point(config: BuilderConfig, network: NetworkDefinition) -> tuple[dict, dict]:
    """Input shapes/values of profile 0 at its opt point (types do not depend on the point)."""
    if not config.profiles:
        return {}, {}
    profile = config.profiles[0]
    shapes = {name: triple[1] for name, triple in profile.shapes.items()}
    values = {name: triple[1] for name, triple in profile.shape_values.items()}
    for name, vals in values.items():
        shapes.setdefault(name, (len(vals),))
    return shapes, values


# -- the pass ------------------------------------------------------------------------------------


def reduce_precision(graph: Graph, policy: PrecisionPolicy | None) -> int:
    """Rewrite ``graph`` in place for ``policy``; returns the number of changes (layers retyped,
    weights converted, reformat layers inserted). ``policy=None`` changes nothing."""
    if policy is None:
        return 0
    return _Rewriter(graph, policy).run()


@dataclass
class _Schema:
    """What the ONNX schema says about one node: type variable per input/output and allowed types."""

    inputs: list[str]
    outputs: list[str]
    allowed: dict[str, set[str]]


class _Rewriter:
    """One pass over the nodes in order, tracking each tensor's new dtype, so that every Cast is
    placed where a reader needs another type than its producer gives (and shared by such readers)."""

    def __init__(self, graph: Graph, policy: PrecisionPolicy) -> None:
        self.graph = graph
        self.policy = policy
        self.original = _original_infos(graph, policy)
        self.dtype: dict[str, np.dtype] = {}
        self.casts: dict[tuple[str, str], str] = {}
        self.converted: dict[str, set[str]] = {}  # constant -> converted copies
        self.nodes: list[Node] = []
        self.changes = 0
        self.opset = graph.opsets.get("", 21)
        self.angle_layers = rotary_angle_layers(graph, self._known)

    # -- driver --------------------------------------------------------------------------------
    def run(self) -> int:
        graph = self.graph
        for name, value in graph.constants.items():
            self.dtype[name] = value.dtype
        for v in graph.inputs:
            if v.name in self.policy.io_dtypes:
                _check_io_change(v.name, v.dtype, self.policy.io_dtypes[v.name])
                v.dtype = self.policy.io_dtypes[v.name]
                self.changes += 1
            self.dtype[v.name] = v.dtype
        for node in graph.nodes:
            self._rewrite(node)
        graph.nodes = self.nodes
        self._reformat_outputs()
        self._settle_constants()
        return self.changes

    def _rewrite(self, node: Node) -> None:
        compute = self._compute_type(node)
        wanted = self._wanted_inputs(node, compute)
        for k, name in enumerate(node.inputs):
            if name and wanted[k] is not None and self.dtype[name] != wanted[k]:
                node.inputs[k] = self._cast(name, wanted[k])
        if has_subgraph(node):
            self._pin_body_reads(node)
        if _is_qdq(node, _DEQUANTIZE):
            self._declare_dequantize_output(node, compute)
        if node.op_type == "Cast" and not node.domain and compute is not None and compute != FLOAT32:
            if np.dtype(_cast_target(node)) == FLOAT32:
                node.attrs["to"] = np_to_onnx(compute)
        if compute is not None and compute != FLOAT32:
            self.changes += 1
        self.nodes.append(node)
        out_dtypes = self._output_dtypes(node)
        for name, dtype in zip(node.outputs, out_dtypes):
            if name:
                self.dtype[name] = dtype
        label = compute if compute is not None else (out_dtypes[0] if out_dtypes else FLOAT32)
        self.policy.layer_precisions[node.name] = dtype_name(label)
        self._apply_output_types(node)

    # -- decisions -----------------------------------------------------------------------------
    def _compute_type(self, node: Node) -> np.dtype | None:
        """The float type the node's data tensors get; None: leave its types as the model's."""
        natural, why_not = self._natural_type(node)
        constraint = node.precision_constraint if self.policy.constraints != "ignore" else None
        if constraint is None:
            return natural
        constraint = np.dtype(constraint)
        if constraint == FLOAT32:
            return FLOAT32 if self._schema(node) is not None or node.domain == KILN_DOMAIN else None
        reason = why_not or self._unsupported(node, constraint)
        if constraint.name not in self.policy.allowed:
            reason = f"{constraint.name} is not enabled by the builder flags (set BuilderFlag.FP16 / BF16)"
        if reason is None:
            return constraint
        self._refuse(f"layer {node}: precision constraint {constraint.name} cannot be honoured: {reason}")
        return natural

    def _natural_type(self, node: Node) -> tuple[np.dtype | None, str | None]:
        """The type the flags give the node, and why it must stay as it is (None: it need not)."""
        if has_subgraph(node):
            return None, "layers with bodies (Loop/If/Scan) keep the model's types"
        if self._is_shape_computation(node) and not _is_qdq(node, _DEQUANTIZE):
            return None, "it computes values known at build time (a shape computation)"
        if self._schema(node) is None and node.domain != KILN_DOMAIN:
            return None, f"op {node.domain or 'ai.onnx'}::{node.op_type} has no ONNX schema to type it"
        if node.name in self.angle_layers:
            return None, None  # float32 by default, not a reason to refuse a constraint (module docstring)
        target = self.policy.target
        if target is None or self._unsupported(node, target) is not None:
            return None, None
        return target, None

    def _unsupported(self, node: Node, dtype: np.dtype) -> str | None:
        """Why ``node`` cannot compute in ``dtype`` (None: it can)."""
        if node.domain == KILN_DOMAIN:
            return None
        if _is_qdq(node, _DEQUANTIZE):
            return self._dequantize_unsupported(node, dtype)
        schema = self._schema(node)
        if schema is None:
            return f"op {node.op_type} has no schema"
        var = self._data_var(node, schema)
        if var is None:
            return "it has no float32 data tensor"
        if f"tensor({dtype.name})" not in schema.allowed.get(var, set()):
            return f"op {node.op_type} does not support {dtype.name}"
        return None

    def _is_shape_computation(self, node: Node) -> bool:
        present = [i for i in node.inputs if i]
        op = get_op(node.op_type, node.domain)
        return bool(present) and op is not None and op.deterministic and all(self._known(i) for i in present)

    def _known(self, name: str) -> bool:
        """Whether the tensor's value is known at build time (a constant, or computed from shapes)."""
        info = self.original.get(name)
        return info is not None and info.value is not None

    def _data_var(self, node: Node, schema: _Schema) -> str | None:
        """The type variable of the node's data tensors: its first float32 output's, else its first
        float32 input's (ops such as ArgMax or Equal that read floats and write ints)."""
        for name, var in zip(node.outputs, schema.outputs):
            if name and self._orig_dtype(name) == FLOAT32 and not var.startswith("tensor("):
                return var
        for name, var in zip(node.inputs, schema.inputs):
            if name and self._orig_dtype(name) == FLOAT32 and not var.startswith("tensor("):
                return var
        return None

    def _wanted_inputs(self, node: Node, compute: np.dtype | None) -> list[np.dtype | None]:
        """Per input: the dtype it must have (None: whatever it has)."""
        if node.op_type in _ANY_INPUT_OPS and not node.domain:
            return [None] * len(node.inputs)
        original = [self._orig_dtype(i) if i else None for i in node.inputs]
        if compute is None or compute == FLOAT32:
            return original
        if node.domain == KILN_DOMAIN:
            return [compute if d == FLOAT32 else d for d in original]
        if _is_qdq(node, _QUANTIZE, _DEQUANTIZE):  # only QuantizeLinear's x is data; scales keep their type
            return [compute if k == 0 and d == FLOAT32 and node.op_type == _QUANTIZE else d
                    for k, d in enumerate(original)]
        schema = self._schema(node)
        assert schema is not None  # a compute type other than float32 implies a schema
        var = self._data_var(node, schema)
        return [compute if d == FLOAT32 and v == var else d for d, v in zip(original, schema.inputs)]

    def _output_dtypes(self, node: Node) -> list[np.dtype]:
        """The node's output types for its (rewritten) input types, from the op's own type rule."""
        original = [self._orig_dtype(o) if o else FLOAT32 for o in node.outputs]
        op = get_op(node.op_type, node.domain)
        if op is None or has_subgraph(node):
            return original
        args = []
        for name in node.inputs:
            if not name:
                args.append(None)
                continue
            info = self.original.get(name) or self.original.get(self._source(name))
            dtype = self.dtype[name]
            value = info.value if info is not None else None
            if value is not None and value.dtype != dtype:
                value = saturated(value, dtype)[0]
            args.append(TensorInfo(dtype, info.shape if info is not None else None, value))
        try:
            result = op.infer(node, *args)
        except Exception:
            return original
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        return [r.dtype for r in results] + original[len(results):]

    def _dequantize_unsupported(self, node: Node, dtype: np.dtype) -> str | None:
        """Why a DequantizeLinear cannot write ``dtype`` (None: it can): any float type, for a float output."""
        out = self._orig_dtype(node.outputs[0]) if node.outputs and node.outputs[0] else None
        if out is None or out.name not in FLOAT_TYPES:
            return f"it dequantizes to {dtype_name(out) if out is not None else 'an unknown type'}, not a float type"
        return None if dtype.name in FLOAT_TYPES else f"DequantizeLinear does not write {dtype.name}"

    # -- edits ---------------------------------------------------------------------------------
    def _declare_dequantize_output(self, node: Node, compute: np.dtype | None) -> None:
        """A DequantizeLinear computing in another float type than its model output declares that type as
        its ``output_dtype`` (its scale keeps its own type: TensorRT's Q/DQ typing)."""
        if compute is None or compute == self._orig_dtype(node.outputs[0]):
            return
        node.attrs["output_dtype"] = np_to_onnx(compute)

    def _cast(self, name: str, dtype: np.dtype) -> str:
        """A tensor holding ``name`` as ``dtype``: a converted weight, or the output of a (shared) Cast."""
        key = (name, dtype_name(dtype))
        if key in self.casts:
            return self.casts[key]
        graph = self.graph
        if name in graph.constants:
            value = graph.constants[name]
            converted, clamped = saturated(value, dtype)
            if clamped:
                self.policy.warn(f"weight '{name}': {clamped} value(s) outside the {dtype_name(dtype)} range "
                                 f"clamped to its largest finite value (as TensorRT does)")
            new = graph.add_constant(f"{name}_{dtype_name(dtype)}", converted)
            self.dtype[new] = dtype
            self.converted.setdefault(name, set()).add(new)
        else:
            if name in graph.input_names:
                label = f"reformat_in:{name}"
                if self.policy.direct_io:
                    raise BuildError(f"DIRECT_IO is set but input '{name}' ({dtype_name(self.dtype[name])}) needs a "
                                     f"reformat to {dtype_name(dtype)}: set the input's dtype to match")
            else:
                label = f"reformat:{name}:{dtype_name(dtype)}"
            new = graph.unique_name(f"{name}_{dtype_name(dtype)}")
            self._add_cast(name, new, dtype, label)
        self.casts[key] = new
        return new

    def _add_cast(self, src: str, dst: str, dtype: np.dtype, label: str) -> None:
        names = {n.name for n in self.nodes}
        node_name = label if label not in names else self.graph.unique_name(label)
        self.nodes.append(Node("Cast", [src], [dst], {"to": np_to_onnx(dtype)}, name=node_name, opset=self.opset))
        self.dtype[dst] = dtype
        self.policy.layer_precisions[node_name] = dtype_name(dtype)
        self.changes += 1

    def _pin_body_reads(self, node: Node) -> None:
        """Bodies (Loop/If/Scan) read enclosing tensors by name and keep the model's types: where such
        a tensor was retyped, the body reads a Cast back to the model's type instead."""
        for name in sorted(subgraph_reads(node)):
            original = self._orig_dtype(name)
            if name in self.dtype and original is not None and self.dtype[name] != original:
                _rename_in_bodies(node, name, self._cast(name, original))

    def _apply_output_types(self, node: Node) -> None:
        """``layer.set_output_type``: a Cast after the layer where its output has another type."""
        if self.policy.constraints == "ignore":
            return
        for index, wanted in sorted(node.output_type_constraints.items()):
            name = node.outputs[index] if index < len(node.outputs) else ""
            if not name:
                continue
            wanted = np.dtype(wanted)
            have = self.dtype[name]
            reason = None
            if wanted.name not in self.policy.allowed:
                reason = f"{wanted.name} is not enabled by the builder flags (set BuilderFlag.FP16 / BF16)"
            elif have.name not in FLOAT_TYPES:
                reason = f"the output is {dtype_name(have)}, not a float tensor"
            if reason is not None:
                self._refuse(f"layer {node}: output {index} type constraint {wanted.name} cannot be honoured: {reason}")
                continue
            if have == wanted:
                continue
            produced = self.graph.unique_name(f"{name}_{have.name}")
            node.outputs[index] = produced
            self.dtype[produced] = have
            self._add_cast(produced, name, wanted, f"{node.name}:output_type:{index}")

    def _reformat_outputs(self) -> None:
        """Graph outputs get the model's type (or the user's I/O type): ``reformat_out:<name>`` Casts."""
        graph = self.graph
        producers = graph.producers()
        for v in graph.outputs:
            if not v.is_tensor or v.name not in self.dtype:
                continue
            wanted = self.policy.io_dtypes.get(v.name, self._orig_dtype(v.name) or v.dtype)
            have = self.dtype[v.name]
            if v.name in self.policy.io_dtypes:
                _check_io_change(v.name, self._orig_dtype(v.name) or v.dtype, wanted)
            if have == wanted:
                v.dtype = wanted
                continue
            if v.name in graph.input_names or v.name in graph.constants:
                raise BuildError(f"output '{v.name}' is also a network input or a constant: its type "
                                 f"{dtype_name(have)} cannot be changed to {dtype_name(wanted)}")
            if self.policy.direct_io:
                raise BuildError(f"DIRECT_IO is set but output '{v.name}' ({dtype_name(have)}) needs a reformat to "
                                 f"{dtype_name(wanted)}: set the output's dtype to match")
            producer = producers[v.name]
            inner = graph.unique_name(f"{v.name}_{have.name}")
            producer.outputs = [inner if o == v.name else o for o in producer.outputs]
            graph.rename_tensor_uses(v.name, inner)
            self.dtype[inner] = have
            self._add_cast(inner, v.name, wanted, f"reformat_out:{v.name}")  # self.nodes is graph.nodes now
            v.dtype = wanted

    def _settle_constants(self) -> None:
        """A weight whose every reader now reads its converted copy is replaced by it, under its own
        name (refit and the inspector keep finding it); weights also read in float32 keep both."""
        graph = self.graph
        reads = {i for n in graph.nodes for i in n.inputs}
        for n in graph.nodes:
            if has_subgraph(n):
                reads |= subgraph_reads(n)
        outputs = set(graph.output_names)
        for name, copies in self.converted.items():
            self.changes += 1
            if name in reads or name in outputs or len(copies) != 1:
                continue
            (copy,) = copies
            graph.constants[name] = graph.constants.pop(copy)
            graph.rename_tensor_uses(copy, name)

    # -- helpers -------------------------------------------------------------------------------
    def _refuse(self, message: str) -> None:
        if self.policy.constraints == "obey":
            raise BuildError(message + " (OBEY_PRECISION_CONSTRAINTS)")
        self.policy.warn(message + "; the layer keeps its default precision (PREFER_PRECISION_CONSTRAINTS)")

    def _orig_dtype(self, name: str) -> np.dtype | None:
        info = self.original.get(name)
        return info.dtype if info is not None else None

    def _source(self, name: str) -> str:
        """The tensor a pass-made tensor (cast output, converted weight) stands for."""
        for (src, _), new in self.casts.items():
            if new == name:
                return src
        return name

    def _schema(self, node: Node) -> _Schema | None:
        return _schema_of(node.op_type, node.domain, node.opset or self.graph.opsets.get(node.domain, self.opset),
                          len(node.inputs), len(node.outputs))


def saturated(value: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, int]:
    """``value`` as ``dtype``, finite values beyond its range clamped to its largest finite value instead of
    becoming infinite (a mask constant of float32's lowest, transformers' finfo.min, stays a huge negative
    number, so ``(1 - mask) * lowest`` is 0 where the mask is 1, not 0 * -inf = NaN), and how many were clamped.
    One pass over the weight finds them (weights are the bulk of a build's host work)."""
    dtype = np.dtype(dtype)
    if value.dtype.kind != "f" or dtype.kind not in "fV" or dtype == value.dtype or value.size == 0:
        return value.astype(dtype), 0
    bound = float(ml_dtypes.finfo(dtype).max)
    beyond = np.abs(value) > bound  # infinities too: they stay as they are
    if not beyond.any():
        return value.astype(dtype), 0
    clamped = beyond & np.isfinite(value)
    return np.where(clamped, np.sign(value) * bound, value).astype(dtype), int(np.count_nonzero(clamped))


def _is_qdq(node: Node, *op_types: str) -> bool:
    """``node`` is a standard-domain QuantizeLinear/DequantizeLinear of one of ``op_types``."""
    return node.op_type in op_types and node.domain in ("", "ai.onnx")


def _check_io_change(name: str, model: np.dtype, wanted: np.dtype) -> None:
    if np.dtype(model).name not in FLOAT_TYPES or np.dtype(wanted).name not in FLOAT_TYPES:
        raise BuildError(f"tensor '{name}': I/O type {dtype_name(wanted)} is not allowed for a "
                         f"{dtype_name(model)} tensor (only float tensors may switch between FLOAT, HALF and BF16)")


def _rename_in_bodies(node: Node, old: str, new: str) -> None:
    """Make every body of ``node`` (at any depth) read ``new`` where it read ``old``."""
    for value in node.attrs.values():
        for body in value if isinstance(value, list) else [value]:
            if isinstance(body, Graph):
                for inner in body.nodes:
                    inner.inputs = [new if i == old else i for i in inner.inputs]
                    if has_subgraph(inner):
                        _rename_in_bodies(inner, old, new)
                body.outputs = [_renamed_value(v, old, new) for v in body.outputs]


def _renamed_value(v: Any, old: str, new: str) -> Any:
    if v.name == old:
        v.name = new
    return v


def _cast_target(node: Node) -> np.dtype:
    from engine_core.types import onnx_to_np

    return onnx_to_np(int(node.attr("to")))


def _original_infos(graph: Graph, policy: PrecisionPolicy) -> dict[str, TensorInfo]:
    """Types (and build-time values) of every tensor as the model has them, before the rewrite."""
    from engine_core.passes.shape_inference import infer_shapes, stand_in_shape

    infos = {}
    for v in graph.inputs:
        if not v.is_tensor:
            infos[v.name] = TensorInfo(v.dtype, None)
            continue
        shape = policy.input_shapes.get(v.name)
        if shape is None and v.shape is not None:
            shape = stand_in_shape(v.shape)
        value = policy.input_values.get(v.name)
        infos[v.name] = TensorInfo(v.dtype, shape,
                                   None if value is None else np.array(value, v.dtype).reshape(shape))
    try:
        return infer_shapes(graph, infos)
    except KilnError as e:
        raise BuildError(f"reduced precision: cannot type the network: {e}") from None


_SCHEMAS: dict[tuple[str, str, int, int, int], _Schema | None] = {}


def _schema_of(op_type: str, domain: str, opset: int, n_in: int, n_out: int) -> _Schema | None:
    """Type variable of each input/output (variadic params repeated), and each variable's allowed
    types: those of the node's opset, widened by the newest schema (types an op gained later, e.g.
    bfloat16 Conv, are an implementation fact, not a semantic change)."""
    key = (op_type, domain, opset, n_in, n_out)
    if key in _SCHEMAS:
        return _SCHEMAS[key]
    schema = None
    try:
        onnx_domain = "" if domain in ("", "ai.onnx") else domain
        at = onnx.defs.get_schema(op_type, max(opset, 1), onnx_domain)
        newest = onnx.defs.get_schema(op_type, onnx_domain)
    except onnx.defs.SchemaError:
        _SCHEMAS[key] = None
        return None
    allowed: dict[str, set[str]] = {t.type_param_str: set(t.allowed_type_strs) for t in at.type_constraints}
    for t in newest.type_constraints:
        if t.type_param_str in allowed:
            allowed[t.type_param_str] |= set(t.allowed_type_strs)
    schema = _Schema(_params(at.inputs, n_in), _params(at.outputs, n_out), allowed)
    _SCHEMAS[key] = schema
    return schema


def _params(formals: Any, count: int) -> list[str]:
    types = [f.type_str for f in formals]
    if not types:
        return ["tensor(undefined)"] * count
    return [types[min(i, len(types) - 1)] for i in range(count)]
