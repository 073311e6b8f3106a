"""S3-FIFO: a small probationary FIFO, a main FIFO with lazy promotion, and a ghost FIFO.

Yang et al., "FIFO queues are all you need for cache eviction" (SOSP 2023).

Theory of operation
-------------------
Most blocks of LLM traffic are used once (76% of the distinct blocks of the Mooncake
conversation trace, ../shared/traces/SOURCES.md). S3-FIFO demotes them quickly: a new key enters
the *small* queue S (10% of the pool); when S is over its share, its oldest key leaves —
promoted to the *main* queue M if it was hit while in S, else evicted and remembered in the
*ghost* queue G. A key that misses while in G was evicted too early, so it goes straight to M.
M is a FIFO with lazy promotion (a two-bit counter, CLOCK-like): its oldest key is evicted when
its counter is 0, else reinserted with the counter decremented.

Hits only bump a counter (capped at 3), so a hit costs one dict store and no list surgery.
Every queue is an `OrderedDict` (O(1) append and pop-oldest); reinsertions are amortised
against the hits that earned them (at most 3 per hit), so a victim is O(1) amortised.

Adapting to the pool's events (kvd/policies/base.py): a pinned key leaves its queue and keeps its
counter and its queue; when it becomes evictable again it is appended to that queue's new end
(the pin was a use; FIFO position cannot be restored in O(1)). A key promoted from S starts M with
its counter cleared: its S hit paid for the promotion.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvd.policies.base import TIER_PREFILL, EvictionPolicy

SMALL_SHARE = 0.1  # the paper's default share of S; its sensitivity study finds 5-20% flat
MAX_FREQUENCY = 3  # two bits, as in the paper


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO with quick demotion from a small queue and a ghost queue the size of main."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_share: float = SMALL_SHARE) -> None:
        super().__init__(capacity)
        if not 0.0 < small_share < 1.0:
            raise ValueError(f"small_share must be in (0, 1), got {small_share}")
        self.small_target = max(1, round(capacity * small_share))
        self._ghost_limit = max(1, capacity - self.small_target)
        self._small: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._frequency: dict[Hashable, int] = {}  # every cached key, evictable or pinned
        self._pinned: dict[Hashable, bool] = {}  # cached, not evictable → is in main

    def inserted(self, key: Hashable, tier: int = TIER_PREFILL) -> None:
        # A key pinned while cached goes back to its queue, a new one to M if it is a ghost
        # hit, else to S unhit.
        is_main = self._pinned.pop(key, None)
        if is_main is None:
            self._frequency[key] = 0
            is_main = self._is_ghost_hit(key)
        (self._main if is_main else self._small)[key] = None

    def inserted_many(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        # inserted() as one loop over locals, for the pool's releases (routing single inserts
        # through here instead measured slower per policy event, bench/policies.py).
        pinned, frequency, is_ghost_hit = self._pinned, self._frequency, self._is_ghost_hit
        main, small = self._main, self._small
        for key in keys:
            is_main = pinned.pop(key, None)
            if is_main is None:
                frequency[key] = 0
                is_main = is_ghost_hit(key)
            (main if is_main else small)[key] = None

    def restored(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        # A fresh policy has no ghosts, so every key enters S unhit, as `inserted` would do it.
        if self._frequency:
            raise ValueError("restored() needs a policy that tracks nothing yet")
        self._frequency = dict.fromkeys(keys, 0)
        self._small = OrderedDict.fromkeys(keys)

    def _is_ghost_hit(self, key: Hashable) -> bool:
        """A newly cached key: whether it left S unhit recently (then it goes to M)."""
        if key not in self._ghost:
            return False
        del self._ghost[key]
        return True

    def accessed(self, key: Hashable) -> None:
        frequency = self._frequency.get(key)
        if frequency is not None and frequency < MAX_FREQUENCY:
            self._frequency[key] = frequency + 1

    def removed(self, key: Hashable) -> None:
        if key in self._small:
            del self._small[key]
            self._pinned[key] = False
        else:
            del self._main[key]
            self._pinned[key] = True

    def hit_evictable(self, key: Hashable) -> None:
        frequency = self._frequency[key]  # an evictable key always has a counter
        if frequency < MAX_FREQUENCY:
            self._frequency[key] = frequency + 1
        self.removed(key)

    def hit_evictable_many(self, keys: Sequence[Hashable]) -> None:
        frequency, small, main, pinned = self._frequency, self._small, self._main, self._pinned
        for key in keys:
            count = frequency[key]
            if count < MAX_FREQUENCY:
                frequency[key] = count + 1
            if key in small:
                del small[key]
                pinned[key] = False
            else:
                del main[key]
                pinned[key] = True

    def discard(self, key: Hashable) -> None:
        del (self._small if key in self._small else self._main)[key]
        del self._frequency[key]

    def victim(self) -> Hashable | None:
        while self._small and (len(self._small) >= self.small_target or not self._main):
            key = self._small.popitem(last=False)[0]
            if self._frequency[key] == 0:
                return self._evict_to_ghost(key)
            self._frequency[key] = 0
            self._main[key] = None
        return self._evict_main()

    def _evict_to_ghost(self, key: Hashable) -> Hashable:
        del self._frequency[key]
        self._ghost[key] = None
        if len(self._ghost) > self._ghost_limit:
            self._ghost.popitem(last=False)
        return key

    def _evict_main(self) -> Hashable | None:
        main, frequency = self._main, self._frequency
        while main:
            key = main.popitem(last=False)[0]
            count = frequency[key]
            if count == 0:
                del frequency[key]
                return self._evicted_from_main(key)
            frequency[key] = count - 1
            main[key] = None
        return None

    def _evicted_from_main(self, key: Hashable) -> Hashable:
        """Hook for subclasses that remember main's victims (kvd/policies/adaptive.py)."""
        return key

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main
