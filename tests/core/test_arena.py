"""kvd.core.arena: slabs shared by pools of different block sizes, memory moving to demand.

Every step checks the arena's invariants (each pool's, plus slab ownership), and the pools run
with their C loops where built (tests/native runs the Python alone under KVD_PURE_PYTHON=1).
"""

from __future__ import annotations

import random

import pytest

from kvd.core.arena import Arena, GhostPolicy, choose_slab_nbytes
from kvd.core.policies import POLICIES, make_policy
from kvd.errors import BadArgsError

A, B = 1, 2  # owners (sessions)


def fill(pool, keys, owner=A, parents=True):
    """Allocate, seal (as one chain when `parents`) and release one block per key."""
    block_ids = pool.allocate(len(keys), owner)
    assert block_ids is not None
    pool.seal(block_ids, keys, owner,
              [None, *keys[:-1]] if parents else None)
    pool.release(block_ids, owner)
    return block_ids


def test_slab_size_is_a_multiple_of_the_largest_block_with_small_tails():
    sizes = [2 * 1024 * 1024, 32 * 1024 + 1024, 576 * 1024]
    slab = choose_slab_nbytes(8 << 30, sizes)
    assert slab % max(sizes) == 0
    assert max((slab % size) / slab for size in sizes) <= 0.01
    assert (8 << 30) // slab >= 100 * len(sizes)


def test_a_budget_without_a_block_per_pool_is_refused_naming_the_fix():
    with pytest.raises(BadArgsError, match="raise --memory"):
        Arena(1000, [600, 100])


def test_block_addresses_are_static_and_inside_their_slab():
    arena = Arena(1 << 20, [4096, 1000])
    assert arena.block_offset(0, 0) == 0
    bps = arena.blocks_per_slab[1]
    assert arena.block_offset(1, bps) == arena.slab_nbytes
    assert arena.block_offset(1, bps - 1) + 1000 <= arena.slab_nbytes


def test_pools_grow_on_demand_and_ids_of_unowned_slabs_are_absent():
    arena = Arena(64 * 4096, [4096, 1024], slab_nbytes=4 * 4096)
    big, small = arena.add_pool(0, "lru"), arena.add_pool(1, "lru")
    assert big.num_present == small.num_present == 0
    ids = big.allocate(5, A)
    assert set(ids) <= set(range(8)) and big.num_present == 8  # two slabs of 4 blocks
    assert small.allocate(1, A) == [32]  # the third slab: ids 32..47 of the small pool
    arena.check_invariants()
    with pytest.raises(Exception):
        small.pin([0], A)  # an absent id is never handed out or shared
    assert arena.live_nbytes() == 5 * 4096 + 1024


def test_phase_two_pool_takes_the_idle_pools_memory():
    """Issue 31 item 2: pool A fills the budget, then only pool B runs; B ends with >= 90 %."""
    budget = 64 << 20
    arena = Arena(budget, [256 * 1024, 24 * 1024])
    pool_a, pool_b = arena.add_pool(0), arena.add_pool(1)
    key = 0
    while arena.num_unowned() or pool_a.num_free:  # phase 1: A until it is full
        keys = [("a", key + i) for i in range(8)]
        fill(pool_a, keys)
        key += len(keys)
    assert pool_a.num_present * pool_a.block_nbytes >= 0.95 * budget
    for _ in range(3 * budget // (8 * pool_b.block_nbytes)):  # phase 2: only B, new prompts
        fill(pool_b, [("b", key + i) for i in range(8)])
        key += 8
    arena.check_invariants()
    share_b = pool_b.num_present * pool_b.block_nbytes / budget
    assert share_b >= 0.90, f"B holds {share_b:.1%} of the budget"


def test_a_pinned_slab_is_never_taken():
    arena = Arena(8 * 4096, [4096, 4096], slab_nbytes=4096)
    pool_a, pool_b = arena.add_pool(0, "lru"), arena.add_pool(1, "lru")
    held = pool_a.allocate(4, A)  # owned: unmovable
    fill(pool_a, [("a", i) for i in range(4)])
    assert pool_b.allocate(4, B) is not None  # takes the four cached ones
    assert pool_b.allocate(1, B) is None  # the rest is A's owned blocks
    assert all(pool_a.state(block_id) == "owned" for block_id in held)
    arena.check_invariants()


def test_a_busy_pool_keeps_its_memory_against_a_colder_one():
    arena = Arena(16 * 4096, [4096, 4096], slab_nbytes=4096)
    pool_a, pool_b = arena.add_pool(0, "lru"), arena.add_pool(1, "lru")
    fill(pool_a, [("a", i) for i in range(8)])
    fill(pool_b, [("b", i) for i in range(8)])
    for round_ in range(20):  # A is hot: every round hits its blocks, B's are never read again
        assert len(pool_a.lookup([("a", i) for i in range(8)], A)) == 8
        pool_a.release(pool_a.holdings(A) and [b for b, n in pool_a.holdings(A).items()
                                               for _ in range(n)], A)
        fill(pool_b, [("b", 100 + 4 * round_ + i) for i in range(4)])
    assert pool_a.num_present == 8  # B evicted its own cold blocks, not A's hot ones
    arena.check_invariants()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_random_mix_keeps_every_invariant(policy):
    """Three pools, random allocate/seal/lookup/release with chains and pins; invariants hold."""
    rng = random.Random(31)
    arena = Arena(48 * 8192, [8192, 3000, 1000], slab_nbytes=8192)
    pools = [arena.add_pool(number, policy) for number in range(3)]
    held = {number: [] for number in range(3)}
    for step in range(600):
        number = rng.randrange(3)
        pool = pools[number]
        if held[number] and rng.random() < 0.4:
            pool.release(held[number], A)
            held[number] = []
        elif rng.random() < 0.5:
            chain = rng.randrange(30)
            keys = [(chain, i) for i in range(rng.randrange(1, 6))]
            hits = pool.lookup(keys, A)
            held[number] += hits
            missing = keys[len(hits):]
            block_ids = pool.allocate(len(missing), A)
            if block_ids:
                parents = [keys[len(hits) - 1] if hits else None, *missing[:-1]]
                indexed = pool.seal(block_ids, missing, A, parents)
                held[number] += block_ids
                assert len(indexed) == len(block_ids)
        else:
            block_ids = pool.allocate(rng.randrange(1, 4), A)
            if block_ids:
                held[number] += block_ids
        if step % 25 == 0:
            arena.check_invariants()
    arena.check_invariants()
    assert arena.num_moves > 0


def hit(pool, keys, times=1, owner=A):
    """Look `keys` up (all cached) and release them, `times` times."""
    for _ in range(times):
        block_ids = pool.lookup(keys, owner)
        assert len(block_ids) == len(keys)
        pool.release(block_ids, owner)


def test_a_one_block_slab_leaves_in_its_pools_policy_order():
    """The donor loses its policy's victim (LFU: the least hit), not its least recent block."""
    arena = Arena(4 * 4096, [4096, 4096], slab_nbytes=4096)
    donor, taker = arena.add_pool(0, "lfu"), arena.add_pool(1, "lfu")
    fill(donor, [("a", 0), ("a", 1)], parents=False)
    hit(donor, [("a", 0), ("a", 1)], times=3)  # frequent, then never again: the coldest slabs
    fill(donor, [("a", 2), ("a", 3)], parents=False)  # newer, never hit
    assert taker.allocate(1, B) is not None
    kept = [donor.find(("a", i)) is not None for i in range(4)]
    assert kept[:2] == [True, True] and kept[2:].count(False) == 1
    arena.check_invariants()


def test_a_victims_slab_with_a_block_used_after_it_stays():
    """Two blocks a slab: the victim's slab-mate was used after it, so the coldest slab goes."""
    arena = Arena(4 * 8192, [4096, 8192], slab_nbytes=8192)
    donor, taker = arena.add_pool(0, "lfu"), arena.add_pool(1, "lfu")
    fill(donor, [("s", 0), ("s", 1)], parents=False)  # slab 0
    others = [("s", i) for i in range(2, 8)]
    for number in range(3):  # slabs 1, 2 and 3
        fill(donor, others[2 * number:2 * number + 2], parents=False)
    for number in range(3):  # hit often, slab 1 first: it is the coldest
        hit(donor, others[2 * number:2 * number + 2], times=3)
    hit(donor, [("s", 0)], times=3)  # LFU's victim is ("s", 1); its slab-mate is the newest
    assert taker.allocate(1, B) is not None
    assert donor.find(("s", 0)) is not None
    assert donor.find(("s", 2)) is None and donor.find(("s", 3)) is None  # slab 1 went
    assert donor.find(("s", 1)) is None  # the chosen victim: evicted with the move
    arena.check_invariants()


def test_a_victims_slab_with_an_owned_block_stays():
    arena = Arena(2 * 8192, [4096, 8192], slab_nbytes=8192)
    donor, taker = arena.add_pool(0, "lfu"), arena.add_pool(1, "lfu")
    fill(donor, [("s", 0)])  # block 0 of slab 0, cached: LFU's victim
    [owned] = donor.allocate(1, A)  # block 1 of slab 0
    fill(donor, [("s", 2), ("s", 3)], parents=False)  # slab 1
    hit(donor, [("s", 2), ("s", 3)], times=3)
    assert taker.allocate(1, B) is not None
    assert donor.state(owned) == "owned" and donor.find(("s", 2)) is None
    arena.check_invariants()


def test_the_ghost_list_keeps_the_newest_keys_let_go_up_to_its_limit():
    ghosts = GhostPolicy(make_policy("lru", 16), limit=3)
    for key in range(10):
        ghosts.inserted(key)
    let_go = [ghosts.victim() for _ in range(5)]
    ghosts.discard(8)
    let_go.append(8)
    assert len(ghosts) == 4 and list(ghosts.keys) == let_go[-3:]
