"""ONNX importer."""

from engine_core.onnx.parser import OnnxParser, ParserError

__all__ = ["OnnxParser", "ParserError"]
