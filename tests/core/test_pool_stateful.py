"""BlockPool + policy driven side by side with a pure-Python reference model (Hypothesis).

The model is the lifecycle of DESIGN.md section 3 written the obvious way: a state per block,
pins per owner, a hash per block and an index. It does not predict which victim a policy picks;
it checks that every block an allocation took from the cache was evictable in the model, then
applies that choice. After every step the pool's invariants hold and the pool equals the model.
Misuse (wrong owner, wrong state, over-release, a put of an indexed key) must raise the error the model predicts and change
nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, \
    run_state_machine_as_test

from kvd.errors import BadArgsError, InUseError, KvdError, NotFoundError
from kvd.core.policies import POLICIES
from kvd.core.pool import BlockPool

KEYS = [b"k%d" % i for i in range(8)]  # few keys, so hits, duplicates and re-use are common
OWNERS = st.sampled_from([0, 1, 2])


@dataclass
class Model:
    """The reference: plain dicts, no free list, no policy."""

    num_blocks: int
    state: list[str] = field(init=False)
    key: list[bytes | None] = field(init=False)
    generation: list[int] = field(init=False)
    held: dict[int, Counter] = field(default_factory=dict)
    index: dict[bytes, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state = ["free"] * self.num_blocks
        self.key = [None] * self.num_blocks
        self.generation = [0] * self.num_blocks

    def blocks_in(self, *states: str) -> list[int]:
        return [i for i, s in enumerate(self.state) if s in states]

    def refs(self, block_id: int) -> int:
        return sum(held[block_id] for held in self.held.values())

    def to_free(self, block_id: int) -> None:
        self.state[block_id], self.key[block_id] = "free", None
        self.generation[block_id] += 1

    def evict(self, block_id: int) -> None:
        if self.state[block_id] != "cached":
            raise AssertionError(f"pool evicted block {block_id}, {self.state[block_id]} in model")
        del self.index[self.key[block_id]]
        self.to_free(block_id)

    def pin(self, block_id: int, owner: int) -> None:
        if self.state[block_id] == "cached":
            self.state[block_id] = "sealed"
        self.held.setdefault(owner, Counter())[block_id] += 1

    def unpin(self, block_id: int, owner: int) -> None:
        held = self.held[owner]
        held[block_id] -= 1
        if not held[block_id]:
            del held[block_id]
        if not held:
            del self.held[owner]
        if self.state[block_id] == "owned":
            self.to_free(block_id)
        elif self.refs(block_id) == 0:
            if self.index.get(self.key[block_id]) == block_id:
                self.state[block_id] = "cached"
            else:
                self.to_free(block_id)  # an unindexed duplicate


class PoolMachine(RuleBasedStateMachine):
    policy_name = "lru"

    @initialize(num_blocks=st.integers(1, 6))
    def start(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, self.policy_name)
        self.model = Model(num_blocks)

    def expect_error(self, error: type[KvdError], call, *args) -> None:
        try:
            call(*args)
        except error:
            return
        raise AssertionError(f"{call.__name__}{args} should raise {error.__name__}")

    @rule(owner=OWNERS, num_blocks=st.integers(0, 4))
    def allocate(self, owner: int, num_blocks: int) -> None:
        model = self.model
        free, cached = model.blocks_in("free"), model.blocks_in("cached")
        block_ids = self.pool.allocate(num_blocks, owner)
        if num_blocks > len(free) + len(cached):
            assert block_ids is None
            return
        assert len(block_ids) == len(set(block_ids)) == num_blocks
        taken_from_cache = [i for i in block_ids if i not in free]
        assert len(taken_from_cache) == max(0, num_blocks - len(free))
        for block_id in taken_from_cache:
            model.evict(block_id)
        for block_id in block_ids:
            model.state[block_id] = "owned"
            model.pin(block_id, owner)

    @rule(data=st.data(), owner=OWNERS)
    def seal(self, data: st.DataObject, owner: int) -> None:
        model = self.model
        mine = sorted(model.held.get(owner, {}))
        candidates = st.sampled_from(range(model.num_blocks))
        if mine and data.draw(st.booleans()):
            candidates = st.sampled_from(mine)
        block_ids = data.draw(st.lists(candidates, max_size=3))
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=len(block_ids),
                                  max_size=len(block_ids)))
        error = self.seal_error(block_ids, owner)
        if error:
            self.expect_error(error, self.pool.seal, block_ids, keys, owner)
            return
        expected = []
        for block_id, key in zip(block_ids, keys):
            model.state[block_id], model.key[block_id] = "sealed", key
            expected.append(key not in model.index)
            model.index.setdefault(key, block_id)
        assert self.pool.seal(block_ids, keys, owner) == expected

    def seal_error(self, block_ids: list[int], owner: int) -> type[KvdError] | None:
        held = self.model.held.get(owner, {})
        for block_id in block_ids:
            if block_id not in held:
                return NotFoundError
            if self.model.state[block_id] != "owned":
                return InUseError
        return BadArgsError if len(set(block_ids)) != len(block_ids) else None

    @rule(key=st.sampled_from(KEYS), tier=st.sampled_from([0, 1]))
    def put(self, key: bytes, tier: int) -> None:
        model = self.model
        if key in model.index:
            self.expect_error(BadArgsError, self.pool.put, key, tier)
            return
        free, cached = model.blocks_in("free"), model.blocks_in("cached")
        block_id = self.pool.put(key, tier)
        if not free and not cached:
            assert block_id is None
            return
        if not free:  # the policy's victim, whichever it chose, must have been evictable
            model.evict(block_id)
        model.state[block_id], model.key[block_id] = "cached", key
        model.index[key] = block_id

    @rule(owner=OWNERS, keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def lookup(self, owner: int, keys: list[bytes]) -> None:
        expected = []
        for key in keys:
            if key not in self.model.index:
                break
            expected.append(self.model.index[key])
        assert self.pool.lookup(keys, owner) == expected
        for block_id in expected:
            self.model.pin(block_id, owner)

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: bytes) -> None:
        assert self.pool.touch(key) == self.model.index.get(key)

    @rule(data=st.data(), owner=OWNERS)
    def pin(self, data: st.DataObject, owner: int) -> None:
        model = self.model
        shareable = model.blocks_in("sealed", "cached")
        if shareable and data.draw(st.booleans()):
            block_ids = data.draw(st.lists(st.sampled_from(shareable), max_size=3))
        else:
            block_ids = data.draw(st.lists(st.sampled_from(range(model.num_blocks)), max_size=3))
        if any(model.state[i] not in ("sealed", "cached") for i in block_ids):
            self.expect_error(InUseError, self.pool.pin, block_ids, owner)
            return
        self.pool.pin(block_ids, owner)
        for block_id in block_ids:
            model.pin(block_id, owner)

    @rule(data=st.data(), owner=OWNERS)
    def release(self, data: st.DataObject, owner: int) -> None:
        held = self.model.held.get(owner, Counter())
        pins = sorted(held.elements())
        if pins and data.draw(st.booleans()):
            block_ids = data.draw(st.permutations(pins))[:data.draw(st.integers(0, len(pins)))]
        else:
            block_ids = data.draw(st.lists(st.sampled_from(range(self.model.num_blocks)),
                                           max_size=3))
        if Counter(block_ids) - held:
            self.expect_error(NotFoundError, self.pool.release, block_ids, owner)
            return
        self.pool.release(block_ids, owner)
        for block_id in reversed(block_ids):
            self.model.unpin(block_id, owner)

    @rule(owner=OWNERS)
    def release_owner(self, owner: int) -> None:
        held = self.model.held.get(owner, Counter())
        assert self.pool.release_owner(owner) == len(held)
        for block_id in sorted(held, reverse=True):
            for _ in range(held[block_id]):
                self.model.unpin(block_id, owner)

    @rule()
    def choose_next_victim(self) -> None:
        # The daemon's idle-time step: it must change no block's state (nothing evicted early;
        # a lookup of the chosen block still hits) -- the invariant below checks exactly that.
        self.pool.choose_next_victim()

    @invariant()
    def pool_equals_model(self) -> None:
        pool, model = self.pool, self.model
        pool.check_invariants()
        for block_id in range(model.num_blocks):
            assert pool.state(block_id) == model.state[block_id], block_id
            assert pool.ref_count(block_id) == model.refs(block_id), block_id
            assert pool.block_hash(block_id) == model.key[block_id], block_id
        assert pool.generations.tolist() == model.generation
        assert {owner: pool.holdings(owner) for owner in pool.owners()} == \
            {owner: dict(held) for owner, held in model.held.items()}
        assert {key: pool.find(key) for key in KEYS} == {key: model.index.get(key) for key in KEYS}
        num_cached = len(model.blocks_in("cached"))
        assert pool.num_cached == num_cached
        assert len(pool.policy) in (num_cached, num_cached - 1)  # less the chosen victim, if any


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_pool_matches_reference_model(policy_name: str) -> None:
    machine = type(f"PoolMachine_{policy_name}", (PoolMachine,), {"policy_name": policy_name})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
