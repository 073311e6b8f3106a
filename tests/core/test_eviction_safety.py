"""Eviction safety: pinned blocks are never evicted, reused or overwritten, whatever the policy.

1. A 100 %-pinned pool (sealed and owned blocks) refuses allocation, sequence opens and forks
   with NoSpaceError and evicts nothing; freeing one pin makes exactly that block evictable.
2. A stale reader can tell: a block's generation counter moves when it is evicted and reused.
3. The race: readers pin a key's block and read it while publishers release their pins on it
   and churners allocate everything they can (evicting every unpinned block) and overwrite it
   with 0xFF. Every read must see its key's bytes and an unchanged generation.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
import pytest
from stress.stress_procs import RACE_COUNTERS, block_bytes, context, pattern, race_main

import kvd
from kvd.core.policies import POLICIES

GEOMETRY = {"layers": 2, "kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32"}
NUM_BLOCKS = 16


def make_keys(label: str, num: int) -> list[bytes]:
    return [hashlib.blake2b(f"{label}-{i}".encode(), digest_size=16).digest()
            for i in range(num)]


def write(client: kvd.Client, block_ids: list[int], keys: list[bytes]) -> None:
    for block_id, key in zip(block_ids, keys):
        block_bytes(client, block_id)[:] = pattern(key, client.geometry.block_nbytes)


def intact(client: kvd.Client, block_ids: list[int], keys: list[bytes]) -> bool:
    return all(np.array_equal(block_bytes(client, b), pattern(k, client.geometry.block_nbytes))
               for b, k in zip(block_ids, keys))


@pytest.mark.integration
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fully_pinned_pool_refuses_and_evicts_nothing(daemon_factory: Any, policy: str) -> None:
    handle = daemon_factory(num_blocks=NUM_BLOCKS, policy=policy, **GEOMETRY)
    keys = make_keys(policy, 10)
    with handle.connect() as owner, handle.connect() as other:
        block_ids = owner.alloc(NUM_BLOCKS)
        write(owner, block_ids, keys)
        owner.seal(block_ids[:10], keys)  # 10 sealed and pinned, 6 owned (unsealed)
        generations = [owner.generation(b) for b in range(NUM_BLOCKS)]
        before = other.stats()
        assert other.lookup(keys) == block_ids[:10]  # shared pins change nothing
        with pytest.raises(kvd.NoSpaceError):
            other.alloc(1)
        with pytest.raises(kvd.NoSpaceError):
            other.open_sequence(np.arange(9))
        after = other.stats()
        assert after["evictions"] == before["evictions"]
        assert (after["free"], after["cached"]) == (0, 0)
        assert [owner.generation(b) for b in range(NUM_BLOCKS)] == generations
        assert intact(owner, block_ids[:10], keys)
        other.release(block_ids[:10])

        owner.release(block_ids[3:4])  # now exactly one block is evictable
        with pytest.raises(kvd.NoSpaceError):
            other.alloc(2)  # all or nothing: not even the evictable one goes
        assert other.stats()["cached"] == 1
        assert other.alloc(1) == block_ids[3:4]
        assert owner.generation(block_ids[3]) == generations[block_ids[3]] + 1
        assert intact(owner, block_ids[:3] + block_ids[4:10], keys[:3] + keys[4:])


@pytest.mark.integration
def test_stale_reader_sees_generation_change(kvd_daemon: Any) -> None:
    keys = make_keys("stale", 1)
    with kvd_daemon.connect() as writer, kvd_daemon.connect() as reader:
        block_ids = writer.alloc(1)
        write(writer, block_ids, keys)
        writer.seal(block_ids, keys)
        writer.release(block_ids)
        hit_ids = reader.lookup(keys)
        generation = reader.generation(hit_ids[0])
        reader.release(hit_ids)  # the reader keeps the id but no pin: it is now stale
        num_blocks = reader.geometry.num_blocks
        writer.release(writer.alloc(num_blocks))  # evicts and reuses every block
        assert reader.generation(hit_ids[0]) != generation
        assert reader.lookup(keys) == []


@pytest.mark.integration
def test_pinned_reads_survive_release_and_churn(daemon_factory: Any) -> None:
    handle = daemon_factory(num_blocks=NUM_BLOCKS, **GEOMETRY)
    keys = make_keys("race", 6)
    roles = ["reader", "reader", "publisher", "churner"]
    counters = context().Array("q", (len(roles) + 1) * len(RACE_COUNTERS), lock=False)
    processes = [context().Process(target=race_main, daemon=True,
                                   args=(role, handle.paths.socket_path, keys, counters, slot))
                 for slot, role in enumerate(roles, start=1)]
    for process in processes:
        process.start()
    time.sleep(4)
    counters[0] = 1
    for process in processes:
        process.join(10)
    assert [p.exitcode for p in processes] == [0] * len(roles)
    table = np.frombuffer(counters, dtype=np.int64).reshape(-1, len(RACE_COUNTERS))[1:]
    totals = dict(zip(RACE_COUNTERS, table.sum(axis=0).tolist()))
    print(f"\nrace: {totals}")
    assert totals["corrupt_reads"] == 0, totals
    assert totals["verified_blocks"] > 0 and totals["churned_blocks"] > 0, totals
    with handle.connect() as client:
        assert client.stats()["evictions"] > 0


@pytest.mark.integration
def test_generation_rejects_ids_outside_the_pool(kvd_daemon: Any) -> None:
    """Regression: generation(-1) read the last block's counter, so a stale-reader check on a
    bad id silently compared the wrong block; a closed client raised AttributeError."""
    client = kvd_daemon.connect()
    num_blocks = client.geometry.num_blocks
    for bad_id in (-1, num_blocks, True, 1.0):
        with pytest.raises(kvd.BadArgsError):
            client.generation(bad_id)
    assert client.generation(np.int64(num_blocks - 1)) >= 0
    client.close()
    with pytest.raises(kvd.DisconnectedError):
        client.generation(0)
