"""`python -m bench.hostile`: what a hostile local client can do to a daemon, measured.

Each row is measured beside its baseline in the same run, on a daemon with default limits:

  fork lever      forks of a 262,144-token sequence (24 bytes each on the wire): the daemon's RSS
                  before and after, and the time per fork
  close stall     another client times its round trips while a session's process dies that
                  holds nearly the pins --max-pins allows (sequences opened on one cached
                  65,536-block prefix) or those forks: p99 and longest round trip in the 0.9 s
                  after, and in the 0.9 s before
  unread replies  100 connections that send requests and never read their replies: the daemon's
                  RSS before and after, and how many of them it cut
  metrics         a client's round-trip p50/p99 while 4 processes scrape /metrics as fast as they
                  can, and while none does (alternating rounds)
  stalled HTTP    1,000 connections to /metrics that send nothing: the daemon's threads

tests/server/test_hostile.py drives the same scenarios, smaller, with bounds.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

import kvd
from bench.common import (
    ROOT, Daemon, GeometryFlags, bench_main, child_env, markdown_table, percentiles, progress,
    report,
)
from kvd.protocol import PROTOCOL_VERSION, FrameDecoder, decode_reply, encode_request

BLOCK_SIZE = 4
GEOMETRY: GeometryFlags = {"layers": 1, "kv_heads": 1, "head_dim": 8, "block_size": BLOCK_SIZE,
                           "dtype": "float32"}
MISS = [b"\x00" * 16]  # a lookup that finds nothing: the cheapest round trip through the pool


def daemon_status(pid: int) -> dict[str, float]:
    """The daemon's resident memory (MiB) and thread count, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
            "threads": int(fields["Threads"])}


def cached_sequence(client: kvd.Client, num_tokens: int) -> kvd.Sequence:
    """A sequence of `num_tokens` whose full blocks are all sealed (so cached once closed)."""
    seq = client.open_sequence(np.arange(num_tokens, dtype=np.uint32))
    client.commit_sequence(seq, num_tokens)
    return seq


class RoundTrips:
    """A thread timing a cheap request on its own connection, back to back, until `stop()`:
    (monotonic end, round trip in ns) samples."""

    def __init__(self, socket_path: str) -> None:
        self._client = kvd.connect(socket_path, reconnect_timeout_s=0)
        self.samples: list[tuple[float, int]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lookup, clock = self._client.lookup, time.perf_counter_ns
        while not self._stopping:
            started = clock()
            lookup(MISS)
            self.samples.append((time.monotonic(), clock() - started))

    def between(self, start: float, end: float) -> list[int]:
        return [rtt for at, rtt in list(self.samples) if start <= at <= end]

    def stop(self) -> None:
        self._stopping = True
        self._thread.join()
        self._client.close()


def raw_session(socket_path: str) -> socket.socket:
    """A connection that said hello (and read its reply): requests can go out unread."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    call(sock, "hello", {"version": PROTOCOL_VERSION, "pid": os.getpid()})
    return sock


def call(sock: socket.socket, op: str, args: dict[str, Any]) -> Any:
    """One request on a raw connection, and its result."""
    return pipeline(sock, op, args, 1)


def pipeline(sock: socket.socket, op: str, args: dict[str, Any], num: int,
             max_in_flight: int = 32) -> Any:
    """`num` requests on a raw connection, `max_in_flight` at a time (a fork of a 65,536-block
    sequence answers 330 KB of ids, and a daemon cuts a client whose one read asks more than
    --max-output-nbytes); the last one's result (the others' are dropped undecoded)."""
    decoder, bodies = FrameDecoder(), []
    while num:
        batch = min(num, max_in_flight)
        sock.sendall(encode_request(1, op, args) * batch)
        while batch:
            data = sock.recv(1 << 20)
            if not data:
                raise kvd.DisconnectedError("the daemon closed the connection")
            bodies = decoder.feed(data)
            batch -= len(bodies)
            num -= len(bodies)
    return decode_reply(bodies[-1])[1]


def open_cached(sock: socket.socket, num_tokens: int) -> int:
    """Open a sequence of `num_tokens` on a raw connection; its id."""
    tokens = np.arange(num_tokens, dtype="<u4").tobytes()
    return int(call(sock, "seq_open", {"tokens": tokens})["seq_id"])


def flood_unread(socket_path: str, num_connections: int, num_tokens: int,
                 num_requests: int) -> list[socket.socket]:
    """`num_connections` connections, each with a sequence of `num_tokens` open, that send
    `num_requests` seq_info each (replies of 5 bytes per block) and read none of them."""
    socks = []
    request_nbytes = 0
    for _ in range(num_connections):
        sock = raw_session(socket_path)
        seq_id = open_cached(sock, num_tokens)
        flood = encode_request(2, "seq_info", {"seq_id": seq_id}) * num_requests
        sock.setblocking(False)
        try:
            request_nbytes += sock.send(flood)
        except OSError:
            pass  # (cut already: that is what the daemon is for)
        socks.append(sock)
    return socks


def scraper_main(port: int, go_path: str, stop_path: str) -> None:
    """A scraper process: GET /metrics back to back while `go_path` exists, until `stop_path`
    does."""
    while not os.path.exists(stop_path):
        if not os.path.exists(go_path):
            time.sleep(0.01)
            continue
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/metrics")
            connection.getresponse().read()
            connection.close()
        except OSError:
            time.sleep(0.001)


@contextmanager
def scrapers(port: int, num: int, tmp: Path) -> Iterator[Path]:
    """`num` scraper processes; they scrape while the yielded path exists."""
    go, stop = tmp / "go", tmp / "stop"
    procs = [subprocess.Popen([sys.executable, "-m", "bench.hostile", "--scrape", str(port),
                               str(go), str(stop)], cwd=ROOT, env=child_env())
             for _ in range(num)]
    try:
        yield go
    finally:
        stop.touch()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---- the rows -----------------------------------------------------------------------------------
def fork_lever(num_tokens: int, num_forks: int) -> dict[str, Any]:
    num_blocks = num_tokens // BLOCK_SIZE + num_forks + 64
    with Daemon(num_blocks, **GEOMETRY) as daemon:
        sock = raw_session(daemon.socket_path)
        seq_id = open_cached(sock, num_tokens)
        call(sock, "seq_commit", {"seq_id": seq_id, "num_computed": num_tokens})
        before = daemon_status(daemon.proc.pid)
        started = time.perf_counter()
        pipeline(sock, "seq_fork", {"seq_id": seq_id}, num_forks)
        elapsed = time.perf_counter() - started
        after = daemon_status(daemon.proc.pid)
        sock.close()
    return {"num_tokens": num_tokens, "num_forks": num_forks,
            "rss_before_mib": before["rss_mib"], "rss_after_mib": after["rss_mib"],
            "fork_us": elapsed / num_forks * 1e6}


def close_stall(num_tokens: int, num_sequences: int, num_forks: int) -> dict[str, Any]:
    num_blocks = num_tokens // BLOCK_SIZE + num_forks + 64
    results = {}
    with Daemon(num_blocks, **GEOMETRY) as daemon:
        with daemon.connect() as client:
            client.close_sequence(cached_sequence(client, num_tokens))
        for kind, num in (("sequences", num_sequences), ("forks", num_forks)):
            holder = subprocess.Popen(
                [sys.executable, "-m", "bench.hostile", "--hold", daemon.socket_path, kind,
                 str(num_tokens), str(num)], cwd=ROOT, env=child_env(), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True)
            assert holder.stdout is not None and holder.stdin is not None
            holder.stdout.readline()  # "ready"
            probe = RoundTrips(daemon.socket_path)
            time.sleep(1.0)
            closed_at = time.monotonic()
            holder.stdin.close()  # it exits: the daemon closes its session
            holder.wait()
            time.sleep(1.0)
            probe.stop()
            during = probe.between(closed_at, closed_at + 0.9)
            before = probe.between(closed_at - 0.9, closed_at)
            results[kind] = {"num_pins": (num_sequences if kind == "sequences" else 1)
                             * num_tokens // BLOCK_SIZE,
                             "p99_before_us": percentiles(before)["p99_us"],
                             "max_before_us": max(before) / 1e3,
                             "p99_during_us": percentiles(during)["p99_us"],
                             "max_during_us": max(during) / 1e3}
    return results


def holder_main(socket_path: str, kind: str, num_tokens: int, num: int) -> None:
    """A holder process: `num` sequences of `num_tokens` (each pinning the cached prefix anew),
    or one and `num` forks of it; says "ready", then holds them until stdin closes."""
    sock = raw_session(socket_path)
    seq_ids = [open_cached(sock, num_tokens) for _ in range(num if kind == "sequences" else 1)]
    if kind == "forks":
        pipeline(sock, "seq_fork", {"seq_id": seq_ids[0]}, num)
    print("ready", flush=True)
    sys.stdin.read()
    os._exit(0)  # (no orderly close: the daemon sees the peer die)


def unread_replies(num_connections: int, num_tokens: int, num_requests: int) -> dict[str, Any]:
    with Daemon(num_tokens // BLOCK_SIZE * 2, **GEOMETRY) as daemon, \
            daemon.connect() as client:
        client.close_sequence(cached_sequence(client, num_tokens))
        before = daemon_status(daemon.proc.pid)
        socks = flood_unread(daemon.socket_path, num_connections, num_tokens, num_requests)
        time.sleep(1.0)
        after = daemon_status(daemon.proc.pid)
        num_left = client.stats()["sessions"] - 1
        for sock in socks:
            sock.close()
    return {"num_connections": num_connections,
            "reply_nbytes_asked": num_connections * num_requests * num_tokens // BLOCK_SIZE * 5,
            "rss_before_mib": before["rss_mib"], "rss_after_mib": after["rss_mib"],
            "num_cut": num_connections - num_left}


def metrics_scraping(round_s: float, num_rounds: int, tmp: Path) -> dict[str, Any]:
    port = free_port()
    with Daemon(1024, flags=["--metrics-port", str(port)], **GEOMETRY) as daemon, \
            scrapers(port, 4, tmp) as go:
        probe = RoundTrips(daemon.socket_path)
        quiet: list[int] = []
        scraped: list[int] = []
        for _ in range(num_rounds):
            for samples, is_scraping in ((quiet, False), (scraped, True)):
                if is_scraping:
                    go.touch()
                start = time.monotonic()
                time.sleep(round_s)
                samples += probe.between(start + 0.1, time.monotonic())
                go.unlink(missing_ok=True)
        probe.stop()
    return {"quiet": percentiles(quiet), "scraped": percentiles(scraped),
            "p99_ratio": percentiles(scraped)["p99_us"] / percentiles(quiet)["p99_us"]}


def stalled_http(num_connections: int) -> dict[str, Any]:
    port = free_port()
    with Daemon(64, flags=["--metrics-port", str(port)], **GEOMETRY) as daemon:
        before = daemon_status(daemon.proc.pid)["threads"]
        socks = []
        for _ in range(num_connections):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                pass  # (refused at accept: what is meant to happen past the bound)
        time.sleep(0.5)
        after = daemon_status(daemon.proc.pid)["threads"]
        with daemon.connect() as client:
            client.stats()  # still serving
        for sock in socks:
            sock.close()
    return {"num_connections": num_connections, "threads_before": before,
            "threads_after": after}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_bench(quick: bool, out: Path) -> str:
    num_tokens = 16_384 if quick else 262_144
    results: dict[str, Any] = {}
    progress("hostile: fork lever")
    results["fork_lever"] = fork_lever(num_tokens, 30 if quick else 300)
    progress("hostile: close stall")
    results["close_stall"] = close_stall(num_tokens, 2 if quick else 15, 30 if quick else 300)
    progress("hostile: unread replies")
    results["unread_replies"] = unread_replies(10 if quick else 100, num_tokens // 4,
                                               20 if quick else 100)
    progress("hostile: metrics scraping")
    with tempfile.TemporaryDirectory(prefix="kvd-hostile-") as tmp:
        results["metrics"] = metrics_scraping(0.5 if quick else 2.0, 2 if quick else 5,
                                              Path(tmp))
    progress("hostile: stalled HTTP")
    results["stalled_http"] = stalled_http(100 if quick else 1000)
    return report(out, "hostile", results, markdown)


def markdown(r: dict[str, Any]) -> str:
    fork, stall, unread = r["fork_lever"], r["close_stall"], r["unread_replies"]
    metrics, http_ = r["metrics"], r["stalled_http"]
    rows = [
        (f"{fork['num_forks']} forks of a {fork['num_tokens']}-token sequence",
         f"RSS {fork['rss_before_mib']:.0f} MiB", f"RSS {fork['rss_after_mib']:.0f} MiB, "
         f"{fork['fork_us']:.0f} us per fork (pipelined, replies of 5 bytes per block)"),
        *((f"close a session holding {row['num_pins']} pins in {kind} (0.9 s before / after)",
           f"round trip p99 {row['p99_before_us']:.0f} us, max {row['max_before_us']:.0f} us",
           f"round trip p99 {row['p99_during_us']:.0f} us, max {row['max_during_us']:.0f} us")
          for kind, row in stall.items()),
        (f"{unread['num_connections']} connections asking {unread['reply_nbytes_asked'] >> 20}"
         " MiB of replies, reading none", f"RSS {unread['rss_before_mib']:.0f} MiB",
         f"RSS {unread['rss_after_mib']:.0f} MiB, {unread['num_cut']} cut"),
        ("4 processes scraping /metrics back to back",
         f"p50 {metrics['quiet']['p50_us']:.0f} us, p99 {metrics['quiet']['p99_us']:.0f} us",
         f"p50 {metrics['scraped']['p50_us']:.0f} us, p99 {metrics['scraped']['p99_us']:.0f} us"
         f" ({metrics['p99_ratio']:.2f}x)"),
        (f"{http_['num_connections']} stalled connections to /metrics",
         f"{http_['threads_before']} daemon threads", f"{http_['threads_after']} daemon threads"),
    ]
    return ("## Hostile clients (`python -m bench.hostile`)\n\n"
            + markdown_table(["scenario", "baseline", "under attack"], rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--scrape"]:
        scraper_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        sys.exit(0)
    if sys.argv[1:2] == ["--hold"]:
        holder_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    sys.exit(bench_main(__doc__, run_bench))
