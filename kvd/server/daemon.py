"""The daemon: one thread, one selector, every client served in turn.

Theory of operation
-------------------
`Daemon.start()` takes the name's flock (single instance: a second daemon of the same name is
refused *before* anything touches the socket path), creates the shared-memory segment, builds the
pool over the segment's generation counters, binds the socket (0600 inside a 0700 directory) and
writes the pidfile. `serve_forever()` then multiplexes with `selectors`:

    listening socket   accept → SO_PEERCRED: another uid is refused with DENIED; otherwise a
                       session is opened and the peer's pidfd is watched
    client socket      recv → FrameDecoder (a chunk of whole frames is decoded in C at once,
                       kvd/protocol/_wire.c; any other goes frame by frame through the Python path) →
                       for each request: Service.handle; the replies of one recv go out in one
                       send -- at once, or after the iteration's journal commit if a seal
                       awaits it (group commit)
    peer pidfd         readable when the peer process dies — even if a forked child still holds
                       the socket, so EOF would come late or never — closes the session at once
    signal pipe        SIGTERM/SIGINT (set_wakeup_fd) stop the loop

After each iteration's handlers (`serve_once`), the journal commits what they changed (one group
commit: the seals of every client served in the iteration share it), then every held reply goes
out, then the idle work no reply waits for: the journal's upkeep (kvd/server/journal.py: compaction
steps and WAL checkpoints) and, on a full pool, choosing the next victim ahead of the next
allocation (kvd/core/pool.py). (One more non-blocking select before the commit, to let requests that
arrived meanwhile join it, was measured and dropped: with 4 clients at batch 16 it cost 5-8
points of seal throughput, bench/recovery.py.)

A connection is closed for framing errors (the byte stream is unsynchronised), when its peer
dies, and when it lets more than MAX_OUTPUT_NBYTES of replies pile up unread. Closing releases the
session's pins and frees its unsealed blocks (Service.close_session). Every other bad request gets
an error reply and the session goes on; an unexpected exception in a handler is logged and
answered INTERNAL — no client can take the daemon down.

Why selectors and not asyncio: the loop does no awaiting, every handler is a short synchronous
call, and a plain selector loop avoids a transport and a protocol callback per request. Measured
(bench/control_plane.py, the same echo server on both, alternating): selectors 22.6 µs p50 round
trip and 13.0 µs server CPU per request, an asyncio Protocol 26.6 µs and 15.8 µs.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import selectors
import signal
import socket
import sqlite3
import stat
import struct
import time
from time import perf_counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvd.errors import (
    BadArgsError, DeniedError, InternalError, InUseError, JournalError, KvdError, ProtocolError,
)
from kvd.geometry import Geometry
from kvd.hashing import HASH_VERSION
from kvd.server.journal import JOURNAL_VERSION, Journal, failpoint, remove_journal
from kvd.server.metrics import OpStats, serve_metrics
from kvd.core.policies import make_policy
from kvd.core.pool import BlockPool, IndexRows
from kvd.protocol import FrameDecoder, FrameEncoder, decode_request, encode_error
from kvd.runtime import SHM_DIR, DaemonPaths
from kvd.runtime import state_dir as state_dir_of
from kvd.segment import LAYOUT_VERSION, Segment, current_boot_id
from kvd.server.service import Service, Session

log = logging.getLogger("kvd")

RECV_NBYTES = 256 * 1024
MAX_OUTPUT_NBYTES = 16 * 1024 * 1024
ACCEPT_RETRY_S = 1.0  # out of fds: how long the listener rests before the loop tries again
_PEERCRED = struct.Struct("3i")


@dataclass(eq=False)  # identity semantics: connections live in sets
class Connection:
    sock: socket.socket
    session: Session
    pidfd: int | None
    decoder: FrameDecoder = field(default_factory=FrameDecoder)
    output: bytearray = field(default_factory=bytearray)
    # Replies of this loop iteration, held until the journal commits:
    # (request_id, reply frame, whether the request changed journaled state).
    pending: list[tuple[int | None, bytes, bool]] = field(default_factory=list)
    is_writing: bool = False  # registered for EVENT_WRITE


def take_lock(paths: DaemonPaths) -> int:
    """Take the single-instance flock; returns its fd. Raises DeniedError if a daemon holds it."""
    fd = os.open(paths.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DeniedError(f"a kvd daemon named {paths.name!r} is already running "
                          f"{_pid_text(paths)}: stop it (kvd stop --name {paths.name}) or "
                          "choose another --name") from None
    return fd


def _pid_text(paths: DaemonPaths) -> str:
    try:
        with open(paths.pid_path) as file:
            return f"(pid {int(file.read().strip())})"
    except (OSError, ValueError):
        return ""


def _is_answered(socket_path: str) -> bool:
    """Whether something accepts connections on the Unix socket at `socket_path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(socket_path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
    return True


def is_running(paths: DaemonPaths) -> bool:
    """Whether a daemon holds the name's lock."""
    try:
        fd = os.open(paths.lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@dataclass(frozen=True)
class StartOptions:
    """What `Daemon.start` needs of its flags and nothing after it."""

    policy: str
    tiers: str | None
    metrics_port: int | None
    recover: bool
    journal: bool


class Daemon:
    """A kvd daemon serving one pool. `start()`, then `serve_forever()`; `stop()` from a handler."""

    def __init__(self, paths: DaemonPaths, geometry: Geometry, policy: str = "default",
                 metrics_port: int | None = None, state_dir: str | None = None,
                 recover: bool = False, journal: bool = True, tiers: str | None = None) -> None:
        """Args:
            tiers: `--tiers` (e.g. prefill=0.7,decode=0.3): a prefill/decode TieredPolicy.
            state_dir: where the journal lives (default: runtime.state_dir(name)).
            recover: re-attach the segment and journal a previous daemon left, if they match.
            journal: keep the crash-recovery journal (off: faster seals, nothing survives).
        """
        if metrics_port is not None and not (type(metrics_port) is int
                                             and 0 <= metrics_port <= 65535):
            raise BadArgsError(f"metrics port must be an int in [0, 65535], got {metrics_port!r}")
        # Fewer than 30 attributes per Daemon: from 30 on, CPython 3.11 stops sharing instance
        # dict keys and every `self.x` of the loop gets slower (bench/request_path.py: the
        # daemon's own path 4 % slower at 30). What only start() reads is one attribute.
        self.paths = paths
        self.geometry = geometry
        self.options = StartOptions(policy, tiers, metrics_port, recover, journal)
        self.state_dir = state_dir or str(state_dir_of(paths.name))
        self.keep_on_stop = False  # (also set while a failed start must keep what it found)
        self.journal: Journal | None = None
        self.num_restored = 0
        self.ops = OpStats()
        self._time_op = self.ops.latency.since  # (bound once: it runs for every request)
        self._lock_fd: int | None = None
        self._listener: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._connections: dict[int, Connection] = {}  # by socket fd
        self._replied: set[Connection] = set()  # connections with replies held for the commit
        # One receive buffer for every connection (the decoder copies what it keeps):
        # sock.recv(RECV_NBYTES) would have malloc map and unmap 256 KiB on every call.
        self._recv_view = memoryview(bytearray(RECV_NBYTES))
        self._encoder = FrameEncoder()  # the loop's own: replies are packed on this thread only
        self._frame = self._encoder.frame
        self._signal_r, self._signal_w = socket.socketpair()
        self._signal_r.setblocking(False)
        self._signal_w.setblocking(False)
        self._is_stopping = False
        self._accept_retry_at: float | None = None  # not accepting (out of fds) until then
        self._next_journal_retry = 0.0
        self.segment: Segment | None = None
        self.service: Service | None = None

    # ---- start / stop ------------------------------------------------------------------------
    def start(self) -> None:
        self._lock_fd = take_lock(self.paths)
        try:
            self._install_signals()  # first: a SIGTERM during start must still clean up
            self._open_pool()
            self._bind()
            self._write_pidfile()
            if self.options.metrics_port is not None:
                self._serve_metrics()
        except BaseException:
            self._cleanup()  # (keeping what a recovery re-attached: see _open_pool)
            raise
        self.keep_on_stop = False

    def _serve_metrics(self) -> None:
        try:
            serve_metrics(self.options.metrics_port, self.service.stats, self.ops)
        except OSError as exc:
            error = InUseError if exc.errno == errno.EADDRINUSE else KvdError
            raise error(f"cannot serve metrics on 127.0.0.1:{self.options.metrics_port}: "
                        f"{exc.strerror or exc}") from None

    def _open_pool(self) -> None:
        """Recover the previous segment and index if asked and valid, else start clean."""
        if self.options.journal:
            self.journal = Journal(self.state_dir)
        recovered = self._recover() if self.options.recover else None
        pool = None
        if recovered is not None:
            self.segment, rows = recovered
            # From here a failed start leaves the crashed daemon's segment and journal as it
            # found them, for the next --recover: a bad flag must not cost the cache.
            self.keep_on_stop = True
            pool = self._new_pool()
            failpoint("during-recovery")
            try:
                self.num_restored = pool.restore(rows)
            except BadArgsError as exc:  # a journal the pool cannot take: never map it
                log.warning("recovery: %s; starting clean", exc)
                self.keep_on_stop, pool = False, None  # (the old mapping goes with the pool)
            else:
                _bump_free_generations(pool, self.segment.generations)
                log.info("recovered segment %s: %d of %d journaled blocks restored from %s",
                         self.segment.name, self.num_restored, len(rows.block_ids),
                         self.journal.path)
        if pool is None:
            self._create_segment()
            pool = self._new_pool()
        info = {"segment": self.segment.name, "segment_uuid": self.segment.uuid,
                "daemon_pid": os.getpid(), "name": self.paths.name}
        self.service = Service(pool, self.geometry, _block_copier(self.segment.pool), info,
                               self.ops, on_shutdown=self._on_shutdown)
        self._handle = self.service.handle
        if self.journal is not None:
            self.service.journal_state = "ok"

    def _new_pool(self) -> BlockPool:
        num_blocks = self.geometry.num_blocks
        policy = make_policy(self.options.policy, num_blocks, tiers=self.options.tiers)
        return BlockPool(num_blocks, policy, self.segment.generations, observer=self.journal)

    def _create_segment(self) -> None:
        stale = SHM_DIR + self.paths.segment_name
        if os.path.exists(stale):  # we hold the lock, so no live daemon uses it
            log.warning("removing stale segment %s left by a daemon that crashed or stopped "
                        "with --keep (kvd start --recover keeps it)", self.paths.segment_name)
            os.unlink(stale)
        self.segment = Segment.create(self.paths.segment_name, self.geometry)
        if self.journal is not None:
            self.journal.reset(_stamp(self.segment))
        elif Path(self.state_dir) == state_dir_of(self.paths.name):
            # A journal there describes a segment that is gone (say, kept by stop --keep and
            # then started clean with --no-journal): nothing would ever remove it. (Only under
            # the name's own default: the lock held covers nothing else.)
            remove_journal(self.state_dir)

    def _recover(self) -> tuple[Segment, IndexRows] | None:
        """The previous segment and its journaled blocks, or None (logged) to start clean."""
        if self.journal is None:
            log.warning("recovery: --recover needs the journal; starting clean")
            return None
        try:
            segment = Segment.attach(self.paths.segment_name)
        except KvdError as exc:
            log.warning("recovery: no usable segment (%s); starting clean", exc)
            return None
        expected = _stamp(segment)
        stamp = self.journal.read_stamp()
        reason = None
        if segment.boot_id != current_boot_id():
            reason = "the segment is from another boot"
        elif segment.geometry != self.geometry:
            reason = f"geometry changed from {segment.geometry} to {self.geometry}"
        elif stamp != expected:
            reason = (f"the journal in {self.journal.path} does not describe this segment "
                      f"(journal {stamp or 'empty'}, segment {expected})")
        if reason is None:
            try:
                return segment, self.journal.load()
            except (JournalError, sqlite3.Error, ValueError) as exc:  # unreadable: never map it
                reason = f"the journal in {self.journal.path} cannot be read ({exc})"
        log.warning("recovery: %s; starting clean", reason)
        segment.close()
        return None

    def _bind(self) -> None:
        path = self.paths.socket_path
        # The name's lock does not cover a --socket path another name may serve, or a file a
        # typo names: replace only a socket nobody answers on (a dead daemon's).
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(mode):
                raise InUseError(f"{path} exists and is not a socket: refusing to replace it "
                                 "(choose another --socket)")
            if _is_answered(path):
                raise InUseError(f"another daemon serves {path} (started under another "
                                 "--name): stop it or choose another --socket")
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(path)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        listener.listen(512)
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, (self._on_listener, None))
        self._selector.register(self._signal_r, selectors.EVENT_READ,
                                (self._on_signal_pipe, None))

    def _write_pidfile(self) -> None:
        tmp = f"{self.paths.pid_path}.{os.getpid()}"
        with open(tmp, "w") as file:
            file.write(f"{os.getpid()}\n")
        os.replace(tmp, self.paths.pid_path)

    def _install_signals(self) -> None:
        signal.set_wakeup_fd(self._signal_w.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        self._is_stopping = True

    def stop(self, keep: bool | None = None) -> None:
        """Ask the loop to stop after this iteration."""
        if keep is not None:
            self.keep_on_stop = keep
        self._is_stopping = True

    def _cleanup(self) -> None:
        for connection in list(self._connections.values()):
            self._close(connection, "daemon stopping")
        if self._listener is not None:
            self._listener.close()
            self._unlink_quietly(self.paths.socket_path)
        if self.segment is not None and not self.keep_on_stop:
            self.segment.unlink()
        if self.journal is not None:
            if self.keep_on_stop and self.service is not None:
                self._commit_journal()  # pending tombstones: a smaller log to replay
                self.journal.close()
            else:
                self.journal.remove()
        self._unlink_quietly(self.paths.pid_path)
        self._selector.close()
        self._signal_r.close()
        self._signal_w.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock last: the name is free only now
            self._lock_fd = None

    @staticmethod
    def _unlink_quietly(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    # ---- the loop ----------------------------------------------------------------------------
    # Every registration's data is (handler, connection or None): the loop calls the handler
    # directly, so a request costs one call layer from select() to recv (bench/control_plane.py
    # measures the request path against an echo server; each layer is ~0.1-0.2 µs of a ~20 µs
    # round trip, and more after a wake-up with cold caches).
    def serve_forever(self) -> None:
        try:
            while not self._is_stopping:
                self.serve_once(1.0)
        except BaseException:
            # A kvd bug escaped the loop (handlers' errors never do): end like a crash, keeping
            # what --recover restores, rather than like a plain stop that removes the cache.
            self.keep_on_stop = self.keep_on_stop or self.journal is not None
            log.exception("the loop failed: stopping%s", ", keeping segment and journal for "
                          "--recover" if self.keep_on_stop else "")
            raise
        finally:
            log.info("stopped: %s", "kept segment for restart" if self.keep_on_stop
                     else "segment and socket removed")
            self._cleanup()

    def serve_once(self, timeout_s: float | None) -> None:
        """One loop iteration: wait up to `timeout_s` for events, handle them, commit, reply.

        serve_forever calls it; bench/request_path.py calls it inline to measure the request
        path without a scheduler in between.
        """
        for key, mask in self._selector.select(timeout_s):
            handler, connection = key.data
            try:
                handler(connection, mask)
            except Exception:  # a kvd bug: drop the one connection involved, keep serving
                log.exception("internal error in %s", handler.__name__)
                if connection is not None:
                    self._close(connection, "internal error")
        if self._replied or self.service.write_error is not None:
            # (Otherwise nothing waits: seals only come with held replies, and the journal's
            # upkeep is only due after a commit; a failed journal retries on its timer.)
            self._commit_and_reply()
        # The replies are out: while the clients think, ask the policy for the next victim of
        # a full pool, a third of the next allocation's eviction (kvd/core/pool.py).
        self.service.pool.choose_next_victim()
        if self._accept_retry_at is not None and time.monotonic() >= self._accept_retry_at:
            self._resume_accepting()

    def _on_listener(self, _: None, mask: int) -> None:
        self._accept()

    def _on_signal_pipe(self, _: None, mask: int) -> None:
        self._signal_r.recv(4096)

    def _on_peer_exit(self, connection: Connection, mask: int) -> None:
        self._close(connection, "peer process exited")

    def _accept(self) -> None:
        for _ in range(64):  # drain a burst without starving established clients
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: the listener stays readable
                # Stop listening for a while rather than spin on it (and flood the log): a
                # session's close frees fds, and the loop retries within a second anyway.
                log.error("accept failed: %s; not accepting until a session closes (or %g s)",
                          exc, ACCEPT_RETRY_S)
                self._selector.unregister(self._listener)
                self._accept_retry_at = time.monotonic() + ACCEPT_RETRY_S
                return
            self._admit(sock)

    def _resume_accepting(self) -> None:
        self._accept_retry_at = None
        self._selector.register(self._listener, selectors.EVENT_READ, (self._on_listener, None))

    def _admit(self, sock: socket.socket) -> None:
        pid, uid, _ = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if uid != os.getuid():
            log.warning("refused pid %d of uid %d: the daemon serves uid %d only",
                        pid, uid, os.getuid())
            _send_quietly(sock, encode_error(None, DeniedError(
                f"this daemon serves uid {os.getuid()} only, you are uid {uid}")))
            sock.close()
            return
        sock.setblocking(False)
        session = self.service.open_session(pid, uid)
        pidfd, is_alive = _open_pidfd(pid)
        connection = Connection(sock, session, pidfd)
        self._connections[sock.fileno()] = connection
        self._selector.register(sock, selectors.EVENT_READ, (self._read, connection))
        if not is_alive:
            self._close(connection, "peer process exited before accept")
            return
        if pidfd is not None:
            self._selector.register(pidfd, selectors.EVENT_READ, (self._on_peer_exit, connection))
        log.debug("session %d: pid %d connected", session.session_id, pid)

    def _on_writable(self, connection: Connection, mask: int) -> None:
        """A connection with unsent replies (registered for writing too)."""
        if mask & selectors.EVENT_WRITE:
            self._flush(connection)
        if mask & selectors.EVENT_READ and connection.sock.fileno() in self._connections:
            self._read(connection, mask)

    def _read(self, connection: Connection, mask: int) -> None:
        try:
            nbytes = connection.sock.recv_into(self._recv_view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(connection, f"recv failed: {exc}")
            return
        if not nbytes:
            self._close(connection, "closed by peer")
            return
        chunk, session = self._recv_view[:nbytes], connection.session
        requests = connection.decoder.requests(chunk)  # the usual chunk, decoded in C
        if requests is not None:  # (and the usual one request without a comprehension's frame)
            replies = ([self._reply(session, None, requests[0])] if len(requests) == 1 else
                       [self._reply(session, None, request) for request in requests])
        else:
            try:
                bodies = connection.decoder.feed(chunk)
            except KvdError as exc:  # bad length prefix: the stream cannot be resynchronised
                self.ops.error(exc.code)
                _send_quietly(connection.sock, bytes(connection.output) + encode_error(None, exc))
                self._close(connection, f"framing error: {exc}")
                return
            replies = [self._reply(session, body) for body in bodies]
        if self.journal is not None and self.journal.num_seals_pending:
            connection.pending += replies  # held for this iteration's commit
            self._replied.add(connection)
            return
        # Nothing uncommitted exists, so no reply can reveal it: out they go.
        data = replies[0][1] if len(replies) == 1 else b"".join([r for _, r, _ in replies])
        if connection.output:
            self._send(connection, data)
            return
        try:  # _send's common case inline: a frame less per request is 0.3-0.4 us here
            sent = connection.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._close(connection, f"send failed: {exc}")
            return
        if sent != len(data):
            connection.output += data[sent:]
            self._flush(connection)

    def _reply(self, session: Session, body: bytes | None,
               request: tuple[int, str, dict[str, Any]] | None = None
               ) -> tuple[int | None, bytes, bool]:
        """Handle one frame body, or the request already decoded from it: (request id, reply
        frame, whether it awaits the journal)."""
        started = perf_counter()
        request_id = op = None
        journal = self.journal
        num_seals = journal.num_seals_pending if journal is not None else 0
        try:
            request_id, op, args = request if request is not None else decode_request(body)
            reply = self._frame([request_id, True, self._handle(session, op, args)])
        except KvdError as exc:
            if isinstance(exc, ProtocolError) and request_id is None:
                request_id = getattr(exc, "request_id", None)
            self.ops.error(exc.code)
            reply = self._encoder.error(request_id, exc)
        except Exception as exc:  # a kvd bug: answer it, log it, keep serving everyone
            log.exception("internal error handling %s for session %d", op, session.session_id)
            self.ops.error("INTERNAL")
            reply = self._encoder.error(request_id,
                                        InternalError(f"{type(exc).__name__}: {exc}"))
        self._time_op(op, started)  # (any op the service does not handle is not timed)
        return request_id, reply, journal is not None and journal.num_seals_pending != num_seals

    def _commit_and_reply(self) -> None:
        """Group commit: one journal transaction for the iteration, then every held reply goes
        out, then the journal's upkeep (compaction, WAL checkpoints), which no reply waits for.

        A connection's replies are held (`_read`) while seals of this iteration are not yet
        committed, so that no client hears "sealed" before the seal is durable, and no reply
        reveals a seal that a crash could still take back (see kvd/server/journal.py for why evictions
        need not force a commit).
        """
        failure = None
        if self.journal is not None:
            failure = self._commit_journal()
        for connection in self._replied:
            if connection.sock.fileno() in self._connections:
                self._send_pending(connection, failure)
        self._replied.clear()
        if self.journal is not None and self.service.write_error is None:
            self._tidy_journal()

    def _send_pending(self, connection: Connection, failure: JournalError | None) -> None:
        """Send the connection's replies; `failure` replaces those that awaited a failed commit."""
        replies = []
        for request_id, reply, is_journaled in connection.pending:
            if failure is not None and is_journaled:
                self.ops.error(failure.code)
                reply = encode_error(request_id, failure)
            replies.append(reply)
        connection.pending.clear()
        self._send(connection, b"".join(replies))  # one reply: joined without a copy

    def _send(self, connection: Connection, data: bytes) -> None:
        """Send `data` after any output still queued; queue what the socket does not take."""
        if not connection.output:  # the common case: straight to the socket, no buffer copies
            sent = self._send_now(connection, data)
            if sent is None or sent == len(data):
                return
            data = data[sent:]
        connection.output += data
        self._flush(connection)

    def _send_now(self, connection: Connection, data: bytes | bytearray) -> int | None:
        """What the socket takes of `data` now, in bytes; None if sending failed (closed)."""
        try:
            return connection.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self._close(connection, f"send failed: {exc}")
            return None

    def _commit_journal(self) -> JournalError | None:
        """Commit (or, after a failure, try a full rewrite); returns the error if it failed."""
        journal = self.journal
        try:
            if self.service.write_error is not None:
                if time.monotonic() < self._next_journal_retry:
                    return None  # writes are refused meanwhile, nothing can be pending
                journal.rewrite(self.service.pool.journal_rows())
                log.warning("journal writable again (%s): accepting writes", journal.path)
                self.service.write_error = None
            elif journal.num_seals_pending:  # tombstones alone wait (kvd/server/journal.py)
                journal.commit()
                self.service.counters["journal_commits"] += 1
        except JournalError as exc:
            self._journal_failed(exc)
            return exc
        return None

    def _tidy_journal(self) -> None:
        try:
            self.journal.tidy()
        except JournalError as exc:  # no reply depends on it, but the disk is failing writes
            self._journal_failed(exc)

    def _journal_failed(self, exc: JournalError) -> None:
        """Fail closed: refuse allocations and seals, retry a full rewrite in a second."""
        if self.service.write_error is None:
            log.error("%s; refusing allocations and seals until it recovers", exc)
        self.service.counters["journal_failures"] += 1
        self.service.write_error = str(exc)
        self._next_journal_retry = time.monotonic() + 1.0

    def _on_shutdown(self, keep: bool) -> None:
        self.stop(keep=keep)
        log.info("shutdown requested by a client (keep=%s)", keep)

    def _flush(self, connection: Connection) -> None:
        output = connection.output
        if output:
            sent = self._send_now(connection, output)
            if sent is None:
                return
            del output[:sent]
        if len(output) > MAX_OUTPUT_NBYTES:
            self._close(connection, f"{len(output)} bytes of replies unread: client not reading")
            return
        wants_write = bool(output)
        if wants_write != connection.is_writing:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if wants_write else 0)
            handler = self._on_writable if wants_write else self._read
            self._selector.modify(connection.sock, events, (handler, connection))
            connection.is_writing = wants_write

    def _close(self, connection: Connection, reason: str) -> None:
        fd = connection.sock.fileno()
        if self._connections.pop(fd, None) is None:
            return
        self._selector.unregister(connection.sock)
        connection.sock.close()
        if connection.pidfd is not None:
            self._selector.unregister(connection.pidfd)
            os.close(connection.pidfd)
        session = connection.session
        held = sum(len(self.service.pool.holdings(owner))
                   for owner in (session.session_id, *session.seq_ids))
        self.service.close_session(session)
        log.info("session %d (pid %d) closed: %s; released %d blocks",
                 session.session_id, session.pid, reason, held)
        if self._accept_retry_at is not None and not self._is_stopping:
            self._resume_accepting()  # its fds are free again


def _stamp(segment: Segment) -> dict[str, Any]:
    """What a journal must agree with to be restored into `segment`."""
    return {"journal_version": JOURNAL_VERSION, "layout_version": LAYOUT_VERSION,
            "hash_version": HASH_VERSION,
            "geometry": segment.geometry.to_dict(), "segment_uuid": segment.uuid.hex(),
            "boot_id": segment.boot_id.hex()}


def _bump_free_generations(pool: BlockPool, generations: Any) -> None:
    """After recovery every block that was not restored is FREE: make stale ids detectable."""
    is_free = np.frombuffer(pool.states(), dtype=np.uint8) == 0
    generations[is_free] += 1


def _block_copier(blocks: Any) -> Any:
    def copy_block(src: int, dst: int) -> None:
        blocks[dst] = blocks[src]
    return copy_block


def _open_pidfd(pid: int) -> tuple[int | None, bool]:
    """A pidfd for `pid` and whether the process is alive (pidfd None: not available here)."""
    try:
        return os.pidfd_open(pid), True
    except ProcessLookupError:
        return None, False
    except OSError as exc:  # old kernel or a sandbox: dead workers are then noticed at EOF
        log.warning("pidfd_open(%d) failed (%s): relying on socket EOF", pid, exc)
        return None, True


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.setblocking(False)
        sock.send(data)
    except OSError:
        pass
