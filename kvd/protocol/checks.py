"""Argument checks: what op handlers call on a request's `args` (pure functions).

The `arg_*` validators each take one argument and raise BadArgsError naming it and the type or
range it expected. msgpack hands back exact `int`, `bytes`, `str`, `list`, `dict` objects, so the
checks use `type(x) is T` (which also keeps `True` out of ints).

A hot op's arguments are one schema, a tuple of fields, so that the common request is checked in
one call (`args_of`), and `call_hot` calls the op's handler with the checked values. Where
kvd/protocol/_checks.c is built, those calls and the list validators answer in C first: the C
accepts exactly what the validators accept, returns the very same objects, and declines the rest
to them, which raise the error (tests/native/test_checks_c.py). That C is kept because it pays:
in `python -m bench.request_path`'s in-process round trip of the control plane's ops, a turn with
these checks in Python took 1.09x the time of one with them in C, the daemon's side 1.14x (about
1 µs of a request), the two taking turns in one run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, cast

from kvd import native
from kvd.errors import BadArgsError
from kvd.protocol.messages import MAX_UINT64, describe, short_repr

_REQUIRED: Any = object()


def _default(name: str, default: Any) -> Any:
    if default is _REQUIRED:
        raise BadArgsError(f"missing argument {name!r}")
    return default


def _range_text(min_value: int, max_value: int | None) -> str:
    return f">= {min_value}" if max_value is None else f"in [{min_value}, {max_value}]"


def arg_int(args: dict[str, Any], name: str, min_value: int = 0, max_value: int | None = None,
            default: Any = _REQUIRED) -> int:
    """An int (not bool) in [min_value, max_value]; `default` if absent (required otherwise)."""
    if name not in args:
        return _default(name, default)
    value = args[name]
    if type(value) is not int or value < min_value or (max_value is not None and value > max_value):
        raise BadArgsError(f"{name} must be an int {_range_text(min_value, max_value)}, "
                           f"got {short_repr(value)}")
    return value


def arg_int_list(args: dict[str, Any], name: str, max_len: int,
                 max_value: int | None = None) -> list[int]:
    """A list of at most `max_len` ints (not bools) in [0, max_value]."""
    value = args[name] if name in args else _default(name, _REQUIRED)
    limit = MAX_UINT64 if max_value is None else max_value
    if _c is not None and _c.is_int_list(value, max_len, limit):
        return value  # checked in C (module docstring); below, the checks that name the error
    if type(value) is not list or len(value) > max_len:
        raise BadArgsError(f"{name} must be a list of at most {max_len} ints, got "
                           f"{describe(value)}")
    # One plain loop, not all(genexpr) + min + max: a batch-1 request pays ~0.5 µs less
    # (bench/control_plane.py), and large batches still scan once.
    for item in value:
        if type(item) is not int or not 0 <= item <= limit:
            raise BadArgsError(f"{name} must hold only ints {_range_text(0, max_value)}")
    return value


def arg_bytes(args: dict[str, Any], name: str, max_nbytes: int, default: Any = _REQUIRED) -> bytes:
    """A binary string of at most `max_nbytes` bytes; `default` if absent (required otherwise)."""
    if name not in args:
        return _default(name, default)
    value = args[name]
    if type(value) is not bytes or len(value) > max_nbytes:
        raise BadArgsError(f"{name} must be binary of at most {max_nbytes} bytes, got "
                           f"{describe(value)}")
    return value


def arg_bytes_list(args: dict[str, Any], name: str, max_len: int, max_item_nbytes: int,
                   allow_nil: bool = False) -> list[bytes | None]:
    """A list of at most `max_len` binary strings of 1 to `max_item_nbytes` bytes each (or nil
    items, if `allow_nil`)."""
    value = args[name] if name in args else _default(name, _REQUIRED)
    if _c is not None and _c.is_bytes_list(value, max_len, max_item_nbytes, allow_nil):
        return value  # checked in C, as in arg_int_list
    if type(value) is not list or len(value) > max_len:
        raise BadArgsError(f"{name} must be a list of at most {max_len} binary strings, got "
                           f"{describe(value)}")
    for item in value:  # one plain loop, as in arg_int_list
        if item is None and allow_nil:
            continue
        if type(item) is not bytes:
            raise BadArgsError(f"{name} must hold only binary strings (msgpack bin, Python "
                               "bytes)")
        if not 0 < len(item) <= max_item_nbytes:
            raise BadArgsError(f"every item of {name} must be 1 to {max_item_nbytes} bytes, "
                               f"got one of {len(item)}")
    return value


def arg_str(args: dict[str, Any], name: str, max_len: int, default: Any = _REQUIRED) -> str:
    """A string of at most `max_len` characters; `default` if absent (required otherwise)."""
    if name not in args:
        return _default(name, default)
    value = args[name]
    if type(value) is not str or len(value) > max_len:
        raise BadArgsError(f"{name} must be a string of at most {max_len} characters, got "
                           f"{describe(value)}")
    return value


def arg_bool(args: dict[str, Any], name: str, default: Any = _REQUIRED) -> bool:
    """A bool; `default` if absent (required otherwise)."""
    if name not in args:
        return _default(name, default)
    value = args[name]
    if type(value) is not bool:
        raise BadArgsError(f"{name} must be true or false, got {describe(value)}")
    return value


def check_no_extra(args: dict[str, Any], allowed: Collection[str]) -> None:
    """Raise BadArgsError naming any argument not in `allowed`."""
    for key in args:  # a loop over a few keys: half the cost of building a set per request
        if key not in allowed:
            extra = set(args).difference(allowed)  # (sorted by str: in process, keys may be any)
            raise BadArgsError(f"unknown arguments {sorted(extra, key=str)}; "
                               f"valid: {sorted(allowed)}")


# --- a hot op's schema ----------------------------------------------------------------------
# A field is (name, kind, is_required, a, b, allow_nil), with a and b the limits of its arg_*
# validator: a plain tuple, which the C reads without calling into Python.
ARG_INT, ARG_INT_LIST, ARG_BYTES_LIST = 0, 1, 2
ArgField = tuple[str, int, bool, int, "int | None", bool]


def int_field(name: str, min_value: int, max_value: int | None,
              is_required: bool = True) -> ArgField:
    """An `arg_int` argument (absent optional ones are None)."""
    return (name, ARG_INT, is_required, min_value, max_value, False)


def int_list_field(name: str, max_len: int, max_value: int | None,
                   is_required: bool = True) -> ArgField:
    """An `arg_int_list` argument (absent optional ones are None)."""
    return (name, ARG_INT_LIST, is_required, max_len, max_value, False)


def bytes_list_field(name: str, max_len: int, max_item_nbytes: int, is_required: bool = True,
                     allow_nil: bool = False) -> ArgField:
    """An `arg_bytes_list` argument (absent optional ones are None)."""
    return (name, ARG_BYTES_LIST, is_required, max_len, max_item_nbytes, allow_nil)


def args_of(args: dict[str, Any], schema: tuple[ArgField, ...]) -> tuple[Any, ...]:
    """The values of `args`, in `schema`'s order (None for an absent optional field).

    Raises BadArgsError as `check_no_extra` and the fields' arg_* validators do, in the
    schema's order. kvd/protocol/_checks.c answers first when it can: it returns the values
    only when every one of those checks passes, None otherwise.
    """
    if _c is not None:
        values = _c.args_of(args, schema)
        if values is not None:
            return values
    check_no_extra(args, [field[0] for field in schema])
    found: list[Any] = []
    for name, kind, is_required, a, b, allow_nil in schema:
        if not is_required and name not in args:
            found.append(None)
        elif kind == ARG_INT:
            found.append(arg_int(args, name, a, b))
        elif kind == ARG_INT_LIST:
            found.append(arg_int_list(args, name, a, b))
        else:
            found.append(arg_bytes_list(args, name, a, cast(int, b), allow_nil))  # (never None)
    return tuple(found)


def python_call_hot(handler: Callable[..., Any], args: dict[str, Any],
                    schema: tuple[ArgField, ...], owner: int) -> Any:
    """`handler(*args_of(args, schema), owner)`: a hot op's checked call (kvd/server/service.py).

    kvd/protocol/_checks.c's call_hot is the same call with its checks in C and the values
    passed on its stack, no frame of Python in between; `call_hot` is whichever this process
    runs (use_c).
    """
    return handler(*args_of(args, schema), owner)


_built = native.built("checks")  # kvd/protocol/_checks.c, or None where it was not built
if _built is not None:
    _built.set_validators(args_of)  # (what its call_hot declines: they name the error)
_c = native.load("checks")
call_hot = python_call_hot if _c is None else _c.call_hot


def use_c(enabled: bool) -> bool:
    """Turn kvd/protocol/_checks.c on or off in this process (benches and twin tests compare the
    two in one run); returns whether it is on, which it never is where it was not built or with
    KVD_PURE_PYTHON=1. kvd.protocol.use_c also rebinds the package's `call_hot`."""
    global _c, call_hot
    _c = native.load("checks") if enabled else None
    call_hot = python_call_hot if _c is None else _c.call_hot
    return _c is not None
