"""Prometheus metrics: the collector over fixed numbers, then a real daemon scraped over HTTP.

The scrape is parsed with prometheus_client's own text parser and compared with `kvd stats --json`
run as a separate process: both must report the same numbers.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvd
from kvd.server.metrics import LATENCY_BUCKETS_S, Histogram, KvdCollector, OpStats


ROOT = Path(__file__).resolve().parents[2]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


FAKE_STATS = {"free": 5, "owned": 4, "sealed": 3, "cached": 2, "num_blocks": 14, "sessions": 2,
              "sequences": 1, "allocations": 40, "evictions": 6, "seals": 9, "lookups": 7,
              "lookup_blocks": 20, "hit_blocks": 11, "prompt_tokens": 300, "cached_tokens": 176,
              "sessions_opened": 12, "sessions_closed": 10, "journal": "ok",
              "journal_commits": 5, "journal_failures": 0}


def test_op_stats_buckets_and_the_collector_exposition():
    ops = OpStats()
    ops.latency = Histogram(LATENCY_BUCKETS_S)
    ops.latency.add("alloc")
    ops.latency.add("seal")  # never recorded: no series for it
    for seconds in (5e-6, 1e-5, 3e-5, 0.5, 5.0):
        ops.latency.record("alloc", seconds)
    ops.latency.record("made-up", 1e-5)  # an op without a row is not counted
    ops.error("NO_SPACE")
    ops.error("NO_SPACE")
    assert ops.requests() == {"alloc": 5}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvdCollector(lambda: FAKE_STATS, ops))
    got = samples(generate_latest(registry).decode())
    for state in ("free", "owned", "sealed", "cached"):
        assert got[("kvd_blocks", (("pool", "default"), ("state", state)))] == FAKE_STATS[state]
    assert got[("kvd_prefix_hit_tokens_total", (("pool", "default"),))] == 176
    assert got[("kvd_prefix_hit_blocks_total", (("pool", "default"),))] == 11
    assert got[("kvd_errors_total", (("code", "NO_SPACE"),))] == 2
    bucket = "kvd_request_latency_seconds_bucket"
    assert got[(bucket, (("le", "1e-05"), ("op", "alloc")))] == 2  # le is inclusive
    assert got[(bucket, (("le", "0.0001"), ("op", "alloc")))] == 3
    assert got[(bucket, (("le", "1.0"), ("op", "alloc")))] == 4
    assert got[(bucket, (("le", "+Inf"), ("op", "alloc")))] == 5
    assert got[("kvd_request_latency_seconds_count", (("op", "alloc"),))] == 5
    assert got[("kvd_request_latency_seconds_sum", (("op", "alloc"),))] == pytest.approx(5.500045)
    assert not any(labels == (("op", "seal"),) or ("op", "made-up") in labels
                   for _, labels in got)
    assert len(LATENCY_BUCKETS_S) == len(set(LATENCY_BUCKETS_S))


def test_since_reads_perf_counters_clock():
    """since(op, started) records perf_counter() - started."""
    histogram = Histogram(LATENCY_BUCKETS_S)
    histogram.add("alloc")
    before = time.perf_counter()
    histogram.since("alloc", before - 0.05)  # 50 ms ago: the 0.1 s bucket
    after = time.perf_counter()
    counts, sum_s = histogram.rows()["alloc"]
    assert counts[LATENCY_BUCKETS_S.index(0.1)] == 1 and sum(counts) == 1
    assert 0.05 <= sum_s <= after - before + 0.05


def test_histogram_misuse_is_a_clear_error():
    histogram = Histogram((1e-5, 1e-3))
    with pytest.raises(TypeError, match="an op is a str"):
        histogram.add(b"alloc")
    histogram.add("alloc")
    with pytest.raises(TypeError):
        histogram.record("alloc", "fast")
    assert histogram.rows() == {}


def test_a_scrape_racing_new_ops_sees_a_consistent_view():
    """The HTTP thread reads OpStats while the loop adds ops and records (regression:
    'dictionary changed size during iteration', and a histogram without its sum)."""
    ops = OpStats()
    ops.latency = Histogram(LATENCY_BUCKETS_S)
    collector = KvdCollector(lambda: {**FAKE_STATS, "requests": ops.requests()}, ops)
    failures: list[BaseException] = []
    is_done = threading.Event()

    def scrape_forever() -> None:
        while not is_done.is_set():
            try:
                list(collector.collect())
            except Exception as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    scraper = threading.Thread(target=scrape_forever)
    scraper.start()
    try:
        for i in range(10_000):
            ops.latency.add(f"op{i}")
            ops.latency.record(f"op{i}", 1e-5)
            ops.error(f"CODE{i}")
    finally:
        is_done.set()
        scraper.join()
        sys.setswitchinterval(interval)
    assert not failures, failures[:3]
    assert ops.requests() == {f"op{i}": 1 for i in range(10_000)}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) with a socket listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as file:
            for line in file.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if int(hex_port, 16) == port and state == "0A":  # 0A = LISTEN
                    found.add(address)
    return found


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return samples(reply.read().decode())


def kvd_stats_json(name: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "kvd.cli", "stats", "--name", name, "--json"],
                          env=env, capture_output=True, text=True, timeout=30, check=True)
    return json.loads(done.stdout)


@pytest.mark.integration
def test_metrics_endpoint_serves_kvd_metrics_that_agree_with_kvd_stats(daemon_factory):
    port = free_port()
    daemon = daemon_factory(num_blocks=8, layers=1, kv_heads=1, head_dim=8, block_size=4,
                            dtype="float32", metrics_port=port)
    assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only
    with daemon.connect() as a, daemon.connect() as b:
        seq = a.open_sequence(np.arange(9))
        a.commit_sequence(seq)
        a.close_sequence(seq)
        again = b.open_sequence(np.arange(9))  # a prefix hit: 2 blocks, 8 tokens
        hog = b.alloc(5)  # 8 - 3 held: every free block
        with pytest.raises(kvd.NoSpaceError):
            a.alloc(1)
        with pytest.raises(kvd.BadArgsError):
            a.alloc(-1)
        with pytest.raises(kvd.NotFoundError):
            a.release([0])
        got = scrape(port)
        stats = kvd_stats_json(daemon.name)  # one more session, hello and stats
        b.release(hog)
        b.close_sequence(again)

    for state in ("free", "owned", "sealed", "cached"):
        assert got[("kvd_blocks", (("pool", "default"), ("state", state)))] == stats[state]
    assert (stats["free"], stats["owned"], stats["sealed"]) == (0, 6, 2)
    assert got[("kvd_sequences", ())] == stats["sequences"]
    for metric, key in (("kvd_pool_blocks", "num_blocks"),
                        ("kvd_allocations_total", "allocations"),
                        ("kvd_evictions_total", "evictions"), ("kvd_seals_total", "seals"),
                        ("kvd_lookups_total", "lookups"),
                        ("kvd_lookup_blocks_total", "lookup_blocks"),
                        ("kvd_prefix_hit_blocks_total", "hit_blocks"),
                        ("kvd_prompt_tokens_total", "prompt_tokens"),
                        ("kvd_prefix_hit_tokens_total", "cached_tokens")):
        assert got[(metric, (("pool", "default"),))] == stats[key], metric
    assert (stats["hit_blocks"], stats["cached_tokens"], stats["prompt_tokens"]) == (2, 8, 18)
    assert got[("kvd_sessions", ())] == stats["sessions"] - 1 == 2
    assert got[("kvd_sessions_opened_total", ())] == stats["sessions_opened"] - 1
    for code in ("NO_SPACE", "BAD_ARGS", "NOT_FOUND"):
        assert got[("kvd_errors_total", (("code", code),))] == stats["errors"][code] == 1
    for op in ("alloc", "seq_open", "seq_commit", "seq_close", "release"):
        count = got[("kvd_request_latency_seconds_count", (("op", op),))]
        assert count == stats["requests"][op] > 0, op
    # docs/operations.md lists every name a query must use (counters carry the _total suffix).
    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc[doc.index("`--metrics-port P`"):doc.index("## Environment")]
    listed = set(re.findall(r"`(kvd_[a-z_]+)(?:\{[a-z,]+\})?`", section))
    exported = {name for name, _ in got if not name.startswith("kvd_request_latency_seconds")}
    assert listed == exported | {"kvd_request_latency_seconds"}


@pytest.fixture
def metrics_server():
    from kvd.server.metrics import serve_metrics

    calls = []

    def stats():
        calls.append(1)
        return FAKE_STATS

    server = serve_metrics(0, stats, OpStats())
    yield server, calls
    server.shutdown()
    server.server_close()


def test_scrapes_share_one_rendering_and_are_paced(metrics_server):
    from kvd.server.metrics import MIN_REPLY_INTERVAL_S

    server, calls = metrics_server
    port = server.server_address[1]
    started = time.monotonic()
    bodies = [urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
              for _ in range(5)]
    assert len(calls) == 1 and len(set(bodies)) == 1 and b"kvd_blocks" in bodies[0]
    assert time.monotonic() - started >= 4 * MIN_REPLY_INTERVAL_S


def test_stalled_connections_hold_a_bounded_number_of_threads(metrics_server):
    from kvd.server.metrics import MAX_CONNECTIONS

    server, _ = metrics_server
    port = server.server_address[1]
    before = threading.active_count()
    stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    try:
        time.sleep(0.5)
        assert threading.active_count() - before <= MAX_CONNECTIONS
    finally:
        for sock in stalled:
            sock.close()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)  # (their handlers see EOF and end, freeing their slots)
    assert b"kvd_blocks" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                                   timeout=10).read()
