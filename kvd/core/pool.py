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

Storage, chosen so a million-block pool costs tens of bytes per block and no Python object per
block until it holds content:
  * `_state`  bytearray, one byte per block;
  * `_refs`   list of ints (ref counts; all small ints are shared objects);
  * `_free`   array('q') used as a LIFO stack: allocate pops, free pushes, both O(1); LIFO hands
    out recently freed blocks whose pages are warm;
  * `_hashes` list, the content hash of each SEALED/CACHED block (None otherwise);
  * `_index`  dict hash → block id: at most one block per hash (invariant 4);
  * `_held`   dict owner → {block id: pins}; an OWNED block is held once by its owner;
  * `generations` uint64 per block (in the shared segment when a daemon runs): bumped every time a
    block goes back to FREE, so a reader holding a stale id can tell it was reused (invariant 5);
  * `_tier`   bytearray: who wrote each sealed block (TIER_PREFILL or TIER_DECODE), for the policy;
  * `_is_duplicate` bytearray: a SEALED block outside the index (see Duplicates below), so that a
    release tells a duplicate without probing the index (a random access into a table of every
    cached hash, where a batch's blocks are neighbours in these arrays);
  * `_parent`, `_first_child`, `_next_sibling`, `_prev_sibling`, `_is_orphan`: the prefix tree.

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
arise from raw pins of a chain's middle: a sequence pins its whole chain from the head.) Evicting a subtree may free more blocks than an allocation asked for;
they were unreachable, so nothing of value is lost. The journal records each block's parent, so
`restore` rebuilds the tree.

The policy sees only CACHED keys (see kvd/core/policies/base.py). One exception: the victim chosen
ahead of need. On a full pool every allocation must evict, and asking the policy for its victim
is about a third of that work; `choose_next_victim()` lets the daemon ask while it is idle
(after the replies of a loop iteration went out). The chosen block stays CACHED and indexed --
nothing is evicted early, a lookup still finds it -- but the policy has let it go (`victim()`
returned it), so the pool remembers it in `_next_victim`: the next eviction takes it, and a hit
before then cancels the choice (the block is pinned; the policy hears of it again when it is
inserted on release, as of any key it chose). So `num_cached == len(policy)` plus one while a
victim is chosen.

Duplicates: sealing a hash that another block already holds leaves the sealer's block SEALED but
out of the index. Its ids stay valid for the sealer (a worker's block table never changes under
it) and it is freed, not cached, on its last release.

C loops: at batch 256 a request is its per-block bookkeeping, so kvd/core/_pool.c runs the loops of
allocate (its evictions of leaf victims too), lookup, pin, release and seal (and journal_rows)
over these same tables for the common blocks and stops before any other (a block to free, an orphan's last pin,
a victim with children, a policy event other than a hit),
which the Python loop here then does before calling it again: one loop, interleaved, with the
Python as its specification (tests/test_pool_c.py runs twin pools). Batch 256, kvd's policy (whose
batch events run in kvd/core/policies/_s3fifo.c the same way), against the Python loops in the same
process (`python -m bench.pool_ab --base python`): seal 0.57x the time (0.40x sealing chains, with
parents to link), lookup 0.46x, releases 0.49-0.52x. At batch 1 the Python around those loops is
the request, so `hot_ops` gives the Service an allocation, seal, release and lookup of one block
done whole in C (the policy's event included, through its `c_events` queues), every other request
going to the method: the request path's server side went from 0.71-0.80x the echo floor's
speed to 0.81-0.88x (bench/request_path.py's round, the two side by side in one process).
KVD_PURE_PYTHON=1, or a build without the module, runs the Python loops only.

Errors: expected exhaustion returns None from `allocate`; misuse by a caller (wrong owner, wrong
state, bad hash) raises a typed KvdError and changes nothing; a policy that returns a key the pool
cannot evict raises InternalError naming the policy — that is a kvd bug.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import partial
from itertools import islice
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvd import native
from kvd.core.policies import TIER_NAMES, EvictionPolicy, make_policy
from kvd.errors import BadArgsError, InUseError, InternalError, NotFoundError

_built_loops = native.built("pool")  # (twin tests call it directly)
# Each pool's `_loops` (tests give a twin None): kvd/core/_pool.c's fast paths of its per-block loops.
_loops = native.load("pool")

FREE, OWNED, SEALED, CACHED = 0, 1, 2, 3
NO_BLOCK = -1  # an empty link in the prefix tree
# In IndexRows: the `parent` of a chain's head, and of an orphan (sealed after its parent was
# evicted, so unreachable).
NO_PARENT, ORPHAN = NO_BLOCK, -2
STATE_NAMES = ("free", "owned", "sealed", "cached")
# An indexed block as the journal records it (BlockPool.journal_rows):
# (block_id, key, generation, parent, parent_generation, tier), as in IndexRows.
JournalRow = tuple[int, Hashable, int, int, int, int]


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
            observer: told of every change to the hash index (the crash-recovery journal).
        """
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise BadArgsError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.policy = make_policy(policy, num_blocks) if isinstance(policy, str) else policy
        if generations is None:
            generations = np.zeros(num_blocks, dtype=np.uint64)
        if (generations.shape != (num_blocks,) or generations.dtype != np.uint64
                or not generations.flags.c_contiguous):
            raise BadArgsError(f"generations must be a contiguous uint64 array of shape "
                               f"({num_blocks},), got {generations.dtype} {generations.shape}")
        self.generations = generations
        # The same counters as a flat memoryview: bumping one costs half a NumPy scalar update.
        self._generations = memoryview(generations).cast("B").cast("Q")
        self.observer = observer
        self._state = bytearray(num_blocks)
        self._refs = [0] * num_blocks
        self._free = array("q", range(num_blocks - 1, -1, -1))  # block 0 allocated first
        self._hashes: list[Hashable | None] = [None] * num_blocks
        self._tier = bytearray(num_blocks)
        self._parent = array("i", [NO_BLOCK]) * num_blocks
        self._first_child = array("i", [NO_BLOCK]) * num_blocks
        self._next_sibling = array("i", [NO_BLOCK]) * num_blocks
        self._prev_sibling = array("i", [NO_BLOCK]) * num_blocks
        # (the prefix tree's four tables as the C loops take them, built once: never reassigned)
        self._links = (self._parent, self._first_child, self._next_sibling, self._prev_sibling)
        self._is_orphan = bytearray(num_blocks)
        self._is_duplicate = bytearray(num_blocks)
        self._index: dict[Hashable, int] = {}
        self._held: dict[int, dict[int, int]] = {}
        self._num_owned = 0
        self._num_sealed = 0
        self._next_victim = NO_BLOCK  # CACHED, indexed, already out of the policy (docstring)
        self._loops = _loops
        self._hot_ops_made = False  # (restore must come first)
        # Cumulative; named apart from the state counts (an "evictions" total, "cached" now).
        self.counters = {"allocations": 0, "evictions": 0, "seals": 0, "lookups": 0,
                         "lookup_blocks": 0, "hit_blocks": 0}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_owned(self) -> int:
        return self._num_owned

    @property
    def num_sealed(self) -> int:
        return self._num_sealed

    @property
    def num_cached(self) -> int:
        return self.num_blocks - len(self._free) - self._num_owned - self._num_sealed

    @property
    def num_available(self) -> int:
        """Blocks an allocation could get right now: free plus evictable."""
        return self.num_blocks - self._num_owned - self._num_sealed

    def state(self, block_id: int) -> str:
        return STATE_NAMES[self._state[self._checked_id(block_id)]]

    def ref_count(self, block_id: int) -> int:
        return self._refs[self._checked_id(block_id)]

    def block_hash(self, block_id: int) -> Hashable | None:
        return self._hashes[self._checked_id(block_id)]

    def find(self, key: Hashable) -> int | None:
        """Block id holding `key` in the index, without pinning or counting an access."""
        return self._index.get(key)

    def holdings(self, owner: int) -> dict[int, int]:
        """Copy of {block id: pins} held by `owner`."""
        return dict(self._held.get(owner, {}))

    def owners(self) -> list[int]:
        return list(self._held)

    def states(self) -> bytes:
        """One byte per block: FREE, OWNED, SEALED or CACHED (a copy)."""
        return bytes(self._state)

    def hot_ops(self, allocate: Callable[[int, int], list[int]]) -> dict[str, Callable[..., Any]]:
        """The Service's common requests, each a callable of the wire's arguments in order, then
        the owner: "alloc" (num_blocks; `allocate`, which must be `self.allocate` or raise where
        it returns None), "seal" (block_ids, keys, parents, tiers), "release" (block_ids) and
        "lookup" (keys). Where kvd/core/_pool.c runs, a request of one block is done there whole (its
        tables bound once) and any other goes to the method; without it they are the methods.
        Only `restore` replaces tables, so it must come first (it refuses to come after)."""
        self._hot_ops_made = True
        loops, policy = self._loops, self.policy
        if loops is None:
            return {"alloc": allocate, "seal": self._seal_in_wire_order, "release": self.release,
                    "lookup": self.lookup}
        return {
            "alloc": partial(loops.alloc_one, (self, allocate, self._free, self._held,
                                               self._state, self._refs, self.counters)),
            "seal": partial(loops.seal_one, (
                self, self._seal_in_wire_order, self._held, self._state, self._hashes,
                self._tier, self._is_duplicate, self._is_orphan, self._index, self._links,
                self._generations, self.counters)),
            "release": partial(loops.release_one, (
                self, self.release, self._held, self._state, self._refs, self._hashes,
                self._tier, self._is_orphan, self._is_duplicate, policy.c_events,
                policy.inserted)),
            "lookup": partial(loops.lookup_one, (
                self, self.lookup, self._index, self._state, self._refs, self._hashes,
                self._held, self.counters, policy.c_events, policy.hit_evictable)),
        }

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, num_blocks: int, owner: int) -> list[int] | None:
        """Hand out `num_blocks` writable blocks to `owner`, evicting cached blocks if needed.

        All or nothing: returns None (and evicts nothing) when free + evictable < num_blocks.
        """
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise BadArgsError(f"allocate needs a non-negative int block count, got {num_blocks!r}")
        if num_blocks > self.num_blocks - self._num_owned - self._num_sealed:
            return None  # (free + cached, without a call to the policy's __len__)
        if not num_blocks:
            return []  # and no empty holdings entry for an owner that holds nothing
        if len(self._free) < num_blocks:
            self._evict_for(num_blocks)
        held = self._held.setdefault(owner, {})
        state, refs, free = self._state, self._refs, self._free
        if num_blocks == 1:
            block_ids = [free.pop()]
        else:  # the stack's top, popped in order, in two C calls
            block_ids = free[-num_blocks:].tolist()
            del free[-num_blocks:]
            block_ids.reverse()
        if self._loops is None or not self._loops.own(block_ids, held, state, refs):
            for block_id in block_ids:
                state[block_id] = OWNED
                refs[block_id] = 1
                held[block_id] = 1
        self._num_owned += num_blocks
        self.counters["allocations"] += num_blocks
        return block_ids

    def _evict_for(self, num_blocks: int) -> None:
        """Evict until `num_blocks` blocks are free (there are enough evictable ones)."""
        free, loops = self._free, self._loops
        while len(free) < num_blocks:
            if self._next_victim != NO_BLOCK:
                block_id, self._next_victim = self._next_victim, NO_BLOCK
            elif loops is None:
                block_id = self._policy_victim()
            else:  # leaf victims in C; it hands back the first victim that is not one
                freed: list[int] = []
                try:
                    unevicted = loops.evict_run(
                        num_blocks - len(free), self.policy.victim,
                        None if self.observer is None else self.observer.evicted, freed,
                        self._index, self._state, self._hashes, self._tier, self._is_orphan,
                        self._is_duplicate, self._refs, self._generations, self._links)
                finally:  # (freed blocks go on the stack even if the journal raised)
                    free.extend(freed)
                    self.counters["evictions"] += len(freed)
                if unevicted is None:
                    return
                block_id = self._victim_block(unevicted[0])
            self._evict_subtree(block_id)

    def _policy_victim(self) -> int:
        """Ask the policy for its victim (it stops tracking it); returns the block id."""
        return self._victim_block(self.policy.victim())

    def _victim_block(self, key: Hashable | None) -> int:
        """The block of the key the policy let go; InternalError if it is not a cached one."""
        block_id = self._index.get(key) if key is not None else None
        if block_id is None or self._state[block_id] != CACHED:
            raise InternalError(
                f"policy {self.policy.name!r} chose victim {key!r} that is not a cached block "
                f"(block {block_id}): bug in the policy or in the pool's event calls")
        return block_id

    def choose_next_victim(self) -> None:
        """If the pool is full, take the policy's next victim now (module docstring): the next
        allocation then only executes the eviction. Cheap when there is nothing to do."""
        if (self._next_victim == NO_BLOCK and not self._free
                and self._num_owned + self._num_sealed < self.num_blocks):
            self._next_victim = self._policy_victim()


    def _evict_subtree(self, root: int) -> None:
        """Evict `root` (no longer in the policy) and its cached descendants, children first.

        Pinned descendants stay (their holders read them) but become orphans, freed on their
        last release; `_evict` cuts them off from their evicted parents.
        """
        if self._first_child[root] == NO_BLOCK:  # a leaf, the common victim: no walk
            self._evict(root)
            return
        visit = [root]
        first_child, next_sibling, state = self._first_child, self._next_sibling, self._state
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
                self.policy.discard(self._hashes[block_id])
                self._evict(block_id)
            else:
                self._is_orphan[block_id] = 1

    def _evict(self, block_id: int) -> None:
        """Drop an indexed block that no policy tracks any more: unindex, unlink, free."""
        child = self._first_child[block_id]
        while child != NO_BLOCK:  # only pinned orphans are left: cut them off
            following = self._next_sibling[child]
            self._unlink(child)
            child = following
        self._unlink(block_id)
        del self._index[self._hashes[block_id]]
        self._hashes[block_id] = None
        if self.observer is not None:
            self.observer.evicted(block_id)
        self._to_free(block_id)
        self.counters["evictions"] += 1

    # ---- prefix tree -----------------------------------------------------------------------
    def _link(self, parent: int, child: int) -> None:
        first = self._first_child[parent]
        self._parent[child] = parent
        self._next_sibling[child] = first
        if first != NO_BLOCK:
            self._prev_sibling[first] = child
        self._first_child[parent] = child

    def _unlink(self, child: int) -> None:
        parent = self._parent[child]
        if parent == NO_BLOCK:
            return
        before, after = self._prev_sibling[child], self._next_sibling[child]
        if before == NO_BLOCK:
            self._first_child[parent] = after
        else:
            self._next_sibling[before] = after
        if after != NO_BLOCK:
            self._prev_sibling[after] = before
        self._parent[child] = self._prev_sibling[child] = self._next_sibling[child] = NO_BLOCK

    def _to_free(self, block_id: int) -> None:
        self._state[block_id] = FREE
        self._tier[block_id] = 0
        self._is_orphan[block_id] = 0
        self._is_duplicate[block_id] = 0
        self._refs[block_id] = 0
        self._generations[block_id] += 1
        self._free.append(block_id)

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
        if parents is not None or tiers is not None or len(keys) != len(block_ids):
            self._check_seal_hints(len(block_ids), keys, parents, tiers)
        held, state, num_blocks = self._held.get(owner, {}), self._state, self.num_blocks
        loops = self._loops
        # Validate everything before changing anything (the C loop vouches for a prefix, the
        # usual whole of it: then no iterators are built for the rest).
        start = 0 if loops is None else loops.first_unsealable(block_ids, keys, held, state)
        for block_id, key in () if start == len(block_ids) else islice(zip(block_ids, keys),
                                                                         start, None):
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                self._checked_id(block_id)  # raises, naming the problem
            if block_id not in held:
                raise NotFoundError(f"block {block_id} is not held by this session")
            if state[block_id] != OWNED:
                raise InUseError(f"block {block_id} is {self.state(block_id)}, only owned blocks "
                                 "can be sealed (sealed blocks are immutable)")
            if type(key) is not bytes:  # (what the daemon passes: checked inline, no call)
                _check_key(key)
        if len(block_ids) > 1 and len(set(block_ids)) != len(block_ids):
            raise BadArgsError("seal names the same block twice")
        hashes, index, tier_of = self._hashes, self._index, self._tier
        is_duplicate = self._is_duplicate
        links = self._links
        indexed: list[bool] = []  # per block: newly indexed
        position, end = 0, len(block_ids)
        while position < end:
            if loops is not None:
                position = loops.seal_run(block_ids, keys, position, tiers, parents, state,
                                          hashes, tier_of, is_duplicate, self._is_orphan, index,
                                          links, indexed)
                if position == end:
                    break
            block_id, key = block_ids[position], keys[position]
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
            position += 1
        if self.observer is not None:
            self.observer.sealed(self.journal_rows(
                [block_id for block_id, is_new in zip(block_ids, indexed) if is_new]))
        self._num_owned -= len(block_ids)
        self._num_sealed += len(block_ids)
        self.counters["seals"] += len(block_ids)
        return indexed

    def _seal_in_wire_order(self, block_ids: Sequence[int], keys: Sequence[Hashable],
                            parents: Sequence[Hashable | None] | None,
                            tiers: Sequence[int] | None, owner: int) -> list[bool]:
        """`seal` with the wire's argument order (hot_ops' "seal")."""
        return self.seal(block_ids, keys, owner, parents, tiers)

    def _check_seal_hints(self, num_blocks: int, keys: Sequence[Hashable],
                          parents: Sequence[Hashable | None] | None,
                          tiers: Sequence[int] | None) -> None:
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

    def _adopt(self, block_id: int, parent_key: Hashable) -> None:
        """Link a newly indexed block under the block holding `parent_key`; orphan it if that
        block is gone or itself an orphan (its prefix is gone: unreachable once released)."""
        parent = self._index.get(parent_key)
        if parent is None:
            self._is_orphan[block_id] = 1
            return
        self._link(parent, block_id)
        self._is_orphan[block_id] = self._is_orphan[parent]

    def lookup(self, keys: Iterable[Hashable], owner: int) -> list[int]:
        """Pin for `owner` the blocks of the longest prefix of `keys` that is cached."""
        if type(keys) is not list:  # (the daemon's keys are a list already: no copy)
            keys = list(keys)
        block_ids = None if self._loops is None else self._loops.prefix(self._index, keys)
        if block_ids is None:
            block_ids = []
            for key in keys:
                block_id = self._index.get(key)
                if block_id is None:
                    break
                block_ids.append(block_id)
        if (len(block_ids) == 1 and self._state[block_ids[0]] == CACHED
                and block_ids[0] != self._next_victim):
            self._pin_cached_hit(block_ids[0], owner)  # most lookups: no loop setup
        else:
            self._pin_sealed(block_ids, owner, count_access=True)
        self.counters["lookups"] += 1
        self.counters["lookup_blocks"] += len(keys)
        self.counters["hit_blocks"] += len(block_ids)
        return block_ids

    def touch(self, key: Hashable) -> int | None:
        """Count an access to `key` without pinning it; returns its block id or None."""
        block_id = self._index.get(key)
        if block_id is not None:
            self.policy.accessed(key)
        return block_id

    def pin(self, block_ids: Sequence[int], owner: int) -> None:
        """Add one pin per block for `owner` (sharing sealed blocks, e.g. on fork)."""
        for block_id in block_ids:
            self._checked_id(block_id)
            if self._state[block_id] not in (SEALED, CACHED):
                raise InUseError(f"block {block_id} is {self.state(block_id)}: only sealed blocks "
                                 "can be shared")
        self._pin_sealed(block_ids, owner, count_access=False)

    def _pin_cached_hit(self, block_id: int, owner: int) -> None:
        """`_pin_sealed(count_access=True)` of one CACHED block that is not the next victim."""
        self.policy.hit_evictable(self._hashes[block_id])
        self._state[block_id] = SEALED
        self._num_sealed += 1
        self._refs[block_id] = 1  # (cached: nobody held it)
        self._held.setdefault(owner, {})[block_id] = 1

    def _pin_sealed(self, block_ids: Sequence[int], owner: int, count_access: bool) -> None:
        if not block_ids:
            return
        held = self._held.setdefault(owner, {})
        state, refs, hashes, policy = self._state, self._refs, self._hashes, self.policy
        accessed, removed, next_victim = policy.accessed, policy.removed, self._next_victim
        # Hits on cached blocks go to the policy in one call, delivered before any other event
        # so that the policy sees every key's events in the order they happened.
        hits: list[Hashable] = []
        num_uncached = 0
        loops, position, end = self._loops, 0, len(block_ids)
        while position < end:
            if loops is not None:  # the blocks that need no policy call of their own
                position, num_hits = loops.pin_run(block_ids, position, held, state, refs, hashes,
                                                   next_victim, count_access, hits)
                num_uncached += num_hits
                if position == end:
                    break
            block_id = block_ids[position]
            position += 1
            if state[block_id] == CACHED:
                if block_id == next_victim:  # a hit cancels the choice; the policy has let it
                    self._next_victim = next_victim = NO_BLOCK  # go already: nothing to remove
                    if count_access:
                        if hits:
                            policy.hit_evictable_many(hits)
                            hits = []
                        accessed(hashes[block_id])
                elif count_access:
                    hits.append(hashes[block_id])
                else:
                    removed(hashes[block_id])
                state[block_id] = SEALED
                num_uncached += 1
            elif count_access:
                if hits:
                    policy.hit_evictable_many(hits)
                    hits = []
                accessed(hashes[block_id])
            refs[block_id] += 1
            held[block_id] = held.get(block_id, 0) + 1
        if hits:
            policy.hit_evictable_many(hits)
        self._num_sealed += num_uncached

    # ---- release ---------------------------------------------------------------------------
    def release(self, block_ids: Sequence[int], owner: int) -> None:
        """Drop one of `owner`'s pins on each block, last block first.

        OWNED blocks go back to FREE (an aborted write). SEALED blocks whose ref count reaches 0
        become CACHED — evictable — in reverse order, so a prefix chain's tail is evicted first.
        Raises NotFoundError (changing nothing) if a block is not held by `owner` often enough.
        """
        held = self._held.get(owner, {})
        if len(block_ids) == 1:  # most requests: no sets, no lists, no call but the policy's
            block_id = block_ids[0]
            if block_id not in held:
                self._check_held(block_ids, held)
            if (self._state[block_id] != SEALED or self._refs[block_id] != 1
                    or self._is_duplicate[block_id] or self._is_orphan[block_id]):
                self._unpin((block_id,), held)  # a write aborted, a shared block, ...: the loop
            else:  # the last pin on an indexed block (so this owner's only one): CACHED, as in
                del held[block_id]  # _unpin (inline: a frame less was 5-10 % of a release)
                self._refs[block_id] = 0
                self._state[block_id] = CACHED
                self._num_sealed -= 1
                self.policy.inserted(self._hashes[block_id], self._tier[block_id])
        else:
            # The usual release names distinct blocks, each held: two set operations in C say
            # so. Only otherwise are pins counted block by block (repeats, or to name the
            # culprit).
            distinct = set(block_ids)
            if len(distinct) != len(block_ids) or not held.keys() >= distinct:
                self._check_held(block_ids, held)
            self._unpin(block_ids[::-1], held)
        if not held:
            self._held.pop(owner, None)

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
        held = self._held.pop(owner, None)
        if not held:
            return 0
        num_touched = len(held)  # _unpin empties `held` as it goes
        # Highest id first approximates "tail first" for chains allocated in one batch.
        self._unpin([block_id for block_id in sorted(held, reverse=True)
                     for _ in range(held[block_id])], held)
        return num_touched

    def _unpin(self, block_ids: Sequence[int], held: dict[int, int]) -> None:
        """Drop one pin of `held` per block, in order (every pin is known to be there).

        One loop with the pool's tables in locals, and one policy call for every block that
        became evictable: at batch 256 the per-block work is all there is, and a method call per
        block was 12-20 % of a release (in-process, old/new alternating)."""
        state, refs, hashes, tiers = self._state, self._refs, self._hashes, self._tier
        is_orphan, is_duplicate = self._is_orphan, self._is_duplicate
        num_last_pins = 0  # sealed blocks whose last pin this was: no longer SEALED
        cached_keys: list[Hashable] = []  # for the policy in one call, in release order
        cached_tiers: list[int] = []
        loops, position, end = self._loops, 0, len(block_ids)
        while position < end:
            if loops is not None:  # the sealed blocks that stay or become cached
                position, num_cached = loops.unpin_run(
                    block_ids, position, held, state, refs, hashes, tiers, is_orphan,
                    is_duplicate, cached_keys, cached_tiers)
                num_last_pins += num_cached
                if position == end:
                    break
            block_id = block_ids[position]
            position += 1
            pins = held.pop(block_id) - 1  # one dict operation for the usual single pin
            if pins:
                held[block_id] = pins
            if state[block_id] == OWNED:
                self._num_owned -= 1
                self._to_free(block_id)
                continue
            count = refs[block_id] - 1
            refs[block_id] = count
            if count:
                continue
            num_last_pins += 1
            key = hashes[block_id]
            if is_duplicate[block_id]:
                # Nobody can look it up, so keeping it would only waste a block.
                hashes[block_id] = None
                self._to_free(block_id)
            elif is_orphan[block_id]:
                # Unreachable: caching it would only waste blocks. Its subtree may hold blocks
                # this loop cached already: the policy must know them before it discards any.
                self.policy.inserted_many(cached_keys, cached_tiers)
                cached_keys, cached_tiers = [], []
                self.policy.forgotten(key)  # (what it kept of the key while it was pinned)
                self._evict_subtree(block_id)
            else:
                state[block_id] = CACHED
                cached_keys.append(key)
                cached_tiers.append(tiers[block_id])
        if cached_keys:
            self.policy.inserted_many(cached_keys, cached_tiers)
        self._num_sealed -= num_last_pins

    # ---- recovery --------------------------------------------------------------------------
    def journal_rows(self, block_ids: Iterable[int] | None = None) -> list[JournalRow]:
        """What the journal records of indexed blocks (see kvd/server/journal.py): of `block_ids`, or
        of every indexed block, oldest index entry first. A row is (block_id, key, generation,
        parent, parent_generation, tier); parent is ORPHAN for an orphan."""
        parents, is_orphan, hashes, tiers = self._parent, self._is_orphan, self._hashes, self._tier
        if self._loops is not None and type(block_ids) is list:
            rows = self._loops.journal_rows(block_ids, is_orphan, hashes, tiers,
                                            self._generations, self._links)
            if rows is not None:
                return rows
        generation = self.generations.item  # a Python int at half the cost of int(a[i])
        rows = []
        for block_id in self._index.values() if block_ids is None else block_ids:
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
        if len(self._free) != self.num_blocks:
            raise InternalError("restore() needs a fresh pool: blocks are already in use")
        if self._hot_ops_made:  # (it replaces tables they are bound to: filling them in place
            # instead made a million-block restore 0.2-0.7 s slower)
            raise InternalError("restore() must come before hot_ops()")
        keep = self._restorable(rows)
        ids = np.asarray(rows.block_ids, dtype=np.int64)[keep]
        keys = rows.keys if keep.all() else [key for key, is_kept in zip(rows.keys, keep.tolist())
                                             if is_kept]
        parents = np.asarray(rows.parents, dtype=np.int64)[keep]
        tiers = np.asarray(rows.tiers, dtype=np.uint8)[keep]
        self._index = dict(zip(keys, ids.tolist()))
        if len(self._index) != len(keys):
            raise BadArgsError("the journal names a hash twice: it is corrupt")
        np.frombuffer(self._state, dtype=np.uint8)[ids] = CACHED
        np.frombuffer(self._tier, dtype=np.uint8)[ids] = tiers
        # One NumPy scatter, not a Python loop over a million blocks; fromiter keeps every key
        # one object, tuples included.
        hashes = np.empty(self.num_blocks, dtype=object)  # (all None: the pool is fresh)
        hashes[ids] = np.fromiter(keys, dtype=object, count=len(keys))
        self._hashes = hashes.tolist()
        self._link_restored(ids, parents)
        self.policy.restored(keys, tiers.tolist())
        self._free = array("q", np.flatnonzero(np.frombuffer(self._state, dtype=np.uint8)
                                               == FREE)[::-1].tolist())
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
        view = {name: np.frombuffer(getattr(self, name), dtype=np.int32)
                for name in ("_parent", "_first_child", "_next_sibling", "_prev_sibling")}
        view["_parent"][children] = parents
        is_sibling = parents[1:] == parents[:-1]  # consecutive children of one parent
        view["_next_sibling"][children[:-1][is_sibling]] = children[1:][is_sibling]
        view["_prev_sibling"][children[1:][is_sibling]] = children[:-1][is_sibling]
        is_first = np.concatenate(([True], ~is_sibling))[:children.size]
        view["_first_child"][parents[is_first]] = children[is_first]

    # ---- checking ------------------------------------------------------------------------
    def _checked_id(self, block_id: int) -> int:
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:  # (not bool)
            raise BadArgsError(f"block id {block_id!r} is not in [0, {self.num_blocks})")
        return block_id

    def check_invariants(self) -> None:
        """Verify DESIGN.md section 3's invariants in O(num_blocks); raise InternalError if not."""
        counts = [0, 0, 0, 0]
        for state in self._state:
            counts[state] += 1
        expected = [len(self._free), self._num_owned, self._num_sealed,
                    len(self.policy) + (self._next_victim != NO_BLOCK)]
        if counts != expected:
            raise InternalError(f"state counts {counts} != bookkeeping {expected} "
                                "(free, owned, sealed, cached)")
        if len(set(self._free)) != len(self._free):
            raise InternalError("a block is on the free list twice")
        if any(self._state[block_id] != FREE for block_id in self._free):
            raise InternalError("a block on the free list is not free")
        pins = [0] * self.num_blocks
        for owner, held in self._held.items():
            if not held:
                raise InternalError(f"owner {owner} is listed but holds no block")
            for block_id, count in held.items():
                if count <= 0:
                    raise InternalError(f"owner {owner} holds block {block_id} {count} times")
                pins[block_id] += count
        for block_id in range(self.num_blocks):
            self._check_block(block_id, pins[block_id])
        for key, block_id in self._index.items():
            if self._hashes[block_id] != key or self._state[block_id] not in (SEALED, CACHED):
                raise InternalError(f"index maps {key!r} to block {block_id} which does not hold it")
        self._check_tree()

    def _is_indexed(self, block_id: int) -> bool:
        key = self._hashes[block_id]
        return key is not None and self._index.get(key) == block_id

    def _check_tree(self) -> None:
        """Prefix-tree links are consistent; no orphan is cached; every linked block's parent is
        indexed (so no cached block is reachable only through an evicted parent)."""
        num_linked = 0
        for parent in range(self.num_blocks):
            child, before = self._first_child[parent], NO_BLOCK
            while child != NO_BLOCK:
                num_linked += 1
                if self._parent[child] != parent or self._prev_sibling[child] != before \
                        or not self._is_indexed(parent) or not self._is_indexed(child) \
                        or self._is_orphan[child] != self._is_orphan[parent] \
                        or num_linked > self.num_blocks:
                    raise InternalError(f"prefix tree: block {child} under block {parent} is "
                                        "mislinked, unindexed or orphaned: a pool bug")
                child, before = self._next_sibling[child], child
        if num_linked != sum(parent != NO_BLOCK for parent in self._parent):
            raise InternalError("prefix tree: a block names a parent whose child list lacks it")
        for block_id in range(self.num_blocks):
            if self._is_orphan[block_id] and self._state[block_id] != SEALED:
                raise InternalError(f"orphan block {block_id} is {self.state(block_id)}: an "
                                    "unreachable block must be freed on its last release")

    def _check_block(self, block_id: int, pins: int) -> None:
        state, refs, key = self._state[block_id], self._refs[block_id], self._hashes[block_id]
        where = f"block {block_id} ({STATE_NAMES[state]}, ref {refs}, pins {pins})"
        if refs != pins:
            raise InternalError(f"{where}: ref count differs from pins held by live owners")
        if state == FREE and (refs or key is not None):
            raise InternalError(f"{where}: a free block holds a ref or a hash")
        if state == OWNED and (refs != 1 or key is not None):
            raise InternalError(f"{where}: an owned block must have exactly its owner's ref")
        if state == SEALED and (refs < 1 or key is None):
            raise InternalError(f"{where}: a sealed block must be pinned and hashed")
        if self._is_duplicate[block_id] != (state == SEALED and not self._is_indexed(block_id)):
            raise InternalError(f"{where}: duplicate mark {self._is_duplicate[block_id]} is wrong: "
                                "a duplicate is exactly a sealed block outside the index")
        is_tracked = key in self.policy
        if state == CACHED and (refs or key is None or self._index.get(key) != block_id
                                or is_tracked == (block_id == self._next_victim)):
            raise InternalError(f"{where}: a cached block must be unpinned, indexed and evictable "
                                "(tracked by the policy unless it is the chosen next victim)")

    def stats(self) -> dict[str, int]:
        """Block counts by state plus cumulative counters."""
        return {"num_blocks": self.num_blocks, "free": self.num_free, "owned": self.num_owned,
                "sealed": self.num_sealed, "cached": self.num_cached,
                "indexed": len(self._index), **self.counters}
