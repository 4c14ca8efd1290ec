"""Fixtures for the generative-model tests: the tiny decoder of examples/generative.py, written and built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.examples import load_example

#: examples/generative.py: write_tiny_decoder, reference_greedy, tokenizer_vocab, ...
generative = load_example("generative.py")


@pytest.fixture(scope="session")
def tiny_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny decoder's version directory (model.onnx, tokenizer.json, tokenizer_config.json, ...)."""
    return generative.write_tiny_decoder(tmp_path_factory.mktemp("tiny_decoder"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_decoder: Path):
    """The tiny decoder built for the CPU: 4 sequences per step, contexts of 64 tokens."""
    from engine_core.generate import build_decoder_engine

    return build_decoder_engine(tiny_decoder / "model.onnx", max_batch_size=4, max_context=64)
