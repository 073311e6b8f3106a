"""The remote tier's two threads: write-behind and read-through fetches, over redis-py.

Theory of operation
-------------------
The loop thread never waits on Redis. It talks to the tier through three hand-offs, each a
deque (appends and pops are atomic under the GIL) plus a wake-up:

    writes   `sealed(rows)` (the pool's observer, kvd/server/remote/__init__.py) queues
             (block id, hash, generation) per newly indexed block: no bytes, no I/O. The queue
             holds at most `max_queued` blocks; when Redis cannot keep up the oldest are dropped
             and counted (`dropped`): the newest blocks are the likeliest to be asked for next.
    fetches  `fetch(keys)` queues a FetchJob for the keys after a lookup's local prefix, or
             declines (None: the tier is down, a fetch has been stuck past the deadline, or too
             many wait), and the lookup is answered at once from what is local.
    done     the fetch thread appends the finished job and writes a byte to `done_fd`, which the
             loop's selector watches (kvd/server/loop.py); the loop imports what arrived.

Write-behind thread: pops up to WRITE_BATCH blocks, and at most WRITE_BATCH_NBYTES of them
(one block at least), copies each block's bytes out of the shared segment, and sends them as one
command. The byte bound is Redis's: a command's arguments sit in the server's query buffer, which
counts against `maxmemory` until the command has run, so a tier nearly full under `allkeys-lru`
answers a 2 MiB MSET with OOM however much it evicts, where 1 MiB ones go through (as do a
cluster's SETs of one block each). A sealed block is immutable, but once released it can
be evicted and its block reused (for other bytes) at any moment; eviction bumps the block's
generation (kvd/core/pool.py, invariant 5) before the block can be handed out again, so the
generation is read before and after the copy and the write is dropped (`stale`) if it changed: a
copy between two equal readings is a copy of the sealed bytes.

The thread shares the daemon's GIL with the loop, and whatever Python it runs is time the loop
may wait for the GIL (up to the switch interval, 5 ms, for a long stretch): a lookup's p99 pays
for it. So on one server a batch is one `MSET`, packed by kvd/server/remote/_codec.c in one call
that reads the rows with the GIL and then copies, checksums and checks generations with the GIL
released, straight into the bytes that go on the wire (codec.py's `pack_mset` is its Python
twin), sent with one `sendall` (which releases the GIL) and answered by one `+OK`: 1.6-2.9 us of
the thread's CPU per 512-byte block, mostly without the GIL, against 10.8-14.8 us of mostly
Python through redis-py's pipeline of SETs (`python -m bench.remote`, docs/remote.md). (The C
packs a segment's one pool, an array; pools in shared slabs go through the Python twin.) A cluster's blocks go as a pipeline of SETs, which
redis-py routes key by key (an MSET must stay in one slot).

Fetch thread: MGETs of the job's keys, then checks of the values head first
(kvd/server/remote/codec.py), keeping the consecutive ones that pass: a prefix is useful only up
to its first gap. A value that fails a check is counted (`corrupt`), deleted, and ends the prefix
like a miss. On one server the keys go as one pipeline of MGETs of FETCH_CHUNK keys, and each
reply is checked as soon as it is read, while the server's next replies stream into the socket
buffer: the CRC-32s (4.6 us per 64 KiB in kvd's C, codec.py) overlap the transfer instead of
following it. The replies are read by ReplyReader rather than redis-py's hiredis parser: each
value goes from the kernel into a buffer of its own by one `recv_into`, with the GIL released,
where hiredis copies it twice more holding the GIL (into its buffer, then into a bytes object).
On a cluster, redis-py splits one MGET by slot and pipelines the parts to each master.

Health: `state` is "connecting" (at start: fetches are tried), "up" or "down"; `stats()`
reports "stalled" while a call has been in flight longer than the fetch deadline (a slow
server, or redis-py riding out a cluster failover: fetches are declined meanwhile). Any Redis
or socket error marks the tier down (a gauge, an error counter and `last_error` say why); while
down, fetches are declined, writes wait in the queue (dropping the oldest once full), and the
write thread probes with PING every RETRY_S until one succeeds: the tier resumes by itself
after a restart, a failover or a slow spell.
redis-py's own retries are off for a single server (the tier retries) and left on for a
cluster, where they follow MOVED/ASK and refresh the slot map after a failover.

Counters are plain ints, each written by one thread only (the loop's, the writer's or the
fetcher's), read by `stats()` from the loop or the metrics thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvd.errors import BadArgsError
from kvd.server.remote.codec import BlockCodec, Blocks, RemoteURL

log = logging.getLogger("kvd")

DEFAULT_TIMEOUT_MS = 100
MAX_QUEUED_WRITES = 8192  # blocks waiting to be written (metadata only: ~100 bytes each)
WRITE_BATCH = 32  # blocks per command: 16 KiB at 512-byte blocks
WRITE_BATCH_NBYTES = 1 << 20  # and at most this many bytes of them (module docstring)
WRITE_GATHER_S = 0.005  # a write waits this long for others to share its pipeline
# A cluster's values this large go to redis-py as memoryviews, which it sends as they are; it
# would copy a bytearray twice (to bytes, then into hiredis' packed command), holding the GIL the
# loop needs. (Below it, hiredis' packing of a copy costs less than redis-py's Python packer.)
ZERO_COPY_NBYTES = 1 << 16
MAX_FETCH_BLOCKS = 1024  # blocks one lookup fetches at most
FETCH_CHUNK = 32  # keys per MGET of a fetch from one server (2 MiB of 64 KiB blocks)
MAX_WAITING_FETCHES = 64  # fetches queued behind the one in flight
RETRY_S = 0.5  # while down: how often the write thread probes
MIN_IO_TIMEOUT_S = 1.0  # redis-py socket timeout: at least this, or 4 fetch deadlines

LOOP_COUNTERS = ("queued", "dropped", "fetches", "declined", "timeouts", "hit_blocks")
WRITE_COUNTERS = ("written", "written_bytes", "stale", "write_errors", "probes")
FETCH_COUNTERS = ("fetched", "fetched_bytes", "missed", "corrupt", "fetch_errors")


@dataclass(eq=False)
class FetchJob:
    """One read-through: keys asked (head first); `payloads` the consecutive ones found."""

    keys: list[bytes]
    deadline: float  # time.monotonic() by which the lookup is answered, fetched or not
    context: Any = None  # the loop's: the deferred request
    payloads: list[memoryview] = field(default_factory=list)
    is_answered: bool = False  # the loop answered the request (in time or at its deadline)


class RemoteTier:
    """Write-behind and read-through for one pool (module docstring)."""

    def __init__(self, url: RemoteURL, codec: BlockCodec,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 max_queued: int = MAX_QUEUED_WRITES) -> None:
        self.url = url
        self.codec = codec
        self.timeout_s = timeout_ms / 1000
        self.max_queued = max_queued
        self.state = "connecting"  # until the first command succeeds or fails
        self.last_error: str | None = None
        self.counters = dict.fromkeys((*LOOP_COUNTERS, *WRITE_COUNTERS, *FETCH_COUNTERS), 0)
        self.is_importing = False  # the loop is sealing fetched blocks: nothing to write back
        self._writes: deque[tuple[int, bytes, int]] = deque()
        self._batch_blocks = max(1, min(WRITE_BATCH, WRITE_BATCH_NBYTES // codec.block_nbytes))
        self._fetches: deque[FetchJob] = deque()
        self._done: deque[FetchJob] = deque()
        self._wake_writer = threading.Event()
        self._wake_fetcher = threading.Event()
        self._fetch_started: float | None = None  # monotonic start of the MGET in flight
        self._write_started: float | None = None  # and of the pipeline in flight
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._done_r, self._done_w = socket.socketpair()
        self._done_r.setblocking(False)
        self._done_w.setblocking(False)
        self.blocks: Blocks | None = None  # the pool's blocks, uint8 [block_nbytes] each
        self._generations: np.ndarray | None = None

    # ---- life --------------------------------------------------------------------------
    def start(self, blocks: Blocks, generations: np.ndarray) -> None:
        """Serve the segment's blocks (`blocks`: uint8 [num_blocks, block_nbytes])."""
        self.blocks, self._generations = blocks, generations
        for name, target in (("kvd-remote-write", self._write_loop),
                             ("kvd-remote-fetch", self._fetch_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Stop both threads (a write or fetch in flight ends within the I/O timeout)."""
        self._stopping = True
        self._wake_writer.set()
        self._wake_fetcher.set()
        for thread in self._threads:
            thread.join(self.io_timeout_s + 1.0)
        self._done_r.close()
        self._done_w.close()
        self.blocks = self._generations = None

    @property
    def io_timeout_s(self) -> float:
        return max(MIN_IO_TIMEOUT_S, 4 * self.timeout_s)

    @property
    def done_fd(self) -> socket.socket:
        """Readable when a fetch finished: the loop then calls `take_done`."""
        return self._done_r

    # ---- the loop's side -----------------------------------------------------------------
    def sealed(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Queue newly indexed blocks for writing (a journal row: block_id, key, generation,
        ...); drops the oldest queued beyond `max_queued`."""
        if self.is_importing:
            return
        writes, counters = self._writes, self.counters
        was_empty = not writes
        for row in rows:
            if len(writes) >= self.max_queued:
                writes.popleft()
                counters["dropped"] += 1
            writes.append((row[0], row[1], row[2]))
        counters["queued"] += len(rows)
        # Wake the writer only where it waits for work: a writer with a queue is busy or
        # gathering, and a down one sleeps until its next probe; each needless wake-up is a
        # thread that takes the GIL from this loop (500 a second in bench.remote's lookups).
        # (The writer looks at the queue after each wait, so none is lost.)
        if was_empty and self.state != "down":
            self._wake_writer.set()

    def fetch(self, keys: list[bytes]) -> FetchJob | None:
        """Queue a fetch of `keys` (head first), or None if the tier declines (module
        docstring): the caller answers from what is local."""
        started = self._fetch_started
        now = time.monotonic()
        if (self.state == "down" or len(self._fetches) >= MAX_WAITING_FETCHES
                or (started is not None and now - started > self.timeout_s)):
            self.counters["declined"] += 1
            return None
        job = FetchJob(keys[:MAX_FETCH_BLOCKS], now + self.timeout_s)
        self._fetches.append(job)
        self.counters["fetches"] += 1
        self._wake_fetcher.set()
        return job

    def take_done(self) -> list[FetchJob]:
        """The finished fetches (after `done_fd` turned readable)."""
        try:
            while self._done_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        done = []
        while self._done:
            done.append(self._done.popleft())
        return done

    @property
    def num_queued(self) -> int:
        return len(self._writes)

    def stats(self) -> dict[str, Any]:
        return {"url": str(self.url), "state": self.health(), "last_error": self.last_error,
                "queue_depth": len(self._writes), "queue_capacity": self.max_queued,
                "fetches_waiting": len(self._fetches), "timeout_ms": round(self.timeout_s * 1e3),
                "key_prefix": self.codec.prefix, **self.counters}

    def health(self) -> str:
        """`state`, or "stalled" while a call is in flight past the deadline."""
        now = time.monotonic()
        for started in (self._fetch_started, self._write_started):
            if started is not None and now - started > self.timeout_s and self.state != "down":
                return "stalled"
        return self.state

    # ---- health (either thread) ------------------------------------------------------------
    def _failed(self, what: str, exc: BaseException) -> None:
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"
        if self.state != "down":
            log.warning("remote tier %s down (%s); local serving goes on, retrying every %g s",
                        self.url, self.last_error, RETRY_S)
        self.state = "down"

    def _succeeded(self) -> None:
        if self.state != "up":
            log.info("remote tier %s up", self.url)
        self.state = "up"

    def _connect(self) -> Any:
        import redis
        url, timeout_s = self.url, self.io_timeout_s
        if url.is_cluster:
            from redis.cluster import ClusterNode, RedisCluster
            return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in url.nodes],
                                require_full_coverage=False, socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s, username=url.username,
                                password=url.password)
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        host, port = url.nodes[0]
        return redis.Redis(host=host, port=port, db=url.db, retry=Retry(NoBackoff(), 0),
                           socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                           username=url.username, password=url.password)

    # ---- write-behind thread -------------------------------------------------------------
    def _write_loop(self) -> None:
        client = None
        next_probe = 0.0  # while down: probes every RETRY_S, however often seals wake us
        while not self._stopping:
            if self.state != "up" or client is None:
                wait_s = next_probe - time.monotonic()
                if wait_s <= 0:
                    client = self._probe(client)
                    next_probe = time.monotonic() + RETRY_S
                if client is None or self.state != "up":
                    self._wake_writer.wait(max(wait_s, 0.0) or RETRY_S)
                    self._wake_writer.clear()
                    continue
            if not self._writes:
                self._wake_writer.wait(RETRY_S)
                self._wake_writer.clear()
                continue
            if len(self._writes) < self._batch_blocks:  # let a batch gather: fewer, fuller ones
                time.sleep(WRITE_GATHER_S)
            self._write_batch(client)
        _close_client(client)

    def _probe(self, client: Any) -> Any:
        """PING (connecting first if need be); returns the client, or None if it cannot be
        made. Marks the tier up or down."""
        self.counters["probes"] += 1
        try:
            if client is None:
                client = self._connect()
            client.ping()
        except Exception as exc:  # redis-py raises many types (RedisError, OSError, cluster's)
            self._failed("probe", exc)
            return client
        self._succeeded()
        return client

    def _write_batch(self, client: Any) -> None:
        rows: list[tuple[int, bytes, int]] = []
        writes = self._writes
        while writes and len(rows) < self._batch_blocks:
            try:
                rows.append(writes.popleft())
            except IndexError:  # (the loop dropped it meanwhile)
                break
        blocks, generations = self.blocks, self._generations
        if blocks is None or generations is None:
            return
        if self.url.is_cluster:
            values = self._values(rows, blocks, generations)
            num_values, num_bytes = len(values), sum(len(value) for _, value in values)
        else:
            command, start, num_values = self.codec.pack_mset(blocks, generations, rows)
            num_bytes = len(command) - start
        self.counters["stale"] += len(rows) - num_values
        if not num_values:
            return
        self._write_started = time.monotonic()
        try:
            if self.url.is_cluster:
                pipe = client.pipeline(transaction=False)
                for name, value in values:
                    pipe.execute_command(
                        "SET", name, memoryview(value) if len(value) >= ZERO_COPY_NBYTES else value)
                pipe.execute()
            else:
                _send_packed(client, memoryview(command)[start:])
        except Exception as exc:
            self.counters["write_errors"] += num_values
            self._failed("write", exc)
            return
        finally:
            self._write_started = None
        self.counters["written"] += num_values
        self.counters["written_bytes"] += num_bytes
        self._succeeded()

    def _values(self, rows: list[tuple[int, bytes, int]], blocks: Blocks,
                generations: np.ndarray) -> list[tuple[str, bytearray]]:
        """(key, value) of the rows' blocks that were not evicted before or during the copy
        (module docstring): a cluster's SETs, which redis-py routes key by key."""
        values = []
        for block_id, block_hash, generation in rows:
            if int(generations[block_id]) != generation:
                continue
            value = self.codec.encode(block_hash, blocks[block_id])
            if int(generations[block_id]) == generation:
                values.append((self.codec.key(block_hash), value))
        return values

    # ---- fetch thread -----------------------------------------------------------------------
    def _fetch_loop(self) -> None:
        client = None
        while not self._stopping:
            if not self._fetches:
                self._wake_fetcher.wait(RETRY_S)
                self._wake_fetcher.clear()
                continue
            job = self._fetches.popleft()
            if time.monotonic() < job.deadline:  # (else answered already: fetch nothing)
                client = self._fetch(client, job)
            self._done.append(job)
            try:
                self._done_w.send(b"x")
            except (BlockingIOError, InterruptedError):  # full: the loop has wake-ups pending
                pass
            except OSError:  # closed: stopping
                return
        _close_client(client)

    def _fetch(self, client: Any, job: FetchJob) -> Any:
        self._fetch_started = time.monotonic()
        try:
            if client is None:
                client = self._connect()
            names = [self.codec.key(key) for key in job.keys]
            payloads: list[memoryview] = []
            if self.url.is_cluster:
                self._check(client, job.keys, names, client.mget_nonatomic(names), payloads)
            else:
                self._fetch_chunks(client, job.keys, names, payloads)
            job.payloads = payloads
            self.counters["fetched"] += len(payloads)
            self.counters["missed"] += len(job.keys) - len(payloads)
            self._succeeded()
        except Exception as exc:
            self.counters["fetch_errors"] += 1
            self._failed("fetch", exc)
        finally:
            self._fetch_started = None
        return client

    def _fetch_chunks(self, client: Any, keys: list[bytes], names: list[str],
                      payloads: list[memoryview]) -> None:
        """One server: MGETs of FETCH_CHUNK keys in one pipeline, each reply checked as it is
        read (module docstring); every reply is read, even after a gap."""
        starts = range(0, len(keys), FETCH_CHUNK)
        pool = client.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command(connection.pack_commands(
                [("MGET", *names[start:start + FETCH_CHUNK]) for start in starts]))
            is_whole, replies = True, ReplyReader(connection._sock)
            for start in starts:  # (the server's next replies stream in while one is checked)
                values = replies.bulk_array()
                if is_whole:
                    end = start + FETCH_CHUNK
                    is_whole = self._check(client, keys[start:end], names[start:end], values,
                                           payloads)
        except BaseException:
            connection.disconnect()  # (replies left unread)
            raise
        finally:
            pool.release(connection)

    def _check(self, client: Any, keys: list[bytes], names: list[str],
               values: Sequence[bytes | memoryview | None], payloads: list[memoryview]) -> bool:
        """Append the payloads of the consecutive values that pass every check, head first;
        whether all did."""
        counters = self.counters
        for key, name, value in zip(keys, names, values):
            if value is None:
                return False
            payload = self.codec.payload(key, value)
            if payload is None:
                counters["corrupt"] += 1
                log.warning("remote tier: value of %s failed its checks: deleted", name)
                client.delete(name)
                return False
            payloads.append(payload)
            counters["fetched_bytes"] += len(value)
        return True


class ReplyReader:
    """Replies of MGET (RESP2 or RESP3 arrays of bulk strings and nulls) read off a socket: each
    value's bytes go from the kernel into a buffer of its own by `recv_into`, which releases the
    GIL. hiredis, through redis-py, copies them twice (into its read buffer, then into a bytes
    object) holding the GIL that the daemon's loop needs, which is what a raw redis-py MGET pays
    too. An error reply raises redis-py's ResponseError; a closed socket, ConnectionError;
    a timeout, the socket's (the caller then drops the connection)."""

    LINE_READ = 4096  # bytes asked for when a header line is incomplete

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = bytearray()  # read past what was parsed (deletes from its front are O(1))

    def bulk_array(self) -> list[memoryview | None]:
        line = self._line()
        if line[:1] != b"*":
            raise self._unexpected(line)
        values: list[memoryview | None] = []
        for _ in range(int(line[1:])):
            line = self._line()
            if line == b"_":  # RESP3's null (redis-py speaks RESP3 where the server does)
                values.append(None)
                continue
            if line[:1] != b"$":
                raise self._unexpected(line)
            nbytes = int(line[1:])
            values.append(None if nbytes < 0 else self._bulk(nbytes))
        return values

    def _line(self) -> bytes:
        pending = self._pending
        while (end := pending.find(b"\r\n")) < 0:
            self._recv_more()
        line = bytes(pending[:end])
        del pending[:end + 2]
        return line

    def _bulk(self, nbytes: int) -> memoryview:
        """The next `nbytes` bytes and their CRLF."""
        value = memoryview(bytearray(nbytes))
        pending = self._pending
        got = min(len(pending), nbytes)
        value[:got] = pending[:got]
        del pending[:got]
        while got < nbytes:
            count = self._sock.recv_into(value[got:])
            if not count:
                raise _closed()
            got += count
        while len(pending) < 2:
            self._recv_more()
        if pending[:2] != b"\r\n":
            raise self._unexpected(bytes(pending[:16]))
        del pending[:2]
        return value

    def _recv_more(self) -> None:
        chunk = self._sock.recv(self.LINE_READ)
        if not chunk:
            raise _closed()
        self._pending += chunk

    @staticmethod
    def _unexpected(line: bytes) -> Exception:
        from redis.exceptions import InvalidResponse, ResponseError
        if line[:1] == b"-":
            return ResponseError(line[1:].decode(errors="replace"))
        return InvalidResponse(f"unexpected reply to MGET: {line[:64]!r}")


def _closed() -> Exception:
    from redis.exceptions import ConnectionError
    return ConnectionError("Redis closed the connection")


def require_redis() -> None:
    """Import redis-py now (its import takes 0.1-0.3 s: not in the fetch thread's first
    deadline); a typed error naming the fix where it is missing."""
    try:
        import redis  # noqa: F401
    except ImportError:
        raise BadArgsError("--remote needs redis-py: pip install 'kvd[remote]' "
                           "(redis and hiredis)") from None


def _send_packed(client: Any, command: memoryview) -> None:
    """Send one packed command on a single server's connection and read its reply (an error
    reply raises, as redis-py's own calls do)."""
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_packed_command([command], check_health=False)
        reply = connection.read_response()
    except BaseException:
        connection.disconnect()  # (a reply may be left unread)
        raise
    finally:
        pool.release(connection)
    if isinstance(reply, Exception):
        raise reply


def _close_client(client: Any) -> None:
    if client is not None:
        try:
            client.close()
        except Exception:  # closing a broken connection: nothing to keep
            pass
