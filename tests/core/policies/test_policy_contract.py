"""One contract suite, parametrised over every registered policy (kvd/core/policies/base.py).

A pure-Python model tracks which keys are evictable; each policy is driven with random event
sequences that respect the lifecycle `inserted → (accessed | removed → accessed* → inserted)* →
(victim | discard)`, and every answer is checked against the model. The tiered composite
(kvd/core/policies/tiered.py) runs the same suite with keys spread over both tiers.
"""

from __future__ import annotations

import random

import pytest

from kvd.errors import BadArgsError
from kvd.core.policies import DEFAULT_POLICY, POLICIES, EvictionPolicy, make_policy

NAMES = sorted(POLICIES)
TIERS = "prefill=0.6,decode=0.4"


def build(name: str, capacity: int) -> EvictionPolicy:
    """`name`, or `tiered:NAME` for NAME inside both tiers of a TieredPolicy."""
    if name.startswith("tiered:"):
        return make_policy(name.split(":", 1)[1], capacity, tiers=TIERS)
    return make_policy(name, capacity)


ALL = NAMES + [f"tiered:{name}" for name in ("lru", DEFAULT_POLICY)]


def drive(policy: EvictionPolicy, seed: int, num_steps: int = 3000,
          twin: EvictionPolicy | None = None) -> None:
    """Random lifecycle-respecting events; check victims and len/contains after each step.

    With `twin` (a second policy of the same kind), every event goes to both, except that the
    shorthands go to `policy` only: a hit that pins an evictable key is `hit_evictable` for it
    and `accessed` then `removed` for the twin, hits on a batch of evictable keys
    `hit_evictable_many` for it and `accessed`, `removed` key by key for the twin, a batch of
    keys becoming evictable (pinned ones, new ones, evicted ones that may be ghosts)
    `inserted_many` for it and `inserted` key by key for the twin. The contract says those are
    the same: every victim must then agree.
    """
    rng = random.Random(seed)
    both = [policy] if twin is None else [policy, twin]
    evictable: set[int] = set()
    pinned: set[int] = set()
    evicted: set[int] = set()
    next_key = 0
    for _ in range(num_steps):
        op = rng.random()
        if op < 0.35 or not (evictable or pinned):
            key = rng.choice(sorted(evicted)) if evicted and rng.random() < 0.3 else next_key
            next_key += key == next_key
            evicted.discard(key)
            for each in both:
                each.inserted(key, key % 2)
            evictable.add(key)
        elif op < 0.5:
            key = rng.choice(sorted(evictable | pinned))
            for each in both:
                each.accessed(key)
        elif op < 0.6 and evictable:
            choice = rng.random()
            keys = [rng.choice(sorted(evictable))]
            if choice < 0.4:
                for each in both:
                    each.removed(keys[0])
            elif choice < 0.7:
                policy.hit_evictable(keys[0])
            else:
                keys = rng.sample(sorted(evictable), min(len(evictable), rng.randint(1, 5)))
                policy.hit_evictable_many(keys)
            if choice >= 0.4 and twin is not None:
                for key in keys:
                    twin.accessed(key)
                    twin.removed(key)
            evictable.difference_update(keys)
            pinned.update(keys)
        elif op < 0.72 and pinned:
            keys = rng.sample(sorted(pinned), min(len(pinned), rng.randint(1, 4)))
            if rng.random() < 0.5:  # and keys that were never cached or were evicted
                keys += [next_key, next_key + 1]
                next_key += 2
                keys += rng.sample(sorted(evicted), min(len(evicted), rng.randint(0, 2)))
                rng.shuffle(keys)
            policy.inserted_many(keys, [key % 2 for key in keys])
            if twin is not None:
                for key in keys:
                    twin.inserted(key, key % 2)
            pinned.difference_update(keys)
            evicted.difference_update(keys)
            evictable.update(keys)
        elif op < 0.77 and evictable:
            key = rng.choice(sorted(evictable))
            for each in both:
                each.discard(key)
            evictable.remove(key)
            evicted.add(key)
        else:
            key = policy.victim()
            if twin is not None:
                assert twin.victim() == key, "hit_evictable differs from accessed + removed"
            if not evictable:
                assert key is None
                continue
            assert key in evictable, f"victim {key!r} is not evictable"
            evictable.remove(key)
            evicted.add(key)
        assert len(policy) == len(evictable)
        assert all(key in policy for key in evictable)
        assert not any(key in policy for key in pinned | evicted)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("seed", range(4))
def test_random_lifecycle_respects_contract(name: str, seed: int) -> None:
    drive(build(name, capacity=16), seed)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("seed", range(4))
def test_shorthands_match_the_events_they_stand_for(name: str, seed: int) -> None:
    drive(build(name, capacity=16), seed, twin=build(name, capacity=16))


@pytest.mark.parametrize("name", ALL)
def test_empty_policy_has_no_victim(name: str) -> None:
    policy = build(name, capacity=4)
    assert policy.victim() is None and len(policy) == 0 and 1 not in policy


@pytest.mark.parametrize("name", ALL)
def test_drains_every_key_exactly_once(name: str) -> None:
    policy = build(name, capacity=8)
    for key in range(20):
        policy.inserted(key)
        if key % 3 == 0:
            policy.accessed(key)
    victims = [policy.victim() for _ in range(20)]
    assert sorted(victims) == list(range(20))
    assert policy.victim() is None


@pytest.mark.parametrize("name", ALL)
def test_pinned_key_is_never_a_victim(name: str) -> None:
    policy = build(name, capacity=4)
    for key in range(6):
        policy.inserted(key)
    policy.removed(0)
    policy.accessed(0)
    victims = {policy.victim() for _ in range(5)}
    assert 0 not in victims and policy.victim() is None
    policy.inserted(0)
    assert policy.victim() == 0


@pytest.mark.parametrize("name", ALL)
def test_untouched_old_key_goes_before_a_hot_one(name: str) -> None:
    """Eviction order sanity: with one key hit repeatedly, the cold ones go first."""
    policy = build(name, capacity=4)
    for key in range(4):
        policy.inserted(key)
    for _ in range(3):
        policy.accessed(0)
    assert policy.victim() != 0


@pytest.mark.parametrize("name", NAMES)
def test_policy_is_named_and_validates_capacity(name: str) -> None:
    assert POLICIES[name].name == name
    with pytest.raises(ValueError, match="positive"):
        POLICIES[name](0)


def test_registry_default_and_unknown_name() -> None:
    assert DEFAULT_POLICY in POLICIES
    assert type(make_policy("default", 8)).name == DEFAULT_POLICY
    with pytest.raises(BadArgsError, match="choose one of"):
        make_policy("belady", 8)
