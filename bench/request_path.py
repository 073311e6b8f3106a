"""Request path: what one batch-1 request costs kvd beyond the echo floor, in one process.

Cross-process round trips swing with where the scheduler puts the two processes and with how
cold each one's caches are after the switch. This bench takes the scheduler out: one process
drives both ends of a real Unix socket and runs the daemon's loop iteration inline
(`Daemon.serve_once`), so a request's cost is path length only (the kernel's socket work plus the
Python on both sides) and repeats to a fraction of a microsecond. The echo floor is
bench/common.py's echo answering over a socketpair, served inline the same way.

Per op of the control plane's round (alloc, seal, release, lookup, release), medians of
interleaved chunks:
  * the round trip, kvd (client encode → send → serve_once → recv → decode) next to the floor
    with the same request body;
  * the same kvd round trip with the protocol's fast paths off (`kvd.protocol.use_c(False)`:
    msgpack instead of msgspec, the argument checks in Python instead of kvd/protocol/_checks.c):
    what they save;
  * the server's side alone: kvd's `serve_once` and the echo's loop iteration. A daemon running
    flat out on a core of its own serves 1 / (its time per request), so over the round the
    floor's server time over kvd's is what bench/scaling.py's ratio tends to with a core per
    worker: a scheduler-free view of that goal (>= 0.8x at 8 workers);
  * kvd's handling stages (decode: unpack + parse; handle: the Service's validation and the
    pool; encode), each timed alone on the same requests.

    python -m bench.request_path [--quick] [--out DIR]
"""

from __future__ import annotations

import os
import selectors
import socket
import statistics
import struct
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack

from bench.common import (bench_main, digests, echo_replies, geometry_of, markdown_table, progress,
                          report)
from bench.control_plane import NUM_BLOCKS, OPS
from kvd import protocol
from kvd.protocol import PROTOCOL_VERSION, FrameDecoder, FrameEncoder, decode_reply, decode_request
from kvd.runtime import DaemonPaths
from kvd.server.daemon import DaemonConfig, launch

ROUND = ("alloc", "seal", "release", "lookup", "release")  # the control plane's round
STAGES = ("decode", "handle", "encode")
CHUNK = 100  # rounds per turn when kvd and the floor alternate


class InlineDaemon:
    """A real Daemon in this process (no journal), served one loop iteration per request."""

    def __init__(self, directory: str) -> None:
        name = f"bench-path-{uuid.uuid4().hex[:8]}"
        paths = DaemonPaths(name=name, socket_path=os.path.join(directory, "kvd.sock"),
                            lock_path=os.path.join(directory, "kvd.lock"),
                            pid_path=os.path.join(directory, "kvd.pid"),
                            segment_name=f"/kvd-{os.getuid()}-{name}")
        self.daemon = launch(DaemonConfig(paths, geometry_of(NUM_BLOCKS), state_dir=directory,
                                          journal=False))
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(paths.socket_path)
        self.daemon.serve_once(1.0)  # accept
        self._encoder, self._decoder, self._next_id = FrameEncoder(), FrameDecoder(), 1
        self.call("hello", {"version": PROTOCOL_VERSION, "pid": os.getpid()})

    def call(self, op: str, args: dict[str, Any]) -> Any:
        """One request as kvd.Client makes it (its encoder, and its decoding of the reply);
        `server_ns` is then the time the daemon's side took (serve_once)."""
        self._next_id += 1
        self.sock.sendall(self._encoder.request(self._next_id, op, args))
        start = time.perf_counter_ns()
        self.daemon.serve_once(1.0)
        self.server_ns = time.perf_counter_ns() - start
        while True:
            chunk = self.sock.recv(65536)
            replies = self._decoder.replies(chunk)
            if replies is not None:
                return replies[0][1]
            bodies = self._decoder.feed(chunk)
            if bodies:
                return decode_reply(bodies[0])[1]

    def close(self) -> None:
        self.sock.close()
        self.daemon.stop()
        self.daemon.serve_forever()  # stopping already: it only cleans up (segment, socket)


class InlineEcho:
    """The echo floor's frame answering over a socketpair, served inline the same way."""

    def __init__(self) -> None:
        self.sock, self._server = socket.socketpair()
        self._server.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._buffer = bytearray()
        self._length = struct.Struct(">I")
        self._next_id = 1

    def call(self, op: str, args: dict[str, Any]) -> Any:
        self._next_id += 1
        body = msgpack.packb([self._next_id, op, args])
        self.sock.sendall(self._length.pack(len(body)) + body)
        start = time.perf_counter_ns()
        for _ in self._selector.select(1.0):  # the echo server's loop iteration
            self._buffer += self._server.recv(65536)
            self._server.sendall(echo_replies(self._buffer))
        self.server_ns = time.perf_counter_ns() - start
        data = self.sock.recv(65536)
        return msgpack.unpackb(data[4:])[2]

    def close(self) -> None:
        self._selector.close()
        self._server.close()
        self.sock.close()


def round_args(hashes: list[bytes], block_ids: list[int]) -> list[tuple[str, dict[str, Any]]]:
    return [("alloc", {"num_blocks": 1}), ("seal", {"block_ids": block_ids, "hashes": hashes}),
            ("release", {"block_ids": block_ids}), ("lookup", {"hashes": hashes}),
            ("release", {"block_ids": block_ids})]


def timed_round(server: Any, hashes: list[bytes], samples: dict[str, list[int]],
                server_samples: dict[str, list[int]]) -> None:
    """One round through `server`: each call's round trip, and its server side alone."""
    clock = time.perf_counter_ns
    block_ids: list[int] = [0]
    for op, args in round_args(hashes, block_ids):
        start = clock()
        result = server.call(op, args)
        samples[op].append(clock() - start)
        server_samples[op].append(server.server_ns)
        if op == "alloc":
            block_ids[:] = result if type(result) is list else [0]  # the echo answers None


def stage_times(inline: InlineDaemon, hashes: list[bytes], samples: dict[str, list[int]]) -> None:
    """Decode, handle and encode of one round's requests, each timed alone (a profile)."""
    service: Any = inline.daemon.service
    clock, encoder = time.perf_counter_ns, FrameEncoder()
    session = next(iter(service.sessions.values()))
    block_ids: list[int] = []
    for op, args in round_args(hashes, block_ids):
        body = encoder.request(1, op, args)[4:]
        start = clock()
        request_id, op_name, request_args = decode_request(body)
        decoded = clock()
        result = service.handle(session, op_name, request_args)
        handled = clock()
        encoder.result(request_id, result)
        encoded = clock()
        if op == "alloc":
            block_ids[:] = result
        for stage, nanoseconds in zip(STAGES, (decoded - start, handled - decoded,
                                               encoded - handled)):
            samples[f"{op}:{stage}"].append(nanoseconds)


def by_op() -> dict[str, list[int]]:
    return {op: [] for op in OPS}


def run(quick: bool) -> dict[str, Any]:
    num_chunks = 2 if quick else 30
    # (samples, the server side's samples) per side; "pure": kvd with the codec in Python
    sides = {side: (by_op(), by_op()) for side in ("kvd", "echo", "pure")}
    has_c = protocol.use_c(True)  # (no pure turn where the fast paths are not there)
    stage_samples: dict[str, list[int]] = {f"{op}:{stage}": [] for op in OPS for stage in STAGES}
    key = 0
    with tempfile.TemporaryDirectory(prefix="kvd-path-") as directory:
        inline, echo = InlineDaemon(directory), InlineEcho()
        turns = [("kvd", inline), ("echo", echo)] + ([("pure", inline)] if has_c else [])
        try:
            for chunk in range(num_chunks + 1):  # the first chunk warms up and is dropped
                progress(f"request path: chunk {chunk + 1} of {num_chunks + 1}")
                for side, server in turns:
                    samples, server_samples = sides[side] if chunk else (by_op(), by_op())
                    if side == "pure":
                        protocol.use_c(False)
                    for _ in range(CHUNK):
                        key += 1
                        timed_round(server, digests(key, 1), samples, server_samples)
                    if side == "pure":
                        protocol.use_c(True)
                for _ in range(CHUNK):
                    key += 1
                    stage_times(inline, digests(key, 1),
                                stage_samples if chunk else {k: [] for k in stage_samples})
        finally:
            echo.close()
            inline.close()
    def median_us(samples: list[int]) -> float:
        return statistics.median(samples) / 1e3

    rows: dict[str, dict[str, Any]] = {}
    for op in OPS:
        (mine, mine_server), (floor, floor_server) = (
            (median_us(samples[op]), median_us(server_samples[op]))
            for samples, server_samples in (sides["kvd"], sides["echo"]))
        rows[op] = {"kvd_us": mine, "echo_us": floor, "ratio": mine / floor,
                    "kvd_server_us": mine_server, "echo_server_us": floor_server,
                    "server_ratio": floor_server / mine_server,
                    "pure_python_us": median_us(sides["pure"][0][op]) if has_c else None,
                    **{stage: median_us(stage_samples[f"{op}:{stage}"]) for stage in STAGES}}

    def per_round(field: str) -> float:
        return sum(rows[op][field] for op in ROUND)
    return {"num_blocks": NUM_BLOCKS, "rounds": num_chunks * CHUNK, "has_c": has_c, "ops": rows,
            # what scaling's saturated servers tend to (bench/scaling.py)
            "round_server_ratio": per_round("echo_server_us") / per_round("kvd_server_us"),
            # kvd's server side less its handler, against the floor's: the daemon's own path
            "round_path_ratio": ((per_round("kvd_server_us") - per_round("handle"))
                                 / per_round("echo_server_us")),
            "handler_us_per_request": per_round("handle") / len(ROUND)}


def _pure_cells(row: dict[str, Any]) -> list[str]:
    pure = row["pure_python_us"]
    if pure is None:
        return ["not built", "-"]
    return [f"{pure:.2f} ({pure / row['echo_us']:.2f}x)", f"{pure - row['kvd_us']:.2f}"]


def markdown(results: dict[str, Any]) -> str:
    rows = [[op, f"{row['kvd_us']:.2f}", f"{row['echo_us']:.2f}", f"{row['ratio']:.2f}x",
             f"{row['kvd_us'] - row['echo_us']:.2f}", *_pure_cells(row),
             f"{row['kvd_server_us']:.2f}", f"{row['echo_server_us']:.2f}",
             f"{row['server_ratio']:.2f}x", *(f"{row[stage]:.2f}" for stage in STAGES)]
            for op, row in results["ops"].items()]
    table = markdown_table(["op", "kvd µs", "echo µs", "kvd / floor", "kvd - floor µs",
                            "pure-Python codec µs", "C saves µs", "kvd server µs",
                            "echo server µs", "floor / kvd server", "decode µs", "handle µs",
                            "encode µs"], rows)
    return ("## Request path in one process, no scheduler (bench/request_path.py)\n\n"
            f"Batch 1, {results['rounds']:,} rounds, medians. Over a round (alloc, seal, "
            f"release, lookup, release) the floor's server time is "
            f"**{results['round_server_ratio']:.2f}x** kvd's: what a saturated daemon's "
            f"throughput tends to against the floor's when every worker has a core "
            f"(bench/scaling.py's goal: >= 0.8x at 8 workers). The handler (validation and "
            f"pool) takes {results['handler_us_per_request']:.2f} µs of a request; without it, "
            f"kvd's server side is {results['round_path_ratio']:.2f}x the floor's.\n\n"
            + table + "\n")


def run_bench(quick: bool, out: Path) -> str:
    return report(out, "request_path", run(quick), markdown)


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run_bench))
