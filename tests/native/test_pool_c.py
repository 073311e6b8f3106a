"""kvd/core/_pool.c against kvd/core/pool.py's Python, which is its specification.

Two pools -- one with the C bound to its tables, one without -- take the same random operations
(allocations, seals with and without parents and tiers, duplicates, puts, lookups, pins, releases,
dead owners, chosen victims, and misuse: unknown ids, ids named twice, bools, foreign owners, keys that
are not bytes) and must answer alike (results and error messages) and end every step with equal
tables, equal policy state, equal observer logs and equal invariants. A counting wrapper around
the bound object checks that the C really did the work (it may decline any call, and the Python
then does it), so the comparison cannot pass by the C side declining everything.
"""

from __future__ import annotations

import os
import random
from array import array
from collections import Counter
from dataclasses import is_dataclass, replace
from typing import Any

import pytest

from kvd.core import pool as pool_module
from kvd.errors import JournalError, KvdError
from kvd.core.policies import EvictionPolicy, make_policy
from kvd.core.pool import BlockPool, IndexRows, PoolTables

native = pool_module._built_native  # (tests bind it directly: KVD_PURE_PYTHON only turns its use off)


def test_the_module_is_built_where_ci_needs_it() -> None:
    """.ci/run sets KVD_REQUIRE_C=1: an install that silently fell back to Python fails there."""
    if native is None and os.environ.get("KVD_REQUIRE_C") != "1":
        pytest.skip("kvd/core/_pool.c is not built here and KVD_REQUIRE_C is not set")
    assert native is not None, "KVD_REQUIRE_C=1 but kvd/core/_pool.c was not built (see pip's output)"
    if os.environ.get("KVD_PURE_PYTHON") != "1":
        assert BlockPool(4)._loops is not None


needs_c = pytest.mark.skipif(native is None, reason="kvd/core/_pool.c is not built")


class CountingLoops:
    """A pool's bound kvd._pool.Loops, counting per operation the calls it did whole (those it
    did not decline) and the blocks or keys they named."""

    def __init__(self, loops: Any) -> None:
        self.loops = loops
        self.handled: Counter[str] = Counter()

    def _count(self, name: str, answer: Any, size: int) -> Any:
        if answer is not None and answer is not False:
            self.handled[name] += size
            self.handled[f"{name} one"] += size == 1
        return answer

    def allocate(self, num_blocks: Any, owner: int) -> Any:
        answer = self.loops.allocate(num_blocks, owner)
        return self._count("allocate", answer, len(answer) if answer else 0)

    def evict(self, num_needed: int) -> Any:
        answer = self.loops.evict(num_needed)  # (the blocks: counted in the observer's log)
        self.handled["evict"] += answer is None
        return answer

    def seal(self, block_ids: Any, keys: Any, *args: Any) -> Any:
        return self._count("seal", self.loops.seal(block_ids, keys, *args), len(block_ids))

    def put(self, key: Any, tier: Any) -> Any:
        answer = self.loops.put(key, tier)
        return self._count("put", answer, 1) if type(answer) is int else answer

    def lookup(self, keys: Any, owner: int) -> Any:
        return self._count("lookup", self.loops.lookup(keys, owner), len(keys))

    def pin(self, block_ids: Any, owner: int) -> Any:
        return self._count("pin", self.loops.pin(block_ids, owner), len(block_ids))

    def release(self, block_ids: Any, owner: int) -> Any:
        return self._count("release", self.loops.release(block_ids, owner), len(block_ids))

    def journal_rows(self, block_ids: Any) -> Any:
        return self._count("journal_rows", self.loops.journal_rows(block_ids), len(block_ids))


def policy_state(policy: EvictionPolicy) -> dict[str, Any]:
    """A policy's attributes as plain values: queues as item lists (their order matters), a
    tiered policy's tiers as their own states."""
    def plain(value: Any) -> Any:
        if isinstance(value, EvictionPolicy):
            return policy_state(value)
        if isinstance(value, tuple | list):
            return [plain(item) for item in value]
        if is_dataclass(value):  # (S3-FIFO's queues)
            return {name: plain(getattr(value, name)) for name in value.__slots__}
        return list(value.items()) if isinstance(value, dict) else value
    return {name: plain(value) for name, value in vars(policy).items()
            if not callable(value) and name != "_loops"}


def snapshot(pool: BlockPool) -> dict[str, Any]:
    """Everything the pool and its policy hold, as plain values (queue orders included)."""
    t = pool.tables
    plain = {name: list(getattr(t, name)) for name in (
        "refs", "hashes", "parent", "first_child", "next_sibling", "prev_sibling", "generations",
        "counts")}
    return {
        **plain, "state": bytes(t.state), "tier": bytes(t.tier), "orphan": bytes(t.is_orphan),
        "duplicate": bytes(t.is_duplicate), "free": list(t.free[:pool.num_free]),
        "index": list(t.index.items()),
        # (as sets: the order of an owner's pins means nothing, and the C updates a pin count in
        # place where Python pops and re-inserts it)
        "held": {owner: sorted(held.items()) for owner, held in t.held.items()},
        "policy": policy_state(pool.policy),
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
        self.one_block_share = one_block_share  # requests made of one block (a worker's traffic)
        self.keys: list[Any] = [b"key-%d" % i for i in range(num_keys)]
        self.keys += [("tuple-key", i) for i in range(3)]  # the embedded API allows any hashable
        self.put_keys = [(0, i) for i in range(num_keys // 2)]  # the embedded cache's: C puts them

    def some_ids(self, pool: BlockPool, owner: int) -> list[Any]:
        rng = self.rng
        held = list(pool.tables.held.get(owner, {}))
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
                            "choose_next_victim", "put"], weights=[6, 6, 6, 5, 2, 1, 1, 4])[0]
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
                ids = [b for b in range(self.num_blocks) if pool.tables.state[b] >= 2]
                ids = rng.sample(ids, min(len(ids), rng.randint(0, 8)))
            return kind, (ids, owner)
        if kind == "lookup":
            start = rng.randrange(len(self.keys))
            length = 1 if rng.random() < self.one_block_share else rng.randint(0, 12)
            return kind, ([self.keys[(start + i) % len(self.keys)] for i in range(length)], owner)
        if kind == "put":  # (a key indexed already, or a bad tier, must raise)
            key = rng.choice(self.keys if rng.random() < 0.3 else self.put_keys)
            return kind, (key, rng.choice([0, 1, 0, 1, 0, 2, True]))
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
              fail_at: int | None = None, one_block_share: float = 0.0) -> Counter[str]:
    """`policy`: a registered name, or "tiered" (prefill and decode tiers, kvd's policy in each).
    With `fail_at`, the observer raises at that eviction: the run ends there, after comparing."""
    rng = random.Random(seed)
    tiers = "prefill=0.6,decode=0.4" if policy == "tiered" else None
    observers = [RecordingObserver(fail_at), RecordingObserver(fail_at)]
    fast, pure = (BlockPool(num_blocks, make_policy("kvd" if tiers else policy, num_blocks, tiers),
                            observer=observer) for observer in observers)
    counting = CountingLoops(native.bind(fast.tables, fast.policy, fast.observer))
    fast._loops, pure._loops = counting, None
    driver = Driver(rng, num_blocks, num_keys=num_blocks + num_blocks // 2,
                    one_block_share=one_block_share)
    for step in range(num_ops):
        kind, args = driver.operation(pure)
        results = [outcome(lambda: getattr(fast, kind)(*args)),
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
    return counting.handled


@needs_c
def test_a_journal_that_raises_mid_eviction_leaves_both_pools_alike() -> None:
    for seed in range(3):
        num_evictions = run_twins("kvd", seed, num_ops=400)["evictions"]
        assert num_evictions > 10
        for fail_at in (1, 2, num_evictions // 2, num_evictions):
            assert run_twins("kvd", seed, num_ops=400, fail_at=fail_at)["journal failed"]


@needs_c
@pytest.mark.parametrize("policy", ["kvd", "s3fifo", "lru", "arc", "lfu", "sieve", "tiered"])
def test_the_c_changes_nothing_a_policy_or_the_pool_can_see(policy: str) -> None:
    handled: Counter[str] = Counter()
    for seed in range(6):
        handled += run_twins(policy, seed, num_ops=400)
    for operation in ("allocate", "seal", "lookup", "pin", "release", "journal_rows", "put"):
        assert handled[operation] > 100, (operation, handled)  # the C side did real work
    assert handled["evict"] > 20 and handled["evictions"] > 100, handled


@needs_c
@pytest.mark.parametrize("policy", ["kvd", "s3fifo", "lru", "tiered"])
def test_one_block_requests_in_c_change_nothing_a_policy_or_the_pool_can_see(policy: str) -> None:
    """Mostly one-block requests, as a worker's traffic."""
    handled: Counter[str] = Counter()
    for seed in range(6):
        handled += run_twins(policy, seed, num_ops=600, one_block_share=0.8)
    for operation in ("allocate", "seal", "release", "lookup"):
        assert handled[f"{operation} one"] > 50, (operation, handled)


@needs_c
def test_the_c_sees_what_restore_restored() -> None:
    source = BlockPool(16)
    ids = source.allocate(3, owner=1)
    source.seal(ids, [b"a", b"b", b"c"], owner=1, parents=[None, b"a", b"b"])
    source.release(ids, owner=1)
    rows = IndexRows(*map(list, zip(*source.journal_rows())))
    pool = BlockPool(16)
    pool._loops = counting = CountingLoops(native.bind(pool.tables, pool.policy, None))
    assert pool.restore(rows) == 3
    assert pool.lookup([b"c"], 2) == [ids[2]] and pool.state(ids[2]) == "sealed"
    assert counting.handled["lookup"] == 1
    assert pool.ref_count(ids[2]) == 1 and b"c" not in pool.policy
    pool.check_invariants()


@needs_c
def test_a_table_renamed_retyped_or_resized_fails_at_bind() -> None:
    """The contract is checked once, loudly: a pool change the C does not know cannot run."""
    pool = BlockPool(8, "lru")
    policy, tables = pool.policy, pool.tables
    for field, wrong in (("refs", [0] * 8), ("state", bytes(8)), ("parent", array("q", [0] * 8)),
                         ("free", array("q", [0] * 7)), ("hashes", (None,) * 8),
                         ("index", list(tables.index)), ("counts", array("q", [0] * 3))):
        with pytest.raises(TypeError, match=field):
            native.bind(replace(tables, **{field: wrong}), policy, None)

    class Renamed(PoolTables):  # (a slot renamed: the C names what it misses)
        __slots__ = ()
        COUNT_NAMES = ("free", "owned", "sealed", "chosen", *PoolTables.COUNT_NAMES[4:])
    with pytest.raises(TypeError, match="COUNT_NAMES"):
        native.bind(Renamed(**{name: getattr(tables, name) for name in PoolTables.__slots__}),
                    policy, None)
    with pytest.raises(AttributeError, match="inserted"):  # (not a policy)
        native.bind(tables, object(), None)
    bound = native.bind(tables, policy, None)
    with pytest.raises(BufferError):
        tables.state.append(0)  # (a table it holds cannot be resized under it)
    del bound


@needs_c
def test_the_c_declines_what_it_does_not_vouch_for_and_changes_nothing() -> None:
    pool = BlockPool(8, "lru")
    loops = native.bind(pool.tables, pool.policy, None)
    ids = pool.allocate(3, owner=1)
    pool.seal(ids[:1], [b"a"], owner=1)
    before = snapshot(pool)
    assert loops.allocate(True, 1) is None and loops.allocate(9, 1) is None
    assert loops.allocate(0, 1) is None and loops.allocate(2**70, 1) is None
    assert loops.seal([ids[0]], [b"x"], None, None, 1) is None  # sealed already
    for bad in ([ids[1], ids[1]], [ids[1], 8], [ids[1], -1], [ids[1], True], (ids[1],),
                [ids[1], 2**70]):
        assert loops.seal(bad, [b"x"] * len(bad), None, None, 1) is None, bad
        assert loops.release(bad, 1) is False and loops.pin(bad, 1) is False
    assert loops.seal([ids[1]], [("t",)], None, None, 1) is None  # a key that is not bytes
    assert loops.seal([ids[1]], [b"x"], [("t",)], None, 1) is None
    for tier in (2, -1, True, 1.0):
        assert loops.seal([ids[1]], [b"x"], None, [tier], 1) is None
    assert loops.seal([ids[1]], [b"x"], None, None, 2) is None  # not its owner's
    assert loops.release([ids[0], ids[0]], 1) is False  # named twice: Python counts pins
    assert loops.lookup([b"a", ("t",)], 1) is None and loops.lookup((b"a",), 1) is None
    assert loops.journal_rows([ids[0], 8]) is None
    for key, tier in ((b"a", 0), (("t",), 0), ((1, True), 0), ((1, 2.0), 0), ((), 2), (b"x", -1),
                      (b"x", True), (b"x", 1.0)):  # indexed already, not a key put hashes, tiers
        assert loops.put(key, tier) is None, (key, tier)
    assert snapshot(pool) == before
    pool.allocate(pool.num_free, owner=2)
    assert pool.num_available == 0 and loops.put(b"x", 0) is None  # nothing free or evictable
    before = snapshot(pool)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        loops.release([])


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
