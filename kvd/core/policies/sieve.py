"""SIEVE: one FIFO, one visited bit per key, and a hand that sifts from old to new.

Zhang et al., "SIEVE is Simpler than LRU" (NSDI 2024).

Theory of operation
-------------------
New keys enter at the head (newest end) of a queue. A hit only sets the key's visited bit. To
choose a victim the *hand* walks from where it stopped toward the head, clearing visited bits,
and evicts the first unvisited key; it wraps to the tail (oldest end) when it passes the head.
Unlike CLOCK, survivors are not moved: keys that were hit stay where they are while new keys
pile up in front of the hand, so one-hit blocks (most of an LLM trace) are sifted out quickly
and popular ones are kept without any per-hit list work.

The queue is a doubly linked list threaded through two dicts (`_newer`, `_older`), so linking,
unlinking and moving the hand are O(1). Each step of the hand clears a bit set by a hit, so a
victim costs O(1) amortised over the hits.

Adapting to the pool's events (kvd/core/policies/base.py): a pinned key is unlinked (the hand steps
past it if it pointed there) and keeps its visited bit; when it becomes evictable again it is
linked at the head, as a newly arrived key would be.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvd.core.policies.base import TIER_PREFILL, EvictionPolicy


class SIEVEPolicy(EvictionPolicy):
    """SIEVE eviction: FIFO insertion order, visited bits, a hand that never moves survivors."""

    name = "sieve"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._newer: dict[Hashable, Hashable | None] = {}  # evictable key → next newer key
        self._older: dict[Hashable, Hashable | None] = {}  # evictable key → next older key
        self._visited: dict[Hashable, bool] = {}  # every cached key, evictable or pinned
        self._head: Hashable | None = None  # newest
        self._tail: Hashable | None = None  # oldest
        self._hand: Hashable | None = None  # next key to examine; None means "start at the tail"

    def _link_at_head(self, key: Hashable) -> None:
        self._newer[key] = None
        self._older[key] = self._head
        if self._head is None:
            self._tail = key
        else:
            self._newer[self._head] = key
        self._head = key

    def _unlink(self, key: Hashable) -> None:
        newer, older = self._newer.pop(key), self._older.pop(key)
        if newer is None:
            self._head = older
        else:
            self._older[newer] = older
        if older is None:
            self._tail = newer
        else:
            self._newer[older] = newer
        if self._hand == key:
            self._hand = newer

    def inserted(self, key: Hashable, tier: int = TIER_PREFILL) -> None:
        self._visited.setdefault(key, False)
        self._link_at_head(key)

    def inserted_many(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        visited, link_at_head = self._visited, self._link_at_head
        for key in keys:
            visited.setdefault(key, False)
            link_at_head(key)

    def accessed(self, key: Hashable) -> None:
        if key in self._visited:
            self._visited[key] = True

    def removed(self, key: Hashable) -> None:
        self._unlink(key)

    def hit_evictable(self, key: Hashable) -> None:
        self._visited[key] = True
        self._unlink(key)

    def hit_evictable_many(self, keys: Sequence[Hashable]) -> None:
        visited, unlink = self._visited, self._unlink
        for key in keys:
            visited[key] = True
            unlink(key)

    def discard(self, key: Hashable) -> None:
        self._unlink(key)
        del self._visited[key]

    def forgotten(self, key: Hashable) -> None:
        self._visited.pop(key, None)

    def victim(self) -> Hashable | None:
        if self._tail is None:
            return None
        visited, newer = self._visited, self._newer
        key = self._tail if self._hand is None else self._hand
        while visited[key]:
            visited[key] = False
            key = newer[key]
            if key is None:
                key = self._tail
        self._hand = key  # unlinking moves the hand on to the next newer key
        self._unlink(key)
        del visited[key]
        return key

    def __len__(self) -> int:
        return len(self._newer)

    def __contains__(self, key: object) -> bool:
        return key in self._newer
