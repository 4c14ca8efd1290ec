"""ModelInferRequest read with its tensor bytes left where they arrived.

Why: the protobuf parser copies every `raw_input_contents` entry into the message, and each read of the field copies
it again (upb makes a new `bytes` per access). For ResNet-50's 600 KB input that was two of the four copies a gRPC
frontend made per request, ~25% of its CPU under load (docs/performance.md, "Large buffers in the heap"). Here the
top-level fields of the wire message are walked once: field 7 (`raw_input_contents`, length-delimited) becomes
memoryviews of the received bytes, every other field is handed to the parser as it was (a few hundred bytes). What
comes back reads like the message (`InferWire`), so `convert.infer_request` takes either.
"""

from __future__ import annotations

from typing import Any

from server.protos import grpc_service_pb2 as pb

RAW_INPUT_CONTENTS = 7  # ModelInferRequest.raw_input_contents (protos/grpc_service.proto)
_LENGTH_DELIMITED, _VARINT, _FIXED64, _FIXED32 = 2, 0, 1, 5


class InferWire:
    """A ModelInferRequest parsed without its raw_input_contents, which are views of the received bytes; every other
    attribute is the parsed message's."""

    __slots__ = ("message", "raw_input_contents")

    def __init__(self, message: pb.ModelInferRequest, raw_input_contents: list[memoryview]) -> None:
        self.message = message
        self.raw_input_contents = raw_input_contents

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)


def read_infer_request(data: bytes | memoryview) -> InferWire | pb.ModelInferRequest:
    """`data` (a serialized ModelInferRequest) with its raw contents as views; a message this walk does not follow
    (groups, a truncated field) goes to the parser whole, which says what is wrong with it."""
    view = memoryview(data).cast("B")
    rest = bytearray()
    raw: list[memoryview] = []
    at, end = 0, len(view)
    try:
        while at < end:
            start = at
            key, at = _varint(view, at)
            field, kind = key >> 3, key & 7
            if kind == _LENGTH_DELIMITED:
                size, at = _varint(view, at)
                if at + size > end:
                    raise ValueError("truncated")
                if field == RAW_INPUT_CONTENTS:
                    raw.append(view[at:at + size])
                    at += size
                    continue
                at += size
            elif kind == _VARINT:
                _, at = _varint(view, at)
            elif kind == _FIXED64:
                at += 8
            elif kind == _FIXED32:
                at += 4
            else:
                raise ValueError("group")
            if at > end:
                raise ValueError("truncated")
            rest += view[start:at]
    except ValueError:
        return pb.ModelInferRequest.FromString(bytes(view))
    if not raw:  # nothing to keep apart: one parse of the bytes as they are
        return pb.ModelInferRequest.FromString(bytes(view) if not isinstance(data, bytes) else data)
    return InferWire(pb.ModelInferRequest.FromString(bytes(rest)), raw)


def _varint(view: memoryview, at: int) -> tuple[int, int]:
    """The varint at `at` and where the next field starts."""
    value = shift = 0
    while True:
        if at >= len(view) or shift > 63:
            raise ValueError("truncated varint")
        byte = view[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
