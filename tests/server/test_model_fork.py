"""`seq_fork@MODEL` against a real daemon started with `--model` (issue 31): a fork of a sequence
spanning a full-attention pool and a sliding-window pool shares the sealed head in both pools
copy-on-write, the two extend independently, the window pool's releases never free what the
other sequence still reads, closing either leaves the other intact, and the per-session limits
and errors hold for model forks as they do for one pool's."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvd
from kvd.errors import BadArgsError, DeniedError, NoSpaceError, NotFoundError, TooLargeError

BLOCK = 4
WINDOW = 10
BOUND = math.ceil(WINDOW / BLOCK) + 1  # window-pool blocks a decoding sequence holds at most
FULL = f"full:layers=2,kv-heads=2,head-dim=8,dtype=float32,block-size={BLOCK}"
SLIDING = (f"sliding:layers=1,kv-heads=2,head-dim=8,dtype=float32,block-size={BLOCK},"
           f"window={WINDOW}")
POOLS = ("full", "sliding")
PROMPT = list(range(100, 114))  # 3 full blocks and 2 tokens


def _start(daemon_factory, monkeypatch, *flags, memory=512 * 1024):
    monkeypatch.setenv("KVD_DEBUG", "1")  # the daemon gets the check_invariants op
    return daemon_factory(["--pool", FULL, "--pool", SLIDING, "--model", "hybrid:full,sliding",
                           *flags], memory=memory)


@pytest.fixture
def model_daemon(daemon_factory, monkeypatch):
    return _start(daemon_factory, monkeypatch)


def _write(client, seq, tokens, start, mark=0):
    """Write token t's KV (the value t + mark) in every pool's block for positions
    [start, start + len(tokens))."""
    for offset, token in enumerate(tokens):
        position = start + offset
        for pool in POOLS:
            block_id = seq.block_ids[pool][position // BLOCK]
            if block_id != -1:
                client.view(block_id, pool)[:, :, position % BLOCK] = token + mark


def _kv(client, pool, block_id):
    """The value each slot of a block holds (what `_write` wrote there)."""
    view = client.view(block_id, pool)
    return [float(view[0, 0, slot, 0, 0]) for slot in range(BLOCK)]


def _daemon_table(client, seq, pool):
    return client._call(f"seq_info@{pool}", {"seq_id": seq.seq_id})["block_ids"]


def _pinned(client):
    """Each pool's blocks in use (owned or sealed-and-pinned)."""
    pools = client.stats()["pools"]
    return {pool: pools[pool]["owned"] + pools[pool]["sealed"] for pool in POOLS}


def _prompt_and_fork(client):
    """A prompt written and committed (the window pool released its first block), and a fork."""
    seq = client.open_model_sequence("hybrid", PROMPT)
    _write(client, seq, PROMPT, 0)
    assert client.commit_model_sequence(seq) == {"full": 3, "sliding": 3}
    assert seq.block_ids["sliding"][0] == -1  # (wholly before 14 - 10 + 1 = 5)
    return seq, client.fork_model_sequence(seq)


def test_a_fork_shares_the_sealed_head_in_every_pool_copy_on_write(model_daemon):
    with model_daemon.connect() as client:
        seq, child = _prompt_and_fork(client)
        assert (child.num_tokens, child.num_sealed_blocks) == (14, 3)
        assert child.seq_id != seq.seq_id
        for pool in POOLS:
            parent_ids, child_ids = seq.block_ids[pool], child.block_ids[pool]
            assert child_ids[:3] == parent_ids[:3]  # sealed: shared (the hole too)
            assert child_ids[3] != parent_ids[3]  # unsealed: copied, same KV
            assert _kv(client, pool, child_ids[3]) == _kv(client, pool, parent_ids[3])
            for each in (seq, child):
                assert _daemon_table(client, each, pool) == each.block_ids[pool]
        # one pin on the shared head, an owned tail each; the released block stays cached
        pools = client.stats()["pools"]
        assert [pools["full"][s] for s in ("sealed", "owned", "cached")] == [3, 2, 0]
        assert [pools["sliding"][s] for s in ("sealed", "owned", "cached")] == [2, 2, 1]
        for pool in POOLS:  # the copy is private to the child
            client.view(child.block_ids[pool][3], pool)[:] = -1
            assert _kv(client, pool, seq.block_ids[pool][3]) == [112, 113, 0, 0]
        assert client._call("check_invariants", {})
        client.close_model_sequence(seq)
        client.close_model_sequence(child)
        assert _pinned(client) == {"full": 0, "sliding": 0}


def test_a_fork_and_its_parent_extend_independently(model_daemon):
    ours, theirs = list(range(500, 507)), list(range(900, 911))
    with model_daemon.connect() as client:
        seq, child = _prompt_and_fork(client)
        for each, tokens, mark in ((seq, ours, 0), (child, theirs, 1000)):
            client.extend_model_sequence(each, tokens)
            _write(client, each, tokens, 14, mark)
            client.commit_model_sequence(each)
        assert seq.num_tokens == 21 and child.num_tokens == 25
        assert seq.block_ids["full"][:3] == child.block_ids["full"][:3]
        assert not set(seq.block_ids["full"][3:]) & set(child.block_ids["full"][3:])
        for each in (seq, child):
            for pool in POOLS:
                assert _daemon_table(client, each, pool) == each.block_ids[pool]
            client.close_model_sequence(each)
        # Each branch sealed its own chain from the shared head: either one is a prefix hit,
        # with the KV its branch wrote.
        for tokens, mark, parent in ((ours, 0, seq), (theirs, 1000, child)):
            again = client.open_model_sequence("hybrid", PROMPT + tokens)
            num_blocks = (len(PROMPT + tokens) - 1) // BLOCK
            assert again.num_cached_tokens == num_blocks * BLOCK
            assert again.block_ids["full"][:num_blocks] == parent.block_ids["full"][:num_blocks]
            last = again.block_ids["sliding"][num_blocks - 1]
            position = (num_blocks - 1) * BLOCK
            expected = [float(t + (mark if position + slot >= 14 else 0)) for slot, t in
                        enumerate((PROMPT + tokens)[position: position + BLOCK])]
            assert _kv(client, "sliding", last) == expected
            client.close_model_sequence(again)
        assert client._call("check_invariants", {})


@pytest.mark.parametrize("decoder", ["parent", "child"])
def test_the_window_pool_keeps_what_the_other_sequence_reads(model_daemon, decoder):
    """One sequence decodes far past the window; the other's window blocks (shared head and own
    tail) keep their block, generation and KV, and it decodes on from them."""
    with model_daemon.connect() as client:
        seq, child = _prompt_and_fork(client)
        going, staying = (seq, child) if decoder == "parent" else (child, seq)
        kept = [b for b in staying.block_ids["sliding"] if b != -1]
        before = {b: (client.generation(b, "sliding"), _kv(client, "sliding", b)) for b in kept}
        shared = [b for b in staying.block_ids["sliding"][:3] if b != -1]
        for step in range(120):  # a long generation, a token a step
            client.extend_model_sequence(going, [step])
            _write(client, going, [step], going.num_tokens - 1, 2000)
            table = _daemon_table(client, going, "sliding")
            assert table == going.block_ids["sliding"], step
            own = [b for b in table[3:] if b != -1]
            assert len(own) <= BOUND, step
            assert _pinned(client)["sliding"] <= len(shared) + 1 + BOUND, step
        assert {b: (client.generation(b, "sliding"), _kv(client, "sliding", b))
                for b in kept} == before
        for pool in POOLS:
            assert _daemon_table(client, staying, pool) == staying.block_ids[pool]
        client.extend_model_sequence(staying, [7, 7, 7])  # decodes on from its own window
        client.commit_model_sequence(staying)
        assert _daemon_table(client, staying, "sliding") == staying.block_ids["sliding"]
        assert client._call("check_invariants", {})
        for each in (seq, child):
            client.close_model_sequence(each)
        assert _pinned(client) == {"full": 0, "sliding": 0}


@pytest.mark.parametrize("first", ["parent", "child"])
def test_closing_either_leaves_the_other_intact(model_daemon, first):
    with model_daemon.connect() as client:
        seq, child = _prompt_and_fork(client)
        closing, staying = (seq, child) if first == "parent" else (child, seq)
        held = {pool: [b for b in staying.block_ids[pool] if b != -1] for pool in POOLS}
        before = {pool: [(client.generation(b, pool), _kv(client, pool, b)) for b in ids]
                  for pool, ids in held.items()}
        client.close_model_sequence(closing)
        with pytest.raises(NotFoundError):
            client._call("seq_info@hybrid", {"seq_id": closing.seq_id})
        assert _pinned(client) == {pool: len(ids) for pool, ids in held.items()}
        assert {pool: [(client.generation(b, pool), _kv(client, pool, b)) for b in ids]
                for pool, ids in held.items()} == before
        client.extend_model_sequence(staying, [1, 2, 3])
        client.commit_model_sequence(staying)
        grandchild = client.fork_model_sequence(staying)  # the survivor forks on
        assert grandchild.block_ids["full"][:4] == staying.block_ids["full"][:4]
        assert client._call("check_invariants", {})
        client.close_model_sequence(staying)
        client.close_model_sequence(grandchild)
        assert _pinned(client) == {"full": 0, "sliding": 0}
        # the shared head went back to the cache, not lost: the prompt is a hit
        again = client.open_model_sequence("hybrid", PROMPT)
        assert again.num_cached_tokens == 12
        client.close_model_sequence(again)


def test_model_forks_count_against_the_session_limits(daemon_factory, monkeypatch):
    daemon = _start(daemon_factory, monkeypatch, "--max-forks", "2", "--max-sequences", "4",
                    "--max-pins", "16")
    with daemon.connect() as client:
        seq = client.open_model_sequence("hybrid", PROMPT)  # 4 blocks in each pool
        client.commit_model_sequence(seq)  # 7 pins: the window pool released its first block
        forks = [client.fork_model_sequence(seq) for _ in range(2)]  # a copied tail: 2 pins each
        with pytest.raises(TooLargeError,
                           match=r"3 forked sequences.*limit of 2 \(kvd start --max-forks\)"):
            client.fork_model_sequence(seq)
        client.close_model_sequence(forks[1])
        forks[1] = client.fork_model_sequence(seq)  # a closed fork gives its place back
        with pytest.raises(TooLargeError, match="block pins.*--max-pins"):
            client.extend_model_sequence(forks[0], list(range(16)))  # 11 + 4 blocks in each pool
        client.open_model_sequence("hybrid", [1])
        with pytest.raises(TooLargeError, match="open sequences.*--max-sequences"):
            client.fork_model_sequence(seq)
        assert client._call("check_invariants", {})
        assert client.stats()["sessions"] == 1  # the session went on


def test_model_fork_errors_are_typed_and_change_nothing(daemon_factory, monkeypatch):
    daemon = _start(daemon_factory, monkeypatch, memory=64 * 1024)
    with daemon.connect() as client, daemon.connect() as other:
        seq = client.open_model_sequence("hybrid", PROMPT)
        for args, error in [({"seq_id": 12345}, NotFoundError),
                            ({"seq_id": "1"}, BadArgsError),
                            ({"seq_id": seq.seq_id, "extra": 1}, BadArgsError),
                            ({}, BadArgsError)]:
            with pytest.raises(error):
                client._call("seq_fork@hybrid", args)
        with pytest.raises(NotFoundError, match="not open in this session"):
            other._call("seq_fork@hybrid", {"seq_id": seq.seq_id})  # another session's
        single = client.open_sequence(PROMPT, pool="full")
        with pytest.raises(NotFoundError, match="pool 'sliding'"):  # open in one pool only
            client._call("seq_fork@hybrid", {"seq_id": single.seq_id})
        with pytest.raises(NotFoundError, match="no pool 'nope'"):
            client._call("seq_fork@nope", {"seq_id": seq.seq_id})
        # No room for the copies of the unsealed tails: NO_SPACE, and nothing changed.
        hog = []
        while True:
            try:
                hog += other.alloc(1, pool="full")
            except NoSpaceError:
                break
        stats = client.stats()["pools"]
        with pytest.raises(NoSpaceError):
            client.fork_model_sequence(seq)
        assert client.stats()["pools"] == stats
        assert client._call("check_invariants", {})
        other.release(hog, pool="full")
        child = client.fork_model_sequence(seq)  # with room again, it forks
        client.close_model_sequence(child)
        client.close_model_sequence(seq)
        client.close_sequence(single)
    with kvd.connect(daemon.paths.socket_path, read_only=True) as reader:
        with pytest.raises(DeniedError, match="read-only"):
            reader.open_model_sequence("hybrid", PROMPT)


def test_a_plain_sequence_on_the_window_pool_keeps_its_table_as_the_daemon_does(model_daemon):
    """`open_sequence(..., pool=WINDOW)`: decode marks -1 what the daemon released (the client
    did not, and so kept ids of blocks others reuse), forks included."""
    with model_daemon.connect() as client:
        seq = client.open_sequence(PROMPT, pool="sliding")
        client.commit_sequence(seq)
        child = client.fork_sequence(seq)
        for step in range(40):
            for each in (seq, child):
                client.extend_sequence(each, [step])
                assert _daemon_table(client, each, "sliding") == each.block_ids, step
        assert seq.block_ids[0] == -1 and seq.block_ids[1:3] == child.block_ids[1:3]
        assert sum(b != -1 for b in seq.block_ids[3:]) <= BOUND
        client.close_sequence(child)
        client.close_sequence(seq)
        assert _pinned(client) == {"full": 0, "sliding": 0}
