"""ARC: adaptive replacement between a recency list and a frequency list, steered by ghosts.

Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache" (FAST 2003).

Theory of operation
-------------------
Cached keys live in two LRU lists: T1 holds keys seen once since they were last cached, T2 keys
hit at least once more. Evicted keys leave a *ghost* (key only, no block) in B1 or B2. A target
`p` for T1's share moves with the ghosts: a miss that finds its key in B1 means "T1 was too
small, a recency cache would have hit" and raises `p`; a hit in B2 lowers it. The victim is T1's
LRU end while T1 is above `p`, else T2's. Steps are ARC's: `max(|B2| / |B1|, 1)` up,
`max(|B1| / |B2|, 1)` down, so the smaller ghost list speaks louder.

Adapting ARC to the pool's events (kvd/core/policies/base.py):
  * A pinned key is cached but not evictable; it leaves T1/T2 and remembers whether it was
    frequent. When it becomes evictable again it goes to the MRU end of T2 if it was hit since
    being cached, else T1 — a pin is a use, so MRU is where ARC would have it.
  * T1 and T2 hold evictable keys only, so the sizes ARC compares with `p` count evictable keys.
    Ghosts are bounded as in ARC: |T1| + |B1| <= c and |B1| + |B2| <= c (c = pool blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvd.core.policies.base import TIER_PREFILL, EvictionPolicy


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache over evictable keys, with B1/B2 ghost lists."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[Hashable, None] = OrderedDict()  # seen once, LRU first
        self._t2: OrderedDict[Hashable, None] = OrderedDict()  # hit again, LRU first
        self._b1: OrderedDict[Hashable, None] = OrderedDict()  # ghosts evicted from T1
        self._b2: OrderedDict[Hashable, None] = OrderedDict()  # ghosts evicted from T2
        self._pinned: dict[Hashable, bool] = {}  # cached, not evictable → is frequent
        self.target_t1 = 0.0  # ARC's p

    def inserted(self, key: Hashable, tier: int = TIER_PREFILL) -> None:
        is_frequent = self._pinned.pop(key, None)
        if is_frequent is None:
            is_frequent = self._adapt(key)
        (self._t2 if is_frequent else self._t1)[key] = None

    def inserted_many(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        # inserted() as one loop over locals, for the pool's releases.
        pinned, adapt, t1, t2 = self._pinned, self._adapt, self._t1, self._t2
        for key in keys:
            is_frequent = pinned.pop(key, None)
            if is_frequent is None:
                is_frequent = adapt(key)
            (t2 if is_frequent else t1)[key] = None

    def _adapt(self, key: Hashable) -> bool:
        """A newly cached key: move `p` if it is a ghost; return whether it goes to T2."""
        if key in self._b1:
            step = max(len(self._b2) / len(self._b1), 1.0)
            self.target_t1 = min(float(self.capacity), self.target_t1 + step)
            del self._b1[key]
            return True
        if key in self._b2:
            step = max(len(self._b1) / len(self._b2), 1.0)
            self.target_t1 = max(0.0, self.target_t1 - step)
            del self._b2[key]
            return True
        return False

    def accessed(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)
        elif key in self._pinned:
            self._pinned[key] = True

    def removed(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._pinned[key] = False
        else:
            del self._t2[key]
            self._pinned[key] = True

    def hit_evictable(self, key: Hashable) -> None:
        # The hit moves a T1 key to T2 and the removal takes it out of T2: pinned as a T2 key.
        del (self._t1 if key in self._t1 else self._t2)[key]
        self._pinned[key] = True

    def hit_evictable_many(self, keys: Sequence[Hashable]) -> None:
        t1, t2, pinned = self._t1, self._t2, self._pinned
        for key in keys:
            del (t1 if key in t1 else t2)[key]
            pinned[key] = True

    def discard(self, key: Hashable) -> None:
        del (self._t1 if key in self._t1 else self._t2)[key]

    def forgotten(self, key: Hashable) -> None:
        self._pinned.pop(key, None)

    def victim(self) -> Hashable | None:
        if self._t1 and (len(self._t1) > self.target_t1 or not self._t2):
            key = self._t1.popitem(last=False)[0]
            self._b1[key] = None
        elif self._t2:
            key = self._t2.popitem(last=False)[0]
            self._b2[key] = None
        else:
            return None
        self._trim_ghosts()
        return key

    def _trim_ghosts(self) -> None:
        # Each victim adds one ghost, so these loops run O(1) times amortised.
        while self._b1 and len(self._t1) + len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        while len(self._b1) + len(self._b2) > self.capacity:
            (self._b2 or self._b1).popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
