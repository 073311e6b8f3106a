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

Pools: a daemon may serve several pools (kvd/server/config.py), each with its own pool, page
table and hash namespace. A session addresses the pool it chose at `hello` (`pool`, default the
daemon's first pool, named `default` for the single-pool flags) with the plain op names, and any
pool NAME with `OP@NAME` (`alloc@draft`, `seq_open@draft`): one dict lookup either way, the
session holding the op table of its pool, so a single-pool request pays nothing for the others.

Models: a model (`add_model`, from `--model NAME:POOL,POOL` or [models.NAME]) is a set of pools
of one block size, e.g. a hybrid model's full-attention layers in one and its sliding-window
layers in another. `seq_open@MODEL` (and extend, commit, fork, info, close) runs one sequence
in every pool of the model in one request: one seq_id (each pool's sequence has that id, so the
per-pool ops see it too), one block table per pool, the prefix hit the longest every pool serves
(kvd/core/page_table.py: a window pool needs only the window before the hit point).

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
from kvd.core.page_table import (
    PageTable, SequenceRecord, extend_spanning, fork_spanning, open_spanning,
)
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


@dataclass(eq=False)
class Served:
    """One pool as the service serves it."""

    name: str
    pool: BlockPool
    geometry: Geometry
    page_table: PageTable


HotOps = dict[str, tuple[tuple[ArgField, ...], bool, Callable[..., Any]]]


@dataclass
class Session:
    session_id: int
    pid: int
    uid: int
    served: Served  # the pool its plain op names address
    hot: HotOps  # the hot ops: plain names for `served`, OP@NAME for every pool
    is_ready: bool = False  # said hello
    seq_ids: set[int] = field(default_factory=set)
    fork_ids: set[int] = field(default_factory=set)  # those of seq_ids made by seq_fork
    num_pins: int = 0  # held by its sequences, in every pool (Limits.max_pins)


class Service:
    """Sessions, sequences and the wire ops of one pool."""

    def __init__(self, pool: BlockPool, geometry: Geometry,
                 copy_block: Callable[[int, int], None], info: dict[str, Any],
                 ops: OpStats | None = None,
                 on_shutdown: Callable[[bool], None] | None = None,
                 pool_name: str = "default", limits: Limits = Limits()) -> None:
        """Args:
            pool, geometry: the first pool (`add_pool` adds others), named `pool_name`.
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
        self.info = info
        self._ids = itertools.count(1)  # session ids and pool owner ids share one space
        self.served: dict[str, Served] = {}
        self._hot_of: dict[str, HotOps] = {}  # pool name → the hot ops of its sessions
        self._hot_named: HotOps = {}  # OP@NAME for every pool
        self.models: dict[str, list[Served]] = {}  # model name → its pools
        self.add_pool(pool_name, pool, geometry, copy_block)
        self.default = self.served[pool_name]
        self.pool, self.geometry = pool, geometry  # (the first pool's: loop, metrics, journal)
        self.page_table = self.default.page_table
        self.sessions: dict[int, Session] = {}
        self.num_deferred = 0  # pins of closed sessions not released yet, in every pool
        self.started_at = time.time()
        self.remote: Any = None  # the remote tiers (kvd/server/remote.Tiers), if --remote
        # pool name → blocks the remote tier imported there for the request running
        self.imported: dict[str, frozenset[int]] = {}
        # The remote tier's probe of a seq_open hashed its tokens: (the pool hashed for,
        # tokens, salt, cap, hashes), so that the open that follows does not hash them again.
        self._probed: tuple[Served, bytes, bytes, int | None, list[bytes]] | None = None
        self.counters = {"sessions_opened": 0, "sessions_closed": 0, "journal_commits": 0,
                         "journal_failures": 0}
        self._ops: dict[str, Callable[[Session, dict[str, Any]], Any]] = {
            "hello": self._hello, "stats": self._stats, "shutdown": self._shutdown,
        }
        # Ops of one pool: the session's (plain name) or the one named after '@'.
        self._pool_ops: dict[str, Callable[[Served, Session, dict[str, Any]], Any]] = {
            "seq_open": self._seq_open, "seq_extend": self._seq_extend,
            "seq_commit": self._seq_commit, "seq_fork": self._seq_fork,
            "seq_close": self._seq_close, "seq_info": self._seq_info,
        }
        self._model_ops: dict[str, Callable[[list[Served], Session, dict[str, Any]], Any]] = {
            "seq_open": self._model_open, "seq_extend": self._model_extend,
            "seq_commit": self._model_commit, "seq_fork": self._model_fork,
            "seq_close": self._model_close, "seq_info": self._model_info,
        }
        if os.environ.get(DEBUG_ENV) == "1":
            self._ops["check_invariants"] = self._check_invariants
        for op in (*self._hot_of[pool_name], *self._ops, *self._pool_ops):  # the ops timed:
            self.ops.latency.add(op)  # made-up names are not labels

    def add_pool(self, name: str, pool: BlockPool, geometry: Geometry,
                 copy_block: Callable[[int, int], None]) -> None:
        """Serve another pool (before any session opens: the op tables are rebuilt)."""
        page_table = PageTable(pool, geometry.block_size, lambda: next(self._ids), copy_block,
                               geometry.window)
        served = self.served[name] = Served(name, pool, geometry, page_table)
        hot = self._hot_ops(served)
        self._hot_named.update({f"{op}@{name}": entry for op, entry in hot.items()})
        self._hot_of[name] = hot
        for ops in self._hot_of.values():  # (in place: a session holds one of these dicts)
            ops.update(self._hot_named)

    def serve_remote(self, remote: Any) -> None:
        """Serve the remote tiers (kvd/server/remote.Tiers; before any session opens): their
        stats, and lookups that may ask how many of their blocks came from them
        (`remote: 1`, replied {block_ids, num_remote}; without a tier the plain lookup stays
        the pool's own method, no frame between)."""
        self.remote = remote
        for name, served in self.served.items():
            self._hot_of[name]["lookup"] = self._hot_named[f"lookup@{name}"] = (
                self._reporting_lookup(served))
        for ops in self._hot_of.values():
            ops.update(self._hot_named)

    def _reporting_lookup(self, served: Served) -> tuple[tuple[ArgField, ...], bool,
                                                          Callable[..., Any]]:
        lookup, name = served.pool.lookup, served.name
        schema = self._hot_of[name]["lookup"][0]

        def reporting_lookup(keys: list[bytes], remote: int | None, owner: int) -> Any:
            block_ids = lookup(keys, owner)
            if remote is None:
                return block_ids
            imported = self.imported.get(name)
            return {"block_ids": block_ids,
                    "num_remote": len(imported.intersection(block_ids)) if imported else 0}
        return (*schema, int_field("remote", 1, 1, is_required=False)), False, reporting_lookup

    def add_model(self, name: str, pool_names: list[str]) -> None:
        """Serve a model over pools already added (kvd/server/config.py checked the names and
        that they share one block size)."""
        self.models[name] = [self.served[pool_name] for pool_name in pool_names]

    def _hot_ops(self, served: Served) -> HotOps:
        """The hot ops of one pool: (schema, whether it writes, handler of the schema's values
        then the session's owner id): the pool's own methods where nothing else is to do, no
        frame between (the pool does a one-block request in C where that runs)."""
        pool = served.pool
        seal = pool.seal
        block_ids = int_list_field("block_ids", MAX_BATCH, pool.num_blocks - 1)
        # kvd.hash_blocks makes 16-byte hashes; MAX_KEY_NBYTES leaves room for other digests.
        hashes = bytes_list_field("hashes", MAX_BATCH, MAX_KEY_NBYTES)

        def alloc(num_blocks: int, owner: int) -> list[int]:
            block_ids = pool.allocate(num_blocks, owner)
            if block_ids is None and self._release_closed():
                block_ids = pool.allocate(num_blocks, owner)
            if block_ids is None:
                raise NoSpaceError(served.page_table._no_space(num_blocks))
            return block_ids

        return {
            "alloc": ((int_field("num_blocks", 0, min(pool.num_blocks, MAX_BATCH)),), True,
                      alloc),
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

    # ---- sessions ------------------------------------------------------------------------
    def open_session(self, pid: int, uid: int) -> Session:
        default = self.default
        session = Session(next(self._ids), pid, uid, default, self._hot_of[default.name])
        self.sessions[session.session_id] = session
        self.counters["sessions_opened"] += 1
        return session

    def close_session(self, session: Session) -> int:
        """Queue the release of everything the session holds, in every pool (`release_deferred`
        does it a bounded step at a time, so a big session's close stalls nobody); returns the
        pins queued. Safe to call twice."""
        if self.sessions.pop(session.session_id, None) is None:
            return 0
        num_queued = self.num_deferred
        for seq_id in sorted(session.seq_ids, reverse=True):
            for served in self.served.values():
                record = served.page_table.sequences.get(seq_id)
                if record is not None:
                    served.page_table.close(record, is_deferred=True)
        session.seq_ids.clear()
        for served in self.served.values():
            held = served.pool.holdings(session.session_id)
            # Highest id released first approximates "tail first" for chains allocated in one
            # batch.
            served.page_table.defer_release([b for b in sorted(held) for _ in range(held[b])],
                                            session.session_id)
        self.counters["sessions_closed"] += 1
        self._count_deferred()
        return self.num_deferred - num_queued

    def _count_deferred(self) -> None:
        # A plain attribute, kept by the only two methods that change the queues: the loop reads
        # it every iteration.
        self.num_deferred = sum(served.page_table.num_deferred for served in self.served.values())

    def release_deferred(self, max_pins: int) -> bool:
        """Release up to `max_pins` pins of closed sessions; whether any are left."""
        for served in self.served.values():
            page_table = served.page_table
            num_before = page_table.num_deferred
            if num_before and max_pins > 0:
                page_table.release_deferred(max_pins)
                max_pins -= num_before - page_table.num_deferred
        self._count_deferred()
        return self.num_deferred > 0

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
        """Release every pin closed sessions still hold, in every pool (the arena moves memory
        between pools, so any pool's freed blocks can make room); whether there was any."""
        num_deferred = self.num_deferred
        self.release_deferred(num_deferred)
        return num_deferred > 0

    def handle(self, session: Session, op: str, args: dict[str, Any]) -> Any:
        """Run one request. Raises a KvdError for the error reply (UNKNOWN_OP, BAD_ARGS, ...)."""
        hot = session.hot.get(op)
        if hot is not None and session.is_ready:  # the traffic: checks in one call, then the op
            schema, writes, handler = hot
            if writes and self.write_error is not None:
                self._check_writable()
            return protocol.call_hot(handler, args, schema, session.session_id)
        op_handler = self._ops.get(op)
        if op_handler is None and hot is None:
            op_handler = self._pool_op(session, op)
        # (No handler here: a hot op, so the session has not said hello.)
        if op_handler is None or (not session.is_ready and op != "hello"):
            raise ProtocolError(f"say hello (protocol version {PROTOCOL_VERSION}) before {op!r}")
        return op_handler(session, args)

    def _pool_op(self, session: Session, op: str) -> Callable[[Session, dict[str, Any]], Any]:
        """The handler of a pool's non-hot op: OP for the session's pool, OP@NAME for NAME's."""
        name, at, pool_name = op.partition("@")
        model = self.models.get(pool_name) if at else None
        if model is not None and name in self._model_ops:
            model_handler = self._model_ops[name]
            return lambda session, args: model_handler(model, session, args)
        served = self._served(pool_name) if at else session.served
        handler = self._pool_ops.get(name)
        if handler is None:
            plain = [op for op in self._hot_of[self.default.name] if "@" not in op]
            raise UnknownOpError(f"unknown op {op!r}: valid ops are "
                                 f"{', '.join([*self._ops, *self._pool_ops, *plain])} "
                                 "(OP@POOL for another pool)")
        return lambda session, args: handler(served, session, args)

    def _served(self, name: str) -> Served:
        served = self.served.get(name)
        if served is None:
            models = f" (and models {', '.join(self.models)})" if self.models else ""
            raise NotFoundError(f"no pool {name!r}: this daemon serves "
                                f"{', '.join(self.served)}{models}")
        return served

    # ---- ops -----------------------------------------------------------------------------
    def _hello(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        check_no_extra(args, ("version", "pid", "pool"))
        version = arg_int(args, "version")
        if version != PROTOCOL_VERSION:
            raise VersionError(f"client speaks protocol {version}, daemon speaks "
                               f"{PROTOCOL_VERSION}: install matching kvd versions")
        pool_name = args.get("pool")
        if pool_name is not None:
            if type(pool_name) is not str:
                raise BadArgsError(f"pool must be a pool name, got {pool_name!r}")
            session.served = self._served(pool_name)
            session.hot = self._hot_of[pool_name]
        session.is_ready = True
        return {"session_id": session.session_id, "protocol_version": PROTOCOL_VERSION,
                "hash_version": HASH_VERSION, "geometry": session.served.geometry.to_dict(),
                "pool": session.served.name,
                "pools": {name: served.geometry.to_dict() for name, served in self.served.items()},
                "models": {name: [served.name for served in model]
                           for name, model in self.models.items()},
                "remote": self.remote is not None,  # (lookups may then ask for `remote`)
                **self.info}

    def _check_writable(self) -> None:
        if self.write_error is not None:
            raise JournalError(f"the daemon refuses allocations and seals until its journal can "
                               f"be written again ({self.write_error}); lookups and reads go on")

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
            "pools": {name: {**self._pool_stats(served), **self._remote_stats(name)}
                      for name, served in self.served.items()},
            **self._arena_stats(),
            **({"remote": self.remote.stats()} if self.remote is not None else {}),
        }

    @staticmethod
    def _pool_stats(served: Served) -> dict[str, Any]:
        """One pool's block counts and counters, policy, geometry and open sequences."""
        return {**served.pool.stats(), **served.page_table.counters,
                "policy": served.pool.policy.name,
                "geometry": served.geometry.to_dict(),
                "sequences": len(served.page_table.sequences)}

    def _remote_stats(self, pool_name: str) -> dict[str, Any]:
        stats = None if self.remote is None else self.remote.pool_stats(pool_name)
        return {} if stats is None else {"remote": stats}

    def _arena_stats(self) -> dict[str, Any]:
        arena = getattr(self.pool, "arena", None)
        return {} if arena is None else {"arena": arena.stats()}

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
        return sum(sum(served.pool.holdings(owner).values()) for served in self.served.values()
                   for owner in (session.session_id, *session.seq_ids))

    def check_invariants(self) -> None:
        """Each pool's invariants (and its arena's), plus: every pin and sequence belongs to a
        live session."""
        seq_ids = set().union(*(s.seq_ids for s in self.sessions.values()))
        open_ids: set[int] = set()
        for served in self.served.values():
            arena = getattr(served.pool, "arena", None)
            (served.pool if arena is None else arena).check_invariants()
            open_ids |= set(served.page_table.sequences)
            stray = (set(served.pool.owners()) - seq_ids - set(self.sessions)
                     - served.page_table.owners())
            if stray:
                raise InternalError(f"pool {served.name!r} owners {sorted(stray)} are neither "
                                    "live sessions, their sequences nor queued releases: a "
                                    "closed session's pins were not released")
        num_pins = sum(s.num_pins for s in self.sessions.values())
        num_table_pins = sum(served.page_table.num_pins for served in self.served.values())
        if num_pins != num_table_pins:
            raise InternalError(f"sessions count {num_pins} sequence pins, the page tables "
                                f"{num_table_pins}")
        if seq_ids != open_ids:
            raise InternalError(f"open sequences {sorted(open_ids)} != those of "
                                f"live sessions {sorted(seq_ids)}: a session leaked a sequence")

    # ---- sequences -----------------------------------------------------------------------
    def _sequence(self, served: Served, session: Session, args: dict[str, Any]) -> SequenceRecord:
        seq_id = arg_int(args, "seq_id")
        record = served.page_table.sequences.get(seq_id)
        if seq_id not in session.seq_ids or record is None:
            raise NotFoundError(f"sequence {seq_id} is not open in this session"
                                + (f" in pool {served.name!r}" if len(self.served) > 1 else ""))
        return record

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

    def _seq_open(self, served: Served, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        self._check_writable()
        tokens, salt, max_cached = self._open_args(args)
        self._check_length(served, len(tokens) // 4)
        self._check_limit(len(session.seq_ids) + 1, "max_sequences", "open sequences")
        self._check_pins(session, -(-len(tokens) // 4 // served.geometry.block_size))
        hashes = self._probed_hashes(served, tokens, salt, max_cached)
        record, num_cached = self._counting_pins(served, session, lambda: served.page_table.open(
            tokens, salt, max_cached, hashes))
        session.seq_ids.add(record.seq_id)
        return self._describe(record, num_cached_tokens=num_cached,
                              num_remote_tokens=self._remote_tokens([served], [record],
                                                                    num_cached))

    def _open_args(self, args: dict[str, Any]) -> tuple[bytes, bytes, int | None]:
        check_no_extra(args, ("tokens", "salt", "max_cached_tokens"))
        return (self._tokens(args), arg_bytes(args, "salt", MAX_SALT_NBYTES, b""),
                arg_int(args, "max_cached_tokens", 0, default=None))

    def open_hashes(self, args: dict[str, Any], served: Served) -> list[bytes]:
        """The hashes a seq_open of `args` looks up in `served` (a model's: its first pool's;
        the remote tier's probe); raises as seq_open would for bad args."""
        tokens, salt, max_cached = self._open_args(args)
        hashes = served.page_table.cacheable_hashes(tokens, salt, max_cached)
        self._probed = (served, tokens, salt, max_cached, hashes)
        return hashes

    def _probed_hashes(self, served: Served, tokens: bytes, salt: bytes,
                       max_cached: int | None) -> list[bytes] | None:
        """The hashes `open_hashes` made for this very open, if it did."""
        probed, self._probed = self._probed, None
        if (probed is None or probed[0] is not served or probed[1] is not tokens
                or probed[2:4] != (salt, max_cached)):
            return None
        return probed[4]

    def _remote_tokens(self, pools: list[Served], records: list[SequenceRecord],
                       num_cached: int) -> int:
        """Of an open's hit, the tokens of the blocks the remote tier imported for it, in any
        of its pools (kvd/server/remote)."""
        if not self.imported:
            return 0
        block_size = pools[0].geometry.block_size
        num_hit = num_cached // block_size
        is_remote = [False] * num_hit
        for served, record in zip(pools, records):
            imported = self.imported.get(served.name, frozenset())
            for position, block_id in enumerate(record.block_ids[:num_hit]):
                if block_id in imported:
                    is_remote[position] = True
        return sum(is_remote) * block_size

    def _check_limit(self, num: int, name: str, what: str) -> None:
        limit = getattr(self.limits, name)
        if num > limit:
            raise TooLargeError(f"this session would hold {num} {what}, above the daemon's "
                                f"limit of {limit} (kvd start --{name.replace('_', '-')})")

    def _check_pins(self, session: Session, num_new: int) -> None:
        self._check_limit(session.num_pins + num_new, "max_pins", "block pins in its sequences")

    def _counting_pins(self, served: Served | list[Served], session: Session,
                       call: Callable[[], Any]) -> Any:
        """`call()` (an op of `served`'s page table, or of a model's pools), its change of the
        sequences' pins charged to `session`."""
        tables = [each.page_table for each in (served if isinstance(served, list) else [served])]
        num_pins = sum(table.num_pins for table in tables)
        try:
            return self._with_room(call)
        finally:
            session.num_pins += sum(table.num_pins for table in tables) - num_pins

    def _seq_extend(self, served: Served, session: Session, args: dict[str, Any]) -> list[int]:
        self._check_writable()
        check_no_extra(args, ("seq_id", "tokens", "num_computed"))
        record = self._sequence(served, session, args)
        tokens = self._tokens(args)
        num_computed = arg_int(args, "num_computed", 0, record.num_tokens, record.num_tokens)
        num_tokens = record.num_tokens + len(tokens) // 4
        self._check_length(served, num_tokens)
        self._check_pins(session, -(-num_tokens // served.geometry.block_size)
                         - len(record.own_block_ids) - record.num_run_blocks)
        return self._counting_pins(
            served, session, lambda: served.page_table.extend(record, tokens, num_computed))

    @staticmethod
    def _check_length(served: Served, num_tokens: int) -> None:
        block_size = served.geometry.block_size
        if -(-num_tokens // block_size) > MAX_BATCH:
            raise BadArgsError(f"a sequence holds at most {MAX_BATCH} blocks "
                               f"({MAX_BATCH * block_size} tokens of block size {block_size}), "
                               f"this one would have {num_tokens} tokens")

    def _seq_commit(self, served: Served, session: Session, args: dict[str, Any]) -> int:
        self._check_writable()
        check_no_extra(args, ("seq_id", "num_computed"))
        record = self._sequence(served, session, args)
        num_computed = arg_int(args, "num_computed", 0, record.num_tokens, record.num_tokens)
        return self._counting_pins(  # (a window pool releases blocks outside the window)
            served, session, lambda: served.page_table.commit(record, num_computed))

    def _seq_fork(self, served: Served, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        self._check_writable()
        check_no_extra(args, ("seq_id",))
        record = self._sequence(served, session, args)
        self._check_limit(len(session.seq_ids) + 1, "max_sequences", "open sequences")
        self._check_limit(len(session.fork_ids) + 1, "max_forks", "forked sequences")
        self._check_pins(session, len(record.own_block_ids) - len(record.own_hashes))
        child = self._counting_pins(served, session, lambda: served.page_table.fork(record))
        session.seq_ids.add(child.seq_id)
        session.fork_ids.add(child.seq_id)
        return self._describe(child)

    def _seq_close(self, served: Served, session: Session, args: dict[str, Any]) -> None:
        check_no_extra(args, ("seq_id",))
        record = self._sequence(served, session, args)
        self._counting_pins(served, session, lambda: served.page_table.close(record))
        # (a model's sequence stays the session's while another of its pools holds it)
        if not any(record.seq_id in other.page_table.sequences for other in self.served.values()):
            session.seq_ids.discard(record.seq_id)
            session.fork_ids.discard(record.seq_id)

    def _seq_info(self, served: Served, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        check_no_extra(args, ("seq_id",))
        return self._describe(self._sequence(served, session, args))

    # ---- sequences of a model (one per pool, one seq_id) -----------------------------------
    def _model_records(self, model: list[Served], session: Session, args: dict[str, Any]
                       ) -> list[SequenceRecord]:
        return [self._sequence(served, session, args) for served in model]

    @staticmethod
    def _describe_model(model: list[Served], records: list[SequenceRecord], **extra: Any
                        ) -> dict[str, Any]:
        """The sequence: its id and length, and each pool's block table (HOLE, -1, where a
        window pool released a block) and sealed-block count."""
        return {"seq_id": records[0].seq_id, "num_tokens": records[0].num_tokens,
                "pools": {served.name: {"block_ids": record.block_ids,
                                        "num_sealed_blocks": record.num_sealed}
                          for served, record in zip(model, records)}, **extra}

    def _model_open(self, model: list[Served], session: Session, args: dict[str, Any]
                    ) -> dict[str, Any]:
        self._check_writable()
        tokens, salt, max_cached = self._open_args(args)
        self._check_length(model[0], len(tokens) // 4)
        self._check_limit(len(session.seq_ids) + 1, "max_sequences", "open sequences")
        self._check_pins(session, len(model) * -(-len(tokens) // 4 // model[0].geometry.block_size))
        seq_id = next(self._ids)
        hashes = self._probed_hashes(model[0], tokens, salt, max_cached)
        records, num_cached = self._counting_pins(model, session, lambda: open_spanning(
            [served.page_table for served in model], seq_id, tokens, salt, max_cached, hashes))
        session.seq_ids.add(seq_id)
        return self._describe_model(model, records, num_cached_tokens=num_cached,
                                    num_remote_tokens=self._remote_tokens(model, records,
                                                                          num_cached))

    def _model_extend(self, model: list[Served], session: Session, args: dict[str, Any]
                      ) -> dict[str, list[int]]:
        self._check_writable()
        check_no_extra(args, ("seq_id", "tokens", "num_computed"))
        records = self._model_records(model, session, args)
        tokens = self._tokens(args)
        num_tokens = records[0].num_tokens
        # (up to the appended tokens: the engine is about to compute them, see extend_spanning)
        num_computed = arg_int(args, "num_computed", 0, num_tokens + len(tokens) // 4,
                               num_tokens)
        num_blocks = -(-(num_tokens + len(tokens) // 4) // model[0].geometry.block_size)
        self._check_length(model[0], num_tokens + len(tokens) // 4)
        self._check_pins(session, sum(num_blocks - len(record.own_block_ids)
                                      - record.num_run_blocks for record in records))
        new_ids = self._counting_pins(model, session, lambda: extend_spanning(
            [served.page_table for served in model], records, tokens, num_computed))
        return {served.name: ids for served, ids in zip(model, new_ids)}

    def _model_commit(self, model: list[Served], session: Session, args: dict[str, Any]
                      ) -> dict[str, int]:
        self._check_writable()
        check_no_extra(args, ("seq_id", "num_computed"))
        records = self._model_records(model, session, args)
        num_tokens = records[0].num_tokens
        num_computed = arg_int(args, "num_computed", 0, num_tokens, num_tokens)
        return self._counting_pins(model, session, lambda: {  # (a window pool releases)
            served.name: served.page_table.commit(record, num_computed)
            for served, record in zip(model, records)})

    def _model_fork(self, model: list[Served], session: Session, args: dict[str, Any]
                    ) -> dict[str, Any]:
        self._check_writable()
        check_no_extra(args, ("seq_id",))
        records = self._model_records(model, session, args)
        self._check_limit(len(session.seq_ids) + 1, "max_sequences", "open sequences")
        self._check_limit(len(session.fork_ids) + 1, "max_forks", "forked sequences")
        self._check_pins(session, sum(len(record.own_block_ids) - len(record.own_hashes)
                                      for record in records))
        seq_id = next(self._ids)
        children = self._counting_pins(model, session, lambda: fork_spanning(
            [served.page_table for served in model], records, seq_id))
        session.seq_ids.add(seq_id)
        session.fork_ids.add(seq_id)
        return self._describe_model(model, children)

    def _model_close(self, model: list[Served], session: Session, args: dict[str, Any]) -> None:
        check_no_extra(args, ("seq_id",))
        records = self._model_records(model, session, args)
        session.seq_ids.discard(records[0].seq_id)
        session.fork_ids.discard(records[0].seq_id)

        def close_all() -> None:
            for served, record in zip(model, records):
                served.page_table.close(record)
        self._counting_pins(model, session, close_all)

    def _model_info(self, model: list[Served], session: Session, args: dict[str, Any]
                    ) -> dict[str, Any]:
        check_no_extra(args, ("seq_id",))
        return self._describe_model(model, self._model_records(model, session, args))
