"""A daemon of several pools (issue 31): `--pool`/`--config`, per-pool ops over one connection,
hash namespaces that never cross, memory that moves to the busy pool, per-pool stats."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

import kvd
from kvd.errors import NotFoundError, UnknownOpError

TARGET = "target:layers=2,kv-heads=2,head-dim=8,dtype=float32,block-size=4"
LATENT = "latent:layers=3,parts=1,kv-heads=1,head-dim=24,dtype=bfloat16,block-size=4,window=16"
MEMORY = 256 * 1024  # 1 KiB target blocks, 576-byte latent ones


@pytest.fixture
def pools_daemon(daemon_factory):
    return daemon_factory(["--pool", TARGET, "--pool", LATENT], memory=MEMORY)


def key(*parts: object) -> bytes:
    return repr(parts).encode().ljust(16, b".")[:64]


def test_a_session_addresses_its_pool_and_others_by_name(pools_daemon):
    with pools_daemon.connect(pool="latent") as client:
        assert client.geometry.parts == 1 and client.geometry.window == 16
        assert set(client.pools) == {"target", "latent"}
        latent_ids = client.alloc(2)
        view = client.view(latent_ids[0])
        assert view.shape == (3, 1, 4, 1, 24)
        view[...] = 7
        target_ids = client.alloc(1, pool="target")
        target_view = client.view(target_ids[0], pool="target")
        assert target_view.shape == (2, 2, 4, 2, 8)
        target_view[...] = 1.5
        assert (client.view(latent_ids[0]) == 7).all()  # neither write touched the other
        client.seal(latent_ids, [key("a"), key("b")])
        client.seal(target_ids, [key("a")], pool="target")
        # One hash, two namespaces: each pool finds its own block only.
        assert client.lookup([key("a"), key("b")]) == latent_ids
        assert client.lookup([key("a"), key("b")], pool="target") == target_ids
        generation = client.generation(target_ids[0], pool="target")
        client.release(latent_ids * 2)
        client.release(target_ids * 2, pool="target")
        assert client.generation(target_ids[0], pool="target") == generation  # (cached)
        del view, target_view


def test_sequences_open_on_a_named_pool(pools_daemon):
    with pools_daemon.connect() as client:  # the first pool configured: target
        assert client.info["pool"] == "target"
        seq = client.open_sequence(list(range(10)), pool="latent")
        assert seq.pool == "latent" and len(seq.block_ids) == 3
        client.extend_sequence(seq, [1, 2, 3])
        assert client.commit_sequence(seq) == 1 and seq.num_sealed_blocks == 3
        fork = client.fork_sequence(seq)
        client.close_sequence(fork)
        client.close_sequence(seq)
        again = client.open_sequence(list(range(10)), pool="latent")
        assert again.num_cached_tokens == 8  # the latent pool's cache, not target's
        client.close_sequence(again)
        assert client.open_sequence(list(range(10))).num_cached_tokens == 0


def test_unknown_pools_are_typed_errors(pools_daemon):
    with pytest.raises(NotFoundError, match="no pool 'draft': this daemon serves target, latent"):
        pools_daemon.connect(pool="draft")
    with pools_daemon.connect() as client:
        with pytest.raises(NotFoundError, match="no pool 'draft'"):
            client.alloc(1, pool="draft")
        with pytest.raises(NotFoundError, match="no pool 'draft'"):
            client.open_sequence([1, 2, 3], pool="draft")
        with pytest.raises(UnknownOpError, match="OP@POOL"):
            client._call("nope@target", {})


def test_the_busy_pool_takes_the_idle_pools_memory(pools_daemon):
    """Issue 31 item 2 through the daemon: A fills the budget, then only B runs; B ends with
    >= 90 % of the budget's bytes."""
    with pools_daemon.connect() as client:
        stats = client.stats()
        budget = stats["arena"]["num_slabs"] * stats["arena"]["slab_nbytes"]
        target_nbytes = client.pools["target"].block_nbytes
        latent_nbytes = client.pools["latent"].block_nbytes
        for chain in range(2 * budget // (4 * target_nbytes)):  # phase 1: target, chains of 4
            hashes = kvd.hash_blocks(list(range(chain * 16, chain * 16 + 16)), 4)
            seq_ids = client.alloc(4)
            client.seal(seq_ids, hashes, [None, *hashes[:-1]])
            client.release(seq_ids)
        assert client.stats()["arena"]["unowned_slabs"] == 0
        for chain in range(3 * budget // (4 * latent_nbytes)):  # phase 2: latent only
            hashes = kvd.hash_blocks(list(range(chain * 16, chain * 16 + 16)), 4, salt=b"l")
            seq_ids = client.alloc(4, pool="latent")
            client.seal(seq_ids, hashes, [None, *hashes[:-1]], pool="latent")
            client.release(seq_ids, pool="latent")
        pools = client.stats()["pools"]
        held_nbytes = pools["latent"]["num_blocks"] * latent_nbytes
        assert held_nbytes >= 0.90 * budget, pools


def test_random_ops_on_several_pools_keep_every_invariant(daemon_factory, monkeypatch):
    monkeypatch.setenv("KVD_DEBUG", "1")  # the daemon gets the check_invariants op
    handle = daemon_factory(["--pool", TARGET, "--pool", LATENT,
                             "--pool", "draft:layers=1,kv-heads=1,head-dim=8,block-size=4"],
                            memory=MEMORY)
    rng = random.Random(31)
    with handle.connect() as client:
        held: dict[str, list[int]] = {"target": [], "latent": [], "draft": []}
        for step in range(400):
            pool = rng.choice(list(held))
            if held[pool] and rng.random() < 0.3:
                client.release(held[pool], pool=pool)
                held[pool] = []
                continue
            chain = rng.randrange(300)
            hashes = kvd.hash_blocks([chain] * 4 * rng.randrange(1, 17), 4)
            hits = client.lookup(hashes, pool=pool)
            held[pool] += hits
            missing = hashes[len(hits):]
            if not missing:
                continue
            try:
                new_ids = client.alloc(len(missing), pool=pool)
            except kvd.NoSpaceError:
                continue
            parents = [hashes[len(hits) - 1] if hits else None, *missing[:-1]]
            client.seal(new_ids, missing, parents, pool=pool)
            held[pool] += new_ids
            if step % 50 == 0:
                client._call("check_invariants", {})
        client._call("check_invariants", {})
        stats = client.stats()
        assert stats["arena"]["slab_moves"] > 0
        assert sum(each["num_blocks"] * each["block_nbytes"] for each in stats["pools"].values()
                   ) <= stats["arena"]["num_slabs"] * stats["arena"]["slab_nbytes"]


def test_stats_report_every_pool(pools_daemon):
    with pools_daemon.connect() as client:
        client.alloc(2, pool="latent")
        stats = client.stats()
    assert stats["pools"]["latent"]["owned"] == 2 and stats["pools"]["target"]["owned"] == 0
    assert stats["pools"]["latent"]["geometry"]["parts"] == 1
    text = subprocess.run([sys.executable, "-m", "kvd.cli", "stats", "--name", pools_daemon.name],
                          capture_output=True, text=True, timeout=30).stdout
    assert "pool latent: blocks free / owned / sealed / cached" in text and "slabs" in text


def test_a_bad_pool_config_is_refused_naming_the_fix(tmp_path):
    config = tmp_path / "kvd.toml"
    config.write_text("[pools.a]\nlayers = 2\nheads = 2\n")
    for args, message in (
            (["--config", str(config)], "unknown keys ['heads']"),
            (["--pool", TARGET, "--pool", TARGET], "configured twice"),
            (["--pool", TARGET, "--memory", "512"], "raise --memory"),
            (["--pool", TARGET, "--num-blocks", "8"], "give --memory instead")):
        done = subprocess.run([sys.executable, "-m", "kvd.cli", "start", "--name", "kvd-bad",
                               *args], capture_output=True, text=True, timeout=30)
        assert done.returncode != 0 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_views_of_a_released_slab_see_the_generation_change(pools_daemon):
    """A block's address is static; when its slab moves to another pool the old pool's
    generation of it has changed, so a stale reader can tell."""
    with pools_daemon.connect() as client:
        ids = client.alloc(1)
        client.seal(ids, [key("x")])
        generation = client.generation(ids[0])
        client.release(ids)
        for chain in range(MEMORY // 576):  # fill the budget through the latent pool
            hashes = kvd.hash_blocks(list(range(chain * 4, chain * 4 + 4)), 4, salt=b"z")
            new_ids = client.alloc(1, pool="latent")
            client.seal(new_ids, hashes, pool="latent")
            client.release(new_ids, pool="latent")
        assert client.lookup([key("x")]) == []
        assert client.generation(ids[0]) != generation
        assert np.asarray(client.stats()["pools"]["target"]["num_blocks"]) >= 0


def test_metrics_carry_the_pool_label(daemon_factory):
    import urllib.request
    handle = daemon_factory(["--pool", TARGET, "--pool", LATENT, "--metrics-port", "0"],
                            memory=MEMORY)
    with handle.connect() as client:
        client.alloc(2, pool="latent")
        port = client.stats()["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    assert 'kvd_blocks{pool="latent",state="owned"} 2.0' in text
    assert 'kvd_blocks{pool="target",state="owned"} 0.0' in text
    assert 'kvd_allocations_total{pool="latent"} 2.0' in text
