"""BlockPool.restore: the journal's rows rebuild the index, the prefix tree and the tiers, and
rows that no longer describe the segment are dropped rather than guessed at."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from kvd.errors import BadArgsError
from kvd.hashing import token_bytes
from kvd.server.journal import Journal
from kvd.core.page_table import PageTable
from kvd.core.policies import POLICIES, make_policy
from kvd.core.pool import NO_PARENT, ORPHAN, BlockPool, IndexRows

BLOCK_SIZE = 4


def rows_of(*rows: tuple) -> IndexRows:
    """IndexRows from (block_id, key, generation, parent, parent_generation, tier) tuples."""
    return IndexRows(*(list(column) for column in zip(*rows))) if rows else \
        IndexRows([], [], [], [], [], [])


def snapshot(pool: BlockPool) -> tuple:
    return (pool.states(), sorted(pool.journal_rows()), pool.num_cached)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_journal_round_trip_restores_index_tree_and_tiers(tmp_path, policy):
    journal = Journal(tmp_path)
    pool = BlockPool(32, policy, observer=journal)
    owners = itertools.count(100)
    table = PageTable(pool, BLOCK_SIZE, lambda: next(owners), lambda src, dst: None)
    for start in (0, 1000):  # two chains with a forked branch, one with decode blocks
        record, _ = table.open(token_bytes(np.arange(start, start + 10)))
        table.extend(record, token_bytes([7, 7, 7, 7, 7, 7]), num_computed=10)
        table.commit(record, 16)
        table.close(table.fork(record))
        table.close(record)
    pool.allocate(20, owner=1)  # evicts some subtrees: their rows must go too
    journal.commit()

    fresh = BlockPool(32, policy, generations=pool.generations.copy())
    fresh.restore(journal.load().rows)
    journal.close()
    fresh.check_invariants()
    cached = [i for i in range(32) if pool.state(i) == "cached"]
    assert sorted(fresh.journal_rows()) == sorted(pool.journal_rows())
    assert [fresh.state(i) for i in cached] == ["cached"] * len(cached)
    assert fresh.num_cached == len(cached)


def test_a_restored_parent_takes_its_restored_children_along():
    pool = BlockPool(8, "lru")
    pool.restore(rows_of((0, b"a", 0, NO_PARENT, 0, 0), (1, b"b", 0, 0, 0, 0),
                         (2, b"c", 0, 1, 0, 0), (3, b"x", 0, NO_PARENT, 0, 0)))
    pool.allocate(4, owner=1)  # the free blocks first
    pool.allocate(1, owner=1)  # LRU victim: block 0, the oldest — with its subtree
    assert [pool.state(i) for i in range(4)] == ["owned", "free", "free", "cached"]
    pool.check_invariants()


def test_any_hashable_key_comes_back_as_the_same_object():
    keys = [b"a", ("layer", 3), (0, 1)]  # tuples too: NumPy must not unpack them
    pool = BlockPool(4, "lru")
    pool.restore(rows_of(*((i, key, 0, NO_PARENT, 0, 0) for i, key in enumerate(keys))))
    assert [pool.block_hash(i) for i in range(4)] == [*keys, None]
    assert all(pool.block_hash(i) is key for i, key in enumerate(keys))
    assert [pool.find(key) for key in keys] == [0, 1, 2]
    pool.check_invariants()


def test_rows_that_no_longer_describe_the_segment_are_dropped_with_their_descendants():
    pool = BlockPool(8, "lru")
    pool.generations[2] = 5  # block 2 was freed (and maybe reused) after its row was written
    pool.restore(rows_of(
        (0, b"a", 0, NO_PARENT, 0, 0),
        (1, b"b", 0, 0, 0, 0),
        (2, b"c", 0, NO_PARENT, 0, 0),  # stale generation: dropped
        (3, b"d", 0, 2, 0, 0),  # child of a dropped row: unreachable, dropped
        (4, b"e", 0, 0, 9, 0),  # sealed under another residency of block 0: dropped
        (5, b"f", 0, ORPHAN, 0, 0),  # orphan: dropped
        (6, b"g", 0, 4, 0, 0),  # grandchild of a dropped row: dropped
    ))
    assert [pool.state(i) for i in range(7)] == ["cached", "cached"] + ["free"] * 5
    assert pool.find(b"b") == 1 and pool.find(b"d") is None
    pool.check_invariants()


@pytest.mark.parametrize("rows", [
    rows_of((0, b"a", 0, NO_PARENT, 0, 0), (0, b"b", 0, NO_PARENT, 0, 0)),
    rows_of((0, b"a", 0, NO_PARENT, 0, 0), (1, b"a", 0, NO_PARENT, 0, 0)),
    rows_of((8, b"a", 0, NO_PARENT, 0, 0)),
    rows_of((0, b"a", 0, 8, 0, 0)),
], ids=["block twice", "key twice", "out of range", "parent out of range"])
def test_a_corrupt_journal_is_refused(rows):
    with pytest.raises(BadArgsError, match="corrupt"):
        BlockPool(8, "lru").restore(rows)


@pytest.mark.parametrize("length", [1, 2, 3, 5])
def test_a_cycle_of_parents_is_dropped_not_chased_forever(length):
    """Regression: a corrupt journal whose parent links form an odd cycle of 3 or more hung the
    pointer jumping (and so `kvd start --recover`); every row of a cycle is unreachable."""
    cycle = [(i, bytes([i]), 0, (i + 1) % length, 0, 0) for i in range(length)]
    pool = BlockPool(8, "lru")
    pool.restore(rows_of((7, b"root", 0, NO_PARENT, 0, 0), *cycle))
    assert [pool.state(i) for i in range(8)] == ["free"] * 7 + ["cached"]
    pool.check_invariants()


def test_tiers_come_back_for_a_tiered_policy():
    pool = BlockPool(8, make_policy("lru", 8, tiers="prefill=0.5,decode=0.5"))
    pool.restore(rows_of((0, b"a", 0, NO_PARENT, 0, 0), (1, b"b", 0, 0, 0, 1)))
    assert [row[5] for row in sorted(pool.journal_rows())] == [0, 1]
    pool.check_invariants()


def test_an_uncommitted_eviction_never_restores_the_new_owners_bytes(tmp_path, monkeypatch):
    """Tombstones ride with the next seal's commit; a crash before it must still not restore an
    evicted block under its old hash: the eviction bumped the block's generation first."""
    # (tests/server's folder is on sys.path only when pytest collected a file there)
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "server"))
    from test_journal import on_disk

    journal = Journal(tmp_path / "state")
    pool = BlockPool(2, "lru", observer=journal)
    old = pool.allocate(2, owner=1)
    pool.seal(old, [b"old-0", b"old-1"], owner=1)
    pool.release(old, owner=1)
    journal.commit()
    reused = pool.allocate(1, owner=2)  # evicts one; its tombstone is only buffered
    assert journal.num_seals_pending == 0 and journal.is_dirty
    crashed = on_disk(journal.state_dir)  # the daemon dies here, before any further commit
    journal.close()
    fresh = BlockPool(2, "lru", generations=pool.generations.copy())
    fresh.restore(crashed)
    assert fresh.state(reused[0]) == "free"  # dropped: the generation moved on
    assert fresh.num_cached == 1
    fresh.check_invariants()
