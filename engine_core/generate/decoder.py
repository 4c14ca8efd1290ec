"""A decoder-only ONNX model with a KV cache as a Kiln engine, and the runner that steps it.

The model follows the Hugging Face / optimum export convention (inputs ``input_ids``, ``attention_mask``, optional
``position_ids``, ``past_key_values.{i}.key`` / ``.value``; outputs ``logits``, ``present.{i}.key`` / ``.value``).
One engine serves both phases: prefill (several sequences, each a chunk of its prompt after the chunks before it)
and decode (many sequences, one new token each), so it is built with one optimization profile covering both. A run
left-pads the sequences' pasts to one length and RIGHT-pads their new tokens to one length: causal attention then
keeps every real token from seeing a pad, and every pad query still sees a real token (a query row masked whole
would make NaN with a -inf mask, and NaN times a zero weight poisons the real rows of the next layer).

The builder checks every profile at its min, opt and max corners, where the three lengths (new tokens S, past P,
mask P + S) have to agree. The max corner (S = max_context new tokens after P = max_context - 1 past ones) has
P + S = 2 * max_context - 1, so the mask's range goes that far; real steps never pass max_context tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from engine_core.builder import Builder, build_plan
from engine_core.errors import ParseError
from engine_core.generate.device_kv import DeviceKVPool
from engine_core.generate.device_step import DeviceStepper
from engine_core.generate.kv_cache import BlockAccounting, KVBlockPool
from engine_core.generate.kv_layout import KV_PARTS, PAST, PRESENT, StepLayout, bucket_shapes, plan_step
from engine_core.generate.kv_layout import ragged_layout as ragged_layout  # it lived here
from engine_core.generate.logits_rows import LOGITS_ROWS, select_logits_rows
from engine_core.network import NetworkDefinition
from engine_core.onnx import OnnxParser
from engine_core.runtime import CudaEngine, Runtime
from engine_core.types import BuilderFlag, DataType, TensorIOMode, nptype


def _past_names(names: set[str]) -> list[str]:
    return sorted(n for n in names if n.startswith("past_key_values."))


def _layer_count(inputs: set[str], outputs: set[str]) -> int:
    """How many layers the I/O names describe; ValueError naming a missing or unexpected tensor."""
    for name, where in (("input_ids", inputs), ("attention_mask", inputs), ("logits", outputs)):
        if name not in where:
            raise ValueError(f"decoder model: no {'input' if where is inputs else 'output'} '{name}' "
                             f"(a Hugging Face / optimum decoder export with a KV cache has it)")
    layers = 0
    while PAST.format(layers, "key") in inputs:
        layers += 1
    if layers == 0:
        raise ValueError("decoder model: no input 'past_key_values.0.key': export it with its KV cache "
                         "(optimum: --task text-generation-with-past)")
    wanted_in = {PAST.format(i, p) for i in range(layers) for p in KV_PARTS}
    wanted_out = {PRESENT.format(i, p) for i in range(layers) for p in KV_PARTS}
    missing = sorted((wanted_in - inputs) | (wanted_out - outputs))
    if missing:
        raise ValueError(f"decoder model with {layers} layers lacks {', '.join(missing)}")
    extra = sorted(inputs - wanted_in - {"input_ids", "attention_mask", "position_ids", LOGITS_ROWS})
    if extra:
        raise ValueError(f"decoder model has inputs Kiln does not feed: {', '.join(extra)}")
    return layers


@dataclass(frozen=True)
class DecoderSignature:
    """What a generator needs to know about a decoder engine: its KV cache's shape and type, its vocabulary."""

    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    has_position_ids: bool
    kv_dtype: np.dtype
    #: the engine computes the head for the rows ``logits_rows`` names (logits_rows.py): logits [batch, 1, vocab]
    has_logits_rows: bool = False

    @classmethod
    def from_engine(cls, engine: CudaEngine) -> DecoderSignature:
        """Read from the engine's I/O; ValueError naming what is missing or not static."""
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = {n for n in names if engine.get_tensor_mode(n) == TensorIOMode.INPUT}
        outputs = {n for n in names if engine.get_tensor_mode(n) == TensorIOMode.OUTPUT}
        layers = _layer_count(inputs, outputs)
        past = PAST.format(0, "key")
        shape = engine.get_tensor_shape(past)
        if len(shape) != 4 or shape[1] < 1 or shape[3] < 1:
            raise ValueError(f"decoder model: '{past}' has shape {list(shape)}; expected [batch, kv_heads, past, "
                             f"head_dim] with kv_heads and head_dim fixed")
        logits = engine.get_tensor_shape("logits")
        if len(logits) != 3 or logits[2] < 1:
            raise ValueError(f"decoder model: 'logits' has shape {list(logits)}; expected [batch, sequence, vocab] "
                             f"with vocab fixed")
        return cls(layers=layers, kv_heads=shape[1], head_dim=shape[3], vocab_size=logits[2],
                   has_position_ids="position_ids" in inputs,
                   kv_dtype=np.dtype(nptype(engine.get_tensor_dtype(past))), has_logits_rows=LOGITS_ROWS in inputs)


def _set_profile(network: NetworkDefinition, profile, max_batch_size: int, max_context: int) -> None:
    """Shapes for every input: batch 1..max_batch_size, new tokens 1..max_context, past 0..max_context - 1, mask
    as long as past + new (opt: a full batch decoding one token after half a context)."""
    batch, past_opt = (1, max_batch_size, max_batch_size), max_context // 2
    lengths = {"new": (1, 1, max_context), "past": (0, past_opt, max_context - 1),
               "total": (1, past_opt + 1, 2 * max_context - 1)}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        dims: list[tuple[int, ...]]
        if tensor.name in ("input_ids", "position_ids"):
            dims = [(b, s) for b, s in zip(batch, lengths["new"])]
        elif tensor.name == LOGITS_ROWS:
            dims = [(b,) for b in batch]
        elif tensor.name == "attention_mask":
            dims = [(b, t) for b, t in zip(batch, lengths["total"])]
        elif tensor.name.startswith("past_key_values.") and len(tensor.shape) == 4 and min(
                tensor.shape[1], tensor.shape[3]) > 0:
            dims = [(b, tensor.shape[1], p, tensor.shape[3]) for b, p in zip(batch, lengths["past"])]
        else:
            raise ValueError(f"decoder model: input '{tensor.name}' (shape {list(tensor.shape)}) is not one a "
                             f"decoder with a KV cache has")
        profile.set_shape(tensor.name, *dims)


def _half_kv_io(network: NetworkDefinition) -> None:
    """In an fp16 build the pasts and presents are bound as fp16 (a float32 export's KV I/O would otherwise get a
    reformat layer per layer and direction every step, casting the whole past, and the cache would hold float32:
    twice the memory and the copies). The logits stay float32 for sampling."""
    for tensors in ([network.get_input(i) for i in range(network.num_inputs)],
                    [network.get_output(i) for i in range(network.num_outputs)]):
        for tensor in tensors:
            if tensor.name.startswith(("past_key_values.", "present.")) and tensor.dtype == DataType.FLOAT:
                tensor.dtype = DataType.HALF


def build_decoder_engine(model_path: Path, *, max_batch_size: int, max_context: int, backend: str = "cpu",
                         fp16: bool = False, tf32: bool = True) -> CudaEngine:
    """Parse and build a decoder ONNX model (the convention above) for ``backend`` with one optimization profile
    that fits prefill of up to ``max_context`` tokens and decode of up to ``max_batch_size`` sequences. ``fp16``
    sets BuilderFlag.FP16; ``tf32=False`` clears BuilderFlag.TF32 (strict fp32 math on CUDA). Raises ParseError,
    BuildError, or ValueError for a model without the decoder's inputs."""
    if max_batch_size < 1 or max_context < 2:
        raise ValueError(f"max_batch_size must be >= 1 and max_context >= 2, not {max_batch_size}, {max_context}")
    builder = Builder()
    network = builder.create_network()
    parser = OnnxParser(network)
    try:
        model = onnx.load(str(model_path), load_external_data=False)  # the parser reads external weights itself
    except Exception as e:  # noqa: BLE001 - onnx raises DecodeError, OSError, ValueError ...
        raise ParseError(f"{model_path}: not a readable ONNX model: {e}") from None
    select_logits_rows(model)
    if not parser.parse(model, str(model_path)):
        raise ParseError(f"{model_path}: " + "; ".join(str(e) for e in parser.errors))
    config = builder.create_builder_config()
    config.backend = backend
    if fp16:
        config.set_flag(BuilderFlag.FP16)
        _half_kv_io(network)
    if not tf32:
        config.clear_flag(BuilderFlag.TF32)
    profile = builder.create_optimization_profile()
    _set_profile(network, profile, max_batch_size, max_context)
    config.add_optimization_profile(profile)
    return Runtime().load(build_plan(network, config))


def engine_limits(engine: CudaEngine) -> tuple[int, int]:
    """(most sequences per step, longest context) that the engine's first optimization profile takes."""
    batch_and_new = engine.get_tensor_profile_shape("input_ids", 0)[2]
    past = engine.get_tensor_profile_shape(PAST.format(0, "key"), 0)[2][2]
    return batch_and_new[0], min(batch_and_new[1], past + 1)


class DecoderRunner:
    """Steps a decoder engine over sequences whose keys and values live in a paged KV cache: each call feeds new
    tokens after every sequence's cached past (pasts left-padded to one length, rounded up to whole blocks so decode
    sees few distinct shapes; new tokens right-padded to the longest row's), writes the real tokens' keys and values
    back and returns each row's logits at its last real token.

    Two paths, chosen by the pool: a host ``KVBlockPool`` (CPU engines) feeds the engine host arrays; a
    ``DeviceKVPool`` (``new_pool``'s choice for CUDA engines) keeps the cache on the device and runs the engine by
    device address with shape buckets (``device_step.DeviceStepper``): only token ids, masks, block tables and each
    row's last logits cross PCIe."""

    def __init__(self, engine: CudaEngine, signature: DecoderSignature | None = None) -> None:
        self.engine = engine
        self.signature = signature or DecoderSignature.from_engine(engine)
        self.context = engine.create_execution_context()
        indices = ["input_ids", "attention_mask"] + ["position_ids"] * self.signature.has_position_ids + \
            [LOGITS_ROWS] * self.signature.has_logits_rows
        self._index_dtype = {n: np.dtype(nptype(engine.get_tensor_dtype(n))) for n in indices}
        self.max_batch_size, self.max_context = engine_limits(engine)
        #: whether the engine reads device addresses (CUDA engines): ``new_pool`` then keeps the cache in device memory
        self.on_device = engine.backend == "cuda"
        self._stepper: DeviceStepper | None = None  # made on the first device step

    def new_pool(self, *, block_tokens: int, num_blocks: int, on_device: bool | None = None) -> BlockAccounting:
        """A pool shaped for this engine's keys and values: in device memory (``DeviceKVPool``) when ``on_device``
        (default: the engine runs on CUDA), else in host memory (``KVBlockPool``)."""
        s = self.signature
        kind = DeviceKVPool if (self.on_device if on_device is None else on_device) else KVBlockPool
        return kind(s.layers, s.kv_heads, s.head_dim, block_tokens=block_tokens, num_blocks=num_blocks,
                    dtype=s.kv_dtype)

    def prefill(self, pool: BlockAccounting, seqs: Sequence[Hashable], chunks: Sequence[Sequence[int]],
                copy: bool = True) -> np.ndarray:
        """Feed each of ``seqs`` its next chunk of prompt (any length, after what the pool holds for it) in one
        batched run; next-token logits [len(seqs), vocab] (a sequence's first token's once its last chunk is in)."""
        return self.step(pool, seqs, chunks, copy)

    def decode(self, pool: BlockAccounting, seqs: Sequence[Hashable], tokens: Sequence[int], copy: bool = True,
               argmax: bool = False) -> np.ndarray:
        """Feed one token to each of ``seqs`` in one batched run; next-token logits [len(seqs), vocab] (or with
        ``argmax`` each sequence's greedy token [len(seqs)], found on the device for a device pool)."""
        return self.step(pool, seqs, [[int(t)] for t in tokens], copy, argmax)

    def step(self, pool: BlockAccounting, seqs: Sequence[Hashable], chunks: Sequence[Sequence[int]],
             copy: bool = True, argmax: bool = False) -> np.ndarray:
        """Feed ``chunks[b]`` (at least one token) after sequence ``seqs[b]``'s past; writes their rows into the pool
        (reserving blocks as needed: KVCacheFull when they run out) and returns each row's logits at its last new
        token [batch, vocab]. ValueError when the longest past and the longest chunk together pass the context.
        ``copy=False`` lets the device path hand over its pinned host buffer itself, valid until the next step (the
        generator samples from it at once; 64 rows of a 128k vocabulary are a 33 MB copy a step otherwise).
        ``argmax``: each row's argmax token id [batch] (int64) instead of its logits (numpy's argmax)."""
        on_device = isinstance(pool, DeviceKVPool)
        if on_device and not self.on_device:
            raise ValueError(f"a device KV cache needs a CUDA engine; this one runs on '{self.engine.backend}'")
        if not on_device and not isinstance(pool, KVBlockPool):
            raise TypeError(f"DecoderRunner steps a KVBlockPool or a DeviceKVPool, not {type(pool).__name__}")
        lengths = [pool.length(s) if s in pool else 0 for s in seqs]
        layout = plan_step(lengths, chunks, block_tokens=pool.block_tokens, max_context=self.max_context,
                           max_batch=self.max_batch_size if on_device else None)
        for seq, length, count in zip(seqs, lengths, layout.counts.tolist()):
            pool.reserve(seq, length + count)
        if isinstance(pool, DeviceKVPool):
            stepper = self._device_stepper()
            if argmax and stepper.finds_argmax:  # only the ids come back
                return stepper.step(pool, seqs, layout, argmax=True)
            logits = stepper.step(pool, seqs, layout, copy and not argmax)
        else:
            assert isinstance(pool, KVBlockPool)
            logits = self._host_step(pool, seqs, layout)
        return np.argmax(logits, axis=1) if argmax else logits

    def warm_up(self, pool: BlockAccounting, max_prefill_tokens: int) -> int:
        """Capture the CUDA graphs of every shape bucket a device ``pool``'s runs can have (``bucket_shapes``: each
        decode batch and past, each prefill without a cached past) before serving, and return how many. Why: a
        shape's first runs bind it (the whole graph lowered again), capture and check its graph, a stall of every
        sequence in the step (~0.1-0.3 s for a 1B model); a server meets dozens of them in its first minute.
        Nothing to do (0) for a host pool."""
        if not isinstance(pool, DeviceKVPool):
            return 0
        shapes = bucket_shapes(self.max_batch_size, self.max_context, max_prefill_tokens)
        self._device_stepper().warm_up(pool, shapes, pool.block_tokens)
        return len(shapes)

    def close(self) -> None:
        """Free the device path's engine-side buffers (pools are their owners' to close). Idempotent; a later
        device step allocates them again."""
        if self._stepper is not None:
            self._stepper.close()
            self._stepper = None

    def _device_stepper(self) -> DeviceStepper:
        if self._stepper is None:
            self._stepper = DeviceStepper(self.context, self.signature, self._index_dtype,
                                          max_batch=self.max_batch_size, max_context=self.max_context)
        return self._stepper

    def _host_step(self, pool: KVBlockPool, seqs: Sequence[Hashable], layout: StepLayout) -> np.ndarray:
        """The run on host arrays: pasts gathered from the host pool, the present outputs' new rows written back."""
        feeds = {"input_ids": layout.tokens.astype(self._index_dtype["input_ids"], copy=False),
                 "attention_mask": layout.mask.astype(self._index_dtype["attention_mask"])}
        if self.signature.has_position_ids:
            feeds["position_ids"] = layout.positions.astype(self._index_dtype["position_ids"], copy=False)
        if self.signature.has_logits_rows:
            feeds[LOGITS_ROWS] = layout.logits_rows.astype(self._index_dtype[LOGITS_ROWS], copy=False)
        keys, values = pool.gather(seqs, layout.past)
        for i in range(self.signature.layers):
            feeds[PAST.format(i, "key")], feeds[PAST.format(i, "value")] = keys[i], values[i]
        outputs = self.context.infer(feeds)
        for b, seq in enumerate(seqs):
            rows = slice(layout.past, layout.past + int(layout.counts[b]))
            new_kv = [np.stack([outputs[PRESENT.format(i, part)][b, :, rows] for i in range(self.signature.layers)])
                      .astype(pool.dtype, copy=False) for part in KV_PARTS]
            pool.write(seq, int(layout.lengths[b]), *new_kv)
        if self.signature.has_logits_rows:
            return np.asarray(outputs["logits"][:len(seqs), 0], np.float32)
        return np.asarray(outputs["logits"][np.arange(len(seqs)), layout.last], np.float32)
