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
Every queue is an `OrderedDict` (O(1) append and pop-oldest), all of them in one `S3FIFOQueues`
object; reinsertions are amortised against the hits that earned them (at most 3 per hit), so a
victim is O(1) amortised.

Adapting to the pool's events (kvd/core/policies/base.py): a pinned key leaves its queue and keeps its
counter and its queue; when it becomes evictable again it is appended to that queue's new end
(the pin was a use; FIFO position cannot be restored in O(1)). A key promoted from S starts M with
its counter cleared: its S hit paid for the promotion.

The batch events (`inserted_many`, `hit_evictable_many`) run in kvd/core/policies/_s3fifo.c, which
binds the policy's S3FIFOQueues once, for the keys without a rule of their own (no ghost hit),
interleaved with the Python loop here, and so does `victim`; the Python is their specification
and their fallback (KVD_PURE_PYTHON=1, a build without the module, or a subclass, whose hooks the
C would skip). The pool reaches them through the policy's methods only. What the C buys: the pool
ops at batch 16 and 256 with and without it (`python -m bench.pool_ab --base python` turns off
both the pool's C and this).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, ClassVar

from kvd.core.policies.base import TIER_PREFILL, EvictionPolicy
from kvd import native

_built_loops = native.built("s3fifo")  # (twin tests bind it directly)
_native = native.load("s3fifo")  # kvd/core/policies/_s3fifo.c, or None where the Python runs alone

SMALL_SHARE = 0.1  # the paper's default share of S; its sensitivity study finds 5-20% flat
MAX_FREQUENCY = 3  # two bits, as in the paper
COUNTER, IN_MAIN = 0b011, 0b100  # a pinned key's entry: its counter, and whether it left M


@dataclass(frozen=True, slots=True)
class S3FIFOQueues:
    """The queues of S3-FIFO and of kvd's policy: the contract between kvd/core/policies/s3fifo.py
    (and adaptive.py) and kvd/core/policies/_s3fifo.c, which binds them once.

        small        OrderedDict key → counter (0..MAX_FREQUENCY), oldest first: S
        main         OrderedDict key → counter, oldest first: M
        pinned       dict key → counter | IN_MAIN (if it left M): cached keys pinned again
        ghost        OrderedDict key → None, or (kvd's policy) its S eviction number: S's victims
        main_ghost   OrderedDict key → None of M's victims (kvd's policy), or None (S3-FIFO)
        ghost_limit  how many keys each ghost keeps
        count_main_hits  whether a hit in M bumps its counter (S3-FIFO) or not (kvd's policy)
    Frozen: no queue is ever replaced (`restored` fills S in place).
    """

    IN_MAIN: ClassVar[int] = IN_MAIN
    MAX_FREQUENCY: ClassVar[int] = MAX_FREQUENCY
    small: OrderedDict[Hashable, int]
    main: OrderedDict[Hashable, int]
    pinned: dict[Hashable, int]
    ghost: OrderedDict[Hashable, Any]
    main_ghost: OrderedDict[Hashable, None] | None
    ghost_limit: int
    count_main_hits: bool


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO with quick demotion from a small queue and a ghost queue the size of main."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_share: float = SMALL_SHARE) -> None:
        super().__init__(capacity)
        if not 0.0 < small_share < 1.0:
            raise ValueError(f"small_share must be in (0, 1), got {small_share}")
        self.small_target: float = max(1, round(capacity * small_share))
        # Each cached key's counter lives where the key is: S and M map key → counter (oldest
        # first), and a pinned key's entry packs its counter with IN_MAIN if it left M.
        self.queues = self._make_queues(capacity)
        # kvd/core/policies/_s3fifo.c bound to the queues, or None (the Python alone; twin tests
        # set it). A subclass may change the hooks the C stands in for: it runs Python.
        self._loops = (None if _native is None or type(self) is not S3FIFOPolicy
                       else _native.bind(self.queues))

    def _make_queues(self, capacity: int) -> S3FIFOQueues:
        return S3FIFOQueues(small=OrderedDict(), main=OrderedDict(), pinned={},
                            ghost=OrderedDict(), main_ghost=None,
                            ghost_limit=max(1, capacity - round(self.small_target)),
                            count_main_hits=True)

    def inserted(self, key: Hashable, tier: int = TIER_PREFILL) -> None:
        # A key pinned while cached goes back to its queue with its counter, a new one to M if
        # it is a ghost hit, else to S unhit.
        if self._loops is not None and self._loops.insert(key):  # (the C does all but a ghost hit)
            return
        queues = self.queues
        packed = queues.pinned.pop(key, None)
        if packed is None:
            (queues.main if self._is_ghost_hit(key) else queues.small)[key] = 0
        else:
            (queues.main if packed & IN_MAIN else queues.small)[key] = packed & COUNTER

    def inserted_many(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        # inserted() as one loop over locals, for the pool's releases (routing single inserts
        # through here instead measured slower per policy event, bench/policies.py).
        queues, is_ghost_hit = self.queues, self._is_ghost_hit
        pinned, main, small = queues.pinned, queues.main, queues.small
        loops, position, end = self._loops, 0, len(keys)
        while position < end:
            if loops is not None:  # every key up to a ghost hit
                position = loops.insert_run(keys, position)
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
        if self.queues.small or self.queues.main or self.queues.pinned:
            raise ValueError("restored() needs a policy that tracks nothing yet")
        self.queues.small.update(zip(keys, repeat(0)))

    def _is_ghost_hit(self, key: Hashable) -> bool:
        """A newly cached key: whether it left S unhit recently (then it goes to M)."""
        if key not in self.queues.ghost:
            return False
        del self.queues.ghost[key]
        return True

    def accessed(self, key: Hashable) -> None:
        # (assigning to a key an OrderedDict holds keeps its position)
        for queue in (self.queues.small, self.queues.main):
            count = queue.get(key)
            if count is not None:
                if count < MAX_FREQUENCY:
                    queue[key] = count + 1
                return
        packed = self.queues.pinned.get(key)
        if packed is not None and packed & COUNTER < MAX_FREQUENCY:
            self.queues.pinned[key] = packed + 1

    def removed(self, key: Hashable) -> None:
        count = self.queues.small.pop(key, None)
        self.queues.pinned[key] = self.queues.main.pop(key) | IN_MAIN if count is None else count

    def hit_evictable(self, key: Hashable) -> None:
        if self._loops is None or not self._loops.hit(key):
            self.hit_evictable_many((key,))  # (a tuple: the Python loop)

    def hit_evictable_many(self, keys: Sequence[Hashable]) -> None:
        small, main, pinned = self.queues.small, self.queues.main, self.queues.pinned
        loops, position, end = self._loops, 0, len(keys)
        while position < end:
            if loops is not None:  # every key up to one it leaves to this loop
                position = loops.hit_run(keys, position)
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
        if self.queues.small.pop(key, None) is None:
            del self.queues.main[key]

    def forgotten(self, key: Hashable) -> None:
        self.queues.pinned.pop(key, None)

    def victim(self) -> Hashable | None:
        if self._loops is not None:
            return self._loops.victim(self.small_target, 0)[0]
        small, main = self.queues.small, self.queues.main
        while small and (len(small) >= self.small_target or not main):
            key, count = small.popitem(last=False)
            if count == 0:
                return self._evict_to_ghost(key)
            main[key] = 0
        return self._evict_main()

    def _evict_to_ghost(self, key: Hashable) -> Hashable:
        ghost = self.queues.ghost
        ghost[key] = None
        if len(ghost) > self.queues.ghost_limit:
            ghost.popitem(last=False)
        return key

    def _evict_main(self) -> Hashable | None:
        main = self.queues.main
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
        return len(self.queues.small) + len(self.queues.main)

    def __contains__(self, key: object) -> bool:
        return key in self.queues.small or key in self.queues.main
