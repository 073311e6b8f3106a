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

Hits only bump a counter (capped at 3), so a hit costs one dict store and no list surgery. The
counter is the key's value in its queue (or in the table of pinned keys), not an entry in a table
of its own: one table fewer to touch per event, which is what a batch's events cost in a pool of
many thousand keys (bench/pool_ab.py).
Every queue is an `OrderedDict` (O(1) append and pop-oldest); reinsertions are amortised
against the hits that earned them (at most 3 per hit), so a victim is O(1) amortised.

Adapting to the pool's events (kvd/core/policies/base.py): a pinned key leaves its queue and keeps its
counter and its queue; when it becomes evictable again it is appended to that queue's new end
(the pin was a use; FIFO position cannot be restored in O(1)). A key promoted from S starts M with
its counter cleared: its S hit paid for the promotion.

The batch events (`inserted_many`, `hit_evictable_many`) run in kvd/core/policies/_s3fifo.c for the
keys without a rule of their own (no ghost hit), interleaved with the Python loop here, and so
does `victim`; the Python is their specification and their fallback (KVD_PURE_PYTHON=1, a build
without the module, or a subclass, whose hooks the C would skip).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvd.core.policies.base import TIER_PREFILL, EvictionPolicy
from kvd import native

_built_loops = native.built("s3fifo")  # (twin tests call it directly)
# Each policy's `_loops` (tests give a twin None).
_loops = native.load("s3fifo")

SMALL_SHARE = 0.1  # the paper's default share of S; its sensitivity study finds 5-20% flat
MAX_FREQUENCY = 3  # two bits, as in the paper
COUNTER, IN_MAIN = 0b011, 0b100  # a pinned key's entry: its counter, and whether it left M


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO with quick demotion from a small queue and a ghost queue the size of main."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_share: float = SMALL_SHARE) -> None:
        super().__init__(capacity)
        if not 0.0 < small_share < 1.0:
            raise ValueError(f"small_share must be in (0, 1), got {small_share}")
        self.small_target = max(1, round(capacity * small_share))
        self._ghost_limit = max(1, capacity - self.small_target)
        # Each cached key's counter lives where the key is: S and M map key → counter (oldest
        # first), and a pinned key's entry packs its counter with IN_MAIN if it left M.
        self._small: OrderedDict[Hashable, int] = OrderedDict()
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._pinned: dict[Hashable, int] = {}  # cached, not evictable
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        # (a subclass may change the hooks the C loops stand in for: it runs Python)
        self._loops = _loops if type(self) is S3FIFOPolicy else None
        self.c_events = self._c_events(count_main_hits=True)

    def inserted(self, key: Hashable, tier: int = TIER_PREFILL) -> None:
        # A key pinned while cached goes back to its queue with its counter, a new one to M if
        # it is a ghost hit, else to S unhit.
        packed = self._pinned.pop(key, None)
        if packed is None:
            (self._main if self._is_ghost_hit(key) else self._small)[key] = 0
        else:
            (self._main if packed & IN_MAIN else self._small)[key] = packed & COUNTER

    def inserted_many(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        # inserted() as one loop over locals, for the pool's releases (routing single inserts
        # through here instead measured slower per policy event, bench/policies.py).
        pinned, is_ghost_hit, main, small = self._pinned, self._is_ghost_hit, self._main, self._small
        loops, position, end = self._loops, 0, len(keys)
        while position < end:
            if loops is not None:  # every key up to a ghost hit
                position = loops.insert_run(keys, position, pinned, small, main, self._ghosts(),
                                            IN_MAIN)
                if position == end:
                    break
            key = keys[position]
            position += 1
            packed = pinned.pop(key, None)
            if packed is None:
                (main if is_ghost_hit(key) else small)[key] = 0
            elif packed & IN_MAIN:
                main[key] = packed ^ IN_MAIN
            else:
                small[key] = packed

    def restored(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        # A fresh policy has no ghosts, so every key enters S unhit, as `inserted` would do it.
        if self._small or self._main or self._pinned:
            raise ValueError("restored() needs a policy that tracks nothing yet")
        self._small = OrderedDict.fromkeys(keys, 0)
        if self.c_events is not None:  # (the queues it names: S is a new one)
            self.c_events = (self._pinned, self._small, *self.c_events[2:])

    def _c_events(self, count_main_hits: bool) -> tuple | None:
        """`c_events` (kvd/core/policies/base.py): these queues, where the C loops run."""
        if self._loops is None:
            return None
        return (self._pinned, self._small, self._main, self._ghosts(), IN_MAIN, MAX_FREQUENCY,
                count_main_hits)

    def _ghosts(self) -> tuple[OrderedDict, ...]:
        """The ghosts whose keys `_is_ghost_hit` must see (the C loop stops at them)."""
        return (self._ghost,)

    def _is_ghost_hit(self, key: Hashable) -> bool:
        """A newly cached key: whether it left S unhit recently (then it goes to M)."""
        if key not in self._ghost:
            return False
        del self._ghost[key]
        return True

    def accessed(self, key: Hashable) -> None:
        # (assigning to a key an OrderedDict holds keeps its position)
        for queue in (self._small, self._main):
            count = queue.get(key)
            if count is not None:
                if count < MAX_FREQUENCY:
                    queue[key] = count + 1
                return
        packed = self._pinned.get(key)
        if packed is not None and packed & COUNTER < MAX_FREQUENCY:
            self._pinned[key] = packed + 1

    def removed(self, key: Hashable) -> None:
        count = self._small.pop(key, None)
        self._pinned[key] = self._main.pop(key) | IN_MAIN if count is None else count

    def hit_evictable(self, key: Hashable) -> None:
        self.hit_evictable_many((key,))

    def hit_evictable_many(self, keys: Sequence[Hashable]) -> None:
        small, main, pinned = self._small, self._main, self._pinned
        loops, position, end = self._loops, 0, len(keys)
        while position < end:
            if loops is not None:
                position = loops.hit_run(keys, position, small, main, pinned, IN_MAIN,
                                         MAX_FREQUENCY, True)
                if position == end:
                    break
            key = keys[position]
            position += 1
            count = small.pop(key, None)
            packed = IN_MAIN
            if count is None:
                count = main.pop(key)
            else:
                packed = 0
            pinned[key] = packed | (count + 1 if count < MAX_FREQUENCY else count)

    def discard(self, key: Hashable) -> None:
        if self._small.pop(key, None) is None:
            del self._main[key]

    def forgotten(self, key: Hashable) -> None:
        self._pinned.pop(key, None)

    def victim(self) -> Hashable | None:
        if self._loops is not None:
            return self._loops.victim(self._small, self._main, self._ghost, None,
                                      self.small_target, self._ghost_limit, 0)[0]
        while self._small and (len(self._small) >= self.small_target or not self._main):
            key, count = self._small.popitem(last=False)
            if count == 0:
                return self._evict_to_ghost(key)
            self._main[key] = 0
        return self._evict_main()

    def _evict_to_ghost(self, key: Hashable) -> Hashable:
        self._ghost[key] = None
        if len(self._ghost) > self._ghost_limit:
            self._ghost.popitem(last=False)
        return key

    def _evict_main(self) -> Hashable | None:
        main = self._main
        while main:
            key, count = main.popitem(last=False)
            if count == 0:
                return self._evicted_from_main(key)
            main[key] = count - 1
        return None

    def _evicted_from_main(self, key: Hashable) -> Hashable:
        """Hook for subclasses that remember main's victims (kvd/core/policies/adaptive.py)."""
        return key

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main
