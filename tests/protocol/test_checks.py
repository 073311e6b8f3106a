"""kvd/protocol/checks.py: the argument validators, each naming the argument it refuses."""

from __future__ import annotations

import pytest

from kvd.errors import BadArgsError
from kvd.protocol import (
    arg_bool, arg_bytes, arg_bytes_list, arg_int, arg_int_list, arg_str, check_no_extra,
)


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

