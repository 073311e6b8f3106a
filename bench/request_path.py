"""Request path: what one batch-1 request costs kvd beyond the echo floor, in one process.

Cross-process round trips on a small VM swing with where the scheduler puts the two processes
(one vCPU or two, a halted vCPU to wake) and with how cold each one's caches are after the
switch; bench/control_plane.py reports those as measured. This bench takes the scheduler out:
one process drives both ends of a real Unix socket and runs the daemon's loop iteration inline
(`Daemon.serve_once`), so a request's cost is path length only — the kernel's socket work plus
the Python on both sides — and repeats to a fraction of a microsecond. The echo floor is the
same selectors echo server as in bench/control_plane.py, driven the same way over a socketpair.

It reports, per op of the control plane's round (alloc, seal, release, lookup, release):
  * the in-process round trip, kvd (client encode → send → serve_once → recv → decode) next to
    the echo floor with the same request body, medians of interleaved chunks;
  * the same kvd round trip with its frame codec in pure Python (`kvd.protocol.use_c(False)`),
    in the same interleaving: what kvd/protocol/_wire.c saves;
  * the server's side of those same round trips alone: kvd's `serve_once` (select, recv,
    decode, handle, encode, send) and the echo server's loop iteration. A daemon that runs flat
    out on a core of its own serves 1 / (its time per request), so over the round's mix of ops
    the floor's server time over kvd's is what bench/scaling.py's ratio tends to on a host with
    a core per worker: a steady, scheduler-free view of that goal (>= 0.8x at 8 workers);
  * the stages of kvd's handling of that request (decode: unpack + parse, handle: the Service's
    validation and the pool, encode), each timed alone on the same requests, with the C codec.

    python -m bench.request_path [--quick] [--out DIR]
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack

from bench.common import TINY_GEOMETRY, bench_main, markdown_table, progress, write_json
from bench.control_plane import NUM_BLOCKS, OPS, digests, echo_replies
from kvd import protocol
from kvd.server.daemon import Daemon
from kvd.geometry import Geometry
from kvd.protocol import PROTOCOL_VERSION, FrameDecoder, FrameEncoder, decode_reply, decode_request
from kvd.runtime import DaemonPaths

ROUND = ("alloc", "seal", "release", "lookup", "release")  # the control plane's round
CHUNK = 100  # rounds per turn when kvd and the floor alternate


class InlineDaemon:
    """A real Daemon in this process (no journal), served one loop iteration per request."""

    def __init__(self, directory: str) -> None:
        name = f"bench-path-{uuid.uuid4().hex[:8]}"
        paths = DaemonPaths(name=name, socket_path=os.path.join(directory, "kvd.sock"),
                            lock_path=os.path.join(directory, "kvd.lock"),
                            pid_path=os.path.join(directory, "kvd.pid"),
                            segment_name=f"/kvd-{os.getuid()}-{name}")
        geometry = Geometry(num_blocks=NUM_BLOCKS, num_layers=TINY_GEOMETRY["layers"],
                            block_size=TINY_GEOMETRY["block_size"],
                            num_kv_heads=TINY_GEOMETRY["kv_heads"],
                            head_dim=TINY_GEOMETRY["head_dim"], dtype=TINY_GEOMETRY["dtype"])
        self.daemon = Daemon(paths, geometry, state_dir=directory, journal=False)
        self.daemon.start()
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


def constant_answer(session: Any, op: str, args: dict[str, Any]) -> Any:
    """What the daemon's handler answers each op of the round, shaped as the real answers, with
    no validation and no pool: the daemon's own path (select, recv, decode, encode, send) alone."""
    return None if op == "release" else [True] if op == "seal" else [0]


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
    clock, service, encoder = time.perf_counter_ns, inline.daemon.service, FrameEncoder()
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
        for stage, nanoseconds in (("decode", decoded - start), ("handle", handled - decoded),
                                   ("encode", encoded - handled)):
            samples[f"{op}:{stage}"].append(nanoseconds)


def median_us(samples: list[int]) -> float:
    return sorted(samples)[len(samples) // 2] / 1e3


def run(quick: bool) -> dict[str, Any]:
    num_chunks = 2 if quick else 30
    kvd_samples: dict[str, list[int]] = {op: [] for op in OPS}
    pure_samples: dict[str, list[int]] = {op: [] for op in OPS}
    echo_samples: dict[str, list[int]] = {op: [] for op in OPS}
    # the server's side alone (kvd's serve_once, the echo's loop iteration), C codec turns only
    kvd_server: dict[str, list[int]] = {op: [] for op in OPS}
    echo_server: dict[str, list[int]] = {op: [] for op in OPS}
    # kvd's server side again with its handler answering constants: the framework's share
    stub_server: dict[str, list[int]] = {op: [] for op in OPS}
    has_c = protocol.use_c(True)  # (off where kvd/protocol/_wire.c was not built: no pure column then)
    stage_samples: dict[str, list[int]] = {f"{op}:{stage}": [] for op in OPS
                                           for stage in ("decode", "handle", "encode")}
    key = 0
    with tempfile.TemporaryDirectory(prefix="kvd-path-") as directory:
        inline, echo = InlineDaemon(directory), InlineEcho()
        handle = inline.daemon._handle
        # (server, samples, server-side samples, whether its turn runs with the C codec, and
        # the daemon's handler for it)
        servers = [(inline, kvd_samples, kvd_server, True, handle),
                   (echo, echo_samples, echo_server, True, handle),
                   (inline, {op: [] for op in OPS}, stub_server, True, constant_answer)]
        if has_c:
            servers.append((inline, pure_samples, {op: [] for op in OPS}, False, handle))
        try:
            for chunk in range(num_chunks + 1):  # the first chunk warms up and is dropped
                progress(f"request path: chunk {chunk + 1} of {num_chunks + 1}")
                keep = chunk > 0
                for server, samples, server_samples, with_c, handler in servers:
                    protocol.use_c(with_c)
                    inline.daemon._handle = handler
                    for _ in range(CHUNK):
                        key += 1
                        timed_round(server, digests(key, 1),
                                    samples if keep else {op: [] for op in OPS},
                                    server_samples if keep else {op: [] for op in OPS})
                    protocol.use_c(has_c)
                    inline.daemon._handle = handle
                for _ in range(CHUNK):
                    key += 1
                    stage_times(inline, digests(key, 1),
                                stage_samples if keep else {k: [] for k in stage_samples})
        finally:
            echo.close()
            inline.close()
    rows = {}
    for op in OPS:
        mine, floor = median_us(kvd_samples[op]), median_us(echo_samples[op])
        mine_server, floor_server = median_us(kvd_server[op]), median_us(echo_server[op])
        rows[op] = {"kvd_us": mine, "echo_us": floor, "ratio": mine / floor,
                    "kvd_server_us": mine_server, "echo_server_us": floor_server,
                    "server_ratio": floor_server / mine_server,
                    "constant_handler_server_us": median_us(stub_server[op]),
                    "pure_python_us": median_us(pure_samples[op]) if has_c else None,
                    **{stage: median_us(stage_samples[f"{op}:{stage}"])
                       for stage in ("decode", "handle", "encode")}}
    # What scaling's saturated servers tend to (bench/scaling.py): the floor's server time per
    # request over kvd's, over the round's mix of ops.
    def per_round(field: str) -> float:
        return sum(rows[op][field] for op in ROUND)
    round_server_ratio = per_round("echo_server_us") / per_round("kvd_server_us")
    return {"num_blocks": NUM_BLOCKS, "rounds": num_chunks * CHUNK, "has_c": has_c, "ops": rows,
            "round_server_ratio": round_server_ratio,
            # kvd's server time over the floor's with the handler answering constants, and the
            # handler's share of a request in the daemon (µs)
            "round_constant_handler_ratio": (per_round("constant_handler_server_us")
                                             / per_round("echo_server_us")),
            "handler_us_per_request": (per_round("kvd_server_us")
                                       - per_round("constant_handler_server_us")) / len(ROUND)}


def _pure_cells(row: dict[str, Any]) -> list[str]:
    pure = row["pure_python_us"]
    if pure is None:
        return ["not built", "-"]
    return [f"{pure:.2f} ({pure / row['echo_us']:.2f}x)", f"{pure - row['kvd_us']:.2f}"]


def markdown(results: dict[str, Any]) -> str:
    rows = [[op, f"{row['kvd_us']:.2f}", f"{row['echo_us']:.2f}", f"{row['ratio']:.2f}x",
             f"{row['kvd_us'] - row['echo_us']:.2f}", *_pure_cells(row),
             f"{row['kvd_server_us']:.2f}", f"{row['echo_server_us']:.2f}",
             f"{row['server_ratio']:.2f}x", f"{row['decode']:.2f}", f"{row['handle']:.2f}",
             f"{row['encode']:.2f}"]
            for op, row in results["ops"].items()]
    table = markdown_table(["op", "kvd µs", "echo µs", "kvd / floor", "kvd - floor µs",
                            "pure-Python codec µs", "C saves µs", "kvd server µs",
                            "echo server µs", "floor / kvd server", "decode µs", "handle µs",
                            "encode µs"], rows)
    return ("## Request path in one process, no scheduler (bench/request_path.py)\n\n"
            f"One process drives both ends of a real Unix socket and runs the daemon's loop "
            f"iteration inline, so these are path lengths (kernel socket work + Python on both "
            f"sides), steady to a fraction of a µs; batch 1, {results['rounds']:,} rounds, "
            f"medians. The pure-Python column is the same kvd round trip with the frame codec "
            f"in Python (kvd.protocol.use_c(False)), interleaved with the others: what "
            f"kvd/protocol/_wire.c saves. The stages are kvd's decode (unpack + parse), handle "
            f"(validation + pool) and encode of the same requests, each timed alone. The server "
            f"columns time the server's side of the same round trips alone (kvd's serve_once, "
            f"the echo server's loop iteration): over a round (alloc, seal, release, lookup, "
            f"release) the floor's server time is {results['round_server_ratio']:.2f}x kvd's, "
            f"what a saturated daemon's throughput tends to against the floor's when every "
            f"worker has a core (bench/scaling.py's goal: >= 0.8x at 8 workers). With the "
            f"daemon's handler answering constants (no validation, no pool), kvd's server time "
            f"is {results['round_constant_handler_ratio']:.2f}x the floor's over the round: the "
            f"handler takes {results['handler_us_per_request']:.2f} µs of a request in the "
            f"daemon, the rest is the daemon's own path.\n\n"
            + table + "\n")


def run_bench(quick: bool, out: Path) -> str:
    results = run(quick)
    write_json(out, "request_path", results)
    return markdown(results)


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run_bench))
