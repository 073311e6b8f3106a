"""The eviction-policy interface: policies order keys, the pool executes.

Theory of operation
-------------------
A policy never touches memory, the free list or ref counts. The pool tells it four things about
*keys* (content hashes in the daemon, `(layer, position)` keys in the embedded cache, trace ids in
`kvd replay`):

    inserted(key)   the key became evictable (sealed and ref count 0, i.e. CACHED)
    accessed(key)   the key was hit; it may be evictable or pinned right now
    removed(key)    the key stopped being evictable (pinned again) but is still cached
    victim()        choose an evictable key, stop tracking it and return it (None if none)

Keys are content, not block ids, so a policy that remembers evicted keys (ARC's ghost lists,
S3-FIFO's ghost queue) recognises a block's content when it comes back in another block.

A key's life:  inserted → (accessed | removed → accessed* → inserted)* → victim.
Every event and every victim must cost O(1) (amortised): the pool calls them while holding up a
client's request. Only keys inserted and not since removed may be returned by `victim()`.

Prefix chains: the pool makes a request's blocks evictable tail first (it releases in reverse),
so a recency-ordered policy evicts a chain's tail before its head — a child without its parent is
unreachable, a parent without its child is still a useful prefix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import ClassVar


class EvictionPolicy(ABC):
    """Orders evictable keys and chooses victims. Subclasses are named after the literature."""

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        """Args: capacity: blocks in the pool (sizes history such as ghost lists)."""
        if capacity <= 0:
            raise ValueError(f"policy capacity must be a positive block count, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def inserted(self, key: Hashable) -> None:
        """`key` became evictable."""

    @abstractmethod
    def accessed(self, key: Hashable) -> None:
        """`key` was hit (evictable or pinned)."""

    @abstractmethod
    def removed(self, key: Hashable) -> None:
        """`key` is pinned again: no longer evictable, still cached."""

    @abstractmethod
    def victim(self) -> Hashable | None:
        """Remove and return the key to evict, or None when nothing is evictable."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is evictable right now."""
