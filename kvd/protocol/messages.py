"""Messages: frame bodies <-> requests and replies, under tight limits (sans I/O).

Messages (msgpack arrays)::

    request       [request_id: uint, op: str, args: map str -> any]
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

The specification and the fast path
-----------------------------------
`unpack_body` (msgpack with the limits) then `parse_request` or `parse_reply` is the
specification: it decodes everything the protocol allows and raises the exact error for the
rest. `decode_request`, `decode_reply`, `FrameDecoder.requests`/`.replies` and `FrameEncoder`
first offer a body to msgspec's typed msgpack codec, whose types hold every limit and shape
check of the specification (`_Msgspec`), so that whatever it decodes the specification decodes
the same; whatever it refuses (an error reply, a float-keyed map, a deep or unusual value, any
invalid body) goes to the specification, which decodes it or raises its error. msgspec is loaded
through kvd/native.py like kvd's own compiled modules: with KVD_PURE_PYTHON=1, or where it is
missing, only the specification runs.

Why msgspec and not a codec of kvd's own: in `python -m bench.request_path`'s in-process round
trip of the control plane's ops (alloc, seal, release, lookup, release), with a turn of the
hand-written C codec this replaced taking turns with it in one run, msgspec's round trip took
1.05x the C codec's, the daemon's side of it 1.03x; the bar was 10 %. msgspec's own calls count
about as many instructions as the C codec's did (valgrind --tool=callgrind); the difference is
the length prefix, handled here in Python. What kvd's own C still does is the argument checks
(kvd/protocol/checks.py), which msgspec's types cannot express for kvd's schemas.
"""

from __future__ import annotations

import reprlib
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Annotated, Any, Union, cast

import msgpack

from kvd import native
from kvd.errors import KvdError, error_from_wire
from kvd.protocol.framing import (
    LENGTH, MAX_FRAME_NBYTES, FrameBuffer, prefixed, protocol_error, whole_frames,
)

PROTOCOL_VERSION = 1

# Limits inside one body. Strings are op names, argument keys and messages; binary items are
# 16-byte hashes or packed arrays (bounded by the frame); arrays are batches of ids or token ids
# (a 2 MiB frame holds at most ~2M one-byte ints); maps are argument dicts and stats.
MAX_STR_NBYTES = 64 * 1024
MAX_ARRAY_LEN = MAX_FRAME_NBYTES
MAX_MAP_LEN = 4096
MAX_OP_NBYTES = 64
MAX_UINT64 = 2**64 - 1  # the largest int msgpack carries
MAX_REQUEST_ID = MAX_UINT64

Request = tuple[int, str, dict[str, Any]]
_length_of = LENGTH.unpack_from
_pack_length = LENGTH.pack
_PREFIX_NBYTES = LENGTH.size


class _Msgspec:
    """msgspec's typed decoders and its encoder, for the bodies that make up the traffic.

    Every type below is one the specification accepts whole: request ids in [0, 2**64), ops of
    1 to MAX_OP_NBYTES characters, strings short enough in characters that their UTF-8 is within
    MAX_STR_NBYTES, binary and arrays within their limits (which only a body above the frame cap
    could pass), maps within MAX_MAP_LEN with str keys, and values of one level of nesting
    (an argument's list, a reply's list or map). Ext types and timestamps are in none of them.
    msgspec refuses a length beyond the body before it allocates. A request's values hold no
    str, and a reply's no bytes: msgspec's unions take one of the two (no op's arguments are
    strings; no hot op's reply holds bytes).
    """

    def __init__(self, msgspec: ModuleType) -> None:
        meta = msgspec.Meta
        text: Any = Annotated[str, meta(max_length=MAX_STR_NBYTES // 4)]
        request_id: Any = Annotated[int, meta(ge=0)]
        op: Any = Annotated[str, meta(min_length=1, max_length=MAX_OP_NBYTES)]

        binary: Any = Annotated[bytes, meta(max_length=MAX_FRAME_NBYTES)]

        def values(scalar: Any) -> Any:  # a scalar, or a list or a map of scalars
            return Union[scalar, Annotated[list[scalar], meta(max_length=MAX_ARRAY_LEN)],
                         Annotated[dict[text, scalar], meta(max_length=MAX_MAP_LEN)]]

        arg: Any = values(Union[None, bool, int, float, binary])
        args: Any = Annotated[dict[text, arg], meta(max_length=MAX_MAP_LEN)]
        result: Any = values(Union[None, bool, int, float, text])
        decoder = msgspec.msgpack.Decoder
        self.request: Callable[[Any], Request] = decoder(tuple[request_id, op, args]).decode
        self.reply: Callable[[Any], tuple[int, bool, Any]] = decoder(
            tuple[request_id, bool, result]).decode
        self.encode: Callable[[Any], bytes] = msgspec.msgpack.Encoder().encode


def _load_msgspec() -> _Msgspec | None:
    module = native.load("msgspec")
    return None if module is None else _Msgspec(module)


_fast = _load_msgspec()


def use_msgspec(enabled: bool) -> bool:
    """Turn the msgspec fast path on or off in this process (benches and twin tests compare the
    two in one run); returns whether it is on, which it never is where msgspec is missing or
    with KVD_PURE_PYTHON=1."""
    global _fast
    _fast = _load_msgspec() if enabled else None
    return _fast is not None


def codec() -> str:
    """Which codec this process runs: "msgspec" or "python" (`kvd start` prints it in its ready
    line and `stats` reports it, so an install that fell back to Python shows)."""
    return "python" if _fast is None else "msgspec"


# --- the specification ---------------------------------------------------------------------

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
        raise protocol_error(f"undecodable frame body: {type(exc).__name__}: {exc}") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed")


def _is_request_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_REQUEST_ID


def parse_request(obj: Any) -> Request:
    """Check the shape of a decoded request; return `(request_id, op, args)`.

    Raises:
        ProtocolError: anything but `[uint id, short str op, map with str keys]`; its
            `request_id` attribute holds the id when that much was readable, else None.
    """
    if type(obj) is not list or len(obj) != 3:
        request_id = obj[0] if type(obj) is list and obj and _is_request_id(obj[0]) else None
        raise protocol_error("a request is [request_id, op, args]", request_id)
    request_id, op, args = obj
    # Inline checks and a plain loop, not helpers and all(genexpr): this runs once per request
    # and the helpers cost a third of a microsecond (bench/control_plane.py).
    if type(request_id) is not int or not 0 <= request_id <= MAX_REQUEST_ID:
        raise protocol_error("request_id must be an int in [0, 2**64), got "
                             f"{short_repr(request_id)}")
    if type(op) is not str or not 0 < len(op) <= MAX_OP_NBYTES:
        raise protocol_error(f"op must be a non-empty string of at most {MAX_OP_NBYTES} "
                             f"characters, got {short_repr(op)}", request_id)
    if type(args) is not dict:
        raise protocol_error("args must be a map with string keys", request_id)
    for key in args:
        if type(key) is not str:
            raise protocol_error("args must be a map with string keys", request_id)
    return request_id, op, args  # a plain tuple: a NamedTuple costs ~0.15 µs more per request


def parse_reply(obj: Any) -> tuple[int, Any]:
    """Check a decoded reply; return `(request_id, result)` or raise the error it carries.

    Raises:
        KvdError: the mapped subclass for an error reply, with `request_id` set on it.
        ProtocolError: the reply is malformed.
    """
    if type(obj) is not list or len(obj) != 3 or type(obj[1]) is not bool:
        raise protocol_error("a reply is [request_id, ok, result_or_error]")
    request_id, is_ok, payload = obj
    if not (type(request_id) is int and 0 <= request_id <= MAX_REQUEST_ID
            or (request_id is None and not is_ok)):
        raise protocol_error(f"reply request_id must be an int in [0, 2**64), "
                             f"got {short_repr(request_id)}")
    if is_ok:
        return cast(int, request_id), payload  # (None only in an error reply)
    if (type(payload) is not list or len(payload) != 2
            or type(payload[0]) is not str or type(payload[1]) is not str):
        raise protocol_error("an error reply carries [CODE, message]", request_id)
    exc = error_from_wire(payload[0], payload[1])
    exc.request_id = request_id  # type: ignore[attr-defined]
    raise exc


# --- decoding: the fast path, then the specification ----------------------------------------

def fast_request(body: Any) -> Request | None:
    """The request msgspec decodes from `body`, or None where the specification must look."""
    if _fast is None:
        return None
    try:
        return _fast.request(body)
    except Exception:  # msgspec.DecodeError for any body its types refuse (module docstring)
        return None


def fast_reply(body: Any) -> tuple[int, Any] | None:
    """A success reply msgspec decodes from `body`, or None (an error reply included)."""
    if _fast is None:
        return None
    try:
        request_id, is_ok, result = _fast.reply(body)
    except Exception:  # as in fast_request
        return None
    return (request_id, result) if is_ok else None


def decode_request(body: bytes) -> Request:
    """`parse_request(unpack_body(body))`, through msgspec when it can (module docstring)."""
    return fast_request(body) or parse_request(unpack_body(body))


def decode_reply(body: bytes) -> tuple[int, Any]:
    """`parse_reply(unpack_body(body))`, through msgspec when it can (module docstring)."""
    return fast_reply(body) or parse_reply(unpack_body(body))


class FrameDecoder(FrameBuffer):
    """A FrameBuffer that also decodes whole chunks of frames at once (the daemon's and the
    client's common case: one chunk, one or a few whole frames)."""

    def requests(self, data: bytes | bytearray | memoryview) -> list[Request] | None:
        """`decode_request` of every frame in `data`, if `data` holds whole frames only, nothing
        is buffered and msgspec decodes every body; else None (then `feed` it: this changes
        nothing)."""
        fast = _fast
        if fast is None or self._buffer or self._error is not None:
            return None
        try:
            # Inline, the common chunk (one whole frame): every request's path into the daemon,
            # where a helper call or a memoryview more costs a tenth of a microsecond.
            if 0 < _length_of(data)[0] == len(data) - _PREFIX_NBYTES <= MAX_FRAME_NBYTES:
                return [fast.request(data[_PREFIX_NBYTES:])]
            bodies = whole_frames(data)
            return None if bodies is None else [fast.request(body) for body in bodies]
        except Exception:  # as in fast_request (and a chunk shorter than a length prefix)
            return None

    def replies(self, data: bytes | bytearray | memoryview) -> list[tuple[int, Any]] | None:
        """`decode_reply` of every frame in `data`, as `requests` does it for requests: success
        replies only (an error reply is None here, and `decode_reply` raises its error)."""
        fast = _fast
        if fast is None or self._buffer or self._error is not None:
            return None
        try:
            if 0 < _length_of(data)[0] == len(data) - _PREFIX_NBYTES <= MAX_FRAME_NBYTES:
                request_id, is_ok, result = fast.reply(data[_PREFIX_NBYTES:])  # as in requests
                return [(request_id, result)] if is_ok else None
            bodies = whole_frames(data)
            replies = [fast.reply(body) for body in bodies or ()]
        except Exception:  # as in requests
            return None
        if not replies or not all(is_ok for _, is_ok, _ in replies):
            return None
        return [(request_id, result) for request_id, _, result in replies]


# --- encoding --------------------------------------------------------------------------------

class FrameEncoder:
    """Packs messages into length-prefixed frames: msgspec's encoder where it runs, else a
    msgpack Packer of this encoder's own.

    `msgpack.packb` builds a Packer (and its 256 KiB buffer) per call, about 1 µs of a 20 µs
    round trip; a Packer is not thread-safe, so each thread or connection owner keeps one:
    the daemon's loop and every Client hold their own (a direct attribute is ~0.2 µs cheaper
    per frame than a thread-local lookup, bench/control_plane.py), and the module-level
    `encode_*` functions use one per thread. `pack` resets the Packer even when it raises.
    msgspec's encoder is thread-safe; it packs the traffic's objects byte for byte as the Packer
    does (tests/native/test_wire.py), and a few the Packer refuses (sets, datetimes),
    which the daemon then refuses by type.
    """

    def __init__(self) -> None:
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def frame(self, obj: Any) -> bytes:
        """Pack `obj` into one frame.

        Raises:
            TooLargeError: the body is above MAX_FRAME_NBYTES.
            TypeError: `obj` holds something msgpack cannot pack (e.g. np.int64: pass `int`).
        """
        if _fast is not None:
            try:
                body = _fast.encode(obj)
            except Exception:  # what msgspec cannot pack: the Packer raises its own error
                pass
            else:
                if len(body) <= MAX_FRAME_NBYTES:
                    return _pack_length(len(body)) + body
        return prefixed(self._pack(obj))

    def request(self, request_id: int, op: str, args: dict[str, Any]) -> bytes:
        """Frame a request."""
        return self.frame([request_id, op, args])

    def result(self, request_id: int, result: Any) -> bytes:
        """Frame a success reply. Raises TooLargeError if the result does not fit one frame."""
        return self.frame([request_id, True, result])

    def error(self, request_id: int | None, exc: KvdError) -> bytes:
        """Frame an error reply `[CODE, message]` for `exc` (request_id None is sent as nil)."""
        return self.frame([request_id, False, [exc.code, str(exc)[:MAX_STR_NBYTES // 4]]])


_local = threading.local()


def _encoder() -> FrameEncoder:
    """This thread's FrameEncoder (for the module-level functions)."""
    encoder = getattr(_local, "encoder", None)
    if encoder is None:
        encoder = _local.encoder = FrameEncoder()
    return encoder


def encode_frame(obj: Any) -> bytes:
    """Pack `obj` into one length-prefixed frame (see FrameEncoder.frame)."""
    return _encoder().frame(obj)


def encode_request(request_id: int, op: str, args: dict[str, Any]) -> bytes:
    """Frame a request."""
    return _encoder().request(request_id, op, args)


def encode_result(request_id: int, result: Any) -> bytes:
    """Frame a success reply. Raises TooLargeError if the result does not fit one frame."""
    return _encoder().result(request_id, result)


def encode_error(request_id: int | None, exc: KvdError) -> bytes:
    """Frame an error reply `[CODE, message]` for `exc` (request_id None is sent as nil)."""
    return _encoder().error(request_id, exc)


# --- quoting what a client sent -------------------------------------------------------------

# Error messages quote what a client sent, which msgpack lets nest 1024 deep: repr() of that
# raises RecursionError (an INTERNAL error, a kvd bug, instead of the client's); and a plain
# repr builds all of a huge value before it is cut.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40


def short_repr(value: Any) -> str:
    """`value` quoted for an error message: bounded in depth and length."""
    return _REPR.repr(value)[:80]


def describe(value: Any) -> str:
    """`value` for an error message: a container by its type and length, else short_repr."""
    if type(value) in (list, bytes, str):
        return f"{type(value).__name__} of length {len(value)}"
    return short_repr(value)

