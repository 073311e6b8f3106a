"""The loop: one thread, one selector, every client served in turn.

Theory of operation
-------------------
A `Server` serves what startup built (kvd/server/startup.py: flock, segment, pool, Service,
journal, listening socket, signal wakeup), nothing of it missing, until it is asked to stop; then
it closes every session and releases all of it (Started.resources). `serve_forever()` multiplexes
with `selectors`:

    listening socket   accept → SO_PEERCRED: another uid is refused with DENIED; otherwise a
                       session is opened and the peer's pidfd is watched
    client socket      recv → FrameDecoder (a chunk of whole frames is decoded in C at once,
                       kvd/protocol/_wire.c; any other goes frame by frame through the Python
                       path) → for each request: Service.handle; the replies of one recv go out
                       in one send -- at once, or after the iteration's journal commit if a
                       seal awaits it (group commit)
    peer pidfd         readable when the peer process dies — even if a forked child still holds
                       the socket, so EOF would come late or never — closes the session at once
    signal wakeup      SIGTERM/SIGINT (set_wakeup_fd) stop the loop
    remote fetches     --remote: readable when a pool's tier finished a fetch

After each iteration's handlers (`serve_once`), the journal commits what they changed (one group
commit: the seals of every client served in the iteration share it), then every held reply goes
out, then the idle work no reply waits for: the journal's upkeep (kvd/server/journal.py: compaction
steps and WAL checkpoints) and, on a full pool, choosing the next victim ahead of the next
allocation (kvd/core/pool.py). The commit does not wait for requests that arrive meanwhile: one
more non-blocking select to let them join it cost more seal throughput than the commits it
saved (4 clients at batch 16, `python -m bench.seal_throughput`).

A connection is closed for framing errors (the byte stream is unsynchronised), when its peer
dies, when it lets more than `--max-output-nbytes` of replies pile up unread, when the replies
all connections leave unread pass `--max-total-output-nbytes` (the connections holding the most
are closed first, until the rest fit: the one that did not read pays, not the others), and when
it has not said hello within HELLO_TIMEOUT_S of its accept (a silent connection would otherwise
hold a session and an fd forever). Connections wait for their hello in accept order, all with
the same timeout, so the loop checks only the oldest ones: nothing per request. Closing queues
the release of the session's pins and unsealed blocks (Service.close_session), and each
iteration releases at most RELEASE_STEP_PINS of them, so closing a session that holds a million
pins stalls the other clients for a step's fraction of a millisecond at a time, not for the
whole release (`python -m bench.hostile` measures it). Every other bad request gets
an error reply and the session goes on; an unexpected exception in a handler is logged and
answered INTERNAL — no client can take the daemon down. A kvd bug that escapes the loop itself
ends it like a crash, keeping segment and journal for --recover.

Deferred replies (--remote): a lookup or seq_open whose pools lack blocks it could hit is not
run at once; its reply is left out of its recv's replies (an empty placeholder: the
client matches replies by id) and the request waits in `_deferred`, in deadline order, while
the loop serves everyone else. It runs when its fetches are done (the fetched blocks imported
first) or at its deadline, whichever comes first, and its reply joins the held replies of that
iteration, so it goes out after the journal committed the imported blocks' seals.
kvd/server/remote/__init__.py describes the read-through.

Why selectors and not asyncio: the loop does no awaiting, every handler is a short synchronous
call, and a plain selector loop avoids a transport and a protocol callback per request
(`python -m bench.diagnostics.event_loop` runs the same echo server on both).
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import time
from collections import deque
from time import perf_counter
from dataclasses import dataclass, field
from typing import Any

from kvd.errors import DeniedError, InternalError, JournalError, KvdError, ProtocolError
from kvd.protocol import FrameDecoder, FrameEncoder, decode_request, encode_error
from kvd.server import remote
from kvd.server.journal import Journal, PoolJournals
from kvd.server.service import Session
from kvd.server.startup import Started

log = logging.getLogger("kvd")

RECV_NBYTES = 256 * 1024
# Pins released per iteration for closed sessions: 1,024 take 0.06 ms (C pool) to 0.2 ms (pure
# Python) at the median, so a teardown adds about that to a client's round trip, where a
# million pins at once stalled every client for tens of ms (`python -m bench.hostile`).
RELEASE_STEP_PINS = 1024
ACCEPT_RETRY_S = 1.0  # out of fds: how long the listener rests before the loop tries again
HELLO_TIMEOUT_S = 10.0  # a connection that has not said hello by then is closed
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


class Server:
    """Serves what startup built: `serve_forever()` (or `serve_once`) until `stop()`."""

    def __init__(self, started: Started) -> None:
        # Fewer than 30 attributes per Server: from 30 on, CPython 3.11 stops sharing instance
        # dict keys and every `self.x` of the loop gets slower (bench/request_path.py: the
        # daemon's own path 4 % slower at 30). What the loop never reads stays in `started`.
        self.started = started
        self.journal = started.journal
        self.service = started.service
        self.ops = started.service.ops
        self._time_op = self.ops.latency.since  # (bound once: it runs for every request)
        self._handle = started.service.handle
        self._stop = started.stop
        self._listener = started.listener
        self._wakeup = started.wakeup
        self._selector = started.selector
        self._connections: dict[int, Connection] = {}  # by socket fd
        self._limits = started.service.limits
        self._writing: set[Connection] = set()  # connections with replies queued unsent
        self._replied: set[Connection] = set()  # connections with replies held for the commit
        # One receive buffer for every connection (the decoder copies what it keeps):
        # sock.recv(RECV_NBYTES) would have malloc map and unmap 256 KiB on every call.
        self._recv_view = memoryview(bytearray(RECV_NBYTES))
        self._encoder = FrameEncoder()  # the loop's own: replies are packed on this thread only
        self._frame = self._encoder.frame
        self._accept_retry_at: float | None = None  # not accepting (out of fds) until then
        # Connections accepted in the last HELLO_TIMEOUT_S -> when their hello is due, in accept
        # order (so in deadline order); those that said it leave once their deadline passes.
        self._hello_due: dict[Connection, float] = {}
        self._next_journal_retry = 0.0
        # --remote: the tiers, the ops they may defer, and the deferred requests' read-throughs.
        self._remote = started.remote
        self._deferrable = frozenset() if self._remote is None else self._remote.bind(
            self.service.served, self.service.models)
        self._deferred: deque[remote.ReadThrough] = deque()
        try:
            self._selector.register(self._listener, selectors.EVENT_READ,
                                    (self._on_listener, None))
            self._selector.register(self._wakeup, selectors.EVENT_READ, (self._on_wakeup, None))
            for done_fd in [] if self._remote is None else self._remote.done_fds:
                self._selector.register(done_fd, selectors.EVENT_READ, (self._on_fetched, None))
        except BaseException:
            started.resources.close()
            raise

    def stop(self, keep: bool | None = None) -> None:
        """Ask the loop to stop after this iteration (`keep`: keep segment and journal for
        --recover; None: as decided so far)."""
        self._stop.request(keep)

    def _release(self) -> None:
        """Close every session, then release what startup built."""
        for connection in list(self._connections.values()):
            self._close(connection, "daemon stopping")
        self.service.release_deferred(self.service.num_deferred)
        if self._stop.keep and self.journal is not None:
            self._commit_journal(self.journal)  # pending tombstones: a smaller log to replay
        self.started.resources.close()  # releases the flock last: the name is free only then

    # ---- the loop ----------------------------------------------------------------------------
    # Every registration's data is (handler, connection or None): the loop calls the handler
    # directly, so a request costs one call layer from select() to recv (bench/control_plane.py
    # measures the request path against an echo server; each layer is ~0.1-0.2 µs of a ~20 µs
    # round trip, and more after a wake-up with cold caches).
    def serve_forever(self) -> None:
        """Serve until asked to stop, then release everything (even if the loop fails)."""
        stop = self._stop
        try:
            while not stop.is_requested:  # (no waiting while closed sessions are released)
                self.serve_once(0.0 if self.service.num_deferred else 1.0)
            if stop.signal_name is not None:
                log.info("received %s, stopping", stop.signal_name)
        except BaseException:
            # A kvd bug escaped the loop (handlers' errors never do): end like a crash, keeping
            # what --recover restores, rather than like a plain stop that removes the cache.
            stop.keep = stop.keep or self.journal is not None
            log.exception("the loop failed: stopping%s", ", keeping segment and journal for "
                          "--recover" if stop.keep else "")
            raise
        finally:
            log.info("stopped: %s", "kept segment for restart" if stop.keep
                     else "segment and socket removed")
            self._release()

    def serve_once(self, timeout_s: float | None) -> None:
        """One loop iteration: wait up to `timeout_s` for events, handle them, commit, reply.

        serve_forever calls it; bench/request_path.py calls it inline to measure the request
        path without a scheduler in between.
        """
        if self._deferred:  # wake for the first deadline
            timeout_s = max(0.0, min(timeout_s if timeout_s is not None else 1e9,
                                     self._deferred[0].deadline - time.monotonic()))
        for key, mask in self._selector.select(timeout_s):
            handler, connection = key.data
            try:
                handler(connection, mask)
            except Exception:  # a kvd bug: drop the one connection involved, keep serving
                log.exception("internal error in %s", handler.__name__)
                if connection is not None:
                    self._close(connection, "internal error")
        if self._deferred:
            self._answer_overdue()
        if self._replied or self.service.write_error is not None:
            # (Otherwise nothing waits: seals only come with held replies, and the journal's
            # upkeep is only due after a commit; a failed journal retries on its timer.)
            self._commit_and_reply()
        # The replies are out: while the clients think, ask the policy for the next victim of
        # a full pool, a third of the next allocation's eviction (kvd/core/pool.py).
        self.service.pool.choose_next_victim()
        if self.service.num_deferred:
            self.service.release_deferred(RELEASE_STEP_PINS)
        if self._accept_retry_at is not None and time.monotonic() >= self._accept_retry_at:
            self._resume_accepting()
        if self._hello_due:
            self._close_silent()

    def _close_silent(self) -> None:
        """Close the connections whose hello is overdue (module docstring)."""
        now = time.monotonic()
        for connection, due in list(self._hello_due.items()):
            if due > now:
                return
            del self._hello_due[connection]
            if not connection.session.is_ready:
                self._close(connection, f"no hello within {HELLO_TIMEOUT_S:g} s")

    def _on_listener(self, _: None, mask: int) -> None:
        self._accept()

    def _on_wakeup(self, _: None, mask: int) -> None:
        self._wakeup.recv(4096)  # (the signal handler has requested the stop)

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
        self._hello_due[connection] = time.monotonic() + HELLO_TIMEOUT_S
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
        chunk = self._recv_view[:nbytes]
        requests = connection.decoder.requests(chunk)  # the usual chunk, decoded in C
        if requests is not None:  # (and the usual one request without a comprehension's frame)
            replies = ([self._reply(connection, requests[0])] if len(requests) == 1 else
                       self._replies(connection, requests, True))
        else:
            try:
                bodies = connection.decoder.feed(chunk)
            except KvdError as exc:  # bad length prefix: the stream cannot be resynchronised
                self.ops.error(exc.code)
                _send_quietly(connection.sock, bytes(connection.output) + encode_error(None, exc))
                self._close(connection, f"framing error: {exc}")
                return
            replies = self._replies(connection, bodies, False)
        if not replies:
            return  # (no whole frame yet, or the connection was closed)
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

    def _replies(self, connection: Connection, items: list[Any], is_decoded: bool
                 ) -> list[tuple[int | None, bytes, bool]]:
        """The replies to a chunk's requests (decoded, or frame bodies), handled in turn while
        they fit --max-output-nbytes: a chunk that asks more than that (pipelined forks of a
        long sequence, say) is not read as it comes, so it is cut before the daemon builds
        more of it (closed; returns [])."""
        limit = self._limits.max_output_nbytes
        replies, nbytes = [], 0
        for item in items:
            reply = (self._reply(connection, item) if is_decoded
                     else self._reply(connection, None, item))
            replies.append(reply)
            nbytes += len(reply[1])
            if nbytes > limit:
                self._close(connection, f"one read asked {nbytes} bytes of replies and more "
                            "(kvd start --max-output-nbytes): client not reading")
                return []
        return replies

    def _reply(self, connection: Connection, request: tuple[int, str, dict[str, Any]] | None,
               body: bytes = b"", may_defer: bool = True) -> tuple[int | None, bytes, bool]:
        """Handle one request already decoded, or (None) the frame `body` to decode: (request
        id, reply frame, whether it awaits the journal). A deferred request's frame is empty
        (module docstring)."""
        started = perf_counter()
        request_id = op = None
        journal = self.journal
        num_seals = journal.num_seals_pending if journal is not None else 0
        session = connection.session
        try:
            request_id, op, args = request if request is not None else decode_request(body)
            if op in self._deferrable and may_defer and session.is_ready and self._defer(
                    connection, request_id, op, args):
                return request_id, b"", False
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

    # ---- deferred replies (--remote) --------------------------------------------------------
    def _defer(self, connection: Connection, request_id: int, op: str,
               args: dict[str, Any]) -> bool:
        """Start a read-through for the request if its pools lack blocks; whether it did."""
        service, tiers = self.service, self._remote
        if tiers is None or service.write_error is not None:  # (imports are seals: refused)
            return False
        read = tiers.read(connection.session.served, op, args, service.open_hashes)
        if read is None:
            return False
        read.context = (connection, request_id, op, args)
        self._deferred.append(read)
        return True

    def _on_fetched(self, _: None, mask: int) -> None:
        """Import what the finished read-throughs brought, answering those still waiting."""
        if self._remote is not None:
            for read in self._remote.take_done():
                self._import_and_answer(read)

    def _import_and_answer(self, read: remote.ReadThrough) -> None:
        service = self.service
        try:
            imported = {} if service.write_error is not None else read.import_fetched()
            if not read.is_answered:
                service.imported = imported
                self._answer(read, any(imported.values()))
                read.count_hits()
        finally:
            service.imported = {}
            read.release()

    def _answer_overdue(self) -> None:
        """Answer the deferred requests whose deadline passed, from what is local."""
        now, deferred = time.monotonic(), self._deferred
        while deferred and (deferred[0].is_answered or deferred[0].deadline <= now):
            read = deferred.popleft()
            if not read.is_answered:
                read.count_timeout()
                self._answer(read, False)

    def _answer(self, read: remote.ReadThrough, is_journaled: bool) -> None:
        """Run the deferred request now; its reply waits for this iteration's commit."""
        read.is_answered = True
        connection: Connection = read.context[0]
        request_id, op, args = read.context[1:4]
        if self._connections.get(connection.sock.fileno()) is not connection:
            return  # closed meanwhile
        request_id, reply, awaits = self._reply(connection, (request_id, op, args),
                                                may_defer=False)
        connection.pending.append((request_id, reply, awaits or is_journaled))
        self._replied.add(connection)

    def _commit_and_reply(self) -> None:
        """Group commit: one journal transaction for the iteration, then every held reply goes
        out, then the journal's upkeep (compaction, WAL checkpoints), which no reply waits for.

        A connection's replies are held (`_read`) while seals of this iteration are not yet
        committed, so that no client hears "sealed" before the seal is durable, and no reply
        reveals a seal that a crash could still take back (see kvd/server/journal.py for why
        evictions need not force a commit).
        """
        failure, journal = None, self.journal
        if journal is not None:
            failure = self._commit_journal(journal)
        for connection in self._replied:
            if connection.sock.fileno() in self._connections:
                self._send_pending(connection, failure)
        self._replied.clear()
        if journal is not None and self.service.write_error is None:
            self._tidy_journal(journal)

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

    def _commit_journal(self, journal: Journal | PoolJournals) -> JournalError | None:
        """Commit (or, after a failure, try a full rewrite); returns the error if it failed."""
        try:
            if self.service.write_error is not None:
                if time.monotonic() < self._next_journal_retry:
                    return None  # writes are refused meanwhile, nothing can be pending
                if isinstance(journal, PoolJournals):
                    journal.rewrite_pools()
                else:
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

    def _tidy_journal(self, journal: Journal | PoolJournals) -> None:
        try:
            journal.tidy()
        except JournalError as exc:  # no reply depends on it, but the disk is failing writes
            self._journal_failed(exc)

    def _journal_failed(self, exc: JournalError) -> None:
        """Fail closed: refuse allocations and seals, retry a full rewrite in a second."""
        if self.service.write_error is None:
            log.error("%s; refusing allocations and seals until it recovers", exc)
        self.service.counters["journal_failures"] += 1
        self.service.write_error = str(exc)
        self._next_journal_retry = time.monotonic() + 1.0

    def _flush(self, connection: Connection) -> None:
        output = connection.output
        if output:
            sent = self._send_now(connection, output)
            if sent is None:
                return
            del output[:sent]
        if len(output) > self._limits.max_output_nbytes:
            self._close(connection, f"{len(output)} bytes of replies unread: client not reading "
                        f"(kvd start --max-output-nbytes)")
            return
        wants_write = bool(output)
        if wants_write != connection.is_writing:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if wants_write else 0)
            handler = self._on_writable if wants_write else self._read
            self._selector.modify(connection.sock, events, (handler, connection))
            connection.is_writing = wants_write
            (self._writing.add if wants_write else self._writing.discard)(connection)
        if wants_write:
            self._check_total_output()

    def _check_total_output(self) -> None:
        """Close the connections with the most replies unread while all together hold more
        than --max-total-output-nbytes (module docstring)."""
        num_nbytes = sum([len(c.output) for c in self._writing])
        limit = self._limits.max_total_output_nbytes
        if num_nbytes <= limit:
            return
        for connection in sorted(self._writing, key=lambda c: len(c.output), reverse=True):
            num_nbytes -= len(connection.output)
            self._close(connection, f"{len(connection.output)} bytes of replies unread while "
                        f"all connections hold more than {limit} (kvd start "
                        "--max-total-output-nbytes): client not reading")
            if num_nbytes <= limit:
                return

    def _close(self, connection: Connection, reason: str) -> None:
        fd = connection.sock.fileno()
        if self._connections.pop(fd, None) is None:
            return
        self._hello_due.pop(connection, None)
        self._writing.discard(connection)
        self._selector.unregister(connection.sock)
        connection.sock.close()
        if connection.pidfd is not None:
            self._selector.unregister(connection.pidfd)
            os.close(connection.pidfd)
        session = connection.session
        num_pins = self.service.close_session(session)
        log.info("session %d (pid %d) closed: %s; releasing %d pins",
                 session.session_id, session.pid, reason, num_pins)
        if self._accept_retry_at is not None and not self._stop.is_requested:
            self._resume_accepting()  # its fds are free again


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
