"""The remote tier against a real redis-server: format, acceptance across two daemons (two
"hosts": each its own segment), integrity, and the faults of a single server (down, slow,
restarted empty, evicting), each asserting zero failed client requests and zero wrong bytes."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvd
from conftest import SMALL_GEOMETRY, DaemonHandle, start_daemon_process
from kvd.errors import BadArgsError
from kvd.geometry import Geometry
from kvd.hashing import hash_blocks
from kvd.server.remote import BlockCodec, RemoteTier, parse_url
from kvd.server.remote.codec import HEADER, geometry_digest
from redis_servers import RedisServer, free_port, redis_server  # noqa: F401 (a fixture)
from test_cli import kvd_cli
from test_metrics import scrape

pytestmark = pytest.mark.integration
BLOCK = SMALL_GEOMETRY["block_size"]


# ---- helpers (the cluster tests use them too) --------------------------------------------------
def block_bytes(tag: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """Distinct contents for block `index` of prompt `tag`."""
    return np.random.default_rng([tag, index]).random(shape, dtype=np.float32)


def prompt(tag: int, num_blocks: int) -> list[int]:
    return [tag * 100_000 + i for i in range(num_blocks * BLOCK)]


def prefill(client: kvd.Client, tag: int, num_blocks: int) -> None:
    """Open a prompt of `num_blocks` full blocks plus one token, write distinct bytes per block,
    seal, close (the blocks stay cached)."""
    seq = client.open_sequence(prompt(tag, num_blocks) + [7])
    for index, block_id in enumerate(seq.block_ids[:num_blocks]):
        view = client.view(block_id)
        view[:] = block_bytes(tag, index, view.shape)
    client.commit_sequence(seq, num_blocks * BLOCK)
    client.close_sequence(seq)


def remote_stats(client: kvd.Client) -> dict[str, Any]:
    return client.stats()["remote"]


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_written(client: kvd.Client, num_blocks: int) -> None:
    wait_for(lambda: remote_stats(client)["written"] >= num_blocks
             and remote_stats(client)["queue_depth"] == 0, f"{num_blocks} blocks written")


def open_and_check(client: kvd.Client, tag: int, num_blocks: int,
                   suffix: int = 5) -> kvd.client.Sequence:
    """Open prompt `tag` plus a suffix; every block it got as a hit must hold the prompt's
    bytes (zero wrong bytes), whichever tier it came from. Returns the sequence (closed)."""
    seq = client.open_sequence(prompt(tag, num_blocks) + [9] * suffix)
    num_hit = seq.num_cached_tokens // BLOCK
    for index, block_id in enumerate(seq.block_ids[:num_hit]):
        view = client.view(block_id)
        assert np.array_equal(view, block_bytes(tag, index, view.shape)), \
            f"wrong bytes in block {index} of prompt {tag}"
    client.close_sequence(seq)
    return seq


def remote_daemon(factory: Callable[..., DaemonHandle], url: str, **options: Any
                  ) -> DaemonHandle:
    """A small daemon on the tier at `url`, its tier up (unless nothing listens there)."""
    handle = factory(**{**SMALL_GEOMETRY, "remote": url, **options})
    with handle.connect() as client:
        wait_for(lambda: remote_stats(client)["state"] != "connecting", "the tier's probe")
    return handle


@pytest.fixture
def redis_empty(redis_server: RedisServer) -> RedisServer:  # noqa: F811
    if redis_server.proc is None:
        redis_server.start()
    redis_server.cli("CONFIG", "SET", "maxmemory", "0")
    redis_server.cli("FLUSHALL")
    return redis_server


# ---- format ------------------------------------------------------------------------------
def test_url_forms_and_typed_errors():
    assert parse_url("redis://10.0.0.1:7000/3").nodes == (("10.0.0.1", 7000),)
    assert parse_url("redis://h").db == 0 and parse_url("redis://h").nodes == (("h", 6379),)
    cluster = parse_url("redis-cluster://a:1,b:2")
    assert cluster.is_cluster and cluster.nodes == (("a", 1), ("b", 2))
    secret = parse_url("redis-cluster://kvd:s%40cret@a:1,b:2")
    assert (secret.username, secret.password, secret.nodes) == ("kvd", "s@cret", cluster.nodes)
    assert "cret" not in str(secret) + repr(secret)
    assert parse_url("redis://:pw@h:1/2").password == "pw"
    for bad in ("http://h:1", "redis://", "redis://a:1,b:2", "redis://h:1/x",
                "redis-cluster://a:1/0", "redis://h:99999"):
        with pytest.raises(BadArgsError, match="redis"):
            parse_url(bad)


def test_keys_separate_pools_geometries_and_hashes():
    geometry = Geometry(num_blocks=8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    key = b"\x01" * 16
    codec = BlockCodec("default", geometry)
    assert codec.key(key).startswith("kvd:default:h1:g") and codec.key(key).endswith("01" * 16)
    other_shape = BlockCodec("default", Geometry(8, 2, 4, 2, 16))
    other_pool = BlockCodec("draft", geometry)
    assert len({codec.key(key), other_shape.key(key), other_pool.key(key)}) == 3
    # num_blocks is not part of a block's shape: hosts with other pool sizes share blocks
    assert geometry_digest(Geometry(999, 2, 4, 2, 8)) == codec.geometry_digest


def test_a_value_that_fails_any_check_is_refused():
    geometry = Geometry(num_blocks=8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    codec = BlockCodec("default", geometry)
    key = b"k" * 16
    block = np.arange(geometry.block_nbytes, dtype=np.uint64).astype(np.uint8)
    value = bytes(codec.encode(key, block))
    assert bytes(codec.payload(key, value)) == block.tobytes()
    assert codec.payload(b"x" * 16, value) is None  # another block's value
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert codec.payload(key, bytes(flipped)) is None  # payload bit flip: CRC
    assert codec.payload(key, value[:-1]) is None  # truncated
    for offset in range(HEADER.size):  # any header byte
        bad = bytearray(value)
        bad[offset] ^= 0x40
        assert codec.payload(key, bytes(bad)) is None, offset
    other = BlockCodec("default", Geometry(8, 2, 4, 2, 8, dtype="float32"))
    assert other.payload(key, value) is None  # another geometry


def test_queue_drops_the_oldest_writes_when_full():
    tier = RemoteTier(parse_url("redis://127.0.0.1:1"), BlockCodec("default", Geometry(
        8, 2, 4, 2, 8)), max_queued=3)
    try:
        tier.sealed([(i, bytes([i]) * 16, 0) for i in range(5)])
        assert tier.counters["dropped"] == 2 and tier.num_queued == 3
        assert [row[0] for row in tier._writes] == [2, 3, 4]
    finally:
        tier.close()


def test_a_block_evicted_during_the_copy_is_not_written(redis_empty):
    geometry = Geometry(num_blocks=4, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    tier = RemoteTier(parse_url(redis_empty.url), BlockCodec("default", geometry))
    blocks = np.zeros((4, geometry.block_nbytes), dtype=np.uint8)
    generations = np.zeros(4, dtype=np.uint64)
    tier.blocks, tier._generations = blocks, generations
    client = tier._connect()
    try:
        tier.sealed([(0, b"a" * 16, 0), (1, b"b" * 16, 0)])
        generations[1] += 1  # block 1 was evicted (and perhaps reused) before its write
        tier._write_batch(client)
        assert tier.counters["written"] == 1 and tier.counters["stale"] == 1
        assert redis_empty.cli("EXISTS", tier.codec.key(b"a" * 16)) == "1"
        assert redis_empty.cli("EXISTS", tier.codec.key(b"b" * 16)) == "0"
    finally:
        client.close()
        tier.blocks = tier._generations = None
        tier.close()


def test_full_batches_fit_a_tier_at_its_maxmemory(redis_empty):
    """A command's arguments count against maxmemory until it runs: a batch of 32 blocks of
    64 KiB in one MSET was refused (OOM) by a server with 2 MB to spare however much it evicted,
    and the tier went down. Batches are bounded by bytes as well as blocks."""
    redis_empty.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    info = redis_empty.cli("INFO", "memory")
    used = int(next(line for line in info.splitlines() if line.startswith("used_memory:"))
               .split(":")[1])
    redis_empty.cli("CONFIG", "SET", "maxmemory", str(used + 2_000_000))
    geometry = Geometry(num_blocks=64, num_layers=2, block_size=4, num_kv_heads=2, head_dim=1024,
                        dtype="float32")  # 64 KiB blocks
    tier = RemoteTier(parse_url(redis_empty.url), BlockCodec("default", geometry))
    tier.blocks = np.ones((64, geometry.block_nbytes), dtype=np.uint8)
    tier._generations = np.zeros(64, dtype=np.uint64)
    client = tier._connect()
    try:
        for round_ in range(2):  # the second round must evict the first
            tier.sealed([(index, bytes([round_, index]) * 8, 0) for index in range(32)])
            while tier._writes:
                tier._write_batch(client)
        assert tier.counters["write_errors"] == 0, tier.last_error
        assert tier.counters["written"] == 64 and tier.state != "down"
        assert 0 < int(redis_empty.cli("DBSIZE")) < 64  # it evicted
    finally:
        client.close()
        tier.blocks = tier._generations = None
        tier.close()


# ---- acceptance: two hosts --------------------------------------------------------------------
def test_a_prompt_prefilled_on_one_host_is_a_hit_on_another(daemon_factory, redis_empty):
    host_a = remote_daemon(daemon_factory, redis_empty.url)
    host_b = remote_daemon(daemon_factory, redis_empty.url, metrics_port=0)
    with host_a.connect() as a, host_b.connect() as b:
        prefill(a, tag=1, num_blocks=6)
        wait_written(a, 6)
        seq = open_and_check(b, tag=1, num_blocks=6)
        assert seq.num_cached_tokens == 6 * BLOCK and seq.num_remote_tokens == 6 * BLOCK
        stats = b.stats()
        assert stats["remote"]["hit_blocks"] == 6 and stats["remote"]["fetched"] == 6
        # now local on B: a second open hits without the tier
        again = open_and_check(b, tag=1, num_blocks=6)
        assert again.num_cached_tokens == 6 * BLOCK and again.num_remote_tokens == 0
        # raw lookups read through too
        hashes = hash_blocks(prompt(2, 3), BLOCK)
        prefill(a, tag=2, num_blocks=3)
        wait_written(a, 9)
        block_ids = b.lookup(hashes)
        assert len(block_ids) == 3 and block_ids.num_remote == 3  # (the reply says so)
        for index, block_id in enumerate(block_ids):
            assert np.array_equal(b.view(block_id), block_bytes(2, index, b.view(0).shape))
        b.release(block_ids)
        assert remote_stats(b)["hit_blocks"] == 9
        # B's imported blocks are not written back
        assert remote_stats(b)["written"] == 0
        # the operator's view: metrics, kvd stats, kvd status
        metrics = scrape(b.stats()["metrics_port"])
        default = (("pool", "default"),)
        assert metrics[("kvd_remote_hit_blocks_total", default)] == 9
        assert metrics[("kvd_remote_up", default)] == 1
        assert metrics[("kvd_remote_state", (*default, ("state", "up")))] == 1
        text = kvd_cli("stats", "--name", host_b.name).stdout
        assert re.search(r"remote hit blocks \(of prefix hits\) +9 of", text), text
        assert f"remote: {redis_empty.url}/0 up" in kvd_cli("status", "--name", host_b.name).stdout


def test_a_lookup_after_a_restart_without_the_tier_is_retried_plainly(daemon_factory,
                                                                      redis_empty):
    """The first lookup after a --recover restart that dropped --remote was built for a tier
    (`remote: 1`): its retry goes without it, since the new daemon refuses the argument."""
    host = remote_daemon(daemon_factory, redis_empty.url)
    with host.connect() as client:
        prefill(client, tag=1, num_blocks=3)
        hashes = hash_blocks(prompt(1, 3), BLOCK)
        host.proc.send_signal(signal.SIGKILL)
        host.proc.wait(20)
        host.proc = start_daemon_process(host.name, host.log_path, ["--recover"],
                                         **SMALL_GEOMETRY)
        host.wait_ready()
        found = client.lookup(hashes)  # (sent as for a tier, lost, retried)
        assert len(found) == 3 and found.num_remote == 0
        assert client.num_reconnects == 1 and client.info["remote"] is False
        client.release(found)


def test_corrupt_values_are_misses_deleted_and_counted(daemon_factory, redis_empty):
    host_a = remote_daemon(daemon_factory, redis_empty.url)
    host_b = remote_daemon(daemon_factory, redis_empty.url)
    with host_a.connect() as a, host_b.connect() as b:
        prefill(a, tag=3, num_blocks=4)
        wait_written(a, 4)
        key = remote_stats(a)["key_prefix"] + hash_blocks(prompt(3, 4), BLOCK)[2].hex()
        redis_empty.cli("SETRANGE", key, "100", "X")  # flip payload bytes of block 2
        seq = open_and_check(b, tag=3, num_blocks=4)
        assert seq.num_cached_tokens == 2 * BLOCK  # blocks 0 and 1; 2 failed its check
        assert remote_stats(b)["corrupt"] == 1
        assert redis_empty.cli("EXISTS", key) == "0"
        # bad lookups are answered as without a tier, never fetched
        fetches = remote_stats(b)["fetches"]
        with pytest.raises(BadArgsError):
            b.lookup([b"x" * 100])
        assert b.stats()["errors"] == {"BAD_ARGS": 1}
        assert remote_stats(b)["fetches"] == fetches


# ---- faults -----------------------------------------------------------------------------------
def test_redis_down_at_start_then_up_later(daemon_factory, tmp_path):
    """Nothing listens at first: the daemon serves, seals and hits locally; once a server comes
    up on that port the tier resumes by itself and writes what it queued."""
    server = RedisServer(tmp_path / "late", free_port())
    host_a = remote_daemon(daemon_factory, server.url, remote_timeout_ms=50)
    try:
        with host_a.connect() as a:
            prefill(a, tag=4, num_blocks=3)
            assert open_and_check(a, tag=4, num_blocks=3).num_cached_tokens == 3 * BLOCK
            wait_for(lambda: remote_stats(a)["state"] == "down", "the tier seen down")
            stats = remote_stats(a)
            assert "Connection refused" in stats["last_error"] and stats["queue_depth"] == 3
            # seals wake the write thread, but it probes every 0.5 s only
            started, probes = time.monotonic(), stats["probes"]
            for tag in range(40, 60):
                prefill(a, tag=tag, num_blocks=1)
            elapsed = time.monotonic() - started
            assert remote_stats(a)["probes"] - probes <= 2 + elapsed / 0.5
            server.start()
            wait_written(a, 23)
            assert remote_stats(a)["state"] == "up"
            assert server.cli("DBSIZE") == "23"
    finally:
        server.stop()


def test_redis_killed_restarted_empty_and_slow(daemon_factory, redis_empty):
    """Killed: requests go on locally; restarted empty: misses, then new writes land; slow
    (DEBUG SLEEP): a lookup waits at most about the deadline. No request fails, no byte is
    wrong, and the counters and the state say what happened."""
    host_a = remote_daemon(daemon_factory, redis_empty.url, remote_timeout_ms=100)
    host_b = remote_daemon(daemon_factory, redis_empty.url, remote_timeout_ms=100)
    with host_a.connect() as a, host_b.connect() as b:
        prefill(a, tag=5, num_blocks=3)
        wait_written(a, 3)
        redis_empty.kill()
        prefill(a, tag=6, num_blocks=3)  # seals go on
        seq = open_and_check(b, tag=5, num_blocks=3)  # a miss everywhere: computed
        assert seq.num_cached_tokens == 0
        assert open_and_check(a, tag=5, num_blocks=3).num_cached_tokens == 3 * BLOCK
        wait_for(lambda: remote_stats(a)["state"] == "down", "A sees the tier down")
        redis_empty.start()  # empty
        wait_for(lambda: remote_stats(a)["state"] == "up", "A sees the tier up again")
        prefill(a, tag=7, num_blocks=3)
        wait_for(lambda: redis_empty.cli("DBSIZE") != "0", "writes after the restart")
        wait_written(a, 6)
        wait_for(lambda: remote_stats(b)["state"] == "up", "B sees the tier up again")
        assert open_and_check(b, tag=7, num_blocks=3).num_remote_tokens == 3 * BLOCK
        # slow: Redis sleeps 1.5 s; B's lookups of a missing prompt are answered near the
        # deadline (then at once while the fetch is stuck), local hits at once
        sleeper = threading.Thread(target=redis_empty.cli, args=("DEBUG", "SLEEP", "1.5"))
        sleeper.start()
        time.sleep(0.1)
        started = time.monotonic()
        for tag in (8, 9, 10):
            assert open_and_check(b, tag=tag, num_blocks=2).num_cached_tokens == 0
        assert open_and_check(b, tag=7, num_blocks=3).num_cached_tokens == 3 * BLOCK
        assert time.monotonic() - started < 1.0
        sleeper.join()
        assert remote_stats(b)["timeouts"] >= 1
        wait_for(lambda: remote_stats(b)["state"] == "up", "B's tier up after the sleep")
        errors = {**a.stats()["errors"], **b.stats()["errors"]}
        assert not errors, errors


def test_redis_evicting_under_maxmemory(daemon_factory, redis_empty):
    """allkeys-lru with room for a few blocks: B gets whatever consecutive head is left, with
    the right bytes, and computes the rest."""
    redis_empty.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    info = redis_empty.cli("INFO", "memory")
    used = int(next(line for line in info.splitlines() if line.startswith("used_memory:"))
               .split(":")[1])
    # room for ~30 blocks of 64 KiB (and the clients' buffers)
    redis_empty.cli("CONFIG", "SET", "maxmemory", str(used + 2_000_000))
    host_a = remote_daemon(daemon_factory, redis_empty.url, head_dim=512)
    host_b = remote_daemon(daemon_factory, redis_empty.url, head_dim=512)
    try:
        with host_a.connect() as a, host_b.connect() as b:
            for tag in range(20, 40):
                prefill(a, tag=tag, num_blocks=4)
            wait_for(lambda: remote_stats(a)["queue_depth"] == 0, "writes drained")
            assert int(redis_empty.cli("DBSIZE")) < 80  # it evicted
            hits = [open_and_check(b, tag=tag, num_blocks=4).num_remote_tokens
                    for tag in range(20, 40)]
            assert sum(hits) > 0, (redis_empty.cli("DBSIZE"), remote_stats(a), remote_stats(b))
            assert not b.stats()["errors"] and remote_stats(b)["corrupt"] == 0
    finally:
        redis_empty.cli("CONFIG", "SET", "maxmemory", "0")


def test_a_long_prefix_is_fetched_in_chunks_up_to_its_first_bad_value(daemon_factory,
                                                                       redis_empty):
    """More keys than one MGET takes (FETCH_CHUNK): every reply is read, the prefix stops at
    the corrupt block, and the connection serves the next fetch."""
    host_a = remote_daemon(daemon_factory, redis_empty.url, num_blocks=256)
    host_b = remote_daemon(daemon_factory, redis_empty.url, num_blocks=256)
    with host_a.connect() as a, host_b.connect() as b:
        prefill(a, tag=11, num_blocks=70)
        prefill(a, tag=12, num_blocks=70)
        wait_written(a, 140)
        key = remote_stats(a)["key_prefix"] + hash_blocks(prompt(11, 70), BLOCK)[40].hex()
        redis_empty.cli("SETRANGE", key, "2", "X")  # the header's format version
        assert open_and_check(b, tag=11, num_blocks=70).num_remote_tokens == 40 * BLOCK
        assert open_and_check(b, tag=12, num_blocks=70).num_remote_tokens == 70 * BLOCK
        stats = remote_stats(b)
        assert stats["corrupt"] == 1 and stats["fetch_errors"] == 0


def test_other_clients_are_served_while_a_fetch_waits(daemon_factory, redis_empty):
    """A read-through stuck on a sleeping Redis defers only its own reply."""
    host = remote_daemon(daemon_factory, redis_empty.url, remote_timeout_ms=3000)
    with host.connect() as waiting, host.connect() as other:
        prefill(other, tag=13, num_blocks=2)
        sleeper = threading.Thread(target=redis_empty.cli, args=("DEBUG", "SLEEP", "2"))
        sleeper.start()
        time.sleep(0.1)
        answered = threading.Event()

        def open_missing() -> None:
            open_and_check(waiting, tag=14, num_blocks=2)  # deferred until Redis wakes
            answered.set()

        opener = threading.Thread(target=open_missing)
        opener.start()
        wait_for(lambda: remote_stats(other)["fetches"] >= 2, "the fetch in flight")
        for _ in range(20):  # served meanwhile: local hits, seals, stats
            assert open_and_check(other, 13, 2, suffix=1).num_cached_tokens == 2 * BLOCK
        block_ids = other.alloc(2)
        other.seal(block_ids, [b"fresh-%d" % i for i in range(2)])
        other.release(block_ids)
        assert not answered.is_set()
        opener.join(10)
        sleeper.join()
        assert answered.is_set() and not other.stats()["errors"]

