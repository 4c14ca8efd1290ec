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

from engine_core.builder import Builder, build_plan
from engine_core.errors import ParseError
from engine_core.generate.kv_cache import KVBlockPool
from engine_core.network import NetworkDefinition
from engine_core.onnx import OnnxParser
from engine_core.runtime import CudaEngine, Runtime
from engine_core.types import BuilderFlag, TensorIOMode, nptype

PAST = "past_key_values.{}.{}"
PRESENT = "present.{}.{}"
KV_PARTS = ("key", "value")


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
    extra = sorted(inputs - wanted_in - {"input_ids", "attention_mask", "position_ids"})
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
                   kv_dtype=np.dtype(nptype(engine.get_tensor_dtype(past))))


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
        elif tensor.name == "attention_mask":
            dims = [(b, t) for b, t in zip(batch, lengths["total"])]
        elif tensor.name.startswith("past_key_values.") and len(tensor.shape) == 4 and min(
                tensor.shape[1], tensor.shape[3]) > 0:
            dims = [(b, tensor.shape[1], p, tensor.shape[3]) for b, p in zip(batch, lengths["past"])]
        else:
            raise ValueError(f"decoder model: input '{tensor.name}' (shape {list(tensor.shape)}) is not one a "
                             f"decoder with a KV cache has")
        profile.set_shape(tensor.name, *dims)


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
    if not parser.parse_from_file(str(model_path)):
        raise ParseError(f"{model_path}: " + "; ".join(str(e) for e in parser.errors))
    config = builder.create_builder_config()
    config.backend = backend
    if fp16:
        config.set_flag(BuilderFlag.FP16)
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


def ragged_layout(lengths: np.ndarray, counts: np.ndarray, past: int, new: int) -> tuple[np.ndarray, np.ndarray]:
    """The attention mask [batch, past + new] and position ids [batch, new] of one run: row ``b`` has ``lengths[b]``
    cached tokens right-aligned in the ``past`` columns and ``counts[b]`` new tokens left-aligned in the ``new``
    columns (pads after them). Positions count each row's real tokens from 0; a pad's goes on counting (it stays
    below ``past + new``, so within the model's positions, and nothing real attends to it)."""
    columns = np.arange(past + new)[None, :]
    mask = (columns >= past - lengths[:, None]) & (columns < past + counts[:, None])
    return mask, lengths[:, None] + np.arange(new)[None, :]


class DecoderRunner:
    """Steps a decoder engine over sequences whose keys and values live in a KVBlockPool: each call feeds new
    tokens after every sequence's cached past (pasts left-padded to one length, rounded up to whole blocks so decode
    sees few distinct shapes; new tokens right-padded to the longest row's), writes the real tokens' keys and values
    back and returns each row's logits at its last real token."""

    def __init__(self, engine: CudaEngine, signature: DecoderSignature | None = None) -> None:
        self.engine = engine
        self.signature = signature or DecoderSignature.from_engine(engine)
        self.context = engine.create_execution_context()
        indices = ["input_ids", "attention_mask"] + ["position_ids"] * self.signature.has_position_ids
        self._index_dtype = {n: np.dtype(nptype(engine.get_tensor_dtype(n))) for n in indices}
        self.max_batch_size, self.max_context = engine_limits(engine)

    def new_pool(self, *, block_tokens: int, num_blocks: int) -> KVBlockPool:
        """A pool shaped for this engine's keys and values."""
        s = self.signature
        return KVBlockPool(s.layers, s.kv_heads, s.head_dim, block_tokens=block_tokens, num_blocks=num_blocks,
                           dtype=s.kv_dtype)

    def prefill(self, pool: KVBlockPool, seqs: Sequence[Hashable], chunks: Sequence[Sequence[int]]) -> np.ndarray:
        """Feed each of ``seqs`` its next chunk of prompt (any length, after what the pool holds for it) in one
        batched run; next-token logits [len(seqs), vocab] (a sequence's first token's once its last chunk is in)."""
        return self.step(pool, seqs, chunks)

    def decode(self, pool: KVBlockPool, seqs: Sequence[Hashable], tokens: Sequence[int]) -> np.ndarray:
        """Feed one token to each of ``seqs`` in one batched run; next-token logits [len(seqs), vocab]."""
        return self.step(pool, seqs, [[int(t)] for t in tokens])

    def step(self, pool: KVBlockPool, seqs: Sequence[Hashable], chunks: Sequence[Sequence[int]]) -> np.ndarray:
        """Feed ``chunks[b]`` (at least one token) after sequence ``seqs[b]``'s past; writes their rows into the pool
        (reserving blocks as needed: KVCacheFull when they run out) and returns each row's logits at its last new
        token [batch, vocab]. ValueError when the longest past and the longest chunk together pass the context."""
        counts = np.array([len(c) for c in chunks], np.int64)
        if len(chunks) != len(seqs) or not len(seqs) or counts.min() < 1:
            raise ValueError(f"{len(seqs)} sequences need as many chunks of at least one token, not {counts.tolist()}")
        lengths = np.array([pool.length(s) if s in pool else 0 for s in seqs], np.int64)
        new = int(counts.max())
        past = self._padded_past(int(lengths.max()), new, pool.block_tokens)
        for seq, length, count in zip(seqs, lengths, counts):
            pool.reserve(seq, int(length + count))
        tokens = np.zeros((len(seqs), new), self._index_dtype["input_ids"])
        for b, chunk in enumerate(chunks):
            tokens[b, :len(chunk)] = chunk
        mask, positions = ragged_layout(lengths, counts, past, new)
        feeds = {"input_ids": tokens, "attention_mask": mask.astype(self._index_dtype["attention_mask"])}
        if self.signature.has_position_ids:
            feeds["position_ids"] = positions.astype(self._index_dtype["position_ids"])
        keys, values = pool.gather(seqs, past)
        for i in range(self.signature.layers):
            feeds[PAST.format(i, "key")], feeds[PAST.format(i, "value")] = keys[i], values[i]
        outputs = self.context.infer(feeds)
        for b, seq in enumerate(seqs):
            rows = slice(past, past + int(counts[b]))
            new_kv = [np.stack([outputs[PRESENT.format(i, part)][b, :, rows] for i in range(self.signature.layers)])
                      .astype(pool.dtype, copy=False) for part in KV_PARTS]
            pool.write(seq, int(lengths[b]), *new_kv)
        return np.asarray(outputs["logits"][np.arange(len(seqs)), counts - 1], np.float32)

    def _padded_past(self, longest: int, new: int, block_tokens: int) -> int:
        """The past length to feed: the longest past rounded up to whole blocks, keeping past + new within the
        context (so a run never feeds the model more positions than it serves)."""
        if longest + new > self.max_context:
            raise ValueError(f"{longest} cached + {new} new tokens exceed the engine's context of "
                             f"{self.max_context}")
        rounded = -(-longest // block_tokens) * block_tokens
        return min(rounded, self.max_context - new)
