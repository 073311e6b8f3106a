"""kvd's own default policy: S3-FIFO whose small/main split is steered online by ARC's ghosts.

Theory of operation
-------------------
No classic policy wins at every pool size on LLM traces (../shared/traces/SOURCES.md, and the
table in bench/hit_ratio.py): quick demotion (S3-FIFO, a 10% probationary queue) wins when the
pool is small, because most blocks are used once and must leave before they push out the shared
prefixes; recency and frequency (LRU, ARC, LFU) win when the pool holds most conversations,
because a conversation's next turn comes back after a long gap that a 10% probationary queue
cannot bridge. Both regimes are the same structure with a different share for the small queue S:
a tiny S is S3-FIFO's quick demotion, a large S keeps every new block for nearly a full cache
turnover before it must prove itself (a CLOCK-like FIFO with reinsertion).

So kvd keeps S3-FIFO's queues and moves S's target size online with the rule ARC uses for its
T1/T2 split (Megiddo and Modha, FAST 2003), one ghost per queue:
  * a new block found in S's ghost was demoted too early → S grows by max(|GM| / |GS|, 1);
  * a new block found in M's ghost was evicted from M too early → S shrinks by max(|GS| / |GM|, 1).
Either ghost hit also admits the block straight to M (it has proven reuse). The ghosts hold keys
only, each bounded by the pool size, so the policy costs about two dict entries per block of
history and stays O(1) per event (amortised, as S3-FIFO).

Nothing here is fitted to a trace: the start share (S3-FIFO's 10%), the step rule (ARC's) and the
ghost bounds (the pool size) all come from the two papers. bench/hit_ratio.py measures it against
the five classic policies on both Mooncake traces.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from kvd.policies.s3fifo import S3FIFOPolicy


class AdaptiveS3FIFOPolicy(S3FIFOPolicy):
    """S3-FIFO with ARC-style ghost adaptation of the small queue's target size."""

    name = "kvd"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small_target = float(self.small_target)
        self._ghost_limit = capacity
        self._main_ghost: OrderedDict[Hashable, None] = OrderedDict()

    def _is_ghost_hit(self, key: Hashable) -> bool:
        if key in self._ghost:
            step = max(len(self._main_ghost) / len(self._ghost), 1.0)
            self.small_target = min(self.capacity - 1.0, self.small_target + step)
            del self._ghost[key]
            return True
        if key in self._main_ghost:
            step = max(len(self._ghost) / len(self._main_ghost), 1.0)
            self.small_target = max(1.0, self.small_target - step)
            del self._main_ghost[key]
            return True
        return False

    def _evicted_from_main(self, key: Hashable) -> Hashable:
        self._main_ghost[key] = None
        if len(self._main_ghost) > self.capacity:
            self._main_ghost.popitem(last=False)
        return key
