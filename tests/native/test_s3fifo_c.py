"""kvd/core/policies/_s3fifo.c against S3-FIFO's and kvd's policy's Python, its specification.

Twin policies -- one with the C batch loops, one without -- take the same random events in the
order a pool sends them (keys inserted when released, pinned by hits and pins, evicted, discarded,
touched) and must end every step with equal queues, ghosts, pinned table, counters and S target,
and choose the same victims (C's victim() against Python's). Counting wrappers check that the C
side did the work.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from typing import Any

import pytest

from dataclasses import replace

from kvd.core.policies import s3fifo
from kvd.core.policies.adaptive import AdaptiveS3FIFOPolicy
from kvd.core.policies.s3fifo import S3FIFOPolicy, S3FIFOQueues

native = s3fifo._built_loops  # (tests bind it directly: KVD_PURE_PYTHON only turns its use off)
needs_c = pytest.mark.skipif(native is None, reason="kvd/core/policies/_s3fifo.c is not built")


def test_the_module_is_built_where_ci_needs_it() -> None:
    """.ci/run sets KVD_REQUIRE_C=1: an install that silently fell back to Python fails there."""
    if native is None and os.environ.get("KVD_REQUIRE_C") != "1":
        pytest.skip("kvd/core/policies/_s3fifo.c is not built here and KVD_REQUIRE_C is not set")
    assert native is not None, "KVD_REQUIRE_C=1 but kvd/core/policies/_s3fifo.c was not built"


class CountingLoops:
    """A policy's bound kvd.core.policies._s3fifo.Queues, counting the keys it did."""

    def __init__(self, loops: Any) -> None:
        self.loops = loops
        self.handled: Counter[str] = Counter()

    def insert(self, key: Any) -> bool:
        done = self.loops.insert(key)
        self.handled["insert"] += done
        return done

    def hit(self, key: Any) -> bool:
        done = self.loops.hit(key)
        self.handled["hit"] += done
        return done

    def insert_run(self, keys: list, start: int) -> int:
        position = self.loops.insert_run(keys, start)
        self.handled["insert_run"] += position - start
        return position

    def victim(self, *args: Any) -> tuple:
        answer = self.loops.victim(*args)
        self.handled["victim"] += answer[0] is not None
        return answer

    def hit_run(self, keys: list, start: int) -> int:
        position = self.loops.hit_run(keys, start)
        self.handled["hit_run"] += position - start
        return position


def state(policy: S3FIFOPolicy) -> dict[str, Any]:
    """The policy's attributes, its queues as item lists (their order matters)."""
    queues = {f"queues.{name}": list(value.items()) if isinstance(value, dict) else value
              for name in S3FIFOQueues.__slots__ for value in [getattr(policy.queues, name)]}
    return {**queues, **{name: value for name, value in vars(policy).items()
                         if name not in ("_loops", "queues")}}


def run_twins(cls: type[S3FIFOPolicy], seed: int, capacity: int, num_steps: int) -> Counter:
    """A pool's life in events: `evictable` and `pinned` are the keys in each state."""
    rng = random.Random(seed)
    fast, pure = cls(capacity), cls(capacity)
    counting = CountingLoops(native.bind(fast.queues))
    fast._loops, pure._loops = counting, None
    universe = [b"k%d" % i for i in range(capacity * 3)] + [("not", "bytes"), 7]
    evictable: list = []
    pinned: list = []
    for step in range(num_steps):
        kind = rng.choices(["insert", "hit", "victim", "accessed", "discard", "removed"],
                           weights=[8, 6, 4, 2, 1, 1])[0]
        if kind == "insert":  # a release: new keys and pinned keys coming back, in any mix
            fresh = [key for key in rng.sample(universe, rng.randint(0, 12))
                     if key not in evictable and key not in pinned]
            back = rng.sample(pinned, rng.randint(0, len(pinned)))
            batch = fresh + back
            rng.shuffle(batch)
            batch = batch[:max(0, capacity - len(evictable) - len(pinned) + len(back))]
            one = rng.random() < 0.3  # (a one-key release: `inserted` per key)
            for policy in (fast, pure):
                if one:
                    for key in batch:
                        policy.inserted(key, 0)
                else:
                    policy.inserted_many(batch, [0] * len(batch))
            pinned = [key for key in pinned if key not in batch]
            evictable += batch
        elif kind == "hit" and evictable:
            batch = rng.sample(evictable, rng.randint(1, min(12, len(evictable))))
            one = rng.random() < 0.3  # (a one-block lookup: `hit_evictable` per key)
            for policy in (fast, pure):
                if one:
                    for key in batch:
                        policy.hit_evictable(key)
                else:
                    policy.hit_evictable_many(batch)
            evictable = [key for key in evictable if key not in batch]
            pinned += batch
        elif kind == "victim" and evictable:
            victims = {fast.victim(), pure.victim()}
            assert len(victims) == 1, (seed, step)
            evictable.remove(victims.pop())
        elif kind == "accessed" and evictable + pinned:
            key = rng.choice(evictable + pinned)
            fast.accessed(key)
            pure.accessed(key)
        elif kind == "discard" and evictable:
            key = rng.choice(evictable)
            fast.discard(key)
            pure.discard(key)
            evictable.remove(key)
        elif kind == "removed" and evictable:
            key = rng.choice(evictable)
            fast.removed(key)
            pure.removed(key)
            evictable.remove(key)
            pinned.append(key)
        assert state(fast) == state(pure), (cls.name, seed, step, kind)
    return counting.handled


@needs_c
@pytest.mark.parametrize("cls", [S3FIFOPolicy, AdaptiveS3FIFOPolicy], ids=lambda cls: cls.name)
def test_the_c_batch_loops_change_nothing_the_policy_holds(cls: type[S3FIFOPolicy]) -> None:
    handled: Counter[str] = Counter()
    for seed in range(8):
        for capacity in (4, 32, 200):
            handled += run_twins(cls, seed, capacity, num_steps=350)
    assert handled["insert_run"] > 1000 and handled["hit_run"] > 1000, handled
    assert handled["insert"] > 300 and handled["hit"] > 300, handled
    assert handled["victim"] > 1000, handled


@needs_c
def test_subclasses_run_the_python_whose_hooks_they_may_change() -> None:
    class Mine(AdaptiveS3FIFOPolicy):
        pass

    assert Mine(8)._loops is None
    if os.environ.get("KVD_PURE_PYTHON") != "1":
        assert AdaptiveS3FIFOPolicy(8)._loops is not None and S3FIFOPolicy(8)._loops is not None


@needs_c
def test_queues_renamed_or_retyped_fail_at_bind() -> None:
    queues = AdaptiveS3FIFOPolicy(8).queues
    for field, wrong in (("small", dict(queues.small)), ("main", []), ("pinned", queues.small),
                         ("ghost", None), ("main_ghost", {}), ("ghost_limit", -1)):
        with pytest.raises(TypeError, match=field):
            native.bind(replace(queues, **{field: wrong}))

    class Repacked(S3FIFOQueues):  # (pinned keys packed another way: the C must not guess)
        __slots__ = ()
        IN_MAIN = 0b1000
    with pytest.raises(TypeError, match="IN_MAIN"):
        native.bind(Repacked(**{name: getattr(queues, name) for name in S3FIFOQueues.__slots__}))


@needs_c
def test_a_run_stops_at_a_ghost_hit_and_at_keys_it_cannot_hash_safely() -> None:
    policy = AdaptiveS3FIFOPolicy(8)
    queues = policy.queues
    loops = native.bind(queues)
    queues.main_ghost[b"g"] = None
    assert loops.insert_run([b"a", b"g", b"b"], 0) == 1
    assert list(queues.small.items()) == [(b"a", 0)] and b"g" in queues.main_ghost
    assert loops.insert_run([b"b", ("t",)], 0) == 1
    assert loops.hit_run([b"a", b"missing"], 0) == 1  # not evictable: Python's KeyError
    assert queues.pinned == {b"a": 1} and list(queues.small) == [b"b"]
    assert loops.insert_run((b"x",), 0) == 0  # only lists
    with pytest.raises(ValueError, match="start"):
        loops.hit_run([b"a"], 2)
