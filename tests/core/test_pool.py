"""kvd.core.pool.BlockPool: every state transition, all-or-nothing allocation, typed misuse errors.

Every pool here is wrapped in `Checked`, which runs `check_invariants()` after every call (also
after a call that raised), so each step of each test is an invariant check.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.errors import BadArgsError, InternalError, InUseError, KvdError, NotFoundError
from kvd.core.policies import DEFAULT_POLICY, POLICIES, LRUPolicy, make_policy
from kvd.core.pool import BlockPool

A, B = 1, 2  # owners (sessions)


class Checked:
    """Proxy to a BlockPool that checks the invariants after every method call."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def __getattr__(self, name):
        attr = getattr(self.pool, name)
        if not callable(attr):
            return attr

        def checked(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self.pool.check_invariants()

        return checked


@pytest.fixture(params=sorted(POLICIES))
def policy(request) -> str:
    return request.param


def make_pool(num_blocks: int, policy: str = "default") -> Checked:
    pool = Checked(BlockPool(num_blocks, policy))
    pool.check_invariants()
    return pool


def snapshot(pool: Checked) -> tuple:
    """Everything observable through the public API, to assert a failed call changed nothing."""
    per_block = [(pool.state(i), pool.ref_count(i), pool.block_hash(i))
                 for i in range(pool.num_blocks)]
    holdings = {owner: pool.holdings(owner) for owner in pool.owners()}
    return per_block, holdings, pool.stats(), pool.generations.tolist()


def cached_chain(pool: Checked, keys: list, owner: int = A) -> list[int]:
    """Allocate, seal under `keys` and release: the blocks end CACHED, tail released first."""
    block_ids = pool.allocate(len(keys), owner)
    assert pool.seal(block_ids, keys, owner) == [True] * len(keys)
    pool.release(block_ids, owner)
    return block_ids


# ---- construction and queries ---------------------------------------------------------------
def test_new_pool_is_all_free(policy):
    pool = make_pool(5, policy)
    assert [pool.state(i) for i in range(5)] == ["free"] * 5
    assert (pool.num_free, pool.num_owned, pool.num_sealed, pool.num_cached) == (5, 0, 0, 0)
    assert pool.num_available == 5 and pool.owners() == []
    assert pool.generations.tolist() == [0] * 5
    assert pool.policy.name == policy


@pytest.mark.parametrize("num_blocks", [0, -3, 2.0, "4", None])
def test_bad_num_blocks(num_blocks):
    with pytest.raises(BadArgsError, match="num_blocks must be a positive int"):
        BlockPool(num_blocks)


def test_unknown_policy_lists_choices():
    with pytest.raises(BadArgsError, match="choose one of"):
        BlockPool(4, "belady")


def test_default_policy_and_policy_instance():
    assert BlockPool(4).policy.name == DEFAULT_POLICY
    policy = LRUPolicy(4)
    assert BlockPool(4, policy).policy is policy


def test_shared_generations_array_is_maintained_in_place():
    generations = np.zeros(3, dtype=np.uint64)
    pool = Checked(BlockPool(3, generations=generations))
    (block_id,) = pool.allocate(1, A)
    pool.release([block_id], A)
    assert generations[block_id] == 1
    with pytest.raises(BadArgsError, match=r"shape \(3,\)"):
        BlockPool(3, generations=np.zeros(4, dtype=np.uint64))


@pytest.mark.parametrize("bad_id", [-1, 4, 2**70, 1.0, True, "0", None])
def test_queries_reject_bad_ids_naming_the_range(bad_id):
    pool = make_pool(4)
    for query in (pool.state, pool.ref_count, pool.block_hash):
        with pytest.raises(BadArgsError, match=r"\[0, 4\)"):
            query(bad_id)


# ---- FREE → OWNED → FREE ---------------------------------------------------------------------
def test_allocate_hands_out_distinct_owned_blocks(policy):
    pool = make_pool(6, policy)
    block_ids = pool.allocate(4, A)
    assert len(set(block_ids)) == 4 and all(0 <= i < 6 for i in block_ids)
    assert all(pool.state(i) == "owned" and pool.ref_count(i) == 1 for i in block_ids)
    assert pool.holdings(A) == {i: 1 for i in block_ids}
    assert (pool.num_free, pool.num_owned) == (2, 4)
    assert pool.stats()["allocations"] == 4


def test_allocate_zero_returns_empty_and_registers_no_owner():
    pool = make_pool(2)
    assert pool.allocate(0, A) == []
    assert pool.owners() == []


@pytest.mark.parametrize("count", [-1, 1.5, "2"])
def test_allocate_bad_count(count):
    pool = make_pool(2)
    with pytest.raises(BadArgsError):
        pool.allocate(count, A)
    assert pool.num_free == 2


def test_release_owned_block_frees_it_and_bumps_generation(policy):
    pool = make_pool(3, policy)
    block_ids = pool.allocate(2, A)
    pool.release(block_ids, A)
    assert all(pool.state(i) == "free" for i in block_ids)
    assert [int(pool.generations[i]) for i in block_ids] == [1, 1]
    assert pool.owners() == [] and pool.num_free == 3


# ---- OWNED → SEALED → CACHED → SEALED ---------------------------------------------------------
def test_seal_publishes_read_only_pinned_blocks(policy):
    pool = make_pool(3, policy)
    block_ids = pool.allocate(2, A)
    assert pool.seal(block_ids, [b"k0", b"k1"], A) == [True, True]
    assert [pool.state(i) for i in block_ids] == ["sealed", "sealed"]
    assert [pool.ref_count(i) for i in block_ids] == [1, 1]
    assert [pool.find(k) for k in (b"k0", b"k1")] == block_ids
    assert pool.block_hash(block_ids[1]) == b"k1"
    assert (pool.num_owned, pool.num_sealed, pool.num_cached) == (0, 2, 0)
    assert pool.generations.tolist() == [0, 0, 0]  # sealing is not a reuse


def test_last_release_makes_sealed_blocks_cached_and_evictable(policy):
    pool = make_pool(3, policy)
    block_ids = cached_chain(pool, [b"k0", b"k1"])
    assert [pool.state(i) for i in block_ids] == ["cached", "cached"]
    assert all(pool.ref_count(i) == 0 for i in block_ids)
    assert b"k0" in pool.policy and b"k1" in pool.policy
    assert (pool.num_sealed, pool.num_cached, pool.num_available) == (0, 2, 3)
    assert pool.owners() == []
    assert pool.generations.tolist() == [0, 0, 0]  # cached blocks keep their content


def test_lookup_hit_pins_cached_blocks_again(policy):
    pool = make_pool(3, policy)
    block_ids = cached_chain(pool, [b"k0", b"k1"])
    assert pool.lookup([b"k0", b"k1"], B) == block_ids
    assert [pool.state(i) for i in block_ids] == ["sealed", "sealed"]
    assert pool.holdings(B) == {i: 1 for i in block_ids}
    assert b"k0" not in pool.policy and pool.num_cached == 0


def test_lookup_returns_the_longest_cached_prefix_only(policy):
    pool = make_pool(3, policy)
    first, second, _ = cached_chain(pool, [b"k0", b"k1", b"k2"])
    pool.allocate(1, B)  # evicts the chain's tail
    assert pool.lookup([b"k0", b"k1", b"k2", b"k3"], A) == [first, second]
    stats = pool.stats()
    assert (stats["lookups"], stats["lookup_blocks"], stats["hit_blocks"]) == (1, 4, 2)  # 4 asked


def test_lookup_stops_at_first_miss_even_if_later_keys_are_cached(policy):
    pool = make_pool(4, policy)
    cached_chain(pool, [b"k0"])
    cached_chain(pool, [b"k2"])
    assert pool.lookup([b"k0", b"k1", b"k2"], B) == [pool.find(b"k0")]
    assert pool.state(pool.find(b"k2")) == "cached"
    assert pool.lookup([b"nope"], B) == [pool.find(b"k0")][:0]
    assert pool.lookup([], B) == []


def test_lookup_twice_pins_twice_and_needs_two_releases(policy):
    pool = make_pool(2, policy)
    (block_id,) = cached_chain(pool, [b"k"])
    pool.lookup([b"k"], B)
    pool.lookup([b"k"], B)
    assert pool.ref_count(block_id) == 2 and pool.holdings(B) == {block_id: 2}
    pool.release([block_id], B)
    assert pool.state(block_id) == "sealed"
    pool.release([block_id], B)
    assert pool.state(block_id) == "cached"


def test_shared_block_stays_sealed_until_every_owner_releases(policy):
    pool = make_pool(2, policy)
    (block_id,) = pool.allocate(1, A)
    pool.seal([block_id], [b"k"], A)
    assert pool.lookup([b"k"], B) == [block_id]
    assert pool.ref_count(block_id) == 2
    pool.release([block_id], A)
    assert pool.state(block_id) == "sealed" and pool.ref_count(block_id) == 1
    pool.release([block_id], B)
    assert pool.state(block_id) == "cached"


def test_touch_counts_an_access_without_pinning(policy):
    pool = make_pool(2, policy)
    (block_id,) = cached_chain(pool, [b"k"])
    assert pool.touch(b"k") == block_id
    assert pool.state(block_id) == "cached" and pool.ref_count(block_id) == 0
    assert pool.touch(b"absent") is None


# ---- pin -------------------------------------------------------------------------------------
def test_pin_shares_sealed_and_cached_blocks(policy):
    pool = make_pool(3, policy)
    sealed, cached = pool.allocate(2, A)
    pool.seal([sealed, cached], [b"s", b"c"], A)
    pool.release([cached], A)
    pool.pin([sealed, cached, sealed], B)
    assert pool.holdings(B) == {sealed: 2, cached: 1}
    assert pool.state(cached) == "sealed" and pool.ref_count(sealed) == 3
    assert pool.num_cached == 0


def test_pin_does_not_count_an_access_but_lookup_does():
    pool = make_pool(2, "lfu")
    (old,) = cached_chain(pool, [b"old"])
    cached_chain(pool, [b"new"])
    pool.touch(b"new")
    for _ in range(3):
        pool.pin([old], A)
        pool.release([old], A)
    pool.allocate(1, B)
    assert pool.find(b"old") is None and pool.find(b"new") is not None


class RecordingLRU(LRUPolicy):
    """LRU that logs every event, a batch shorthand as its per-key events."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.events: list[tuple[str, bytes]] = []

    def accessed(self, key):
        self.events.append(("accessed", key))
        super().accessed(key)

    def hit_evictable(self, key):
        self.events.append(("hit_evictable", key))
        super().hit_evictable(key)

    def hit_evictable_many(self, keys):
        self.events += [("hit_evictable", key) for key in keys]
        super().hit_evictable_many(keys)


def test_a_lookup_tells_the_policy_each_blocks_events_in_block_order():
    # Hits on cached blocks reach the policy in one batch; a block pinned already (shared, or
    # named twice) is `accessed`. Every event must still arrive in the lookup's block order: a
    # block named twice is a hit on a cached block first, then an access to a pinned one.
    recorder = RecordingLRU(4)
    pool = Checked(BlockPool(4, recorder))  # full: a victim can be chosen
    cached_chain(pool, [b"a", b"b", b"c", b"d"])
    pool.lookup([b"b"], B)  # b is pinned by B: A's lookup below only accesses it
    pool.choose_next_victim()  # d: a hit on it is an access (the policy has let it go)
    assert b"d" not in recorder
    recorder.events.clear()
    pool.lookup([b"a", b"a", b"b", b"c", b"d", b"c", b"a"], A)
    assert recorder.events == [("hit_evictable", b"a"), ("accessed", b"a"), ("accessed", b"b"),
                               ("hit_evictable", b"c"), ("accessed", b"d"), ("accessed", b"c"),
                               ("accessed", b"a")]
    assert pool.holdings(A) == {0: 3, 1: 1, 2: 2, 3: 1}


@pytest.mark.parametrize("setup", ["free", "owned_by_me", "owned_by_other"])
def test_pin_rejects_blocks_that_are_not_sealed(policy, setup):
    pool = make_pool(2, policy)
    if setup == "free":
        block_id = 1
        pool.allocate(1, A)
    else:
        (block_id,) = pool.allocate(1, A if setup == "owned_by_me" else B)
    before = snapshot(pool)
    with pytest.raises(InUseError, match="only sealed blocks can be shared"):
        pool.pin([block_id], A)
    assert snapshot(pool) == before


def test_pin_is_all_or_nothing():
    pool = make_pool(3)
    sealed, owned = pool.allocate(2, A)
    pool.seal([sealed], [b"s"], A)
    before = snapshot(pool)
    with pytest.raises(InUseError):
        pool.pin([sealed, owned], B)
    with pytest.raises(BadArgsError):
        pool.pin([sealed, 99], B)
    assert snapshot(pool) == before


# ---- eviction and all-or-nothing allocation --------------------------------------------------
def test_allocation_evicts_cached_blocks_and_bumps_their_generation(policy):
    pool = make_pool(2, policy)
    victims = cached_chain(pool, [b"k0", b"k1"])
    block_ids = pool.allocate(2, B)
    assert sorted(block_ids) == sorted(victims)
    assert pool.find(b"k0") is None and pool.find(b"k1") is None
    assert all(pool.block_hash(i) is None and pool.state(i) == "owned" for i in block_ids)
    assert pool.generations.tolist() == [1, 1]
    assert pool.stats()["evictions"] == 2 and len(pool.policy) == 0


def test_allocation_uses_free_blocks_before_evicting(policy):
    pool = make_pool(3, policy)
    cached_chain(pool, [b"k0", b"k1"])
    pool.allocate(1, B)
    assert pool.find(b"k0") is not None and pool.find(b"k1") is not None
    assert pool.stats()["evictions"] == 0


def test_allocation_short_returns_none_and_evicts_nothing(policy):
    pool = make_pool(5, policy)
    pinned = pool.allocate(2, A)
    pool.seal(pinned, [b"p0", b"p1"], A)
    cached_chain(pool, [b"c0", b"c1"], owner=B)
    assert pool.num_available == 3
    before = snapshot(pool)
    assert pool.allocate(4, B) is None
    assert snapshot(pool) == before
    block_ids = pool.allocate(3, B)
    assert len(block_ids) == 3 and not set(block_ids) & set(pinned)
    assert all(pool.state(i) == "sealed" for i in pinned)
    assert pool.find(b"p0") == pinned[0] and pool.find(b"c0") is None


def test_pinned_blocks_are_never_evicted(policy):
    pool = make_pool(3, policy)
    pinned = pool.allocate(3, A)
    pool.seal(pinned, [b"a", b"b", b"c"], A)
    assert pool.allocate(1, B) is None
    pool.lookup([b"a"], B)
    pool.release(pinned, A)  # a is still pinned by B; b and c become cached
    block_ids = pool.allocate(2, B)
    assert pinned[0] not in block_ids and pool.state(pinned[0]) == "sealed"
    assert pool.allocate(1, B) is None


@pytest.mark.parametrize("order", ["release", "release_owner"])
def test_chain_tail_is_evicted_before_its_ancestors(policy, order):
    pool = make_pool(4, policy)
    keys = [b"head", b"middle", b"tail"]
    block_ids = pool.allocate(3, A)
    pool.seal(block_ids, keys, A)
    if order == "release":
        pool.release(block_ids, A)
    else:
        assert pool.release_owner(A) == 3
    pool.allocate(1, B)  # the free block
    evicted = []
    for _ in range(3):
        pool.allocate(1, B)
        evicted += [k for k in keys if pool.find(k) is None and k not in evicted]
    assert evicted == [b"tail", b"middle", b"head"]


class BrokenPolicy(LRUPolicy):
    """Lets go of its victim but names a key that was never cached."""

    name = "broken"

    def victim(self):
        super().victim()
        return b"never-cached"


def test_policy_choosing_a_non_cached_victim_is_an_internal_error_naming_it():
    pool = BlockPool(2, BrokenPolicy(2))
    cached_chain(Checked(pool), [b"k0", b"k1"])
    with pytest.raises(InternalError, match="policy 'broken'"):
        pool.allocate(1, B)


# ---- seal misuse and duplicates -------------------------------------------------------------
def test_seal_by_another_owner_is_not_found_and_changes_nothing(policy):
    pool = make_pool(2, policy)
    block_ids = pool.allocate(2, A)
    before = snapshot(pool)
    with pytest.raises(NotFoundError, match="not held by this session"):
        pool.seal(block_ids, [b"k0", b"k1"], B)
    assert snapshot(pool) == before


def test_seal_twice_is_in_use_and_changes_nothing(policy):
    pool = make_pool(2, policy)
    first, second = pool.allocate(2, A)
    pool.seal([first], [b"k0"], A)
    before = snapshot(pool)
    with pytest.raises(InUseError, match="immutable"):
        pool.seal([second, first], [b"k1", b"k2"], A)
    assert snapshot(pool) == before


@pytest.mark.parametrize("block_ids, keys, match", [
    ([0, 1], [b"k0"], "2 block ids but 1 hashes"),
    ([0, 0], [b"k0", b"k1"], "same block twice"),
    ([0, 7], [b"k0", b"k1"], r"\[0, 2\)"),
    ([0, -1], [b"k0", b"k1"], r"\[0, 2\)"),
    ([0, 1], [b"k0", None], "hash"),
    ([0, 1], [b"k0", [1, 2]], "hash"),
])
def test_seal_bad_args_change_nothing(block_ids, keys, match):
    pool = make_pool(2)
    pool.allocate(2, A)
    before = snapshot(pool)
    with pytest.raises(BadArgsError, match=match):
        pool.seal(block_ids, keys, A)
    assert snapshot(pool) == before


def test_sealing_an_indexed_hash_keeps_a_private_duplicate(policy):
    pool = make_pool(3, policy)
    (original,) = pool.allocate(1, A)
    pool.seal([original], [b"k"], A)
    (duplicate,) = pool.allocate(1, B)
    assert pool.seal([duplicate], [b"k"], B) == [False]
    assert pool.state(duplicate) == "sealed" and pool.find(b"k") == original
    assert pool.stats()["indexed"] == 1
    pool.release([duplicate], B)  # unreachable by lookup: freed, not cached
    assert pool.state(duplicate) == "free" and pool.generations[duplicate] == 1
    pool.release([original], A)
    assert pool.state(original) == "cached"


def test_sealing_the_hash_of_a_cached_block_is_a_duplicate(policy):
    pool = make_pool(3, policy)
    (original,) = cached_chain(pool, [b"k"])
    (duplicate,) = pool.allocate(1, B)
    assert pool.seal([duplicate], [b"k"], B) == [False]
    assert pool.lookup([b"k"], B) == [original]


def test_duplicate_within_one_seal_batch(policy):
    pool = make_pool(2, policy)
    first, second = pool.allocate(2, A)
    assert pool.seal([first, second], [b"k", b"k"], A) == [True, False]
    pool.release_owner(A)
    assert (pool.state(first), pool.state(second)) == ("cached", "free")


def test_duplicate_of_an_evicted_hash_can_be_indexed_again(policy):
    pool = make_pool(2, policy)
    cached_chain(pool, [b"k"])
    reuse = pool.allocate(2, B)  # evicts b"k"
    assert pool.seal(reuse, [b"k", b"j"], B) == [True, True]


# ---- release misuse ---------------------------------------------------------------------------
def test_release_by_wrong_owner_changes_nothing(policy):
    pool = make_pool(2, policy)
    block_ids = pool.allocate(2, A)
    before = snapshot(pool)
    with pytest.raises(NotFoundError, match="not held by this session"):
        pool.release(block_ids, B)
    assert snapshot(pool) == before


def test_double_release_is_not_found(policy):
    pool = make_pool(2, policy)
    block_ids = cached_chain(pool, [b"k0", b"k1"])
    before = snapshot(pool)
    with pytest.raises(NotFoundError):
        pool.release(block_ids, A)
    assert snapshot(pool) == before


def test_release_more_pins_than_held_is_all_or_nothing(policy):
    pool = make_pool(3, policy)
    first, second = pool.allocate(2, A)
    before = snapshot(pool)
    with pytest.raises(NotFoundError, match="often enough"):
        pool.release([first, second, second], A)
    assert snapshot(pool) == before


@pytest.mark.parametrize("bad_id", [-1, 2, "0", None])
def test_release_of_bad_ids_is_a_typed_error(bad_id):
    pool = make_pool(2)
    pool.allocate(1, A)
    before = snapshot(pool)
    with pytest.raises(KvdError):
        pool.release([0, bad_id], A)
    assert snapshot(pool) == before


# ---- release_owner (session closed or died) ----------------------------------------------------
def test_release_owner_drops_every_pin_and_frees_unsealed_blocks(policy):
    pool = make_pool(6, policy)
    owned = pool.allocate(2, A)
    sealed = pool.allocate(2, A)
    pool.seal(sealed, [b"s0", b"s1"], A)
    pool.lookup([b"s0"], A)  # a second pin on s0
    pool.lookup([b"s1"], B)  # another session shares s1
    assert pool.release_owner(A) == 4
    assert all(pool.state(i) == "free" for i in owned)
    assert pool.state(sealed[0]) == "cached"
    assert pool.state(sealed[1]) == "sealed" and pool.holdings(B) == {sealed[1]: 1}
    assert pool.owners() == [B]
    assert pool.release_owner(A) == 0 and pool.release_owner(99) == 0


# ---- generations ------------------------------------------------------------------------------
def test_generation_bumps_every_time_a_block_returns_to_free(policy):
    pool = make_pool(1, policy)
    for round_number in range(1, 4):
        (block_id,) = pool.allocate(1, A)
        pool.seal([block_id], [round_number], A)
        pool.lookup([round_number], B)
        pool.release([block_id], A)
        pool.release([block_id], B)
        assert pool.generations[block_id] == round_number - 1  # cached: same content
        assert pool.lookup([round_number], A) == [block_id]
        pool.release([block_id], A)
    pool.allocate(1, B)  # evicts round 3's content
    assert pool.generations[0] == 3


# ---- the checker itself ----------------------------------------------------------------------
@pytest.mark.parametrize("corrupt, match", [
    (lambda p: p.tables.refs.__setitem__(0, 2), "ref count differs"),
    (lambda p: p.tables.state.__setitem__(1, 0), "state counts"),
    (lambda p: p.tables.hashes.__setitem__(0, None), "pinned and hashed"),
    (lambda p: p.tables.index.__setitem__(b"ghost", 2), "does not hold it"),
    (lambda p: p.tables.counts.__setitem__(0, p.num_free + 1), "state counts|free list"),
    (lambda p: p.policy.removed(b"c"), "evictable|state counts"),
    (lambda p: p.tables.is_duplicate.__setitem__(0, 1), "duplicate"),
])
def test_check_invariants_catches_corruption(corrupt, match):
    pool = BlockPool(4)
    sealed, owned, cached = pool.allocate(3, A)
    pool.seal([sealed, cached], [b"s", b"c"], A)
    pool.release([cached], A)
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(InternalError, match=match):
        pool.check_invariants()


def test_check_invariants_catches_a_duplicate_that_is_not_marked():
    pool = BlockPool(3)
    original, duplicate = pool.allocate(2, A)
    assert pool.seal([original, duplicate], [b"k", b"k"], A) == [True, False]
    pool.check_invariants()
    pool.tables.is_duplicate[duplicate] = 0  # its release would cache it under the original's hash
    with pytest.raises(InternalError, match="duplicate"):
        pool.check_invariants()


def test_check_invariants_catches_a_non_free_block_on_the_free_list():
    pool = BlockPool(3)
    (owned,) = pool.allocate(1, A)
    pool.tables.free[0] = owned  # counts still match; a free block is missing from the list instead
    with pytest.raises(InternalError, match="free list"):
        pool.check_invariants()


# ---- the victim chosen ahead of need (the daemon's idle step) --------------------------------
def test_choosing_the_next_victim_evicts_nothing_and_the_next_allocation_takes_it():
    pool = make_pool(3, "lru")
    pool.choose_next_victim()  # not full: nothing to choose
    ids = cached_chain(pool, [b"a", b"b", b"c"])  # released tail first: c is the LRU block
    before = snapshot(pool)
    pool.choose_next_victim()
    pool.choose_next_victim()  # idempotent
    assert snapshot(pool) == before  # every block still cached and indexed, no counter moved
    assert pool.num_cached == 3 and len(pool.policy) == 2
    (new_id,) = pool.allocate(1, A)
    assert new_id == ids[2] and pool.find(b"c") is None and pool.counters["evictions"] == 1


def test_a_hit_on_the_chosen_victim_cancels_the_choice(policy):
    pool = make_pool(2, policy)
    cached_chain(pool, [b"a"])
    cached_chain(pool, [b"b"])
    pool.choose_next_victim()
    chosen = next(key for key in (b"a", b"b") if key not in pool.policy)
    (hit,) = pool.lookup([chosen], B)  # still found: nothing was evicted early
    assert pool.state(hit) == "sealed" and pool.num_cached == 1 == len(pool.policy)
    (new_id,) = pool.allocate(1, A)  # the other block goes; the hit one is pinned
    assert pool.find(chosen) == hit and new_id != hit
    pool.release([hit], B)  # back to the policy like any released block
    assert chosen in pool.policy and pool.state(hit) == "cached"


def test_the_chosen_victim_takes_its_cached_children_along():
    pool = make_pool(3, "lru")
    ids = pool.allocate(2, A)
    pool.seal(ids, [b"p", b"c"], A, parents=[None, b"p"])
    pool.release([ids[0]], A)  # the head first: it is the least recently used block
    pool.release([ids[1]], A)
    cached_chain(pool, [b"x"])
    pool.choose_next_victim()
    assert b"p" not in pool.policy and b"c" in pool.policy
    new_ids = pool.allocate(2, A)  # the chosen head goes, and its child with it
    assert sorted(new_ids) == sorted(ids) and pool.find(b"x") is not None
    assert pool.counters["evictions"] == 2


def _remembers(policy, key) -> list[str]:
    """Where a policy (or a tier's policy) still holds `key`: in any dict or set attribute."""
    found = [name for name, value in vars(policy).items()
             if isinstance(value, (dict, set)) and key in value]
    for tier, inner in enumerate(getattr(policy, "policies", ())):
        found += [f"tier {tier}: {name}" for name in _remembers(inner, key)]
    return found


@pytest.mark.parametrize("policy", [*sorted(POLICIES), "tiered"])
def test_a_pinned_block_freed_as_an_orphan_is_forgotten_by_the_policy(policy):
    """Regression: a block pinned by a lookup hit, cut off when its parent was evicted and freed
    at its last release was never reported to the policy, which kept its pinned-state entry (and
    Tiered its residency count) for good, skewing every later choice."""
    tiers = "prefill=0.5,decode=0.5" if policy == "tiered" else None
    pool = BlockPool(4, make_policy("kvd" if tiers else policy, 4, tiers))
    parent, child = pool.allocate(2, owner=1)
    pool.seal([parent, child], [b"a", b"b"], owner=1, parents=[None, b"a"])
    pool.release([parent, child], owner=1)  # both cached
    assert pool.lookup([b"a", b"b"], owner=2) == [parent, child]  # hits: both pinned again
    pool.release([parent], owner=2)
    taken = pool.allocate(3, owner=3)  # evicts the parent: the pinned child is cut off
    pool.release([child], owner=2)  # its last pin: freed, not cached
    assert pool.state(child) == "free"
    pool.release(taken, owner=3)
    pool.check_invariants()
    assert _remembers(pool.policy, b"b") == []
    if tiers:
        assert sum(pool.policy.num_resident) == len(pool.policy) == 0


# ---- put: allocate, seal and release in one call ---------------------------------------------
class RecordingObserver:
    def __init__(self) -> None:
        self.log: list[tuple] = []

    def sealed(self, rows):
        self.log.append(("sealed", rows))

    def evicted(self, block_id):
        self.log.append(("evicted", block_id))


def test_put_is_allocate_seal_and_release_in_one_call(policy):
    # The same blocks, tables, counters, generations, journal rows and policy order as the three
    # calls, through evictions of both kinds of key the C takes (bytes and tuples of ints).
    observers = [RecordingObserver(), RecordingObserver()]
    put_pool, three_calls = (Checked(BlockPool(4, policy, observer=observer))
                             for observer in observers)
    keys = [b"k%d" % i if i % 2 else (i % 3, i) for i in range(11)]
    for number, key in enumerate(keys):
        tier = number % 2
        block_ids = three_calls.allocate(1, A)
        three_calls.seal(block_ids, [key], A, tiers=[tier])
        three_calls.release(block_ids, A)
        assert put_pool.put(key, tier) == block_ids[0]
        assert put_pool.touch(keys[0]) == three_calls.touch(keys[0])  # (reorders the policy)
    assert snapshot(put_pool) == snapshot(three_calls)
    assert bytes(put_pool.tables.tier) == bytes(three_calls.tables.tier)
    assert observers[0].log == observers[1].log and len(observers[0].log) == 11 + 7
    assert put_pool.counters["allocations"] == put_pool.counters["seals"] == 11
    new_keys = [b"new%d" % i for i in range(4)]  # the policies agree: the same victims, in order
    assert [put_pool.put(key) for key in new_keys] == [three_calls.put(key) for key in new_keys]


def test_put_returns_none_when_no_block_is_free_or_evictable(policy):
    pool = make_pool(2, policy)
    pool.allocate(1, A)
    pool.seal(pool.allocate(1, B), [b"k"], B)  # owned and sealed: neither evictable
    before = snapshot(pool)
    assert pool.put(b"other") is None
    assert snapshot(pool) == before


@pytest.mark.parametrize("key, tier, match", [
    (b"cached", 0, "holds it already"), (b"sealed", 0, "holds it already"),
    (None, 0, "not a content hash"), ([1], 0, "not hashable"), (b"new", 2, "tier"),
    (b"new", -1, "tier"), (b"new", True, "tier"), (b"new", 1.0, "tier")])
def test_put_misuse_is_a_typed_error_and_changes_nothing(key, tier, match):
    pool = make_pool(3)
    pool.put(b"cached")
    pool.seal(pool.allocate(1, A), [b"sealed"], A)
    before = snapshot(pool)
    with pytest.raises(BadArgsError, match=match):
        pool.put(key, tier)
    assert snapshot(pool) == before


def test_put_on_a_policy_choosing_a_non_cached_victim_is_an_internal_error():
    pool = BlockPool(1, BrokenPolicy(1))
    pool.put(b"k0")
    with pytest.raises(InternalError, match="policy 'broken'"):
        pool.put(b"k1")
