"""HPACK (RFC 7541) codec: the RFC's Appendix C examples, malformed blocks, Huffman coding and encoder round-trips.

The Huffman *encoder* here is the test's own, built from the module's code table, so decoding is checked against an
independent path; the Appendix C vectors check the table itself.
"""

from __future__ import annotations

import random

import pytest

from server.frontends.grpc import hpack
from server.frontends.grpc.hpack import (
    HUFFMAN_CODES,
    STATIC_TABLE,
    Decoder,
    Encoder,
    HpackError,
    _encode_int,
    huffman_decode,
)


def huffman_encode(data: bytes) -> bytes:
    """RFC 7541 5.2: codes concatenated, padded to a whole byte with the most significant bits of EOS (ones)."""
    acc = 0
    bits = 0
    for byte in data:
        code, length = HUFFMAN_CODES[byte]
        acc = (acc << length) | code
        bits += length
    pad = -bits % 8
    acc = (acc << pad) | ((1 << pad) - 1)
    return acc.to_bytes((bits + pad) // 8, "big")


def encode_int(value: int, prefix_bits: int, flags: int = 0) -> bytes:
    """RFC 7541 5.1: an integer with an N-bit prefix, `flags` in the first byte's other bits."""
    return _encode_int(value, prefix_bits, flags)


def string_literal(data: bytes, huffman: bool = False) -> bytes:
    """RFC 7541 5.2: a string literal, optionally Huffman-coded."""
    raw = huffman_encode(data) if huffman else data
    return encode_int(len(raw), 7, 0x80 if huffman else 0) + raw


def h(text: str) -> bytes:
    """Hex as the RFC prints it (spaces and line breaks allowed)."""
    return bytes.fromhex("".join(text.split()))


# ---------------------------------------------------------------------------------------------------------- tables


def test_static_table_is_appendix_a() -> None:
    assert len(STATIC_TABLE) == 61
    assert STATIC_TABLE[0] == (":authority", "")
    assert STATIC_TABLE[7] == (":status", "200")
    assert STATIC_TABLE[15] == ("accept-encoding", "gzip, deflate")
    assert STATIC_TABLE[30] == ("content-type", "")
    assert STATIC_TABLE[57] == ("user-agent", "")
    assert STATIC_TABLE[60] == ("www-authenticate", "")
    assert Decoder().decode(bytes(0x80 | i for i in range(1, 62))) == list(STATIC_TABLE)


def test_huffman_code_is_a_complete_canonical_prefix_code() -> None:
    assert len(HUFFMAN_CODES) == 257
    assert sum(2 ** (30 - length) for _, length in HUFFMAN_CODES) == 2**30  # Kraft equality: complete
    # Canonical: codes counted up in (length, symbol) order, so the lengths alone determine them.
    code, previous = -1, 0
    for symbol in sorted(range(257), key=lambda s: (HUFFMAN_CODES[s][1], s)):
        length = HUFFMAN_CODES[symbol][1]
        code = (code + 1) << (length - previous)
        previous = length
        assert HUFFMAN_CODES[symbol][0] == code, symbol
    assert HUFFMAN_CODES[256] == (0x3FFFFFFF, 30)
    assert HUFFMAN_CODES[ord("a")] == (0x3, 5)
    assert HUFFMAN_CODES[ord("0")] == (0x0, 5)


# ---------------------------------------------------------------------------------------------------- Appendix C.2


def test_c2_1_literal_with_indexing() -> None:
    decoder = Decoder()
    block = h("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572")
    assert decoder.decode(block) == [("custom-key", "custom-header")]
    assert decoder.dynamic_table == [("custom-key", "custom-header")]
    assert decoder.table_size == 55


def test_c2_2_literal_without_indexing() -> None:
    decoder = Decoder()
    assert decoder.decode(h("040c 2f73 616d 706c 652f 7061 7468")) == [(":path", "/sample/path")]
    assert decoder.dynamic_table == []
    assert decoder.table_size == 0


def test_c2_3_literal_never_indexed() -> None:
    decoder = Decoder()
    assert decoder.decode(h("1008 7061 7373 776f 7264 0673 6563 7265 74")) == [("password", "secret")]
    assert decoder.dynamic_table == []
    assert decoder.table_size == 0


def test_c2_4_indexed() -> None:
    decoder = Decoder()
    assert decoder.decode(b"\x82") == [(":method", "GET")]
    assert decoder.dynamic_table == []


# ------------------------------------------------------------------------------------------------ Appendix C.3, C.4

REQUEST_1 = [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")]
REQUEST_2 = [*REQUEST_1, ("cache-control", "no-cache")]
REQUEST_3 = [
    (":method", "GET"),
    (":scheme", "https"),
    (":path", "/index.html"),
    (":authority", "www.example.com"),
    ("custom-key", "custom-value"),
]
TABLES_C3 = [
    ([(":authority", "www.example.com")], 57),
    ([("cache-control", "no-cache"), (":authority", "www.example.com")], 110),
    ([("custom-key", "custom-value"), ("cache-control", "no-cache"), (":authority", "www.example.com")], 164),
]
C3_BLOCKS = [
    "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
    "8286 84be 5808 6e6f 2d63 6163 6865",
    "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
]
C4_BLOCKS = [
    "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
    "8286 84be 5886 a8eb 1064 9cbf",
    "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
]


@pytest.mark.parametrize("blocks", [C3_BLOCKS, C4_BLOCKS], ids=["c3-plain", "c4-huffman"])
def test_c3_c4_requests_share_the_dynamic_table(blocks: list[str]) -> None:
    decoder = Decoder()
    for block, expected, (table, size) in zip(blocks, [REQUEST_1, REQUEST_2, REQUEST_3], TABLES_C3, strict=True):
        assert decoder.decode(h(block)) == expected
        assert decoder.dynamic_table == table
        assert decoder.table_size == size


# ------------------------------------------------------------------------------------------------ Appendix C.5, C.6

DATE_21 = "Mon, 21 Oct 2013 20:13:21 GMT"
DATE_22 = "Mon, 21 Oct 2013 20:13:22 GMT"
LOCATION = "https://www.example.com"
COOKIE = "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
RESPONSES = [
    [(":status", "302"), ("cache-control", "private"), ("date", DATE_21), ("location", LOCATION)],
    [(":status", "307"), ("cache-control", "private"), ("date", DATE_21), ("location", LOCATION)],
    [
        (":status", "200"),
        ("cache-control", "private"),
        ("date", DATE_22),
        ("location", LOCATION),
        ("content-encoding", "gzip"),
        ("set-cookie", COOKIE),
    ],
]
TABLES_C5 = [
    ([("location", LOCATION), ("date", DATE_21), ("cache-control", "private"), (":status", "302")], 222),
    ([(":status", "307"), ("location", LOCATION), ("date", DATE_21), ("cache-control", "private")], 222),
    ([("set-cookie", COOKIE), ("content-encoding", "gzip"), ("date", DATE_22)], 215),
]
C5_BLOCKS = [
    """4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133
       2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 6c65 2e63 6f6d""",
    "4803 3330 37c1 c0bf",
    """88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d
       54c0 5a04 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049
       5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e 3d31""",
]
C6_BLOCKS = [
    """4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6
       2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3""",
    "4883 640e ffc1 c0bf",
    """88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab
       77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f
       9587 3160 65c0 03ed 4ee5 b106 3d50 07""",
]


@pytest.mark.parametrize("blocks", [C5_BLOCKS, C6_BLOCKS], ids=["c5-plain", "c6-huffman"])
def test_c5_c6_responses_evict_from_a_256_byte_table(blocks: list[str]) -> None:
    decoder = Decoder(max_table_size=256)
    for block, expected, (table, size) in zip(blocks, RESPONSES, TABLES_C5, strict=True):
        assert decoder.decode(h(block)) == expected
        assert decoder.dynamic_table == table
        assert decoder.table_size == size


def test_huffman_strings_of_appendix_c() -> None:
    assert huffman_decode(h("f1e3 c2e5 f23a 6ba0 ab90 f4ff")) == "www.example.com"
    assert huffman_decode(h("a8eb 1064 9cbf")) == "no-cache"
    assert huffman_encode(b"www.example.com") == h("f1e3 c2e5 f23a 6ba0 ab90 f4ff")
    assert huffman_encode(COOKIE.encode()) == h(
        "94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 65c0 03ed 4ee5 b106 3d50 07"
    )


# ----------------------------------------------------------------------------------------------------------- Huffman


def test_huffman_round_trips_every_byte_value() -> None:
    every = bytes(range(256))
    assert huffman_decode(huffman_encode(every)) == every.decode("latin-1")
    for byte in range(256):
        single = bytes((byte,))
        assert huffman_decode(huffman_encode(single)) == single.decode("latin-1"), byte
        assert huffman_decode(huffman_encode(single * 3 + b"a")) == (single * 3 + b"a").decode("latin-1"), byte
    assert huffman_decode(b"") == ""


def test_huffman_field_values_decode_as_latin_1() -> None:
    value = bytes(range(0x80, 0x100)) * 2
    literal = string_literal(value, huffman=True)
    assert literal[0] == 0xFF and len(literal) > 3 + 256  # a Huffman string with a multi-byte length
    block = b"\x00" + string_literal(b"x-bin", huffman=True) + literal
    assert Decoder().decode(block) == [("x-bin", value.decode("latin-1"))]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xff\xff\xff\xfc", "EOS"),  # EOS (30 ones) and two bits of padding
        (huffman_encode(b"ab") + b"\xff", "padding"),  # padding of 8 or more bits
        (b"\x1e", "padding"),  # 'a' (00011) then padding 110: not all ones
        (b"\x00", "padding"),  # '0' (00000) then padding 000
        (b"\xfe", "padding"),  # 11111110: the start of a 10-bit code, cut short
        (huffman_encode(b"ab")[:-1], "padding"),  # 'a' then 3 bits of 'b' (100011)
    ],
)
def test_huffman_rejects_eos_and_bad_padding(raw: bytes, message: str) -> None:
    with pytest.raises(HpackError, match=message):
        huffman_decode(raw)


def test_huffman_padding_of_zero_to_seven_ones_is_accepted() -> None:
    assert huffman_decode(b"\x07") == "0"  # 00000 then 111
    assert huffman_decode(b"\x1f") == "a"  # 00011 then 111
    assert huffman_decode(b"\x00\x00\x00\x7f") == "00000"  # 25 bits, then 7 ones
    assert huffman_decode(b"\x00\x00\x00\x00\x00") == "00000000"  # 40 bits: no padding
    assert huffman_decode(b"\xf8") == "&"  # an 8-bit code: no padding


def test_huffman_errors_are_not_cached() -> None:
    raw = b"\x1e"
    for _ in range(2):
        with pytest.raises(HpackError):
            huffman_decode(raw)
    assert raw not in hpack._HUFFMAN_CACHE


# ------------------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (b"\xff", "ends inside an integer"),  # index 127 + continuation bytes that never come
        (b"\xff\x80", "ends inside an integer"),
        (b"\xff\xff\xff\xff\xff\xff\x01", "too long"),  # more continuation bytes than any 32-bit integer needs
        (b"\xff\xff\xff\xff\xff\x1f", "too large"),  # 127 + 2**33 - 1
        (b"\x80", "index 0"),
        (b"\xbe", "index 62"),  # no dynamic entries yet
        (b"\xff\x80\x01", "index 255"),
        (b"\x7f\x80\x01\x00", "index 191"),  # literal with indexing, name index beyond the tables
        (b"\x0f\x80\x01\x00", "index 143"),  # literal without indexing, name index beyond the tables
        (b"\x04\x0c/sample", "ends inside a string"),
        (b"\x04", "ends before a string"),
        (b"\x00\x03ab", "ends inside a string"),
        (b"\x00\x01a", "ends before a string"),
        (b"\x40\x7f", "ends inside an integer"),  # a string length whose continuation never comes
        (b"\x00\x81\x1e\x00", "padding"),  # a Huffman name with bad padding
        (b"\x04\x84\xff\xff\xff\xff", "EOS"),  # a Huffman value holding EOS
        (b"\x00\x06Custom\x01x", "not lowercase"),
        (b"\x40\x06cUSTOM\x01x", "not lowercase"),
        (b"\x00" + string_literal(b"Custom", huffman=True) + b"\x01x", "not lowercase"),
        (b"\x3f\xe2\x1f", "exceeds the allowed 4096"),  # size update to 4097
        (b"\x82\x20", "after a header field"),
        (b"\x82\x3f\xe1\x1f", "after a header field"),
    ],
)
def test_malformed_blocks_raise(block: bytes, message: str) -> None:
    with pytest.raises(HpackError, match=message):
        Decoder().decode(block)


def test_integer_at_the_limit_decodes_and_beyond_is_rejected() -> None:
    decoder = Decoder()
    # A string length of 2**32 - 1 (127 + continuation bytes) decodes as an integer, then the block is too short.
    value = 2**32 - 1 - 127
    cont = bytearray()
    while value >= 0x80:
        cont.append((value & 0x7F) | 0x80)
        value >>= 7
    cont.append(value)
    with pytest.raises(HpackError, match="ends inside a string"):
        decoder.decode(b"\x00\x7f" + bytes(cont))
    cont[-1] += 1  # 2**32
    with pytest.raises(HpackError, match="too large"):
        decoder.decode(b"\x00\x7f" + bytes(cont))


# ------------------------------------------------------------------------------------------------ dynamic table size


def test_size_updates_at_block_start_evict_and_are_bounded() -> None:
    decoder = Decoder(max_table_size=4096)
    assert decoder.max_allowed_table_size == 4096
    decoder.decode(h(C3_BLOCKS[0]))
    decoder.decode(h(C3_BLOCKS[1]))
    assert decoder.table_size == 110
    # Two updates in a row at the start are allowed: 60 (keeps only the newest, 53 bytes), then 4096.
    assert decoder.decode(b"\x3f\x1d\x3f\xe1\x1f\xbe") == [("cache-control", "no-cache")]
    assert decoder.dynamic_table == [("cache-control", "no-cache")]
    assert decoder.table_size == 53
    assert decoder.max_table_size == 4096
    # Size 0 empties the table; then index 62 is out of range.
    assert decoder.decode(b"\x20") == []
    assert decoder.dynamic_table == [] and decoder.table_size == 0 and decoder.max_table_size == 0
    with pytest.raises(HpackError, match="index 62"):
        decoder.decode(b"\xbe")
    # With a maximum of 0 an entry is decoded but not kept.
    assert decoder.decode(b"\x41\x03abc") == [(":authority", "abc")]
    assert decoder.dynamic_table == []


def test_size_update_respects_a_changed_allowed_maximum() -> None:
    decoder = Decoder(max_table_size=256)
    with pytest.raises(HpackError, match="exceeds the allowed 256"):
        decoder.decode(b"\x3f\xe2\x01")  # 257
    assert decoder.decode(b"\x3f\xe1\x01") == []  # exactly 256
    decoder.max_allowed_table_size = 1024
    assert decoder.decode(b"\x3f\xe1\x07") == []  # 1024
    assert decoder.max_table_size == 1024


def test_a_lowered_allowed_maximum_requires_a_size_update() -> None:
    decoder = Decoder()
    decoder.decode(h(C3_BLOCKS[0]))
    decoder.decode(b"\xbe")  # now in the block cache
    decoder.max_allowed_table_size = 100
    for block in (b"\xbe", b"\x82", b""):
        with pytest.raises(HpackError, match="no dynamic table size update"):
            decoder.decode(block)
    with pytest.raises(HpackError, match="exceeds the allowed 100"):
        decoder.decode(b"\x3f\x46")  # 101
    assert decoder.decode(b"\x3f\x45\xbe") == [(":authority", "www.example.com")]  # 100: the entry (57) stays
    assert decoder.max_table_size == 100
    assert decoder.decode(b"\xbe") == [(":authority", "www.example.com")]  # no update needed any more


def test_huffman_cache_is_bounded() -> None:
    long_raw = huffman_encode(b"x" * 1000)
    assert huffman_decode(long_raw) == "x" * 1000
    assert long_raw not in hpack._HUFFMAN_CACHE
    for i in range(hpack._HUFFMAN_CACHE_MAX + 10):
        assert huffman_decode(huffman_encode(str(i).encode())) == str(i)
    assert 0 < len(hpack._HUFFMAN_CACHE) <= hpack._HUFFMAN_CACHE_MAX


def test_entry_larger_than_the_table_empties_it() -> None:
    decoder = Decoder(max_table_size=64)
    assert decoder.decode(b"\x41\x03abc") == [(":authority", "abc")]  # 10 + 3 + 32 = 45
    assert decoder.table_size == 45
    big = "x" * 40
    assert decoder.decode(b"\x41\x28" + big.encode()) == [(":authority", big)]  # 82 > 64
    assert decoder.dynamic_table == [] and decoder.table_size == 0


def test_new_entry_may_name_the_entry_it_evicts() -> None:
    decoder = Decoder(max_table_size=50)
    decoder.decode(b"\x40\x03abc\x03def")  # 38 bytes
    assert decoder.decode(b"\x7e\x03ghi") == [("abc", "ghi")]  # name from index 62, which this insert evicts
    assert decoder.dynamic_table == [("abc", "ghi")]
    assert decoder.table_size == 38


def test_eviction_keeps_entries_that_fit_exactly() -> None:
    decoder = Decoder(max_table_size=76)
    decoder.decode(b"\x40\x01a\x04aaaa\x40\x01b\x04bbbb")  # 37 + 37 = 74
    assert decoder.table_size == 74
    decoder.decode(b"\x40\x01c\x06cccccc")  # 39: 'a' goes, 76 left exactly
    assert decoder.dynamic_table == [("c", "cccccc"), ("b", "bbbb")]
    assert decoder.table_size == 76
    assert decoder.decode(b"\xbe\xbf") == [("c", "cccccc"), ("b", "bbbb")]


# ------------------------------------------------------------------------------------------------------ block cache


def test_cached_blocks_follow_dynamic_table_changes() -> None:
    decoder = Decoder()
    decoder.decode(b"\x40\x01a\x011")
    first = decoder.decode(b"\xbe\x82")
    assert first == [("a", "1"), (":method", "GET")]
    first.append(("mutated", "by caller"))
    assert decoder.decode(b"\xbe\x82") == [("a", "1"), (":method", "GET")]  # a fresh list each time
    decoder.decode(b"\x40\x01b\x012")  # index 62 is now ("b", "2")
    assert decoder.decode(b"\xbe\x82") == [("b", "2"), (":method", "GET")]
    assert decoder.decode(b"\x3f\x1a") == []  # size 57: only ("b", "2") (34 bytes) stays
    assert decoder.decode(b"\xbe") == [("b", "2")]
    with pytest.raises(HpackError, match="index 63"):
        decoder.decode(b"\xbf")


def test_blocks_that_change_the_table_are_not_replayed() -> None:
    decoder = Decoder()
    block = b"\x40\x01a\x011"
    for count in range(1, 4):
        assert decoder.decode(block) == [("a", "1")]
        assert decoder.dynamic_table == [("a", "1")] * count
        assert decoder.table_size == 34 * count


def test_block_cache_is_bounded() -> None:
    decoder = Decoder()
    for i in range(hpack._BLOCK_CACHE_MAX + 5):
        assert decoder.decode(b"\x04" + string_literal(str(i).encode())) == [(":path", str(i))]
    assert 0 < len(decoder._blocks) <= hpack._BLOCK_CACHE_MAX


def test_random_and_corrupted_blocks_raise_only_hpack_error() -> None:
    rng = random.Random(7541)
    valid = [h(block) for block in C3_BLOCKS + C4_BLOCKS + C5_BLOCKS + C6_BLOCKS] + [GRPC_FIRST, GRPC_SECOND]
    outcomes = {"decoded": 0, "rejected": 0}
    for trial in range(3000):
        if trial % 2:
            block = rng.randbytes(rng.randrange(1, 40))
        else:
            corrupt = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                corrupt[rng.randrange(len(corrupt))] = rng.randrange(256)
            block = bytes(corrupt[: rng.randrange(1, len(corrupt) + 1)])
        decoder = Decoder(max_table_size=rng.choice([0, 256, 4096]))
        try:
            headers = decoder.decode(block)
        except HpackError:
            outcomes["rejected"] += 1
        else:
            outcomes["decoded"] += 1
            assert all(type(name) is str and type(value) is str for name, value in headers)
            assert decoder.table_size <= decoder.max_table_size
    assert outcomes["decoded"] > 100 and outcomes["rejected"] > 100


def test_bytearray_and_memoryview_blocks_decode() -> None:
    block = h(C4_BLOCKS[0])
    assert Decoder().decode(bytearray(block)) == REQUEST_1
    assert Decoder().decode(memoryview(block)) == REQUEST_1


# ---------------------------------------------------------------------------------------------------- gRPC traffic

# Captured from grpcio 1.85.3 (C-core) calling /inference.GRPCInferenceService/ModelInfer: the first request (all
# literals with incremental indexing, no Huffman), a second with a new grpc-timeout, a third without a timeout.
GRPC_FIRST = h(
    "40053a706174682a2f696e666572656e63652e47525043496e666572656e6365536572766963652f4d6f64656c496e666572400a3a61"
    "7574686f726974790f6c6f63616c686f73743a33333632338386400c636f6e74656e742d74797065106170706c69636174696f6e2f67"
    "7270634002746508747261696c6572734014677270632d6163636570742d656e636f64696e67176964656e746974792c206465666c61"
    "74652c20677a6970400c677270632d74696d656f757403333053400a757365722d6167656e7430677270632d707974686f6e2f312e38"
    "352e3320677270632d632f35382e302e3020286c696e75783b2063687474703229"
)
GRPC_SECOND = h("c4c38386c2c1c0400c677270632d74696d656f75740633303130306dbf")
GRPC_THIRD = h("c5c48386c3c2c1bf")
GRPC_COMMON = [
    (":path", "/inference.GRPCInferenceService/ModelInfer"),
    (":authority", "localhost:33623"),
    (":method", "POST"),
    (":scheme", "http"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
    ("grpc-accept-encoding", "identity, deflate, gzip"),
]
USER_AGENT = ("user-agent", "grpc-python/1.85.3 grpc-c/58.0.0 (linux; chttp2)")


def test_grpc_c_core_request_blocks() -> None:
    decoder = Decoder()
    assert decoder.decode(GRPC_FIRST) == [*GRPC_COMMON, ("grpc-timeout", "30S"), USER_AGENT]
    assert len(decoder.dynamic_table) == 7  # all but :method and :scheme, which are static
    assert decoder.decode(GRPC_SECOND) == [*GRPC_COMMON, ("grpc-timeout", "30100m"), USER_AGENT]
    assert decoder.decode(GRPC_THIRD) == [*GRPC_COMMON, USER_AGENT]
    assert decoder.decode(GRPC_THIRD) == [*GRPC_COMMON, USER_AGENT]  # again, from the block cache


def test_grpc_request_with_huffman_literals() -> None:
    fields = [*GRPC_COMMON, ("grpc-timeout", "30S"), USER_AGENT]
    block = bytearray()
    for name, value in fields:
        block += b"\x40" + string_literal(name.encode(), huffman=True) + string_literal(value.encode(), huffman=True)
    decoder = Decoder()
    assert decoder.decode(bytes(block)) == fields
    assert decoder.dynamic_table == fields[::-1]


# ----------------------------------------------------------------------------------------------------------- encoder


def test_encoder_uses_static_indexes() -> None:
    encoder = Encoder()
    assert encoder.encode([(":status", "200")]) == b"\x88"
    assert encoder.encode([(":method", "POST")]) == b"\x83"
    # content-type is static index 31: a 4-bit prefix of 15 and a continuation of 16.
    assert encoder.encode([("content-type", "application/grpc")]) == b"\x0f\x10\x10application/grpc"
    assert encoder.encode([(":status", "201")]) == b"\x08\x03201"
    assert encoder.encode([("grpc-status", "0")]) == b"\x00\x0bgrpc-status\x010"
    assert encoder.encode([]) == b""


@pytest.mark.parametrize(
    "headers",
    [
        [(":status", "200"), ("content-type", "application/grpc")],
        [("grpc-status", "0"), ("grpc-message", "")],
        [(":authority", ""), ("x-empty", ""), ("", "")],
        [("grpc-message", "x" * 127), ("long-" + "n" * 200, "v" * 5000), ("user-agent", "y" * 126)],
        [("x-bytes", bytes(range(32, 256)).decode("latin-1"))],
        [(name, value) for name, value in STATIC_TABLE],
        [(name, value + "!") for name, value in STATIC_TABLE],
    ],
)
def test_encoder_round_trips_through_the_decoder(headers: list[tuple[str, str]]) -> None:
    decoder = Decoder()
    encoder = Encoder()
    block = encoder.encode(headers)
    assert decoder.decode(block) == headers
    assert decoder.dynamic_table == []  # the encoder never indexes
    assert encoder.encode(iter(headers)) == block  # the same again, from the field cache
    assert decoder.decode(block) == headers
