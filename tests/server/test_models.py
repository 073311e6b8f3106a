"""Sequences that span pools (issue 31 item 5): a model over a full-attention pool and a
sliding-window pool, one sequence with a block table per pool, the hybrid prefix-hit rule, and
decode that releases the window pool's blocks outside the window."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvd.errors import NotFoundError
from kvd.hashing import hash_blocks

BLOCK = 4
WINDOW = 10  # a hit needs ceil(9 / 4) = 3 window blocks before the hit point
FULL = f"full:layers=2,kv-heads=2,head-dim=8,dtype=float32,block-size={BLOCK}"
SLIDING = f"sliding:layers=2,kv-heads=2,head-dim=8,dtype=float32,block-size={BLOCK},window={WINDOW}"
MEMORY = 512 * 1024


@pytest.fixture
def model_daemon(daemon_factory, monkeypatch):
    monkeypatch.setenv("KVD_DEBUG", "1")  # the daemon gets the check_invariants op
    return daemon_factory(["--pool", FULL, "--pool", SLIDING, "--model", "hybrid:full,sliding"],
                          memory=MEMORY)


def test_a_model_sequence_has_a_block_table_per_pool(model_daemon):
    with model_daemon.connect() as client:
        assert client.info["models"] == {"hybrid": ["full", "sliding"]}
        seq = client.open_model_sequence("hybrid", list(range(10)))
        assert seq.num_cached_tokens == 0 and seq.num_tokens == 10
        assert {name: len(ids) for name, ids in seq.block_ids.items()} == {"full": 3,
                                                                          "sliding": 3}
        # The per-pool ops see the same sequence id in each pool.
        info = client._call("seq_info@sliding", {"seq_id": seq.seq_id})
        assert info["block_ids"] == seq.block_ids["sliding"]
        new = client.extend_model_sequence(seq, [10, 11, 12])
        assert [len(ids) for ids in new.values()] == [1, 1]
        assert client.commit_model_sequence(seq) == {"full": 1, "sliding": 1}  # (2 by extend)
        client.close_model_sequence(seq)
        again = client.open_model_sequence("hybrid", list(range(13)))
        assert again.num_cached_tokens == 12
        client.close_model_sequence(again)
        assert client._call("check_invariants", {})


def _seal_raw(client, pool, tokens, salt, indices):
    """Cache in `pool` only the blocks `indices` of `tokens`'s chain (raw alloc and seal)."""
    hashes = hash_blocks(np.asarray(tokens, dtype="<u4"), BLOCK, salt=salt)
    ids = client.alloc(len(indices), pool=pool)
    client.seal(ids, [hashes[index] for index in indices], pool=pool)
    client.release(ids, pool=pool)


@pytest.mark.parametrize("full, sliding, num_hit", [
    (range(8), [5, 6, 7], 8),  # the window before the hit point is all a window pool needs
    (range(8), [2, 3, 4, 6, 7], 5),  # 8 lacks block 5, 6 and 7 lack 5: 5 has 2, 3, 4
    (range(4), range(8), 4),  # the full pool's prefix bounds the hit
    (range(8), [0, 1], 2),  # a hit shorter than the window needs all its blocks
    (range(8), [], 0),
])
def test_a_hit_needs_every_full_block_and_the_window_before_it(model_daemon, full, sliding,
                                                              num_hit):
    tokens = list(range(100, 133))  # 8 full blocks + 1 token
    with model_daemon.connect() as client:
        _seal_raw(client, "full", tokens, b"", list(full))
        _seal_raw(client, "sliding", tokens, b"", list(sliding))
        seq = client.open_model_sequence("hybrid", tokens)
        assert seq.num_cached_tokens == num_hit * BLOCK
        held = seq.block_ids["sliding"]
        first = max(num_hit - 3, 0)
        assert held[:first] == [-1] * first and -1 not in held[first:]
        assert -1 not in seq.block_ids["full"] and len(held) == len(seq.block_ids["full"]) == 9
        client.close_model_sequence(seq)
        assert client._call("check_invariants", {})


def test_decode_holds_at_most_the_window_in_the_window_pool(model_daemon):
    bound = math.ceil(WINDOW / BLOCK) + 1
    with model_daemon.connect() as client:
        seq = client.open_model_sequence("hybrid", [7, 8, 9])
        for token in range(300):  # a long generation: one token a step
            client.extend_model_sequence(seq, [token])
            daemon_table = client._call("seq_info@sliding", {"seq_id": seq.seq_id})["block_ids"]
            assert daemon_table == seq.block_ids["sliding"], token
            assert sum(block != -1 for block in daemon_table) <= bound
        assert len(seq.block_ids["full"]) == math.ceil(303 / BLOCK)
        sliding = client.stats()["pools"]["sliding"]
        assert sliding["owned"] + sliding["sealed"] <= bound  # (sealed: pinned, not cached)
        # What decode released stays cached: the same prompt reuses the full pool's prefix and
        # the window before the hit point.
        client.commit_model_sequence(seq)
        tokens = [7, 8, 9, *range(300)]
        client.close_model_sequence(seq)
        again = client.open_model_sequence("hybrid", tokens)
        assert again.num_cached_tokens == (len(tokens) - 1) // BLOCK * BLOCK
        client.close_model_sequence(again)
        assert client._call("check_invariants", {})


def test_closing_the_session_closes_its_model_sequences(model_daemon):
    with model_daemon.connect() as client:
        client.open_model_sequence("hybrid", list(range(50)))
        fork = client._call("seq_fork@hybrid", {"seq_id": client.open_model_sequence(
            "hybrid", list(range(9))).seq_id})
        assert set(fork["pools"]) == {"full", "sliding"}
    with model_daemon.connect() as client:
        pools = client.stats()["pools"]
        assert [pools[name][state] for name in ("full", "sliding")
                for state in ("owned", "sealed")] == [0, 0, 0, 0]
        assert [pins for _, _, pins in client._call("check_invariants", {})] == [0]


def test_model_errors_are_typed(model_daemon, daemon_factory):
    with model_daemon.connect() as client:
        with pytest.raises(NotFoundError, match="models hybrid"):
            client.open_model_sequence("nope", [1, 2])
        seq = client.open_model_sequence("hybrid", [1, 2])
        # closing one pool's part leaves the sequence the session's until the other closes
        client._call("seq_close@full", {"seq_id": seq.seq_id})
        with pytest.raises(NotFoundError):
            client.extend_model_sequence(seq, [3])
        client._call("seq_close@sliding", {"seq_id": seq.seq_id})
        assert client._call("check_invariants", {})
