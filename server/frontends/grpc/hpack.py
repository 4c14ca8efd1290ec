"""HPACK (RFC 7541): the header compression of HTTP/2, decoder and a stateless encoder.

Why it exists: grpcio's server spends about 300 µs of CPU on every call, so Kiln serves gRPC over its own HTTP/2
layer, and every request's header block passes through `Decoder.decode`. The module is pure Python with no
third-party dependency; the static table (Appendix A) and the Huffman code (Appendix B) are data below.

Speed notes: indexed fields are one list index into a single table (a placeholder at 0, the static table at 1..61,
the dynamic table newest first from 62); Huffman strings are decoded a byte at a time through a transition table
built once at import, and cached by their raw bytes (clients repeat the same values); a whole block that leaves the
dynamic table unchanged (a repeated request of indexed fields) is cached until the table next changes.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["HUFFMAN_CODES", "STATIC_TABLE", "Decoder", "Encoder", "HpackError", "huffman_decode"]


class HpackError(Exception):
    """A header block that does not decode (COMPRESSION_ERROR in HTTP/2 terms)."""


#: RFC 7541 Appendix A: the static table; entry i of the RFC is STATIC_TABLE[i - 1].
STATIC_TABLE: tuple[tuple[str, str], ...] = (
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
)

#: RFC 7541 Appendix B: (code, length in bits) for symbols 0..255 and EOS (256); codes are right-aligned.
HUFFMAN_CODES: tuple[tuple[int, int], ...] = (
    (0x1ff8, 13), (0x7fffd8, 23), (0xfffffe2, 28), (0xfffffe3, 28), (0xfffffe4, 28), (0xfffffe5, 28),  # 0
    (0xfffffe6, 28), (0xfffffe7, 28), (0xfffffe8, 28), (0xffffea, 24), (0x3ffffffc, 30), (0xfffffe9, 28),  # 6
    (0xfffffea, 28), (0x3ffffffd, 30), (0xfffffeb, 28), (0xfffffec, 28), (0xfffffed, 28), (0xfffffee, 28),  # 12
    (0xfffffef, 28), (0xffffff0, 28), (0xffffff1, 28), (0xffffff2, 28), (0x3ffffffe, 30), (0xffffff3, 28),  # 18
    (0xffffff4, 28), (0xffffff5, 28), (0xffffff6, 28), (0xffffff7, 28), (0xffffff8, 28), (0xffffff9, 28),  # 24
    (0xffffffa, 28), (0xffffffb, 28), (0x14, 6), (0x3f8, 10), (0x3f9, 10), (0xffa, 12),  # 30
    (0x1ff9, 13), (0x15, 6), (0xf8, 8), (0x7fa, 11), (0x3fa, 10), (0x3fb, 10),  # 36
    (0xf9, 8), (0x7fb, 11), (0xfa, 8), (0x16, 6), (0x17, 6), (0x18, 6),  # 42
    (0x0, 5), (0x1, 5), (0x2, 5), (0x19, 6), (0x1a, 6), (0x1b, 6),  # 48
    (0x1c, 6), (0x1d, 6), (0x1e, 6), (0x1f, 6), (0x5c, 7), (0xfb, 8),  # 54
    (0x7ffc, 15), (0x20, 6), (0xffb, 12), (0x3fc, 10), (0x1ffa, 13), (0x21, 6),  # 60
    (0x5d, 7), (0x5e, 7), (0x5f, 7), (0x60, 7), (0x61, 7), (0x62, 7),  # 66
    (0x63, 7), (0x64, 7), (0x65, 7), (0x66, 7), (0x67, 7), (0x68, 7),  # 72
    (0x69, 7), (0x6a, 7), (0x6b, 7), (0x6c, 7), (0x6d, 7), (0x6e, 7),  # 78
    (0x6f, 7), (0x70, 7), (0x71, 7), (0x72, 7), (0xfc, 8), (0x73, 7),  # 84
    (0xfd, 8), (0x1ffb, 13), (0x7fff0, 19), (0x1ffc, 13), (0x3ffc, 14), (0x22, 6),  # 90
    (0x7ffd, 15), (0x3, 5), (0x23, 6), (0x4, 5), (0x24, 6), (0x5, 5),  # 96
    (0x25, 6), (0x26, 6), (0x27, 6), (0x6, 5), (0x74, 7), (0x75, 7),  # 102
    (0x28, 6), (0x29, 6), (0x2a, 6), (0x7, 5), (0x2b, 6), (0x76, 7),  # 108
    (0x2c, 6), (0x8, 5), (0x9, 5), (0x2d, 6), (0x77, 7), (0x78, 7),  # 114
    (0x79, 7), (0x7a, 7), (0x7b, 7), (0x7ffe, 15), (0x7fc, 11), (0x3ffd, 14),  # 120
    (0x1ffd, 13), (0xffffffc, 28), (0xfffe6, 20), (0x3fffd2, 22), (0xfffe7, 20), (0xfffe8, 20),  # 126
    (0x3fffd3, 22), (0x3fffd4, 22), (0x3fffd5, 22), (0x7fffd9, 23), (0x3fffd6, 22), (0x7fffda, 23),  # 132
    (0x7fffdb, 23), (0x7fffdc, 23), (0x7fffdd, 23), (0x7fffde, 23), (0xffffeb, 24), (0x7fffdf, 23),  # 138
    (0xffffec, 24), (0xffffed, 24), (0x3fffd7, 22), (0x7fffe0, 23), (0xffffee, 24), (0x7fffe1, 23),  # 144
    (0x7fffe2, 23), (0x7fffe3, 23), (0x7fffe4, 23), (0x1fffdc, 21), (0x3fffd8, 22), (0x7fffe5, 23),  # 150
    (0x3fffd9, 22), (0x7fffe6, 23), (0x7fffe7, 23), (0xffffef, 24), (0x3fffda, 22), (0x1fffdd, 21),  # 156
    (0xfffe9, 20), (0x3fffdb, 22), (0x3fffdc, 22), (0x7fffe8, 23), (0x7fffe9, 23), (0x1fffde, 21),  # 162
    (0x7fffea, 23), (0x3fffdd, 22), (0x3fffde, 22), (0xfffff0, 24), (0x1fffdf, 21), (0x3fffdf, 22),  # 168
    (0x7fffeb, 23), (0x7fffec, 23), (0x1fffe0, 21), (0x1fffe1, 21), (0x3fffe0, 22), (0x1fffe2, 21),  # 174
    (0x7fffed, 23), (0x3fffe1, 22), (0x7fffee, 23), (0x7fffef, 23), (0xfffea, 20), (0x3fffe2, 22),  # 180
    (0x3fffe3, 22), (0x3fffe4, 22), (0x7ffff0, 23), (0x3fffe5, 22), (0x3fffe6, 22), (0x7ffff1, 23),  # 186
    (0x3ffffe0, 26), (0x3ffffe1, 26), (0xfffeb, 20), (0x7fff1, 19), (0x3fffe7, 22), (0x7ffff2, 23),  # 192
    (0x3fffe8, 22), (0x1ffffec, 25), (0x3ffffe2, 26), (0x3ffffe3, 26), (0x3ffffe4, 26), (0x7ffffde, 27),  # 198
    (0x7ffffdf, 27), (0x3ffffe5, 26), (0xfffff1, 24), (0x1ffffed, 25), (0x7fff2, 19), (0x1fffe3, 21),  # 204
    (0x3ffffe6, 26), (0x7ffffe0, 27), (0x7ffffe1, 27), (0x3ffffe7, 26), (0x7ffffe2, 27), (0xfffff2, 24),  # 210
    (0x1fffe4, 21), (0x1fffe5, 21), (0x3ffffe8, 26), (0x3ffffe9, 26), (0xffffffd, 28), (0x7ffffe3, 27),  # 216
    (0x7ffffe4, 27), (0x7ffffe5, 27), (0xfffec, 20), (0xfffff3, 24), (0xfffed, 20), (0x1fffe6, 21),  # 222
    (0x3fffe9, 22), (0x1fffe7, 21), (0x1fffe8, 21), (0x7ffff3, 23), (0x3fffea, 22), (0x3fffeb, 22),  # 228
    (0x1ffffee, 25), (0x1ffffef, 25), (0xfffff4, 24), (0xfffff5, 24), (0x3ffffea, 26), (0x7ffff4, 23),  # 234
    (0x3ffffeb, 26), (0x7ffffe6, 27), (0x3ffffec, 26), (0x3ffffed, 26), (0x7ffffe7, 27), (0x7ffffe8, 27),  # 240
    (0x7ffffe9, 27), (0x7ffffea, 27), (0x7ffffeb, 27), (0xffffffe, 28), (0x7ffffec, 27), (0x7ffffed, 27),  # 246
    (0x7ffffee, 27), (0x7ffffef, 27), (0x7fffff0, 27), (0x3ffffee, 26), (0x3fffffff, 30),  # 252
)

_EOS = 256
_DEAD = 256  # the Huffman decoder's state after an error (EOS or a code that is not in the table): it stays there
_MAX_INT = 2**32  # integers at or above this are rejected
_HUFFMAN_CACHE_MAX = 1024
_HUFFMAN_CACHE_BYTES = 512  # longer strings are not cached
_BLOCK_CACHE_MAX = 64
_BLOCK_CACHE_BYTES = 1024  # longer blocks are not cached
_ENCODE_CACHE_MAX = 1024
_ENCODE_CACHE_VALUE = 256  # longer values are not cached


def _build_huffman() -> tuple[list[int], list[str], frozenset[int]]:
    """The byte-at-a-time decoder: states are the code tree's internal nodes (0 is the root, `_DEAD` the error).

    For the state at row offset `s << 8` and input byte `b`, `next[(s << 8) | b]` is the next state's row offset and
    `out[(s << 8) | b]` the symbols completed on the way (latin-1 text). The accepting final states are the nodes
    reached from the root by at most 7 one-bits: a string ends in EOS-prefix padding of 0..7 bits.
    """
    children: list[list[int | None]] = [[None, None]]  # internal nodes; a child >= 0 is a node, < 0 is ~symbol
    for symbol, (code, length) in enumerate(HUFFMAN_CODES):
        node = 0
        for shift in range(length - 1, 0, -1):
            bit = (code >> shift) & 1
            child = children[node][bit]
            if child is None:
                child = len(children)
                children.append([None, None])
                children[node][bit] = child
            assert child >= 0, "the Huffman code is not prefix-free"
            node = child
        assert children[node][code & 1] is None, "the Huffman code is not prefix-free"
        children[node][code & 1] = ~symbol
    assert len(children) == 256 and all(c is not None for pair in children for c in pair), "incomplete Huffman code"

    # Nibble transitions first (4 bits can complete at most one symbol), then bytes as two nibbles.
    nibble: list[list[tuple[int, str]]] = []
    for state in range(256):
        row = []
        for value in range(16):
            node, text = state, ""
            for shift in (3, 2, 1, 0):
                child = children[node][(value >> shift) & 1]
                assert child is not None
                if child >= 0:
                    node = child
                elif ~child == _EOS:
                    node = _DEAD
                    break
                else:
                    text += chr(~child)
                    node = 0
            row.append((node, text))
        nibble.append(row)
    nibble.append([(_DEAD, "")] * 16)

    # A dead step's text is never used: decoding fails there.
    nibble_next = [[node << 8 for node, _ in row] for row in nibble]
    nibble_text = [[text for _, text in row] for row in nibble]
    nxt: list[int] = []
    out: list[str] = []
    for state in range(257):
        for middle, text_high in nibble[state]:
            nxt += nibble_next[middle]
            out += map(text_high.__add__, nibble_text[middle]) if text_high else nibble_text[middle]

    accepting = {0}
    node = 0
    for _ in range(7):
        child = children[node][1]
        assert child is not None and child > 0
        node = child
        accepting.add(node << 8)
    return nxt, out, frozenset(accepting)


_HUFFMAN_NEXT, _HUFFMAN_OUT, _HUFFMAN_ACCEPTING = _build_huffman()
_HUFFMAN_CACHE: dict[bytes, str] = {}


def huffman_decode(raw: bytes) -> str:
    """Decode a Huffman-coded string (RFC 7541 5.2) to latin-1 text; results are cached by `raw`."""
    text = _HUFFMAN_CACHE.get(raw)
    if text is not None:
        return text
    nxt, out = _HUFFMAN_NEXT, _HUFFMAN_OUT
    parts: list[str] = []
    append = parts.append
    state = 0
    for byte in raw:
        index = state | byte
        append(out[index])
        state = nxt[index]
    if state not in _HUFFMAN_ACCEPTING:
        if state == _DEAD << 8:
            raise HpackError("Huffman-coded string holds EOS")
        raise HpackError("Huffman-coded string ends in padding that is not 0-7 one-bits")
    text = "".join(parts)
    if len(raw) <= _HUFFMAN_CACHE_BYTES:
        if len(_HUFFMAN_CACHE) >= _HUFFMAN_CACHE_MAX:
            _HUFFMAN_CACHE.clear()
        _HUFFMAN_CACHE[raw] = text
    return text


def _read_int(data: bytes, pos: int, value: int) -> tuple[int, int]:
    """The continuation bytes of an integer whose prefix was all ones (`value`); returns (integer, next pos)."""
    shift = 0
    n = len(data)
    while pos < n:
        byte = data[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            if value >= _MAX_INT:
                raise HpackError(f"integer {value} is too large")
            return value, pos
        shift += 7
        if shift > 28:
            raise HpackError("integer is too long")
    raise HpackError("header block ends inside an integer")


class Decoder:
    """Decodes the header blocks of one HTTP/2 connection (one direction), keeping its dynamic table."""

    __slots__ = ("max_allowed_table_size", "_max_size", "_size", "_table", "_blocks")

    def __init__(self, max_table_size: int = 4096) -> None:
        #: The SETTINGS_HEADER_TABLE_SIZE we advertised: a size update above it is an HpackError. Lower it only once
        #: the peer has acknowledged the setting: the next block must then start with a size update within it (4.2).
        self.max_allowed_table_size = max_table_size
        self._max_size = max_table_size
        self._size = 0
        # [placeholder for the invalid index 0, static entries 1..61, dynamic entries newest first from 62]
        self._table: list[tuple[str, str]] = [("", ""), *STATIC_TABLE]
        self._blocks: dict[bytes, tuple[tuple[str, str], ...]] = {}

    @property
    def dynamic_table(self) -> list[tuple[str, str]]:
        """The dynamic table's entries, newest first (index 62 first)."""
        return self._table[62:]

    @property
    def table_size(self) -> int:
        """The dynamic table's size by RFC 7541 4.1 (name and value bytes plus 32 per entry)."""
        return self._size

    @property
    def max_table_size(self) -> int:
        """The dynamic table's current maximum size (the last size update, or the initial size)."""
        return self._max_size

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The (name, value) fields of one complete header block, in order; raises HpackError if it does not decode."""
        if type(block) is not bytes:
            block = bytes(block)
        if self._max_size > self.max_allowed_table_size and (not block or block[0] & 0xE0 != 0x20):
            raise HpackError(f"no dynamic table size update to within the allowed {self.max_allowed_table_size}")
        cached = self._blocks.get(block)
        if cached is not None:
            return list(cached)
        table = self._table
        headers: list[tuple[str, str]] = []
        append = headers.append
        entries = len(table)  # kept up to date below
        n = len(block)
        pos = 0
        changed = False
        while pos < n:
            first = block[pos]
            pos += 1
            if first & 0x80:  # indexed field (6.1)
                index = first & 0x7F
                if index == 0x7F:
                    index, pos = _read_int(block, pos, 0x7F)
                if not 0 < index < entries:
                    raise HpackError(f"header index {index} is not in the table")
                append(table[index])
                continue
            if first & 0x40:  # literal with incremental indexing (6.2.1)
                index = first & 0x3F
                if index == 0x3F:
                    index, pos = _read_int(block, pos, 0x3F)
            elif first & 0x20:  # dynamic table size update (6.3)
                if headers:
                    raise HpackError("dynamic table size update after a header field")
                size = first & 0x1F
                if size == 0x1F:
                    size, pos = _read_int(block, pos, 0x1F)
                if size > self.max_allowed_table_size:
                    raise HpackError(f"dynamic table size {size} exceeds the allowed {self.max_allowed_table_size}")
                self._resize(size)
                entries = len(table)
                changed = True
                continue
            else:  # literal without indexing (0000) or never indexed (0001) (6.2.2, 6.2.3)
                index = first & 0x0F
                if index == 0x0F:
                    index, pos = _read_int(block, pos, 0x0F)
            if index:
                if index >= entries:
                    raise HpackError(f"header index {index} is not in the table")
                name = table[index][0]
            else:  # a literal name (5.2); it must be lowercase (RFC 9113 8.2.1)
                name, pos = _read_string(block, pos, n)
                if name.lower() != name:
                    raise HpackError(f"header name {name!r} is not lowercase")
            value, pos = _read_string(block, pos, n)
            field = (name, value)
            append(field)
            if first & 0x40:
                self._add(field)
                entries = len(table)
                changed = True
        if not changed and n <= _BLOCK_CACHE_BYTES:
            blocks = self._blocks
            if len(blocks) >= _BLOCK_CACHE_MAX:
                blocks.clear()
            blocks[block] = tuple(headers)
        return headers

    def _add(self, field: tuple[str, str]) -> None:
        """Insert at the front of the dynamic table, evicting the oldest entries to fit (4.4)."""
        self._blocks.clear()
        table = self._table
        size = len(field[0]) + len(field[1]) + 32
        if size > self._max_size:
            del table[62:]
            self._size = 0
            return
        self._size += size
        while self._size > self._max_size:
            name, value = table.pop()
            self._size -= len(name) + len(value) + 32
        table.insert(62, field)

    def _resize(self, max_size: int) -> None:
        """Apply a dynamic table size update, evicting the oldest entries to fit (4.3)."""
        self._blocks.clear()
        self._max_size = max_size
        table = self._table
        while self._size > max_size:
            name, value = table.pop()
            self._size -= len(name) + len(value) + 32


def _read_string(block: bytes, pos: int, n: int) -> tuple[str, int]:
    """A string literal (5.2) at `pos`, Huffman-coded or not, and the position after it."""
    if pos >= n:
        raise HpackError("header block ends before a string")
    length = block[pos]
    pos += 1
    huffman = length & 0x80
    length &= 0x7F
    if length == 0x7F:
        length, pos = _read_int(block, pos, 0x7F)
    end = pos + length
    if end > n:
        raise HpackError("header block ends inside a string")
    return (huffman_decode(block[pos:end]) if huffman else block[pos:end].decode("latin-1")), end


def _encode_int(value: int, prefix_bits: int, flags: int) -> bytes:
    """An integer with an N-bit prefix (5.1); `flags` are the first byte's bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((flags | value,))
    out = bytearray((flags | limit,))
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _encode_string(text: str) -> bytes:
    """A string literal without Huffman coding (5.2), latin-1 encoded."""
    raw = text.encode("latin-1")
    return _encode_int(len(raw), 7, 0) + raw


_STATIC_FIELD_INDEX: dict[tuple[str, str], int] = {}
_STATIC_NAME_INDEX: dict[str, int] = {}
for _index, _field in enumerate(STATIC_TABLE, 1):
    _STATIC_FIELD_INDEX.setdefault(_field, _index)
    _STATIC_NAME_INDEX.setdefault(_field[0], _index)
del _index, _field
_ENCODE_CACHE: dict[tuple[str, str], bytes] = {}


def _encode_field(name: str, value: str) -> bytes:
    """One field: the static index of the whole field, or a literal without indexing (static name index if any)."""
    index = _STATIC_FIELD_INDEX.get((name, value))
    if index is not None:
        return _encode_int(index, 7, 0x80)
    index = _STATIC_NAME_INDEX.get(name)
    if index is not None:
        return _encode_int(index, 4, 0) + _encode_string(value)
    return b"\x00" + _encode_string(name) + _encode_string(value)


class Encoder:
    """A stateless encoder: it never adds to the peer's dynamic table and never Huffman-codes.

    Names must already be lowercase and names and values latin-1 text.
    """

    __slots__ = ()

    def encode(self, headers: Iterable[tuple[str, str]]) -> bytes:
        """The header block of `headers`, in order."""
        cache = _ENCODE_CACHE
        parts = []
        for name, value in headers:
            field = cache.get((name, value))
            if field is None:
                field = _encode_field(name, value)
                if len(value) <= _ENCODE_CACHE_VALUE:
                    if len(cache) >= _ENCODE_CACHE_MAX:
                        cache.clear()
                    cache[(name, value)] = field
            parts.append(field)
        return b"".join(parts)
