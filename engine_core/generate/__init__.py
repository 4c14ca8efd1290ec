"""Serving decoder-only language models on Kiln engines: tokenizer, chat template, paged KV cache, continuous batching.

A generative model answers one request with many engine runs, one per new token, each needing the keys and values
of every token before it. Running requests one at a time would leave the engine mostly idle and recomputing those
keys and values would cost a full forward pass per token. So this package keeps them in a paged KV cache
(``KVBlockPool``: fixed-size blocks handed to sequences as they go, as vLLM does) and steps every running sequence
together in one batched engine run per token, letting sequences join and leave between steps (``Generator``:
continuous batching). The model is an ONNX export in the Hugging Face / optimum convention (``decoder.py``), built
by the public Builder API; text goes in and out through the model's own ``tokenizer.json`` and chat template.

    engine = build_decoder_engine(path / "model.onnx", max_batch_size=8, max_context=512)
    generator = Generator(engine, max_batch_size=8, max_context=512, eos_token_ids=tokenizer.eos_token_ids)
    generator.submit(tokenizer.encode(prompt), SamplingParams(max_tokens=32, temperature=0), on_event)

This package sits on the engine's public API; the server imports it, never the other way round.
"""

from engine_core.generate.chat_template import ChatTemplateError, render_chat
from engine_core.generate.decoder import DecoderRunner, DecoderSignature, build_decoder_engine
from engine_core.generate.generator import GenerationEvent, GenerationHandle, Generator, GeneratorStats
from engine_core.generate.kv_cache import KVBlockPool, KVCacheFull
from engine_core.generate.sampling import Sampler, SamplingParams
from engine_core.generate.tokenizer import DecodeStream, Tokenizer
from engine_core.generate.tokenizer_error import TokenizerError

__all__ = [
    "ChatTemplateError", "DecodeStream", "DecoderRunner", "DecoderSignature", "GenerationEvent", "GenerationHandle",
    "Generator", "GeneratorStats", "KVBlockPool", "KVCacheFull", "Sampler", "SamplingParams", "Tokenizer",
    "TokenizerError", "build_decoder_engine", "render_chat",
]
