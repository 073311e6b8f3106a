"""kvd/core/_pool.c against kvd/core/pool.py's Python loops, which are its specification.

Two pools -- one with the C loops, one without -- take the same random operations (allocations,
seals with and without parents and tiers, duplicates, lookups, pins, releases, dead owners, chosen
victims, and misuse: unknown ids, ids named twice, bools, foreign owners, keys that are not bytes)
and must answer alike (results and error messages) and end every step with equal tables, equal
policy state and equal invariants. A counting wrapper around the module checks that its fast
paths really did the work, so the comparison cannot pass by the C side declining everything.
"""

from __future__ import annotations

import os
import random
from array import array
from collections import Counter
from typing import Any

import pytest

from kvd.core import pool as pool_module
from kvd.errors import InternalError, JournalError, KvdError
from kvd.core.policies import EvictionPolicy, make_policy
from kvd.core.pool import BlockPool, IndexRows

loops = pool_module._built_loops  # (tests call it directly: KVD_PURE_PYTHON only turns its use off)


def test_the_module_is_built_where_ci_needs_it() -> None:
    """.ci/run sets KVD_REQUIRE_C=1: an install that silently fell back to Python fails there."""
    if loops is None and os.environ.get("KVD_REQUIRE_C") != "1":
        pytest.skip("kvd/core/_pool.c is not built here and KVD_REQUIRE_C is not set")
    assert loops is not None, "KVD_REQUIRE_C=1 but kvd/core/_pool.c was not built (see pip's output)"
    if os.environ.get("KVD_PURE_PYTHON") != "1":
        assert BlockPool(4)._loops is loops


needs_c = pytest.mark.skipif(loops is None, reason="kvd/core/_pool.c is not built")


class CountingLoops:
    """kvd._pool, counting the blocks each function handled (a run's stop minus its start)."""

    def __init__(self) -> None:
        self.handled: Counter[str] = Counter()

    def own(self, block_ids: list[int], *tables: Any) -> bool:
        done = loops.own(block_ids, *tables)
        self.handled["own"] += len(block_ids) if done else 0
        return done

    def prefix(self, index: dict, keys: list) -> list[int] | None:
        found = loops.prefix(index, keys)
        self.handled["prefix"] += len(found) if found is not None else 0
        return found

    def first_unsealable(self, block_ids: list[int], *tables: Any) -> int:
        position = loops.first_unsealable(block_ids, *tables)
        self.handled["first_unsealable"] += position
        return position

    def seal_run(self, block_ids: list[int], keys: list, start: int, *tables: Any) -> int:
        position = loops.seal_run(block_ids, keys, start, *tables)
        self.handled["seal_run"] += position - start
        return position

    def pin_run(self, block_ids: list[int], start: int, *tables: Any) -> tuple[int, int]:
        position, num_hits = loops.pin_run(block_ids, start, *tables)
        self.handled["pin_run"] += position - start
        return position, num_hits

    def evict_run(self, num_needed: int, victim: Any, evicted: Any, freed: list[int],
                  *tables: Any) -> tuple | None:
        try:
            return loops.evict_run(num_needed, victim, evicted, freed, *tables)
        finally:
            self.handled["evict_run"] += len(freed)

    def journal_rows(self, block_ids: list[int], *tables: Any) -> list | None:
        rows = loops.journal_rows(block_ids, *tables)
        self.handled["journal_rows"] += len(rows) if rows is not None else 0
        return rows

    def unpin_run(self, block_ids: list[int], start: int, *tables: Any) -> tuple[int, int]:
        position, num_cached = loops.unpin_run(block_ids, start, *tables)
        self.handled["unpin_run"] += position - start
        return position, num_cached

    def _one(self, name: str, tables: tuple, *args: Any) -> Any:
        """A one-block request, counted when C did it (not its method, tables[1])."""
        fell_back: list[bool] = []
        method = tables[1]

        def counted_method(*args: Any) -> Any:
            fell_back.append(True)
            return method(*args)
        try:
            return getattr(loops, name)((tables[0], counted_method, *tables[2:]), *args)
        finally:
            self.handled[name] += not fell_back

    def alloc_one(self, tables: tuple, num_blocks: Any, owner: int) -> Any:
        return self._one("alloc_one", tables, num_blocks, owner)

    def release_one(self, tables: tuple, block_ids: Any, owner: int) -> Any:
        return self._one("release_one", tables, block_ids, owner)

    def lookup_one(self, tables: tuple, keys: Any, owner: int) -> Any:
        return self._one("lookup_one", tables, keys, owner)

    def seal_one(self, tables: tuple, *args: Any) -> Any:
        return self._one("seal_one", tables, *args)


def policy_state(policy: EvictionPolicy) -> dict[str, Any]:
    """A policy's attributes as plain values: queues as item lists (their order matters), a
    tiered policy's tiers as their own states."""
    def plain(value: Any) -> Any:
        if isinstance(value, EvictionPolicy):
            return policy_state(value)
        if isinstance(value, tuple | list):
            return [plain(item) for item in value]
        return list(value.items()) if isinstance(value, dict) else value
    return {name: plain(value) for name, value in vars(policy).items() if not callable(value)}


def snapshot(pool: BlockPool) -> dict[str, Any]:
    """Everything the pool and its policy hold, as plain values (queue orders included)."""
    return {
        "state": bytes(pool._state), "refs": list(pool._refs), "hashes": list(pool._hashes),
        "free": list(pool._free), "index": list(pool._index.items()),
        # (as sets: the order of an owner's pins means nothing, and the C loops update a pin
        # count in place where Python pops and re-inserts it)
        "held": {owner: sorted(held.items()) for owner, held in pool._held.items()},
        "tier": bytes(pool._tier), "orphan": bytes(pool._is_orphan),
        "duplicate": bytes(pool._is_duplicate), "parent": list(pool._parent),
        "first_child": list(pool._first_child), "next_sibling": list(pool._next_sibling),
        "prev_sibling": list(pool._prev_sibling), "generations": pool.generations.tolist(),
        "counts": (pool.num_owned, pool.num_sealed, pool.num_cached, pool._next_victim),
        "counters": dict(pool.counters), "policy": policy_state(pool.policy),
    }


def outcome(call: Any) -> Any:
    try:
        return ("ok", call())
    except KvdError as exc:
        return (type(exc).__name__, str(exc))


class Driver:
    """Random operations on a pool of `num_blocks`, drawn from one seeded generator."""

    def __init__(self, rng: random.Random, num_blocks: int, num_keys: int,
                 one_block_share: float = 0.0) -> None:
        self.rng, self.num_blocks = rng, num_blocks
        self.one_block_share = one_block_share  # requests made of one block (hot_ops' own)
        self.keys: list[Any] = [b"key-%d" % i for i in range(num_keys)]
        self.keys += [("tuple-key", i) for i in range(3)]  # the embedded API allows any hashable

    def some_ids(self, pool: BlockPool, owner: int) -> list[Any]:
        rng = self.rng
        held = list(pool._held.get(owner, {}))
        ids = rng.sample(held, rng.randint(0, len(held))) if held else []
        if held and rng.random() < self.one_block_share:
            ids = [rng.choice(held)]
        if ids and rng.random() < 0.1:
            ids.append(rng.choice(ids))  # named twice
        if rng.random() < 0.05:
            ids.insert(rng.randint(0, len(ids)),
                       rng.choice([self.num_blocks, -1, True, 2**70, "3", rng.randrange(self.num_blocks)]))
        return ids

    def operation(self, pool: BlockPool) -> tuple[str, tuple]:
        """An operation and its arguments, drawn against `pool`'s current holdings (the twins'
        are equal, so either may be asked)."""
        rng = self.rng
        owner = rng.randrange(3)
        kind = rng.choices(["allocate", "seal", "release", "lookup", "pin", "release_owner",
                            "choose_next_victim"], weights=[6, 6, 6, 5, 2, 1, 1])[0]
        if kind == "allocate":
            one = rng.random() < self.one_block_share
            return kind, (1 if one else rng.choice([0, 1, 2, 5, 16, 40]), owner)
        if kind == "seal":
            ids = self.some_ids(pool, owner)
            start = rng.randrange(len(self.keys))
            chain = rng.random() < 0.5  # consecutive keys: a chain, earlier blocks the parents
            keys = [self.keys[(start + i) % len(self.keys)] if chain else rng.choice(self.keys)
                    for i in range(len(ids))]
            parents = None
            if rng.random() < 0.5:
                parents = [rng.choice(self.keys) if rng.random() < 0.2 else
                           (keys[i - 1] if i else None) for i in range(len(ids))]
            tiers = [rng.randrange(2) for _ in ids] if rng.random() < 0.3 else None
            if rng.random() < 0.05:  # misuse, and a bool that Python takes for tier 1
                tiers = [rng.choice([2, -1, True, 1.0])] * len(ids)
            return kind, (ids, keys, owner, parents, tiers)
        if kind in ("release", "pin"):
            ids = self.some_ids(pool, owner)
            if kind == "pin" and rng.random() < 0.5:  # share someone else's sealed blocks
                ids = [b for b in range(self.num_blocks) if pool._state[b] >= 2]
                ids = rng.sample(ids, min(len(ids), rng.randint(0, 8)))
            return kind, (ids, owner)
        if kind == "lookup":
            start = rng.randrange(len(self.keys))
            length = 1 if rng.random() < self.one_block_share else rng.randint(0, 12)
            return kind, ([self.keys[(start + i) % len(self.keys)] for i in range(length)], owner)
        if kind == "release_owner":
            return kind, (owner,)
        return kind, ()


class RecordingObserver:
    """What a journal hears, in order; raises JournalError at eviction number `fail_at`."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.log: list[tuple] = []
        self.fail_at = fail_at

    def sealed(self, rows: list) -> None:
        self.log.append(("sealed", rows))

    def evicted(self, block_id: int) -> None:
        self.log.append(("evicted", block_id))
        if self.fail_at is not None and sum(entry[0] == "evicted" for entry in self.log) == self.fail_at:
            raise JournalError("failpoint: the journal cannot be written")


def run_twins(policy: str, seed: int, num_ops: int, num_blocks: int = 48,
              fail_at: int | None = None, one_block_share: float = 0.0) -> CountingLoops:
    """`policy`: a registered name, or "tiered" (prefill and decode tiers, kvd's policy in each).
    With `fail_at`, the observer raises at that eviction: the run ends there, after comparing.
    The C pool takes allocate, release and lookup through its hot_ops (the Service's path), the
    Python one through its methods."""
    rng = random.Random(seed)
    tiers = "prefill=0.6,decode=0.4" if policy == "tiered" else None
    observers = [RecordingObserver(fail_at), RecordingObserver(fail_at)]
    fast, pure = (BlockPool(num_blocks, make_policy("kvd" if tiers else policy, num_blocks, tiers),
                            observer=observer) for observer in observers)
    counting = CountingLoops()
    fast._loops, pure._loops = counting, None
    hot = {kind: fast.hot_ops(fast.allocate)[op] for kind, op in (
        ("allocate", "alloc"), ("release", "release"), ("lookup", "lookup"), ("seal", "seal"))}
    driver = Driver(rng, num_blocks, num_keys=num_blocks + num_blocks // 2,
                    one_block_share=one_block_share)
    for step in range(num_ops):
        kind, args = driver.operation(pure)
        # (the hot seal takes the wire's order: block_ids, keys, parents, tiers, owner)
        hot_args = (*args[:2], *args[3:], args[2]) if kind == "seal" else args
        results = [outcome(lambda: hot.get(kind, getattr(fast, kind))(*hot_args)),
                   outcome(lambda: getattr(pure, kind)(*args))]
        context = f"{policy} seed {seed} step {step}: {kind}{args}"
        assert results[0] == results[1], context
        assert snapshot(fast) == snapshot(pure), context
        assert observers[0].log == observers[1].log, context
        if results[0][0] == "JournalError":
            counting.handled["journal failed"] += 1
            break  # (a half-done eviction breaks the invariants, alike in both)
        fast.check_invariants()
    counting.handled["evictions"] = sum(entry[0] == "evicted" for entry in observers[1].log)
    return counting


@needs_c
def test_a_journal_that_raises_mid_eviction_leaves_both_pools_alike() -> None:
    for seed in range(3):
        num_evictions = run_twins("kvd", seed, num_ops=400).handled["evictions"]
        assert num_evictions > 10
        for fail_at in (1, 2, num_evictions // 2, num_evictions):
            assert run_twins("kvd", seed, num_ops=400, fail_at=fail_at).handled["journal failed"]


@needs_c
@pytest.mark.parametrize("policy", ["kvd", "s3fifo", "lru", "arc", "lfu", "sieve", "tiered"])
def test_the_c_loops_change_nothing_a_policy_or_the_pool_can_see(policy: str) -> None:
    handled: Counter[str] = Counter()
    for seed in range(6):
        handled += run_twins(policy, seed, num_ops=400).handled
    for function in ("own", "prefix", "first_unsealable", "seal_run", "pin_run", "unpin_run",
                     "evict_run", "journal_rows"):
        assert handled[function] > 100, (function, handled)  # the C side did real work


@needs_c
@pytest.mark.parametrize("policy", ["kvd", "s3fifo", "lru", "tiered"])
def test_one_block_requests_in_c_change_nothing_a_policy_or_the_pool_can_see(policy: str) -> None:
    """Mostly one-block requests, as a worker's traffic: hot_ops' C does them whole."""
    handled: Counter[str] = Counter()
    for seed in range(6):
        handled += run_twins(policy, seed, num_ops=600, one_block_share=0.8).handled
    for function in ("alloc_one", "seal_one", "release_one", "lookup_one"):
        assert handled[function] > 50, (function, handled)  # (the rest were Python's to do)


def test_hot_ops_come_after_restore_and_see_what_it_restored() -> None:
    source = BlockPool(16)
    ids = source.allocate(3, owner=1)
    source.seal(ids, [b"a", b"b", b"c"], owner=1, parents=[None, b"a", b"b"])
    source.release(ids, owner=1)
    rows = IndexRows(*map(list, zip(*source.journal_rows())))
    pool = BlockPool(16)
    assert pool.restore(rows) == 3
    events = pool.policy.c_events
    assert events is None or events[1] is pool.policy._small  # (None: KVD_PURE_PYTHON=1)
    lookup = pool.hot_ops(pool.allocate)["lookup"]
    assert lookup([b"c"], 2) == [ids[2]] and pool.state(ids[2]) == "sealed"
    assert pool.ref_count(ids[2]) == 1 and b"c" not in pool.policy
    pool.check_invariants()
    late = BlockPool(16)
    late.hot_ops(late.allocate)
    with pytest.raises(InternalError, match="before hot_ops"):
        late.restore(rows)


@needs_c
def test_a_run_stops_before_a_block_it_must_leave_to_python() -> None:
    """The stop is the first such block, and nothing of it has changed."""
    pool = BlockPool(8, "lru")
    ids = pool.allocate(4, owner=1)
    pool.seal(ids[:2], [b"a", b"b"], owner=1)
    held, before = pool._held[1], snapshot(pool)
    order = [ids[1], ids[0], ids[2]]  # two sealed, then an OWNED block (freed: Python's)
    cached_keys: list = []
    position, num_cached = loops.unpin_run(order, 0, held, pool._state, pool._refs, pool._hashes,
                                           pool._tier, pool._is_orphan, pool._is_duplicate,
                                           cached_keys, [])
    assert (position, num_cached, cached_keys) == (2, 2, [b"b", b"a"])
    assert pool._state[ids[2]] == 1 and held[ids[2]] == 1 and before["held"][1][2:] == [(ids[2], 1), (ids[3], 1)]
    for bad in ([ids[0], 8], [ids[0], -1], [ids[0], True], [ids[0], 2**70], [ids[0], 1.0]):
        assert loops.first_unsealable(bad, [b"x", b"y"], held, pool._state) in (0, 1)
    assert loops.own([pool._free[-1], 8], {}, pool._state, pool._refs) is False
    assert loops.prefix({b"a": 0}, (b"a",)) is None  # only lists
    with pytest.raises(ValueError, match="start"):
        loops.pin_run([1], 2, {}, pool._state, pool._refs, pool._hashes, -1, True, [])
    with pytest.raises(TypeError, match="takes 4 arguments"):
        loops.own([])


@needs_c
def test_tables_of_the_wrong_shape_stop_every_run_at_its_start() -> None:
    pool = BlockPool(8, "lru")
    ids = pool.allocate(2, owner=1)
    short = bytearray(4)
    held = pool._held[1]
    assert loops.own([pool._free[-1]], {}, short, pool._refs) is False
    assert loops.first_unsealable(ids, [b"a", b"b"], held, bytes(pool._state)) == 0
    links = (pool._parent, pool._first_child, pool._next_sibling, pool._prev_sibling)
    tables = (pool._tier, pool._is_duplicate, pool._is_orphan, pool._index)
    assert loops.seal_run(ids, [b"a", b"b"], 0, None, None, pool._state, pool._hashes[:4],
                          *tables, links, []) == 0
    assert loops.seal_run(ids, [b"a"], 0, None, None, pool._state, pool._hashes, *tables, links,
                          []) == 0
    for bad_links in (links[:3], (*links[:3], bytearray(32)), (*links[:3], array("q", [0] * 8)),
                      (*links[:3], links[3][:4]), None):  # a parent to link: stop there
        assert loops.seal_run(ids, [b"a", b"b"], 0, None, [None, b"a"], pool._state,
                              pool._hashes, *tables, bad_links, []) == 1
        pool._state[ids[0]], pool._hashes[ids[0]] = 1, None  # (undo the first block's seal)
        del pool._index[b"a"]
    assert loops.pin_run(ids, 0, held, pool._state, tuple(pool._refs), pool._hashes, -1, False,
                         []) == (0, 0)
    assert loops.unpin_run(ids, 0, held, pool._state, pool._refs, pool._hashes, short,
                           pool._is_orphan, pool._is_duplicate, [], []) == (0, 0)
    assert pool.state(ids[0]) == "owned" and not pool._index


@needs_c
@pytest.mark.parametrize("policy", ["s3fifo", "kvd"])
def test_tuples_of_ids_and_keys_do_what_lists_do(policy: str) -> None:
    """Regression: a C run handed a tuple (not its to take) returned position 0, not its start,
    so the Python loop went on from 0 again and again: seal and pin never returned (refs
    climbing), release popped twice; S3-FIFO's inserted_many hung, hit_evictable_many raised."""
    fast, pure = BlockPool(8, policy), BlockPool(8, policy)
    pure._loops = None
    for pool in (fast, pure):
        ids = tuple(pool.allocate(3, owner=1))
        assert pool.seal(ids, (b"a", b"b", b"c"), owner=1) == [True] * 3
        pool.pin(ids, owner=1)
        pool.release(ids, owner=1)
        pool.release(ids, owner=1)  # all three cached now
        assert pool.lookup((b"a", b"b", b"c"), owner=1) == list(ids)
        pool.release(ids, owner=1)
        pool.check_invariants()
    assert snapshot(fast) == snapshot(pure)
    policies = [make_policy(policy, 8), make_policy(policy, 8)]
    policies[1]._loops = None
    for each in policies:
        each.inserted_many((b"x", b"y", b"z"), (0, 0, 0))
        each.hit_evictable_many((b"x", b"y"))
        each.inserted_many((b"x", b"y"), (0, 0))
    assert [[each.victim() for _ in range(4)] for each in policies] == [[b"z", b"x", b"y", None]] * 2
