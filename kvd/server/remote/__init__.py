"""The remote tier (`kvd start --remote`): sealed blocks written behind to Redis (or a Redis
Cluster), local misses read through from it. docs/remote.md is the operator's guide.

    codec.py        the URL, the key of a block and the value format (pure)
    tier.py         RemoteTier: one pool's write-behind and fetch threads, health and counters
    this module     what the loop thread does: tap each pool's seals, find what a request's
                    pools lack, import fetched blocks into them (Tiers, ReadThrough)

Every pool has its own RemoteTier: its keys (named after the pool and its geometry, codec.py),
its seal tap, its threads and counters, so pools never meet and each reports apart.

Read-through on the loop (kvd/server/loop.py holds the deferred replies):

    1. a lookup or seq_open arrives (OP@POOL and seq_open@MODEL too); `Tiers.read` finds what
       its pools lack (none: served as usual, at the cost of an index probe of its last key, or
       of its window in a sliding-window pool);
    2. each pool that lacks blocks queues a fetch on its tier (a tier may decline: the request
       is then served from what is local and the other pools' fetches), and the request's reply
       is deferred; the loop goes on serving everyone else;
    3. the last fetch's wake-up arrives, or the deadline (--remote-timeout-ms) passes first;
    4. `ReadThrough.import_fetched` takes the longest hit over local and fetched blocks, pins
       the local blocks it needs in every pool (so that no allocation, in any pool of the
       arena, evicts them), allocates fresh blocks for the fetched ones it needs, copies them
       in and seals them (journaled like any seal; not written back), under IMPORT_OWNER;
    5. the request runs as if it had just arrived (it now hits the imported blocks), then
       IMPORT_OWNER's pins are dropped: the blocks stay pinned by the requester or become cached
       like any other.
A read-through whose fetches finish after its deadline is still imported (the next request
finds it).

The hit rule is the request's: a lookup's is the plain prefix (every block up to the hit
point); a seq_open's is its pools' (kvd/core/page_table.py): a full-attention pool needs every
block of the prefix, a sliding-window pool only the blocks covering the window before the hit
point. The hit point is not known before the fetches answer, so a window pool asks for the
blocks it lacks from the window before the first point past the local hit on: whatever the full
pools' fetches bring, the window before it is among them. Only what the final hit needs is
imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvd.core.page_table import longest_hit, servable_of
from kvd.core.pool import BlockPool
from kvd.errors import InternalError, KvdError
from kvd.server.remote.codec import MAX_HASH_NBYTES, BlockCodec, Blocks, RemoteURL, parse_url
from kvd.server.remote.tier import DEFAULT_TIMEOUT_MS, FetchJob, RemoteTier, require_redis

__all__ = ["BlockCodec", "Blocks", "DEFAULT_TIMEOUT_MS", "IMPORT_OWNER", "ReadThrough",
           "RemoteTier", "RemoteURL", "SealTap", "SlabBlocks", "Tiers", "parse_url",
           "require_redis"]

# The pool owner of blocks being imported; never a session's (those count up from 1), and it
# holds nothing between two loop iterations.
IMPORT_OWNER = -1
# Counted per tier but meaning one figure each (summed, a daemon's figure would be wrong).
SHARED_STATS = ("url", "timeout_ms", "last_error")
STATE_ORDER = ("down", "stalled", "connecting", "up")  # the daemon's state: its worst pool's
# What a request reads through: lookup or seq_open (the hit rule), its pools (Served), their
# windows (ReadThrough.windows)
Target = tuple[str, list[Any], list[int | None]]


class SealTap:
    """The pool's observer with a remote tier: the journal's (if any), and every newly indexed
    block queued for writing. `evicted` is the journal's own method, so an eviction costs no
    extra call (kvd/core/_pool.c calls it directly)."""

    def __init__(self, journal: Any, tier: RemoteTier) -> None:
        self._journal_sealed = None if journal is None else journal.sealed
        self._tier_sealed = tier.sealed
        self.evicted = _ignore if journal is None else journal.evicted

    def sealed(self, rows: list[Any]) -> None:
        if self._journal_sealed is not None:
            self._journal_sealed(rows)
        self._tier_sealed(rows)


def _ignore(block_id: int) -> None:
    """No journal: evictions concern no one."""


class SlabBlocks:
    """A pool's blocks in the slabs it shares with other pools (kvd/core/arena.py), as rows of
    bytes for the tier: block b is row b % blocks_per_slab of slab b // blocks_per_slab."""

    def __init__(self, slabs: np.ndarray, blocks_per_slab: int) -> None:
        """`slabs`: Segment.slabs_of(pool)."""
        self._rows = slabs.reshape(*slabs.shape[:2], -1).view(np.uint8)
        if not np.may_share_memory(self._rows, slabs):  # (blocks are C-ordered: never)
            raise InternalError("a pool's slabs cannot be viewed as rows of bytes")
        self._blocks_per_slab = blocks_per_slab

    def __getitem__(self, block_id: int) -> np.ndarray:
        return self._rows[divmod(block_id, self._blocks_per_slab)]

    def __setitem__(self, block_id: int, value: Any) -> None:
        self._rows[divmod(block_id, self._blocks_per_slab)] = value


@dataclass(eq=False)
class PoolFetch:
    """One pool's part of a read-through: the positions of the request's keys it asked for."""

    served: Any  # kvd.server.service.Served
    tier: RemoteTier
    indices: list[int]
    job: FetchJob
    is_done: bool = False


@dataclass(eq=False)
class ReadThrough:
    """A deferred request (module docstring): its keys, its pools with the blocks each held when
    it arrived, and the fetches of those that lacked some."""

    keys: list[bytes]
    pools: list[Any]  # kvd.server.service.Served
    windows: list[int | None]  # per pool: the blocks before the hit point it needs (None: all)
    presents: list[list[bool]]  # per pool: which keys it held
    fetches: list[PoolFetch]
    context: Any = None  # the loop's: the deferred request
    imported: dict[str, frozenset[int]] = field(default_factory=dict)  # pool name → block ids
    is_answered: bool = False  # the loop answered the request (in time or at its deadline)

    @property
    def deadline(self) -> float:
        """time.monotonic() by which the request is answered, fetched or not."""
        return min(fetch.job.deadline for fetch in self.fetches)

    def import_fetched(self) -> dict[str, frozenset[int]]:
        """Seal what the fetches brought that the longest hit needs into fresh blocks held by
        IMPORT_OWNER, the local blocks it needs pinned first (module docstring, step 4);
        returns each pool's imported block ids. `release` drops IMPORT_OWNER's pins."""
        fetches = self._fetch_of_pool()
        fetched = [{} if fetch is None else dict(zip(fetch.indices, fetch.job.payloads))
                   for fetch in fetches]
        presents = [[is_present or index in payloads for index, is_present in enumerate(present)]
                    for present, payloads in zip(self.presents, fetched)]
        num_hit = longest_hit([servable_of(present, window)
                               for present, window in zip(presents, self.windows)])
        spans = [range(0 if window is None else max(num_hit - window, 0), num_hit)
                 for window in self.windows]
        for served, span in zip(self.pools, spans):
            index = served.pool.tables.index
            local = [index[key] for key in self.keys[span.start:span.stop] if key in index]
            if local:
                served.pool.pin(local, IMPORT_OWNER)
        for served, span, payloads, fetch in zip(self.pools, spans, fetched, fetches):
            if fetch is not None and payloads:
                self.imported[served.name] = frozenset(self._seal(
                    served.pool, fetch.tier, [k for k in span if k in payloads], payloads,
                    is_chained=served.page_table.window is None))
        return self.imported

    def _fetch_of_pool(self) -> list[PoolFetch | None]:
        fetches = {id(fetch.served): fetch for fetch in self.fetches}
        return [fetches.get(id(served)) for served in self.pools]

    def _seal(self, pool: BlockPool, tier: RemoteTier, indices: list[int],
              payloads: dict[int, memoryview], is_chained: bool) -> list[int]:
        """Import the blocks at `indices` (those not sealed here meanwhile); their ids."""
        index, keys = pool.tables.index, self.keys
        indices = [k for k in indices if keys[k] not in index]
        blocks = tier.blocks
        num_blocks = min(len(indices), pool.num_available)
        block_ids = pool.allocate(num_blocks, IMPORT_OWNER) if num_blocks else None
        if not block_ids or blocks is None:
            return []
        indices = indices[:num_blocks]
        for block_id, k in zip(block_ids, indices):
            blocks[block_id] = np.frombuffer(payloads[k], dtype=np.uint8)
        # (a full-attention pool's prefix tree links each block to the one before it; a window
        # pool seals without parents, kvd/core/page_table.py)
        parents = [keys[k - 1] if k else None for k in indices] if is_chained else None
        tier.is_importing = True
        try:
            pool.seal(block_ids, [keys[k] for k in indices], IMPORT_OWNER, parents)
        finally:
            tier.is_importing = False
        return block_ids

    def count_hits(self) -> None:
        """Count, per tier, the imported blocks the request kept (its remote hits)."""
        for fetch in self.fetches:
            pool = fetch.served.pool
            fetch.tier.counters["hit_blocks"] += sum(
                pool.ref_count(block_id) > 1
                for block_id in self.imported.get(fetch.served.name, ()))

    def count_timeout(self) -> None:
        """Answered at its deadline: each tier still fetching counts it."""
        for fetch in self.fetches:
            if not fetch.is_done:
                fetch.tier.counters["timeouts"] += 1

    def release(self) -> None:
        """Drop IMPORT_OWNER's pins in every pool of the request."""
        for served in self.pools:
            served.pool.release_owner(IMPORT_OWNER)


class Tiers:
    """The remote tiers of a daemon's pools (one each) and the read-throughs in flight."""

    def __init__(self, tiers: dict[str, RemoteTier]) -> None:
        self.tiers = tiers  # pool name → its tier
        # a session's pool (Served) → the targets of its requests by op name: plain for its
        # own pool, OP@NAME for any (`bind`)
        self._targets: dict[Any, dict[str, Target]] = {}

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()

    @property
    def done_fds(self) -> list[Any]:
        """Readable when a fetch finished: the loop then calls `take_done`."""
        return [tier.done_fd for tier in self.tiers.values()]

    def bind(self, pools: dict[str, Any], models: dict[str, list[Any]]) -> frozenset[str]:
        """Learn the service's pools (name → kvd.server.service.Served) and models (name → its
        pools); returns the op names a read-through may defer."""
        plain: dict[Any, dict[str, Target]] = {}
        named: dict[str, Target] = {}
        for name, served in pools.items():
            plain[served] = {"lookup": ("lookup", [served], [None]),
                             "seq_open": ("seq_open", [served], [served.page_table.window_blocks])}
            named.update({f"{op}@{name}": target for op, target in plain[served].items()})
        for name, model in models.items():
            named[f"seq_open@{name}"] = (
                "seq_open", model, [served.page_table.window_blocks for served in model])
        self._targets = {served: {**targets, **named} for served, targets in plain.items()}
        return frozenset({"lookup", "seq_open", *named})

    def read(self, session_pool: Any, op: str, args: Any, open_hashes: Any
             ) -> ReadThrough | None:
        """Start the read-through of a request (a lookup or seq_open of the session's pool
        `session_pool`, a Served, or of the pool or model it names), or None if its pools hold
        all it could hit, its args are malformed (the op then answers them), or no tier takes
        a fetch.

        Args:
            open_hashes: the hashes a seq_open of `args` looks up (Service.open_hashes).
        """
        target = self._targets[session_pool].get(op)
        if target is None:  # (a name nothing serves: the op answers it)
            return None
        kind, pools, windows = target
        if kind == "lookup":
            keys = args.get("hashes") if type(args) is dict else None
            if type(keys) is not list or not keys:
                return None
            last = keys[-1]  # the usual hit, all local as far as a prefix can tell (cached
            if type(last) is bytes and last in pools[0].pool.tables.index:  # children have
                return None  # cached parents): one probe
            if not all(type(key) is bytes and 0 < len(key) <= MAX_HASH_NBYTES for key in keys):
                return None  # (the lookup answers BAD_ARGS)
        else:
            try:
                keys = open_hashes(args, pools[0])
            except KvdError:  # malformed: seq_open answers with the right error
                return None
            if not keys or all(_holds_end(served.pool, keys, window)
                               for served, window in zip(pools, windows)):
                return None
        presents = [[key in served.pool.tables.index for key in keys] for served in pools]
        num_hit = longest_hit([servable_of(present, window)
                               for present, window in zip(presents, windows)])
        read = ReadThrough(keys, pools, windows, presents, [])
        for served, present, window in zip(pools, presents, windows):
            first = num_hit if window is None else max(num_hit + 1 - window, 0)
            indices = [k for k in range(first, len(keys)) if not present[k]]
            tier = self.tiers[served.name]
            job = tier.fetch([keys[k] for k in indices]) if indices else None
            if job is not None:
                fetch = PoolFetch(served, tier, indices, job)
                job.context = (read, fetch)
                read.fetches.append(fetch)
        return read if read.fetches else None

    def take_done(self) -> list[ReadThrough]:
        """The read-throughs whose last fetch just finished (after a `done_fds` turned
        readable)."""
        done = []
        for tier in self.tiers.values():
            for job in tier.take_done():
                read, fetch = job.context
                fetch.is_done = True
                if all(each.is_done for each in read.fetches):
                    done.append(read)
        return done

    def pool_stats(self, name: str) -> dict[str, Any] | None:
        tier = self.tiers.get(name)
        return None if tier is None else tier.stats()

    def stats(self) -> dict[str, Any]:
        """The daemon's tier: one pool's stats, or of several their counts summed, their
        worst state (per-pool stats are `pool_stats`)."""
        each = [tier.stats() for tier in self.tiers.values()]
        if len(each) == 1:
            return each[0]
        total: dict[str, Any] = {key: each[0][key] for key in SHARED_STATS}
        total["last_error"] = next((s["last_error"] for s in each if s["last_error"]), None)
        total["state"] = min((s["state"] for s in each), key=STATE_ORDER.index)
        for key, value in each[0].items():
            if type(value) is int and key not in total:
                total[key] = sum(s[key] for s in each)
        return total


def _holds_end(pool: BlockPool, keys: list[bytes], window: int | None) -> bool:
    """Whether the pool holds what a hit of all `keys` needs, as far as the end of them tells:
    the last key, or a window pool's last window."""
    index = pool.tables.index
    if window is None:
        return keys[-1] in index
    return all(key in index for key in keys[len(keys) - window:])
