"""The remote tier on a real 3-master 3-replica Redis Cluster: blocks spread over every master
(MOVED/ASK handled by redis-py), and a master killed and its replica promoted while two daemons
serve: no failed client request, no wrong byte, and the tier resumes by itself."""

from __future__ import annotations

import time

import pytest

from redis_servers import RedisClusterNodes, redis_cluster  # noqa: F401 (a fixture)
from test_remote import BLOCK, open_and_check, prefill, remote_daemon, remote_stats, wait_for

pytestmark = pytest.mark.integration


def test_two_hosts_share_prompts_through_the_cluster(daemon_factory, redis_cluster):  # noqa: F811
    # (blocks of 64 KiB: values redis-py sends as memoryviews)
    host_a = remote_daemon(daemon_factory, redis_cluster.url, head_dim=512)
    host_b = remote_daemon(daemon_factory, redis_cluster.url, head_dim=512)
    with host_a.connect() as a, host_b.connect() as b:
        prefill(a, tag=101, num_blocks=12)
        wait_for(lambda: remote_stats(a)["written"] >= 12, "12 blocks written")
        seq = open_and_check(b, tag=101, num_blocks=12)
        assert seq.num_remote_tokens == seq.num_cached_tokens == 12 * BLOCK
        keys = sum(int(node.cli("DBSIZE")) for node in redis_cluster.masters())
        assert keys >= 12 and all(int(n.cli("DBSIZE")) > 0 for n in redis_cluster.masters())


def test_master_killed_and_replica_promoted(daemon_factory,
                                            redis_cluster: RedisClusterNodes):  # noqa: F811
    host_a = remote_daemon(daemon_factory, redis_cluster.url, remote_timeout_ms=100)
    host_b = remote_daemon(daemon_factory, redis_cluster.url, remote_timeout_ms=100)
    victim = redis_cluster.masters()[0]
    try:
        with host_a.connect() as a, host_b.connect() as b:
            prefill(a, tag=110, num_blocks=6)
            wait_for(lambda: remote_stats(a)["written"] >= 6, "written before the failover")
            victim.kill()
            # During the failover: every request succeeds, local hits and seals go on.
            started = time.monotonic()
            tag = 120
            while time.monotonic() - started < 2.5:
                prefill(a, tag=tag, num_blocks=2)
                assert open_and_check(a, tag=tag, num_blocks=2).num_cached_tokens == 2 * BLOCK
                open_and_check(b, tag=tag, num_blocks=2)  # remote hit or miss: right bytes
                tag += 1
            redis_cluster.wait_ok()  # the replica took over its slots
            victim.start()  # rejoins as a replica
            # The tier resumes by itself: new prompts travel from A to B again.
            def shared() -> bool:
                nonlocal tag
                tag += 1
                prefill(a, tag=tag, num_blocks=3)
                time.sleep(0.2)
                return open_and_check(b, tag=tag, num_blocks=3).num_remote_tokens == 3 * BLOCK
            wait_for(shared, "a prompt shared after the failover", timeout_s=30)
            wait_for(lambda: remote_stats(a)["state"] == "up", "A's tier up")
            errors = {**a.stats()["errors"], **b.stats()["errors"]}
            assert not errors, errors
            assert remote_stats(b)["corrupt"] == 0
            # and the counters saw it: fetches declined or timed out, or calls that failed
            seen = [remote_stats(c)[name] for c in (a, b)
                    for name in ("declined", "timeouts", "fetch_errors", "write_errors")]
            assert sum(seen) > 0
    finally:
        if victim.proc is None:
            victim.start()
        redis_cluster.wait_ok()
