"""Framing byte by byte, message shapes, the error table and the argument validators."""

from __future__ import annotations

import inspect
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvd.errors
from kvd import protocol
from kvd.errors import (
    ERROR_CLASSES, BadArgsError, KvdError, NoSpaceError, NotFoundError, ProtocolError,
    TooLargeError,
)
from kvd.protocol import (
    MAX_FRAME_NBYTES, FrameDecoder, FrameEncoder, arg_bool, arg_bytes, arg_bytes_list, arg_int,
    arg_int_list, arg_str, check_no_extra, encode_error, encode_frame, encode_request,
    encode_result, parse_reply, parse_request, unpack_body,
)

MESSAGES = [
    [0, "hello", {"protocol_version": 1}],
    [7, "alloc", {"num_blocks": 3}],
    [2**64 - 1, "seal", {"block_ids": [1, 2, 3], "hashes": [b"\x00" * 16, b"\xff" * 16]}],
    [3, True, {"nested": {"ids": list(range(300)), "text": "é" * 100}}],
    [4, False, ["NO_SPACE", "pool is full: release blocks or raise --num-blocks"]],
    [5, "lookup", {"hashes": [bytes(range(16))] * 1000}],
]
FRAMES = [encode_frame(message) for message in MESSAGES]
STREAM = b"".join(FRAMES)


def decode_all(chunks) -> list:
    decoder = FrameDecoder()
    bodies = [body for chunk in chunks for body in decoder.feed(chunk)]
    assert decoder.buffered_nbytes == 0
    return [unpack_body(body) for body in bodies]


# --- framing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: str(m[1]))
def test_each_message_whole_and_byte_by_byte(message):
    frame = encode_frame(message)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert decode_all([frame]) == [message]
    assert decode_all([frame[i:i + 1] for i in range(len(frame))]) == [message]
    assert decode_all([memoryview(frame)]) == [message]


@pytest.mark.parametrize("message", MESSAGES[:5], ids=lambda m: str(m[1]))
def test_each_message_split_at_every_offset(message):
    frame = encode_frame(message)
    for cut in range(len(frame) + 1):
        assert decode_all([frame[:cut], frame[cut:]]) == [message]


def test_many_frames_in_one_chunk_and_split_everywhere():
    assert decode_all([STREAM]) == MESSAGES
    for cut in range(0, len(STREAM), 7):
        assert decode_all([STREAM[:cut], STREAM[cut:]]) == MESSAGES


@pytest.mark.parametrize("num_trailing", [1, 3, 4, 5, 10])
def test_trailing_bytes_stay_buffered_until_completed(num_trailing):
    decoder = FrameDecoder()
    next_frame = FRAMES[1]
    bodies = decoder.feed(FRAMES[0] + next_frame[:num_trailing])
    assert [unpack_body(b) for b in bodies] == [MESSAGES[0]]
    assert decoder.buffered_nbytes == num_trailing
    bodies = decoder.feed(next_frame[num_trailing:])
    assert [unpack_body(b) for b in bodies] == [MESSAGES[1]]
    assert decoder.buffered_nbytes == 0


def test_zero_length_rejected_and_decoder_stays_failed():
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError, match="length 0"):
        decoder.feed(b"\0\0\0\0")
    with pytest.raises(ProtocolError):
        decoder.feed(FRAMES[0])


def test_huge_length_rejected_before_the_body_arrives():
    decoder = FrameDecoder()
    prefix = struct.pack(">I", MAX_FRAME_NBYTES + 1)
    assert decoder.feed(prefix[:3]) == []
    with pytest.raises(TooLargeError, match="split the batch"):
        decoder.feed(prefix[3:])  # only the 4 prefix bytes were sent, no body
    with pytest.raises(TooLargeError):
        decoder.feed(b"x")


def test_huge_length_after_a_good_frame_in_the_same_chunk():
    with pytest.raises(TooLargeError):
        FrameDecoder().feed(FRAMES[0] + b"\xff\xff\xff\xff")


def test_frame_exactly_at_the_cap_passes_and_one_byte_more_is_refused():
    overhead = len(msgpack.packb(b"\0" * 70_000, use_bin_type=True)) - 70_000  # bin32 header
    at_cap = encode_frame(b"\0" * (MAX_FRAME_NBYTES - overhead))
    assert len(at_cap) == 4 + MAX_FRAME_NBYTES
    decoder = FrameDecoder()
    bodies = [b for i in range(0, len(at_cap), 65536) for b in decoder.feed(at_cap[i:i + 65536])]
    assert len(bodies) == 1 and len(bodies[0]) == MAX_FRAME_NBYTES
    with pytest.raises(TooLargeError):
        encode_frame(b"\0" * (MAX_FRAME_NBYTES - overhead + 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=40))
def test_random_chunkings_give_the_same_frames(cuts):
    bounds = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in zip(bounds, bounds[1:])]
    assert decode_all(chunks) == MESSAGES


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.lists(st.integers(min_value=1, max_value=8), max_size=16))
def test_garbage_stream_raises_only_kvd_errors(data, chunk_nbytes):
    decoder = FrameDecoder()
    position = 0
    try:
        for step in [*chunk_nbytes, len(data)]:
            for body in decoder.feed(data[position:position + step]):
                unpack_body(body)
            position += step
    except (ProtocolError, TooLargeError):
        pass


# --- body decoding -------------------------------------------------------------------------------

GARBAGE_BODIES = {
    "reserved byte": b"\xc1",
    "truncated array": b"\x93\x01",
    "extra data": msgpack.packb(1) + msgpack.packb(2),
    "ext type": msgpack.packb(msgpack.ExtType(5, b"abc")),
    "empty ext": msgpack.packb(msgpack.ExtType(5, b"")),
    "timestamp": msgpack.packb(msgpack.Timestamp(1, 0)),
    "int map key": b"\x81\x01\x02",
    "deep nesting": b"\x91" * 100_000,
    "bad utf-8": b"\xa2\xff\xfe",
    "long string": msgpack.packb("x" * (protocol.MAX_STR_NBYTES + 1)),
    "big map": msgpack.packb({str(i): 0 for i in range(protocol.MAX_MAP_LEN + 1)}),
    "lying array header": b"\xdd\xff\xff\xff\xff",
}


@pytest.mark.parametrize("body", GARBAGE_BODIES.values(), ids=GARBAGE_BODIES.keys())
def test_garbage_bodies_raise_protocol_error(body):
    with pytest.raises(ProtocolError, match="undecodable"):
        unpack_body(body)


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=1, max_size=200))
def test_random_bodies_decode_or_raise_protocol_error(body):
    try:
        unpack_body(body)
    except ProtocolError:
        pass


# --- messages ------------------------------------------------------------------------------------

def test_request_round_trip():
    frame = encode_request(42, "lookup", {"hashes": [b"\1" * 16]})
    (body,) = FrameDecoder().feed(frame)
    request = parse_request(unpack_body(body))
    assert request == (42, "lookup", {"hashes": [b"\1" * 16]})


def test_result_round_trip():
    (body,) = FrameDecoder().feed(encode_result(9, {"block_ids": [1, 2]}))
    assert parse_reply(unpack_body(body)) == (9, {"block_ids": [1, 2]})


@pytest.mark.parametrize("cls", ERROR_CLASSES.values(), ids=ERROR_CLASSES.keys())
def test_error_round_trip_for_every_code(cls):
    (body,) = FrameDecoder().feed(encode_error(11, cls("do this instead")))
    with pytest.raises(cls, match="^do this instead$") as info:
        parse_reply(unpack_body(body))
    assert type(info.value) is cls
    assert info.value.request_id == 11


def test_error_reply_without_request_id():
    (body,) = FrameDecoder().feed(encode_error(None, ProtocolError("bad frame")))
    with pytest.raises(ProtocolError) as info:
        parse_reply(unpack_body(body))
    assert info.value.request_id is None


def test_unknown_error_code_maps_to_internal_error():
    with pytest.raises(kvd.errors.InternalError, match="WHATEVER"):
        parse_reply([1, False, ["WHATEVER", "msg"]])


def test_long_error_message_still_decodes():
    (body,) = FrameDecoder().feed(encode_error(1, NoSpaceError("é" * 100_000)))
    with pytest.raises(NoSpaceError):
        parse_reply(unpack_body(body))


def test_error_table_is_a_bijection_over_every_error_class():
    classes = list(ERROR_CLASSES.values())
    assert len(set(classes)) == len(classes)
    assert all(cls.code == code and code.isupper() for code, cls in ERROR_CLASSES.items())
    defined = {obj for _, obj in inspect.getmembers(kvd.errors, inspect.isclass)
               if issubclass(obj, KvdError) and obj is not KvdError}
    assert defined == set(classes)
    assert NotFoundError("x").code == "NOT_FOUND" and str(NotFoundError("x")) == "x"


BAD_REQUESTS = [
    ("not a list", {"op": "x"}, None),
    ("empty", [], None),
    ("too short", [1, "alloc"], 1),
    ("too long", [1, "alloc", {}, 4], 1),
    ("bool id", [True, "alloc", {}], None),
    ("negative id", [-1, "alloc", {}], None),
    ("huge id", [2**64, "alloc", {}], None),
    ("str id", ["1", "alloc", {}], None),
    ("int op", [1, 5, {}], 1),
    ("empty op", [1, "", {}], 1),
    ("long op", [1, "x" * 65, {}], 1),
    ("list args", [1, "alloc", []], 1),
    ("bytes key", [1, "alloc", {b"n": 1}], 1),
]


@pytest.mark.parametrize("obj,request_id", [(o, i) for _, o, i in BAD_REQUESTS],
                         ids=[name for name, _, _ in BAD_REQUESTS])
def test_bad_request_shapes(obj, request_id):
    with pytest.raises(ProtocolError) as info:
        parse_request(obj)
    assert info.value.request_id == request_id


@pytest.mark.parametrize("obj", [
    None, [1, True], [1, 1, {}], ["x", True, 1], [None, True, 1], [1, False, "NO_SPACE"],
    [1, False, ["NO_SPACE"]], [1, False, [1, "m"]], [1, False, ["NO_SPACE", b"m"]],
])
def test_bad_reply_shapes(obj):
    with pytest.raises(ProtocolError):
        parse_reply(obj)


# --- validators ----------------------------------------------------------------------------------

def test_arg_int():
    assert arg_int({"n": 5}, "n") == 5
    assert arg_int({}, "n", default=3) == 3
    assert arg_int({}, "n", default=None) is None
    assert arg_int({"n": 10}, "n", min_value=1, max_value=10) == 10
    for bad in (True, 1.0, "1", -1, None, 11):
        with pytest.raises(BadArgsError, match=r"n must be an int in \[0, 10\]"):
            arg_int({"n": bad}, "n", max_value=10)
    with pytest.raises(BadArgsError, match="missing argument 'n'"):
        arg_int({}, "n")


def test_arg_int_list():
    assert arg_int_list({"ids": [0, 1, 2**40]}, "ids", max_len=3) == [0, 1, 2**40]
    assert arg_int_list({"ids": []}, "ids", max_len=3) == []
    with pytest.raises(BadArgsError, match="at most 2 ints, got list of length 3"):
        arg_int_list({"ids": [1, 2, 3]}, "ids", max_len=2)
    for bad in ([1, True], [1, -1], [1, "2"], [1.0], [None]):
        with pytest.raises(BadArgsError, match="ids must hold only ints >= 0"):
            arg_int_list({"ids": bad}, "ids", max_len=10)
    with pytest.raises(BadArgsError, match=r"in \[0, 7\]"):
        arg_int_list({"ids": [8]}, "ids", max_len=10, max_value=7)
    with pytest.raises(BadArgsError):
        arg_int_list({"ids": (1, 2)}, "ids", max_len=10)
    with pytest.raises(BadArgsError, match="missing"):
        arg_int_list({}, "ids", max_len=10)


def test_arg_bytes_and_bytes_list():
    assert arg_bytes({"salt": b"ab"}, "salt", max_nbytes=2) == b"ab"
    assert arg_bytes({}, "salt", max_nbytes=2, default=b"") == b""
    for bad in (b"abc", "ab", bytearray(b"a"), 1):
        with pytest.raises(BadArgsError, match="salt must be binary of at most 2 bytes"):
            arg_bytes({"salt": bad}, "salt", max_nbytes=2)
    hashes = [b"\0" * 16, b"\1" * 16]
    assert arg_bytes_list({"h": hashes}, "h", max_len=2, max_item_nbytes=16) == hashes
    for bad in (b"", b"\0" * 17):
        with pytest.raises(BadArgsError, match="must be 1 to 16 bytes"):
            arg_bytes_list({"h": [b"\0" * 16, bad]}, "h", max_len=2, max_item_nbytes=16)
    with pytest.raises(BadArgsError, match="only binary strings"):
        arg_bytes_list({"h": [b"\0", "x"]}, "h", max_len=2, max_item_nbytes=16)
    with pytest.raises(BadArgsError, match="at most 1 binary"):
        arg_bytes_list({"h": hashes}, "h", max_len=1, max_item_nbytes=16)


def test_arg_str_and_bool():
    assert arg_str({"policy": "lru"}, "policy", max_len=8) == "lru"
    assert arg_str({}, "policy", max_len=8, default="lfu") == "lfu"
    with pytest.raises(BadArgsError, match="policy must be a string of at most 2"):
        arg_str({"policy": "lru"}, "policy", max_len=2)
    assert arg_bool({"x": False}, "x") is False
    assert arg_bool({}, "x", default=True) is True
    for bad in (0, 1, None, "true"):
        with pytest.raises(BadArgsError, match="x must be true or false"):
            arg_bool({"x": bad}, "x")


def test_check_no_extra():
    check_no_extra({"a": 1}, {"a", "b"})
    check_no_extra({}, ())
    with pytest.raises(BadArgsError, match=r"unknown arguments \['c'\]; valid: \['a', 'b'\]"):
        check_no_extra({"a": 1, "c": 2}, ("a", "b"))


def test_frame_encoder_matches_the_module_functions_and_keeps_the_cap():
    encoder = FrameEncoder()
    assert encoder.request(7, "alloc", {"num_blocks": 2}) == encode_request(
        7, "alloc", {"num_blocks": 2})
    assert encoder.result(7, [1, 2]) == encode_result(7, [1, 2])
    exc = BadArgsError("no")
    assert encoder.error(None, exc) == encode_error(None, exc)
    with pytest.raises(TooLargeError):
        encoder.result(7, b"\0" * MAX_FRAME_NBYTES)
    assert encoder.result(8, None) == encode_result(8, None)  # still usable after the failure


def test_a_deeply_nested_value_is_the_clients_error_not_an_internal_one():
    """Regression: msgpack nests 1024 deep, and repr() of such a value in an error message raised
    RecursionError: the daemon answered INTERNAL (the code for kvd's own bugs) with a traceback."""
    deep: list = []
    for _ in range(1000):
        deep = [deep]
    with pytest.raises(ProtocolError, match=r"request_id must be an int .*got \[\[\["):
        protocol.decode_request(msgpack.packb([deep, "alloc", {}]))
    with pytest.raises(ProtocolError, match="op must be"):
        protocol.decode_request(msgpack.packb([1, deep, {}]))
    for check in (lambda: protocol.arg_int({"n": deep}, "n"),
                  lambda: protocol.arg_int({"n": {"a": deep}}, "n"),
                  lambda: protocol.arg_bool({"b": deep}, "b")):
        with pytest.raises(BadArgsError) as refused:
            check()
        assert len(str(refused.value)) < 200
