"""Strict prefix awareness in the pool (kvd/core/pool.py, "Prefix tree"), under every policy.

A parent is never evicted before its cached children, and no cached block is ever reachable only
through an evicted parent (no stranded middles), whatever order the policy prefers.
"""

from __future__ import annotations

import random

import pytest

from kvd.errors import BadArgsError
from kvd.core.policies import POLICIES, TIER_DECODE
from kvd.core.pool import BlockPool

A, B = 1, 2
NAMES = sorted(POLICIES)


def put_chain(pool: BlockPool, keys: list[str], owner: int = A, release: bool = True) -> list[int]:
    """Look up `keys` as one chain, allocate and seal the misses with their parents."""
    hit_ids = pool.lookup(keys, owner)
    missing = keys[len(hit_ids):]
    new_ids = pool.allocate(len(missing), owner)
    assert new_ids is not None
    parents = [keys[len(hit_ids) - 1] if hit_ids else None, *missing[:-1]]
    pool.seal(new_ids, missing, owner, parents)
    if release:
        pool.release(hit_ids + new_ids, owner)
    return hit_ids + new_ids


def assert_no_stranded_middle(pool: BlockPool, chains: list[list[str]]) -> None:
    """Every cached key of a chain has every earlier key of that chain in the index too."""
    for chain in chains:
        for position, key in enumerate(chain):
            block_id = pool.find(key)
            if block_id is not None and pool.state(block_id) == "cached":
                missing = [k for k in chain[:position] if pool.find(k) is None]
                assert not missing, f"{key} is cached but its prefix {missing} is gone"


@pytest.mark.parametrize("name", NAMES)
def test_victim_with_cached_children_takes_them_along(name: str) -> None:
    pool = BlockPool(4, name)
    put_chain(pool, ["a", "b", "c"])
    pool.lookup(["a"], A)  # the head is the hottest block of the chain...
    pool.release([pool.find("a")], A)
    put_chain(pool, ["x"])
    evicted_before = pool.counters["evictions"]
    put_chain(pool, ["y"])  # ...but whatever the policy picks, no middle is left behind
    assert pool.counters["evictions"] > evicted_before
    assert_no_stranded_middle(pool, [["a", "b", "c"], ["x"], ["y"]])
    pool.check_invariants()


def test_parent_chosen_first_is_evicted_after_its_children() -> None:
    evicted: list[int] = []

    class Journal:
        def sealed(self, rows: list[tuple]) -> None:
            pass

        def evicted(self, block_id: int) -> None:
            evicted.append(block_id)

    pool = BlockPool(3, "lru", observer=Journal())
    ids = put_chain(pool, ["a", "b", "c"], release=False)
    pool.release(ids[::-1], A)  # head first: LRU would now evict the head before its children
    pool.allocate(1, B)
    assert evicted == [ids[2], ids[1], ids[0]]  # the whole chain, tail first
    assert pool.num_free == 2  # it freed more than asked: the children were unreachable
    pool.check_invariants()


def test_pinned_child_is_cut_off_and_freed_on_release() -> None:
    pool = BlockPool(3, "lru")
    ids = put_chain(pool, ["a", "b", "c"], release=False)
    pool.release(ids[::-1], A)  # head first, so LRU picks "a"
    pool.pin([ids[1]], B)  # a raw pin on the middle only: its parent stays evictable
    pool.allocate(1, A)  # evicts "a" and the unreachable "c"; "b" is pinned, so it is cut off
    assert pool.find("a") is None and pool.find("c") is None
    assert pool.state(ids[1]) == "sealed" and pool.num_free == 1
    pool.check_invariants()
    pool.release([ids[1]], B)  # unreachable: freed on its last release, never cached
    assert pool.find("b") is None and pool.num_cached == 0
    pool.check_invariants()


def test_seal_under_an_evicted_parent_is_never_cached() -> None:
    pool = BlockPool(4, "lru")
    block_ids = pool.allocate(1, A)
    pool.seal(block_ids, ["orphan"], A, parents=["gone"])
    assert pool.lookup(["orphan"], B) == block_ids  # still readable while pinned
    pool.release(block_ids, B)
    pool.release(block_ids, A)
    assert pool.find("orphan") is None and pool.num_free == 4
    pool.check_invariants()


def test_seal_without_parents_keeps_the_old_behaviour() -> None:
    pool = BlockPool(2, "lru")
    ids = pool.allocate(2, A)
    pool.seal(ids, ["a", "b"], A)
    pool.release(ids[::-1], A)  # head first: LRU evicts "a" alone, "b" stays (stranded)
    pool.allocate(1, B)
    assert pool.find("a") is None and pool.find("b") is not None
    pool.check_invariants()


def test_seal_validates_parents_and_tiers() -> None:
    pool = BlockPool(4, "lru")
    ids = pool.allocate(2, A)
    for parents, tiers in (([None], None), ([None, ["list"]], None), (None, [0]),
                           (None, [0, 2]), (None, [0, True.__class__(1) + 1])):
        with pytest.raises(BadArgsError):
            pool.seal(ids, ["a", "b"], A, parents, tiers)
        assert pool.state(ids[0]) == "owned"  # refused: nothing changed
    pool.seal(ids, ["a", "b"], A, [None, "a"], [0, TIER_DECODE])
    pool.check_invariants()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(3))
def test_random_conversations_never_strand_a_middle(name: str, seed: int) -> None:
    """Branching conversations, raw middle pins and head-first releases under pressure."""
    rng = random.Random(seed)
    pool = BlockPool(24, name)
    chains: list[list[str]] = [["sys"]]
    pinned: list[int] = []
    for step in range(400):
        base = rng.choice(chains)[: rng.randrange(1, 8)]
        chain = base + [f"{step}.{i}" for i in range(rng.randrange(1, 5))]
        chains.append(chain)
        ids = put_chain(pool, chain, release=False)
        if rng.random() < 0.1 and len(ids) > 1:
            pool.pin([ids[len(ids) // 2]], B)
            pinned.append(ids[len(ids) // 2])
        pool.release(ids if rng.random() < 0.3 else ids[::-1], A)
        if pinned and rng.random() < 0.2:
            pool.release([pinned.pop(0)], B)
        pool.check_invariants()
        assert_no_stranded_middle(pool, chains[-50:])
