"""The request handlers: sessions and every wire op, over the pool and the page table. No I/O.

Theory of operation
-------------------
The daemon's event loop decodes a request and calls `Service.handle(session, op, args)`; whatever
that returns is the result, whatever KvdError it raises becomes the error reply. Everything here
runs on the loop's one thread, so a handler is atomic with respect to every other client.

Each handler validates its arguments completely before it changes anything, so a bad request
gets BAD_ARGS (or NOT_FOUND, IN_USE, NO_SPACE) and leaves the state exactly as it was. The hot
ops (alloc, seal, lookup, release, pin: a worker's traffic) declare their arguments as a schema,
and `protocol.call_hot` checks a request against it and calls the handler with the checked
values, both in one C call (kvd/protocol/_wire.c); the others validate their own `args`.

Sessions: a session is one connection. It must say `hello` (protocol version) first. Its raw
`alloc`/`lookup`/`pin` pins are held under the session's pool owner id; each sequence it opens
holds its pins under an owner id of its own. `close_session` — on EOF, on the peer's pidfd
firing, on a protocol error, on shutdown — closes its sequences (tail first) and releases
everything else, which is what makes a SIGKILLed worker's blocks come back.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd import native, protocol
from kvd.errors import (
    BadArgsError, DeniedError, InternalError, JournalError, NoSpaceError, NotFoundError,
    ProtocolError, TooLargeError, UnknownOpError, VersionError,
)
from kvd.geometry import Geometry
from kvd.hashing import HASH_VERSION
from kvd.server.metrics import OpStats
from kvd.core.page_table import PageTable, SequenceRecord
from kvd.core.policies import TIER_NAMES, TieredPolicy
from kvd.core.pool import BlockPool
from kvd.protocol import (
    PROTOCOL_VERSION, ArgField, arg_bool, arg_bytes, arg_int, bytes_list_field, check_no_extra,
    codec, int_field, int_list_field,
)

MAX_BATCH = 1 << 16  # ids or hashes per request, blocks per alloc and per sequence
# (so that every reply fits a frame: 65,536 ids pack into ~330 KB, and an op refused for its
# reply's size would already have changed the pool)
MAX_KEY_NBYTES = 64  # a content hash; kvd.hash_blocks makes 16
MAX_SALT_NBYTES = 256
# KVD_DEBUG=1 in the daemon's environment adds the `check_invariants` op (tests and soaks use it;
# it is O(num_blocks), so it stays off in production).
DEBUG_ENV = "KVD_DEBUG"


@dataclass(frozen=True)
class Limits:
    """What one session, and all of them together, may hold: far above any honest workload,
    low enough that no client takes the daemon's memory (`kvd start --max-*`; the flag of each
    is its name with dashes). A request past a limit gets TOO_LARGE naming it and its flag.

    Pins count what a session's sequences hold in the pool and page table (~200 bytes each): a
    forked sequence's shared sealed head counts once (kvd/core/page_table.py), raw pins by
    `lookup`/`pin` are not counted (they are bounded by the pool: one entry per block).
    """

    max_sequences: int = 1 << 16  # open sequences per session
    max_forks: int = 1 << 14  # open sequences per session made by seq_fork
    max_pins: int = 1 << 20  # block pins held by a session's sequences
    max_output_nbytes: int = 16 << 20  # replies one connection leaves unread
    max_total_output_nbytes: int = 256 << 20  # replies all connections together leave unread

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if type(value) is not int or value <= 0:
                raise BadArgsError(f"--{name.replace('_', '-')} must be a positive int, "
                                   f"got {value!r}")


@dataclass
class Session:
    session_id: int
    pid: int
    uid: int
    is_ready: bool = False  # said hello
    seq_ids: set[int] = field(default_factory=set)
    fork_ids: set[int] = field(default_factory=set)  # those of seq_ids made by seq_fork
    num_pins: int = 0  # held by its sequences (Limits.max_pins)


class Service:
    """Sessions, sequences and the wire ops of one pool."""

    def __init__(self, pool: BlockPool, geometry: Geometry,
                 copy_block: Callable[[int, int], None], info: dict[str, Any],
                 ops: OpStats | None = None,
                 on_shutdown: Callable[[bool], None] | None = None,
                 limits: Limits = Limits()) -> None:
        """Args:
            copy_block: copies one block's bytes to another (fork of unsealed blocks).
            info: facts `hello` returns besides geometry (segment name, uuid, daemon pid, ...).
            ops: per-op request and error counts to report in `stats` (the daemon's).
            on_shutdown: stops the daemon (`keep`: keep segment and journal); None refuses.
            limits: what each session may hold.
        """
        self.limits = limits
        self._on_shutdown = on_shutdown
        self.ops = ops or OpStats()
        # Set while the journal cannot be written: writes fail closed with this reason.
        self.write_error: str | None = None
        self.journal_state = "off"  # "ok" when the daemon journals
        self.pool = pool
        self.geometry = geometry
        self.info = info
        self._ids = itertools.count(1)  # session ids and pool owner ids share one space
        self.page_table = PageTable(pool, geometry.block_size, lambda: next(self._ids), copy_block)
        self.sessions: dict[int, Session] = {}
        self.started_at = time.time()
        self.counters = {"sessions_opened": 0, "sessions_closed": 0, "journal_commits": 0,
                         "journal_failures": 0}
        # The hot ops: (schema, whether it writes, handler of the schema's values then the
        # session's owner id): the pool's own methods where nothing else is to do, no frame
        # between (the pool does a one-block request in C where that runs).
        seal = pool.seal
        block_ids = int_list_field("block_ids", MAX_BATCH, pool.num_blocks - 1)
        # kvd.hash_blocks makes 16-byte hashes; MAX_KEY_NBYTES leaves room for other digests.
        hashes = bytes_list_field("hashes", MAX_BATCH, MAX_KEY_NBYTES)
        self._hot: dict[str, tuple[tuple[ArgField, ...], bool, Callable[..., Any]]] = {
            "alloc": ((int_field("num_blocks", 0, min(pool.num_blocks, MAX_BATCH)),), True,
                      self._alloc),
            # parents, optional, one per block: the hash of the block before it in its chain
            # (nil for a chain's head), which links it into the pool's prefix tree so that
            # eviction never strands a chain's middle; tiers (0 prefill, 1 decode) for --tiers.
            "seal": ((block_ids, hashes,
                      bytes_list_field("parents", MAX_BATCH, MAX_KEY_NBYTES, is_required=False,
                                       allow_nil=True),
                      int_list_field("tiers", MAX_BATCH, len(TIER_NAMES) - 1, is_required=False)),
                     True, lambda block_ids, keys, parents, tiers, owner:  # (the wire's order)
                         seal(block_ids, keys, owner, parents, tiers)),
            "lookup": ((hashes,), False, pool.lookup),
            "release": ((block_ids,), False, pool.release),
            "pin": ((block_ids,), False, pool.pin),
        }
        self._ops: dict[str, Callable[[Session, dict[str, Any]], Any]] = {
            "hello": self._hello, "stats": self._stats, "seq_open": self._seq_open,
            "seq_extend": self._seq_extend, "seq_commit": self._seq_commit,
            "seq_fork": self._seq_fork, "seq_close": self._seq_close, "seq_info": self._seq_info,
            "shutdown": self._shutdown,
        }
        if os.environ.get(DEBUG_ENV) == "1":
            self._ops["check_invariants"] = self._check_invariants
        for op in (*self._hot, *self._ops):  # the ops timed: made-up names are not labels
            self.ops.latency.add(op)

    # ---- sessions ------------------------------------------------------------------------
    def open_session(self, pid: int, uid: int) -> Session:
        session = Session(next(self._ids), pid, uid)
        self.sessions[session.session_id] = session
        self.counters["sessions_opened"] += 1
        return session

    def close_session(self, session: Session) -> int:
        """Queue the release of everything the session holds (`release_deferred` does it a
        bounded step at a time, so a big session's close stalls nobody); returns the pins
        queued. Safe to call twice."""
        if self.sessions.pop(session.session_id, None) is None:
            return 0
        page_table = self.page_table
        num_queued = page_table.num_deferred
        for seq_id in sorted(session.seq_ids, reverse=True):
            page_table.close(page_table.sequences[seq_id], is_deferred=True)
        session.seq_ids.clear()
        held = self.pool.holdings(session.session_id)
        # Highest id released first approximates "tail first" for chains allocated in one batch.
        page_table.defer_release([b for b in sorted(held) for _ in range(held[b])],
                                 session.session_id)
        self.counters["sessions_closed"] += 1
        return page_table.num_deferred - num_queued

    def release_deferred(self, max_pins: int) -> bool:
        """Release up to `max_pins` pins of closed sessions; whether any are left."""
        self.page_table.release_deferred(max_pins)
        return self.page_table.num_deferred > 0

    def _with_room(self, call: Callable[[], Any]) -> Any:
        """`call()` (all or nothing on NoSpaceError), once more after releasing what closed
        sessions still pin if it found no room."""
        try:
            return call()
        except NoSpaceError:
            if not self._release_closed():
                raise
            return call()

    def _release_closed(self) -> bool:
        """Release every pin closed sessions still hold; whether there was any."""
        num_deferred = self.page_table.num_deferred
        self.page_table.release_deferred(num_deferred)
        return num_deferred > 0

    def handle(self, session: Session, op: str, args: dict[str, Any]) -> Any:
        """Run one request. Raises a KvdError for the error reply (UNKNOWN_OP, BAD_ARGS, ...)."""
        hot = self._hot.get(op)
        if hot is not None and session.is_ready:  # the traffic: checks in one call, then the op
            schema, writes, handler = hot
            if writes and self.write_error is not None:
                self._check_writable()
            return protocol.call_hot(handler, args, schema, session.session_id)
        op_handler = self._ops.get(op)
        if op_handler is None and hot is None:
            raise UnknownOpError(f"unknown op {op!r}: valid ops are "
                                 f"{', '.join([*self._ops, *self._hot])}")
        # (No handler here: a hot op, so the session has not said hello.)
        if op_handler is None or (not session.is_ready and op != "hello"):
            raise ProtocolError(f"say hello (protocol version {PROTOCOL_VERSION}) before {op!r}")
        return op_handler(session, args)

    # ---- ops -----------------------------------------------------------------------------
    def _hello(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        check_no_extra(args, ("version", "pid"))
        version = arg_int(args, "version")
        if version != PROTOCOL_VERSION:
            raise VersionError(f"client speaks protocol {version}, daemon speaks "
                               f"{PROTOCOL_VERSION}: install matching kvd versions")
        session.is_ready = True
        return {"session_id": session.session_id, "protocol_version": PROTOCOL_VERSION,
                "hash_version": HASH_VERSION, "geometry": self.geometry.to_dict(), **self.info}

    def _check_writable(self) -> None:
        if self.write_error is not None:
            raise JournalError(f"the daemon refuses allocations and seals until its journal can "
                               f"be written again ({self.write_error}); lookups and reads go on")

    def _alloc(self, num_blocks: int, owner: int) -> list[int]:
        block_ids = self.pool.allocate(num_blocks, owner)
        if block_ids is None and self._release_closed():
            block_ids = self.pool.allocate(num_blocks, owner)
        if block_ids is None:
            raise NoSpaceError(self.page_table._no_space(num_blocks))
        return block_ids

    def _shutdown(self, session: Session, args: dict[str, Any]) -> None:
        check_no_extra(args, ("keep",))
        keep = arg_bool(args, "keep", False)
        if self._on_shutdown is None:
            raise DeniedError("this service cannot be shut down over the wire")
        self._on_shutdown(keep)

    def _stats(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        check_no_extra(args, ())
        return self.stats()

    def stats(self) -> dict[str, Any]:
        pages = self.page_table.counters
        return {
            **self.pool.stats(), **self.counters, **pages,
            "policy": self.pool.policy.name, "sessions": len(self.sessions),
            "sequences": len(self.page_table.sequences),
            "uptime_s": round(time.time() - self.started_at, 3),
            "geometry": self.geometry.to_dict(), "daemon_pid": os.getpid(),
            "requests": self.ops.requests(), "errors": dict(self.ops.errors),
            "journal": "failed" if self.write_error else self.journal_state,
            "codec": codec(),  # "python" where msgspec is missing or turned off: the slower path
            "native": native.status(),  # which compiled modules run (kvd/native.py)
            "metrics_port": self.info.get("metrics_port"),  # None: no --metrics-port
            **self._tier_stats(),
        }

    def _tier_stats(self) -> dict[str, Any]:
        policy = self.pool.policy
        if not isinstance(policy, TieredPolicy):
            return {}
        return {"tiers": policy.describe(),
                "tier_blocks": dict(zip(TIER_NAMES, policy.num_resident))}

    def _check_invariants(self, session: Session, args: dict[str, Any]) -> list[list[int]]:
        """Debug op: raise InternalError if an invariant fails, else `[session_id, pid, pins]`
        for every live session (a test polls it to time how fast a dead worker is reclaimed)."""
        check_no_extra(args, ())
        self.check_invariants()
        return [[s.session_id, s.pid, self._num_pins(s)] for s in self.sessions.values()]

    def _num_pins(self, session: Session) -> int:
        return sum(sum(self.pool.holdings(owner).values())
                   for owner in (session.session_id, *session.seq_ids))

    def check_invariants(self) -> None:
        """The pool's invariants, plus: every pin and sequence belongs to a live session."""
        self.pool.check_invariants()
        seq_ids = set().union(*(s.seq_ids for s in self.sessions.values()))
        if seq_ids != set(self.page_table.sequences):
            raise InternalError(f"open sequences {sorted(self.page_table.sequences)} != those of "
                                f"live sessions {sorted(seq_ids)}: a session leaked a sequence")
        stray = (set(self.pool.owners()) - seq_ids - set(self.sessions)
                 - self.page_table.owners())
        if stray:
            raise InternalError(f"pool owners {sorted(stray)} are neither live sessions, their "
                                "sequences nor queued releases: a closed session's pins were "
                                "not released")
        num_pins = sum(s.num_pins for s in self.sessions.values())
        if num_pins != self.page_table.num_pins:
            raise InternalError(f"sessions count {num_pins} sequence pins, the page table "
                                f"{self.page_table.num_pins}")

    # ---- sequences -----------------------------------------------------------------------
    def _sequence(self, session: Session, args: dict[str, Any]) -> SequenceRecord:
        seq_id = arg_int(args, "seq_id")
        if seq_id not in session.seq_ids:
            raise NotFoundError(f"sequence {seq_id} is not open in this session")
        return self.page_table.sequences[seq_id]

    def _tokens(self, args: dict[str, Any], name: str = "tokens") -> bytes:
        tokens = arg_bytes(args, name, 1 << 24)
        if len(tokens) % 4:
            raise BadArgsError(f"{name} must be little-endian uint32 token ids (length a multiple "
                               f"of 4 bytes), got {len(tokens)} bytes")
        return tokens

    @staticmethod
    def _describe(record: SequenceRecord, **extra: Any) -> dict[str, Any]:
        return {"seq_id": record.seq_id, "block_ids": record.block_ids,
                "num_tokens": record.num_tokens, "num_sealed_blocks": record.num_sealed, **extra}

    def _seq_open(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        self._check_writable()
        check_no_extra(args, ("tokens", "salt", "max_cached_tokens"))
        tokens = self._tokens(args)
        salt = arg_bytes(args, "salt", MAX_SALT_NBYTES, b"")
        max_cached = arg_int(args, "max_cached_tokens", 0, default=None)
        self._check_length(len(tokens) // 4)
        self._check_limit(len(session.seq_ids) + 1, "max_sequences", "open sequences")
        self._check_pins(session, -(-len(tokens) // 4 // self.geometry.block_size))
        record, num_cached = self._counting_pins(session, lambda: self.page_table.open(
            tokens, salt, max_cached))
        session.seq_ids.add(record.seq_id)
        return self._describe(record, num_cached_tokens=num_cached)

    def _check_limit(self, num: int, name: str, what: str) -> None:
        limit = getattr(self.limits, name)
        if num > limit:
            raise TooLargeError(f"this session would hold {num} {what}, above the daemon's "
                                f"limit of {limit} (kvd start --{name.replace('_', '-')})")

    def _check_pins(self, session: Session, num_new: int) -> None:
        self._check_limit(session.num_pins + num_new, "max_pins", "block pins in its sequences")

    def _counting_pins(self, session: Session, call: Callable[[], Any]) -> Any:
        """`call()` (a page table op), its change of the sequences' pins charged to
        `session`."""
        num_pins = self.page_table.num_pins
        try:
            return self._with_room(call)
        finally:
            session.num_pins += self.page_table.num_pins - num_pins

    def _seq_extend(self, session: Session, args: dict[str, Any]) -> list[int]:
        self._check_writable()
        check_no_extra(args, ("seq_id", "tokens", "num_computed"))
        record = self._sequence(session, args)
        tokens = self._tokens(args)
        num_computed = arg_int(args, "num_computed", 0, record.num_tokens, record.num_tokens)
        num_tokens = record.num_tokens + len(tokens) // 4
        self._check_length(num_tokens)
        self._check_pins(session, -(-num_tokens // self.geometry.block_size)
                         - len(record.own_block_ids) - record.num_run_blocks)
        return self._counting_pins(
            session, lambda: self.page_table.extend(record, tokens, num_computed))

    def _check_length(self, num_tokens: int) -> None:
        block_size = self.geometry.block_size
        if -(-num_tokens // block_size) > MAX_BATCH:
            raise BadArgsError(f"a sequence holds at most {MAX_BATCH} blocks "
                               f"({MAX_BATCH * block_size} tokens of block size {block_size}), "
                               f"this one would have {num_tokens} tokens")

    def _seq_commit(self, session: Session, args: dict[str, Any]) -> int:
        self._check_writable()
        check_no_extra(args, ("seq_id", "num_computed"))
        record = self._sequence(session, args)
        num_computed = arg_int(args, "num_computed", 0, record.num_tokens, record.num_tokens)
        return self.page_table.commit(record, num_computed)

    def _seq_fork(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        self._check_writable()
        check_no_extra(args, ("seq_id",))
        record = self._sequence(session, args)
        self._check_limit(len(session.seq_ids) + 1, "max_sequences", "open sequences")
        self._check_limit(len(session.fork_ids) + 1, "max_forks", "forked sequences")
        self._check_pins(session, len(record.own_block_ids) - len(record.own_hashes))
        child = self._counting_pins(session, lambda: self.page_table.fork(record))
        session.seq_ids.add(child.seq_id)
        session.fork_ids.add(child.seq_id)
        return self._describe(child)

    def _seq_close(self, session: Session, args: dict[str, Any]) -> None:
        check_no_extra(args, ("seq_id",))
        record = self._sequence(session, args)
        session.seq_ids.discard(record.seq_id)
        session.fork_ids.discard(record.seq_id)
        self._counting_pins(session, lambda: self.page_table.close(record))

    def _seq_info(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        check_no_extra(args, ("seq_id",))
        return self._describe(self._sequence(session, args))
