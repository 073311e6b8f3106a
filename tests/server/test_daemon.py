"""The daemon with real processes: sharing, crash reclaim, hostile input, typed errors, eviction.

Most tests share one module-scoped daemon (starting one costs about a second on the CI box) and
must leave it as they found it: no session, nothing owned or pinned (`idle` checks that after
each test). Tests that need a particular policy or dtype start their own daemons, in parallel.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

import kvd
from kvd.core.policies import DEFAULT_POLICY, POLICIES
from kvd.protocol import PROTOCOL_VERSION, FrameDecoder, encode_request, parse_reply, unpack_body
from conftest import ROOT, DaemonHandle, child_env, daemon_name, running_daemons
from kvd.runtime import DaemonPaths

SMALL = {"num_blocks": 64, "layers": 2, "kv_heads": 2, "head_dim": 8, "block_size": 4,
         "dtype": "float32"}
STATE_KEYS = ("free", "owned", "sealed", "cached", "indexed", "allocations", "evictions",
              "seals", "sequences")

pytestmark = pytest.mark.integration


# ---- daemons --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    with running_daemons(tmp_path_factory.mktemp("daemon"), SMALL) as (daemon,):
        yield daemon


def state(client: kvd.Client) -> tuple:
    stats = client.stats()
    return tuple(stats[key] for key in STATE_KEYS)


def wait_idle(client: kvd.Client, num_sessions: int = 1, timeout_s: float = 2.0) -> dict:
    """Stats once only `num_sessions` sessions remain (other clients' EOFs are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if stats["sessions"] <= num_sessions or time.monotonic() > deadline:
            return stats
        time.sleep(0.005)


@pytest.fixture
def idle(shared: DaemonHandle) -> Iterator[DaemonHandle]:
    """The shared daemon; after the test it must hold no session and nothing owned or pinned."""
    yield shared
    with shared.connect() as client:
        stats = wait_idle(client)
    assert (stats["sessions"], stats["owned"], stats["sealed"], stats["sequences"]) == (1, 0, 0, 0)
    assert "Traceback" not in shared.log()


# ---- raw protocol access ----------------------------------------------------------------------

class Raw:
    """A socket speaking the wire protocol by hand, to send what no Client would."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self._decoder = FrameDecoder()
        self._replies: list = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, obj: object) -> list | None:
        body = obj if isinstance(obj, bytes) else msgpack.packb(obj)
        self.send(struct.pack(">I", len(body)) + body)
        return self.reply()

    def request(self, op: str, args: dict, request_id: int = 7) -> list | None:
        self.send(encode_request(request_id, op, args))
        return self.reply()

    def hello(self) -> None:
        assert self.request("hello", {"version": PROTOCOL_VERSION})[1] is True

    def reply(self) -> list | None:
        """The next reply, or None at EOF."""
        while not self._replies:
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self._replies += [unpack_body(body) for body in self._decoder.feed(data)]
        return self._replies.pop(0)

    def close(self) -> None:
        self.sock.close()


def code_of(reply: list) -> str:
    assert reply is not None and reply[1] is False, reply
    return reply[2][0]


# ---- two processes share bytes ----------------------------------------------------------------

WRITER = r"""
import sys, hashlib, numpy as np, kvd
client = kvd.connect(sys.argv[1])
hashes = kvd.hash_blocks(np.arange(1000, 1016), client.geometry.block_size)
ids = client.alloc(len(hashes))
data = np.random.default_rng(1234).standard_normal((len(ids), *client.geometry.block_shape))
client.pool[ids] = data
client.seal(ids, hashes)
print(hashlib.sha256(client.pool[ids].tobytes()).hexdigest(), *ids, flush=True)
sys.stdin.readline()  # hold the pins until the test says so
"""

READER = r"""
import sys, hashlib, numpy as np, kvd
with kvd.connect(sys.argv[1]) as client:
    hashes = kvd.hash_blocks(np.arange(1000, 1016), client.geometry.block_size)
    ids = client.lookup(hashes)
    data = client.pool[ids].tobytes()
    client.release(ids)
    print(hashlib.sha256(data).hexdigest(), *ids, flush=True)
"""


def test_two_processes_share_a_sealed_prefix_and_read_identical_bytes(idle):
    writer = subprocess.Popen([sys.executable, "-c", WRITER, idle.name], env=child_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        written = writer.stdout.readline().split()
        read = subprocess.run([sys.executable, "-c", READER, idle.name], env=child_env(),
                              capture_output=True, text=True, timeout=30, check=True)
        assert read.stdout.split() == written  # same digest, same block ids
        assert len(written) == 1 + 4
        expected = np.random.default_rng(1234).standard_normal((4, 2, 2, 4, 2, 8))
        with idle.connect() as client:  # a third process: the bytes are the writer's
            ids = [int(i) for i in written[1:]]
            assert np.array_equal(client.pool[ids], expected.astype(np.float32))
        writer.stdin.write("done\n")
        writer.stdin.flush()
        assert writer.wait(30) == 0
    finally:
        writer.kill()
        writer.wait()
        writer.stdin.close()
        writer.stdout.close()


# ---- crash reclaim --------------------------------------------------------------------------

HOLDER = r"""
import os, sys, time, kvd
client = kvd.connect(sys.argv[1])
ids = client.alloc(client.geometry.num_blocks)
client.pool[ids] = 1.0
child = 0
if sys.argv[2] == "fork":  # a child inherits the socket: EOF will not come when we die
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
print("ready", len(ids), child, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["plain", "fork"])
def test_sigkilled_worker_holding_the_whole_pool_is_reclaimed_within_100ms(idle, mode):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, idle.name, mode], env=child_env(),
                              stdout=subprocess.PIPE, text=True)
    child_pid = 0
    try:
        with idle.connect() as client:
            word, num_held, child = holder.stdout.readline().split()
            child_pid = int(child)
            num_blocks = client.geometry.num_blocks
            assert (word, int(num_held)) == ("ready", num_blocks)
            with pytest.raises(kvd.NoSpaceError):
                client.alloc(1)
            os.kill(holder.pid, signal.SIGKILL)
            started = time.monotonic()
            while True:
                try:
                    block_ids = client.alloc(num_blocks)
                    break
                except kvd.NoSpaceError:
                    assert time.monotonic() - started < 5, "blocks never came back"
                    time.sleep(0.001)
            elapsed_s = time.monotonic() - started
            if child_pid:
                os.kill(child_pid, 0)  # still alive and holding the socket: the pidfd did it
            client.release(block_ids)
        assert elapsed_s < 0.1, f"reclaim took {elapsed_s * 1e3:.1f} ms"
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
        if child_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, signal.SIGKILL)


# ---- hostile input --------------------------------------------------------------------------

# (label, raw bytes sent after connect (and hello if the label says so), acceptable codes)
FRAMING_GARBAGE = [
    ("random bytes", random.Random(7).randbytes(4096), {"TOO_LARGE", "PROTOCOL"}),
    ("zero length", b"\0\0\0\0", {"PROTOCOL"}),
    ("huge length", b"\xff\xff\xff\xff" + b"x" * 64, {"TOO_LARGE"}),
    ("just above the cap", struct.pack(">I", 2 * 1024 * 1024 + 1), {"TOO_LARGE"}),
]

BODY_GARBAGE = [
    ("bad msgpack", b"\xc1", "PROTOCOL"),
    ("truncated msgpack", b"\x93\x01", "PROTOCOL"),
    ("trailing bytes", msgpack.packb([1, "stats", {}]) + b"\x00", "PROTOCOL"),
    ("deep nesting", b"\x91" * 100_000 + b"\xc0", "PROTOCOL"),
    ("array claiming 4G items", b"\xdd\xff\xff\xff\xff", "PROTOCOL"),
    ("ext type", msgpack.packb(msgpack.ExtType(5, b"x")), "PROTOCOL"),
    ("a map", msgpack.packb({"op": "alloc"}), "PROTOCOL"),
    ("two items", msgpack.packb([1, "alloc"]), "PROTOCOL"),
    ("op not a string", msgpack.packb([1, 2, {}]), "PROTOCOL"),
    ("id not an int", msgpack.packb(["x", "stats", {}]), "PROTOCOL"),
    ("negative id", msgpack.packb([-1, "stats", {}]), "PROTOCOL"),
    ("args a list", msgpack.packb([1, "stats", []]), "PROTOCOL"),
    ("int keys", msgpack.packb([1, "stats", {1: 2}]), "PROTOCOL"),
    ("long op", msgpack.packb([1, "a" * 1000, {}]), "PROTOCOL"),
    ("unknown op", msgpack.packb([1, "format_disk", {}]), "UNKNOWN_OP"),
    ("num_blocks a string", msgpack.packb([1, "alloc", {"num_blocks": "9"}]), "BAD_ARGS"),
    ("block ids of floats", msgpack.packb([1, "release", {"block_ids": [1.5]}]), "BAD_ARGS"),
    ("huge batch", msgpack.packb([1, "lookup", {"hashes": [b"h"] * 70_000}]), "BAD_ARGS"),
]


def test_garbage_never_stops_the_daemon_and_a_concurrent_client_keeps_succeeding(idle):
    stop = threading.Event()
    failures: list[BaseException] = []
    num_ok = [0]

    def well_behaved() -> None:
        try:
            with idle.connect(timeout_s=5) as client:
                while not stop.is_set():
                    block_ids = client.alloc(4)
                    client.pool[block_ids] = 3.0
                    client.release(block_ids)
                    num_ok[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failures.append(exc)

    def served_meanwhile() -> None:
        """Wait until the well-behaved client completes another round (it is not starved)."""
        seen, deadline = num_ok[0], time.monotonic() + 5
        while num_ok[0] == seen and not failures and time.monotonic() < deadline:
            time.sleep(0.001)
        assert num_ok[0] > seen, failures

    thread = threading.Thread(target=well_behaved)
    thread.start()
    try:
        for label, data, codes in FRAMING_GARBAGE:
            raw = Raw(idle.paths.socket_path)
            raw.send(data)
            assert code_of(raw.reply()) in codes, label
            assert raw.reply() is None, f"{label}: the session must be closed"
            raw.close()
            served_meanwhile()
        raw = Raw(idle.paths.socket_path)
        raw.hello()
        for label, body, code in BODY_GARBAGE:
            assert code_of(raw.frame(body)) == code, label
            served_meanwhile()
        assert raw.request("stats", {})[1] is True  # the session survived every body error
        raw.send(b"\0\0")  # half a length prefix, then hang up
        raw.close()
        for _ in range(20):  # connect and vanish, with and without half a frame
            raw = Raw(idle.paths.socket_path)
            raw.send(struct.pack(">I", 100) + b"partial")
            raw.close()
        served_meanwhile()
    finally:
        stop.set()
        thread.join(30)
    assert not failures, failures


def test_requests_before_hello_and_a_wrong_version_are_refused(idle):
    raw = Raw(idle.paths.socket_path)
    try:
        reply = raw.request("alloc", {"num_blocks": 1}, request_id=41)
        assert (reply[0], code_of(reply)) == (41, "PROTOCOL")
        assert code_of(raw.request("hello", {"version": PROTOCOL_VERSION + 1})) == "VERSION"
        assert code_of(raw.request("stats", {})) == "PROTOCOL"  # still not admitted
        assert code_of(raw.request("hello", {})) == "BAD_ARGS"
        raw.hello()
        assert raw.request("stats", {})[1] is True
    finally:
        raw.close()


def test_pipelined_requests_are_answered_in_order(idle):
    raw = Raw(idle.paths.socket_path)
    try:
        raw.hello()
        raw.send(b"".join(encode_request(i, "stats", {}) for i in range(100, 300)))
        assert [raw.reply()[0] for _ in range(200)] == list(range(100, 300))
    finally:
        raw.close()


def test_a_chunk_mixing_common_and_uncommon_frames_is_answered_frame_by_frame(idle):
    """kvd/protocol/_wire.c decodes a chunk of whole frames at once, or leaves the whole chunk to the
    Python path when one body is not its to decode (a float, a bytes key, a bad shape, an
    undecodable body): every frame is then still answered, in order, as Python decides."""
    def frame(obj: object) -> bytes:
        body = obj if isinstance(obj, bytes) else msgpack.packb(obj, use_bin_type=True)
        return struct.pack(">I", len(body)) + body

    raw = Raw(idle.paths.socket_path)
    try:
        raw.hello()
        raw.send(b"".join([
            frame([1, "stats", {}]),
            frame([2, "alloc", {"num_blocks": 1.5}]),  # a float: BAD_ARGS from the validator
            frame([3, "stats", {b"x": 1}]),  # a bytes key: PROTOCOL, with the request id
            frame(b"\xc1"),  # undecodable: PROTOCOL, no id
            frame([5, "alloc", {"num_blocks": 1}]),
        ]))
        replies = [raw.reply() for _ in range(5)]
        assert [reply[0] for reply in replies] == [1, 2, 3, None, 5]
        assert [reply[1] is True or reply[2][0] for reply in replies] == [
            True, "BAD_ARGS", "PROTOCOL", "PROTOCOL", True]
        assert raw.request("stats", {})[2]["owned"] == 1  # and the session goes on
    finally:
        raw.close()


# ---- every error class through the daemon, state unchanged ----------------------------------

def _raises(code: str, reply: list) -> None:
    """The reply decodes (as the client decodes it) to the class mapped to `code`."""
    with pytest.raises(kvd.ERROR_CLASSES[code]):
        parse_reply(reply)


def test_every_error_code_round_trips_and_leaves_state_unchanged(idle):
    hashes = kvd.hash_blocks(np.arange(12), 4)
    with idle.connect() as client, idle.connect() as other:
        owned = client.alloc(4)
        client.seal(owned[:2], hashes[:2])
        hog = other.alloc(client.stats()["free"] + client.stats()["cached"] - 1)
        before = state(client)
        client_errors = [
            (kvd.BadArgsError, lambda: client.alloc(-1)),
            (kvd.BadArgsError, lambda: client.seal(owned[2:3], [b""])),
            (kvd.BadArgsError, lambda: client.release([10**6])),
            (kvd.NoSpaceError, lambda: client.alloc(2)),
            (kvd.NoSpaceError, lambda: client.open_sequence(np.arange(100, 120))),
            (kvd.NotFoundError, lambda: client.release([hog[0]])),
            (kvd.NotFoundError, lambda: client.close_sequence(kvd.Sequence(10**9, [], 0))),
            (kvd.InUseError, lambda: client.seal(owned[:1], hashes[2:3])),
            (kvd.InUseError, lambda: client.pin(owned[2:3])),
        ]
        for error, call in client_errors:
            with pytest.raises(error):
                call()
            assert state(client) == before, error
        raw = Raw(idle.paths.socket_path)
        try:
            _raises("UNKNOWN_OP", raw.request("frobnicate", {}))
            _raises("PROTOCOL", raw.request("stats", {}))
            _raises("VERSION", raw.request("hello", {"version": 999}))
            raw.hello()
            _raises("PROTOCOL", raw.frame(b"\xc1"))
            raw.send(struct.pack(">I", 1 << 30))
            _raises("TOO_LARGE", raw.reply())
        finally:
            raw.close()
        assert state(client) == before
        with pytest.raises(kvd.TooLargeError):  # refused before it is sent, too
            client.lookup([b"h" * 16] * 200_000)
        errors = client.stats()["errors"]
        for code in ("BAD_ARGS", "NO_SPACE", "NOT_FOUND", "IN_USE", "UNKNOWN_OP", "PROTOCOL",
                     "VERSION", "TOO_LARGE"):
            assert errors.get(code, 0) >= 1, code
        other.release(hog)
        client.release(owned)


# ---- eviction and policies ------------------------------------------------------------------

def test_default_policy_is_the_documented_one(idle):
    with idle.connect() as client:
        assert client.stats()["policy"] == DEFAULT_POLICY


def _eviction_scenario(daemon: DaemonHandle, policy: str) -> None:
    hashes = kvd.hash_blocks(np.arange(32), 4)
    with daemon.connect() as a, daemon.connect() as b:
        assert a.stats()["policy"] == policy
        owned = a.alloc(16)
        with pytest.raises(kvd.NoSpaceError):  # fully pinned
            b.alloc(1)
        a.pool[owned[:8]] = np.arange(8, dtype=np.float32).reshape(8, 1, 1, 1, 1, 1)
        a.seal(owned[:8], hashes[:8])
        a.release(owned[4:])  # 4 sealed blocks cached, 8 owned freed; 4 stay pinned
        stats = a.stats()
        assert (stats["free"], stats["cached"], stats["sealed"]) == (8, 4, 4)
        taken = b.alloc(12)  # needs every cached block
        stats = b.stats()
        assert (stats["evictions"], stats["cached"], stats["free"]) == (4, 0, 0)
        assert set(taken).isdisjoint(owned[:4])
        assert b.lookup(hashes[:8]) == owned[:4]  # the pinned prefix survived, bytes too
        assert (b.pool[owned[:4]] == np.arange(4).reshape(4, 1, 1, 1, 1, 1)).all()
        with pytest.raises(kvd.NoSpaceError):
            b.alloc(1)
        assert b.stats()["evictions"] == 4  # refusing evicted nothing


def test_policy_flag_selects_each_registered_policy_and_pinned_blocks_are_never_evicted(
        tmp_path):
    names = sorted(POLICIES)
    geometry = {**SMALL, "num_blocks": 16}
    with running_daemons(tmp_path, *({**geometry, "policy": name} for name in names)) as started:
        for name, daemon in zip(names, started):
            _eviction_scenario(daemon, name)


def test_unknown_policy_is_refused_at_start(tmp_path):
    daemon = DaemonHandle.launch(tmp_path, policy="belady", **SMALL)
    assert daemon.proc.wait(30) != 0
    assert "unknown --policy 'belady'" in daemon.log()
    assert not os.path.exists(daemon.paths.socket_path)
    assert not os.path.exists(f"/dev/shm{daemon.paths.segment_name}")


# ---- segment views --------------------------------------------------------------------------

def test_views_have_the_pool_dtype_and_shape_for_every_dtype(tmp_path):
    dtypes = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}
    option_sets = [{**SMALL, "num_blocks": 4, "dtype": name} for name in dtypes]
    with running_daemons(tmp_path, *option_sets) as started:
        for (name, storage), daemon in zip(dtypes.items(), started):
            with daemon.connect() as writer, daemon.connect() as reader:
                assert writer.geometry.dtype == name
                shape = (2, 2, 4, 2, 8)
                view = writer.view(1)
                assert view.dtype == storage and view.shape == shape
                assert writer.pool.shape == (4, *shape) and writer.pool.dtype == storage
                assert np.shares_memory(view, writer.pool)  # a view, not a copy
                block_ids = writer.alloc(1)
                writer.view(block_ids[0])[:] = np.arange(np.prod(shape)).reshape(shape)
                got = reader.view(block_ids[0])
                assert got.tobytes() == writer.view(block_ids[0]).tobytes()
                del view, got
                writer.release(block_ids)


# ---- running out of file descriptors ----------------------------------------------------------

FD_LIMIT = 64
LIMITED_START = ("import resource, runpy, sys; "
                 f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT})); "
                 "sys.argv[0] = 'kvd'; runpy.run_module('kvd.cli', run_name='__main__')")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def start_scripted(script: str, tmp_path: Path) -> DaemonHandle:
    """`kvd start` (SMALL geometry) through `python -c script`, which then runs kvd.cli."""
    name = daemon_name()
    log_path = tmp_path / f"{name}.log"
    command = [sys.executable, "-c", script, "start", "--name", name,
               *(f"--{key.replace('_', '-')}={value}" for key, value in SMALL.items())]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, env=child_env(), cwd=ROOT, stdout=log, stderr=log)
    return DaemonHandle(name, proc, DaemonPaths.for_name(name), log_path)


def test_out_of_fds_the_daemon_rests_its_listener_instead_of_spinning(tmp_path):
    """Regression: once accept() failed with EMFILE the listener stayed readable, so the loop
    spun a whole core and logged 'accept failed' millions of times (7 MB in 2 s)."""
    daemon = start_scripted(LIMITED_START, tmp_path)
    proc, log_path = daemon.proc, daemon.log_path
    clients = []
    try:
        daemon.wait_ready()
        with daemon.connect() as served:
            for _ in range(FD_LIMIT + 16):  # more than its fds: the last ones wait in the backlog
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(daemon.paths.socket_path)
                clients.append(sock)
            time.sleep(0.3)  # let it hit the limit
            before = cpu_s(proc.pid), log_path.stat().st_size
            time.sleep(2.0)
            spent_s, logged = cpu_s(proc.pid) - before[0], log_path.stat().st_size - before[1]
            assert spent_s < 0.5, f"the daemon spun: {spent_s:.2f} s of CPU in 2 s"
            assert logged < 10_000, f"{logged} bytes of log in 2 s"
            assert served.stats()["sessions"] >= 1  # sessions it has keep being served
            for sock in clients:
                sock.close()
            clients.clear()
        with daemon.connect() as late:  # fds are free again: it accepts
            assert late.stats()["sessions"] == 1
    finally:
        for sock in clients:
            sock.close()
        daemon.stop_and_check()


SHORT_HELLO_START = ("import runpy, sys; import kvd.server.loop as loop; "
                     "loop.HELLO_TIMEOUT_S = 0.5; "
                     "sys.argv[0] = 'kvd'; runpy.run_module('kvd.cli', run_name='__main__')")


def test_a_connection_that_never_says_hello_is_closed(tmp_path):
    """Regression: a connection that never said hello kept its session (and an fd) forever.
    With the timeout cut to 0.5 s, the silent one is closed and the greeted one is served."""
    daemon = start_scripted(SHORT_HELLO_START, tmp_path)
    silent = greeted = None
    try:
        daemon.wait_ready()
        silent, greeted = Raw(daemon.paths.socket_path), Raw(daemon.paths.socket_path)
        greeted.hello()
        started = time.monotonic()
        assert silent.reply() is None  # EOF: the daemon closed it
        assert time.monotonic() - started < 4.0
        time.sleep(1.0)  # past the greeted one's deadline too
        reply = greeted.request("stats", {})
        assert reply[1] is True and reply[2]["sessions"] == 1, reply
        assert "closed: no hello within 0.5 s" in daemon.log()
    finally:
        for raw in (silent, greeted):
            if raw is not None:
                raw.close()
        daemon.stop_and_check()


def test_a_started_daemon_keeps_under_30_attributes(tmp_path):
    """From 30 instance attributes on, CPython 3.11 stops sharing the instance dict's keys and
    every `self.x` in the loop gets slower: the daemon's own request path was 4 % slower
    (bench/request_path.py) the day a change took it to 30. Keep what the loop never reads in
    `started`."""
    from kvd.server.daemon import DaemonConfig, launch
    from kvd.geometry import Geometry

    paths = DaemonPaths.for_name(daemon_name(), str(tmp_path / "kvd.sock"))
    geometry = Geometry(num_blocks=4, num_layers=1, block_size=2, num_kv_heads=1, head_dim=8)
    state_dir = str(tmp_path / "state")
    daemon = launch(DaemonConfig(paths, geometry, state_dir=state_dir))
    try:
        assert len(vars(daemon)) < 30, sorted(vars(daemon))
    finally:
        daemon.stop()
        daemon.serve_forever()
