"""The client library: a session with a kvd daemon plus zero-copy views of its segment.

Theory of operation
-------------------
`kvd.connect()` opens the Unix socket, says `hello` (protocol version; the daemon answers with
the geometry and the segment's name and uuid) and maps the segment read-write. From then on
requests carry only metadata — block ids, hashes, token ids — and KV bytes are written and read
in place through NumPy views of the mapping (`pool`, `view`), never through the socket.

Every call is synchronous for its caller: it returns once its reply is read. A `Client` may be
shared by threads, whose requests are then in flight on its one connection together:
  * a thread frames and sends its request under `_send_lock` (frames never interleave), after
    putting a reply slot under the request's id in `_pending`;
  * replies come back in request order, each tagged with its id. Whichever waiting thread finds
    nobody reading becomes the reader: it reads chunks and hands every reply to its slot, waking
    that slot's thread, until its own reply is in; then it wakes one sleeping waiter to take the
    reading over. So a lone thread reads its own reply, as a single-threaded client does, and no
    thread is spent on reading while nobody waits. `_mutex` guards the slots and the reading.
  * if the daemon goes away, every request in flight fails with the same loss; the first thread
    to handle it reconnects and the others find the session already replaced (by `epoch`, the
    `num_reconnects` each request was sent under), so `num_reconnects` grows by one per restart
    and each thread's call is then retried or raises as a lone caller's would (below). A thread
    with no call in flight then is told at its next call, as if that call had noticed: every
    thread sees a restart exactly once, and its own ids of the old session never reach the new
    one (ids one thread hands another across a restart are theirs to drop);
  * `close()` (or a timeout) from any thread fails every call in flight or waiting to send with
    DisconnectedError: it shuts the socket down, which wakes a reader blocked in recv.
A `Client` belongs to the process that made it: in a forked child every call raises InUseError,
because the child would otherwise share the parent's session (and its pins) silently. Call
`kvd.connect()` again in the child.

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
(or have applied the request), so the session cannot go on; it is not taken for a restart. The
same holds for a reply that answers no request in flight.

Views are built with `np.frombuffer` over the mapping, so `close()` raises InUseError while any
view is alive rather than leaving readers on unmapped memory; drop views before closing.
"""

from __future__ import annotations

import operator
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvd.errors import (
    BadArgsError, DeniedError, DisconnectedError, InUseError, KvdError, NotFoundError,
)
from kvd.geometry import Geometry, num_outside_window
from kvd.hashing import token_bytes
from kvd.protocol import (
    PROTOCOL_VERSION, FrameDecoder, FrameEncoder, decode_reply,
)
from kvd.runtime import resolve_socket
from kvd.segment import Segment

_RECV_NBYTES = 256 * 1024
RECHECK_S = 0.05  # how long a thread waiting for its reply sleeps before it looks again

# After the daemon restarts (crash + `kvd start --recover`, or stop --keep + start), the client
# reconnects. These ops hold nothing from the lost session, so they are simply sent again: a
# lookup or alloc whose reply was lost had its pins dropped with the old session.
RETRIED_OPS = frozenset({"stats", "lookup", "alloc", "seq_open"})
# These only drop pins, which the restart dropped already: they succeed.
SATISFIED_BY_RESTART = frozenset({"release", "seq_close"})
# Everything else names blocks or sequences of the lost session (seal, pin, seq_extend,
# seq_commit, seq_fork, shutdown) and raises DisconnectedError after reconnecting. An op
# addressed to a pool or a model (OP@NAME) follows its OP's rule.
_live_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _disown_after_fork() -> None:
    for client in list(_live_clients):
        client._is_forked = True
        # Another thread of the parent may have held them at the fork: the child's are fresh.
        client._send_lock, client._mutex = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_disown_after_fork)


@dataclass
class Sequence:
    """A daemon-side sequence: its block table grows in place as tokens are appended.

    `num_cached_tokens` tokens at the start were found in the cache when it was opened: their KV
    is already in the blocks, so prefill starts there. `num_remote_tokens` of them came from the
    daemon's remote tier (`kvd start --remote`) for this open. On a sliding-window pool the table
    holds -1 where the daemon released a block outside the window (as a ModelSequence's does).
    """

    seq_id: int
    block_ids: list[int]
    num_tokens: int
    num_cached_tokens: int = 0
    num_sealed_blocks: int = 0
    num_remote_tokens: int = 0
    is_closed: bool = field(default=False, repr=False)
    epoch: int = field(default=0, repr=False)  # the client's num_reconnects when opened
    pool: str | None = None  # the pool it was opened on (None: the session's)
    # leading blocks shared with a fork (a window pool keeps them while any sharer lives)
    num_shared_blocks: int = field(default=0, repr=False)


class BlockIds(list[int]):
    """A lookup's block ids (a list), and `num_remote`: how many of them the daemon's remote
    tier (`kvd start --remote`) fetched for this lookup (after the local prefix); the others
    were cached locally."""

    def __init__(self, block_ids: Iterable[int] = (), num_remote: int = 0) -> None:
        super().__init__(block_ids)
        self.num_remote = num_remote


@dataclass
class ModelSequence:
    """A sequence spanning the pools of a model (`Client.open_model_sequence`): one seq_id, one
    block table per pool. A sliding-window pool's table holds -1 where the daemon released a
    block outside the window (`kvd.geometry.num_outside_window`)."""

    seq_id: int
    model: str
    block_ids: dict[str, list[int]]  # pool name → its block table
    num_tokens: int
    num_cached_tokens: int = 0
    num_sealed_blocks: int = 0
    num_remote_tokens: int = 0  # of num_cached_tokens, those the remote tier supplied
    is_closed: bool = field(default=False, repr=False)
    epoch: int = field(default=0, repr=False)
    # pool name → leading blocks shared with a fork (the daemon keeps them while any sharer
    # lives, so the table shows them even outside the window; kvd/core/page_table.py)
    num_shared_blocks: dict[str, int] = field(default_factory=dict, repr=False)


class _Reply:
    """A request's reply, filled in by whichever thread reads it off the socket (under the
    client's _mutex). Class defaults: a reply is made per call, with no __init__ to run."""

    value: Any = None
    error: BaseException | None = None
    is_done = False
    wakeup: threading.Lock | None = None  # made when its thread must sleep; released to wake it
    session: tuple[int, bytes | None] | None = None  # Client._session when sent (None: not)


def _decoded(body: bytes) -> tuple[int | None, Any]:
    """(request id, result) of a reply body, or (its request id, the KvdError it carries)."""
    try:
        return decode_reply(body)
    except KvdError as exc:
        return getattr(exc, "request_id", None), exc


class Client:
    """One session with a daemon. Use as a context manager or call `close()`.

    Thread-safe: any number of threads may share one Client and call any method at once; their
    requests are in flight on its connection together and each call returns its own reply (see
    the module docstring). Pins, owned blocks and sequences belong to the session, not to a
    thread: a block one thread allocates another may seal or release.
    """

    def __init__(self, socket_path: str, timeout_s: float | None = None,
                 reconnect_timeout_s: float = 10.0, map_segment: bool = True,
                 pool: str | None = None, read_only: bool = False) -> None:
        """Args:
            pool: the pool the session's ops address (None: the daemon's only pool, or the one
                named `default`, or its first); `pool=NAME` on an op addresses another one.
            timeout_s: how long one reply may take (None: wait forever).
            reconnect_timeout_s: how long to keep retrying (with backoff) when the daemon goes
                away mid-session, e.g. while it restarts with --recover; 0 never reconnects.
            map_segment: False maps nothing, for ops that need no block (`kvd status`, `kvd
                stop`): they then work even when the daemon's segment was deleted under it.
            read_only: map the pool read-only (every view raises on a write) and refuse the ops
                that write blocks (alloc, seal, sequences) with DeniedError, for a client that
                only looks up, pins and reads.
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
        self.map_segment = map_segment
        self.pool_name = pool
        self.read_only = read_only
        self.num_reconnects = 0
        self._sock: socket.socket | None = None
        self._segment: Segment | None = None
        self._segment_uuid: bytes | None = None  # the served segment's, as of the last hello
        self._session: tuple[int, bytes | None] = (0, None)  # (set below, once connected)
        self._stale_segments: list[Segment] = []
        self._pool: np.ndarray | None = None
        self._pool_views: dict[str, tuple[np.ndarray, int, np.ndarray]] = {}  # several pools
        self._is_multi_pool = False  # the mapped segment has several pools (layout 2)
        self._next_id = 1
        # Reused for every reply (the decoder copies what it keeps): sock.recv(_RECV_NBYTES)
        # would have malloc map, fault in and unmap 256 KiB per call (bench/control_plane.py).
        self._recv_view = memoryview(bytearray(_RECV_NBYTES))
        self._encoder = FrameEncoder()  # used under _send_lock only
        # Threads (module docstring): _send_lock orders frames on the socket; _mutex guards the
        # requests in flight and the reading of replies.
        self._send_lock = threading.Lock()
        self._mutex = threading.Lock()
        self._pending: dict[int, _Reply] = {}  # request id -> its reply, until it is read
        self._is_reading = False  # a thread is reading replies (it hands each to its request)
        self._orphan_socket: socket.socket | None = None  # dropped while read: the reader closes it
        self._closed_because: str | None = None
        self._pid = os.getpid()
        self._is_forked = False
        try:
            self._open_session()
        except BaseException:
            self._teardown()
            raise
        # (num_reconnects, segment uuid): a new object per session (reconnects replace it).
        # Each thread keeps the one its last call saw, so a thread that did not see a restart
        # is told at its next call; a thread that never called saw the first.
        self._session = (self.num_reconnects, self._segment_uuid)
        self._first_session, self._seen = self._session, threading.local()
        _live_clients.add(self)

    def _open_session(self) -> None:
        """Connect, say hello, map the segment the daemon serves (keeping a mapping of it).
        Nobody else sends meanwhile: the constructor, or a reconnect under _send_lock."""
        self._decoder = FrameDecoder()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
        except PermissionError:  # the socket or its directory belongs to another user
            sock.close()
            raise DeniedError(f"no permission to connect to {self.socket_path}: a daemon serves "
                              "its own user only; run as that user or start your own "
                              "daemon") from None
        except OSError as exc:  # absent, refused, or a backlog full for longer than timeout_s
            sock.close()
            raise DisconnectedError(f"no kvd daemon at {self.socket_path} ({exc}): start one "
                                    "with `kvd start`") from None
        self._sock, hello = sock, _Reply()
        try:
            hello_args: dict[str, Any] = {"version": PROTOCOL_VERSION, "pid": os.getpid()}
            if self.pool_name is not None:
                hello_args["pool"] = self.pool_name
            self._send("hello", hello_args, hello)
        except DisconnectedError:
            self._raise_parting_error()
            raise
        try:
            self.info = self._wait(hello)
        except TimeoutError:
            raise DisconnectedError(f"the kvd daemon at {self.socket_path} did not answer "
                                    f"hello within timeout_s={self.timeout_s} s") from None
        self.geometry = Geometry.from_dict(self.info["geometry"])
        # Every pool's geometry (a daemon before pools has one, unnamed: "default").
        self.pools = {name: Geometry.from_dict(data)
                      for name, data in self.info.get("pools", {"default": self.info["geometry"]}
                                                      ).items()}
        self.session_id: int = self.info["session_id"]
        if not self.map_segment:
            return
        if self._segment_uuid == self.info["segment_uuid"]:
            return  # a recovered daemon serves the same segment: every view stays valid
        if self._segment is not None:
            # A new segment: old views point at the old (unlinked) memory; keep it mapped while
            # they live so they never touch unmapped pages, and hand out views of the new one.
            self._stale_segments.append(self._segment)
            self._segment, self._segment_uuid, self._pool = None, None, None
            self._pool_views = {}
        self._close_stale_segments()
        try:
            segment = Segment.attach(self.info["segment"], self.read_only)
        except NotFoundError:  # the daemon was replaced between its hello and our attach
            raise DisconnectedError(f"segment {self.info['segment']} is gone (the daemon "
                                    "restarted): reconnect") from None
        if segment.uuid != self.info["segment_uuid"]:
            segment.close()  # no view of it was handed out
            raise DisconnectedError(f"segment {self.info['segment']} is not the one the "
                                    "daemon serves (it was replaced): reconnect")
        self._segment, self._segment_uuid = segment, segment.uuid
        self._is_multi_pool = segment.is_multi_pool

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
        reply = _Reply()
        try:
            return self._request(op, args, reply)
        except TimeoutError:
            raise self._timed_out(op) from None
        except DisconnectedError as lost:
            if self._closed_because is not None:
                raise self._closed_error() from None
            if reply.session is None:  # not sent: told of a restart another thread handled
                raise
            self._reconnect_once(reply, lost)
        self._seen.session = self._session
        if self._after_restart(op, reply.session[1], "during"):
            return None
        try:
            return self._request(op, args, _Reply())
        except TimeoutError:
            raise self._timed_out(op) from None
        except DisconnectedError as lost:
            if self._closed_because is None:  # gone again at once: leave reconnecting to the caller
                self._shut(f"the daemon went away again: {lost}")
            raise

    def _notice(self, op: str) -> bool:
        """If this thread has not called since a reconnect (another thread's), tell it of the
        restart now, as the call that noticed it is told, since its pins, blocks and sequences
        died as well (and their ids may name the new session's blocks). A thread's first call
        counts as having seen the first session. Returns True if the op is done: it only
        dropped pins, which the restart dropped."""
        seen = getattr(self._seen, "session", self._first_session)
        if seen is self._session:
            return False
        self._seen.session = self._session
        return self._after_restart(op, seen[1], "before")

    def _after_restart(self, op: str, segment_uuid: bytes | None, when: str) -> bool:
        """Apply the restart rules (module docstring) to `op`, sent or about to be sent `when`
        the daemon restarted, by a caller who last saw segment `segment_uuid`. Returns True if
        the op is done (SATISFIED_BY_RESTART), False if it is to be sent (RETRIED_OPS)."""
        if self._segment_uuid != segment_uuid:  # (a clean start's new segment)
            raise DisconnectedError(
                f"the kvd daemon restarted clean {when} {op!r} and serves a new segment: "
                "nothing cached survived, and views and `pool` taken before show the old, "
                "unlinked memory (writes there reach nobody): take them again; the client is "
                "reconnected")
        kind = op.partition("@")[0]  # (OP@POOL and OP@MODEL follow OP's rule)
        if kind in SATISFIED_BY_RESTART:
            return True
        if kind not in RETRIED_OPS:
            raise DisconnectedError(
                f"the kvd daemon restarted {when} {op!r}: this session's pins, unsealed blocks "
                "and sequences are gone (sealed blocks survive a --recover restart: look them "
                "up again); the client is reconnected")
        return False

    def _request(self, op: str, args: dict[str, Any], reply: _Reply) -> Any:
        """Send one request and wait for its reply (read by this thread or another), unless
        this thread is to be told of a restart first (checked under _send_lock, which a
        reconnect holds: the request goes to the session the thread has seen)."""
        send_lock = self._send_lock
        send_lock.acquire()  # (locks are taken without `with` here: 0.2 µs less each, timeit
        try:  # on the CPython 3.11 we run, where a request costs the client ~5 µs)
            if self.num_reconnects and self._notice(op):
                return None
            self._send(op, args, reply)
        finally:
            send_lock.release()
        return self._wait(reply)

    def _send(self, op: str, args: dict[str, Any], reply: _Reply) -> None:
        """Frame and send a request whose reply `reply` awaits. The caller holds _send_lock:
        frames must not interleave, and the encoder's Packer is not thread-safe."""
        sock = self._sock
        if sock is None:
            raise self._closed_error()
        request_id = self._next_id
        self._next_id = request_id + 1
        try:
            frame = self._encoder.request(request_id, op, args)
        except TypeError as exc:  # msgpack has no encoding for an argument's type
            raise BadArgsError(f"{op}: an argument cannot be sent ({exc}); pass ints, bytes, "
                               "str, lists and None") from None
        reply.session = self._session
        # Before the send: another thread may read the reply. Not under _mutex (one lock pair a
        # request saved), so the walks of _pending under _mutex go over a copy: a slot added
        # meanwhile broke a walk of the dict itself ("dictionary changed size during iteration").
        self._pending[request_id] = reply
        try:
            sock.sendall(frame)
        except OSError as exc:
            with self._mutex:
                self._pending.pop(request_id, None)
            if isinstance(exc, TimeoutError):
                raise  # the caller's to tell from a lost daemon
            raise DisconnectedError(f"lost the kvd daemon at {self.socket_path}: {exc}") from None

    def _wait(self, reply: _Reply) -> Any:
        """`reply`'s result: read the socket while no other thread does, else sleep until the
        reader hands over the reply or the reading. Raises the reply's error, DisconnectedError,
        or TimeoutError (the reply took longer than timeout_s)."""
        deadline, mutex = None, self._mutex
        while True:
            mutex.acquire()
            try:
                is_reader = not reply.is_done and not self._is_reading
                if is_reader:
                    self._is_reading = True
                elif not reply.is_done and reply.wakeup is None:
                    reply.wakeup = threading.Lock()
                    reply.wakeup.acquire()  # held while there is no news; released to wake us
                wakeup = reply.wakeup
            finally:
                mutex.release()
            if is_reader:
                self._read_until(reply)  # (returns with the reply done)
            elif wakeup is not None and not reply.is_done:
                # A sleeper looks again at least every RECHECK_S and takes the reading itself if
                # it is free, so a hand-over lost to a bug costs 50 ms, not a hang. (The one seen:
                # a reconnect cleared the slots of threads asleep on the lost connection before
                # its reader had failed them; reconnects now fail them under _mutex, waking them.)
                if self.timeout_s is None:
                    wakeup.acquire(timeout=RECHECK_S)
                    continue
                deadline = deadline or time.monotonic() + self.timeout_s
                left_s = deadline - time.monotonic()
                if not wakeup.acquire(timeout=max(0.0, min(left_s, RECHECK_S))) and left_s <= 0:
                    raise TimeoutError
                continue
            if reply.error is not None:
                raise reply.error
            return reply.value

    def _read_until(self, reply: _Reply) -> None:
        """Read replies, handing each to its request, until `reply` is done; the caller has
        taken the reading (_is_reading). On leaving, wake a waiter to take it over; if the
        connection failed, fail every request in flight with it."""
        sock, view, decoder, mutex = self._sock, self._recv_view, self._decoder, self._mutex
        try:
            while True:
                try:
                    nbytes = sock.recv_into(view) if sock is not None else 0
                except TimeoutError:
                    raise
                except OSError as exc:
                    raise DisconnectedError(f"lost the kvd daemon at {self.socket_path}: "
                                            f"{exc}") from None
                if not nbytes:
                    raise DisconnectedError(f"the kvd daemon at {self.socket_path} closed the "
                                            "connection")
                chunk = view[:nbytes]
                replies: SequenceOf[tuple[int | None, Any]] | None = decoder.replies(chunk)  # C
                if replies is None:
                    replies = [_decoded(body) for body in decoder.feed(chunk)]
                mutex.acquire()
                try:
                    for request_id, value in replies:
                        pending = self._pending.pop(request_id, None)  # type: ignore[arg-type]
                        if pending is reply and not isinstance(value, KvdError):
                            reply.value, reply.is_done = value, True  # ours: nobody to wake
                        else:
                            self._deliver(request_id, pending, value)
                    if reply.is_done:
                        if self._pending or self._orphan_socket is not None:
                            self._stop_reading(sock)
                        else:  # (a lone caller's usual end: nobody to hand the reading to)
                            self._is_reading = False
                        return
                finally:
                    mutex.release()
        except TimeoutError:  # (the caller closes the client, failing the others)
            with mutex:
                self._stop_reading(sock)
            raise
        except DisconnectedError as exc:
            with mutex:
                # Fail what was sent on this socket, unless a reconnect or close dropped it
                # (and failed those already): the slots now in flight are the new session's,
                # e.g. a reconnect's hello, sent while this reader still held the reading.
                if sock is self._sock:
                    self._fail_pending(str(exc))
                self._stop_reading(sock)
            raise
        except BaseException as exc:  # a reply we cannot place: the stream is out of step
            with mutex:
                self._stop_reading(sock)
            self._shut(f"the session is out of step: {exc}")
            raise

    def _stop_reading(self, sock: socket.socket | None) -> None:
        """Give up the reading: close the socket if it was dropped meanwhile, else wake one
        sleeping waiter to take the reading over (a waiter not asleep yet finds it free by
        itself). Under _mutex."""
        self._is_reading = False
        if sock is not None and sock is self._orphan_socket:
            sock.close()
            self._orphan_socket = None
        for pending in list(self._pending.values()):
            if pending.wakeup is not None:
                if pending.wakeup.locked():
                    pending.wakeup.release()
                return

    def _deliver(self, request_id: int | None, pending: _Reply | None, value: Any) -> None:
        """Hand a reply (a result, or the KvdError to raise) to `pending`, the request of
        `request_id` (None: no request in flight has that id). Under _mutex."""
        if pending is None:
            if isinstance(value, KvdError):  # an error the daemon could not tie to a request
                raise value
            raise DisconnectedError(f"reply {request_id} answers no request in flight: the "
                                    "session is out of step, reconnect")
        if isinstance(value, KvdError):
            self._finish(pending, None, value)
        else:
            self._finish(pending, value, None)

    def _fail_pending(self, reason: str) -> None:
        """Fail every request in flight with DisconnectedError(reason). Under _mutex. Pops by a
        copy of the ids: a sending thread adds its slot without _mutex, and a slot added meanwhile
        must stay (its thread finds the connection's fate itself) rather than vanish unanswered."""
        for request_id in list(self._pending):
            self._finish(self._pending.pop(request_id), None, DisconnectedError(reason))

    @staticmethod
    def _finish(reply: _Reply, value: Any, error: BaseException | None) -> None:
        """Fill `reply` and wake its thread if it sleeps. Under _mutex."""
        reply.value, reply.error, reply.is_done = value, error, True
        if reply.wakeup is not None and reply.wakeup.locked():
            reply.wakeup.release()

    def _reconnect_once(self, reply: _Reply, lost: DisconnectedError) -> None:
        """Reconnect after `lost` unless another thread did since `reply` was sent; raise if the
        client closes instead."""
        if self.reconnect_timeout_s <= 0:
            self._shut(str(lost))  # a half-read reply would put every later call out of step
            raise lost
        with self._send_lock:  # nobody sends while the session is replaced
            if self._closed_because is not None:
                raise self._closed_error() from None
            if self._session is reply.session:
                self._reconnect(lost)

    def _timed_out(self, op: str) -> DisconnectedError:
        """Close the client after a reply did not come in time (a late one would answer the
        next request) and say so."""
        reason = (f"no reply to {op!r} within timeout_s={self.timeout_s} s: the client is closed "
                  "(the daemon drops this session's pins, unsealed blocks and sequences; the "
                  "request may have been applied); call kvd.connect() again")
        self._shut(reason)
        return DisconnectedError(reason)

    def _raise_parting_error(self) -> None:
        """Raise the error the daemon sent before closing, if any. A daemon refusing a
        connection (another uid) sends one error frame and closes at once, so a hello sent
        after that fails with EPIPE while the frame waits unread in our socket."""
        sock, data = self._sock, bytearray()
        try:
            if sock is not None:
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

    def _reconnect(self, lost: DisconnectedError) -> None:
        """Retry the connection with exponential backoff for up to reconnect_timeout_s; the
        caller holds _send_lock."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        delay_s = 0.02
        while True:
            with self._mutex:
                # (Whatever is in flight was sent on the lost connection: a reader of it may not
                # have seen it end yet, and must not fail the new session's hello in its stead.)
                self._fail_pending(str(lost))
                self._drop_socket()
            try:
                self._open_session()
                self.num_reconnects += 1
                self._session = (self.num_reconnects, self._segment_uuid)
                return
            except DisconnectedError:
                if time.monotonic() + delay_s > deadline or self._closed_because is not None:
                    self._shut(f"{lost}; no daemon came back within "
                               f"{self.reconnect_timeout_s} s")
                    raise self._closed_error() from None
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 0.5)
            except BaseException:
                self._shut(f"reconnecting failed after: {lost}")
                raise

    def _shut(self, reason: str) -> None:
        """Close the session for good (`reason` is what later calls say): every request in
        flight fails with DisconnectedError, a thread reading replies wakes to end of file."""
        with self._mutex:
            if self._closed_because is None:
                self._closed_because = reason
            self._fail_pending(str(self._closed_error()))
            self._drop_socket()

    def _drop_socket(self) -> None:
        """Shut the socket down (a close alone wakes no thread blocked in recv) and close it, or
        leave that to the thread reading it, whose recv must not meet a reused fd. Under _mutex."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            if not self._is_forked:  # (a forked child's shutdown would end its parent's session)
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected (any more)
        if self._is_reading:
            self._orphan_socket = sock
        else:
            sock.close()

    def _closed_error(self) -> DisconnectedError:
        return DisconnectedError(f"the client is closed ({self._closed_because}): call "
                                 "kvd.connect() again")

    def _teardown(self) -> None:
        self._shut("close() was called")
        self._pool, self._pool_views = None, {}
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
        self._shut("its with block raised")
        self._pool = self._segment = None
        self._pool_views = {}
        self._stale_segments = []

    @property
    def is_closed(self) -> bool:
        return self._closed_because is not None

    # ---- blocks --------------------------------------------------------------------------
    @property
    def pool(self) -> np.ndarray:
        """Every block of the session's pool, a view of shared memory: `(num_blocks, num_layers,
        parts, block_size, H, D)`; on a daemon of several pools `(num_slabs, blocks_per_slab,
        ...)`, block b at `[b // blocks_per_slab, b % blocks_per_slab]` (use `view`)."""
        if self._pool is None:
            segment = self._mapped()
            self._pool = (segment.slabs_of(self.info["pool"]) if segment.is_multi_pool
                          else segment.pool)
        return self._pool

    def _mapped(self) -> Segment:
        if not self.map_segment:
            raise InUseError("this client was made with map_segment=False: it maps no "
                             "block; use kvd.connect()")
        if self._segment is None:
            raise DisconnectedError("the client is closed: call kvd.connect() again")
        return self._segment

    def _pool_view(self, pool: str) -> tuple[np.ndarray, int, np.ndarray]:
        """(slabs view, blocks per slab, generations) of a named pool of a multi-pool segment."""
        view = self._pool_views.get(pool)
        if view is None:
            segment = self._mapped()
            if pool not in segment.pools:
                raise NotFoundError(f"no pool {pool!r}: this daemon serves "
                                    f"{', '.join(segment.pools)}")
            view = self._pool_views[pool] = (segment.slabs_of(pool),
                                             segment.pools[pool].blocks_per_slab,
                                             segment.generations_of(pool))
        return view

    def view(self, block_id: int, pool: str | None = None) -> np.ndarray:
        """One block `(num_layers, parts, block_size, H, D)` of the session's pool (or of
        `pool`), a view into shared memory (no copy)."""
        if pool is None and not self._is_multi_pool:
            return self.pool[self._checked_id(block_id)]
        slabs, blocks_per_slab, _ = self._pool_view(self.info["pool"] if pool is None else pool)
        return slabs[divmod(self._checked_id(block_id, pool), blocks_per_slab)]

    def generation(self, block_id: int, pool: str | None = None) -> int:
        """The block's generation counter; it changes whenever the block is freed and reused."""
        block_id = self._checked_id(block_id, pool)
        segment = self._mapped()
        if pool is None and not segment.is_multi_pool:
            return int(segment.generations[block_id])
        return int(self._pool_view(self.info["pool"] if pool is None else pool)[2][block_id])

    def _checked_id(self, block_id: int, pool: str | None = None) -> int:
        if type(block_id) is not int and not isinstance(block_id, np.integer):
            raise BadArgsError(f"block_id must be an int, got {block_id!r}")
        geometry = self.geometry if pool is None else self._geometry_of(pool)
        if not 0 <= block_id < geometry.num_blocks:  # -1 would silently be the last block
            raise BadArgsError(f"block_id must be in [0, {geometry.num_blocks}), "
                               f"got {block_id}")
        return block_id

    def _geometry_of(self, pool: str) -> Geometry:
        geometry = self.pools.get(pool)
        if geometry is None:
            raise NotFoundError(f"no pool {pool!r}: this daemon serves {', '.join(self.pools)}")
        return geometry

    def _check_writer(self, op: str) -> None:
        if self.read_only:
            raise DeniedError(f"{op} writes blocks, and this client is read-only "
                              "(kvd.connect(..., read_only=True)): connect without read_only")

    def alloc(self, num_blocks: int, pool: str | None = None) -> list[int]:
        """`num_blocks` writable blocks owned by this session (of `pool`, default the session's).
        Raises NoSpaceError."""
        self._check_writer("alloc")
        return self._call("alloc" if pool is None else f"alloc@{pool}",
                          {"num_blocks": _int(num_blocks, "num_blocks")})

    def seal(self, block_ids: SequenceOf[int], hashes: SequenceOf[bytes],
             parents: SequenceOf[bytes | None] | None = None,
             tiers: SequenceOf[int] | None = None, pool: str | None = None) -> list[bool]:
        """Publish filled blocks under content hashes; returns which ones entered the index.

        Args:
            parents: per block, the hash of the block before it in its chain (None for a
                chain's head; earlier blocks of the same call may be parents). The daemon then
                never evicts a parent before its cached children, so no chain is left with a
                stranded middle. For blocks hashed with `kvd.hash_blocks(tokens, size, parent)`
                that is `[parent, *hashes[:-1]]`. Sequences do this themselves.
            tiers: per block, 0 (written by prefill) or 1 (by decode), for a `--tiers` daemon.
            pool: the blocks' pool (default the session's); likewise for every op below.
        """
        self._check_writer("seal")
        args: dict[str, Any] = {"block_ids": _ints(block_ids, "block_ids"),
                                "hashes": _list(hashes, "hashes")}
        if parents is not None:
            args["parents"] = _list(parents, "parents")
        if tiers is not None:
            args["tiers"] = _ints(tiers, "tiers")
        return self._call("seal" if pool is None else f"seal@{pool}", args)

    def lookup(self, hashes: SequenceOf[bytes], pool: str | None = None) -> BlockIds:
        """Block ids of the longest cached prefix of `hashes`, pinned for this session (a list;
        its `num_remote`: how many of them the daemon's remote tier supplied for this call)."""
        args: dict[str, Any] = {"hashes": _list(hashes, "hashes")}
        if self.info.get("remote"):  # (a daemon without a tier has nothing to split)
            args["remote"] = 1
        reply = self._call("lookup" if pool is None else f"lookup@{pool}", args)
        if type(reply) is dict:
            return BlockIds(reply["block_ids"], reply["num_remote"])
        return BlockIds(reply)

    def pin(self, block_ids: SequenceOf[int], pool: str | None = None) -> None:
        """One more pin on each sealed block (to share it)."""
        self._call("pin" if pool is None else f"pin@{pool}",
                   {"block_ids": _ints(block_ids, "block_ids")})

    def release(self, block_ids: SequenceOf[int], pool: str | None = None) -> None:
        """Drop one pin per block; unsealed blocks are freed, sealed ones stay cached."""
        self._call("release" if pool is None else f"release@{pool}",
                   {"block_ids": _ints(block_ids, "block_ids")})

    def stats(self) -> dict[str, Any]:
        return self._call("stats", {})

    def shutdown(self, keep: bool = False) -> None:
        """Ask the daemon to stop (keep=True keeps segment and journal for a restart)."""
        self._call("shutdown", {"keep": keep})

    # ---- sequences -------------------------------------------------------------------------
    def open_sequence(self, token_ids: Any, salt: bytes = b"",
                      max_cached_tokens: int | None = None, pool: str | None = None) -> Sequence:
        """Open a sequence: reuse the longest cached prefix, allocate the rest (one round trip).

        At most `max_cached_tokens` (default: all but the last token, whose logits an engine
        needs) come from the cache; write KV for tokens `[num_cached_tokens, num_tokens)`.
        """
        self._check_writer("open_sequence")
        args: dict[str, Any] = {"tokens": token_bytes(token_ids), "salt": salt}
        if max_cached_tokens is not None:
            args["max_cached_tokens"] = _int(max_cached_tokens, "max_cached_tokens")
        reply = self._call(_op("seq_open", pool), args)
        return Sequence(reply["seq_id"], reply["block_ids"], reply["num_tokens"],
                        reply["num_cached_tokens"], reply["num_sealed_blocks"],
                        reply.get("num_remote_tokens", 0), epoch=self.num_reconnects, pool=pool)

    def _check_live(self, seq: Sequence | ModelSequence) -> None:
        if seq.epoch != self.num_reconnects:
            raise DisconnectedError(f"sequence {seq.seq_id} was opened before the daemon "
                                    "restarted and is gone: open it again (its sealed prefix "
                                    "is found in the cache)")

    def extend_sequence(self, seq: Sequence, token_ids: Any,
                        num_computed: int | None = None) -> list[int]:
        """Append tokens, allocating blocks; first seal full blocks below `num_computed`
        (default: the tokens before this call). Returns the new block ids."""
        self._check_writer("extend_sequence")
        self._check_live(seq)
        data = token_bytes(token_ids)
        num_computed = (seq.num_tokens if num_computed is None
                        else _int(num_computed, "num_computed"))
        new_ids = self._call(_op("seq_extend", seq.pool), {
            "seq_id": seq.seq_id, "tokens": data, "num_computed": num_computed})
        block_size = (self.geometry if seq.pool is None else self._geometry_of(seq.pool)
                      ).block_size
        seq.num_sealed_blocks = max(seq.num_sealed_blocks, num_computed // block_size)
        seq.block_ids.extend(new_ids)
        self._mark_released(seq.block_ids, seq.num_shared_blocks, seq.pool, num_computed)
        seq.num_tokens += len(data) // 4
        return new_ids

    def commit_sequence(self, seq: Sequence, num_computed: int | None = None) -> int:
        """Seal the full blocks below `num_computed` tokens (default all); returns how many."""
        self._check_writer("commit_sequence")
        self._check_live(seq)
        num_computed = (seq.num_tokens if num_computed is None
                        else _int(num_computed, "num_computed"))
        num_sealed = self._call(_op("seq_commit", seq.pool), {"seq_id": seq.seq_id,
                                                              "num_computed": num_computed})
        seq.num_sealed_blocks += num_sealed
        self._mark_released(seq.block_ids, seq.num_shared_blocks, seq.pool, num_computed)
        return num_sealed

    def fork_sequence(self, seq: Sequence) -> Sequence:
        """A new sequence sharing `seq`'s sealed blocks; its unsealed blocks are copies."""
        self._check_writer("fork_sequence")
        self._check_live(seq)
        reply = self._call(_op("seq_fork", seq.pool), {"seq_id": seq.seq_id})
        # Both now share the parent's sealed blocks (the child has no sealed block of its own).
        seq.num_shared_blocks = reply["num_sealed_blocks"]
        return Sequence(reply["seq_id"], reply["block_ids"], reply["num_tokens"],
                        seq.num_cached_tokens, reply["num_sealed_blocks"],
                        epoch=self.num_reconnects, pool=seq.pool,
                        num_shared_blocks=reply["num_sealed_blocks"])

    def close_sequence(self, seq: Sequence) -> None:
        """Release the sequence's blocks (sealed ones stay cached for others)."""
        if seq.epoch == self.num_reconnects:  # else the restart released them already
            self._call(_op("seq_close", seq.pool), {"seq_id": seq.seq_id})
        seq.is_closed = True


    # ---- sequences of a model (several pools) ---------------------------------------------
    def open_model_sequence(self, model: str, token_ids: Any, salt: bytes = b"",
                            max_cached_tokens: int | None = None) -> ModelSequence:
        """Open a sequence in every pool of `model` (one round trip): the longest prefix every
        pool serves (a sliding-window pool: the window before it) is reused, the rest allocated.
        """
        self._check_writer("open_model_sequence")
        args: dict[str, Any] = {"tokens": token_bytes(token_ids), "salt": salt}
        if max_cached_tokens is not None:
            args["max_cached_tokens"] = _int(max_cached_tokens, "max_cached_tokens")
        reply = self._call(f"seq_open@{model}", args)
        return self._model_sequence(reply, model, reply["num_cached_tokens"])

    def _model_sequence(self, reply: dict[str, Any], model: str, num_cached_tokens: int
                        ) -> ModelSequence:
        pools = reply["pools"]
        return ModelSequence(reply["seq_id"], model,
                             {name: each["block_ids"] for name, each in pools.items()},
                             reply["num_tokens"], num_cached_tokens,
                             min(each["num_sealed_blocks"] for each in pools.values()),
                             reply.get("num_remote_tokens", 0), epoch=self.num_reconnects)

    def extend_model_sequence(self, seq: ModelSequence, token_ids: Any,
                              num_computed: int | None = None) -> dict[str, list[int]]:
        """Append tokens in every pool of the model, first committing `num_computed` (default:
        the tokens before this call); returns each pool's new block ids. Window pools release
        the blocks wholly before the window of token `num_computed` (marked -1 here)."""
        self._check_writer("extend_model_sequence")
        self._check_live(seq)
        data = token_bytes(token_ids)
        num_computed = (seq.num_tokens if num_computed is None
                        else _int(num_computed, "num_computed"))
        new_ids = self._call(f"seq_extend@{seq.model}", {
            "seq_id": seq.seq_id, "tokens": data, "num_computed": num_computed})
        for name, ids in new_ids.items():
            table = seq.block_ids[name]
            table.extend(ids)
            self._mark_released(table, seq.num_shared_blocks.get(name, 0), name, num_computed)
            seq.num_sealed_blocks = max(seq.num_sealed_blocks,
                                        num_computed // self._geometry_of(name).block_size)
        seq.num_tokens += len(data) // 4
        return new_ids

    def commit_model_sequence(self, seq: ModelSequence, num_computed: int | None = None
                              ) -> dict[str, int]:
        """Seal the full blocks below `num_computed` (default all) in every pool."""
        self._check_writer("commit_model_sequence")
        self._check_live(seq)
        num_computed = (seq.num_tokens if num_computed is None
                        else _int(num_computed, "num_computed"))
        sealed = self._call(f"seq_commit@{seq.model}", {"seq_id": seq.seq_id,
                                                        "num_computed": num_computed})
        for name, table in seq.block_ids.items():
            self._mark_released(table, seq.num_shared_blocks.get(name, 0), name, num_computed)
        seq.num_sealed_blocks += min(sealed.values())
        return sealed

    def _mark_released(self, table: list[int], num_shared: int, pool: str | None,
                       num_computed: int) -> None:
        """Mark -1 in a block table of `pool` (None: the session's) what a window pool released:
        the blocks before the window of `num_computed`, but for the `num_shared` first (shared
        with a fork)."""
        geometry = self.geometry if pool is None else self._geometry_of(pool)
        if geometry.window is not None:
            end = min(num_outside_window(num_computed, geometry.window, geometry.block_size),
                      len(table))
            table[num_shared:end] = [-1] * max(end - num_shared, 0)

    def fork_model_sequence(self, seq: ModelSequence) -> ModelSequence:
        """A new sequence of the same model sharing `seq`'s sealed blocks in every pool; its
        unsealed blocks are copies (one round trip, all pools or none)."""
        self._check_writer("fork_model_sequence")
        self._check_live(seq)
        reply = self._call(f"seq_fork@{seq.model}", {"seq_id": seq.seq_id})
        child = self._model_sequence(reply, seq.model, seq.num_cached_tokens)
        # Both now share the parent's sealed blocks (the child has no sealed block of its own).
        seq.num_shared_blocks = child.num_shared_blocks = {
            name: each["num_sealed_blocks"] for name, each in reply["pools"].items()}
        return child

    def close_model_sequence(self, seq: ModelSequence) -> None:
        """Release the sequence's blocks in every pool (sealed ones stay cached)."""
        if seq.epoch == self.num_reconnects:
            self._call(f"seq_close@{seq.model}", {"seq_id": seq.seq_id})
        seq.is_closed = True


def _op(name: str, pool: str | None) -> str:
    """The wire op addressing `pool` (None: the session's): OP@NAME (kvd/server/service.py)."""
    return name if pool is None else f"{name}@{pool}"


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
            reconnect_timeout_s: float = 10.0, pool: str | None = None,
            read_only: bool = False) -> Client:
    """Connect to a daemon by name (default `$KVD_NAME` or "default") or socket path; `pool`
    names the pool the session's ops address (None: the daemon's first, `default` for the
    single-pool flags); `read_only`: a client that only reads blocks (see Client). Raises
    NotFoundError for a pool the daemon does not serve."""
    return Client(resolve_socket(name_or_socket_path), timeout_s, reconnect_timeout_s,
                  pool=pool, read_only=read_only)
