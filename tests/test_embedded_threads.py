"""kvd.PagedKVCache shared by threads (issue 30, item 1): every public method at once, every policy.

Eight threads run random allocate / get / hold (write, check) / release / stats / check_invariants
on a pool so small that every allocation evicts, with a tiny switch interval so threads interleave
inside the pool's methods. Each thread holds at most one block, its own pair, and checks that what
it wrote through the held block is what it reads back, however much the others evict.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import kvd
from conftest import run_threads
from kvd import PagedKVCache
from kvd.core.policies import POLICIES

NUM_THREADS = 8
NUM_OPS = 1500
NUM_BLOCKS = 16  # 8 holds at most: the other 8 keep every allocation evicting
NUM_SHARED_POSITIONS = 64  # pairs every thread allocates and gets (x 2 layers: 8x the pool)


class Worker:
    """One thread's random ops; its held pair is (layer 1, 1000 + index), written with `mark`."""

    def __init__(self, cache: PagedKVCache, index: int) -> None:
        self.cache, self.rng = cache, random.Random(index)
        self.pair = (1, 1000 + index)
        self.held: kvd.Block | None = None
        self.mark = 0.0

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.35:
            block_id = self.cache.allocate_block(*self.shared_pair())
            assert 0 <= block_id < NUM_BLOCKS
        elif op < 0.6:
            block = self.cache.get_block(*self.shared_pair())
            assert block is None or 0 <= block.block_id < NUM_BLOCKS
        elif op < 0.75:
            self.hold_or_release()
        elif op < 0.9:
            self.check_held()
        elif op < 0.97:
            stats = self.cache.stats()
            assert stats["used_blocks"] + stats["free_blocks"] == NUM_BLOCKS
            assert stats["held_blocks"] <= NUM_THREADS
        else:
            self.cache.check_invariants()

    def shared_pair(self) -> tuple[int, int]:
        return self.rng.randrange(2), self.rng.randrange(NUM_SHARED_POSITIONS)

    def hold_or_release(self) -> None:
        if self.held is None:
            self.held = self.cache.hold_block(*self.pair)
            self.mark += 1.0
            self.held.keys[:] = self.mark
            self.held.values[:] = -self.mark
        else:
            self.check_held()
            self.cache.release_block(*self.pair)
            self.held = None

    def check_held(self) -> None:
        if self.held is None:
            return
        again = self.cache.get_block(*self.pair)
        assert again is not None and again.block_id == self.held.block_id, "a held block moved"
        assert np.all(again.keys == self.mark) and np.all(again.values == -self.mark), (
            "a held block's data changed under its holder")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_eight_threads_of_random_ops_keep_the_pool_whole_and_held_data_intact(policy,
                                                                            fine_switching):
    cache = PagedKVCache(num_blocks=NUM_BLOCKS, num_layers=2, block_size=2, head_dim=4,
                         eviction_policy=policy)
    workers = [Worker(cache, index) for index in range(NUM_THREADS)]

    def work(index: int) -> None:
        worker = workers[index]
        for _ in range(NUM_OPS):
            worker.step()
        worker.check_held()

    run_threads(work, NUM_THREADS)
    cache.check_invariants()
    stats = cache.stats()
    assert stats["held_blocks"] == sum(worker.held is not None for worker in workers)
    assert stats["evictions"] > NUM_THREADS * NUM_OPS // 10  # the pool really was contended
    assert stats["hits"] + stats["misses"] > 0


def test_counters_add_up_across_threads(fine_switching):
    cache = PagedKVCache(num_blocks=4, num_layers=1, block_size=1, head_dim=1)
    cache.allocate_block(0, 0)

    def get_many(index: int) -> None:
        for _ in range(500):
            cache.get_block(0, 0)
            cache.get_block(0, 1 + index)

    run_threads(get_many, NUM_THREADS)
    stats = cache.stats()
    assert (stats["hits"], stats["misses"]) == (NUM_THREADS * 500, NUM_THREADS * 500)
