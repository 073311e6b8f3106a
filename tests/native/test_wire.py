"""kvd/protocol/_wire.c against the Python path it shortcuts (kvd/protocol/__init__.py, and kvd/server/journal.py's record
packing and settling), which is its specification.

The C module's contract is one-sided: whatever it returns equals what the Python path returns for
the same input, and where it returns None the Python path runs instead. So every test here
checks both halves: agreement whenever C answers, and that C does answer for the shapes that make
up kvd's traffic (a module that always returned None would be correct and useless).
"""

from __future__ import annotations

import os
import struct
from array import array
import subprocess
import sys
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvd import protocol
from kvd.server import journal
from kvd.errors import BadArgsError, KvdError
from kvd.protocol import (
    MAX_ARRAY_LEN, MAX_FRAME_NBYTES, MAX_MAP_LEN, MAX_OP_NBYTES, MAX_STR_NBYTES, FrameDecoder,
    FrameEncoder, parse_reply, parse_request, unpack_body,
)

wire = protocol._built_wire  # (tests call it directly: KVD_PURE_PYTHON only turns its use off)
needs_wire = pytest.mark.skipif(wire is None, reason="kvd/protocol/_wire.c is not built here (a plain "
                                "source checkout or no C compiler): only the Python path runs")
# For the tests of kvd's use of the module (FrameDecoder.requests, use_c, the validators).
in_use = pytest.mark.skipif(os.environ.get("KVD_PURE_PYTHON") == "1",
                            reason="KVD_PURE_PYTHON=1: kvd does not use kvd/protocol/_wire.c")


def test_the_c_module_is_built_where_ci_requires_it() -> None:
    """.ci/run sets KVD_REQUIRE_C=1: an install that silently fell back to Python fails there."""
    if wire is None and os.environ.get("KVD_REQUIRE_C") != "1":
        pytest.skip("kvd/protocol/_wire.c is not built here and KVD_REQUIRE_C is not set")
    assert wire is not None, "KVD_REQUIRE_C=1 but kvd/protocol/_wire.c was not built (see pip's output)"
    if os.environ.get("KVD_PURE_PYTHON") != "1":
        assert protocol._wire is wire  # and kvd uses it


def same(a: Any, b: Any) -> bool:
    """Equal with equal types all the way down (True == 1 and (1,) == [1] are not enough)."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[key], b[key]) for key in a)
    return a == b


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


# What kvd's traffic is made of: the types kvd/protocol/_wire.c decodes and encodes.
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
supported = st.recursive(
    st.none() | st.booleans() | ints | st.text(max_size=40) | st.binary(max_size=40),
    lambda children: (st.lists(children, max_size=20)
                      | st.dictionaries(st.text(max_size=10), children, max_size=8)),
    max_leaves=40)
# And what it is not: floats, bytes map keys, tuples (packed as arrays, decoded as lists).
anything = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**65)
    | st.floats(allow_nan=False) | st.text(max_size=40) | st.binary(max_size=40),
    lambda children: (st.lists(children, max_size=20) | st.tuples(children, children)
                      | st.dictionaries(st.text(max_size=10) | st.binary(max_size=10), children,
                                        max_size=8)),
    max_leaves=40)
request_ids = st.integers(min_value=0, max_value=2**64 - 1)
ops = st.text(min_size=1, max_size=MAX_OP_NBYTES)


def nested_depth(obj: Any) -> int:
    if type(obj) in (list, tuple):
        return 1 + max((nested_depth(item) for item in obj), default=0)
    if type(obj) is dict:
        return 1 + max((nested_depth(item) for item in obj.values()), default=0)
    return 0


@needs_wire
@settings(max_examples=150, deadline=None)
@given(request_ids, ops, st.dictionaries(st.text(max_size=10), supported, max_size=8))
def test_requests_of_supported_types_decode_in_c_as_in_python(
        request_id: int, op: str, args: dict[str, Any]) -> None:
    body = msgpack.packb([request_id, op, args], use_bin_type=True)
    assert same(wire.request(body), python_request(body))  # never None: C answered
    assert same(protocol.decode_request(body), python_request(body))


@needs_wire
@settings(max_examples=150, deadline=None)
@given(st.one_of(anything, st.tuples(anything, anything, anything)))
def test_any_body_decodes_in_c_as_in_python_or_not_at_all(obj: Any) -> None:
    body = python_frame(obj)
    assume(body is not None)  # ints msgpack cannot carry
    for fast, slow in ((wire.request, python_request), (wire.reply, python_reply)):
        answer = fast(body)
        assert answer is None or same(answer, slow(body))


@needs_wire
@settings(max_examples=250, deadline=None)
@given(request_ids, ops, st.dictionaries(st.text(max_size=10), supported, max_size=4),
       st.lists(st.tuples(st.integers(min_value=0, max_value=10**6),
                          st.integers(min_value=0, max_value=255),
                          st.sampled_from(["flip", "insert", "delete", "truncate"])),
                min_size=1, max_size=4))
def test_mutated_bodies_decode_in_c_as_in_python_or_not_at_all(
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
    for fast, slow in ((wire.request, python_request), (wire.reply, python_reply)):
        answer = fast(body)
        assert answer is None or same(answer, slow(body))


@needs_wire
@settings(max_examples=150, deadline=None)
@given(request_ids, supported)
def test_success_replies_decode_in_c_and_error_replies_are_left_to_python(
        request_id: int, result: Any) -> None:
    body = msgpack.packb([request_id, True, result], use_bin_type=True)
    assert same(wire.reply(body), python_reply(body))
    assert same(protocol.decode_reply(body), python_reply(body))
    error = msgpack.packb([request_id, False, ["NO_SPACE", "full"]], use_bin_type=True)
    assert wire.reply(error) is None
    with pytest.raises(KvdError, match="full"):
        protocol.decode_reply(error)


def header(tag: int, fmt: str, length: int) -> bytes:
    return bytes([tag]) + struct.pack(fmt, length)


@needs_wire
@pytest.mark.parametrize("body", [
    b"",  # nothing
    msgpack.packb([1, "alloc", {}]) + b"\x00",  # trailing bytes
    msgpack.packb([1, "alloc", {"num_blocks": 1}])[:-1],  # truncated
    msgpack.packb([-1, "alloc", {}]),  # negative id
    msgpack.packb([1, "", {}]),  # empty op
    msgpack.packb([1, "x" * (MAX_OP_NBYTES + 1), {}]),  # op too long
    msgpack.packb([1, 2, {}]),  # op not a str
    msgpack.packb([1, "alloc", []]),  # args not a map
    msgpack.packb([1, "alloc", {b"num_blocks": 1}], use_bin_type=True),  # bytes key
    msgpack.packb([1, "alloc"]),  # two items
    msgpack.packb([1, "alloc", {"x": 1.5}]),  # a float: Python decodes it
    msgpack.packb([1, "alloc", {"x": msgpack.ExtType(1, b"")}]),  # ext: Python refuses it
    b"\x93\x01\xa5alloc\x81\xa1x\xc1",  # 0xc1, never used
    b"\x93\x01\xa5alloc\x81\xa1x\xa2\xff\xfe",  # invalid UTF-8
    b"\x93\x01\xa5alloc\x81\xa1x" + header(0xdd, ">I", MAX_ARRAY_LEN + 1),  # long array
    b"\x93\x01\xa5alloc\x81\xa1x" + header(0xdd, ">I", 2**32 - 1) + b"\x00" * 8,  # claims 4G
    b"\x93\x01\xa5alloc" + header(0xdf, ">I", MAX_MAP_LEN + 1),  # large map
    b"\x93\x01\xa5alloc\x81\xa1x" + header(0xdb, ">I", MAX_STR_NBYTES + 1)
    + b"a" * (MAX_STR_NBYTES + 1),  # long str
    b"\x93\x01\xa5alloc\x81\xa1x" + header(0xc6, ">I", 2**32 - 1),  # bin beyond the body
    msgpack.packb([1, "alloc", {"x": [[[[[[[[[[1]]]]]]]]]]}]),  # deep: Python decodes it
], ids=lambda body: body[:24].hex())
def test_bodies_left_to_python(body: bytes) -> None:
    assert wire.request(body) is None
    slow = python_request(body)
    try:  # decode_request agrees with the Python path: the value, or the same error type
        assert same(protocol.decode_request(body), slow)
    except KvdError:
        assert slow is None


def frame_of(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@needs_wire
@in_use
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(request_ids, ops, st.dictionaries(st.text(max_size=8), supported,
                                                              max_size=3)),
                min_size=1, max_size=5))
def test_chunks_of_whole_frames_decode_in_c_and_others_go_to_the_decoder(requests: list) -> None:
    bodies = [msgpack.packb(list(request), use_bin_type=True) for request in requests]
    chunk = b"".join(frame_of(body) for body in bodies)
    assert same(FrameDecoder().requests(chunk), [python_request(body) for body in bodies])
    assert FrameDecoder().requests(chunk[:-1]) is None  # a partial frame
    assert FrameDecoder().requests(chunk + b"\x00\x00") is None  # a partial length prefix
    assert FrameDecoder().requests(chunk + b"\x00\x00\x00\x00") is None  # length 0
    too_long = struct.pack(">I", MAX_FRAME_NBYTES + 1)
    assert FrameDecoder().requests(chunk + too_long) is None
    busy = FrameDecoder()
    busy.feed(chunk[:3])
    assert busy.requests(chunk) is None  # something buffered: only feed() may go on
    replies = b"".join(frame_of(msgpack.packb([i, True, i], use_bin_type=True))
                       for i in range(len(bodies)))
    assert FrameDecoder().replies(replies) == [(i, i) for i in range(len(bodies))]


@needs_wire
@settings(max_examples=150, deadline=None)
@given(supported)
def test_supported_objects_encode_in_c_byte_for_byte_as_msgpack(obj: Any) -> None:
    expected = python_frame(obj)
    if nested_depth(obj) > 8:  # deeper than kvd/protocol/_wire.c goes: the Packer's
        assert wire.frame(obj) is None
    else:
        assert wire.frame(obj) == frame_of(expected)
    assert FrameEncoder().frame(obj) == frame_of(expected)


@needs_wire
@settings(max_examples=150, deadline=None)
@given(anything)
def test_other_objects_encode_in_c_as_msgpack_or_not_at_all(obj: Any) -> None:
    expected = python_frame(obj)
    frame = wire.frame(obj)
    assert frame is None or (expected is not None and frame == frame_of(expected))


BOUNDARY_INTS = [0, 127, 128, 255, 256, 2**16 - 1, 2**16, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
                 2**64 - 1, -1, -32, -33, -128, -129, -(2**15), -(2**15) - 1, -(2**31),
                 -(2**31) - 1, -(2**63)]


@needs_wire
@pytest.mark.parametrize("obj", [
    *BOUNDARY_INTS,
    *("é" * n for n in (0, 15, 16, 31, 32, 127, 128, 2**15)),  # 2 bytes each: every length form
    *(b"x" * n for n in (0, 255, 256, 2**16 - 1, 2**16)),
    *([None] * n for n in (0, 15, 16, 2**16 - 1, 2**16)),
    *({str(i): i for i in range(n)} for n in (0, 15, 16, 2**16)),
])
def test_every_length_form_encodes_as_msgpack(obj: Any) -> None:
    assert wire.frame(obj) == frame_of(python_frame(obj))


@needs_wire
@pytest.mark.parametrize("obj", [2**64, -(2**63) - 1, 1.5, (1, 2), "\ud800", True.__class__,
                                 [object()], {1: 2}, {"a": {"b": b"x" * (MAX_FRAME_NBYTES + 1)}}])
def test_objects_left_to_the_packer(obj: Any) -> None:
    assert wire.frame(obj) is None


@needs_wire
def test_kvd_pure_python_turns_the_c_module_off() -> None:
    code = "from kvd import protocol; print(protocol._wire is None)"
    for value, expected in (("1", "True"), ("0", "False")):
        env = {**os.environ, "KVD_PURE_PYTHON": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == expected


@needs_wire
@in_use
def test_use_c_switches_the_codec_in_process() -> None:
    body = msgpack.packb([1, "alloc", {"num_blocks": 1}])
    try:
        assert protocol.use_c(False) is False
        assert FrameDecoder().requests(struct.pack(">I", len(body)) + body) is None
        assert protocol.decode_request(body) == (1, "alloc", {"num_blocks": 1})  # Python's
        assert protocol.use_c(True) is True
        assert FrameDecoder().requests(struct.pack(">I", len(body)) + body) == [
            (1, "alloc", {"num_blocks": 1})]
    finally:
        protocol.use_c(True)


def python_check(validator: Any, value: Any, *limits: Any) -> bool:
    """Whether the Python validator accepts `value` (C switched off for the call)."""
    protocol.use_c(False)
    try:
        validator({"x": value}, "x", *limits)
        return True
    except KvdError:
        return False
    finally:
        protocol.use_c(True)


list_items = st.one_of(ints, st.integers(min_value=-(2**65), max_value=2**65), st.booleans(),
                       st.none(), st.binary(max_size=70), st.text(max_size=3), st.floats())


@needs_wire
@in_use
@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(list_items, max_size=12), st.lists(ints, max_size=12),
                 st.lists(st.binary(min_size=1, max_size=64) | st.none(), max_size=12),
                 list_items, st.tuples(ints)),
       st.integers(min_value=-1, max_value=12), st.integers(min_value=-2, max_value=2**64),
       st.integers(min_value=-1, max_value=70), st.booleans())
def test_list_checks_in_c_accept_exactly_what_the_validators_accept(
        value: Any, max_len: int, limit: int, max_item_nbytes: int, allow_nil: bool) -> None:
    if 0 <= limit <= 2**64 - 1:  # (the validators never pass other limits)
        assert wire.is_int_list(value, max_len, limit) == python_check(
            protocol.arg_int_list, value, max_len, limit)
    else:
        assert not wire.is_int_list(value, max_len, limit)
    assert wire.is_bytes_list(value, max_len, max_item_nbytes, allow_nil) == python_check(
        protocol.arg_bytes_list, value, max_len, max_item_nbytes, allow_nil)
    if wire.is_int_list(value, max_len, max(limit, 0)):  # and through the validator itself
        assert protocol.arg_int_list({"x": value}, "x", max_len, max(limit, 0)) is value


@needs_wire
@in_use
@pytest.mark.parametrize("value", [[True], [1, False], [-1], [2**64], [8], [1.0], [None], (1,),
                                   [b"x"], [0, 7], [], list(range(9))])
def test_int_list_edge_cases(value: Any) -> None:
    for limit in (0, 7, 2**64 - 1):
        assert wire.is_int_list(value, 8, limit) == python_check(
            protocol.arg_int_list, value, 8, limit)


@needs_wire
@in_use
@pytest.mark.parametrize("value", [[b""], [b"x" * 17], [b"x" * 16], [None], [bytearray(b"x")],
                                   ["x"], [1], (b"x",), [], [b"x"] * 9, [b"x", None]])
def test_bytes_list_edge_cases(value: Any) -> None:
    for allow_nil in (False, True):
        assert wire.is_bytes_list(value, 8, 16, allow_nil) == python_check(
            protocol.arg_bytes_list, value, 8, 16, allow_nil)


# ---- args_of: a hot op's schema in one call ---------------------------------------------------
SCHEMAS = [  # the Service's own (kvd/server/service.py), and limits either side of them
    (protocol.int_field("num_blocks", 0, 8),),
    (protocol.int_list_field("block_ids", 4, 7), protocol.bytes_list_field("hashes", 4, 16),
     protocol.bytes_list_field("parents", 4, 16, is_required=False, allow_nil=True),
     protocol.int_list_field("tiers", 4, 1, is_required=False)),
    (protocol.bytes_list_field("hashes", 4, 16),),
    (protocol.int_list_field("block_ids", 4, None),),
    (protocol.int_field("num_blocks", -3, None), protocol.int_list_field("tiers", 0, 0)),
    (),
]
NAMES = ["num_blocks", "block_ids", "hashes", "parents", "tiers", "extra"]
arg_values = st.one_of(list_items, st.lists(list_items, max_size=6), st.lists(ints, max_size=6),
                       st.lists(st.integers(min_value=0, max_value=9), max_size=6),
                       st.lists(st.binary(min_size=1, max_size=17) | st.none(), max_size=6),
                       st.dictionaries(st.text(max_size=2), ints, max_size=2))


def without_c(call: Any) -> Any:
    """`call()` with kvd/protocol/_wire.c switched off: its result, or the KvdError it raised."""
    protocol.use_c(False)
    try:
        return call()
    except KvdError as exc:
        return exc
    finally:
        protocol.use_c(True)


def python_args_of(args: Any, schema: Any) -> Any:
    """kvd.protocol.args_of's values, or its error, in Python."""
    return without_c(lambda: protocol.args_of(args, schema))


@needs_wire
@in_use
@settings(max_examples=500, deadline=None)
@given(st.sampled_from(SCHEMAS),
       st.dictionaries(st.sampled_from(NAMES) | st.integers(0, 2), arg_values, max_size=5))
def test_args_of_in_c_answers_only_what_the_validators_accept(schema: Any, args: Any) -> None:
    values, expected = wire.args_of(args, schema), python_args_of(args, schema)
    if values is not None:
        assert type(expected) is tuple and len(values) == len(expected)
        assert all(a is b for a, b in zip(values, expected))  # the very objects, not copies
        assert protocol.args_of(args, schema) == values


@needs_wire
@in_use
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 8), st.lists(st.integers(0, 7), max_size=4),
       st.lists(st.binary(min_size=1, max_size=16), max_size=4), st.booleans(), st.booleans())
def test_args_of_in_c_answers_every_valid_hot_request(num_blocks: int, block_ids: list[int],
                                                      hashes: list[bytes], with_parents: bool,
                                                      with_tiers: bool) -> None:
    """The common requests are answered in C (so the contract above cannot hold by declining)."""
    seal = {"block_ids": block_ids, "hashes": hashes}
    if with_parents:
        seal["parents"] = [None] + hashes[1:]
    if with_tiers:
        seal["tiers"] = [len(hashes) % 2] * len(hashes)
    for schema, args in ((SCHEMAS[0], {"num_blocks": num_blocks}), (SCHEMAS[1], seal),
                         (SCHEMAS[2], {"hashes": hashes}), (SCHEMAS[3], {"block_ids": block_ids})):
        values = wire.args_of(args, schema)
        assert values is not None and values == python_args_of(args, schema)


@needs_wire
@in_use
@pytest.mark.parametrize("args", [{"num_blocks": True}, {"num_blocks": 9}, {"num_blocks": -1},
                                  {"num_blocks": 2**64}, {"num_blocks": 1, "x": 1}, {},
                                  {1: 1, "num_blocks": 1}, {"num_blocks": 1.0}])
def test_args_of_declines_and_the_validators_name_the_argument(args: Any) -> None:
    assert wire.args_of(args, SCHEMAS[0]) is None
    error = python_args_of(args, SCHEMAS[0])
    assert isinstance(error, KvdError) and error.code == "BAD_ARGS"
    assert "num_blocks" in str(error) or "unknown arguments" in str(error)


@needs_wire
@in_use
@pytest.mark.parametrize("change", [
    {"hashes": [None]}, {"hashes": [b""]}, {"hashes": [b"x" * 17]}, {"hashes": [b"x"] * 5},
    {"block_ids": [8]}, {"block_ids": [True]}, {"block_ids": [-1]}, {"block_ids": (1,)},
    {"parents": [b""]}, {"parents": [1]}, {"tiers": [2]}, {"tiers": [None]}, {"extra": 1}])
def test_args_of_declines_one_bad_field_of_a_seal(change: dict[str, Any]) -> None:
    """A valid seal with one field made bad: declined in C, refused by the validators."""
    args = {"block_ids": [1], "hashes": [b"x"], "parents": [None], "tiers": [0], **change}
    assert wire.args_of(args, SCHEMAS[1]) is None
    assert isinstance(python_args_of(args, SCHEMAS[1]), KvdError)


@needs_wire
def test_args_of_declines_malformed_schemas_and_args() -> None:
    for schema in ([("num_blocks", 0, True, 0, 8, False)], (("num_blocks", 0, True),),
                   ((b"num_blocks", 0, True, 0, 8, False),), (("num_blocks", 9, True, 0, 8, False),),
                   (("num_blocks", 0, True, "0", 8, False),)):
        assert wire.args_of({"num_blocks": 1}, schema) is None
    assert wire.args_of([("num_blocks", 1)], SCHEMAS[0]) is None
    with pytest.raises(TypeError):
        wire.args_of({})


def python_call_hot(args: Any, schema: Any) -> Any:
    """kvd.protocol.call_hot in Python, into a handler that returns what it got (or its error)."""
    return without_c(lambda: protocol.call_hot(lambda *values: values, args, schema, 7))


@needs_wire
@in_use
@settings(max_examples=500, deadline=None)
@given(st.sampled_from(SCHEMAS),
       st.dictionaries(st.sampled_from(NAMES) | st.integers(0, 2), arg_values, max_size=5))
def test_call_hot_in_c_calls_the_handler_as_the_python_does(schema: Any, args: Any) -> None:
    """The same objects reach the handler, then the owner; or the validators' very error."""
    expected = python_call_hot(args, schema)
    try:
        got = wire.call_hot(lambda *values: values, args, schema, 7)
    except KvdError as exc:
        got = exc
    if isinstance(expected, KvdError):
        assert (type(got), str(got)) == (type(expected), str(expected))
    else:
        assert type(got) is tuple and len(got) == len(expected) and got[-1] == 7
        assert all(a is b for a, b in zip(got, expected))


@needs_wire
@in_use
def test_call_hot_passes_the_handlers_result_and_errors_through_and_holds_nothing() -> None:
    block_ids = [1, 2]
    args = {"block_ids": block_ids}
    before = sys.getrefcount(block_ids)
    for _ in range(100):
        assert wire.call_hot(lambda ids, owner: (len(ids), owner), args, SCHEMAS[3], 5) == (2, 5)
        with pytest.raises(ZeroDivisionError):
            wire.call_hot(lambda ids, owner: 1 / 0, args, SCHEMAS[3], 5)
        with pytest.raises(BadArgsError, match="block_ids"):  # declined: the validators raise
            wire.call_hot(lambda ids, owner: None, {"block_ids": "x"}, SCHEMAS[3], 5)
    assert sys.getrefcount(block_ids) == before
    assert protocol.call_hot is wire.call_hot
    with pytest.raises(TypeError, match="expected 4 arguments"):
        wire.call_hot(print, args, SCHEMAS[3])


# ---- the journal's records (kvd/server/journal.py's _records and _LogState.settle) ------------------
def python_records(evictions: Any, seals: Any, first_seal_seq: Any) -> tuple[int, bytes] | None:
    try:
        return journal._records(evictions, seals, first_seal_seq)
    except Exception:  # struct.error, sqlite3.DataError, TypeError: what commit() would raise
        return None


block_ids = st.integers(min_value=-(2**31), max_value=2**31 - 1)
u64s = st.integers(min_value=0, max_value=2**64 - 1)
# The rows BlockPool.journal_rows makes: (block_id, key, generation, parent, parent_generation,
# tier), keys of any length the journal keeps.
journal_rows = st.tuples(block_ids, st.binary(max_size=journal.MAX_KEY_NBYTES), u64s, block_ids,
                         u64s, st.integers(min_value=0, max_value=255))
# And rows it would not pack: a field out of range or of another type, a list for a tuple.
odd_fields = st.one_of(st.integers(min_value=-(2**65), max_value=2**65), st.booleans(),
                       st.none(), st.binary(max_size=300), st.floats(), st.text(max_size=3))
odd_rows = st.one_of(
    journal_rows,
    st.tuples(odd_fields, odd_fields, odd_fields, odd_fields, odd_fields, odd_fields),
    journal_rows.map(list), st.tuples(block_ids, st.binary(max_size=16)),
    st.builds(lambda row, at, value: row[:at] + (value,) + row[at + 1:], journal_rows,
              st.integers(min_value=0, max_value=5), odd_fields))


def records_in_c(evictions: Any, seals: Any, first_seal_seq: Any) -> tuple[int, bytes] | None:
    return wire.journal_records(evictions, seals, first_seal_seq, journal.DEFAULT_KEY_WIDTH)


@needs_wire
@settings(max_examples=300, deadline=None)
@given(st.lists(block_ids, max_size=20), st.lists(journal_rows, max_size=20), u64s)
def test_journal_records_pack_in_c_byte_for_byte_as_in_python(
        evictions: list[int], rows: list[tuple], first_seal_seq: int) -> None:
    """The usual rows always pack in C, to the Python path's bytes (evictions overlapping the
    seals included: those leave no tombstone)."""
    seals = {row[0]: row for row in rows}
    evictions += list(seals)[::2]
    assume(first_seal_seq + len(seals) <= 2**64)  # (seal_seq is a u64)
    expected = python_records(evictions, seals, first_seal_seq)
    assert expected is not None
    assert same(records_in_c(evictions, seals, first_seal_seq), expected)


@needs_wire
@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(block_ids, odd_fields), max_size=8),
       st.dictionaries(st.one_of(block_ids, st.text(max_size=2)), odd_rows, max_size=8),
       st.one_of(u64s, odd_fields))
def test_any_rows_pack_in_c_as_in_python_or_not_at_all(evictions: Any, seals: Any,
                                                       first_seal_seq: Any) -> None:
    packed = records_in_c(evictions, seals, first_seal_seq)
    if packed is not None:
        assert same(packed, python_records(evictions, seals, first_seal_seq))


@needs_wire
@pytest.mark.parametrize("evictions, seals, first_seal_seq", [
    ([True], {}, 1),  # a bool for a block id (struct packs it; C leaves it to Python)
    ([2**31], {}, 1),
    ([], {1: (1, b"k", 0, -1, 0, 256)}, 1),  # tier out of range
    ([], {1: (1, b"k" * 256, 0, -1, 0, 0)}, 1),  # a key longer than a record holds
    ([], {1: (1, bytearray(b"k"), 0, -1, 0, 0)}, 1),
    ([], {1: [1, b"k", 0, -1, 0, 0]}, 1),
    ([], {1: (1, b"k", -1, -1, 0, 0)}, 1),
    ([], {1: (1, b"k", 0, -1, 2**64, 0)}, 1),
    ([], {1: (1, b"k", 0, -1, 0, 0), 2: (2, b"k", 0, -1, 0, 0)}, 2**64 - 1),  # seal_seq overflows
    ((1,), {}, 1),
    ([], [(1, b"k", 0, -1, 0, 0)], 1),
])
def test_journal_rows_left_to_python(evictions: Any, seals: Any, first_seal_seq: Any) -> None:
    assert records_in_c(evictions, seals, first_seal_seq) is None


@needs_wire
def test_journal_records_of_the_edges_of_every_field() -> None:
    rows = [(2**31 - 1, b"\xff" * 255, 2**64 - 1, -(2**31), 2**64 - 1, 255),
            (-(2**31), b"", 0, 2**31 - 1, 0, 0), (5, b"\x00" * 16, 1, -2, 1, 1)]
    seals = {row[0]: row for row in rows}
    for evictions in ([], [7, 2**31 - 1, -(2**31), 8], [0] * 3):
        assert same(records_in_c(evictions, seals, 2**64 - 3),
                    python_records(evictions, seals, 2**64 - 3))
    assert same(records_in_c([3, 4], {}, 1), python_records([3, 4], {}, 1))  # tombstones only
    assert records_in_c([], {}, 1) == (journal.DEFAULT_KEY_WIDTH, b"")


@needs_wire
@in_use
def test_a_journal_writes_the_same_log_with_the_c_packer_and_without(tmp_path: Any) -> None:
    """Churn two journaled pools alike, one packing and applying its records in C and one in
    Python: the same chunks, compaction steps included, and the same view of the log."""
    from kvd.core.pool import BlockPool

    logs, states = [], []
    for use_c in (True, False):
        log = journal.Journal(tmp_path / f"c{use_c}", min_compact_records=16, compact_budget=32)
        pool = BlockPool(64, "lru", observer=log)
        protocol.use_c(use_c)
        try:
            for start in range(0, 400, 20):  # a full pool from the fourth round on: evictions
                keys = [i.to_bytes(8 + start % 11, "little") for i in range(start, start + 20)]
                block_ids = pool.allocate(20, 1)
                log.commit()  # the evictions' tombstones alone
                pool.seal(block_ids, keys, 1, parents=[None] + keys[:-1])
                pool.release(block_ids[::2], 1)
                log.commit()
                log.tidy()  # compaction steps, which read chunk_of: applied in C or in settle()
                pool.release(block_ids[1::2], 1)
            log._log.settle()
            states.append((log._log.chunk_of, log._log.num_live, log._log.num_records))
        finally:
            protocol.use_c(True)
        logs.append(log._db.execute("SELECT * FROM log ORDER BY chunk_id").fetchall())
        log.close()
    assert logs[0] == logs[1] and states[0] == states[1]
    assert states[0][1] == pool.num_cached and states[0][2] < 400 + 64  # compacted
    kinds = np.concatenate([np.frombuffer(records, journal._record_dtype(key_width))["kind"]
                            for _, key_width, records in logs[0]])
    assert set(kinds.tolist()) == {journal.SEAL, journal.EVICT}
    assert len({key_width for _, key_width, _ in logs[0]}) >= 3  # runs of several key widths


def settled(commits: list[tuple[int, bytes]], num_slots: int) -> tuple[Any, int]:
    """chunk_of and num_live after `commits` -- (key width, records) each, as one chunk --
    by _LogState.settle, the specification."""
    state = journal._LogState()
    state.reserve(num_slots - 1)
    state.unsettled = [(chunk_id, key_width, records)
                       for chunk_id, (key_width, records) in enumerate(commits, 1)]
    state.settle()
    return state.chunk_of, state.num_live


@needs_wire
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 40), max_size=8),
                          st.lists(st.tuples(st.integers(0, 40), st.binary(max_size=20)),
                                   max_size=8)), max_size=12),
       st.integers(min_value=1, max_value=5))
def test_records_apply_in_c_as_settle_applies_them(commits: list, max_chunk_records: int) -> None:
    """Commits applied one by one in C leave chunk_of and num_live as one settle() of them all,
    also where a commit's records span several chunks."""
    packed = [journal._records(evictions,
                               {block: (block, key, 1, -1, 0, 0) for block, key in rows}, 1)
              for evictions, rows in commits]
    chunk_of, num_live, chunk_id, spec = journal._LogState().chunk_of, 0, 1, []
    chunk_of.frombytes(bytes(8 * 41))
    for key_width, records in packed:
        step = max_chunk_records * (journal._HEADER_NBYTES + key_width)
        delta = wire.apply_records(chunk_of, records, key_width, chunk_id, max_chunk_records)
        assert delta is not None
        num_live += delta
        for start in range(0, len(records), step):
            spec.append((key_width, records[start:start + step]))
            chunk_id += 1
    assert (chunk_of, num_live) == settled(spec, 41)


@needs_wire
def test_records_left_to_settle_leave_chunk_of_untouched() -> None:
    _, records = journal._records([3], {5: (5, b"k" * 16, 1, -1, 0, 0)}, 1)
    assert wire.apply_records(array("q", bytes(8 * 6)), records, 16, 1, 4096) == 1
    for chunk_of, blob, key_width in [
            (array("q", bytes(8 * 5)), records, 16),  # block 5 beyond chunk_of: settle reserves
            (array("i", bytes(8 * 6)), records, 16), (bytearray(48), records, 16),
            (bytes(48), records, 16), (array("q", bytes(48)), records[:-1], 16),
            (array("q", bytes(48)), records, 15),
            (array("q", bytes(48)), records[:32] + b"\x07" + records[33:], 16)]:  # no such kind
        before = bytes(chunk_of)
        assert wire.apply_records(chunk_of, blob, key_width, 1, 4096) is None
        assert bytes(chunk_of) == before


@needs_wire
@in_use
def test_a_commit_applied_in_c_waits_for_older_chunks_left_to_settle(tmp_path: Any) -> None:
    """A commit whose records C could not apply (a block beyond chunk_of) waits for settle();
    the commits after it must wait too, or settle would apply the older records over theirs."""
    log = journal.Journal(tmp_path, compact_budget=1)  # every tidy() settles
    log.sealed([(100, b"a" * 16, 1, -1, 0, 0)])
    log.commit()
    log.tidy()  # chunk_of now has room for blocks up to 150
    log.sealed([(5, b"b" * 16, 1, -1, 0, 0), (200, b"c" * 16, 1, -1, 0, 0)])
    log.commit()  # block 200: left to settle()
    log.evicted(5)
    log.sealed([(7, b"d" * 16, 1, -1, 0, 0)])
    log.commit()
    log.tidy()
    view = log._log
    rescan = journal._scan(log._db.execute(
        "SELECT chunk_id, key_width, records FROM log ORDER BY chunk_id").fetchall())[1]
    assert view.num_live == rescan.num_live == 3
    assert list(view.chunk_of[:len(rescan.chunk_of)]) == list(rescan.chunk_of)
    assert not any(view.chunk_of[len(rescan.chunk_of):])
    log.close()
