"""Prometheus metrics, computed at scrape time from the daemon's own counters.

The request path only bumps plain Python ints and one bucket of its op's latency histogram (one
bisect and two adds in Python); prometheus_client
objects are built when a scrape arrives, on the HTTP server's thread. That keeps the per-request
cost of metrics a small fraction of a microsecond, where observing a prometheus_client Histogram
per request would cost several (bench/request_path.py measures the request path). Reads from the
scrape thread are plain reads under the GIL: a scrape may see one request half-counted, never a
torn value.

The endpoint (`serve_metrics`) is a lever on the loop's latency, since every Python line the
scrape thread runs holds the GIL the loop needs: 4 processes scraping as fast as they could
(~1,060 scrapes/s) once raised the daemon's request p99 from 0.28 to 4.4 ms. So it is bounded:
one rendering serves every scrape for RENDER_TTL_S; responses go out at most one per
MIN_REPLY_INTERVAL_S (a scraper waits, asleep, for its turn); at most MAX_CONNECTIONS
connections are served at once (more are closed at accept, so 1,000 stalled connections hold
MAX_CONNECTIONS threads, not 1,000), each with a TIMEOUT_S socket timeout. Prometheus scrapes
every few seconds; none of this slows it. `python -m bench.hostile` measures the request p99
with and without 4 scrapers, side by side.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from time import perf_counter
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
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
            yield from _collect_remote({name: each["remote"] for name, each in pools.items()
                                        if "remote" in each})
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


def _collect_remote(tiers: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """kvd_remote_*: each pool's tier's state, queue and counters (kvd/server/remote)."""
    up = GaugeMetricFamily("kvd_remote_up", "1 while the remote tier answers in time",
                           labels=["pool"])
    state = GaugeMetricFamily("kvd_remote_state", "The remote tier's state (1 for the current)",
                              labels=["pool", "state"])
    queue = GaugeMetricFamily("kvd_remote_queue_blocks", "Blocks waiting to be written",
                              labels=["pool"])
    counters = {key: CounterMetricFamily(f"kvd_remote_{key}", text, labels=["pool"])
                for key, text in REMOTE_COUNTERS}
    for pool, remote in tiers.items():
        up.add_metric([pool], 1 if remote["state"] == "up" else 0)
        for name in REMOTE_STATES:
            state.add_metric([pool, name], 1 if remote["state"] == name else 0)
        queue.add_metric([pool], remote["queue_depth"])
        for key, counter in counters.items():
            counter.add_metric([pool], remote[key])
    yield from (up, state, queue, *counters.values())


RENDER_TTL_S = 1.0  # one rendering serves the scrapes of this long
MIN_REPLY_INTERVAL_S = 0.1  # at most 10 responses a second, all scrapers together
MAX_CONNECTIONS = 8  # served at once; more are closed at accept
TIMEOUT_S = 5.0  # per socket operation of a connection (a stalled peer is dropped)


class Exposition:
    """The text exposition of a registry, rendered at most once per RENDER_TTL_S and handed
    out at most once per MIN_REPLY_INTERVAL_S (module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._body = b""
        self._rendered_at = -RENDER_TTL_S
        self._next_reply_at = 0.0

    def body(self) -> bytes:
        with self._lock:  # (the waiters sleep on it: no GIL held)
            wait_s = self._next_reply_at - time.monotonic()
            if wait_s > 0:
                time.sleep(wait_s)
            now = time.monotonic()
            self._next_reply_at = now + MIN_REPLY_INTERVAL_S
            if now - self._rendered_at >= RENDER_TTL_S:
                self._body = generate_latest(self._registry)
                self._rendered_at = now
            return self._body


class _Handler(BaseHTTPRequestHandler):
    timeout = TIMEOUT_S
    server: MetricsServer

    def do_GET(self) -> None:
        if self.path.split("?")[0] not in ("/", "/metrics"):
            self.send_error(404, "kvd serves /metrics only")
            return
        body = self.server.exposition.body()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # a scrape is not worth a log line


class MetricsServer(ThreadingHTTPServer):
    """An HTTP server of one Exposition with at most MAX_CONNECTIONS handler threads."""

    daemon_threads = True
    request_queue_size = 64  # (the listen backlog: refuse at accept, not by dropping SYNs)

    def __init__(self, address: tuple[str, int], exposition: Exposition) -> None:
        super().__init__(address, _Handler)
        self.exposition = exposition
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # all slots busy: close rather than queue a thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_metrics(port: int, stats: Callable[[], dict[str, Any]], ops: OpStats,
                  host: str = "127.0.0.1") -> MetricsServer:
    """Serve /metrics on `host`:`port` from a daemon thread (port 0: the kernel's choice, in
    `server.server_address`); `shutdown()` and `server_close()` stop it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvdCollector(stats, ops))
    server = MetricsServer((host, port), Exposition(registry))
    threading.Thread(target=server.serve_forever, name="kvd-metrics", daemon=True).start()
    return server
