"""LRU: evict the key made evictable or hit longest ago.

An `OrderedDict` is a hash map threaded with a doubly linked list in C: `move_to_end` and
`popitem(last=False)` are O(1) and allocate nothing, which makes it both the simplest and the
fastest LRU available to Python code (bench/policies.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvd.core.policies.base import TIER_PREFILL, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Least recently used; recency = last hit or last time the key became evictable."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def inserted(self, key: Hashable, tier: int = TIER_PREFILL) -> None:
        self._order[key] = None

    def inserted_many(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        order = self._order  # (OrderedDict.update(dict.fromkeys(keys)) measured slower)
        for key in keys:
            order[key] = None

    def restored(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        if self._order:
            raise ValueError("restored() needs a policy that tracks nothing yet")
        self._order = OrderedDict.fromkeys(keys)

    def accessed(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: Hashable) -> None:
        del self._order[key]

    def hit_evictable(self, key: Hashable) -> None:
        del self._order[key]  # the hit's move to the end is undone by the removal

    def hit_evictable_many(self, keys: Sequence[Hashable]) -> None:
        order = self._order
        for key in keys:
            del order[key]

    def discard(self, key: Hashable) -> None:
        del self._order[key]

    def victim(self) -> Hashable | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
