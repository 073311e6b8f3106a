"""The client library: a session with a kvd daemon plus zero-copy views of its segment.

Theory of operation
-------------------
`kvd.connect()` opens the Unix socket, says `hello` (protocol version; the daemon answers with
the geometry and the segment's name and uuid) and maps the segment read-write. From then on
requests carry only metadata — block ids, hashes, token ids — and KV bytes are written and read
in place through NumPy views of the mapping (`pool`, `view`), never through the socket.

The client is synchronous: one request in flight, its reply read before the call returns. That
keeps a call's cost at one round trip and needs no threads. A `Client` is not thread-safe (one
socket, one reply in flight): give each thread its own `kvd.connect()`. A `Client` belongs to the process that
made it: in a forked child every call raises InUseError, because the child would otherwise share
the parent's session (and its pins) silently. Call `kvd.connect()` again in the child.

If the daemon goes away mid-session (a crash followed by `kvd start --recover`, or an upgrade
with `kvd stop --keep`), the next call reconnects with bounded exponential backoff. Ops that hold
nothing from the lost session are retried (RETRIED_OPS), ops that only drop pins succeed
(SATISFIED_BY_RESTART), and the rest raise DisconnectedError once reconnected, because the
blocks or sequences they name died with the old session. Pins a caller took before the restart
died too, even when the call that noticed it was retried. A recovered daemon serves the same
segment, so every view stays valid. A daemon that started clean serves a new segment: views
taken before show the old, unlinked memory, where writes reach nobody, so the call that notices
raises DisconnectedError whatever its op (the client is reconnected; take `pool` and views
again). The old mapping is unmapped as soon as no view holds it.

A reply that does not come within `timeout_s` closes the client: the daemon may still answer
(or have applied the request), so the session cannot go on; it is not taken for a restart.

Views are built with `np.frombuffer` over the mapping, so `close()` raises InUseError while any
view is alive rather than leaving readers on unmapped memory; drop views before closing.
"""

from __future__ import annotations

import operator
import os
import socket
import time
import weakref
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvd.errors import (
    BadArgsError, DeniedError, DisconnectedError, InUseError, KvdError, NotFoundError,
)
from kvd.geometry import Geometry
from kvd.hashing import token_bytes
from kvd.protocol import (
    PROTOCOL_VERSION, FrameDecoder, FrameEncoder, decode_reply,
)
from kvd.runtime import resolve_socket
from kvd.segment import Segment

_RECV_NBYTES = 256 * 1024

# After the daemon restarts (crash + `kvd start --recover`, or stop --keep + start), the client
# reconnects. These ops hold nothing from the lost session, so they are simply sent again: a
# lookup or alloc whose reply was lost had its pins dropped with the old session.
RETRIED_OPS = frozenset({"stats", "lookup", "alloc", "seq_open"})
# These only drop pins, which the restart dropped already: they succeed.
SATISFIED_BY_RESTART = frozenset({"release", "seq_close"})
# Everything else names blocks or sequences of the lost session (seal, pin, seq_extend,
# seq_commit, seq_fork, shutdown) and raises DisconnectedError after reconnecting.
_live_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _disown_after_fork() -> None:
    for client in list(_live_clients):
        client._is_forked = True


os.register_at_fork(after_in_child=_disown_after_fork)


@dataclass
class Sequence:
    """A daemon-side sequence: its block table grows in place as tokens are appended.

    `num_cached_tokens` tokens at the start were found in the cache when it was opened: their KV
    is already in the blocks, so prefill starts there.
    """

    seq_id: int
    block_ids: list[int]
    num_tokens: int
    num_cached_tokens: int = 0
    num_sealed_blocks: int = 0
    is_closed: bool = field(default=False, repr=False)
    epoch: int = field(default=0, repr=False)  # the client's num_reconnects when opened


class Client:
    """One session with a daemon. Use as a context manager or call `close()`."""

    def __init__(self, socket_path: str, timeout_s: float | None = None,
                 reconnect_timeout_s: float = 10.0) -> None:
        """Args:
            timeout_s: how long one reply may take (None: wait forever).
            reconnect_timeout_s: how long to keep retrying (with backoff) when the daemon goes
                away mid-session, e.g. while it restarts with --recover; 0 never reconnects.
        """
        if timeout_s is not None and not (_is_seconds(timeout_s) and timeout_s > 0):
            raise BadArgsError("timeout_s must be a number of seconds > 0, or None to wait for "
                               f"every reply, got {timeout_s!r}")
        if not (_is_seconds(reconnect_timeout_s) and reconnect_timeout_s >= 0):
            raise BadArgsError("reconnect_timeout_s must be a number of seconds >= 0 (0: never "
                               f"reconnect), got {reconnect_timeout_s!r}")
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.num_reconnects = 0
        self._sock: socket.socket | None = None
        self._segment: Segment | None = None
        self._stale_segments: list[Segment] = []
        self._pool: np.ndarray | None = None
        self._next_id = 1
        # Reused for every reply (the decoder copies what it keeps): sock.recv(_RECV_NBYTES)
        # would have malloc map, fault in and unmap 256 KiB per call (bench/control_plane.py).
        self._recv_view = memoryview(bytearray(_RECV_NBYTES))
        self._encoder = FrameEncoder()  # a Client is used by one thread at a time
        self._pid = os.getpid()
        self._is_forked = False
        try:
            self._open_session()
        except BaseException:
            self._teardown()
            raise
        _live_clients.add(self)

    def _open_session(self) -> socket.socket:
        """Connect, say hello, map the segment the daemon serves (keeping a mapping of it);
        returns the session's socket (also `_sock`)."""
        self._decoder = FrameDecoder()
        self._sock = sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
        except PermissionError:  # the socket or its directory belongs to another user
            raise DeniedError(f"no permission to connect to {self.socket_path}: a daemon serves "
                              "its own user only; run as that user or start your own "
                              "daemon") from None
        except OSError as exc:  # absent, refused, or a backlog full for longer than timeout_s
            raise DisconnectedError(f"no kvd daemon at {self.socket_path} ({exc}): start one "
                                    "with `kvd start`") from None
        try:
            self.info = self._request(sock, "hello", {"version": PROTOCOL_VERSION,
                                                      "pid": os.getpid()})
        except TimeoutError:
            raise DisconnectedError(f"the kvd daemon at {self.socket_path} did not answer "
                                    f"hello within timeout_s={self.timeout_s} s") from None
        self.geometry = Geometry.from_dict(self.info["geometry"])
        self.session_id: int = self.info["session_id"]
        if self._segment is not None and self._segment.uuid == self.info["segment_uuid"]:
            return sock  # a recovered daemon serves the same segment: every view stays valid
        if self._segment is not None:
            # A new segment: old views point at the old (unlinked) memory; keep it mapped while
            # they live so they never touch unmapped pages, and hand out views of the new one.
            self._stale_segments.append(self._segment)
            self._segment, self._pool = None, None
        self._close_stale_segments()
        try:
            segment = Segment.attach(self.info["segment"])
        except NotFoundError:  # the daemon was replaced between its hello and our attach
            raise DisconnectedError(f"segment {self.info['segment']} is gone (the daemon "
                                    "restarted): reconnect") from None
        if segment.uuid != self.info["segment_uuid"]:
            segment.close()  # no view of it was handed out
            raise DisconnectedError(f"segment {self.info['segment']} is not the one the "
                                    "daemon serves (it was replaced): reconnect")
        self._segment = segment
        return sock

    def _close_stale_segments(self) -> None:
        """Unmap replaced segments no view holds any more (their memory goes back to the host)."""
        still_viewed = []
        for segment in self._stale_segments:
            try:
                segment.close()
            except InUseError:
                still_viewed.append(segment)
        self._stale_segments = still_viewed

    # ---- plumbing --------------------------------------------------------------------------
    def _call(self, op: str, args: dict[str, Any]) -> Any:
        """One request; if the daemon went away, reconnect and retry or raise (see RETRIED_OPS)."""
        if self._is_forked:  # set by os.register_at_fork in a child: no getpid() per call
            raise InUseError(f"this kvd connection belongs to process {self._pid}: call "
                             "kvd.connect() in the child process instead of sharing it")
        sock = self._sock
        if sock is None:
            raise DisconnectedError("the client is closed: call kvd.connect() again")
        try:
            return self._request(sock, op, args)
        except TimeoutError:
            raise self._timed_out(op) from None
        except DisconnectedError as lost:
            if self.reconnect_timeout_s <= 0:
                self._close_socket()  # a half-read reply would put every later call out of step
                raise
            segment_uuid = self.info["segment_uuid"]  # (the mapped segment's: _open_session)
            sock = self._reconnect(sock, lost)
        if self.info["segment_uuid"] != segment_uuid:
            raise DisconnectedError(
                f"the kvd daemon restarted clean during {op!r} and serves a new segment: "
                "nothing cached survived, and views and `pool` taken before show the old, "
                "unlinked memory (writes there reach nobody): take them again; the client is "
                "reconnected")
        if op in SATISFIED_BY_RESTART:
            return None
        if op not in RETRIED_OPS:
            raise DisconnectedError(
                f"the kvd daemon restarted during {op!r}: this session's pins, unsealed blocks "
                "and sequences are gone (sealed blocks survive a --recover restart: look them "
                "up again); the client is reconnected")
        try:
            return self._request(sock, op, args)
        except TimeoutError:
            raise self._timed_out(op) from None
        except DisconnectedError:
            self._close_socket()  # gone again at once: leave reconnecting to the caller
            raise

    def _timed_out(self, op: str) -> DisconnectedError:
        """Close the client after a reply did not come in time (a late one would answer the
        next request) and say so."""
        self._close_socket()
        return DisconnectedError(
            f"no reply to {op!r} within timeout_s={self.timeout_s} s: the client is closed (the "
            "daemon drops this session's pins, unsealed blocks and sequences; the request may "
            "have been applied); call kvd.connect() again")

    def _request(self, sock: socket.socket, op: str, args: dict[str, Any]) -> Any:
        request_id = self._next_id
        self._next_id += 1
        view = self._recv_view
        try:
            frame = self._encoder.request(request_id, op, args)
        except TypeError as exc:  # msgpack has no encoding for an argument's type
            raise BadArgsError(f"{op}: an argument cannot be sent ({exc}); pass ints, bytes, "
                               "str, lists and None") from None
        try:
            sock.sendall(frame)
        except TimeoutError:
            raise  # the caller's to tell from a lost daemon
        except OSError as exc:
            self._raise_parting_error(sock)
            raise DisconnectedError(f"lost the kvd daemon at {self.socket_path}: {exc}") from None
        decoder, reply = self._decoder, None
        try:
            while True:  # one request in flight: the first complete frame is its reply
                nbytes = sock.recv_into(view)
                if not nbytes:
                    raise DisconnectedError(f"the kvd daemon at {self.socket_path} closed the "
                                            "connection")
                chunk = view[:nbytes]
                replies = decoder.replies(chunk)  # the usual reply, decoded in C
                if replies is not None:
                    reply = replies[0]
                    break
                bodies = decoder.feed(chunk)
                if bodies:
                    break
        except TimeoutError:
            raise
        except OSError as exc:
            raise DisconnectedError(f"lost the kvd daemon at {self.socket_path}: {exc}") from None
        reply_id, result = reply if reply is not None else decode_reply(bodies[0])
        if reply_id != request_id:
            raise DisconnectedError(f"reply {reply_id} does not answer request {request_id}: "
                                    "the session is out of step, reconnect")
        return result

    def _raise_parting_error(self, sock: socket.socket) -> None:
        """Raise the error the daemon sent before closing, if any. A daemon refusing a
        connection (another uid) sends one error frame and closes at once, so a request sent
        after that fails with EPIPE while the frame waits unread in our socket."""
        data = bytearray()
        try:
            sock.setblocking(False)
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:
            pass  # nothing (more) buffered
        try:
            bodies = self._decoder.feed(bytes(data))
        except KvdError:
            return  # not a frame: a plain disconnect
        if bodies:
            decode_reply(bodies[0])  # raises the error it carries

    def _reconnect(self, lost_sock: socket.socket, lost: DisconnectedError) -> socket.socket:
        """Retry the connection with exponential backoff for up to reconnect_timeout_s;
        returns the new session's socket."""
        lost_sock.close()
        deadline = time.monotonic() + self.reconnect_timeout_s
        delay_s = 0.02
        while True:
            try:
                sock = self._open_session()
                self.num_reconnects += 1
                return sock
            except DisconnectedError:
                self._close_socket()  # (closed: later calls say so at once)
                if time.monotonic() + delay_s > deadline:
                    raise DisconnectedError(f"{lost}; no daemon came back within "
                                            f"{self.reconnect_timeout_s} s") from None
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 0.5)
            except BaseException:
                self._close_socket()
                raise

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _teardown(self) -> None:
        self._close_socket()
        self._pool = None
        segments, self._stale_segments = self._stale_segments, []
        if self._segment is not None:
            segments.append(self._segment)
            self._segment = None
        for segment in segments:
            segment.close()

    def close(self) -> None:
        """End the session (the daemon releases its pins) and unmap the segment.

        Raises InUseError if a view of the segment is still alive (the socket is closed anyway).
        """
        _live_clients.discard(self)
        self._teardown()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # An exception is passing through: its traceback's frames often still hold views, so
        # unmapping would raise InUseError and hide the real error. End the session and leave
        # the mapping to the garbage collector (it is unmapped once the last view is gone).
        _live_clients.discard(self)
        self._close_socket()
        self._pool = self._segment = None
        self._stale_segments = []

    @property
    def is_closed(self) -> bool:
        return self._sock is None

    # ---- blocks --------------------------------------------------------------------------
    @property
    def pool(self) -> np.ndarray:
        """Every block: `(num_blocks, num_layers, 2, block_size, H, D)`, a view of shared memory."""
        if self._pool is None:
            if self._segment is None:
                raise DisconnectedError("the client is closed: call kvd.connect() again")
            self._pool = self._segment.pool
        return self._pool

    def view(self, block_id: int) -> np.ndarray:
        """One block `(num_layers, 2, block_size, H, D)`, a view into shared memory (no copy)."""
        return self.pool[self._checked_id(block_id)]

    def generation(self, block_id: int) -> int:
        """The block's generation counter; it changes whenever the block is freed and reused."""
        block_id = self._checked_id(block_id)
        if self._segment is None:
            raise DisconnectedError("the client is closed: call kvd.connect() again")
        return int(self._segment.generations[block_id])

    def _checked_id(self, block_id: int) -> int:
        if type(block_id) is not int and not isinstance(block_id, np.integer):
            raise BadArgsError(f"block_id must be an int, got {block_id!r}")
        if not 0 <= block_id < self.geometry.num_blocks:  # -1 would silently be the last block
            raise BadArgsError(f"block_id must be in [0, {self.geometry.num_blocks}), "
                               f"got {block_id}")
        return block_id

    def alloc(self, num_blocks: int) -> list[int]:
        """`num_blocks` writable blocks owned by this session. Raises NoSpaceError."""
        return self._call("alloc", {"num_blocks": _int(num_blocks, "num_blocks")})

    def seal(self, block_ids: SequenceOf[int], hashes: SequenceOf[bytes],
             parents: SequenceOf[bytes | None] | None = None,
             tiers: SequenceOf[int] | None = None) -> list[bool]:
        """Publish filled blocks under content hashes; returns which ones entered the index.

        Args:
            parents: per block, the hash of the block before it in its chain (None for a
                chain's head; earlier blocks of the same call may be parents). The daemon then
                never evicts a parent before its cached children, so no chain is left with a
                stranded middle. For blocks hashed with `kvd.hash_blocks(tokens, size, parent)`
                that is `[parent, *hashes[:-1]]`. Sequences do this themselves.
            tiers: per block, 0 (written by prefill) or 1 (by decode), for a `--tiers` daemon.
        """
        args: dict[str, Any] = {"block_ids": _ints(block_ids, "block_ids"),
                                "hashes": _list(hashes, "hashes")}
        if parents is not None:
            args["parents"] = _list(parents, "parents")
        if tiers is not None:
            args["tiers"] = _ints(tiers, "tiers")
        return self._call("seal", args)

    def lookup(self, hashes: SequenceOf[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes`, pinned for this session."""
        return self._call("lookup", {"hashes": _list(hashes, "hashes")})

    def pin(self, block_ids: SequenceOf[int]) -> None:
        """One more pin on each sealed block (to share it)."""
        self._call("pin", {"block_ids": _ints(block_ids, "block_ids")})

    def release(self, block_ids: SequenceOf[int]) -> None:
        """Drop one pin per block; unsealed blocks are freed, sealed ones stay cached."""
        self._call("release", {"block_ids": _ints(block_ids, "block_ids")})

    def stats(self) -> dict[str, Any]:
        return self._call("stats", {})

    def shutdown(self, keep: bool = False) -> None:
        """Ask the daemon to stop (keep=True keeps segment and journal for a restart)."""
        self._call("shutdown", {"keep": keep})

    # ---- sequences -------------------------------------------------------------------------
    def open_sequence(self, token_ids: Any, salt: bytes = b"",
                      max_cached_tokens: int | None = None) -> Sequence:
        """Open a sequence: reuse the longest cached prefix, allocate the rest (one round trip).

        At most `max_cached_tokens` (default: all but the last token, whose logits an engine
        needs) come from the cache; write KV for tokens `[num_cached_tokens, num_tokens)`.
        """
        args: dict[str, Any] = {"tokens": token_bytes(token_ids), "salt": salt}
        if max_cached_tokens is not None:
            args["max_cached_tokens"] = _int(max_cached_tokens, "max_cached_tokens")
        reply = self._call("seq_open", args)
        return Sequence(reply["seq_id"], reply["block_ids"], reply["num_tokens"],
                        reply["num_cached_tokens"], reply["num_sealed_blocks"],
                        epoch=self.num_reconnects)

    def _check_live(self, seq: Sequence) -> None:
        if seq.epoch != self.num_reconnects:
            raise DisconnectedError(f"sequence {seq.seq_id} was opened before the daemon "
                                    "restarted and is gone: open it again (its sealed prefix "
                                    "is found in the cache)")

    def extend_sequence(self, seq: Sequence, token_ids: Any,
                        num_computed: int | None = None) -> list[int]:
        """Append tokens, allocating blocks; first seal full blocks below `num_computed`
        (default: the tokens before this call). Returns the new block ids."""
        self._check_live(seq)
        data = token_bytes(token_ids)
        num_computed = (seq.num_tokens if num_computed is None
                        else _int(num_computed, "num_computed"))
        new_ids = self._call("seq_extend", {"seq_id": seq.seq_id, "tokens": data,
                                            "num_computed": num_computed})
        seq.num_sealed_blocks = max(seq.num_sealed_blocks,
                                    num_computed // self.geometry.block_size)
        seq.block_ids.extend(new_ids)
        seq.num_tokens += len(data) // 4
        return new_ids

    def commit_sequence(self, seq: Sequence, num_computed: int | None = None) -> int:
        """Seal the full blocks below `num_computed` tokens (default all); returns how many."""
        self._check_live(seq)
        num_computed = (seq.num_tokens if num_computed is None
                        else _int(num_computed, "num_computed"))
        num_sealed = self._call("seq_commit", {"seq_id": seq.seq_id,
                                               "num_computed": num_computed})
        seq.num_sealed_blocks += num_sealed
        return num_sealed

    def fork_sequence(self, seq: Sequence) -> Sequence:
        """A new sequence sharing `seq`'s sealed blocks; its unsealed blocks are copies."""
        self._check_live(seq)
        reply = self._call("seq_fork", {"seq_id": seq.seq_id})
        return Sequence(reply["seq_id"], reply["block_ids"], reply["num_tokens"],
                        seq.num_cached_tokens, reply["num_sealed_blocks"],
                        epoch=self.num_reconnects)

    def close_sequence(self, seq: Sequence) -> None:
        """Release the sequence's blocks (sealed ones stay cached for others)."""
        if seq.epoch == self.num_reconnects:  # else the restart released them already
            self._call("seq_close", {"seq_id": seq.seq_id})
        seq.is_closed = True


def _is_seconds(value: Any) -> bool:
    return type(value) in (int, float)  # not bool, whose `True` would be one second


def _int(value: Any, name: str) -> int:
    """`value` as a plain int (msgpack cannot pack np.int64); never truncates a float."""
    try:
        return operator.index(value)
    except TypeError:
        raise BadArgsError(f"{name} must be an int, got {value!r}") from None


def _ints(values: Any, name: str) -> list[int]:
    """Plain ints from a sequence of ints or NumPy integers (1.7 or "0" are refused, not cut)."""
    index = operator.index
    try:
        return [index(value) for value in values]
    except TypeError:
        raise BadArgsError(f"{name} must be a sequence of ints, got {values!r}") from None


def _list(values: Any, name: str) -> list[Any]:
    try:
        return list(values)
    except TypeError:
        raise BadArgsError(f"{name} must be a sequence, got {values!r}") from None


def connect(name_or_socket_path: str | None = None, timeout_s: float | None = None,
            reconnect_timeout_s: float = 10.0) -> Client:
    """Connect to a daemon by name (default `$KVD_NAME` or "default") or socket path."""
    return Client(resolve_socket(name_or_socket_path), timeout_s, reconnect_timeout_s)
