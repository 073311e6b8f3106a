"""The arena: one memory budget shared by pools of different block sizes (segregated fit).

Theory of operation
-------------------
A daemon serving several geometries (a model and its draft, full and latent attention) has one
budget, not one per geometry. The arena cuts the budget's data area into `num_slabs` slabs of
`slab_nbytes` bytes; a slab belongs to at most one pool at a time and is carved into
`blocks_per_slab(P) = slab_nbytes // block_nbytes(P)` blocks of that pool (memcached's slab
classes, with the slab as the unit that moves). Addresses are static, so a client never needs a
mutable map::

    pool P's block b  ->  slab b // bps(P), byte offset (b % bps(P)) * block_nbytes(P) in it

    data area  ┌─ slab 0 ──────────┬─ slab 1 ──────────┬─ slab 2 ──────────┬─ ...
               │ A0 A1 A2 A3 ...   │ B0 B1 ...    tail │ (unowned)         │
               └───────────────────┴───────────────────┴───────────────────┴─

Each pool's tables (kvd/core/pool.py) span its whole id space, `num_slabs * bps(P)` ids; the
ids of slabs it does not own are ABSENT: FREE in the state table, but not on the free list and
not counted as capacity, so invariant 2 reads free + owned + sealed + cached == present
(`BlockPool.num_present`). Handing a slab to a pool pushes its ids on the free list (lowest id on
top); taking one back needs every block in it FREE or CACHED -- its cached blocks are evicted
through the pool (policy, index, prefix tree, journal and generations stay right: a generation is
bumped when its block is freed, so a stale reader of the old pool sees its id was reused), its
ids leave the free list, and they are ABSENT again. A pinned or owned block is never taken.

Recovery (kvd/server/recovery.py): ownership is not journaled. `ArenaPool.restore` restores a
pool's rows and then owns exactly the slabs its restored blocks are in; the rest stay unowned,
for any pool to take. Rows of two pools claiming one slab are dropped before (recovery's job).

Slab size. `choose_slab_nbytes` picks a multiple of the largest block: large enough that the tail
`slab_nbytes % block_nbytes(P)` wastes little of every pool's slabs, small enough to leave many
slabs to move (a pool's partly used slab is waste too, and many slabs let memory move finely).
bench/arena_waste.py measures the waste against padding every block to the largest geometry.

Where memory goes. The C pool (kvd/core/_pool.c) allocates only from its free list and declines
otherwise, so the slab moves live here, on the refill path (once per slab, not per block). When
pool P's free list is short, `make_room` takes, in order:
  1. an unowned slab (at start every slab is unowned: pools grow on demand);
  2. when P cannot cover the request itself (free + evictable too small), the coldest slab of
     another pool that can be taken;
  3. otherwise another pool's coldest takeable slab, but only from a pool whose memory is worth
     no more than P's; else P evicts its own policy victim (BlockPool's ordinary path).
"Worth" is Cliffhanger's shadow-queue estimate of the hit rate one more slab would buy (Cidon et
al., NSDI 2016): each pool's policy is wrapped in a GhostPolicy that remembers the keys of the
blocks it evicted lately, GHOST_SHARE of the budget's bytes' worth (the same bytes for every
pool, so counts compare per byte), and a lookup miss that would have extended the prefix hit
through remembered keys counts one ghost hit per key; ghost hits halve every GHOST_HALF_LIFE
lookups with a miss. A pool takes from a pool with fewer ghost hits: memory flows to where more
of it buys more prefix hits, and settles where the marginal gains are equal. With equal ghost
hits (say neither pool re-reads anything) the slab ages decide: a slab's stamp is the arena's
clock (one tick per lookup and allocation, any pool) when a block of it was last allocated or
hit, and a slab colder than P's coldest goes (memcached's slab automover: a global LRU at slab
granularity), so an idle pool's memory ages and a busy one takes it (item 2 of issue 31).

Which slab leaves the donor: the slab of the donor's own policy victim when no other block of
it was used after the victim (each block's last use is stamped too), else the donor's coldest
takeable slab. The first keeps the donor's eviction order: a pool whose slab holds one block
(the largest geometry) loses exactly the block its policy would have evicted next, and a pool
with several blocks per slab loses with it only blocks no more recently used. The second
guards against the slab-mates of a victim being hot (a shared prefix allocated next to a
one-off block): evicting them would take their whole subtrees. Taking the coldest slab always
would bypass the donor's policy for most of its evictions (a pool whose memory is taken by
another pool's long requests loses most of its blocks that way), and the policies beat a
slab-granular LRU by up to 10 % (bench/hit_ratio.py --sharing, docs/pools.md). A victim whose
slab is refused goes with the move all the same (`give_back` evicts a chosen victim first): it
was the donor's next eviction anyway. Inside a pool its own policy still chooses every victim.
bench/hit_ratio.py --sharing measures the rule against static splits; GHOST_SHARE and
GHOST_HALF_LIFE are the values that did best there (docs/pools.md).

Costs: a refill compares the stamps of the slabs (NumPy passes over `num_slabs`); a move
asks the donor's policy for one victim, compares `blocks_per_slab` stamps, evicts at most one
slab of blocks (and the victim) and filters the donor's free list once; `num_available`
scans every pool's states (O(id space), off the hot path). The hot path (a pool with free
blocks) pays two stamps (slab and block) per allocated or hit block, and a lookup with a miss
one ghost probe per missing key up to the first one not remembered.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import cast

import numpy as np

from kvd.core.policies import EvictionPolicy, make_policy
from kvd.core.pool import (CACHED, FREE, NEXT_VICTIM, NO_BLOCK, NUM_FREE, NUM_OWNED, NUM_SEALED,
                           OWNED, SEALED, BlockPool, IndexRows, PoolObserver)
from kvd.errors import BadArgsError, InternalError

UNOWNED = -1
MAX_SLAB_BLOCKS = 64  # slab_nbytes is at most this many of the largest block
GHOST_SHARE = 0.7  # a pool's ghost list holds evicted keys worth this share of the budget
GHOST_HALF_LIFE = 150  # lookups with a miss (all pools) after which a ghost hit counts half


def choose_slab_nbytes(budget_nbytes: int, block_nbytes: Sequence[int]) -> int:
    """The slab size for a budget shared by pools of these block sizes (module docstring).

    The multiple k of the largest block that minimises the expected waste: the worst slab tail
    (`slab % block` of a pool's slab), plus one partly used slab per pool (the one its free
    list is drawing on, `num_pools / num_slabs` of the budget), plus the budget's own tail.
    Small k leaves many slabs but may leave big tails; large k the reverse.
    """
    largest = max(block_nbytes)
    best: tuple[float, int] | None = None
    for k in range(1, MAX_SLAB_BLOCKS + 1):
        slab_nbytes = k * largest
        num_slabs = budget_nbytes // slab_nbytes
        if num_slabs < len(block_nbytes):
            break
        waste = (max((slab_nbytes % nbytes) / slab_nbytes for nbytes in block_nbytes)
                 + len(block_nbytes) / num_slabs + (budget_nbytes % slab_nbytes) / budget_nbytes)
        if best is None or waste < best[0]:
            best = (waste, slab_nbytes)
    if best is None:
        raise BadArgsError(f"a budget of {budget_nbytes} bytes holds fewer than one block of "
                           f"{largest} bytes per pool: raise --memory or shrink the largest pool's "
                           "block")
    return best[1]


class GhostPolicy:
    """A pool's policy, plus the keys of the blocks it let go (victims and discards), newest last,
    at most `limit`: a lookup miss on one of them is a hit this pool would have had with more
    memory. Every other event goes straight to the policy (the C pool binds those methods)."""

    def __init__(self, policy: EvictionPolicy, limit: int) -> None:
        self.policy, self.limit, self.name = policy, max(1, limit), policy.name
        self.keys: OrderedDict[Hashable, None] = OrderedDict()

    def __getattr__(self, name: str) -> object:
        return getattr(self.policy, name)

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.policy

    def victim(self) -> Hashable | None:
        key = self.policy.victim()
        if key is not None:
            self._remember(key)
        return key

    def discard(self, key: Hashable) -> None:
        self.policy.discard(key)
        self._remember(key)

    def _remember(self, key: Hashable) -> None:
        keys = self.keys
        keys[key] = None
        if len(keys) > self.limit:
            keys.popitem(last=False)


class Arena:
    """Slabs of one budget and the pools that own them."""

    def __init__(self, budget_nbytes: int, block_nbytes: Sequence[int],
                 slab_nbytes: int | None = None) -> None:
        """Args:
            budget_nbytes: bytes of the data area all pools share.
            block_nbytes: per pool (in pool order), the bytes of one block.
            slab_nbytes: the slab size; `choose_slab_nbytes` when None.
        """
        if not block_nbytes or any(type(n) is not int or n <= 0 for n in block_nbytes):
            raise BadArgsError(f"block sizes must be positive ints, got {list(block_nbytes)!r}")
        self.slab_nbytes = slab_nbytes or choose_slab_nbytes(budget_nbytes, block_nbytes)
        if self.slab_nbytes < max(block_nbytes):
            raise BadArgsError(f"slab of {self.slab_nbytes} bytes holds no block of "
                               f"{max(block_nbytes)} bytes")
        self.num_slabs = budget_nbytes // self.slab_nbytes
        if self.num_slabs < 1:
            raise BadArgsError(f"a budget of {budget_nbytes} bytes holds no slab of "
                               f"{self.slab_nbytes} bytes: raise --memory")
        self.block_nbytes = list(block_nbytes)
        self.blocks_per_slab = [self.slab_nbytes // nbytes for nbytes in block_nbytes]
        self.owner = np.full(self.num_slabs, UNOWNED, dtype=np.int32)
        self.stamps = np.zeros(self.num_slabs, dtype=np.int64)
        self.clock = 0
        self.num_lookups = 0  # (ghost hits halve every GHOST_HALF_LIFE of them)
        self.num_moves = 0
        self.budget_nbytes = budget_nbytes
        self.pools: list[ArenaPool | None] = [None] * len(block_nbytes)

    @property
    def data_nbytes(self) -> int:
        return self.num_slabs * self.slab_nbytes

    def num_ids(self, pool_number: int) -> int:
        """The id space of a pool: every block it could hold if it owned every slab."""
        return self.num_slabs * self.blocks_per_slab[pool_number]

    def block_offset(self, pool_number: int, block_id: int) -> int:
        """Byte offset of a block in the data area (static: see the module docstring)."""
        slab, slot = divmod(block_id, self.blocks_per_slab[pool_number])
        return slab * self.slab_nbytes + slot * self.block_nbytes[pool_number]

    def add_pool(self, pool_number: int, policy: EvictionPolicy | str = "default",
                 generations: np.ndarray | None = None,
                 observer: PoolObserver | None = None) -> ArenaPool:
        """Make pool `pool_number`'s BlockPool, owning no slab yet (it grows on demand)."""
        if self.pools[pool_number] is not None:
            raise BadArgsError(f"pool {pool_number} of the arena exists already")
        pool = ArenaPool(self, pool_number, policy, generations, observer)
        self.pools[pool_number] = pool
        return pool

    # ---- accounting ----------------------------------------------------------------------
    def num_unowned(self) -> int:
        return int(np.count_nonzero(self.owner == UNOWNED))

    def num_takeable(self, pool: ArenaPool) -> int:
        """Slabs `pool` could take now: unowned ones, and other pools' with nothing in use."""
        num = self.num_unowned()
        for other in self.pools:
            if other is not None and other is not pool:
                num += other.num_givable()
        return num

    def slabs_of(self, pool_number: int) -> np.ndarray:
        return np.flatnonzero(self.owner == pool_number)

    def stats(self) -> dict[str, int]:
        return {"num_slabs": self.num_slabs, "slab_nbytes": self.slab_nbytes,
                "unowned_slabs": self.num_unowned(), "slab_moves": self.num_moves}

    def live_nbytes(self) -> int:
        """Bytes of blocks that hold something (owned, sealed or cached), all pools."""
        return sum((pool.num_present - pool.num_free) * pool.block_nbytes
                   for pool in self.pools if pool is not None)

    def in_use_nbytes(self) -> int:
        """Bytes of slabs some pool owns."""
        return int(np.count_nonzero(self.owner != UNOWNED)) * self.slab_nbytes

    # ---- moving memory -------------------------------------------------------------------
    def stamp(self, pool: ArenaPool, block_ids: Iterable[int]) -> None:
        """Tick the clock and mark the slabs of these blocks as just used."""
        self.clock += 1
        bps, stamps, clock = pool.blocks_per_slab, self.stamps, self.clock
        last_used = pool.last_used
        for block_id in block_ids:
            stamps[block_id // bps] = clock
            last_used[block_id] = clock

    def count_lookup(self, pool: ArenaPool, keys: Sequence[Hashable], num_hits: int) -> None:
        """Count the lookup's misses that `pool` evicted lately and that would have extended its
        prefix hit (its ghost hits: what prefix reuse more memory would have bought)."""
        ghosts = pool.ghosts.keys
        for key in keys[num_hits:]:
            if key not in ghosts:
                break
            pool.ghost_hits += 1
        self.num_lookups += 1
        if self.num_lookups % GHOST_HALF_LIFE == 0:
            for each in self.pools:
                if each is not None:
                    each.ghost_hits /= 2

    def make_room(self, pool: ArenaPool, num_blocks: int) -> None:
        """Give `pool` slabs until its free list holds `num_blocks`, or until the rule of the
        module docstring says it should evict its own blocks instead."""
        while pool.num_free < num_blocks:
            unowned = np.flatnonzero(self.owner == UNOWNED)
            if unowned.size:
                self._give(int(unowned[0]), pool)
                continue
            must_grow = pool.num_own_available < num_blocks
            slab = self._donor_slab(pool, must_grow)
            if slab is None:
                return
            self._take(slab)
            self._give(slab, pool)

    def _donor_slab(self, pool: ArenaPool, must_grow: bool) -> int | None:
        """A slab of the pool owning another pool's coldest slab that can be taken (colder than
        `pool`'s coldest unless `must_grow`): its policy victim's if `victim_slab` allows,
        else that coldest slab; or None."""
        owner, stamps = self.owner, self.stamps
        is_other = (owner != UNOWNED) & (owner != pool.number)
        if not must_grow:
            is_other &= self._is_poorer(pool)[np.maximum(owner, 0)]
        if not is_other.any():
            return None
        candidates = np.flatnonzero(is_other)
        if not must_grow:
            own = stamps[owner == pool.number]
            coldest_own = own.min() if own.size else np.iinfo(np.int64).max
            is_tie = np.array([each is not None and each.ghost_hits == pool.ghost_hits
                               for each in self.pools])[owner[candidates]]
            candidates = candidates[~is_tie | (stamps[candidates] < coldest_own)]
        coldest_first = candidates[np.argsort(stamps[candidates], kind="stable")].tolist()
        if coldest_first:
            donor = self.pools[owner[coldest_first[0]]]
            slab = None if donor is None else donor.victim_slab()
            if slab is not None:
                return slab
        for slab in coldest_first:
            donor = self.pools[owner[slab]]
            if donor is not None and donor.can_give(slab):
                return slab
        return None

    def _is_poorer(self, pool: ArenaPool) -> np.ndarray:
        """Per pool, whether its memory is worth no more than `pool`'s need: fewer ghost hits
        (or as many: then the slab ages decide)."""
        return np.array([each is not None and each.ghost_hits <= pool.ghost_hits
                         for each in self.pools])

    def _take(self, slab: int) -> None:
        donor = self.pools[self.owner[slab]]
        if donor is None:
            raise InternalError(f"slab {slab} belongs to a pool that does not exist: an arena bug")
        donor.give_back(slab)
        self.owner[slab] = UNOWNED
        self.num_moves += 1

    def claim(self, pool: ArenaPool, slabs: np.ndarray) -> None:
        """Give `pool` these slabs as they are (a recovery: they hold its restored blocks)."""
        if (self.owner[slabs] != UNOWNED).any():
            raise InternalError("a slab claimed by two pools: recovery drops such claims first")
        self.owner[slabs] = pool.number

    def _give(self, slab: int, pool: ArenaPool) -> None:
        self.owner[slab] = pool.number
        self.clock += 1
        self.stamps[slab] = self.clock
        pool.adopt(slab)

    def check_invariants(self) -> None:
        """Each pool's invariants, and slab ownership agrees with what each pool holds."""
        for pool in self.pools:
            if pool is not None:
                pool.check_invariants()
                if pool.num_present != len(self.slabs_of(pool.number)) * pool.blocks_per_slab:
                    raise InternalError(f"pool {pool.number} counts {pool.num_present} present "
                                        "blocks but owns a different number of slabs")


class ArenaPool(BlockPool):
    """A BlockPool whose capacity is the slabs the arena gave it (module docstring)."""

    def __init__(self, arena: Arena, number: int, policy: EvictionPolicy | str,
                 generations: np.ndarray | None, observer: PoolObserver | None) -> None:
        num_ids = arena.num_ids(number)
        # The policy is sized to the whole id space: the pool may come to hold all of it.
        inner = make_policy(policy, num_ids) if isinstance(policy, str) else policy
        ghost_limit = int(GHOST_SHARE * arena.budget_nbytes) // arena.block_nbytes[number]
        # BlockPool's policy is the GhostPolicy: the same interface (duck-typed, so that every
        # event but victim and discard reaches the inner policy's own bound method).
        self.ghosts = GhostPolicy(inner, ghost_limit)
        super().__init__(num_ids, cast(EvictionPolicy, self.ghosts), generations, observer)
        self.arena, self.number = arena, number
        self.ghost_hits = 0.0
        self.last_used = np.zeros(num_ids, dtype=np.int64)  # per block, the arena's clock
        self.blocks_per_slab = arena.blocks_per_slab[number]
        self.block_nbytes = arena.block_nbytes[number]
        self.tables.counts[NUM_FREE] = 0  # every id ABSENT until the arena gives a slab
        self.num_present = 0

    @property
    def num_own_available(self) -> int:
        """Free plus evictable blocks of the slabs this pool owns."""
        counts = self.tables.counts
        return self.num_present - counts[NUM_OWNED] - counts[NUM_SEALED]

    @property
    def num_available(self) -> int:
        """Own free and evictable blocks plus the worth of every slab it could take (unowned, or
        another pool's with nothing pinned or owned in it): O(id space), off the hot path."""
        return self.num_own_available + self.arena.num_takeable(self) * self.blocks_per_slab

    # ---- the refill path -----------------------------------------------------------------
    def allocate(self, num_blocks: int, owner: int) -> list[int] | None:
        if type(num_blocks) is int and num_blocks > self.tables.counts[NUM_FREE]:
            self.arena.make_room(self, num_blocks)
        block_ids = super().allocate(num_blocks, owner)
        if block_ids:
            self.arena.stamp(self, block_ids)
        return block_ids

    def put(self, key: Hashable, tier: int = 0) -> int | None:
        if not self.tables.counts[NUM_FREE]:
            self.arena.make_room(self, 1)
            if not self.tables.counts[NUM_FREE] and not self.num_cached:
                return None  # (the C put would ask an empty policy for a victim)
        block_id = super().put(key, tier)
        if block_id is not None:
            self.arena.stamp(self, (block_id,))
        return block_id

    def lookup(self, keys: Iterable[Hashable], owner: int) -> list[int]:
        if type(keys) is not list:
            keys = list(keys)
        block_ids = super().lookup(keys, owner)
        self.arena.stamp(self, block_ids)
        if len(block_ids) < len(keys):
            self.arena.count_lookup(self, keys, len(block_ids))
        return block_ids

    def pin(self, block_ids: Sequence[int], owner: int) -> None:
        super().pin(block_ids, owner)
        self.arena.stamp(self, block_ids)

    def restore(self, rows: IndexRows) -> int:
        """BlockPool.restore, then the pool owns the slabs of the blocks that came back (their
        other ids are free) and no other: its rows must claim no slab another pool owns."""
        t = self.tables
        if self.num_present:
            raise InternalError("restore() needs a fresh pool: it owns slabs already")
        t.counts[NUM_FREE] = self.num_blocks  # (every id is FREE: what the fresh check counts)
        try:
            num_restored = super().restore(rows)
        finally:
            states = np.frombuffer(t.state, dtype=np.uint8)
            self.arena.claim(self, np.unique(np.flatnonzero(states == CACHED)
                                             // self.blocks_per_slab))
            present = np.repeat(self.arena.owner == self.number, self.blocks_per_slab)
            free = np.frombuffer(t.free, dtype=np.int64)
            kept = free[:t.counts[NUM_FREE]]
            kept = kept[present[kept]]  # (descending: the lowest id stays on top)
            free[:kept.size] = kept
            t.counts[NUM_FREE] = kept.size
            self.num_present = int(np.count_nonzero(present))
        return num_restored

    # ---- slabs ---------------------------------------------------------------------------
    def _slab_ids(self, slab: int) -> range:
        return range(slab * self.blocks_per_slab, (slab + 1) * self.blocks_per_slab)

    def victim_slab(self) -> int | None:
        """The slab of the policy's victim (chosen now unless it is chosen already: it stays
        CACHED until evicted, the pool's NEXT_VICTIM) if the slab can be given and none of its
        blocks was used after the victim; None otherwise, the victim still chosen."""
        counts = self.tables.counts
        block_id = counts[NEXT_VICTIM]
        if block_id == NO_BLOCK:
            if not self.num_cached:
                return None
            block_id = counts[NEXT_VICTIM] = self._policy_victim()
        slab = block_id // self.blocks_per_slab
        ids = self._slab_ids(slab)
        if (self.last_used[ids.start:ids.stop].max() > self.last_used[block_id]
                or not self.can_give(slab)):
            return None
        return slab

    def can_give(self, slab: int) -> bool:
        """Whether every block of the slab is FREE or CACHED (nothing pinned or owned)."""
        ids = self._slab_ids(slab)
        states = np.frombuffer(self.tables.state, dtype=np.uint8)[ids.start:ids.stop]
        return bool(((states == FREE) | (states == CACHED)).all())

    def num_givable(self) -> int:
        """Slabs this pool owns with every block FREE or CACHED."""
        states = np.frombuffer(self.tables.state, dtype=np.uint8).reshape(
            self.arena.num_slabs, self.blocks_per_slab)
        in_use = ((states == OWNED) | (states == SEALED)).any(axis=1)
        return int(np.count_nonzero(~in_use & (self.arena.owner == self.number)))

    def adopt(self, slab: int) -> None:
        """The slab's ids become present and free, the lowest on top of the free stack."""
        t = self.tables
        ids = self._slab_ids(slab)
        top = t.counts[NUM_FREE]
        np.frombuffer(t.free, dtype=np.int64)[top:top + len(ids)] = np.arange(
            ids.stop - 1, ids.start - 1, -1)
        t.counts[NUM_FREE] = top + len(ids)
        self.num_present += len(ids)

    def give_back(self, slab: int) -> None:
        """Evict the slab's cached blocks (with their cached descendants, wherever they are) and
        make its ids ABSENT. The caller checked `can_give`."""
        t = self.tables
        counts, state, hashes = t.counts, t.state, t.hashes
        chosen = counts[NEXT_VICTIM]
        if chosen != NO_BLOCK:  # the policy let it go already; a subtree walk must not meet it
            counts[NEXT_VICTIM] = NO_BLOCK
            self._evict_subtree(chosen)
        ids = self._slab_ids(slab)
        for block_id in ids:
            if state[block_id] == CACHED:
                self.policy.discard(hashes[block_id])
                self._evict_subtree(block_id)
            elif state[block_id] != FREE:
                raise InternalError(f"slab {slab} given back with block {block_id} in use: "
                                    "an arena bug")
        free = np.frombuffer(t.free, dtype=np.int64)
        top = counts[NUM_FREE]
        kept = free[:top][(free[:top] < ids.start) | (free[:top] >= ids.stop)]
        free[:kept.size] = kept
        counts[NUM_FREE] = kept.size
        self.num_present -= len(ids)

    def check_invariants(self) -> None:
        super().check_invariants()
        owned = self.arena.owner == self.number
        present = np.repeat(owned, self.blocks_per_slab)
        states = np.frombuffer(self.tables.state, dtype=np.uint8)
        if (states[~present] != FREE).any():
            raise InternalError(f"pool {self.number}: a block of a slab it does not own is in use")
        free = np.frombuffer(self.tables.free, dtype=np.int64)[:self.tables.counts[NUM_FREE]]
        if not present[free].all():
            raise InternalError(f"pool {self.number}: an absent block is on the free list")

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "slabs": int(np.count_nonzero(self.arena.owner == self.number)),
                "block_nbytes": self.block_nbytes}
