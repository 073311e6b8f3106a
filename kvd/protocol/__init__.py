"""The wire protocol: framing, message shapes and argument validation, sans I/O.

Theory of operation
-------------------
This module never touches a socket (the h11 shape): the daemon and the client read bytes however
they like and `feed` them to a `FrameDecoder`, which returns complete frame bodies; everything
else here is a pure function from bytes or objects to objects or bytes. Partial reads, coalesced
frames and hostile input therefore become plain unit tests.

Frame::

    +-----------------------+------------------------------------------+
    | length: u32 big-end.  | body: one msgpack object (length bytes)  |
    +-----------------------+------------------------------------------+

`length` is checked the moment its 4 bytes arrive, before any of the body is buffered: 0 is a
ProtocolError, above `MAX_FRAME_NBYTES` a TooLargeError. Either leaves the stream unsynchronised,
so the decoder stays failed (every later `feed` raises again) and the daemon closes the session;
complete frames that arrived in the same chunk before the bad prefix are dropped with it.

Messages (msgpack arrays)::

    request       [request_id: uint, op: str, args: map str → any]
    result reply  [request_id, true,  result]
    error reply   [request_id, false, [CODE: str, message: str]]

`request_id` is chosen by the client and echoed by the daemon, so replies can be matched even if a
client pipelines. A session opens with op `hello` carrying `PROTOCOL_VERSION`.

Bodies are unpacked with tight limits (string, binary, array and map lengths; no ext types, which
also refuses msgpack timestamps) so a small frame can never make the daemon allocate much more
than the frame itself. Anything msgpack rejects becomes a ProtocolError, never a crash.

Errors carry the request id when it could be read: `ProtocolError.request_id` from
`parse_request` (None when the id itself was unreadable) and `KvdError.request_id` from
`parse_reply`, so the daemon can still answer a malformed request and a pipelining client can
route an error reply to its caller.

`decode_request` and `decode_reply` are what the daemon and the client call on a frame body: the
Python path above (`unpack_body`, then `parse_request` or `parse_reply`), except that the common
bodies are first offered to the C module kvd/protocol/_wire.c, which decodes them in one pass and returns
None for anything it does not support or finds invalid -- the Python path then decodes it or
raises its exact error. `FrameDecoder.requests`/`.replies` do the same for a chunk of whole
frames, `FrameEncoder.frame` and the list validators likewise try C first. Together that took
4.4-8.2 µs off a batch-1 round trip in process (bench/request_path.py, interleaved). Where the
module was not built, or with KVD_PURE_PYTHON=1 in the environment, only the Python path runs.

The `arg_*` validators are what op handlers call on `args`; each raises BadArgsError naming the
argument and the type or range it expected. `args_of` runs them over a schema of fields (the hot
ops' arguments), after one C call that answers for the common request. msgpack hands back exact `int`, `bytes`, `str`,
`list`, `dict` objects, so the checks use `type(x) is T` (which also keeps `True` out of ints).
"""

from __future__ import annotations

import reprlib
import struct
import threading
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

import msgpack

from kvd import native
from kvd.errors import BadArgsError, KvdError, ProtocolError, TooLargeError, error_from_wire

PROTOCOL_VERSION = 1

MAX_FRAME_NBYTES = 2 * 1024 * 1024
# Limits inside one body. Strings are op names, argument keys and messages; binary items are
# 16-byte hashes or packed arrays (bounded by the frame); arrays are batches of ids or token ids
# (a 2 MiB frame holds at most ~2M one-byte ints); maps are argument dicts and stats.
MAX_STR_NBYTES = 64 * 1024
MAX_ARRAY_LEN = MAX_FRAME_NBYTES
MAX_MAP_LEN = 4096
MAX_OP_NBYTES = 64
MAX_UINT64 = 2**64 - 1  # the largest int msgpack carries
MAX_REQUEST_ID = MAX_UINT64

_LENGTH = struct.Struct(">I")
_REQUIRED: Any = object()
_local = threading.local()

_built_wire = native.built("wire")  # kvd/protocol/_wire.c, or None where it was not built
if _built_wire is not None:  # the limits unpack_body and parse_request apply
    _built_wire.set_limits(MAX_FRAME_NBYTES, MAX_STR_NBYTES, MAX_FRAME_NBYTES, MAX_ARRAY_LEN,
                           MAX_MAP_LEN, MAX_OP_NBYTES)
_wire = native.load("wire")


def codec() -> str:
    """Which codec this process runs: "c" (kvd/protocol/_wire.c) or "python" (`kvd start` prints it in
    its ready line and `stats` reports it, so a build that fell back to Python shows)."""
    return "python" if _wire is None else "c"


def wire() -> ModuleType | None:
    """kvd/protocol/_wire.c if this process runs it, else None: for kvd/server/journal.py's records (packed
    and applied in C), which follow the same switch."""
    return _wire


def use_c(enabled: bool) -> bool:
    """Turn kvd/protocol/_wire.c on or off in this process, for the codec and the journal's records
    alike (bench/request_path.py and bench/recovery.py compare the two in one run); returns
    whether it is on, which it never is where it was not built or with KVD_PURE_PYTHON=1."""
    global _wire, call_hot
    _wire = native.load("wire") if enabled else None
    call_hot = _call_hot if _wire is None else _wire.call_hot
    return _wire is not None


def _protocol_error(message: str, request_id: int | None = None) -> ProtocolError:
    exc = ProtocolError(message)
    exc.request_id = request_id  # type: ignore[attr-defined]
    return exc


# --- framing ---------------------------------------------------------------------------------

def check_frame_length(nbytes: int) -> None:
    """Raise if a frame body of `nbytes` may not be sent or received."""
    if nbytes == 0:
        raise _protocol_error("frame length 0: every frame carries a msgpack body")
    if nbytes > MAX_FRAME_NBYTES:
        raise TooLargeError(f"frame of {nbytes} bytes is above the {MAX_FRAME_NBYTES}-byte cap: "
                            "split the batch into smaller requests")


class FrameEncoder:
    """Packs messages into length-prefixed frames with a msgpack Packer of its own.

    `msgpack.packb` builds a Packer (and its 256 KiB buffer) per call, about 1 µs of a 20 µs
    round trip; a Packer is not thread-safe, so each thread or connection owner keeps one:
    the daemon's loop and every Client hold their own (a direct attribute is ~0.2 µs cheaper
    per frame than a thread-local lookup, bench/control_plane.py), and the module-level
    `encode_*` functions use one per thread. `pack` resets the Packer even when it raises.
    """

    def __init__(self) -> None:
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def frame(self, obj: Any) -> bytes:
        """Pack `obj` into one frame.

        Raises:
            TooLargeError: the body is above MAX_FRAME_NBYTES.
            TypeError: `obj` holds something msgpack cannot pack (e.g. np.int64: pass `int`).
        """
        if _wire is not None:
            frame = _wire.frame(obj)  # the common objects in C (module docstring)
            if frame is not None:
                return frame
        body = self._pack(obj)
        nbytes = len(body)
        if nbytes > MAX_FRAME_NBYTES:  # (never 0: a msgpack object is at least one byte)
            check_frame_length(nbytes)
        return _LENGTH.pack(nbytes) + body

    def request(self, request_id: int, op: str, args: dict[str, Any]) -> bytes:
        """Frame a request."""
        return self.frame([request_id, op, args])

    def result(self, request_id: int, result: Any) -> bytes:
        """Frame a success reply. Raises TooLargeError if the result does not fit one frame."""
        return self.frame([request_id, True, result])

    def error(self, request_id: int | None, exc: KvdError) -> bytes:
        """Frame an error reply `[CODE, message]` for `exc` (request_id None is sent as nil)."""
        return self.frame([request_id, False, [exc.code, str(exc)[:MAX_STR_NBYTES // 4]]])


def _encoder() -> FrameEncoder:
    """This thread's FrameEncoder (for the module-level functions)."""
    encoder = getattr(_local, "encoder", None)
    if encoder is None:
        encoder = _local.encoder = FrameEncoder()
    return encoder


def encode_frame(obj: Any) -> bytes:
    """Pack `obj` into one length-prefixed frame (see FrameEncoder.frame)."""
    return _encoder().frame(obj)


class FrameDecoder:
    """Reassembles frames from arbitrary chunks of a byte stream.

    The buffer is a bytearray plus a read offset; consumed bytes are dropped once per `feed`
    (CPython deletes a bytearray prefix by moving its start pointer), so the cost is linear in
    the bytes fed however they are chunked.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._error: KvdError | None = None

    @property
    def buffered_nbytes(self) -> int:
        """Bytes received but not yet returned as a frame body."""
        return len(self._buffer)

    def requests(self, data: bytes | bytearray | memoryview
                 ) -> list[tuple[int, str, dict[str, Any]]] | None:
        """`decode_request` of every frame in `data`, decoded in C, if `data` holds whole frames
        only, nothing is buffered and kvd/protocol/_wire.c decodes every body; else None (then `feed` it:
        this changes nothing)."""
        if _wire is None or self._buffer or self._error is not None:
            return None
        return _wire.requests(data)

    def replies(self, data: bytes | bytearray | memoryview) -> list[tuple[int, Any]] | None:
        """`decode_reply` of every frame in `data`, as `requests` does it for requests: success
        replies only (an error reply is None here, and `decode_reply` raises its error)."""
        if _wire is None or self._buffer or self._error is not None:
            return None
        return _wire.replies(data)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Append `data`; return the body of every frame it completed, in order.

        Raises:
            ProtocolError: a length prefix of 0 (now or on any earlier feed).
            TooLargeError: a length prefix above MAX_FRAME_NBYTES (now or earlier).
        """
        if self._error is not None:
            raise self._error
        buffer = self._buffer
        if not buffer and len(data) >= _LENGTH.size:
            # The common case, one whole frame per chunk, without copying through the buffer.
            (nbytes,) = _LENGTH.unpack_from(data)
            if len(data) == _LENGTH.size + nbytes and 0 < nbytes <= MAX_FRAME_NBYTES:
                return [bytes(data[_LENGTH.size:])]
        buffer += data
        bodies: list[bytes] = []
        offset = 0
        while len(buffer) - offset >= _LENGTH.size:
            (nbytes,) = _LENGTH.unpack_from(buffer, offset)
            try:
                check_frame_length(nbytes)
            except KvdError as exc:
                self._error = exc
                raise
            end = offset + _LENGTH.size + nbytes
            if end > len(buffer):
                break
            bodies.append(bytes(buffer[offset + _LENGTH.size:end]))
            offset = end
        del buffer[:offset]
        return bodies


def unpack_body(body: bytes) -> Any:
    """Decode one frame body with tight limits.

    Raises:
        ProtocolError: not exactly one valid msgpack object within the limits.
    """
    try:
        return msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext,
            max_str_len=MAX_STR_NBYTES, max_bin_len=MAX_FRAME_NBYTES,
            max_array_len=MAX_ARRAY_LEN, max_map_len=MAX_MAP_LEN, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises ValueError, FormatError, StackError, TypeError...
        raise _protocol_error(f"undecodable frame body: {type(exc).__name__}: {exc}") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed")


def decode_request(body: bytes) -> tuple[int, str, dict[str, Any]]:
    """`parse_request(unpack_body(body))`, through kvd/protocol/_wire.c when it can (module docstring)."""
    if _wire is not None:
        request = _wire.request(body)
        if request is not None:
            return request
    return parse_request(unpack_body(body))


def decode_reply(body: bytes) -> tuple[int, Any]:
    """`parse_reply(unpack_body(body))`, through kvd/protocol/_wire.c when it can (module docstring)."""
    if _wire is not None:
        reply = _wire.reply(body)
        if reply is not None:
            return reply
    return parse_reply(unpack_body(body))


# --- messages --------------------------------------------------------------------------------

def _is_request_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_REQUEST_ID


def encode_request(request_id: int, op: str, args: dict[str, Any]) -> bytes:
    """Frame a request."""
    return _encoder().request(request_id, op, args)


def encode_result(request_id: int, result: Any) -> bytes:
    """Frame a success reply. Raises TooLargeError if the result does not fit one frame."""
    return _encoder().result(request_id, result)


def encode_error(request_id: int | None, exc: KvdError) -> bytes:
    """Frame an error reply `[CODE, message]` for `exc` (request_id None is sent as nil)."""
    return _encoder().error(request_id, exc)


def parse_request(obj: Any) -> tuple[int, str, dict[str, Any]]:
    """Check the shape of a decoded request; return `(request_id, op, args)`.

    Raises:
        ProtocolError: anything but `[uint id, short str op, map with str keys]`; its
            `request_id` attribute holds the id when that much was readable, else None.
    """
    if type(obj) is not list or len(obj) != 3:
        request_id = obj[0] if type(obj) is list and obj and _is_request_id(obj[0]) else None
        raise _protocol_error("a request is [request_id, op, args]", request_id)
    request_id, op, args = obj
    # Inline checks and a plain loop, not helpers and all(genexpr): this runs once per request
    # and the helpers cost a third of a microsecond (bench/control_plane.py).
    if type(request_id) is not int or not 0 <= request_id <= MAX_REQUEST_ID:
        raise _protocol_error("request_id must be an int in [0, 2**64), got "
                              f"{_short_repr(request_id)}")
    if type(op) is not str or not 0 < len(op) <= MAX_OP_NBYTES:
        raise _protocol_error(f"op must be a non-empty string of at most {MAX_OP_NBYTES} "
                              f"characters, got {_short_repr(op)}", request_id)
    if type(args) is not dict:
        raise _protocol_error("args must be a map with string keys", request_id)
    for key in args:
        if type(key) is not str:
            raise _protocol_error("args must be a map with string keys", request_id)
    return request_id, op, args  # a plain tuple: a NamedTuple costs ~0.15 µs more per request


def parse_reply(obj: Any) -> tuple[int, Any]:
    """Check a decoded reply; return `(request_id, result)` or raise the error it carries.

    Raises:
        KvdError: the mapped subclass for an error reply, with `request_id` set on it.
        ProtocolError: the reply is malformed.
    """
    if type(obj) is not list or len(obj) != 3 or type(obj[1]) is not bool:
        raise _protocol_error("a reply is [request_id, ok, result_or_error]")
    request_id, is_ok, payload = obj
    if not (type(request_id) is int and 0 <= request_id <= MAX_REQUEST_ID
            or (request_id is None and not is_ok)):
        raise _protocol_error(f"reply request_id must be an int in [0, 2**64), "
                              f"got {_short_repr(request_id)}")
    if is_ok:
        return request_id, payload
    if (type(payload) is not list or len(payload) != 2
            or type(payload[0]) is not str or type(payload[1]) is not str):
        raise _protocol_error("an error reply carries [CODE, message]", request_id)
    exc = error_from_wire(payload[0], payload[1])
    exc.request_id = request_id  # type: ignore[attr-defined]
    raise exc


# --- argument validators (used by the daemon's op handlers) -----------------------------------

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
                           f"got {_short_repr(value)}")
    return value


def arg_int_list(args: dict[str, Any], name: str, max_len: int,
                 max_value: int | None = None) -> list[int]:
    """A list of at most `max_len` ints (not bools) in [0, max_value]."""
    value = args[name] if name in args else _default(name, _REQUIRED)
    limit = MAX_UINT64 if max_value is None else max_value
    if _wire is not None and _wire.is_int_list(value, max_len, limit):
        return value  # checked in C (module docstring); below, the checks that name the error
    if type(value) is not list or len(value) > max_len:
        raise BadArgsError(f"{name} must be a list of at most {max_len} ints, got "
                           f"{_describe(value)}")
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
                           f"{_describe(value)}")
    return value


def arg_bytes_list(args: dict[str, Any], name: str, max_len: int, max_item_nbytes: int,
                   allow_nil: bool = False) -> list[bytes | None]:
    """A list of at most `max_len` binary strings of 1 to `max_item_nbytes` bytes each (or nil
    items, if `allow_nil`)."""
    value = args[name] if name in args else _default(name, _REQUIRED)
    if _wire is not None and _wire.is_bytes_list(value, max_len, max_item_nbytes, allow_nil):
        return value  # checked in C, as in arg_int_list
    if type(value) is not list or len(value) > max_len:
        raise BadArgsError(f"{name} must be a list of at most {max_len} binary strings, got "
                           f"{_describe(value)}")
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
                           f"{_describe(value)}")
    return value


def arg_bool(args: dict[str, Any], name: str, default: Any = _REQUIRED) -> bool:
    """A bool; `default` if absent (required otherwise)."""
    if name not in args:
        return _default(name, default)
    value = args[name]
    if type(value) is not bool:
        raise BadArgsError(f"{name} must be true or false, got {_describe(value)}")
    return value


def check_no_extra(args: dict[str, Any], allowed: Collection[str]) -> None:
    """Raise BadArgsError naming any argument not in `allowed`."""
    for key in args:  # a loop over a few keys: half the cost of building a set per request
        if key not in allowed:
            extra = set(args).difference(allowed)  # (sorted by str: in process, keys may be any)
            raise BadArgsError(f"unknown arguments {sorted(extra, key=str)}; "
                               f"valid: {sorted(allowed)}")


# A hot op's arguments as one schema, a tuple of fields, so that the common request is checked
# in one C call (kvd/protocol/_wire.c's args_of) instead of a validator call per argument: a field is
# (name, kind, is_required, a, b, allow_nil), with a and b the limits of its arg_* validator.
ARG_INT, ARG_INT_LIST, ARG_BYTES_LIST = 0, 1, 2
ArgField = tuple[str, int, bool, int, "int | None", bool]


def int_field(name: str, min_value: int, max_value: int | None) -> ArgField:
    """A required `arg_int` argument."""
    return (name, ARG_INT, True, min_value, max_value, False)


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
    schema's order. kvd/protocol/_wire.c answers first when it can: it returns the values only when every
    one of those checks passes, None otherwise.
    """
    if _wire is not None:
        values = _wire.args_of(args, schema)
        if values is not None:
            return values
    check_no_extra(args, [field[0] for field in schema])
    found = []
    for name, kind, is_required, a, b, allow_nil in schema:
        if not is_required and name not in args:
            found.append(None)
        elif kind == ARG_INT:
            found.append(arg_int(args, name, a, b))
        elif kind == ARG_INT_LIST:
            found.append(arg_int_list(args, name, a, b))
        else:
            found.append(arg_bytes_list(args, name, a, b, allow_nil))
    return tuple(found)


def _call_hot(handler: Callable[..., Any], args: dict[str, Any], schema: tuple[ArgField, ...],
              owner: int) -> Any:
    """`handler(*args_of(args, schema), owner)`: a hot op's checked call (kvd/server/service.py).

    kvd/protocol/_wire.c's call_hot is the same call with its checks in C and the values passed on its
    stack, no frame of Python in between; `call_hot` is whichever this process runs (use_c).
    """
    return handler(*args_of(args, schema), owner)


if _built_wire is not None:
    _built_wire.set_validators(args_of)  # (what its call_hot declines: they name the error)
call_hot = _call_hot if _wire is None else _wire.call_hot


def _describe(value: Any) -> str:
    if type(value) in (list, bytes, str):
        return f"{type(value).__name__} of length {len(value)}"
    return _short_repr(value)


# Error messages quote what a client sent, which msgpack lets nest 1024 deep: repr() of that
# raises RecursionError (an INTERNAL error, a kvd bug, instead of the client's); and a plain
# repr builds all of a huge value before it is cut.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40


def _short_repr(value: Any) -> str:
    return _REPR.repr(value)[:80]
