"""The protocol's fast codec (msgspec's typed msgpack, kvd/protocol/messages.py) against the
specification it shortcuts (unpack_body + parse_request / parse_reply, and msgpack's Packer).

The contract is one-sided: whatever the fast path decodes equals what the specification decodes
from the same body, and where it declines the specification runs instead (and raises the exact
error); whatever it encodes is the Packer's bytes. So every test here checks both halves:
agreement whenever it answers, and that it does answer for the shapes that make up kvd's traffic
(a fast path that always declined would be correct and useless).
"""

from __future__ import annotations

import datetime
import os
import struct
import subprocess
import sys
from typing import Any

import msgpack
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvd import native, protocol
from kvd.errors import KvdError, ProtocolError
from kvd.protocol import (
    MAX_ARRAY_LEN, MAX_FRAME_NBYTES, MAX_MAP_LEN, MAX_OP_NBYTES, MAX_STR_NBYTES, FrameDecoder,
    FrameEncoder, parse_reply, parse_request, unpack_body,
)
from kvd.protocol import messages

_msgspec = native.built("msgspec")  # (tests call it directly: KVD_PURE_PYTHON only turns its use off)
fast = None if _msgspec is None else messages._Msgspec(_msgspec)
needs_fast = pytest.mark.skipif(fast is None, reason="msgspec is not installed here: only the "
                                "specification runs")
# For the tests of kvd's use of it (FrameDecoder.requests, use_c).
in_use = pytest.mark.skipif(os.environ.get("KVD_PURE_PYTHON") == "1",
                            reason="KVD_PURE_PYTHON=1: kvd does not use msgspec")


def test_msgspec_is_installed_where_ci_requires_it() -> None:
    """.ci/run sets KVD_REQUIRE_C=1: an install that silently fell back to Python fails there."""
    if fast is None and os.environ.get("KVD_REQUIRE_C") != "1":
        pytest.skip("msgspec is not installed here and KVD_REQUIRE_C is not set")
    assert fast is not None, "KVD_REQUIRE_C=1 but msgspec is not installed (a dependency)"
    if os.environ.get("KVD_PURE_PYTHON") != "1":
        assert protocol.codec() == "msgspec"  # and kvd uses it


def same(a: Any, b: Any) -> bool:
    """Equal with equal types all the way down (True == 1 and (1,) == [1] are not enough)."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[key], b[key]) for key in a)
    return a == b


def frame_of(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def python_request(body: bytes) -> Any:
    try:
        return parse_request(unpack_body(body))
    except KvdError:
        return None


def python_reply(body: bytes) -> Any:
    try:
        return parse_reply(unpack_body(body))
    except KvdError:
        return None


def python_frame(obj: Any) -> bytes | None:
    try:
        return FrameEncoder()._pack(obj)
    except Exception:
        return None


def fast_request(body: Any) -> Any:
    """The fast path's request, or None where it declines."""
    try:
        return fast.request(body)
    except Exception:
        return None


def fast_reply(body: Any) -> Any:
    """The fast path's success reply, or None where it declines."""
    try:
        request_id, is_ok, result = fast.reply(body)
    except Exception:
        return None
    return (request_id, result) if is_ok else None


def fast_frame(obj: Any) -> bytes | None:
    """The fast path's frame, or None where it declines."""
    try:
        body = fast.encode(obj)
    except Exception:
        return None
    return frame_of(body) if len(body) <= MAX_FRAME_NBYTES else None


# What kvd's traffic is made of: the values the fast path decodes (a request's arguments hold no
# str, a reply's no bytes; one level of nesting), and the objects it encodes.
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
floats = st.floats(allow_nan=False)  # (NaN != NaN)


def one_level(scalars: Any) -> Any:
    return (scalars | st.lists(scalars, max_size=20)
            | st.dictionaries(st.text(max_size=10), scalars, max_size=8))


argument_values = one_level(st.none() | st.booleans() | ints | floats | st.binary(max_size=40))
reply_values = one_level(st.none() | st.booleans() | ints | floats | st.text(max_size=40))
supported = st.recursive(
    st.none() | st.booleans() | ints | st.text(max_size=40) | st.binary(max_size=40),
    lambda children: (st.lists(children, max_size=20)
                      | st.dictionaries(st.text(max_size=10), children, max_size=8)),
    max_leaves=40)
# And what it is not: ints msgpack cannot carry, bytes map keys, tuples (packed as arrays,
# decoded as lists).
anything = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**65)
    | floats | st.text(max_size=40) | st.binary(max_size=40),
    lambda children: (st.lists(children, max_size=20) | st.tuples(children, children)
                      | st.dictionaries(st.text(max_size=10) | st.binary(max_size=10), children,
                                        max_size=8)),
    max_leaves=40)
request_ids = st.integers(min_value=0, max_value=2**64 - 1)
ops = st.text(min_size=1, max_size=MAX_OP_NBYTES)


@needs_fast
@settings(max_examples=150, deadline=None)
@given(request_ids, ops, st.dictionaries(st.text(max_size=10), argument_values, max_size=8))
def test_requests_of_the_traffics_types_decode_fast_as_in_python(
        request_id: int, op: str, args: dict[str, Any]) -> None:
    body = msgpack.packb([request_id, op, args], use_bin_type=True)
    assert same(fast_request(body), python_request(body))  # never None: it answered
    assert same(protocol.decode_request(body), python_request(body))


@needs_fast
@settings(max_examples=150, deadline=None)
@given(request_ids, ops, st.dictionaries(st.text(max_size=10), supported, max_size=8))
def test_requests_of_any_supported_types_decode_fast_as_in_python_or_not_at_all(
        request_id: int, op: str, args: dict[str, Any]) -> None:
    body = msgpack.packb([request_id, op, args], use_bin_type=True)
    answer = fast_request(body)
    assert answer is None or same(answer, python_request(body))
    assert same(protocol.decode_request(body), python_request(body))


@needs_fast
@settings(max_examples=150, deadline=None)
@given(st.one_of(anything, st.tuples(anything, anything, anything)))
def test_any_body_decodes_fast_as_in_python_or_not_at_all(obj: Any) -> None:
    body = python_frame(obj)
    assume(body is not None)  # ints msgpack cannot carry
    for decode, slow in ((fast_request, python_request), (fast_reply, python_reply)):
        answer = decode(body)
        assert answer is None or same(answer, slow(body))


@needs_fast
@settings(max_examples=250, deadline=None)
@given(request_ids, ops, st.dictionaries(st.text(max_size=10), supported, max_size=4),
       st.lists(st.tuples(st.integers(min_value=0, max_value=10**6),
                          st.integers(min_value=0, max_value=255),
                          st.sampled_from(["flip", "insert", "delete", "truncate"])),
                min_size=1, max_size=4))
def test_mutated_bodies_decode_fast_as_in_python_or_not_at_all(
        request_id: int, op: str, args: dict[str, Any], edits: list) -> None:
    body = bytearray(msgpack.packb([request_id, op, args], use_bin_type=True))
    for position, value, kind in edits:
        position %= len(body) + 1
        if kind == "flip" and position < len(body):
            body[position] = value
        elif kind == "insert":
            body[position:position] = bytes([value])
        elif kind == "delete":
            del body[position:position + 1]
        elif kind == "truncate":
            del body[position:]
    body = bytes(body)
    for decode, slow in ((fast_request, python_request), (fast_reply, python_reply)):
        answer = decode(body)
        assert answer is None or same(answer, slow(body))


@needs_fast
@settings(max_examples=150, deadline=None)
@given(request_ids, reply_values)
def test_success_replies_decode_fast_and_error_replies_are_left_to_python(
        request_id: int, result: Any) -> None:
    body = msgpack.packb([request_id, True, result], use_bin_type=True)
    assert same(fast_reply(body), python_reply(body))  # never None: it answered
    assert same(protocol.decode_reply(body), python_reply(body))
    error = msgpack.packb([request_id, False, ["NO_SPACE", "full"]], use_bin_type=True)
    assert fast_reply(error) is None
    with pytest.raises(KvdError, match="full"):
        protocol.decode_reply(error)


def header(tag: int, fmt: str, length: int) -> bytes:
    return bytes([tag]) + struct.pack(fmt, length)


@needs_fast
@pytest.mark.parametrize("body", [
    b"",  # nothing
    msgpack.packb([1, "alloc", {}]) + b"\x00",  # trailing bytes
    msgpack.packb([1, "alloc", {"num_blocks": 1}])[:-1],  # truncated
    msgpack.packb([-1, "alloc", {}]),  # negative id
    msgpack.packb([1, "", {}]),  # empty op
    msgpack.packb([1, "x" * (MAX_OP_NBYTES + 1), {}]),  # op too long
    msgpack.packb([1, 2, {}]),  # op not a str
    msgpack.packb([1, "alloc", []]),  # args not a map
    msgpack.packb([1, "alloc"]),  # two items
    msgpack.packb([1, "alloc", {b"num_blocks": 1}], use_bin_type=True),  # a bytes key
    msgpack.packb([1, "alloc", {"x": {1: 2}}]),  # an int key
    msgpack.packb([True, "alloc", {}]),  # a bool for the id
    msgpack.packb([1, "alloc", {"x": msgpack.ExtType(1, b"")}]),  # ext
    msgpack.packb([1, "alloc", {"x": [msgpack.ExtType(1, b"")]}]),  # ext in a list
    msgpack.packb([1, "alloc", {"x": datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)}],
                  datetime=True),  # a timestamp (ext -1)
    b"\x93\x01\xa5alloc\x81\xa1x\xc1",  # 0xc1, never used
    b"\x93\x01\xa5alloc\x81\xa1x\xa2\xff\xfe",  # invalid UTF-8
    b"\x93\x01\xa5alloc\x81\xa1x" + header(0xdd, ">I", MAX_ARRAY_LEN + 1),  # long array
    b"\x93\x01\xa5alloc\x81\xa1x" + header(0xdd, ">I", 2**32 - 1) + b"\x00" * 8,  # claims 4G
    b"\x93\x01\xa5alloc" + header(0xdf, ">I", MAX_MAP_LEN + 1),  # large map
    b"\x93\x01\xa5alloc\x81\xa1x" + header(0xdf, ">I", MAX_MAP_LEN + 1)
    + b"".join(b"\xa1" + bytes([97 + i % 26]) + b"\x00" for i in range(MAX_MAP_LEN + 1)),
    b"\x93\x01\xa5alloc\x81\xa1x" + header(0xdb, ">I", MAX_STR_NBYTES + 1)
    + b"a" * (MAX_STR_NBYTES + 1),  # long str
    b"\x93\x01\xa5alloc\x81" + header(0xdb, ">I", MAX_STR_NBYTES + 1)
    + b"a" * (MAX_STR_NBYTES + 1) + b"\x01",  # long key
    b"\x93\x01\xa5alloc\x81\xa1x" + header(0xc6, ">I", 2**32 - 1),  # bin beyond the body
    msgpack.packb([1, "alloc", {"x": b"x" * (MAX_FRAME_NBYTES + 1)}]),  # (only above the cap)
], ids=lambda body: body[:24].hex())
def test_invalid_bodies_are_left_to_python_which_raises(body: bytes) -> None:
    assert fast_request(body) is None
    assert python_request(body) is None
    with pytest.raises(ProtocolError):
        protocol.decode_request(body)


@needs_fast
@pytest.mark.parametrize("body", [
    msgpack.packb([1, "alloc", {"x": {b"y": 1}}], use_bin_type=True),  # a bytes key below
    msgpack.packb([1, "alloc", {"x": "text"}]),  # a str argument
    msgpack.packb([1, "alloc", {"x": [[1]]}]),  # two levels
    msgpack.packb([1, "alloc", {"x": [[[[[[[[[[1]]]]]]]]]]}]),  # deep
    msgpack.packb([1, "alloc", {"x": "é" * (MAX_STR_NBYTES // 4 + 1)}]),  # long in characters
    msgpack.packb([1, "alloc", {"x": 1.5, "y": [1.5]}]),  # floats: the fast path decodes these
    msgpack.packb([1, "alloc", {"x": 1, "x ": 2}]),
    b"\x93\x01\xa5alloc\x82\xa1x\x01\xa1x\x02",  # a duplicate key: the last one wins
], ids=lambda body: body[:24].hex())
def test_valid_bodies_decode_fast_as_in_python_or_are_left_to_it(body: bytes) -> None:
    expected = python_request(body)
    assert expected is not None
    answer = fast_request(body)
    assert answer is None or same(answer, expected)
    assert same(protocol.decode_request(body), expected)


@needs_fast
@pytest.mark.parametrize("result", [[1.5], {"a": {"b": 1}}, [b"x"], {b"k": 2}, [[1]]])
def test_uncommon_replies_decode_as_in_python(result: Any) -> None:
    body = msgpack.packb([3, True, result], use_bin_type=True)
    answer = fast_reply(body)
    assert answer is None or same(answer, python_reply(body))
    assert same(protocol.decode_reply(body), python_reply(body))


@needs_fast
@in_use
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(request_ids, ops, st.dictionaries(st.text(max_size=8), argument_values,
                                                              max_size=3)),
                min_size=1, max_size=5))
def test_chunks_of_whole_frames_decode_fast_and_others_go_to_the_decoder(requests: list) -> None:
    bodies = [msgpack.packb(list(request), use_bin_type=True) for request in requests]
    chunk = b"".join(frame_of(body) for body in bodies)
    assert same(FrameDecoder().requests(chunk), [python_request(body) for body in bodies])
    assert FrameDecoder().requests(chunk[:-1]) is None  # a partial frame
    assert FrameDecoder().requests(chunk + b"\x00\x00") is None  # a partial length prefix
    assert FrameDecoder().requests(chunk + b"\x00\x00\x00\x00") is None  # length 0
    too_long = struct.pack(">I", MAX_FRAME_NBYTES + 1)
    assert FrameDecoder().requests(chunk + too_long) is None
    assert FrameDecoder().requests(chunk + frame_of(b"\xc1")) is None  # one body declined
    busy = FrameDecoder()
    busy.feed(chunk[:3])
    assert busy.requests(chunk) is None  # something buffered: only feed() may go on
    replies = b"".join(frame_of(msgpack.packb([i, True, i], use_bin_type=True))
                       for i in range(len(bodies)))
    assert FrameDecoder().replies(replies) == [(i, i) for i in range(len(bodies))]
    error = frame_of(msgpack.packb([9, False, ["NO_SPACE", "full"]], use_bin_type=True))
    assert FrameDecoder().replies(replies + error) is None


@needs_fast
@settings(max_examples=150, deadline=None)
@given(supported)
def test_supported_objects_encode_fast_byte_for_byte_as_msgpack(obj: Any) -> None:
    expected = frame_of(python_frame(obj))
    assert fast_frame(obj) == expected
    assert FrameEncoder().frame(obj) == expected


@needs_fast
@settings(max_examples=150, deadline=None)
@given(anything)
def test_other_objects_encode_fast_as_msgpack_or_not_at_all(obj: Any) -> None:
    expected = python_frame(obj)
    frame = fast_frame(obj)
    assert frame is None or (expected is not None and frame == frame_of(expected))


BOUNDARY_INTS = [0, 127, 128, 255, 256, 2**16 - 1, 2**16, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
                 2**64 - 1, -1, -32, -33, -128, -129, -(2**15), -(2**15) - 1, -(2**31),
                 -(2**31) - 1, -(2**63)]


@needs_fast
@pytest.mark.parametrize("obj", [
    *BOUNDARY_INTS, 1.5, -0.0, float("inf"), (1, 2), {1: 2},
    *("é" * n for n in (0, 15, 16, 31, 32, 127, 128, 2**15)),  # 2 bytes each: every length form
    *(b"x" * n for n in (0, 255, 256, 2**16 - 1, 2**16)),
    *([None] * n for n in (0, 15, 16, 2**16 - 1, 2**16)),
    *({str(i): i for i in range(n)} for n in (0, 15, 16, 2**16)),
])
def test_every_length_form_encodes_as_msgpack(obj: Any) -> None:
    assert fast_frame(obj) == frame_of(python_frame(obj))


@needs_fast
@pytest.mark.parametrize("obj", [2**64, -(2**63) - 1, "\ud800", True.__class__, [object()],
                                 {"a": {"b": b"x" * (MAX_FRAME_NBYTES + 1)}}])
def test_objects_left_to_the_packer(obj: Any) -> None:
    assert fast_frame(obj) is None
    with pytest.raises((TypeError, OverflowError, UnicodeEncodeError, KvdError)):
        FrameEncoder().frame(obj)  # the Packer's own error (TooLargeError for the last)


@needs_fast
def test_kvd_pure_python_turns_the_fast_codec_off() -> None:
    code = "from kvd import protocol; print(protocol.codec())"
    for value, expected in (("1", "python"), ("0", "msgspec")):
        env = {**os.environ, "KVD_PURE_PYTHON": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == expected


@needs_fast
@in_use
def test_use_c_switches_the_codec_in_process() -> None:
    body = msgpack.packb([1, "alloc", {"num_blocks": 1}])
    try:
        assert protocol.use_c(False) is False and protocol.codec() == "python"
        assert FrameDecoder().requests(struct.pack(">I", len(body)) + body) is None
        assert protocol.decode_request(body) == (1, "alloc", {"num_blocks": 1})  # Python's
        assert protocol.use_c(True) is True and protocol.codec() == "msgspec"
        assert FrameDecoder().requests(struct.pack(">I", len(body)) + body) == [
            (1, "alloc", {"num_blocks": 1})]
    finally:
        protocol.use_c(True)
