"""kvd/protocol/_checks.c against the Python validators it shortcuts (kvd/protocol/checks.py),
which are its specification.

The contract is one-sided: whatever the C accepts the validators accept, returning the very same
objects, and what it declines goes to the validators, which raise the error. So every test here
checks both halves: agreement whenever C answers, and that C does answer for the arguments that
make up kvd's traffic (a module that always declined would be correct and useless).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd import native, protocol
from kvd.errors import BadArgsError, KvdError
from kvd.protocol import checks

checks_c = native.built("checks")  # (tests call it directly: KVD_PURE_PYTHON only turns its use off)
needs_c = pytest.mark.skipif(checks_c is None, reason="kvd/protocol/_checks.c is not built here "
                             "(a plain source checkout or no C compiler): only the Python runs")
# For the tests of kvd's use of the module (use_c, the validators).
in_use = pytest.mark.skipif(os.environ.get("KVD_PURE_PYTHON") == "1",
                            reason="KVD_PURE_PYTHON=1: kvd does not use kvd/protocol/_checks.c")
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)


def test_the_c_module_is_built_where_ci_requires_it() -> None:
    """.ci/run sets KVD_REQUIRE_C=1: an install that silently fell back to Python fails there."""
    if checks_c is None and os.environ.get("KVD_REQUIRE_C") != "1":
        pytest.skip("kvd/protocol/_checks.c is not built here and KVD_REQUIRE_C is not set")
    assert checks_c is not None, "KVD_REQUIRE_C=1 but kvd/protocol/_checks.c was not built"
    if os.environ.get("KVD_PURE_PYTHON") != "1":
        assert checks._c is checks_c  # and kvd uses it


@needs_c
@in_use
def test_use_c_switches_the_checks_and_call_hot_in_process() -> None:
    try:
        assert checks.use_c(False) is False
        assert checks.call_hot is checks.python_call_hot
        assert protocol.use_c(True) is True
        assert checks.call_hot is protocol.call_hot is checks_c.call_hot
        protocol.use_c(False)
        assert protocol.call_hot is checks.python_call_hot
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


@needs_c
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
        assert checks_c.is_int_list(value, max_len, limit) == python_check(
            protocol.arg_int_list, value, max_len, limit)
    else:
        assert not checks_c.is_int_list(value, max_len, limit)
    assert checks_c.is_bytes_list(value, max_len, max_item_nbytes, allow_nil) == python_check(
        protocol.arg_bytes_list, value, max_len, max_item_nbytes, allow_nil)
    if checks_c.is_int_list(value, max_len, max(limit, 0)):  # and through the validator itself
        assert protocol.arg_int_list({"x": value}, "x", max_len, max(limit, 0)) is value


@needs_c
@in_use
@pytest.mark.parametrize("value", [[True], [1, False], [-1], [2**64], [8], [1.0], [None], (1,),
                                   [b"x"], [0, 7], [], list(range(9))])
def test_int_list_edge_cases(value: Any) -> None:
    for limit in (0, 7, 2**64 - 1):
        assert checks_c.is_int_list(value, 8, limit) == python_check(
            protocol.arg_int_list, value, 8, limit)


@needs_c
@in_use
@pytest.mark.parametrize("value", [[b""], [b"x" * 17], [b"x" * 16], [None], [bytearray(b"x")],
                                   ["x"], [1], (b"x",), [], [b"x"] * 9, [b"x", None]])
def test_bytes_list_edge_cases(value: Any) -> None:
    for allow_nil in (False, True):
        assert checks_c.is_bytes_list(value, 8, 16, allow_nil) == python_check(
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
    """`call()` with kvd/protocol/_checks.c switched off: its result, or the KvdError it raised."""
    protocol.use_c(False)
    try:
        return call()
    except KvdError as exc:
        return exc
    finally:
        protocol.use_c(True)


def python_args_of(args: Any, schema: Any) -> Any:
    """kvd.protocol.checks.args_of's values, or its error, in Python."""
    return without_c(lambda: protocol.args_of(args, schema))


@needs_c
@in_use
@settings(max_examples=500, deadline=None)
@given(st.sampled_from(SCHEMAS),
       st.dictionaries(st.sampled_from(NAMES) | st.integers(0, 2), arg_values, max_size=5))
def test_args_of_in_c_answers_only_what_the_validators_accept(schema: Any, args: Any) -> None:
    values, expected = checks_c.args_of(args, schema), python_args_of(args, schema)
    if values is not None:
        assert type(expected) is tuple and len(values) == len(expected)
        assert all(a is b for a, b in zip(values, expected))  # the very objects, not copies
        assert protocol.args_of(args, schema) == values


@needs_c
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
        values = checks_c.args_of(args, schema)
        assert values is not None and values == python_args_of(args, schema)


@needs_c
@in_use
@pytest.mark.parametrize("args", [{"num_blocks": True}, {"num_blocks": 9}, {"num_blocks": -1},
                                  {"num_blocks": 2**64}, {"num_blocks": 1, "x": 1}, {},
                                  {1: 1, "num_blocks": 1}, {"num_blocks": 1.0}])
def test_args_of_declines_and_the_validators_name_the_argument(args: Any) -> None:
    assert checks_c.args_of(args, SCHEMAS[0]) is None
    error = python_args_of(args, SCHEMAS[0])
    assert isinstance(error, KvdError) and error.code == "BAD_ARGS"
    assert "num_blocks" in str(error) or "unknown arguments" in str(error)


@needs_c
@in_use
@pytest.mark.parametrize("change", [
    {"hashes": [None]}, {"hashes": [b""]}, {"hashes": [b"x" * 17]}, {"hashes": [b"x"] * 5},
    {"block_ids": [8]}, {"block_ids": [True]}, {"block_ids": [-1]}, {"block_ids": (1,)},
    {"parents": [b""]}, {"parents": [1]}, {"tiers": [2]}, {"tiers": [None]}, {"extra": 1}])
def test_args_of_declines_one_bad_field_of_a_seal(change: dict[str, Any]) -> None:
    """A valid seal with one field made bad: declined in C, refused by the validators."""
    args = {"block_ids": [1], "hashes": [b"x"], "parents": [None], "tiers": [0], **change}
    assert checks_c.args_of(args, SCHEMAS[1]) is None
    assert isinstance(python_args_of(args, SCHEMAS[1]), KvdError)


@needs_c
def test_args_of_declines_malformed_schemas_and_args() -> None:
    for schema in ([("num_blocks", 0, True, 0, 8, False)], (("num_blocks", 0, True),),
                   ((b"num_blocks", 0, True, 0, 8, False),), (("num_blocks", 9, True, 0, 8, False),),
                   (("num_blocks", 0, True, "0", 8, False),)):
        assert checks_c.args_of({"num_blocks": 1}, schema) is None
    assert checks_c.args_of([("num_blocks", 1)], SCHEMAS[0]) is None
    with pytest.raises(TypeError):
        checks_c.args_of({})


def python_call_hot(args: Any, schema: Any) -> Any:
    """kvd.protocol.checks.call_hot in Python, into a handler that returns what it got (or its error)."""
    return without_c(lambda: protocol.call_hot(lambda *values: values, args, schema, 7))


@needs_c
@in_use
@settings(max_examples=500, deadline=None)
@given(st.sampled_from(SCHEMAS),
       st.dictionaries(st.sampled_from(NAMES) | st.integers(0, 2), arg_values, max_size=5))
def test_call_hot_in_c_calls_the_handler_as_the_python_does(schema: Any, args: Any) -> None:
    """The same objects reach the handler, then the owner; or the validators' very error."""
    expected = python_call_hot(args, schema)
    try:
        got = checks_c.call_hot(lambda *values: values, args, schema, 7)
    except KvdError as exc:
        got = exc
    if isinstance(expected, KvdError):
        assert (type(got), str(got)) == (type(expected), str(expected))
    else:
        assert type(got) is tuple and len(got) == len(expected) and got[-1] == 7
        assert all(a is b for a, b in zip(got, expected))


@needs_c
@in_use
def test_call_hot_passes_the_handlers_result_and_errors_through_and_holds_nothing() -> None:
    block_ids = [1, 2]
    args = {"block_ids": block_ids}
    before = sys.getrefcount(block_ids)
    for _ in range(100):
        assert checks_c.call_hot(lambda ids, owner: (len(ids), owner), args, SCHEMAS[3], 5) == (2, 5)
        with pytest.raises(ZeroDivisionError):
            checks_c.call_hot(lambda ids, owner: 1 / 0, args, SCHEMAS[3], 5)
        with pytest.raises(BadArgsError, match="block_ids"):  # declined: the validators raise
            checks_c.call_hot(lambda ids, owner: None, {"block_ids": "x"}, SCHEMAS[3], 5)
    assert sys.getrefcount(block_ids) == before
    assert protocol.call_hot is checks_c.call_hot
    with pytest.raises(TypeError, match="expected 4 arguments"):
        checks_c.call_hot(print, args, SCHEMAS[3])


