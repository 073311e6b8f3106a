"""kvd.core.page_table.PageTable over a real BlockPool, no daemon: open/commit/extend/fork/close.

Every test ends with `check_invariants()`; the failure tests compare a full snapshot of the pool
(states, pins per owner, index) before and after to show a refused call changed nothing.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvd.errors import BadArgsError, NoSpaceError
from kvd.hashing import hash_blocks, token_bytes
from kvd.core.page_table import (
    HOLE, PageTable, extend_spanning, fork_spanning, open_spanning,
)
from kvd.core.pool import BlockPool

BLOCK_SIZE = 4


class Harness:
    """A pool, a page table over it and a fake block store the copy callback writes to."""

    def __init__(self, num_blocks: int = 16, policy: str = "lru") -> None:
        self.pool = BlockPool(num_blocks, policy)
        self.store = np.zeros((num_blocks, 8), dtype=np.int64)
        self.copies: list[tuple[int, int]] = []
        owners = itertools.count(1000)
        self.table = PageTable(self.pool, BLOCK_SIZE, lambda: next(owners), self._copy)

    def _copy(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))
        self.store[dst] = self.store[src]

    def snapshot(self) -> tuple:
        pool = self.pool
        return (pool.stats()["free"], pool.num_owned, pool.num_sealed, pool.num_cached,
                [pool.state(i) for i in range(pool.num_blocks)],
                [pool.ref_count(i) for i in range(pool.num_blocks)],
                {owner: pool.holdings(owner) for owner in pool.owners()},
                sorted(self.table.sequences))


def tokens(n: int, start: int = 0) -> bytes:
    return token_bytes(np.arange(start, start + n))


@pytest.fixture
def h() -> Harness:
    harness = Harness()
    yield harness
    harness.pool.check_invariants()


def test_open_allocates_every_block_and_caches_nothing_on_a_cold_pool(h):
    record, num_cached = h.table.open(tokens(10))
    assert num_cached == 0
    assert len(record.block_ids) == 3  # ceil(10 / 4)
    assert {h.pool.state(b) for b in record.block_ids} == {"owned"}
    assert record.num_tokens == 10 and record.num_sealed == 0
    assert h.table.counters == {"opened": 1, "prompt_tokens": 10, "cached_tokens": 0}


def test_commit_seals_full_blocks_under_the_chained_content_hash(h):
    record, _ = h.table.open(tokens(10), salt=b"s")
    assert h.table.commit(record, 9) == 2
    assert record.hashes == hash_blocks(np.arange(10), BLOCK_SIZE, salt=b"s")
    assert [h.pool.state(b) for b in record.block_ids] == ["sealed", "sealed", "owned"]
    assert h.table.commit(record, 9) == 0  # idempotent
    assert h.pool.block_hash(record.block_ids[1]) == record.hashes[1]


def test_commit_rejects_num_computed_outside_the_sequence(h):
    record, _ = h.table.open(tokens(5))
    before = h.snapshot()
    for bad in (-1, 6):
        with pytest.raises(BadArgsError):
            h.table.commit(record, bad)
    assert h.snapshot() == before


def test_reopen_reuses_the_prefix_but_leaves_the_last_token_to_compute(h):
    first, _ = h.table.open(tokens(12))
    h.table.commit(first, 12)
    h.table.close(first)
    assert h.pool.num_cached == 3
    again, num_cached = h.table.open(tokens(12))
    # 12 tokens = 3 full blocks, but the last token's logits are needed: only 2 blocks reused.
    assert num_cached == 8
    assert again.block_ids[:2] == first.block_ids[:2]
    assert again.num_sealed == 2
    assert h.pool.state(again.block_ids[2]) == "owned"
    assert h.table.counters["cached_tokens"] == 8


@pytest.mark.parametrize("cap, expected", [(0, 0), (5, 4), (8, 8), (100, 12)])
def test_max_cached_tokens_caps_the_reused_prefix(h, cap, expected):
    first, _ = h.table.open(tokens(12))
    h.table.commit(first, 12)
    h.table.close(first)
    record, num_cached = h.table.open(tokens(12), max_cached_tokens=cap)
    assert num_cached == expected
    assert record.block_ids[: expected // BLOCK_SIZE] == first.block_ids[: expected // BLOCK_SIZE]
    assert len(record.block_ids) == 3


def test_salt_namespaces_the_prefix_cache(h):
    first, _ = h.table.open(tokens(9), salt=b"tenant-a")
    h.table.commit(first, 9)
    h.table.close(first)
    _, hits_b = h.table.open(tokens(9), salt=b"tenant-b")
    _, hits_a = h.table.open(tokens(9), salt=b"tenant-a")
    assert (hits_b, hits_a) == (0, 8)


def test_open_needs_a_token(h):
    with pytest.raises(BadArgsError):
        h.table.open(b"")


def test_extend_commits_then_allocates_only_across_block_boundaries(h):
    record, _ = h.table.open(tokens(3))
    assert h.table.extend(record, tokens(1, 3), num_computed=3) == []  # 4 tokens: still 1 block
    new = h.table.extend(record, tokens(1, 4), num_computed=4)  # block 0 full and computed
    assert len(new) == 1 and record.block_ids[1] == new[0]
    assert record.num_tokens == 5 and record.num_sealed == 1
    assert record.hashes == hash_blocks(np.arange(4), BLOCK_SIZE)


def test_no_space_on_open_leaves_nothing_pinned_not_even_the_prefix_hits(h):
    first, _ = h.table.open(tokens(9))
    h.table.commit(first, 9)
    h.table.close(first)  # 2 cached, 14 free
    hog = h.pool.allocate(13, owner=1)
    before = h.snapshot()
    with pytest.raises(NoSpaceError, match="need 3 blocks but only 1 "):
        h.table.open(tokens(17))  # 2 hits + 3 new blocks, only 1 free
    assert h.snapshot() == before
    h.pool.release(hog, owner=1)


def test_no_space_on_extend_appends_nothing(h):
    record, _ = h.table.open(tokens(4))
    hog = h.pool.allocate(15, owner=1)
    with pytest.raises(NoSpaceError):
        h.table.extend(record, tokens(1, 4), num_computed=0)
    assert record.num_tokens == 4 and len(record.block_ids) == 1
    h.pool.release(hog, owner=1)


def test_no_space_on_extend_seals_nothing_either(h):
    record, _ = h.table.open(tokens(4))
    hog = h.pool.allocate(15, owner=1)
    before = h.snapshot()
    with pytest.raises(NoSpaceError):
        h.table.extend(record, tokens(1, 4), num_computed=4)  # would seal the full block
    assert h.snapshot() == before and record.num_sealed == 0
    h.pool.release(hog, owner=1)


def test_fork_shares_sealed_blocks_and_copies_unsealed_ones(h):
    parent, _ = h.table.open(tokens(10))
    h.store[parent.block_ids] = np.arange(3)[:, None] + 1
    h.table.commit(parent, 10)  # blocks 0, 1 sealed; block 2 (2 tokens) private
    child = h.table.fork(parent)
    assert child.block_ids[:2] == parent.block_ids[:2]
    assert child.block_ids[2] != parent.block_ids[2]
    assert h.copies == [(parent.block_ids[2], child.block_ids[2])]
    assert (h.store[child.block_ids[2]] == 3).all()
    # Shared copy-on-write: pinned once, by the run both sequences now start with.
    assert child.run is parent.run and child.run.block_ids == parent.block_ids[:2]
    assert [h.pool.ref_count(b) for b in parent.block_ids[:2]] == [1, 1]
    assert h.pool.holdings(parent.run.owner) == {b: 1 for b in parent.block_ids[:2]}
    assert child.hashes == parent.hashes and bytes(child.tokens) == bytes(parent.tokens)
    h.table.close(parent)
    assert [h.pool.state(b) for b in child.block_ids] == ["sealed", "sealed", "owned"]
    h.table.close(child)
    assert h.pool.num_cached == 2 and h.pool.num_owned == 0


def test_no_space_on_fork_changes_nothing(h):
    parent, _ = h.table.open(tokens(6))
    h.table.commit(parent, 6)
    hog = h.pool.allocate(14, owner=1)
    before = h.snapshot()
    with pytest.raises(NoSpaceError):
        h.table.fork(parent)
    assert h.snapshot() == before
    h.pool.release(hog, owner=1)


def test_close_releases_tail_first_so_the_chain_tail_is_evicted_first():
    h = Harness(num_blocks=4, policy="lru")
    record, _ = h.table.open(tokens(12))
    h.table.commit(record, 12)
    hashes = list(record.hashes)
    h.table.close(record)
    h.pool.allocate(2, owner=1)  # 1 free + 1 eviction
    assert h.pool.find(hashes[2]) is None
    assert h.pool.find(hashes[0]) is not None and h.pool.find(hashes[1]) is not None
    h.pool.check_invariants()


def test_forks_of_forks_share_one_chain_and_release_it_after_the_last_sequence(h):
    parent, _ = h.table.open(tokens(6))
    h.table.commit(parent, 6)  # block 0 sealed, block 1 (2 tokens) private
    child = h.table.fork(parent)
    h.table.extend(child, tokens(3, start=6), 6)  # grows to block 2
    h.table.commit(child, 8)  # seals its block 1
    grandchild = h.table.fork(child)
    assert grandchild.run.parent is parent.run and len(h.table.runs) == 2
    assert grandchild.block_ids[:2] == child.block_ids[:2]
    assert bytes(grandchild.tokens) == bytes(child.tokens) == tokens(9)
    assert grandchild.hashes == child.hashes == hash_blocks(np.arange(8), BLOCK_SIZE)
    h.table.commit(grandchild, 9)  # nothing new: block 2 holds a token only
    assert h.table.extend(grandchild, tokens(3, start=9), 9) == []
    assert h.table.commit(grandchild, 12) == 1
    assert grandchild.hashes == hash_blocks(np.arange(12), BLOCK_SIZE)
    for record in (parent, child, grandchild):
        h.table.close(record)
    assert h.table.runs == {} and h.table.num_pins == 0 and h.pool.owners() == []
    assert h.pool.num_owned == 0 and h.pool.num_cached == 3


def test_a_fork_copies_no_table_and_takes_no_pin_on_the_sealed_head():
    h = Harness(num_blocks=1100)
    parent, _ = h.table.open(tokens(4 * 1000 + 1))
    h.table.commit(parent, parent.num_tokens)
    first = h.table.fork(parent)
    num_pins = h.table.num_pins
    children = [h.table.fork(parent) for _ in range(50)]
    assert h.table.num_pins == num_pins + 50  # each: one copy of the 1-token tail block
    assert all(c.run is first.run and len(c.own_tokens) == 4 for c in children)
    for record in (parent, first, *children):
        h.table.close(record)
    h.pool.check_invariants()


def test_deferred_close_releases_tail_first_in_bounded_steps():
    h = Harness(num_blocks=8, policy="lru")
    record, _ = h.table.open(tokens(24))
    h.table.commit(record, 24)
    hashes = record.hashes
    h.table.close(record, is_deferred=True)
    assert h.pool.num_sealed == 6 and h.table.num_deferred == 6
    assert h.table.owners() == {record.owner}
    for remaining in (4, 2, 0):
        h.table.release_deferred(2)
        assert h.table.num_deferred == remaining
    assert h.pool.num_cached == 6 and h.table.owners() == set()
    h.pool.allocate(3, owner=1)  # 2 free + 1 eviction: the chain's tail goes first
    assert h.pool.find(hashes[5]) is None and h.pool.find(hashes[4]) is not None


def _spanning_pair(num_window_blocks: int) -> tuple[Harness, Harness]:
    full, window = Harness(16), Harness(num_window_blocks)
    window.table = PageTable(window.pool, BLOCK_SIZE, lambda: 0, window._copy, window=6)
    return full, window


def test_a_spanning_open_or_extend_without_room_in_one_pool_changes_nothing():
    full, window = _spanning_pair(num_window_blocks=3)
    tables = [full.table, window.table]
    before = (full.snapshot(), window.snapshot())
    with pytest.raises(NoSpaceError):
        open_spanning(tables, 7, token_bytes(list(range(17))), b"", None)  # 5 blocks; 3 there
    assert (full.snapshot(), window.snapshot()) == before and not window.table.sequences
    records, num_cached = open_spanning(tables, 7, token_bytes(list(range(9))), b"", None)
    assert num_cached == 0 and [len(r.block_ids) for r in records] == [3, 3]
    before = (full.snapshot(), window.snapshot())
    with pytest.raises(NoSpaceError):  # 4 more tokens: a 4th block, none free in the window pool
        extend_spanning(tables, records, token_bytes([1, 2, 3, 4]), 9)
    assert (full.snapshot(), window.snapshot()) == before
    # Committing 9 of them released block 0 of the window pool (wholly before 9 - 6 + 1 = 4).
    assert extend_spanning(tables, records, token_bytes([1]), 9) == [[], []]
    assert records[1].block_ids[0] == HOLE and records[1].num_released == 1
    assert window.pool.state(0) == "cached"
    children = fork_spanning(tables, records, 8)
    assert children[1].block_ids[0] == HOLE
    for table, record in [*zip(tables, records), *zip(tables, children)]:
        table.close(record)
    assert full.table.num_pins == window.table.num_pins == 0
    full.pool.check_invariants()
    window.pool.check_invariants()
