"""What one request may cost the server: body and decompressed sizes, requests in flight, repository uploads.

Both frontends share these so that an oversize body, a compression bomb or an overload gets the same answer
whichever protocol carried it (HTTP 413 / 429, gRPC RESOURCE_EXHAUSTED). The checks run before any tensor is
allocated or any model file is written, so a hostile request costs at most its own bytes on the wire.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from .errors import ErrorKind, ServerError, invalid

GIB = 1 << 30
MIB = 1 << 20

# A model name the repository API may create: a directory name on every platform, no hidden directories.
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")
_MAX_UPLOAD_FILES = 1024
_MAX_UPLOAD_DEPTH = 16
_NAME_MAX = 255  # bytes in one path component (Linux NAME_MAX; most file systems)
# Config fields naming files inside the model directory (a path out of it would read files the server can see).
_FILE_FIELDS = ("default_model_filename", "label_filename")


class PayloadTooLarge(ServerError):
    """A body (or what it decompresses to) over a limit: HTTP 413, gRPC RESOURCE_EXHAUSTED."""

    http_status = 413

    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.RESOURCE_EXHAUSTED, message)


def overloaded(message: str) -> ServerError:
    """Too much work in flight: HTTP 429, gRPC RESOURCE_EXHAUSTED; the client should back off and retry."""
    return ServerError(ErrorKind.RESOURCE_EXHAUSTED, message)


# Triton's --http-max-input-size default (server/src/common.h HTTP_DEFAULT_MAX_INPUT_SIZE = 1 << 26, 64 MiB).
HTTP_DEFAULT_MAX_INPUT_SIZE = 64 * MIB
_USE_FLAG = "Use --http-max-input-size to increase the limit."


@dataclass(frozen=True)
class RequestLimits:
    """Per-request size limits. None: no limit (`max_body_bytes`, `max_decompressed_bytes`); 0 means unlimited
    for `max_inflight_requests` only.

    `max_input_bytes` is Triton's `--http-max-input-size`: it bounds what the server must parse or build from
    the body (an inference request's JSON header, JSON request bodies of the other APIs, a raw binary input,
    the decompressed size), not binary tensor data after the header, which Triton does not limit either.
    `max_body_bytes` (`--http-max-body-bytes`) is Kiln's optional cap on the whole body on the wire; Triton has
    none, so by default there is none.
    """

    max_body_bytes: int | None = None
    max_decompressed_bytes: int | None = None
    # Compressed bodies may grow this many times, past a floor that legitimate small requests never reach.
    max_compression_ratio: int = 1024
    ratio_floor_bytes: int = 64 * MIB
    max_inflight_requests: int = 0
    max_input_bytes: int = HTTP_DEFAULT_MAX_INPUT_SIZE

    def __post_init__(self) -> None:
        sizes = [s for s in (self.max_body_bytes, self.max_decompressed_bytes) if s is not None]
        if min([*sizes, self.max_compression_ratio, self.max_input_bytes]) <= 0:
            raise ValueError("body, input, decompressed size and compression ratio limits must be positive")
        if self.max_inflight_requests < 0:
            raise ValueError("max_inflight_requests must be >= 0 (0 = unlimited)")

    def decompressed_limit(self, compressed_bytes: int) -> int:
        """The most bytes a body of `compressed_bytes` may inflate to (input size, absolute and ratio caps)."""
        by_ratio = max(compressed_bytes * self.max_compression_ratio, self.ratio_floor_bytes)
        return min(self.max_decompressed_bytes or by_ratio, by_ratio, self.max_input_bytes)

    def decompression_refusal(self, limit: int, compressed_bytes: int) -> ServerError:
        """The answer when a body would inflate past `limit`: Triton's 400 when the input size is what binds
        (data_compressor.h), else 413 for Kiln's own caps (the ratio guard, --http-max-body-bytes)."""
        if limit == self.max_input_bytes:
            return invalid(f"Decompressed data size exceeds the maximum allowed value of {limit} bytes. {_USE_FLAG}")
        return PayloadTooLarge(f"decompressed request body exceeds the limit of {limit} bytes "
                               f"({compressed_bytes} bytes compressed)")

    def check_body_size(self, size: int) -> None:
        if self.max_body_bytes is not None and size > self.max_body_bytes:
            raise PayloadTooLarge(f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes")

    def check_json_size(self, size: int) -> None:
        """A request JSON (inference header or API body) the server would parse; Triton's text (http_server.cc)."""
        if size > self.max_input_bytes:
            raise invalid(f"request JSON size of {size} bytes exceeds the maximum allowed input size of "
                          f"{self.max_input_bytes} bytes. {_USE_FLAG}")

    def check_raw_input_size(self, size: int) -> None:
        """The body of a raw binary request (Inference-Header-Content-Length: 0); Triton's text."""
        if size > self.max_input_bytes:
            raise invalid(f"Raw input has a byte_size ({size} bytes) that exceeds the maximum allowed value of "
                          f"{self.max_input_bytes} bytes. {_USE_FLAG}")


class InflightLimiter:
    """Bounded admission: at most `limit` requests run at once, the next one is refused, not queued.

    Refusing at once (instead of queueing without bound) keeps memory flat and admitted latency bounded
    under overload; clients retry on 429 / RESOURCE_EXHAUSTED. Used from the event loop only, so a plain
    counter is enough. Both frontends share one instance.
    """

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self.count = 0
        self.refused = 0

    def fits(self, count: int) -> bool:
        """Whether `count` more requests would be admitted now."""
        return not self.limit or self.count + count <= self.limit

    def acquire(self, count: int = 1) -> None:
        """Take `count` slots (a frontend's group of requests takes one per request) or raise RESOURCE_EXHAUSTED;
        pair with `release`."""
        if not self.fits(count):
            self.refused += count
            raise overloaded(f"the server is at its limit of {self.limit} requests in flight; retry later")
        self.count += count

    def release(self, count: int = 1) -> None:
        self.count -= count

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()


# -- tensors ----------------------------------------------------------------------------------------------------
MAX_RANK = 64  # numpy's limit: a deeper shape could not even be represented
MAX_ELEMENTS = (1 << 63) - 1


def check_shape(shape: Sequence[int], name: str) -> None:
    """A client shape numpy can hold and whose element count does not overflow int64 (it would wrap silently
    and make a huge claimed shape look small), checked with exact integers before any array exists."""
    if len(shape) > MAX_RANK:
        raise invalid(f"input '{name}': shape has {len(shape)} dimensions, at most {MAX_RANK} are supported")
    count = 1
    for d in shape:  # one loop: this runs for every input of every request
        if d.__class__ is not int:  # bool is an int subclass and not a dimension
            raise invalid(f"input '{name}': shape {list(shape)} must be a list of integers")
        if d < 0:
            raise invalid(f"input '{name}': shape {list(shape)} has a negative dimension")
        count *= d
    if count > MAX_ELEMENTS:
        raise invalid(f"input '{name}': shape {list(shape)} has more elements than any tensor can hold")


# -- repository API ---------------------------------------------------------------------------------------------
def check_model_name(name: str) -> None:
    """Names the repository API may load: letters, digits, '_', '.', '-'; no path separators, no hidden names."""
    if not _MODEL_NAME.match(name or ""):
        raise invalid(f"invalid model name {name!r}: use 1-255 letters, digits, '_', '.' or '-', "
                      "not starting with '.' or '-'")


def check_relative_path(relative: str, what: str) -> None:
    """A path that stays inside the model directory: relative, no '..', no empty parts, no control characters."""
    parts = PurePosixPath(relative).parts if relative else ()
    bad = (not relative or relative.startswith(("/", "~")) or "\\" in relative or ":" in relative
           or any(ord(c) < 32 or c == "\x7f" for c in relative) or ".." in parts
           or "//" in relative or len(parts) > _MAX_UPLOAD_DEPTH)
    if bad:
        raise invalid(f"{what} {relative!r} must be relative to the model directory, without '..', "
                      "a leading '/', a drive or control characters")


def _file_fields(document: Any) -> Iterator[str]:
    """Every value of a file-naming field anywhere in a JSON config (outputs carry label_filename)."""
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _FILE_FIELDS or key in ("defaultModelFilename", "labelFilename"):
                    yield value if isinstance(value, str) else repr(value)
                elif key in ("cc_model_filenames", "ccModelFilenames") and isinstance(value, dict):
                    yield from (v if isinstance(v, str) else repr(v) for v in value.values())
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def _check_component_lengths(name: str, relative: str) -> None:
    """A file name longer than the file system allows is the client's error (400), refused before anything is
    written; Triton's message for it starts "failed to load '<name>', failed to poll from model repository"."""
    for part in PurePosixPath(relative).parts:
        size = len(part.encode("utf-8", "surrogatepass"))
        if size > _NAME_MAX:
            raise invalid(f"failed to load '{name}', failed to poll from model repository: uploaded file path "
                          f"component '{part[:40]}...' is {size} bytes long, at most {_NAME_MAX} are allowed")


def check_load_request(name: str, config: str | None, files: dict[str, bytes]) -> None:
    """Refuse a repository load that could write or read outside the model directory, before anything runs."""
    check_model_name(name)
    if len(files) > _MAX_UPLOAD_FILES:
        raise invalid(f"a load may upload at most {_MAX_UPLOAD_FILES} files, got {len(files)}")
    for key in files:
        check_relative_path(key.removeprefix("file:"), "uploaded file path")
        _check_component_lengths(name, key.removeprefix("file:"))
    if config is None:
        return
    try:
        document = json.loads(config)
    except (ValueError, RecursionError) as e:
        raise invalid(f"load parameter 'config' is not valid JSON: {str(e)[:200]}") from None
    for value in _file_fields(document):
        if value:
            check_relative_path(value, "config file name")


# -- flags ------------------------------------------------------------------------------------------------------
def _size(text: str) -> int:
    """Bytes with an optional K/M/G suffix (powers of 1024): '1G', '512M', '4096'."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count like 1048576 or 1G, got '{text}'") from None


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http-max-input-size", type=_positive_size, default=HTTP_DEFAULT_MAX_INPUT_SIZE,
                        metavar="BYTES",
                        help="Triton's flag: largest request JSON (inference header or API body), raw binary "
                             "input and decompressed body, 400 beyond; binary tensor data after the header is not "
                             "counted (default 64M, as Triton)")
    parser.add_argument("--http-max-body-bytes", type=_size, default=0, metavar="BYTES",
                        help="largest HTTP request body on the wire, 413 beyond; also caps what a compressed body "
                             "inflates to (default 0: no limit, as Triton)")
    parser.add_argument("--max-inflight-requests", type=int, default=0, metavar="N",
                        help="inference requests running at once over HTTP and gRPC together; more are refused "
                             "with 429 / RESOURCE_EXHAUSTED (0 = unlimited)")


def _positive_size(text: str) -> int:
    size = _size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got '{text}'")
    return size


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    body = args.http_max_body_bytes or None
    return RequestLimits(max_body_bytes=body, max_decompressed_bytes=body, max_inflight_requests=args.max_inflight_requests,
                         max_input_bytes=args.http_max_input_size)
