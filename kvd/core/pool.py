"""The block pool: states, ref counts, pins per owner, the free list and the content-hash index.

Theory of operation
-------------------
The pool owns the metadata of `num_blocks` fixed-size blocks; it never touches KV bytes, sockets
or files. The daemon and the embedded cache both drive it from a single thread.

Block states (DESIGN.md section 3)::

    FREE ──allocate──► OWNED(owner, writable) ──seal(hash)──► SEALED(ref>0, read-only)
      ▲                   │ release / owner gone                 │ last release
      │                   ▼                                      ▼
      └──────────────── FREE ◄──── evict (policy victim) ◄── CACHED(sealed, ref 0)
                                                                 │ lookup hit → SEALED

Tables: the pool's whole state is one `PoolTables` object, flat per-block tables chosen so a
million-block pool costs tens of bytes per block and no Python object per block until it holds
content (field by field in its docstring): states, ref counts, tiers, orphan and duplicate marks
as byte or int arrays; the free list as a fixed stack `free[:counts[NUM_FREE]]` (allocate pops,
free pushes, both O(1); LIFO hands out recently freed blocks whose pages are warm); each
sealed block's hash in a list; the hash index (at most one block per hash, invariant 4) and the
holdings {owner: {block id: pins}} as dicts; the generations (uint64 per block, in the shared
segment when a daemon runs: bumped every time a block goes back to FREE, so a reader holding a
stale id can tell it was reused, invariant 5); the prefix tree's links; and the counts and
cumulative counters as one int64 array. Every field is made once and never reassigned or
resized (`restore` fills them in place): that is what lets kvd/core/_pool.c bind them once.

Prefix tree (strict prefix awareness): a block sealed with its parent's key (the page table always
gives it; raw seals may) is linked under the block that holds that key, in child lists threaded
through four int32 arrays (no Python object per block; link and unlink are O(1)). Then:
  * a policy victim with cached descendants takes them along: the pool walks the victim's subtree
    and evicts its cached blocks tail first (children before parents, `policy.discard` for each),
    because a child without its parent is unreachable. A pinned descendant stays for its holder
    but is cut off (marked orphan) and freed, not cached, on its last release;
  * a block sealed under a parent key that is no longer indexed, or held by an orphan, is an
    orphan from the start.
So no cached block is ever reachable only through an evicted parent (no stranded middles), and a
parent is never evicted before its cached children. Cost: each block is linked once and unlinked
once per residency, and an eviction visits the blocks it frees plus any pinned ones below them,
so every operation is O(1) amortised per freed block. (Pinned blocks under a cached parent only
arise from raw pins of a chain's middle: a sequence pins its whole chain from the head.)
Evicting a subtree may free more blocks than an allocation asked for; they were unreachable, so
nothing of value is lost. The journal records each block's parent, so `restore` rebuilds the tree.

The policy sees only CACHED keys (see kvd/core/policies/base.py). One exception: the victim chosen
ahead of need. On a full pool every allocation must evict, and asking the policy for its victim
is about a third of that work; `choose_next_victim()` lets the daemon ask while it is idle
(after the replies of a loop iteration went out). The chosen block stays CACHED and indexed --
nothing is evicted early, a lookup still finds it -- but the policy has let it go (`victim()`
returned it), so the pool remembers it in the NEXT_VICTIM count: the next eviction takes it, and
a hit before then cancels the choice (the block is pinned; the policy hears of it again when it
is inserted on release, as of any key it chose). So `num_cached == len(policy)` plus one while a
victim is chosen.

Duplicates: sealing a hash that another block already holds leaves the sealer's block SEALED but
out of the index. Its ids stay valid for the sealer (a worker's block table never changes under
it) and it is freed, not cached, on its last release. A release tells a duplicate by its mark,
without probing the index (a random access into a table of every cached hash).

Policy events: a batch's hits reach the policy as one `hit_evictable_many`, its blocks becoming
evictable as one `inserted_many` (a single key as `hit_evictable` / `inserted`, which the policy
interface defines as the same), each delivered before any other event of the batch so that the
policy sees every key's events in the order they happened.

Native code: kvd/core/_pool.c binds a pool's tables once (`bind`, which checks every field's
name, type, item format and length, so a renamed or retyped table fails there, loudly) and does
the per-block operations of allocate (from the free list), eviction, seal, put, lookup, pin,
release and journal_rows, whole: the method asks it first, and it either does the entire call -- the
same table changes and policy events, in the same order, as the Python below -- or declines
before changing anything (arguments it does not vouch for: not lists, keys not exact bytes, ids
repeated or out of range, anything that must raise; for allocate, a free list too short: it is
asked again once eviction made room), and then the Python does the call. So the Python is the
specification (tests/native/test_pool_c.py runs twin pools, one with the module and one
without, and compares every table and every policy event) and KVD_PURE_PYTHON=1, or a build
without the module, runs it alone. What the C buys: `python -m bench.pool_ab --base python`.

Errors: expected exhaustion returns None from `allocate` and `put`; misuse by a caller (wrong
owner, wrong state, bad hash) raises a typed KvdError and changes nothing; a policy that returns a
key the pool cannot evict raises InternalError naming the policy — that is a kvd bug.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from kvd import native
from kvd.core.policies import TIER_NAMES, TIER_PREFILL, EvictionPolicy, make_policy
from kvd.errors import BadArgsError, InUseError, InternalError, NotFoundError

_built_native = native.built("pool")  # (twin tests bind it directly)
_native = native.load("pool")  # kvd/core/_pool.c, or None where the Python runs alone

FREE, OWNED, SEALED, CACHED = 0, 1, 2, 3
NO_BLOCK = -1  # an empty link in the prefix tree, and no chosen victim
# In IndexRows: the `parent` of a chain's head, and of an orphan (sealed after its parent was
# evicted, so unreachable).
NO_PARENT, ORPHAN = NO_BLOCK, -2
STATE_NAMES = ("free", "owned", "sealed", "cached")
# PoolTables.counts, by position: the state counts the free list and the holdings do not give,
# the chosen victim, then the cumulative counters that `stats` reports.
COUNT_NAMES = ("free", "owned", "sealed", "next_victim", "allocations", "evictions", "seals",
               "lookups", "lookup_blocks", "hit_blocks")
(NUM_FREE, NUM_OWNED, NUM_SEALED, NEXT_VICTIM, ALLOCATIONS, EVICTIONS, SEALS, LOOKUPS,
 LOOKUP_BLOCKS, HIT_BLOCKS) = range(len(COUNT_NAMES))
COUNTERS = COUNT_NAMES[ALLOCATIONS:]
# An indexed block as the journal records it (BlockPool.journal_rows):
# (block_id, key, generation, parent, parent_generation, tier), as in IndexRows.
JournalRow = tuple[int, Hashable, int, int, int, int]


@dataclass(frozen=True, slots=True)
class PoolTables:
    """One pool's state: the contract between kvd/core/pool.py and kvd/core/_pool.c.

    Per block (each exactly `num_blocks` long, indexed by block id):
        state         bytearray: FREE, OWNED, SEALED or CACHED
        refs          array('q'): pins by live owners
        hashes        list: the content key of a SEALED or CACHED block, else None
        tier          bytearray: who wrote a sealed block (TIER_PREFILL or TIER_DECODE)
        is_orphan     bytearray: 1 for a block cut off from its prefix (never cached)
        is_duplicate  bytearray: 1 for a SEALED block outside the index
        parent, first_child, next_sibling, prev_sibling
                      array('i'): the prefix tree's links, NO_BLOCK where none
        free          array('q'): the free list, a stack: free[:counts[NUM_FREE]], top last
        generations   memoryview of uint64 ('Q'): bumped each time the block becomes FREE
    Shared:
        index         dict key → block id of the indexed blocks, oldest first
        held          dict owner → {block id: pins}; an owner that holds nothing has no entry
        counts        array('q') of len(COUNT_NAMES), by position: see COUNT_NAMES
    Frozen: no field is ever reassigned and no table resized (kvd/core/_pool.c holds their
    buffers); `BlockPool.restore` fills them in place.
    """

    COUNT_NAMES: ClassVar[tuple[str, ...]] = COUNT_NAMES
    state: bytearray
    refs: array
    hashes: list[Hashable | None]
    tier: bytearray
    is_orphan: bytearray
    is_duplicate: bytearray
    parent: array
    first_child: array
    next_sibling: array
    prev_sibling: array
    free: array
    generations: memoryview
    index: dict[Hashable, int]
    held: dict[int, dict[int, int]]
    counts: array

    @classmethod
    def empty(cls, num_blocks: int, generations: memoryview) -> PoolTables:
        """Every block FREE, block 0 on top of the free stack."""
        counts = array("q", [0] * len(COUNT_NAMES))
        counts[NUM_FREE], counts[NEXT_VICTIM] = num_blocks, NO_BLOCK
        no_links = array("i", [NO_BLOCK]) * num_blocks
        return cls(state=bytearray(num_blocks), refs=array("q", bytes(8 * num_blocks)),
                   hashes=[None] * num_blocks, tier=bytearray(num_blocks),
                   is_orphan=bytearray(num_blocks), is_duplicate=bytearray(num_blocks),
                   parent=no_links, first_child=array("i", no_links),
                   next_sibling=array("i", no_links), prev_sibling=array("i", no_links),
                   free=array("q", range(num_blocks - 1, -1, -1)), generations=generations,
                   index={}, held={}, counts=counts)


def _check_key(key: Hashable) -> None:
    """A content key must be hashable and not None (None marks a block without content)."""
    if type(key) is bytes:  # what the daemon passes: skip the hash() probe
        return
    try:
        hash(key)
    except TypeError:
        raise BadArgsError(f"block hash {key!r} is not hashable: pass bytes") from None
    if key is None:
        raise BadArgsError("block hash None is not a content hash: pass bytes")


def _tell_hits(policy: EvictionPolicy, keys: list[Hashable]) -> None:
    """`hit_evictable_many(keys)`, a single key as `hit_evictable` (the same, by contract)."""
    if len(keys) == 1:
        policy.hit_evictable(keys[0])
    else:
        policy.hit_evictable_many(keys)


def _tell_inserted(policy: EvictionPolicy, keys: list[Hashable], tiers: list[int]) -> None:
    """`inserted_many(keys, tiers)`, a single key as `inserted` (the same, by contract)."""
    if len(keys) == 1:
        policy.inserted(keys[0], tiers[0])
    else:
        policy.inserted_many(keys, tiers)


class IndexRows(NamedTuple):
    """The hash index as columns, oldest entry first: what the journal keeps and restores.

    Numeric columns are lists or NumPy arrays (the journal loads int64/uint64/uint8 arrays,
    which `restore` uses without a copy).
    """

    block_ids: Sequence[int]
    keys: list[Hashable]
    generations: Sequence[int]  # the block's generation when it was sealed
    parents: Sequence[int]  # parent block id, NO_PARENT or ORPHAN
    parent_generations: Sequence[int]  # the parent's generation when the child was sealed
    tiers: Sequence[int]


class PoolObserver(Protocol):
    """Receives every change to the hash index, in order (kvd.server.journal.Journal is one)."""

    def sealed(self, rows: list[JournalRow]) -> None:
        """Blocks just indexed by one seal call, in order, as BlockPool.journal_rows makes them
        (one call per seal, not per block: a batch-16 seal's journal work is mostly per-call
        overhead otherwise)."""

    def evicted(self, block_id: int) -> None: ...


class BlockPool:
    """Metadata of one pool of equally shaped blocks."""

    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy | str = "default",
        generations: np.ndarray | None = None,
        observer: PoolObserver | None = None,
    ) -> None:
        """Args:
            num_blocks: blocks in the pool (> 0).
            policy: an EvictionPolicy or a registered policy name.
            generations: uint64 array of `num_blocks` counters to maintain (e.g. in shared memory);
                a private one is made when None.
            observer: told of every change to the hash index (the crash-recovery journal); fixed
                for the pool's life.
        """
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise BadArgsError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # Blocks this pool holds: all of them, except in an arena (kvd/core/arena.py), whose
        # pools span an id space of which only the ids of the slabs they own are present.
        self.num_present = num_blocks
        self.policy = make_policy(policy, num_blocks) if isinstance(policy, str) else policy
        if generations is None:
            generations = np.zeros(num_blocks, dtype=np.uint64)
        if (generations.shape != (num_blocks,) or generations.dtype != np.uint64
                or not generations.flags.c_contiguous):
            raise BadArgsError(f"generations must be a contiguous uint64 array of shape "
                               f"({num_blocks},), got {generations.dtype} {generations.shape}")
        self.generations = generations
        self.observer = observer
        # (the counters as a flat memoryview: bumping one costs half a NumPy scalar update)
        self.tables = PoolTables.empty(num_blocks, generations.data.cast("B").cast("Q"))
        # kvd/core/_pool.c bound to these tables, the policy and the observer, or None where the
        # Python runs alone (twin tests and bench.pool_ab set it themselves: None runs Python).
        self._loops = None if _native is None else _native.bind(self.tables, self.policy, observer)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.tables.counts[NUM_FREE]

    @property
    def num_owned(self) -> int:
        return self.tables.counts[NUM_OWNED]

    @property
    def num_sealed(self) -> int:
        return self.tables.counts[NUM_SEALED]

    @property
    def num_cached(self) -> int:
        counts = self.tables.counts
        return self.num_present - counts[NUM_FREE] - counts[NUM_OWNED] - counts[NUM_SEALED]

    @property
    def num_available(self) -> int:
        """Blocks an allocation could get right now: free plus evictable."""
        counts = self.tables.counts
        return self.num_present - counts[NUM_OWNED] - counts[NUM_SEALED]

    @property
    def counters(self) -> dict[str, int]:
        """Cumulative counts (a copy): named apart from the state counts (an "evictions" total,
        "cached" now)."""
        return dict(zip(COUNTERS, self.tables.counts[ALLOCATIONS:]))

    def state(self, block_id: int) -> str:
        return STATE_NAMES[self.tables.state[self._checked_id(block_id)]]

    def ref_count(self, block_id: int) -> int:
        return self.tables.refs[self._checked_id(block_id)]

    def block_hash(self, block_id: int) -> Hashable | None:
        return self.tables.hashes[self._checked_id(block_id)]

    def find(self, key: Hashable) -> int | None:
        """Block id holding `key` in the index, without pinning or counting an access."""
        return self.tables.index.get(key)

    def holdings(self, owner: int) -> dict[int, int]:
        """Copy of {block id: pins} held by `owner`."""
        return dict(self.tables.held.get(owner, {}))

    def owners(self) -> list[int]:
        return list(self.tables.held)

    def states(self) -> bytes:
        """One byte per block: FREE, OWNED, SEALED or CACHED (a copy)."""
        return bytes(self.tables.state)

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, num_blocks: int, owner: int) -> list[int] | None:
        """Hand out `num_blocks` writable blocks to `owner`, evicting cached blocks if needed.

        All or nothing: returns None (and evicts nothing) when free + evictable < num_blocks.
        """
        loops = self._loops
        if loops is not None:
            block_ids = loops.allocate(num_blocks, owner)  # whole, when the free list has them
            if block_ids is not None:
                return block_ids
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise BadArgsError(f"allocate needs a non-negative int block count, got {num_blocks!r}")
        if num_blocks > self.num_available:
            return None
        if not num_blocks:
            return []  # and no empty holdings entry for an owner that holds nothing
        if self.tables.counts[NUM_FREE] < num_blocks:
            self._evict_for(num_blocks)
        if loops is not None:
            return loops.allocate(num_blocks, owner)  # (the free list has them now)
        return self._take_free(num_blocks, owner)

    def put(self, key: Hashable, tier: int = TIER_PREFILL) -> int | None:
        """Index `key` in one block, CACHED at once: a free block, else the policy's victim's.

        What `allocate(1)`, `seal` under `key` and `release` do -- the same tables, counters,
        journal rows (the observer sees a seal) and policy events (one `inserted`, told before
        the observer here) -- in one call and without an owner: for a cache whose blocks are
        evictable as soon as written (the embedded one). A reused block's generation was bumped
        when it was freed, as on any reuse. Returns the block id, or None (changing nothing) when
        no block is free or evictable. Raises (changing nothing) BadArgsError for a bad key or
        tier, or a key already indexed: a second block cannot be cached under it (seal would
        make it a duplicate, freed on its last release: here at once), so `touch` it instead.
        """
        block_id = None if self._loops is None else self._loops.put(key, tier)
        if block_id is None:  # (C declined, having changed nothing)
            block_id = self._put(key, tier)
            if block_id is None:
                return None
        elif type(block_id) is tuple:  # the policy let go of a key the pool cannot evict
            self._victim_block(block_id[0])  # raises, naming the policy
        if self.observer is not None:
            self.observer.sealed(self.journal_rows([block_id]))
        return block_id

    def _put(self, key: Hashable, tier: int) -> int | None:
        """`put` less the observer."""
        _check_key(key)
        t = self.tables
        if key in t.index:
            raise BadArgsError(f"put of {key!r}: block {t.index[key]} holds it already")
        if type(tier) is not int or not 0 <= tier < len(TIER_NAMES):  # (not bool)
            raise BadArgsError(f"put needs a tier, 0 (prefill) or 1 (decode), got {tier!r}")
        counts = t.counts
        if not counts[NUM_FREE]:
            if not self.num_available:
                return None
            self._evict_for(1)
        top = counts[NUM_FREE] - 1
        block_id: int = t.free[top]
        counts[NUM_FREE] = top
        t.state[block_id] = CACHED
        t.hashes[block_id] = key
        t.tier[block_id] = tier
        t.index[key] = block_id
        counts[ALLOCATIONS] += 1
        counts[SEALS] += 1
        self.policy.inserted(key, tier)
        return block_id

    def _take_free(self, num_blocks: int, owner: int) -> list[int]:
        """The top `num_blocks` of the free stack (there are as many), OWNED by `owner`."""
        t = self.tables
        counts, state, refs = t.counts, t.state, t.refs
        held = t.held.setdefault(owner, {})
        top = counts[NUM_FREE]
        block_ids = t.free[top - num_blocks:top].tolist()
        block_ids.reverse()  # popped in order: the top first
        counts[NUM_FREE] = top - num_blocks
        for block_id in block_ids:
            state[block_id] = OWNED
            refs[block_id] = 1
            held[block_id] = 1
        counts[NUM_OWNED] += num_blocks
        counts[ALLOCATIONS] += num_blocks
        return block_ids

    def _evict_for(self, num_blocks: int) -> None:
        """Evict until `num_blocks` blocks are free (there are enough evictable ones)."""
        counts = self.tables.counts
        if self._loops is not None:
            unevictable = self._loops.evict(num_blocks)
            if unevictable is not None:  # (the policy let go of a key the pool cannot evict)
                self._victim_block(unevictable[0])  # raises, naming the policy
            return
        while counts[NUM_FREE] < num_blocks:
            block_id = counts[NEXT_VICTIM]
            if block_id != NO_BLOCK:
                counts[NEXT_VICTIM] = NO_BLOCK
            else:
                block_id = self._policy_victim()
            self._evict_subtree(block_id)

    def _policy_victim(self) -> int:
        """Ask the policy for its victim (it stops tracking it); returns the block id."""
        return self._victim_block(self.policy.victim())

    def _victim_block(self, key: Hashable | None) -> int:
        """The block of the key the policy let go; InternalError if it is not a cached one."""
        block_id = self.tables.index.get(key) if key is not None else None
        if block_id is None or self.tables.state[block_id] != CACHED:
            raise InternalError(
                f"policy {self.policy.name!r} chose victim {key!r} that is not a cached block "
                f"(block {block_id}): bug in the policy or in the pool's event calls")
        return block_id

    def choose_next_victim(self) -> None:
        """If the pool is full, take the policy's next victim now (module docstring): the next
        allocation then only executes the eviction. Cheap when there is nothing to do."""
        counts = self.tables.counts
        if (counts[NEXT_VICTIM] == NO_BLOCK and not counts[NUM_FREE]
                and counts[NUM_OWNED] + counts[NUM_SEALED] < self.num_present):
            counts[NEXT_VICTIM] = self._policy_victim()

    def _evict_subtree(self, root: int) -> None:
        """Evict `root` (no longer in the policy) and its cached descendants, children first.

        Pinned descendants stay (their holders read them) but become orphans, freed on their
        last release; `_evict` cuts them off from their evicted parents.
        """
        t = self.tables
        if t.first_child[root] == NO_BLOCK:  # a leaf, the common victim: no walk
            self._evict(root)
            return
        visit = [root]
        first_child, next_sibling, state = t.first_child, t.next_sibling, t.state
        for block_id in visit:  # grows while it is walked: every parent before its children
            child = first_child[block_id]
            while child != NO_BLOCK:
                visit.append(child)
                child = next_sibling[child]
        for block_id in reversed(visit):
            if block_id == root:
                self._evict(block_id)
            elif state[block_id] == CACHED:
                # Never the chosen victim: _evict_for takes that one first (as a root), and an
                # orphan's descendants are never cached.
                self.policy.discard(t.hashes[block_id])
                self._evict(block_id)
            else:
                t.is_orphan[block_id] = 1

    def _evict(self, block_id: int) -> None:
        """Drop an indexed block that no policy tracks any more: unindex, unlink, free."""
        t = self.tables
        child = t.first_child[block_id]
        while child != NO_BLOCK:  # only pinned orphans are left: cut them off
            following = t.next_sibling[child]
            self._unlink(child)
            child = following
        self._unlink(block_id)
        del t.index[t.hashes[block_id]]
        t.hashes[block_id] = None
        if self.observer is not None:
            self.observer.evicted(block_id)
        self._to_free(block_id)
        t.counts[EVICTIONS] += 1

    # ---- prefix tree -----------------------------------------------------------------------
    def _link(self, parent: int, child: int) -> None:
        t = self.tables
        first = t.first_child[parent]
        t.parent[child] = parent
        t.next_sibling[child] = first
        if first != NO_BLOCK:
            t.prev_sibling[first] = child
        t.first_child[parent] = child

    def _unlink(self, child: int) -> None:
        t = self.tables
        parent = t.parent[child]
        if parent == NO_BLOCK:
            return
        before, after = t.prev_sibling[child], t.next_sibling[child]
        if before == NO_BLOCK:
            t.first_child[parent] = after
        else:
            t.next_sibling[before] = after
        if after != NO_BLOCK:
            t.prev_sibling[after] = before
        t.parent[child] = t.prev_sibling[child] = t.next_sibling[child] = NO_BLOCK

    def _to_free(self, block_id: int) -> None:
        t = self.tables
        t.state[block_id] = FREE
        t.tier[block_id] = t.is_orphan[block_id] = t.is_duplicate[block_id] = 0
        t.refs[block_id] = 0
        t.generations[block_id] += 1
        top = t.counts[NUM_FREE]
        t.free[top] = block_id
        t.counts[NUM_FREE] = top + 1

    # ---- sealing, lookup, pinning -------------------------------------------------------
    def seal(self, block_ids: Sequence[int], keys: Sequence[Hashable], owner: int,
             parents: Sequence[Hashable | None] | None = None,
             tiers: Sequence[int] | None = None) -> list[bool]:
        """Publish `owner`'s OWNED blocks under content keys; they become read-only, still pinned.

        Args:
            parents: per block, the key of the block before it in its chain (None for a chain's
                head); links it into the prefix tree (module docstring). Earlier blocks of the
                same call may be parents of later ones.
            tiers: per block, TIER_PREFILL (default) or TIER_DECODE, for a tiered policy.

        Returns, per block, whether it now holds its key in the index (False: another block
        already did, this one stays a private read-only duplicate).
        Raises (changing nothing): BadArgsError, NotFoundError (not held), InUseError (not OWNED).
        """
        indexed = None if self._loops is None else self._loops.seal(block_ids, keys, parents,
                                                                    tiers, owner)
        if indexed is None:
            self._check_seal(block_ids, keys, owner, parents, tiers)
            indexed = self._publish(block_ids, keys, parents, tiers)
        if self.observer is not None:
            self.observer.sealed(self.journal_rows(
                [block_id for block_id, is_new in zip(block_ids, indexed) if is_new]))
        return indexed

    def _check_seal(self, block_ids: Sequence[int], keys: Sequence[Hashable], owner: int,
                    parents: Sequence[Hashable | None] | None,
                    tiers: Sequence[int] | None) -> None:
        """Raise what is wrong with a seal's arguments (before anything changes)."""
        num_blocks = len(block_ids)
        if len(keys) != num_blocks:
            raise BadArgsError(f"seal got {num_blocks} block ids but {len(keys)} hashes")
        if parents is not None:
            if len(parents) != num_blocks:
                raise BadArgsError(f"seal got {num_blocks} block ids but {len(parents)} parents")
            for parent in parents:
                if parent is not None:
                    _check_key(parent)
        if tiers is not None and (len(tiers) != num_blocks or any(
                not isinstance(tier, int) or not 0 <= tier < len(TIER_NAMES) for tier in tiers)):
            raise BadArgsError(f"seal needs one tier per block, each 0 (prefill) or 1 (decode); "
                               f"got {list(tiers)!r}")
        held, state = self.tables.held.get(owner, {}), self.tables.state
        for block_id, key in zip(block_ids, keys):
            self._checked_id(block_id)
            if block_id not in held:
                raise NotFoundError(f"block {block_id} is not held by this session")
            if state[block_id] != OWNED:
                raise InUseError(f"block {block_id} is {self.state(block_id)}, only owned blocks "
                                 "can be sealed (sealed blocks are immutable)")
            _check_key(key)
        if len(set(block_ids)) != num_blocks:
            raise BadArgsError("seal names the same block twice")

    def _publish(self, block_ids: Sequence[int], keys: Sequence[Hashable],
                 parents: Sequence[Hashable | None] | None,
                 tiers: Sequence[int] | None) -> list[bool]:
        """Seal checked blocks: each SEALED under its key, indexed (linked under its parent) if
        the key is new, else a duplicate. Returns, per block, whether it was indexed."""
        t = self.tables
        state, hashes, index, tier_of, is_duplicate = (t.state, t.hashes, t.index, t.tier,
                                                       t.is_duplicate)
        indexed: list[bool] = []
        for position, (block_id, key) in enumerate(zip(block_ids, keys)):
            state[block_id] = SEALED
            hashes[block_id] = key
            if tiers is not None:
                tier_of[block_id] = tiers[position]
            is_new = key not in index
            if is_new:
                if parents is not None and parents[position] is not None:
                    self._adopt(block_id, parents[position])
                index[key] = block_id
            else:
                is_duplicate[block_id] = 1
            indexed.append(is_new)
        t.counts[NUM_OWNED] -= len(block_ids)
        t.counts[NUM_SEALED] += len(block_ids)
        t.counts[SEALS] += len(block_ids)
        return indexed

    def _adopt(self, block_id: int, parent_key: Hashable) -> None:
        """Link a newly indexed block under the block holding `parent_key`; orphan it if that
        block is gone or itself an orphan (its prefix is gone: unreachable once released)."""
        t = self.tables
        parent = t.index.get(parent_key)
        if parent is None:
            t.is_orphan[block_id] = 1
            return
        self._link(parent, block_id)
        t.is_orphan[block_id] = t.is_orphan[parent]

    def lookup(self, keys: Iterable[Hashable], owner: int) -> list[int]:
        """Pin for `owner` the blocks of the longest prefix of `keys` that is cached."""
        loops = self._loops
        if loops is not None:
            block_ids = loops.lookup(keys, owner)
            if block_ids is not None:
                return block_ids
        if type(keys) is not list:
            keys = list(keys)
        index = self.tables.index
        block_ids = []
        for key in keys:
            block_id = index.get(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        self._pin_sealed(block_ids, owner, count_access=True)
        counts = self.tables.counts
        counts[LOOKUPS] += 1
        counts[LOOKUP_BLOCKS] += len(keys)
        counts[HIT_BLOCKS] += len(block_ids)
        return block_ids

    def touch(self, key: Hashable) -> int | None:
        """Count an access to `key` without pinning it; returns its block id or None."""
        block_id = self.tables.index.get(key)
        if block_id is not None:
            self.policy.accessed(key)
        return block_id

    def pin(self, block_ids: Sequence[int], owner: int) -> None:
        """Add one pin per block for `owner` (sharing sealed blocks, e.g. on fork)."""
        if self._loops is not None and self._loops.pin(block_ids, owner):
            return
        state = self.tables.state
        for block_id in block_ids:
            self._checked_id(block_id)
            if state[block_id] not in (SEALED, CACHED):
                raise InUseError(f"block {block_id} is {self.state(block_id)}: only sealed blocks "
                                 "can be shared")
        self._pin_sealed(block_ids, owner, count_access=False)

    def _pin_sealed(self, block_ids: Sequence[int], owner: int, count_access: bool) -> None:
        """One pin more for `owner` on each SEALED or CACHED block; a CACHED one leaves the
        policy (a hit when `count_access`), a SEALED one counts an access when `count_access`."""
        if not block_ids:
            return
        t, policy = self.tables, self.policy
        held = t.held.setdefault(owner, {})
        state, refs, hashes, counts = t.state, t.refs, t.hashes, t.counts
        hits: list[Hashable] = []  # cached blocks hit, for the policy in one call
        num_uncached = 0
        for block_id in block_ids:
            if state[block_id] == CACHED:
                if block_id == counts[NEXT_VICTIM]:  # a hit cancels the choice; the policy has
                    counts[NEXT_VICTIM] = NO_BLOCK  # let it go already: nothing to remove
                    if count_access:
                        if hits:
                            _tell_hits(policy, hits)
                            hits = []
                        policy.accessed(hashes[block_id])
                elif count_access:
                    hits.append(hashes[block_id])
                else:
                    policy.removed(hashes[block_id])
                state[block_id] = SEALED
                num_uncached += 1
            elif count_access:
                if hits:
                    _tell_hits(policy, hits)
                    hits = []
                policy.accessed(hashes[block_id])
            refs[block_id] += 1
            held[block_id] = held.get(block_id, 0) + 1
        if hits:
            _tell_hits(policy, hits)
        counts[NUM_SEALED] += num_uncached

    # ---- release ---------------------------------------------------------------------------
    def release(self, block_ids: Sequence[int], owner: int) -> None:
        """Drop one of `owner`'s pins on each block, last block first.

        OWNED blocks go back to FREE (an aborted write). SEALED blocks whose ref count reaches 0
        become CACHED — evictable — in reverse order, so a prefix chain's tail is evicted first.
        Raises NotFoundError (changing nothing) if a block is not held by `owner` often enough.
        """
        if self._loops is not None and self._loops.release(block_ids, owner):
            return
        held = self.tables.held.get(owner, {})
        # The usual release names distinct blocks, each held: a set operation in C says so. Only
        # otherwise are pins counted block by block (repeats, or to name the culprit).
        if len(block_ids) == 1:
            if block_ids[0] not in held:
                self._check_held(block_ids, held)
        else:
            distinct = set(block_ids)
            if len(distinct) != len(block_ids) or not held.keys() >= distinct:
                self._check_held(block_ids, held)
        self._unpin(block_ids[::-1], held)
        if not held:
            self.tables.held.pop(owner, None)

    @staticmethod
    def _check_held(block_ids: Sequence[int], held: dict[int, int]) -> None:
        wanted: dict[int, int] = {}
        for block_id in block_ids:
            wanted[block_id] = wanted.get(block_id, 0) + 1
        for block_id, count in wanted.items():
            if held.get(block_id, 0) < count:
                raise NotFoundError(f"block {block_id} is not held by this session "
                                    f"{'often enough ' if block_id in held else ''}to release it")

    def release_owner(self, owner: int) -> int:
        """Release everything `owner` holds (session closed or died); returns blocks touched."""
        held = self.tables.held.get(owner)
        if not held:
            return 0
        num_touched = len(held)  # (the release empties `held`)
        # Highest id released first approximates "tail first" for chains allocated in one batch.
        self.release([block_id for block_id in sorted(held) for _ in range(held[block_id])],
                     owner)
        return num_touched

    def _unpin(self, block_ids: Sequence[int], held: dict[int, int]) -> None:
        """Drop one pin of `held` per block, in order (every pin is known to be there)."""
        t, policy = self.tables, self.policy
        state, refs, hashes, tiers, counts = t.state, t.refs, t.hashes, t.tier, t.counts
        num_last_pins = 0  # sealed blocks whose last pin this was: no longer SEALED
        cached_keys: list[Hashable] = []  # for the policy in one call, in release order
        cached_tiers: list[int] = []
        for block_id in block_ids:
            pins = held.pop(block_id) - 1
            if pins:
                held[block_id] = pins
            if state[block_id] == OWNED:
                counts[NUM_OWNED] -= 1
                self._to_free(block_id)
                continue
            count = refs[block_id] - 1
            refs[block_id] = count
            if count:
                continue
            num_last_pins += 1
            key = hashes[block_id]
            if t.is_duplicate[block_id]:
                # Nobody can look it up, so keeping it would only waste a block.
                hashes[block_id] = None
                self._to_free(block_id)
            elif t.is_orphan[block_id]:
                # Unreachable: caching it would only waste blocks. Its subtree may hold blocks
                # this loop cached already: the policy must know them before it discards any.
                if cached_keys:
                    _tell_inserted(policy, cached_keys, cached_tiers)
                    cached_keys, cached_tiers = [], []
                policy.forgotten(key)  # (what it kept of the key while it was pinned)
                self._evict_subtree(block_id)
            else:
                state[block_id] = CACHED
                cached_keys.append(key)
                cached_tiers.append(tiers[block_id])
        if cached_keys:
            _tell_inserted(policy, cached_keys, cached_tiers)
        counts[NUM_SEALED] -= num_last_pins

    # ---- recovery --------------------------------------------------------------------------
    def journal_rows(self, block_ids: Iterable[int] | None = None) -> list[JournalRow]:
        """What the journal records of indexed blocks (see kvd/server/journal.py): of `block_ids`, or
        of every indexed block, oldest index entry first. A row is (block_id, key, generation,
        parent, parent_generation, tier); parent is ORPHAN for an orphan."""
        if self._loops is not None and block_ids is not None:
            rows = self._loops.journal_rows(block_ids)
            if rows is not None:
                return rows
        t = self.tables
        parents, is_orphan, hashes, tiers = t.parent, t.is_orphan, t.hashes, t.tier
        generation = self.generations.item  # a Python int at half the cost of int(a[i])
        rows = []
        for block_id in t.index.values() if block_ids is None else block_ids:
            parent = ORPHAN if is_orphan[block_id] else parents[block_id]
            rows.append((block_id, hashes[block_id], generation(block_id), parent,
                         generation(parent) if parent >= 0 else 0, tiers[block_id]))
        return rows

    def restore(self, rows: IndexRows) -> int:
        """Make journaled blocks CACHED again, oldest first, in a fresh pool (after a crash).

        A row is restored only if the block still has the generation the row recorded and its
        parent (if any) was restored as the same residency the child was sealed under; orphans
        and the descendants of dropped rows are not restored (they would be unreachable). The
        prefix tree and tiers come back with the blocks. Returns how many were restored.
        Raises InternalError if the pool is not fresh, BadArgsError for a corrupt journal.
        """
        t = self.tables
        if t.counts[NUM_FREE] != self.num_blocks:
            raise InternalError("restore() needs a fresh pool: blocks are already in use")
        keep = self._restorable(rows)
        ids = np.asarray(rows.block_ids, dtype=np.int64)[keep]
        keys = rows.keys if keep.all() else [key for key, is_kept in zip(rows.keys, keep.tolist())
                                             if is_kept]
        parents = np.asarray(rows.parents, dtype=np.int64)[keep]
        tiers = np.asarray(rows.tiers, dtype=np.uint8)[keep]
        index = dict(zip(keys, ids.tolist()))
        if len(index) != len(keys):
            raise BadArgsError("the journal names a hash twice: it is corrupt")
        # Filled in place (the tables are bound once), each with whole-array work: a NumPy
        # scatter, not a Python loop over a million blocks; fromiter keeps every key one object,
        # tuples included.
        t.index.update(index)
        np.frombuffer(t.state, dtype=np.uint8)[ids] = CACHED
        np.frombuffer(t.tier, dtype=np.uint8)[ids] = tiers
        hashes = np.empty(self.num_blocks, dtype=object)  # (all None: the pool is fresh)
        hashes[ids] = np.fromiter(keys, dtype=object, count=len(keys))
        t.hashes[:] = hashes.tolist()
        free_ids = np.flatnonzero(np.frombuffer(t.state, dtype=np.uint8) == FREE)[::-1]
        np.frombuffer(t.free, dtype=np.int64)[:free_ids.size] = free_ids
        t.counts[NUM_FREE] = free_ids.size
        self._link_restored(ids, parents)
        self.policy.restored(keys, tiers.tolist())
        return len(keys)

    def _restorable(self, rows: IndexRows) -> np.ndarray:
        """Which rows to restore: current generation, not orphans, and every ancestor kept."""
        ids = np.asarray(rows.block_ids, dtype=np.int64)
        num_rows = ids.size
        if num_rows and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise BadArgsError(f"the journal names a block outside [0, {self.num_blocks}): "
                               "it is corrupt")
        row_of = np.full(self.num_blocks, -1, dtype=np.int64)
        row_of[ids] = np.arange(num_rows)
        if np.count_nonzero(row_of >= 0) != num_rows:
            raise BadArgsError("the journal names a block twice: it is corrupt")
        rows_range = np.arange(num_rows)
        generations = np.asarray(rows.generations, dtype=np.uint64)
        parents = np.asarray(rows.parents, dtype=np.int64)
        if num_rows and parents.max() >= self.num_blocks:
            raise BadArgsError(f"the journal names a parent outside [0, {self.num_blocks}): "
                               "it is corrupt")
        has_parent = parents >= 0
        parent_row = np.where(has_parent, row_of[np.where(has_parent, parents, 0)], rows_range)
        parent_row = np.where(parent_row < 0, rows_range, parent_row)  # a missing parent
        is_linked = ~has_parent | (
            (row_of[np.where(has_parent, parents, 0)] >= 0) & (parent_row < rows_range)
            & (generations[parent_row] == np.asarray(rows.parent_generations, dtype=np.uint64)))
        keep = (self.generations[ids] == generations) & (parents != ORPHAN) & is_linked
        # An unlinked row is dropped and ends its chain, so every chain left runs to older rows
        # only and ends (a corrupt journal's cycle of parents would otherwise never converge).
        parent_row = np.where(is_linked, parent_row, rows_range)
        # A row is kept only if all its ancestors are: pointer jumping needs log2(depth) passes.
        while True:
            keep = keep & keep[parent_row]
            grandparent_row = parent_row[parent_row]
            if np.array_equal(grandparent_row, parent_row):
                return keep
            parent_row = grandparent_row

    def _link_restored(self, ids: np.ndarray, parents: np.ndarray) -> None:
        """Thread restored children into their parents' child lists, all at once."""
        has_parent = parents >= 0
        children, parents = ids[has_parent], parents[has_parent]
        order = np.argsort(parents, kind="stable")
        children, parents = children[order], parents[order]
        t = self.tables
        view = {name: np.frombuffer(getattr(t, name), dtype=np.int32)
                for name in ("parent", "first_child", "next_sibling", "prev_sibling")}
        view["parent"][children] = parents
        is_sibling = parents[1:] == parents[:-1]  # consecutive children of one parent
        view["next_sibling"][children[:-1][is_sibling]] = children[1:][is_sibling]
        view["prev_sibling"][children[1:][is_sibling]] = children[:-1][is_sibling]
        is_first = np.concatenate(([True], ~is_sibling))[:children.size]
        view["first_child"][parents[is_first]] = children[is_first]

    # ---- checking ------------------------------------------------------------------------
    def _checked_id(self, block_id: int) -> int:
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:  # (not bool)
            raise BadArgsError(f"block id {block_id!r} is not in [0, {self.num_blocks})")
        return block_id

    def check_invariants(self) -> None:
        """Verify DESIGN.md section 3's invariants in O(num_blocks); raise InternalError if not."""
        t = self.tables
        counts = [0, 0, 0, 0]
        for state in t.state:
            counts[state] += 1
        next_victim = t.counts[NEXT_VICTIM]
        # (an absent block, outside an arena pool's slabs, is FREE and off the free list)
        num_absent = self.num_blocks - self.num_present
        expected = [t.counts[NUM_FREE] + num_absent, t.counts[NUM_OWNED], t.counts[NUM_SEALED],
                    len(self.policy) + (next_victim != NO_BLOCK)]
        if counts != expected:
            raise InternalError(f"state counts {counts} != bookkeeping {expected} "
                                "(free, owned, sealed, cached)")
        free = t.free[:t.counts[NUM_FREE]]
        if len(set(free)) != len(free):
            raise InternalError("a block is on the free list twice")
        if any(t.state[block_id] != FREE for block_id in free):
            raise InternalError("a block on the free list is not free")
        pins = [0] * self.num_blocks
        for owner, held in t.held.items():
            if not held:
                raise InternalError(f"owner {owner} is listed but holds no block")
            for block_id, count in held.items():
                if count <= 0:
                    raise InternalError(f"owner {owner} holds block {block_id} {count} times")
                pins[block_id] += count
        for block_id in range(self.num_blocks):
            self._check_block(block_id, pins[block_id])
        for key, block_id in t.index.items():
            if t.hashes[block_id] != key or t.state[block_id] not in (SEALED, CACHED):
                raise InternalError(f"index maps {key!r} to block {block_id} which does not hold it")
        self._check_tree()

    def _is_indexed(self, block_id: int) -> bool:
        key = self.tables.hashes[block_id]
        return key is not None and self.tables.index.get(key) == block_id

    def _check_tree(self) -> None:
        """Prefix-tree links are consistent; no orphan is cached; every linked block's parent is
        indexed (so no cached block is reachable only through an evicted parent)."""
        t = self.tables
        num_linked = 0
        for parent in range(self.num_blocks):
            child, before = t.first_child[parent], NO_BLOCK
            while child != NO_BLOCK:
                num_linked += 1
                if t.parent[child] != parent or t.prev_sibling[child] != before \
                        or not self._is_indexed(parent) or not self._is_indexed(child) \
                        or t.is_orphan[child] != t.is_orphan[parent] \
                        or num_linked > self.num_blocks:
                    raise InternalError(f"prefix tree: block {child} under block {parent} is "
                                        "mislinked, unindexed or orphaned: a pool bug")
                child, before = t.next_sibling[child], child
        if num_linked != sum(parent != NO_BLOCK for parent in t.parent):
            raise InternalError("prefix tree: a block names a parent whose child list lacks it")
        for block_id in range(self.num_blocks):
            if t.is_orphan[block_id] and t.state[block_id] != SEALED:
                raise InternalError(f"orphan block {block_id} is {self.state(block_id)}: an "
                                    "unreachable block must be freed on its last release")

    def _check_block(self, block_id: int, pins: int) -> None:
        t = self.tables
        state, refs, key = t.state[block_id], t.refs[block_id], t.hashes[block_id]
        where = f"block {block_id} ({STATE_NAMES[state]}, ref {refs}, pins {pins})"
        if refs != pins:
            raise InternalError(f"{where}: ref count differs from pins held by live owners")
        if state == FREE and (refs or key is not None):
            raise InternalError(f"{where}: a free block holds a ref or a hash")
        if state == OWNED and (refs != 1 or key is not None):
            raise InternalError(f"{where}: an owned block must have exactly its owner's ref")
        if state == SEALED and (refs < 1 or key is None):
            raise InternalError(f"{where}: a sealed block must be pinned and hashed")
        if t.is_duplicate[block_id] != (state == SEALED and not self._is_indexed(block_id)):
            raise InternalError(f"{where}: duplicate mark {t.is_duplicate[block_id]} is wrong: "
                                "a duplicate is exactly a sealed block outside the index")
        is_tracked = key in self.policy
        if state == CACHED and (refs or key is None or t.index.get(key) != block_id
                                or is_tracked == (block_id == t.counts[NEXT_VICTIM])):
            raise InternalError(f"{where}: a cached block must be unpinned, indexed and evictable "
                                "(tracked by the policy unless it is the chosen next victim)")

    def stats(self) -> dict[str, int]:
        """Block counts by state plus cumulative counters."""
        return {"num_blocks": self.num_present, "free": self.num_free, "owned": self.num_owned,
                "sealed": self.num_sealed, "cached": self.num_cached,
                "indexed": len(self.tables.index), **self.counters}
