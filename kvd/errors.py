"""Errors: one exception class per wire error code, all under `KvdError`.

The daemon replies to a bad request with `[CODE, message]`; the client raises the class that
`CODE` maps to. `ERROR_CLASSES` is the single table in both directions and a test checks it is
a bijection. Local misuse raises the same classes, so a caller catches one hierarchy whether the
mistake was found in-process or by the daemon.
"""

from __future__ import annotations


class KvdError(Exception):
    """Base of every error kvd raises. `code` is the wire code (uppercase)."""

    code = "INTERNAL"


class BadArgsError(KvdError, ValueError):
    """An argument has the wrong type, range or shape; the message names the valid range."""

    code = "BAD_ARGS"


class NoSpaceError(KvdError):
    """The pool has too few free or evictable blocks; pinned blocks are never evicted."""

    code = "NO_SPACE"


class NotFoundError(KvdError, KeyError):
    """A block, sequence or hash the request names does not exist (or is not this session's)."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else ""


class InUseError(KvdError):
    """The object is held in a way that forbids the operation (e.g. sealing a shared block)."""

    code = "IN_USE"


class ProtocolError(KvdError):
    """A frame or message broke the wire protocol. A broken frame (length prefix, msgpack) ends
    the session, as the stream cannot be resynchronised; a well-framed but malformed request
    gets this error as its reply and the session goes on."""

    code = "PROTOCOL"


class VersionError(KvdError):
    """Client and daemon speak different protocol or layout versions."""

    code = "VERSION"


class TooLargeError(KvdError):
    """A frame, batch or session is above the daemon's limits; the message names the limit and
    the `kvd start` flag that sets it."""

    code = "TOO_LARGE"


class UnknownOpError(KvdError):
    """The request names an operation the daemon does not have."""

    code = "UNKNOWN_OP"


class DeniedError(KvdError, PermissionError):
    """The peer is not allowed (other uid) or the name is taken by another live daemon."""

    code = "DENIED"


class JournalError(KvdError):
    """The crash-recovery journal cannot be written; the daemon fails closed on writes."""

    code = "JOURNAL"


class DisconnectedError(KvdError, ConnectionError):
    """The daemon went away (or never answered); reconnect or restart it."""

    code = "DISCONNECTED"


class InternalError(KvdError):
    """A bug in kvd: an invariant failed. The message says where."""

    code = "INTERNAL"


ERROR_CLASSES: dict[str, type[KvdError]] = {
    cls.code: cls
    for cls in (
        BadArgsError, NoSpaceError, NotFoundError, InUseError, ProtocolError, VersionError,
        TooLargeError, UnknownOpError, DeniedError, JournalError, DisconnectedError, InternalError,
    )
}


def error_from_wire(code: str, message: str) -> KvdError:
    """Build the exception for a daemon's `[CODE, message]` reply (unknown codes → InternalError)."""
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        return InternalError(f"daemon sent unknown error code {code!r}: {message}")
    return cls(message)
