"""Inference bodies <-> core types: JSON tensors, Triton's binary tensor data extension, gzip/deflate.

This is the one hot path that bypasses per-element pydantic validation: the JSON header is read by orjson and
checked field by field when every field has exactly its type (`_plain`), else validated by `InferRequestBody`
(data left as `Any`); tensor data goes straight to numpy here. Refusals are always the standard library's and
pydantic's (`decode_request`).

Binary layout (request and response): the first `Inference-Header-Content-Length` bytes are the JSON header;
binary tensors follow back to back in the order of the tensors that carry `binary_data_size`.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import ValidationError

from server.core import InferInput, InferRequest, InferResponse, RequestedOutput
from server.core.errors import ServerError, invalid
from server.core.limits import PayloadTooLarge, check_shape
from server.core.tensors import element_count, from_raw, to_raw
from server.core.types import numpy_dtype

from .schemas import InferRequestBody

try:  # C-speed JSON: parsing and writing a request's JSON took a quarter of the server's CPU per JSON request
    import orjson as _orjson
except ImportError:  # pragma: no cover - a platform without its wheel: the standard library does it all
    _orjson = None  # type: ignore[assignment]

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_DECOMPRESSED_BYTES = 1 << 30
# Triton refuses tensor data nested this deep (server/src/common.h HTTP_MAX_JSON_NESTING_DEPTH); its message:
MAX_JSON_NESTING_DEPTH = 100
NESTING_TOO_DEEP = f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_NESTING_DEPTH})"


# -- compression ------------------------------------------------------------------------------------------------
def decompress(body: bytes, encoding: str | None, limit: int = MAX_DECOMPRESSED_BYTES,
               refusal: Callable[[int, int], ServerError] | None = None) -> bytes:
    """Undo Content-Encoding gzip/deflate (deflate = zlib stream, as tritonclient sends it; raw deflate too).

    Inflation stops at `limit` bytes (`refusal(limit, len(body))` beyond, 413 by default: a compression bomb
    never expands in memory); a stream that ends early is a 400, not a silently shortened body.
    """
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("identity", ""):
        return body
    if encoding not in ("gzip", "deflate"):
        raise invalid(f"unsupported Content-Encoding '{encoding}' (supported: gzip, deflate)")
    attempts = [zlib.MAX_WBITS | 16] if encoding == "gzip" else [zlib.MAX_WBITS, -zlib.MAX_WBITS]
    for wbits in attempts:
        inflater = zlib.decompressobj(wbits)
        try:
            data = inflater.decompress(body, limit)
        except zlib.error:
            continue
        if inflater.unconsumed_tail or (not inflater.eof and len(data) >= limit):
            if refusal is not None:
                raise refusal(limit, len(body))
            raise PayloadTooLarge(f"decompressed request body exceeds the limit of {limit} bytes "
                                  f"({len(body)} bytes compressed)")
        if not inflater.eof:
            raise invalid(f"request body is truncated {encoding} data")
        return data
    raise invalid(f"request body is not valid {encoding} data")


def pick_encoding(accept_encoding: str | None) -> str | None:
    """gzip or deflate if the client accepts it (first one listed wins), else None."""
    for part in (accept_encoding or "").split(","):
        name = part.split(";")[0].strip().lower()
        if name in ("gzip", "deflate"):
            return name
    return None


def compress(body: bytes, encoding: str) -> bytes:
    """gzip (RFC 1952) or deflate (zlib stream, RFC 1950) at level 6.

    The window and hash table are sized to the body: zlib's defaults (32 KiB window, memLevel 8) make setting
    up a compressor cost ~60 us, far more than compressing a small response (asyncio's tritonclient, i.e.
    aiohttp, asks for gzip on every request). Any decoder reads a smaller window; the output is standard.
    """
    window_bits = min(max(len(body).bit_length(), 9), zlib.MAX_WBITS)
    mem_level = min(max(window_bits - 6, 1), 8)
    compressor = zlib.compressobj(6, zlib.DEFLATED, window_bits + (16 if encoding == "gzip" else 0), mem_level)
    return compressor.compress(body) + compressor.flush()


# -- requests ---------------------------------------------------------------------------------------------------
def parse_header_length(header_length: str | None) -> int | None:
    """The `Inference-Header-Content-Length` value (None when absent); not an integer is a 400."""
    if header_length is None:
        return None
    try:
        return int(header_length)
    except ValueError:
        raise invalid(f"{HEADER_LENGTH} must be an integer, got '{header_length}'") from None


def is_raw_binary(header_length: str | None) -> bool:
    """Triton's raw binary request: header length 0 means the whole body is the model's single input
    (docs/protocol/extension_binary_data.md "Raw Binary Request"; http_server.cc EVBufferToRawInput)."""
    return parse_header_length(header_length) == 0


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary section; a header length that lies about the body is a 400."""
    length = parse_header_length(header_length)
    if length is None:
        return body, memoryview(b"")
    if not 0 <= length <= len(body):
        raise invalid(f"{HEADER_LENGTH} is {length} but the request body has {len(body)} bytes")
    return body[:length], memoryview(body)[length:]


def _no_constants(name: str) -> Any:
    """JSON has no NaN/Infinity; Python's parser would accept them, Triton's does not."""
    raise invalid(f"the request JSON contains '{name}', which JSON cannot carry: send non-finite values as "
                  "binary tensor data")


# Made once: `json.loads`/`json.dumps` with options build a decoder/encoder per call (~2 us each per request).
_DECODER = json.JSONDecoder(parse_constant=_no_constants)
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def _load(header: bytes) -> Any:
    """The request JSON as the standard library reads it: the reference, which decides and words every refusal."""
    try:  # what json.loads does with bytes, on the one decoder
        return _DECODER.decode(header.decode(json.detect_encoding(header), "surrogatepass"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, too-long ints, too-deep nesting
        raise invalid(f"failed to parse the request JSON buffer: {str(e)[:200]}") from None


def _dump(document: dict[str, Any]) -> bytes | None:
    """The response JSON; None when a float in it is NaN or infinite (JSON cannot carry them). orjson writes the same
    bytes as `_ENCODER` for ASCII text (other text as plain UTF-8, not escaped) but writes non-finite floats as null,
    so a null sends the document to the standard library's encoder, which tells the two apart."""
    if _orjson is not None:
        try:
            text = _orjson.dumps(document)
        except (TypeError, _orjson.JSONEncodeError):  # e.g. an int beyond 64 bits in parameters
            pass
        else:
            if b"null" not in text:
                return text
    try:
        return _ENCODER.encode(document).encode()
    except ValueError:
        return None


class _Tensor:
    """What `_decode` reads of an `InferInputBody` (`_plain`'s result; `_Output` and `_Body` likewise)."""

    __slots__ = ("name", "shape", "datatype", "parameters", "data")

    def __init__(self, name: str, shape: list[int], datatype: str, parameters: dict | None, data: Any) -> None:
        self.name, self.shape, self.datatype, self.parameters, self.data = name, shape, datatype, parameters, data


class _Output:
    __slots__ = ("name", "parameters")

    def __init__(self, name: str, parameters: dict | None) -> None:
        self.name, self.parameters = name, parameters


class _Body:
    __slots__ = ("id", "parameters", "inputs", "outputs")

    def __init__(self, id: str | None, parameters: dict | None, inputs: list[_Tensor],
                 outputs: list[_Output] | None) -> None:
        self.id, self.parameters, self.inputs, self.outputs = id, parameters, inputs, outputs


def _plain(document: dict) -> _Body | None:
    """`InferRequestBody`'s result for a request whose fields all have exactly their types (what clients send),
    read without pydantic (its validation was ~5% of the server's CPU per JSON request); None for anything else,
    which pydantic then validates (coercions, and every error message, stay its own)."""
    get = document.get
    request_id, parameters, inputs, outputs = get("id"), get("parameters"), get("inputs"), get("outputs")
    if (type(inputs) is not list or (request_id is not None and type(request_id) is not str)
            or (parameters is not None and type(parameters) is not dict)):
        return None
    tensors = []
    for item in inputs:
        if type(item) is not dict:
            return None
        name, shape, datatype, tensor_parameters = item.get("name"), item.get("shape"), item.get("datatype"), \
            item.get("parameters")
        if (type(name) is not str or type(datatype) is not str or type(shape) is not list
                or (tensor_parameters is not None and type(tensor_parameters) is not dict)):
            return None
        for dim in shape:
            if type(dim) is not int:
                return None
        tensors.append(_Tensor(name, shape, datatype, tensor_parameters, item.get("data")))
    requested = None
    if outputs is not None:
        if type(outputs) is not list:
            return None
        requested = []
        for item in outputs:
            if type(item) is not dict:
                return None
            name, output_parameters = item.get("name"), item.get("parameters")
            if type(name) is not str or (output_parameters is not None and type(output_parameters) is not dict):
                return None
            requested.append(_Output(name, output_parameters))
    return _Body(request_id, parameters, tensors, requested)


def _validated(document: Any) -> InferRequestBody | _Body:
    if type(document) is dict:
        plain = _plain(document)
        if plain is not None:
            return plain
    if not isinstance(document, dict):
        raise invalid("the request JSON must be an object")
    try:
        return InferRequestBody.model_validate(document)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise invalid(f"invalid inference request: {problems}") from None


def decode_request(body: bytes, header_length: str | None, model_name: str, model_version: str) -> InferRequest:
    """An HTTP inference request body as the core's `InferRequest`.

    orjson reads the JSON first (C speed: the standard library's parser was ~10% of the server's CPU per JSON
    request). A request it refuses, or one refused after it read it, is read again by the standard library, which
    decides and words every refusal: what orjson reads differently (NaN literals, a BOM, UTF-16, integers beyond
    64 bits, which it reads as floats) never shows to a client."""
    header, binary = split_body(body, header_length)
    if _orjson is not None:
        try:
            return _decode(_orjson.loads(header), binary, model_name, model_version)
        except (_orjson.JSONDecodeError, ServerError):
            pass
    return _decode(_load(header), binary, model_name, model_version)


def _decode(json_document: Any, binary: memoryview, model_name: str, model_version: str) -> InferRequest:
    document = _validated(json_document)
    offset = 0
    inputs = []
    for tensor in document.inputs:
        parameters = dict(tensor.parameters or {})
        shape = tuple(tensor.shape)
        check_shape(shape, tensor.name)
        size = parameters.pop("binary_data_size", None)
        if size is not None:
            size = _non_negative_int(size, f"input '{tensor.name}' binary_data_size")
            if offset + size > len(binary):
                raise invalid(f"input '{tensor.name}' has binary_data_size {size} but only "
                              f"{len(binary) - offset} bytes of binary data remain")
            data = from_raw(binary[offset:offset + size], tensor.datatype, shape)
            offset += size
        elif "shared_memory_region" in parameters:
            numpy_dtype(tensor.datatype)
            data = None
        else:
            if tensor.data is None:
                raise invalid(f"input '{tensor.name}' has no data, binary_data_size or shared_memory_region")
            data = from_json(tensor.data, tensor.datatype, shape, tensor.name)
        inputs.append(InferInput(tensor.name, tensor.datatype, shape, data, parameters))
    if offset != len(binary):
        raise invalid(f"the request has {len(binary) - offset} bytes of binary data that no input claims")
    outputs = [RequestedOutput(o.name, dict(o.parameters or {})) for o in document.outputs or []]
    return InferRequest(model_name, inputs, model_version, document.id or "", outputs,
                        dict(document.parameters or {}))


def _non_negative_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(f"{what} must be a non-negative integer, got {value!r}")
    return value


def check_nesting(data: Any) -> None:
    """Refuse tensor data nested as deep as Triton refuses it (ReadDataFromJsonHelper: any value at depth >= 100
    counting the data itself as 0), before anything recurses over it."""
    level = [data]
    for _ in range(MAX_JSON_NESTING_DEPTH):
        level = [item for value in level if isinstance(value, list) for item in value]
        if not level:
            return
    raise invalid(NESTING_TOO_DEEP)


def _flatten_strings(data: Any, name: str) -> list[bytes]:
    """BYTES JSON data (nested lists of strings) as a flat list of utf-8 bytes."""
    if isinstance(data, str):
        return [data.encode()]
    if not isinstance(data, list):
        raise invalid(f"input '{name}': BYTES data must be strings, got {type(data).__name__}")
    flat: list[bytes] = []
    for item in data:
        flat.extend(_flatten_strings(item, name))
    return flat


# numpy kinds JSON numbers may have for each datatype family (ints are accepted for floats, not vice versa).
_ACCEPTED_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}


def from_json(data: Any, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """JSON tensor data (flat or nested, row-major) as an array of `datatype` with `shape`.

    Values must fit the datatype: no bool/number mixing, no floats for ints, no out-of-range ints.
    """
    dtype = numpy_dtype(datatype)
    count = element_count(shape)
    if datatype == "BYTES":
        check_nesting(data)
        flat = _flatten_strings(data, name)
        if len(flat) != count:
            raise invalid(f"input '{name}': shape {list(shape)} needs {count} elements, data has {len(flat)}")
        array = np.empty(count, dtype=object)
        array[:] = flat
        return array.reshape(shape)
    try:  # numpy types the data first (no recursion of ours over it); nesting too deep fails here or is `object`
        values = np.asarray(data)
    except ValueError:
        check_nesting(data)  # Triton's words for data nested 100 deep or more
        raise invalid(f"input '{name}': data is not a rectangular array of numbers") from None
    if values.dtype.kind == "O":
        check_nesting(data)
    if values.size != count:
        raise invalid(f"input '{name}': shape {list(shape)} needs {count} elements, data has {values.size}")
    if count == 0:
        return np.zeros(shape, dtype=dtype)
    family = "f" if dtype.kind == "V" or datatype in ("FP16", "BF16") else dtype.kind
    if datatype == "UINT64" and values.dtype.kind in "fO":  # ints above int64 made numpy pick float64
        return _wide_integers(np.asarray(data, dtype=object), dtype, datatype, name).reshape(shape)
    if values.dtype.kind not in _ACCEPTED_KINDS[family]:
        raise invalid(f"input '{name}': {datatype} data must be "
                      f"{'booleans' if family == 'b' else 'integers' if family in 'iu' else 'numbers'}")
    if family in "iu":
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise invalid(f"input '{name}': values are outside the range of {datatype}")
    return values.astype(dtype).reshape(shape)


def _wide_integers(values: np.ndarray, dtype: np.dtype, datatype: str, name: str) -> np.ndarray:
    """Integers numpy could not type on its own (UINT64 values above the int64 range): convert and compare."""
    try:
        converted = values.astype(dtype)
    except (OverflowError, TypeError, ValueError):
        raise invalid(f"input '{name}': values are not integers in the range of {datatype}") from None
    if not np.array_equal(converted.astype(object), values):
        raise invalid(f"input '{name}': {datatype} data must be integers")
    return converted


# -- responses --------------------------------------------------------------------------------------------------
def _json_data(array: np.ndarray, datatype: str, check_finite: bool) -> list[Any] | None:
    """Flat JSON list of an output's elements, or None if it cannot be JSON (BYTES that are not UTF-8,
    NaN or infinities, which `json.dumps` would write as tokens no JSON parser accepts). Without
    `check_finite`, non-finite floats are left for the encoder to refuse (it looks at every float anyway)."""
    flat = array.reshape(-1)
    if datatype == "BYTES":
        try:
            return [x.decode() if isinstance(x, bytes) else str(x) for x in flat]
        except UnicodeDecodeError:
            return None
    if datatype in ("FP16", "BF16"):
        flat = flat.astype(np.float32)
    if check_finite and flat.dtype.kind == "f" and not np.isfinite(flat).all():
        return None
    return flat.tolist()


def _wants_binary(parameters: dict[str, Any], default: bool) -> bool:
    value = parameters.get("binary_data", default)
    return bool(value)


def encode_response(response: InferResponse, binary_default: bool) -> tuple[bytes, int | None]:
    """The response body and, when binary outputs follow the JSON, the JSON header's length.

    An output is binary when its `binary_data` parameter says so, else when the request's
    `binary_data_output` does; BYTES outputs that are not valid UTF-8, and float outputs with NaN or
    infinities, are sent binary either way.
    """
    document, chunks = _response_document(response, binary_default, check_finite=False)
    header = _dump(document)
    if header is None:  # a non-finite float: only now is each output checked (rare, and costs a pass)
        document, chunks = _response_document(response, binary_default, check_finite=True)
        header = _ENCODER.encode(document).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _response_document(response: InferResponse, binary_default: bool,
                       check_finite: bool) -> tuple[dict[str, Any], list[bytes]]:
    """The response's JSON document and the binary outputs that follow it."""
    outputs = []
    chunks: list[bytes] = []
    for output in response.outputs:
        parameters = {k: v for k, v in output.parameters.items() if k not in ("binary_data", "binary_data_size")}
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype, "shape": list(output.shape)}
        if output.data is not None:
            data = None if _wants_binary(output.parameters, binary_default) else _json_data(
                output.data, output.datatype, check_finite)
            if data is None:
                raw = to_raw(output.data, output.datatype)
                chunks.append(raw)
                parameters["binary_data_size"] = len(raw)
            else:
                entry["data"] = data
        if parameters:
            entry["parameters"] = parameters
        outputs.append(entry)
    document: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version,
                                "outputs": outputs}
    if response.id:
        document["id"] = response.id
    if response.parameters:
        document["parameters"] = response.parameters
    return document, chunks
