"""The eviction-policy interface: policies order keys, the pool executes.

Theory of operation
-------------------
A policy never touches memory, the free list or ref counts. The pool tells it five things about
*keys* (content hashes in the daemon, `(layer, position)` keys in the embedded cache, trace ids in
`kvd replay`):

    inserted(key, tier)  the key became evictable (sealed and ref count 0, i.e. CACHED); `tier`
                         says whether prefill (0) or decode (1) wrote it — only TieredPolicy
                         (kvd/core/policies/tiered.py) looks at it
    accessed(key)        the key was hit; it may be evictable or pinned right now
    removed(key)         the key stopped being evictable (pinned again) but is still cached
    victim()             choose an evictable key, stop tracking it and return it (None if none)
    discard(key)         the pool evicted an evictable key the policy did not choose (it became
                         unreachable when its prefix parent was the victim): forget it, and
                         leave no ghost — the policy's judgement was not involved

and three shorthands for a batch's per-block events, which the base class spells out and a policy
may do more cheaply: `hit_evictable(key)` is exactly `accessed(key)` then `removed(key)` (a lookup
hit on a cached block pins it; every policy here pays no hit reward that the removal undoes at
once, such as LRU's move to the end: a batch-256 lookup in the pool took 30 % less time with
kvd's default policy), `hit_evictable_many(keys)` is `hit_evictable` for each key in order (a
lookup's cached blocks), and `inserted_many(keys, tiers)` is `inserted` for each key in order (a
release's blocks becoming evictable). The batch forms are one call instead of one per block, with
the policy's tables in locals: 20-30 % off a batch-256 release, and 22 % off a batch-256 lookup in
the pool with the default policy (`python -m bench.pool_ab` against the pool without it).

Keys are content, not block ids, so a policy that remembers evicted keys (ARC's ghost lists,
S3-FIFO's ghost queue) recognises a block's content when it comes back in another block.

A key's life:  inserted → (accessed | removed → accessed* → inserted)* → (victim | discard),
or, once removed, → forgotten: a pinned block cut off from its evicted parent is freed at its last
release instead of cached (kvd/core/pool.py, "Prefix tree"), and the policy must drop what it kept.
Every event and every victim must cost O(1) (amortised): the pool calls them while holding up a
client's request. Only keys inserted and not since removed may be returned by `victim()`.

Prefix chains: a child without its parent is unreachable, a parent without its child is still a
useful prefix. The pool enforces this itself for blocks sealed with their parent (kvd/core/pool.py,
"Prefix tree"): when a policy's victim has cached descendants they are discarded with it, tail
first. Policies therefore stay pure orderings; the pool also releases a request's blocks tail first,
so a recency-ordered policy already tends to pick a chain's tail before its head.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import ClassVar

TIER_PREFILL, TIER_DECODE = 0, 1  # who wrote a block: the prompt's prefill or decode


class EvictionPolicy(ABC):
    """Orders evictable keys and chooses victims. Subclasses are named after the literature."""

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        """Args: capacity: blocks in the pool (sizes history such as ghost lists)."""
        if capacity <= 0:
            raise ValueError(f"policy capacity must be a positive block count, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def inserted(self, key: Hashable, tier: int = TIER_PREFILL) -> None:
        """`key` became evictable; `tier` is TIER_PREFILL or TIER_DECODE."""

    def inserted_many(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        """`inserted(key, tier)` for each key and its tier, in order."""
        for key, tier in zip(keys, tiers):
            self.inserted(key, tier)

    def restored(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        """Recovery: `keys` become evictable, oldest first, in a policy that tracks nothing yet.

        Equivalent to `inserted` for each; policies with a cheaper bulk path override it (a
        million-block pool restores in bench/recovery.py's time budget only with one).
        """
        for key, tier in zip(keys, tiers):
            self.inserted(key, tier)

    @abstractmethod
    def accessed(self, key: Hashable) -> None:
        """`key` was hit (evictable or pinned)."""

    @abstractmethod
    def removed(self, key: Hashable) -> None:
        """`key` is pinned again: no longer evictable, still cached."""

    def hit_evictable(self, key: Hashable) -> None:
        """The evictable `key` was hit and pinned: `accessed(key)`, then `removed(key)`."""
        self.accessed(key)
        self.removed(key)

    def hit_evictable_many(self, keys: Sequence[Hashable]) -> None:
        """`hit_evictable(key)` for each key, in order."""
        for key in keys:
            self.hit_evictable(key)

    @abstractmethod
    def victim(self) -> Hashable | None:
        """Remove and return the key to evict, or None when nothing is evictable."""

    @abstractmethod
    def discard(self, key: Hashable) -> None:
        """Stop tracking the evictable `key`: the pool evicted it without asking (no ghost)."""

    def forgotten(self, key: Hashable) -> None:
        """The pinned `key` (last event: `removed`) left the cache without becoming evictable
        again: drop what is kept of it (no ghost: it was never a victim). Also called for a key
        sealed but never inserted. Policies that keep nothing of pinned keys need not override."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is evictable right now."""
