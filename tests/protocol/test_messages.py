"""kvd/protocol/messages.py: bodies unpacked under the limits, message shapes, the error table,
errors on the wire with their request ids, and the encoder's frames."""

from __future__ import annotations

import inspect

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
    MAX_FRAME_NBYTES, FrameDecoder, FrameEncoder, encode_error, encode_request, encode_result,
    parse_reply, parse_request, unpack_body,
)


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
