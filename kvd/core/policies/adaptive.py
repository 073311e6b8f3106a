"""kvd's own default policy: S3-FIFO whose small/main split is steered online by ARC's ghosts.

Theory of operation
-------------------
No classic policy wins at every pool size on LLM traces (../shared/traces/SOURCES.md, and the
table in bench/results/POLICIES.md): quick demotion (S3-FIFO, a 10% probationary queue) wins when
the pool is small, because most blocks are used once and must leave before they push out the
shared prefixes; recency and frequency (LRU, ARC, LFU) win when the pool holds most
conversations, because a conversation's next turn comes back after a long gap that a 10%
probationary queue cannot bridge. Both regimes are the same structure with a different share for
the small queue S: a tiny S is S3-FIFO's quick demotion, a large S keeps every new block for
nearly a full cache turnover before it must prove itself (a FIFO that promotes what was hit).

So kvd keeps S3-FIFO's queues and moves S's target size online with the rule ARC uses for its
T1/T2 split (Megiddo and Modha, FAST 2003), one ghost per queue:
  * a new block found in S's ghost was demoted too early → S grows by max(|GM| / |GS|, 1);
  * a new block found in M's ghost was evicted from M too early → S shrinks by max(|GS| / |GM|, 1).
Either ghost hit also admits the block straight to M (it has proven reuse).

S starts at 20% of the pool, not S3-FIFO's 10%. The paper's sensitivity study finds 5-20% equally
good, and ARC's steps are lopsided here: S's ghost always holds about a pool of keys and M's at
most that, so a growth step is 1 and a shrink step |GS| / |GM| >= 1 — a share that starts too
large is corrected at least as fast as one that starts too small, so the top of the flat range is
the cheaper error. It matters where the pool holds most conversations: S must grow to 50-70%
there, and a trace a few pool turnovers long ends before +1 steps from 10% get there
(conversation at 20k blocks: 0.975x -> 0.989x best of five, POLICIES.md).

M is LRU, not S3-FIFO's CLOCK. S3-FIFO records a hit with a 2-bit counter instead of a move, and
reinserts a counted key instead of evicting it. But in the pool every hit pins its block, and a
released block goes to its queue's new end (kvd/core/policies/base.py: the pin was a use), so in the
daemon M already moves each hit key to its tail; the counter then paid the same hit a second
time, with up to three more laps of M. kvd gives a hit in M one reward, the move (O(1)
`move_to_end`; also for a hit without a pin, as in anchor replay), which makes M ARC's T2: blocks
seen at least twice, in recency order (synthetic at 2k blocks, pool mode: 0.977x -> 0.996x best of
five). S keeps its counter: a hit there is what earns promotion, and a promoted key starts M with
it cleared, so M's counters stay 0 and its victim is always its least recent key.

The two ghosts do two jobs, and only one of them may use all of S's ghost. Admission is S3-FIFO's:
it remembers a full pool's worth of S's victims (the paper sizes it to M; tying it to S's share
instead loses 15% on conversation traffic at 5k blocks, POLICIES.md). Adaptation is ARC's, and
ARC's directory obeys |T1| + |B1| <= c: a B1 hit is evidence only because a T1 of at most the
whole cache would have kept the block. So an S-ghost hit moves the target only while
|S| + (S evictions since the block left S) < c; further back it still admits the block to M but
says nothing about S's size — no S that fits in the pool could have caught it. Counting those far
hits is what grew S to 60–70% of a 5k-block pool on conversation traffic, where a probationary
queue of a few percent wins (POLICIES.md, "kvd's adaptation"). M's ghost needs no such bound:
holding at most c keys beyond an M of at most c, it already satisfies ARC's |T2| + |B2| <= 2c.

Cost: the ghosts hold keys only, each bounded by the pool size; S's ghost stores each key's
eviction number (one int) to tell how far back it is. About two dict entries per block of
history, and O(1) per event (amortised, as S3-FIFO).

Nothing here is fitted to a trace: the start share (the top of S3-FIFO's flat range), the step
rule, the adaptation bound and M's order (ARC's), and the ghost lengths (the pool size) all come
from the two papers.
bench/hit_ratio.py measures it against the five classic policies on both Mooncake traces, and
with `--generalisation` on halves, subsamples and generated traces.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvd.core.policies.s3fifo import _native, IN_MAIN, MAX_FREQUENCY, S3FIFOPolicy, S3FIFOQueues

# S's share before any ghost evidence: the top of the 5-20% range S3-FIFO's sensitivity study finds
# flat, because ARC's steps shrink S at least as fast as they grow it (theory of operation).
START_SHARE = 0.2


class AdaptiveS3FIFOPolicy(S3FIFOPolicy):
    """S3-FIFO with ARC-style ghost adaptation of the small queue's target size and an LRU main."""

    name = "kvd"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, START_SHARE)
        self.small_target = float(self.small_target)
        self._num_small_evictions = 0
        self._loops = (None if _native is None or type(self) is not AdaptiveS3FIFOPolicy
                       else _native.bind(self.queues))  # (as S3FIFOPolicy's)

    def _make_queues(self, capacity: int) -> S3FIFOQueues:
        # S's ghost maps its victims to their eviction number; M's hits are its moves.
        return S3FIFOQueues(small=OrderedDict(), main=OrderedDict(), pinned={},
                            ghost=OrderedDict(), main_ghost=OrderedDict(), ghost_limit=capacity,
                            count_main_hits=False)

    @property
    def _main_ghost(self) -> OrderedDict[Hashable, None]:
        main_ghost = self.queues.main_ghost
        assert main_ghost is not None  # (this policy's queues always have one: _make_queues)
        return main_ghost

    def accessed(self, key: Hashable) -> None:
        if key in self.queues.main:
            self.queues.main.move_to_end(key)  # M is LRU: the move is the hit's whole reward
        else:
            packed = self.queues.pinned.get(key)
            if packed is None or not packed & IN_MAIN:  # a pinned M key moves when released
                super().accessed(key)  # a key in S: its counter earns promotion

    def hit_evictable(self, key: Hashable) -> None:
        # accessed() then removed(): an M key's move to the end would be undone by its removal
        # at once, so only S keys have a reward to keep (their counter). Not S3FIFO's one-key
        # hit_evictable_many: most lookups hit one block, and its loop's setup was half the cost.
        if self._loops is not None and self._loops.hit(key):
            return
        count = self.queues.small.pop(key, None)
        if count is None:
            self.queues.pinned[key] = self.queues.main.pop(key) | IN_MAIN
        else:  # (a branch, not min(): a builtin call per key is measurable at batch 256)
            self.queues.pinned[key] = count + 1 if count < MAX_FREQUENCY else count

    def hit_evictable_many(self, keys: Sequence[Hashable]) -> None:
        loops, position, end = self._loops, 0, len(keys)
        while position < end:
            if loops is not None:  # hit_evictable's work (M's counters are not counted here)
                position = loops.hit_run(keys, position)
                if position == end:
                    break
            self.hit_evictable(keys[position])  # (where C declines, or is not built)
            position += 1

    def victim(self) -> Hashable | None:
        if self._loops is None:
            return super().victim()
        key, self._num_small_evictions = self._loops.victim(self.small_target,
                                                            self._num_small_evictions)
        return key

    def _evict_to_ghost(self, key: Hashable) -> Hashable:
        super()._evict_to_ghost(key)
        self._num_small_evictions += 1
        self.queues.ghost[key] = self._num_small_evictions  # same position: assignment keeps order
        return key

    def _is_ghost_hit(self, key: Hashable) -> bool:
        ghost, main_ghost = self.queues.ghost, self._main_ghost
        evicted_as = ghost.get(key)
        if evicted_as is not None:
            num_since = self._num_small_evictions - evicted_as
            if len(self.queues.small) + num_since < self.capacity:  # ARC's |T1| + |B1| <= c
                step = max(len(main_ghost) / len(ghost), 1.0)
                self.small_target = min(self.capacity - 1.0, self.small_target + step)
            del ghost[key]
            return True
        if key in main_ghost:
            step = max(len(ghost) / len(main_ghost), 1.0)
            self.small_target = max(1.0, self.small_target - step)
            del main_ghost[key]
            return True
        return False

    def _evicted_from_main(self, key: Hashable) -> Hashable:
        self._main_ghost[key] = None
        if len(self._main_ghost) > self.capacity:
            self._main_ghost.popitem(last=False)
        return key
