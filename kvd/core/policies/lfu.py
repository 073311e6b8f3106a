"""LFU with dynamic aging (LFU-DA): least frequent first, ties by LRU, old fame fades.

Plain LFU keeps yesterday's hot blocks forever: their counts were earned once and never decay.
LFU-DA (Arlitt et al., "Evaluating content management techniques for Web proxy caches", 2000)
fixes that with an *inflation value* `L`, the priority of the last victim. A key's priority is

    priority = L_at_its_last_touch + frequency

so a key that stops being hit keeps its old priority while `L` climbs past it as the cache turns
over; a newcomer starts at `L + 1`, level with the oldest survivors. No periodic sweep over all
keys is needed, which is what lets aging stay O(1).

Why O(1): every live priority lies in `(L, L + MAX_FREQUENCY]` (victims are minima, so `L` never
passes a live key, and a touch sets `L + frequency` with frequency capped). Keys sit in one
recency-ordered bucket per priority (an `OrderedDict`, so ties go to the least recently used), and
the minimum is found by walking up from the last known minimum — at most MAX_FREQUENCY steps,
amortised far fewer since the pointer only moves up between inserts.

MAX_FREQUENCY = 64 bounds that walk and caps how long a once-hot key can outlive newcomers: 64
"generations" of cache turnover. Redis' LFU keeps an 8-bit logarithmic counter for the same reason.

Frequencies survive pins (`removed` keeps them) and are forgotten when the key is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvd.core.policies.base import TIER_PREFILL, EvictionPolicy

MAX_FREQUENCY = 64


class LFUPolicy(EvictionPolicy):
    """Least frequently used with dynamic aging; ties broken by least recently used."""

    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._frequency: dict[Hashable, int] = {}  # every cached key, evictable or pinned
        self._priority: dict[Hashable, int] = {}  # evictable keys only
        self._buckets: dict[int, OrderedDict[Hashable, None]] = {}
        self._inflation = 0  # L: priority of the last victim
        self._min_priority = 1

    def _enqueue(self, key: Hashable) -> None:
        priority = self._inflation + self._frequency[key]
        self._priority[key] = priority
        bucket = self._buckets.get(priority)
        if bucket is None:
            bucket = self._buckets[priority] = OrderedDict()
        bucket[key] = None
        if priority < self._min_priority:
            self._min_priority = priority

    def _dequeue(self, key: Hashable) -> None:
        priority = self._priority.pop(key)
        bucket = self._buckets[priority]
        del bucket[key]
        if not bucket:
            del self._buckets[priority]

    def inserted(self, key: Hashable, tier: int = TIER_PREFILL) -> None:
        self._frequency.setdefault(key, 1)
        self._enqueue(key)

    def inserted_many(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        frequency, enqueue = self._frequency, self._enqueue
        for key in keys:
            frequency.setdefault(key, 1)
            enqueue(key)

    def accessed(self, key: Hashable) -> None:
        frequency = self._frequency.get(key)
        if frequency is None:
            return  # not cached: a miss, counted when it is inserted
        self._frequency[key] = min(frequency + 1, MAX_FREQUENCY)
        if key in self._priority:
            self._dequeue(key)
            self._enqueue(key)

    def removed(self, key: Hashable) -> None:
        self._dequeue(key)

    def hit_evictable(self, key: Hashable) -> None:
        self._frequency[key] = min(self._frequency[key] + 1, MAX_FREQUENCY)
        self._dequeue(key)  # no re-queue at the new priority: the removal would undo it

    def hit_evictable_many(self, keys: Sequence[Hashable]) -> None:
        frequency, dequeue = self._frequency, self._dequeue
        for key in keys:
            frequency[key] = min(frequency[key] + 1, MAX_FREQUENCY)
            dequeue(key)

    def discard(self, key: Hashable) -> None:
        self._dequeue(key)
        del self._frequency[key]

    def forgotten(self, key: Hashable) -> None:
        self._frequency.pop(key, None)

    def victim(self) -> Hashable | None:
        if not self._priority:
            return None
        priority = self._min_priority
        while priority not in self._buckets:
            priority += 1
        bucket = self._buckets[priority]
        key = bucket.popitem(last=False)[0]
        if not bucket:
            del self._buckets[priority]
        del self._priority[key]
        del self._frequency[key]
        self._inflation = self._min_priority = priority
        return key

    def __len__(self) -> int:
        return len(self._priority)

    def __contains__(self, key: object) -> bool:
        return key in self._priority
