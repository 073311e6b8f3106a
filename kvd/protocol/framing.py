"""Framing: a byte stream <-> frame bodies, the length prefix and nothing else (sans I/O).

Frame::

    +-----------------------+------------------------------------------+
    | length: u32 big-end.  | body: one msgpack object (length bytes)  |
    +-----------------------+------------------------------------------+

`length` is checked the moment its 4 bytes arrive, before any of the body is buffered: 0 is a
ProtocolError, above `MAX_FRAME_NBYTES` a TooLargeError. Either leaves the stream unsynchronised,
so a `FrameBuffer` stays failed (every later `feed` raises again) and the daemon closes the
session; complete frames that arrived in the same chunk before the bad prefix are dropped with it.

Nothing here knows what a body holds: kvd/protocol/messages.py decodes bodies, and its
FrameDecoder is this buffer plus that decoding.
"""

from __future__ import annotations

import struct

from kvd.errors import KvdError, ProtocolError, TooLargeError

MAX_FRAME_NBYTES = 2 * 1024 * 1024
LENGTH = struct.Struct(">I")  # the length prefix


def protocol_error(message: str, request_id: int | None = None) -> ProtocolError:
    """A ProtocolError carrying `request_id` (None where the id itself was unreadable)."""
    exc = ProtocolError(message)
    exc.request_id = request_id  # type: ignore[attr-defined]
    return exc


def check_frame_length(nbytes: int) -> None:
    """Raise if a frame body of `nbytes` may not be sent or received."""
    if nbytes == 0:
        raise protocol_error("frame length 0: every frame carries a msgpack body")
    if nbytes > MAX_FRAME_NBYTES:
        raise TooLargeError(f"frame of {nbytes} bytes is above the {MAX_FRAME_NBYTES}-byte cap: "
                            "split the batch into smaller requests")


def prefixed(body: bytes) -> bytes:
    """`body` as one frame: its length prefix, then the body.

    Raises:
        TooLargeError: the body is above MAX_FRAME_NBYTES.
    """
    nbytes = len(body)
    if nbytes > MAX_FRAME_NBYTES:  # (never 0: a msgpack object is at least one byte)
        check_frame_length(nbytes)
    return LENGTH.pack(nbytes) + body


def whole_frames(data: bytes | bytearray | memoryview) -> list[memoryview] | None:
    """The bodies of `data` if it holds whole frames with valid lengths only, as views into it;
    else None (a partial frame or length prefix, a bad length: then `feed` it to a FrameBuffer,
    which raises or buffers as it must)."""
    view, at, end = memoryview(data), 0, len(data)
    bodies = []
    while end - at >= LENGTH.size:
        (nbytes,) = LENGTH.unpack_from(view, at)
        at += LENGTH.size
        if not 0 < nbytes <= MAX_FRAME_NBYTES or nbytes > end - at:
            return None
        bodies.append(view[at:at + nbytes])
        at += nbytes
    return bodies if bodies and at == end else None


class FrameBuffer:
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

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Append `data`; return the body of every frame it completed, in order.

        Raises:
            ProtocolError: a length prefix of 0 (now or on any earlier feed).
            TooLargeError: a length prefix above MAX_FRAME_NBYTES (now or earlier).
        """
        if self._error is not None:
            raise self._error
        buffer = self._buffer
        if not buffer and len(data) >= LENGTH.size:
            # The common case, one whole frame per chunk, without copying through the buffer.
            (nbytes,) = LENGTH.unpack_from(data)
            if len(data) == LENGTH.size + nbytes and 0 < nbytes <= MAX_FRAME_NBYTES:
                return [bytes(data[LENGTH.size:])]
        buffer += data
        bodies: list[bytes] = []
        offset = 0
        while len(buffer) - offset >= LENGTH.size:
            (nbytes,) = LENGTH.unpack_from(buffer, offset)
            try:
                check_frame_length(nbytes)
            except KvdError as exc:
                self._error = exc
                raise
            end = offset + LENGTH.size + nbytes
            if end > len(buffer):
                break
            bodies.append(bytes(buffer[offset + LENGTH.size:end]))
            offset = end
        del buffer[:offset]
        return bodies
