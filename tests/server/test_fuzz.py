"""Protocol fuzz: hostile bytes at a live daemon while a well-behaved client keeps working.

`FrameFuzzer` makes batches of frames of six kinds: raw random bytes, length-prefixed random
bodies, valid requests with 1-3 flipped bits, schema-violating requests (a valid template with one
argument given a random msgpack value, dropped, or joined by an extra one; or a wrong shape
altogether), zero and huge length prefixes, frames cut short, and big frames (a 65,536-hash
lookup, one hash more, a body of exactly the frame cap). Each batch goes down a fresh
connection that then half-closes and reads every reply until the daemon closes it. Meanwhile
hundreds of idle and half-sent connections stay open, some clients pipeline requests and never
read a reply, and a well-behaved client in a thread allocs, writes, seals, looks up, verifies
and releases in a loop.

Afterwards: the daemon is alive, answered no request INTERNAL (a handler crashed) and sent
nothing that is not a valid reply, its invariants hold, the good client never failed, and the
daemon's RSS grew < 10 % from warm-up. Default run: 10,000 frames; `pytest -m slow`: 100,000.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from stress.stress_procs import block_bytes, check_invariants, pattern

import kvd
from kvd.protocol import MAX_FRAME_NBYTES, FrameDecoder, parse_reply, unpack_body

GEOMETRY = {"num_blocks": 1024, "layers": 2, "kv_heads": 2, "head_dim": 8, "block_size": 4,
            "dtype": "float32"}
HELLO = {"version": 1, "pid": 1}
# Valid arguments for every op but `shutdown` (a valid shutdown would stop the daemon, which is
# the contract, not a bug). Ids and counts are small so fuzz sessions never pin much of the pool.
TEMPLATES: dict[str, dict[str, Any]] = {
    "hello": HELLO,
    "alloc": {"num_blocks": 1},
    "seal": {"block_ids": [0], "hashes": [b"h" * 16]},
    "lookup": {"hashes": [b"h" * 16, b"i" * 16]},
    "release": {"block_ids": [0, 1]},
    "pin": {"block_ids": [2]},
    "stats": {},
    "seq_open": {"tokens": bytes(range(24)), "salt": b"s", "max_cached_tokens": 4},
    "seq_extend": {"seq_id": 1, "tokens": bytes(8), "num_computed": 0},
    "seq_commit": {"seq_id": 1, "num_computed": 4},
    "seq_fork": {"seq_id": 1},
    "seq_close": {"seq_id": 1},
    "seq_info": {"seq_id": 1},
}
# A daemon of two pools (issue 31): the same ops addressed by OP@NAME, and hello choosing a pool.
POOLS = ["--pool", "a:layers=2,kv-heads=2,head-dim=8,block-size=4,dtype=float32",
         "--pool", "b:layers=1,parts=1,kv-heads=1,head-dim=24,block-size=4,window=8",
         "--memory", "1M"]
POOL_TEMPLATES: dict[str, dict[str, Any]] = {
    **TEMPLATES, "hello": {**HELLO, "pool": "b"},
    **{f"{op}@{pool}": args for op, args in TEMPLATES.items() if op not in ("hello", "stats")
       for pool in ("a", "b", "nope")}}
KINDS = ("raw", "random_body", "bit_flip", "schema", "bad_length", "truncated", "big")
EDGE_INTS = (0, 1, -1, 2**31, 2**32, 2**63 - 1, -2**63, 2**64 - 1, 4096)


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def request(request_id: Any, op: Any, args: Any) -> bytes:
    return frame(msgpack.packb([request_id, op, args], use_bin_type=True))


class FrameFuzzer:
    """Batches of hostile frames; a batch is what one connection sends before half-closing."""

    def __init__(self, seed: int, templates: dict[str, dict[str, Any]] = TEMPLATES) -> None:
        self.rng = random.Random(seed)
        self.templates = templates

    def value(self, depth: int = 0) -> Any:
        """A random msgpack value of a random type."""
        rng = self.rng
        kind = rng.randrange(10 if depth < 3 else 7)
        if kind == 0:
            return rng.choice(EDGE_INTS) if rng.random() < 0.5 else rng.randrange(-2**63, 2**64)
        if kind == 1:
            return rng.randrange(0, 8)
        if kind == 2:
            return rng.choice((None, True, False, 0.5, float("nan"), -1e300))
        if kind == 3:
            return "".join(chr(rng.randrange(1, 0x2FF)) for _ in range(rng.randrange(0, 20)))
        if kind in (4, 5):
            return rng.randbytes(rng.choice((0, 1, 4, 15, 16, 17, 64, 65, 300)))
        if kind == 6:
            return rng.choice(("shutdown-not", "", "x" * 70, "alloc", "lookup"))
        if kind in (7, 8):
            return [self.value(depth + 1) for _ in range(rng.randrange(0, 5))]
        return {self.key(): self.value(depth + 1) for _ in range(rng.randrange(0, 4))}

    def key(self) -> Any:
        rng = self.rng
        return rng.choice((rng.choice(list({k for t in self.templates.values() for k in t})),
                           "extra", "", rng.randrange(5)))

    def valid(self) -> bytes:
        op = self.rng.choice(list(self.templates))
        return request(self.rng.randrange(1 << 20), op, self.templates[op])

    def schema_violation(self) -> bytes:
        rng = self.rng
        op = rng.choice(list(self.templates))
        args = dict(self.templates[op])
        choice = rng.randrange(8)
        if choice < 3 and args:
            args[rng.choice(list(args))] = self.value()  # a wrong type or range
        elif choice == 3 and args:
            del args[rng.choice(list(args))]
        elif choice == 4:
            args[self.key()] = self.value()
        elif choice == 5:
            return request(self.value(), self.value(), self.value())
        elif choice == 6:
            return frame(msgpack.packb(self.value(), use_bin_type=True))
        else:
            args = self.value()
        return request(rng.randrange(1 << 20), op, args)

    def bit_flipped(self) -> bytes:
        data = bytearray(self.valid())
        for _ in range(self.rng.randrange(1, 4)):
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        return bytes(data)

    def batch(self, kind: str | None = None) -> tuple[str, list[bytes]]:
        rng = self.rng
        kind = kind or rng.choices(KINDS, weights=(4, 12, 20, 56, 4, 4, 0.2))[0]
        if kind == "big":  # at and just past the batch and frame limits
            num_hashes = rng.choice((1 << 16, (1 << 16) + 1))
            return kind, [request(1, "hello", HELLO),
                          request(2, "lookup", {"hashes": [rng.randbytes(16)] * num_hashes}),
                          frame(rng.randbytes(MAX_FRAME_NBYTES))]
        if kind == "raw":
            return kind, [rng.randbytes(rng.randrange(1, 200))]
        if kind == "random_body":
            return kind, [frame(rng.randbytes(rng.randrange(1, 100))) for _ in range(20)]
        if kind == "bit_flip":
            return kind, [self.bit_flipped() for _ in range(20)]
        if kind == "schema":
            hello = [request(0, "hello", HELLO)] if rng.random() < 0.8 else []
            return kind, hello + [self.schema_violation() for _ in range(60)]
        if kind == "bad_length":
            length = rng.choice((0, MAX_FRAME_NBYTES + 1, 2**32 - 1))
            return kind, [struct.pack(">I", length) + rng.randbytes(rng.randrange(0, 16))]
        valid = self.valid()
        return kind, [valid[: rng.randrange(1, len(valid))]]

    def batches(self, num_frames: int) -> Iterator[tuple[str, list[bytes]]]:
        while num_frames > 0:
            kind, frames = self.batch()
            num_frames -= len(frames)
            yield kind, frames


def send_batch(socket_path: str, frames: list[bytes], codes: Counter[str]) -> None:
    """Send `frames` on a new connection, half-close, and check every reply until EOF."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(socket_path)
        try:
            sock.sendall(b"".join(frames))
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed on a framing error: fine, read what it said
        decoder = FrameDecoder()
        for body in iter_bodies(sock, decoder):
            try:
                parse_reply(unpack_body(body))
                codes["ok"] += 1
            except kvd.KvdError as exc:
                codes[exc.code] += 1


def iter_bodies(sock: socket.socket, decoder: FrameDecoder) -> Iterator[bytes]:
    while True:
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            return
        if not data:
            return
        yield from decoder.feed(data)


class GoodClient(threading.Thread):
    """Allocs, writes, seals, looks up, verifies and releases until stopped; records failures."""

    def __init__(self, socket_path: str) -> None:
        super().__init__(daemon=True)
        self.socket_path = socket_path
        self.stop = threading.Event()
        self.num_cycles = 0
        self.max_latency_s = 0.0
        self.failures: list[str] = []

    def run(self) -> None:
        try:
            with kvd.connect(self.socket_path, timeout_s=10) as client:
                while not self.stop.is_set():
                    started = time.perf_counter()
                    self.cycle(client)
                    self.max_latency_s = max(self.max_latency_s, time.perf_counter() - started)
                    self.num_cycles += 1
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            self.failures.append(f"{type(exc).__name__}: {exc}")

    def cycle(self, client: kvd.Client) -> None:
        keys = [hashlib.blake2b(b"good-%d-%d" % (self.num_cycles, i), digest_size=16).digest()
                for i in range(2)]
        block_ids = client.alloc(2)
        nbytes = client.geometry.block_nbytes
        for block_id, key in zip(block_ids, keys):
            block_bytes(client, block_id)[:] = pattern(key, nbytes)
        client.seal(block_ids, keys)
        hit_ids = client.lookup(keys)
        if hit_ids != block_ids:
            raise AssertionError(f"lookup of fresh keys gave {hit_ids}, sealed {block_ids}")
        for block_id, key in zip(hit_ids, keys):
            if not np.array_equal(block_bytes(client, block_id), pattern(key, nbytes)):
                raise AssertionError(f"block {block_id} lost its bytes")
        client.release(block_ids + hit_ids)


def open_idle_connections(socket_path: str, num: int, rng: random.Random) -> list[socket.socket]:
    """Connections that say nothing, only hello, or half a frame, and then just sit there."""
    socks = []
    for i in range(num):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path)
        hello = request(0, "hello", HELLO)
        if i % 3 == 1:
            sock.sendall(hello)
        elif i % 3 == 2:
            sock.sendall(hello[: rng.randrange(1, len(hello))])
        socks.append(sock)
    return socks


def flood_without_reading(socket_path: str, num_requests: int) -> bool:
    """Pipeline `stats` requests and never read; True if the daemon cut the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(socket_path)
        sock.settimeout(10)
        chunk = request(0, "hello", HELLO) + b"".join(request(i, "stats", {}) for i in range(100))
        try:
            for _ in range(num_requests // 100):
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as file:
        return next(int(line.split()[1]) for line in file if line.startswith("VmRSS:"))


def run_fuzz(handle: Any, num_frames: int, seed: int,
             templates: dict[str, dict[str, Any]] = TEMPLATES) -> dict[str, Any]:
    socket_path = handle.paths.socket_path
    fuzzer = FrameFuzzer(seed, templates)
    codes: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    good = GoodClient(socket_path)
    good.start()
    with handle.connect() as monitor:
        daemon_pid = monitor.stats()["daemon_pid"]
        idle = open_idle_connections(socket_path, 200, fuzzer.rng)
        # Warm-up: one batch of every kind, so the daemon's buffers and allocator arenas reach
        # their high-water mark (a 2 MiB frame) before the RSS baseline is taken.
        for kind in KINDS:
            send_batch(socket_path, fuzzer.batch(kind)[1], Counter())
        flood_without_reading(socket_path, 2000)
        rss_warm = rss_kib(daemon_pid)
        sent = 0
        for kind, frames in fuzzer.batches(num_frames):
            send_batch(socket_path, frames, codes)
            kinds[kind] += len(frames)
            sent += len(frames)
            if sent % 2000 < len(frames):  # now and then, a client that never reads
                kinds["never_read"] += 2000
                flood_without_reading(socket_path, 2000)
        for sock in idle:
            sock.close()
        good.stop.set()
        good.join(30)
        time.sleep(0.2)  # let the daemon notice the closed connections
        stats = monitor.stats()
        check_invariants(monitor)
        rss_end = rss_kib(daemon_pid)
    assert handle.proc.poll() is None, f"the daemon died:\n{handle.log()}"
    return {"frames": sent + kinds["never_read"], "kinds": dict(kinds), "reply_codes": dict(codes),
            "daemon_errors": stats["errors"], "sessions_left": stats["sessions"] - 1,
            "good_cycles": good.num_cycles, "good_failures": good.failures,
            "good_max_latency_ms": round(1e3 * good.max_latency_s, 1),
            "rss_kib_warm": rss_warm, "rss_kib_end": rss_end,
            "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2)}


def check(summary: dict[str, Any], num_frames: int) -> None:
    assert summary["frames"] >= num_frames, summary
    assert "INTERNAL" not in summary["reply_codes"], summary
    assert "INTERNAL" not in summary["daemon_errors"], summary
    assert not summary["good_failures"] and summary["good_cycles"] > 0, summary
    assert summary["rss_growth_pct"] < 10, summary


@pytest.fixture
def fuzz_daemon(daemon_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("KVD_DEBUG", "1")
    return daemon_factory(**GEOMETRY)


@pytest.mark.integration
def test_fuzz_frames(fuzz_daemon: Any) -> None:
    summary = run_fuzz(fuzz_daemon, 10_000, seed=int(os.environ.get("KVD_FUZZ_SEED", "1")))
    print(f"\nfuzz summary: {summary}")
    check(summary, 10_000)


@pytest.mark.integration
def test_fuzz_frames_several_pools(daemon_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVD_DEBUG", "1")
    handle = daemon_factory(POOLS)
    summary = run_fuzz(handle, 5_000, seed=int(os.environ.get("KVD_FUZZ_SEED", "3")),
                       templates=POOL_TEMPLATES)
    print(f"\nfuzz summary: {summary}")
    check(summary, 5_000)


@pytest.mark.slow
def test_fuzz_frames_slow(fuzz_daemon: Any) -> None:
    summary = run_fuzz(fuzz_daemon, 100_000, seed=int(os.environ.get("KVD_FUZZ_SEED", "2")))
    print(f"\nfuzz summary: {summary}")
    check(summary, 100_000)


@pytest.mark.integration
def test_frames_split_at_every_byte(kvd_daemon: Any) -> None:
    """Each split point of a pipelined hello + stats + alloc, delivered in two sends."""
    frames = (request(1, "hello", HELLO) + request(2, "stats", {})
              + request(3, "alloc", {"num_blocks": 1}))
    for split in range(1, len(frames)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(kvd_daemon.paths.socket_path)
            sock.sendall(frames[:split])
            time.sleep(0.0005)  # usually lands as a separate recv in the daemon
            sock.sendall(frames[split:])
            replies = read_replies(sock, 3)
        assert [reply[0] for reply in replies] == [1, 2, 3], split
        assert replies[2][1] is True and len(replies[2][2]) == 1, (split, replies[2])


@pytest.mark.integration
def test_frame_one_byte_at_a_time(kvd_daemon: Any) -> None:
    frames = request(1, "hello", HELLO) + request(2, "lookup", {"hashes": [b"x" * 16]})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(kvd_daemon.paths.socket_path)
        for i in range(len(frames)):
            sock.send(frames[i:i + 1])
            time.sleep(0.0002)
        assert read_replies(sock, 2)[1] == [2, True, []]


@pytest.mark.integration
def test_client_that_never_reads_is_cut_off(kvd_daemon: Any) -> None:
    """Replies piling up unread past the daemon's cap close that session, not the daemon."""
    assert flood_without_reading(kvd_daemon.paths.socket_path, 100_000)
    with kvd_daemon.connect() as client:
        assert client.stats()["sessions"] == 1


def read_replies(sock: socket.socket, num: int) -> list[Any]:
    decoder, replies = FrameDecoder(), []
    while len(replies) < num:
        data = sock.recv(1 << 16)
        assert data, f"daemon closed after {len(replies)} replies"
        replies += [msgpack.unpackb(body) for body in decoder.feed(data)]
    return replies
