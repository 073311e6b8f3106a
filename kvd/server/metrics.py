"""Prometheus metrics, computed at scrape time from the daemon's own counters.

The request path only bumps plain Python ints and one bucket of its op's latency histogram (one
bisect and two adds in Python); prometheus_client
objects are built when a scrape arrives, on the HTTP server's thread. That keeps the per-request
cost of metrics a small fraction of a microsecond, where observing a prometheus_client Histogram
per request would cost several (bench/request_path.py measures the request path). Reads from the
scrape thread are plain reads under the GIL: a scrape may see one request half-counted, never a
torn value.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# Request latency buckets in seconds: a round trip on a Unix socket starts near 10 µs.
LATENCY_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)


def snapshot(mapping: dict[str, Any]) -> dict[str, Any]:
    """A copy of a dict the loop thread may grow while the scrape thread reads it.

    Copying is one C call, but an allocation inside it can run a garbage collection whose
    finalizers run Python code and so let the loop thread in: then the copy raises
    "dictionary changed size during iteration". Such a collision is rare; trying again is
    cheaper than taking a lock on every request.
    """
    while True:
        try:
            return dict(mapping)
        except RuntimeError:
            continue


class Histogram:
    """Per-op latency buckets: counts per bucket of `bounds` (plus one for +Inf) and a sum.

    `since(op, started)` is what the loop calls once per request: a perf_counter reading, one
    bisect and two in-place adds. Ops without a row (`add`) are not timed, so made-up op names
    never become labels."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._rows: dict[str, list[Any]] = {}  # op -> counts (a last one for +Inf), then sum_s

    def add(self, op: str) -> None:
        if not isinstance(op, str):
            raise TypeError("an op is a str")
        self._rows.setdefault(op, [0] * (len(self._bounds) + 1) + [0.0])

    def since(self, op: Any, started: float) -> None:
        row = self._rows.get(op) if type(op) is str else None
        if row is not None:  # (record's body, not a call to it: this runs for every request)
            seconds = perf_counter() - started
            row[bisect.bisect_left(self._bounds, seconds)] += 1
            row[-1] += seconds

    def record(self, op: Any, seconds: float) -> None:
        row = self._rows.get(op) if type(op) is str else None
        if row is not None:
            row[bisect.bisect_left(self._bounds, seconds)] += 1
            row[-1] += seconds

    def rows(self) -> dict[str, tuple[list[int], float]]:
        views = {}
        for op, row in snapshot(self._rows).items():
            row = row[:]  # one C call: this row's counts and sum as of one instant
            if any(row[:-1]):
                views[op] = (row[:-1], row[-1])
        return views


class OpStats:
    """Per-op request counts and a latency histogram, plus error counts by code.

    Only ops given a row (`latency.add`: the Service adds the ops it handles) are timed, so that
    made-up op names cannot grow the metric labels without bound.
    """

    def __init__(self) -> None:
        self.latency = Histogram(LATENCY_BUCKETS_S)
        self.errors: dict[str, int] = {}

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def requests(self) -> dict[str, int]:
        return {op: sum(counts) for op, (counts, _) in self.latency.rows().items()}


class KvdCollector:
    """A prometheus_client collector over `stats()` (the daemon's stats dict) and OpStats."""

    def __init__(self, stats: Callable[[], dict[str, Any]], ops: OpStats) -> None:
        self._stats = stats
        self._ops = ops

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        # Every block and hit metric carries its pool (a single-pool daemon's is "default").
        pools = stats.get("pools") or {"default": stats}
        blocks = GaugeMetricFamily("kvd_blocks", "Blocks by state", labels=["pool", "state"])
        pool_blocks = GaugeMetricFamily("kvd_pool_blocks", "Blocks the pool holds now",
                                        labels=["pool"])
        for name, each in pools.items():
            for state in ("free", "owned", "sealed", "cached"):
                blocks.add_metric([name, state], each[state])
            pool_blocks.add_metric([name], each["num_blocks"])
        yield blocks
        yield pool_blocks
        yield GaugeMetricFamily("kvd_sessions", "Connected sessions", value=stats["sessions"])
        yield GaugeMetricFamily("kvd_sequences", "Open sequences", value=stats["sequences"])
        yield GaugeMetricFamily("kvd_journal_writable", "1 unless journal writes are failing "
                                "(allocations and seals then fail closed)",
                                value=0 if stats["journal"] == "failed" else 1)
        for name, key, text in (
            ("kvd_allocations", "allocations", "Blocks allocated"),
            ("kvd_evictions", "evictions", "Cached blocks evicted"),
            ("kvd_seals", "seals", "Blocks sealed"),
            ("kvd_lookups", "lookups", "Prefix lookups"),
            ("kvd_lookup_blocks", "lookup_blocks", "Blocks asked for by lookups"),
            ("kvd_prefix_hit_blocks", "hit_blocks", "Blocks found by lookups (prefix hits)"),
            ("kvd_prompt_tokens", "prompt_tokens", "Tokens of opened sequences"),
            ("kvd_prefix_hit_tokens", "cached_tokens", "Prompt tokens served from the cache"),
        ):
            counter = CounterMetricFamily(name, text, labels=["pool"])
            for pool, each in pools.items():
                counter.add_metric([pool], each[key])
            yield counter
        for name, key, text in (
            ("kvd_sessions_opened", "sessions_opened", "Sessions opened"),
            ("kvd_sessions_closed", "sessions_closed", "Sessions closed (any reason)"),
            ("kvd_journal_commits", "journal_commits",
             "Journal group commits (seals divided by this: how well commits are shared)"),
            ("kvd_journal_failures", "journal_failures", "Failed journal commits or rewrites"),
        ):
            yield CounterMetricFamily(name, text, value=stats[key])
        if "remote" in stats:
            yield from _collect_remote(stats["remote"])
        yield from self._collect_ops()

    def _collect_ops(self) -> Iterator[Any]:
        errors = CounterMetricFamily("kvd_errors", "Error replies by code", labels=["code"])
        for code, count in sorted(snapshot(self._ops.errors).items()):
            errors.add_metric([code], count)
        yield errors
        latency = HistogramMetricFamily("kvd_request_latency_seconds",
                                        "Time to handle a request in the daemon", labels=["op"])
        for op, (counts, sum_s) in sorted(self._ops.latency.rows().items()):
            cumulative, total = [], 0
            for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), counts):
                total += count
                cumulative.append((str(bound) if bound != float("inf") else "+Inf", total))
            latency.add_metric([op], cumulative, sum_value=sum_s)
        yield latency


REMOTE_STATES = ("connecting", "up", "stalled", "down")
REMOTE_COUNTERS = (
    ("queued", "Blocks queued for writing to the remote tier"),
    ("dropped", "Queued writes dropped, oldest first, because the queue was full"),
    ("written", "Blocks written to the remote tier"),
    ("written_bytes", "Bytes written to the remote tier"),
    ("stale", "Writes dropped because the block was evicted before its copy was done"),
    ("write_errors", "Blocks whose write failed"),
    ("fetches", "Lookups that asked the remote tier (their reply waited for it)"),
    ("declined", "Local misses not asked of the remote tier (down, stalled or busy)"),
    ("timeouts", "Lookups answered at --remote-timeout-ms before their fetch finished"),
    ("fetched", "Blocks fetched from the remote tier"),
    ("fetched_bytes", "Bytes fetched from the remote tier"),
    ("missed", "Blocks asked of the remote tier and not found there"),
    ("hit_blocks", "Blocks served to lookups from the remote tier (remote hits)"),
    ("corrupt", "Remote values that failed a header or checksum check (deleted)"),
    ("fetch_errors", "Remote fetches that failed"),
    ("probes", "Health probes (PING) of the remote tier"),
)


def _collect_remote(remote: dict[str, Any]) -> Iterator[Any]:
    """kvd_remote_*: the remote tier's state, queue and counters (kvd/server/remote)."""
    yield GaugeMetricFamily("kvd_remote_up", "1 while the remote tier answers in time",
                            value=1 if remote["state"] == "up" else 0)
    state = GaugeMetricFamily("kvd_remote_state", "The remote tier's state (1 for the current)",
                              labels=["state"])
    for name in REMOTE_STATES:
        state.add_metric([name], 1 if remote["state"] == name else 0)
    yield state
    yield GaugeMetricFamily("kvd_remote_queue_blocks", "Blocks waiting to be written",
                            value=remote["queue_depth"])
    for key, text in REMOTE_COUNTERS:
        yield CounterMetricFamily(f"kvd_remote_{key}", text, value=remote[key])


def serve_metrics(port: int, stats: Callable[[], dict[str, Any]], ops: OpStats) -> int:
    """Serve /metrics on 127.0.0.1:`port` from a daemon thread; returns the port bound (the
    kernel's choice when `port` is 0)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvdCollector(stats, ops))
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    return int(server.server_address[1])
