"""Crash recovery with real daemons: SIGKILL under load, failpoints, stamp checks, a failing
journal, `kvd stop --keep`, and clients across restarts.

Every block a test seals holds `pattern(hash)`, bytes derived from its content hash, so after a
recovery any hit can be checked: a hash that maps to a block must map to the block it was sealed
in, and that block must still hold the hash's pattern. Workers record a seal as *attempted*
before sending it and as *acknowledged* only after the reply: every acknowledged seal must
survive, an attempted one may or may not, but never with the wrong bytes.

One daemon name is reused across the crashes of a test (same segment, socket and journal paths);
`Restartable` starts each incarnation with KVD_DEBUG=1 (the `check_invariants` op) and its
cleanup removes whatever a crashed incarnation left, so a failing test leaks nothing.
"""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import posix_ipc
import pytest

import kvd
from conftest import ROOT, child_env, daemon_name, start_daemon_process, wait_ready
from kvd.server.daemon import DaemonConfig, Server, launch
from kvd.geometry import Geometry
from kvd.core.pool import ORPHAN
from kvd.server.journal import JOURNAL_FILENAME, Journal
from kvd.server.metrics import RENDER_TTL_S
from kvd.protocol import PROTOCOL_VERSION, FrameDecoder, encode_request, parse_reply, unpack_body
from kvd.runtime import DaemonPaths, state_dir

pytestmark = pytest.mark.integration

# 128-byte blocks: (1 layer, K/V, 2 tokens, 1 head, 8 dims) float32.
GEOMETRY = {"num_blocks": 256, "layers": 1, "kv_heads": 1, "head_dim": 8, "block_size": 2,
            "dtype": "float32"}
BOOT_ID_OFFSET = 32  # segment header: magic 8s, layout u32, header nbytes u32, uuid 16s, boot id


# ---- bytes derived from hashes ----------------------------------------------------------------

def pattern(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes a block sealed under `key` holds (a different stream for every hash)."""
    return np.frombuffer(hashlib.shake_128(key).digest(nbytes), dtype=np.uint8)


def block_bytes(client: kvd.Client, block_id: int) -> np.ndarray:
    return client.view(block_id).reshape(-1).view(np.uint8)


def fill(client: kvd.Client, block_ids: list[int], keys: list[bytes]) -> None:
    for block_id, key in zip(block_ids, keys):
        block_bytes(client, block_id)[:] = pattern(key, client.geometry.block_nbytes)


def new_keys(count: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(count)]


def seal_new(client: kvd.Client, count: int) -> dict[bytes, int]:
    """Allocate, fill, seal and release `count` blocks; returns {hash: block id} (all acked)."""
    block_ids = client.alloc(count)
    keys = new_keys(count)
    fill(client, block_ids, keys)
    assert client.seal(block_ids, keys) == [True] * count
    client.release(block_ids)
    return dict(zip(keys, block_ids))


def check_present(client: kvd.Client, sealed: dict[bytes, int], chunk: int = 8192) -> None:
    """Every hash maps to its block, which holds the hash's pattern."""
    nbytes = client.geometry.block_nbytes
    keys = list(sealed)
    for start in range(0, len(keys), chunk):
        part = keys[start:start + chunk]
        found = client.lookup(part)
        try:
            expected = [sealed[key] for key in part]
            if found != expected:
                missing = part[len(found)] if len(found) < len(part) else None
                pytest.fail(f"acknowledged seals lost or remapped: asked {len(part)}, found "
                            f"{len(found)}; first missing {missing and missing.hex()}; "
                            f"mismatches {sum(a != b for a, b in zip(found, expected))}")
            data = blocks_bytes(client, found)
            want = np.stack([pattern(key, nbytes) for key in part])
            bad = np.flatnonzero((data != want).any(axis=1))
            assert not len(bad), f"{len(bad)} recovered blocks hold wrong bytes, e.g. block " \
                                 f"{found[bad[0]]} under {part[bad[0]].hex()}"
        finally:
            client.release(found)


def blocks_bytes(client: kvd.Client, block_ids: list[int]) -> np.ndarray:
    """The bytes of these blocks, one row each (a daemon of several pools: view by view)."""
    if client.pool.ndim == len(client.geometry.block_shape) + 1:
        return client.pool[block_ids].reshape(len(block_ids), -1).view(np.uint8)
    return np.stack([block_bytes(client, block_id) for block_id in block_ids]) if block_ids \
        else np.empty((0, client.geometry.block_nbytes), dtype=np.uint8)


def check_maybe_present(client: kvd.Client, attempted: dict[bytes, int]) -> int:
    """Unacknowledged seals may be absent; a hit must be the attempted block with its bytes."""
    num_present = 0
    for key, block_id in attempted.items():
        found = client.lookup([key])
        try:
            if found:
                assert found == [block_id], f"{key.hex()} maps to {found}, was sealed in " \
                                            f"{block_id}"
                assert np.array_equal(block_bytes(client, block_id),
                                      pattern(key, client.geometry.block_nbytes)), \
                    f"unacknowledged seal {key.hex()} restored with wrong bytes"
                num_present += 1
        finally:
            client.release(found)
    return num_present


def check_absent(client: kvd.Client, keys: list[bytes]) -> None:
    for key in keys:
        found = client.lookup([key])
        client.release(found)
        assert not found, f"{key.hex()} should not be in the index, found in {found}"


def check_invariants(client: kvd.Client) -> list[list[int]]:
    """The KVD_DEBUG op (no public method: it is a debug op)."""
    return client._call("check_invariants", {})


def check_fresh_recovery(client: kvd.Client) -> dict:
    """Right after --recover, before anyone allocates: nothing owned or pinned survived."""
    stats = client.stats()
    assert stats["owned"] == 0 and stats["sealed"] == 0, stats
    assert stats["cached"] == stats["indexed"], stats
    check_invariants(client)
    return stats


# ---- one daemon name across incarnations -------------------------------------------------------

class Restartable:
    """`kvd start` under one name, again and again (with --recover), crashes included."""

    def __init__(self, log_dir: Path, geometry: dict[str, object]) -> None:
        self.name = daemon_name("r")
        self.paths = DaemonPaths.for_name(self.name)
        self.log_path = log_dir / f"{self.name}.log"
        self.geometry = geometry
        self.state_dir = state_dir(self.name)
        self.proc: subprocess.Popen | None = None
        self.flags: tuple[str, ...] = ()  # given to every incarnation (several pools: --pool)

    @property
    def segment_path(self) -> str:
        return f"/dev/shm{self.paths.segment_name}"

    @property
    def journal_path(self) -> Path:
        return self.state_dir / JOURNAL_FILENAME

    def start(self, *flags: str, wait: bool = True, geometry: dict | None = None,
              **env: str) -> int:
        """Start an incarnation; returns the log offset where its lines begin."""
        assert self.proc is None or self.proc.poll() is not None, "previous incarnation alive"
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with mock.patch.dict(os.environ, {"KVD_DEBUG": "1", **env}):
            self.proc = start_daemon_process(self.name, self.log_path, [*self.flags, *flags],
                                             **(geometry or self.geometry))
        if wait:
            wait_ready(self.proc, self.name, self.log_path)
        return offset

    def recover(self, **env: str) -> int:
        return self.start("--recover", **env)

    def log(self, offset: int = 0) -> str:
        return self.log_path.read_bytes()[offset:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, like a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(20)

    def expect_crash(self, timeout_s: float = 20.0) -> None:
        """The incarnation must die of SIGKILL (a failpoint) within `timeout_s`."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"daemon {self.name} did not hit its failpoint:\n{self.log()}")
        assert self.proc.returncode == -signal.SIGKILL, self.log()

    def stop_cli(self, *flags: str) -> None:
        """`kvd stop` through the real CLI; the daemon must then exit 0."""
        done = subprocess.run([sys.executable, "-m", "kvd.cli", "stop", "--name", self.name,
                               *flags], env=child_env(), cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert self.proc.wait(20) == 0, self.log()

    def connect(self, **kwargs: object) -> kvd.Client:
        return kvd.connect(self.name, **kwargs)

    def cleanup(self) -> None:
        """Remove everything any incarnation left, whatever state the test failed in."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        remove_daemon_files(self.paths, self.state_dir)


def remove_daemon_files(paths: DaemonPaths, state: Path) -> None:
    """Whatever a daemon of `paths` with its journal in `state` may have left."""
    for path in (f"/dev/shm{paths.segment_name}", paths.socket_path, paths.pid_path,
                 paths.lock_path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[Callable[..., Restartable]]:
    made: list[Restartable] = []

    def make(**geometry: object) -> Restartable:
        daemon = Restartable(tmp_path, {**GEOMETRY, **geometry})
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        daemon.cleanup()


def starting_clean_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "starting clean" in line]


# ---- 1. SIGKILL at random moments under multi-worker load --------------------------------------

def worker_main(name: str, record_path: str, stop_path: str, quota: int,
                pool: str | None = None) -> None:
    """Seal batches of fresh hashes (into `pool`), recording 'A' before each seal and 'S' after
    its ack, until `quota` blocks were attempted (so the pool never evicts); then read its own
    sealed blocks back and check their bytes. Paced so the quota lasts through the default
    run's cycles."""
    client = kvd.connect(name, reconnect_timeout_s=60, pool=pool)
    rng = random.Random()
    acked: list[bytes] = []
    num_attempted = 0
    with open(record_path, "a", buffering=1) as record:
        while not os.path.exists(stop_path):
            try:
                if num_attempted < quota:
                    count = min(rng.randint(1, 8), quota - num_attempted)
                    # Counted before the seal: one that the daemon commits but never answers
                    # (it dies first) still holds its blocks after recovery, so a count taken
                    # only on success let workers seal past the pool and evict acked seals.
                    num_attempted += count
                    seal_batch(client, record, acked, count)
                elif acked:
                    read_back(client, rng.sample(acked, min(8, len(acked))))
            except kvd.DisconnectedError:
                continue  # the daemon restarted: this batch died with the old session
            time.sleep(0.005)
    client.close()


def seal_batch(client: kvd.Client, record, acked: list[bytes], count: int) -> None:
    block_ids = client.alloc(count)
    keys = new_keys(len(block_ids))
    fill(client, block_ids, keys)
    record.write("".join(f"A {k.hex()} {b}\n" for k, b in zip(keys, block_ids)))
    indexed = client.seal(block_ids, keys)
    record.write("".join(f"S {k.hex()} {b}\n" for k, b, ok in zip(keys, block_ids, indexed)
                         if ok))
    acked += [key for key, ok in zip(keys, indexed) if ok]
    client.release(block_ids)


def read_back(client: kvd.Client, keys: list[bytes]) -> None:
    """A worker's own acknowledged seals are never evicted here: all found, bytes intact.

    One key at a time, each pin released before the next lookup: lookup returns the longest
    cached *prefix*, and a restart may fall between any two calls. A lookup that meets it is
    retried in the new session; pins taken before it died with the old one, so releasing them
    together with the new ones would name blocks the new session does not hold."""
    for key in keys:
        found = client.lookup([key])
        try:
            if len(found) != 1:
                raise AssertionError(f"worker {os.getpid()}: an acknowledged seal is missing")
            if not np.array_equal(block_bytes(client, found[0]),
                                  pattern(key, client.geometry.block_nbytes)):
                raise AssertionError(f"worker {os.getpid()}: block {found[0]} lost its bytes")
        finally:
            client.release(found)  # a restart before it: satisfied (the pin died with it)


def read_records(paths: list[Path]) -> tuple[dict[bytes, int], dict[bytes, int]]:
    """(acknowledged, attempted but not acknowledged) seals: {hash: block id}."""
    acked: dict[bytes, int] = {}
    attempted: dict[bytes, int] = {}
    for path in paths:
        text = path.read_text() if path.exists() else ""
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                continue  # a worker stopped mid-line: the next cycle reads it whole
            kind, key_hex, block_id = line.split()
            (acked if kind == "S" else attempted)[bytes.fromhex(key_hex)] = int(block_id)
    return acked, {key: b for key, b in attempted.items() if key not in acked}


def signal_all(workers: list, signum: int) -> None:
    for worker in workers:
        if worker.is_alive():
            os.kill(worker.pid, signum)


def run_kill_cycles(daemon: Restartable, tmp_path: Path, num_cycles: int, num_workers: int = 3,
                    quota: int = 0, pools: tuple[str | None, ...] = (None,)) -> None:
    """`num_workers` workers per pool (`pools`: names, or the one pool) seal `quota` blocks each
    (0: the pool's blocks shared out) while the daemon is killed and recovered."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    stop_path = tmp_path / "stop"
    records = {pool: [tmp_path / f"worker{i}-{pool}.log" for i in range(num_workers)]
               for pool in pools}
    daemon.start()
    fork = multiprocessing.get_context("fork")
    quota = quota or int(daemon.geometry["num_blocks"]) // num_workers  # never evicts
    workers = [fork.Process(target=worker_main,
                            args=(daemon.name, str(path), str(stop_path), quota, pool))
               for pool, paths in records.items() for path in paths]
    for worker in workers:
        worker.start()
    num_acked_after = []
    try:
        for _ in range(num_cycles):
            time.sleep(rng.uniform(0.1, 0.5))  # workers seal (and reconnect) meanwhile
            daemon.kill()
            signal_all(workers, signal.SIGSTOP)  # so nobody allocates before we look
            daemon.recover()
            num_acked = 0
            for pool, paths in records.items():
                acked, attempted = read_records(paths)
                with daemon.connect(pool=pool) as client:
                    check_fresh_recovery(client)
                    check_present(client, acked)
                    check_maybe_present(client, attempted)
                    check_invariants(client)
                num_acked += len(acked)
            num_acked_after.append(num_acked)
            signal_all(workers, signal.SIGCONT)
        stop_path.touch()
        for worker in workers:
            worker.join(30)
            assert worker.exitcode == 0, f"worker exited {worker.exitcode}"
    finally:
        signal_all(workers, signal.SIGCONT)
        stop_path.touch()
        for worker in workers:
            worker.join(5)
            if worker.is_alive():
                worker.kill()
                worker.join()
    # Workers reconnected and kept sealing after the restarts, not only before the first one.
    num_growing = sum(b > a for a, b in zip(num_acked_after, num_acked_after[1:]))
    assert num_growing >= min(10, num_cycles // 2), num_acked_after
    daemon.stop_cli()


@pytest.mark.parametrize("num_cycles", [20, pytest.param(100, marks=pytest.mark.slow)])
def test_acknowledged_seals_survive_sigkill_at_random_moments(restartable, tmp_path, num_cycles):
    # Big enough that nothing is evicted: every acknowledged seal must then be found.
    run_kill_cycles(restartable(num_blocks=65536), tmp_path, num_cycles)


# ---- 2. failpoints --------------------------------------------------------------------------

def crash_with_sealed(daemon: Restartable, count: int) -> dict[bytes, int]:
    """Start, seal `count` blocks, SIGKILL: the state every failpoint test starts from."""
    daemon.start()
    with daemon.connect() as client:
        sealed = seal_new(client, count)
    daemon.kill()
    return sealed


@pytest.mark.parametrize("point, is_committed", [("before-commit", False),
                                                 ("after-commit-before-reply", True)])
def test_commit_failpoints(restartable, point, is_committed):
    daemon = restartable()
    sealed = crash_with_sealed(daemon, 20)
    daemon.recover(KVD_FAILPOINT=point)
    with daemon.connect(reconnect_timeout_s=0) as client:
        block_ids = client.alloc(3)
        keys = new_keys(3)
        fill(client, block_ids, keys)
        with pytest.raises(kvd.DisconnectedError):
            client.seal(block_ids, keys)  # the daemon dies at the failpoint: never acked
    daemon.expect_crash()
    daemon.recover()
    with daemon.connect() as client:
        check_fresh_recovery(client)
        check_present(client, sealed)
        if is_committed:  # durable though never acknowledged
            check_present(client, dict(zip(keys, block_ids)))
        else:
            check_absent(client, keys)
    daemon.stop_cli()


def test_crash_mid_eviction_keeps_the_victim_indexed_with_its_bytes(restartable):
    daemon = restartable(num_blocks=16)
    sealed = crash_with_sealed(daemon, 16)  # the pool is full of cached blocks
    daemon.recover(KVD_FAILPOINT="mid-eviction")
    with daemon.connect(reconnect_timeout_s=0) as client:
        with pytest.raises(kvd.DisconnectedError):
            client.alloc(1)  # must evict: dies before the eviction is committed or answered
    daemon.expect_crash()
    daemon.recover()
    with daemon.connect() as client:
        check_fresh_recovery(client)
        check_present(client, sealed)
    daemon.stop_cli()


def test_evicted_blocks_are_not_restored_under_their_old_hash(restartable):
    daemon = restartable(num_blocks=16)
    sealed = crash_with_sealed(daemon, 16)
    daemon.recover()
    with daemon.connect() as client:
        evicted_ids = client.alloc(6)  # evicts 6 cached blocks
        assert client.stats()["evictions"] == 6
        fresh = dict(zip(new_keys(3), evicted_ids[:3]))
        fill(client, evicted_ids, list(fresh) + new_keys(3))  # overwrite all 6
        client.seal(list(fresh.values()), list(fresh))
        # the other 3 stay OWNED (overwritten, never sealed) when the daemon dies
        daemon.kill()
    daemon.recover()
    gone = [key for key, block_id in sealed.items() if block_id in evicted_ids]
    kept = {key: block_id for key, block_id in sealed.items() if block_id not in evicted_ids}
    assert len(gone) == 6
    with daemon.connect() as client:
        check_fresh_recovery(client)
        check_absent(client, gone)
        check_present(client, kept)
        check_present(client, fresh)
        assert client.stats()["free"] == 3  # the unsealed ones came back FREE
    daemon.stop_cli()


class RawSession:
    """One pipelining session (kvd.Client sends one request at a time)."""

    def __init__(self, socket_path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(socket_path)
        self.decoder = FrameDecoder()
        self.replies: list = []
        self.call(1, "hello", {"version": PROTOCOL_VERSION, "pid": os.getpid()})

    def call(self, request_id: int, op: str, args: dict) -> object:
        self.sock.sendall(encode_request(request_id, op, args))
        return self.replies_for(1)[0]

    def replies_for(self, count: int) -> list:
        while len(self.replies) < count:
            self.replies += [parse_reply(unpack_body(body))[1]
                             for body in self.decoder.feed(self.sock.recv(65536))]
        replies, self.replies = self.replies[:count], self.replies[count:]
        return replies


def test_block_sealed_and_evicted_in_one_iteration_is_not_restored(restartable):
    # Regression: seal, release and an evicting alloc pipelined in one read are one group
    # commit; the journal used to run the eviction's DELETE before the seal's INSERT, so the
    # block came back after a crash under its old hash, holding its new owner's bytes.
    daemon = restartable(num_blocks=4)
    daemon.start()
    raw = RawSession(daemon.paths.socket_path)
    try:
        block_ids = raw.call(2, "alloc", {"num_blocks": 4})
        key = os.urandom(16)
        raw.sock.sendall(encode_request(3, "seal", {"block_ids": [block_ids[0]], "hashes": [key]})
                         + encode_request(4, "release", {"block_ids": [block_ids[0]]})
                         + encode_request(5, "alloc", {"num_blocks": 1}))
        assert raw.replies_for(3) == [[True], None, [block_ids[0]]]  # evicted and handed back
        daemon.kill()
    finally:
        raw.sock.close()
    daemon.recover()
    with daemon.connect() as client:
        check_absent(client, [key])
        check_fresh_recovery(client)
    daemon.stop_cli()


@pytest.fixture
def inline_daemon(tmp_path: Path) -> Iterator[Server]:
    """A journaled daemon in this process, served one loop iteration at a time."""
    name = daemon_name()
    paths = DaemonPaths.for_name(name, str(tmp_path / "kvd.sock"))
    daemon = launch(DaemonConfig(
        paths, Geometry(**{k: GEOMETRY[k] for k in ("num_blocks", "block_size")}, num_layers=1,
                        num_kv_heads=1, head_dim=8), state_dir=str(tmp_path / "state")))
    try:
        yield daemon
    finally:
        daemon.stop()
        daemon.serve_forever()  # stopping already: it only cleans up (segment, socket, journal)


def test_seals_of_every_client_served_in_one_iteration_share_one_commit(inline_daemon):
    """Group commit across clients: one journal transaction per loop iteration, whoever sent the
    seals, and no reply goes out before it."""
    sessions = []
    for _ in range(3):
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.settimeout(10)
        raw.connect(inline_daemon.started.config.paths.socket_path)
        inline_daemon.serve_once(1.0)  # accept
        raw.sendall(encode_request(1, "hello", {"version": PROTOCOL_VERSION, "pid": os.getpid()}))
        inline_daemon.serve_once(1.0)
        raw.recv(65536)
        raw.sendall(encode_request(2, "alloc", {"num_blocks": 2}))
        inline_daemon.serve_once(1.0)
        sessions.append((raw, parse_reply(unpack_body(FrameDecoder().feed(raw.recv(65536))[0]))[1]))
    for index, (raw, block_ids) in enumerate(sessions):  # all waiting when the loop looks
        raw.sendall(encode_request(3, "seal", {"block_ids": block_ids,
                                               "hashes": [bytes([index, 0]) * 8,
                                                          bytes([index, 1]) * 8]}))
    commits = inline_daemon.service.counters["journal_commits"]
    inline_daemon.serve_once(1.0)
    assert inline_daemon.service.counters["journal_commits"] == commits + 1
    assert inline_daemon.service.stats()["seals"] == 6
    for raw, _ in sessions:
        raw.setblocking(False)
        assert parse_reply(unpack_body(FrameDecoder().feed(raw.recv(65536))[0]))[1] == [True] * 2
        raw.close()


def recover_all(daemon: Restartable, sealed: dict[bytes, int]) -> None:
    """`--recover` must restore every one of `sealed`, bytes and hashes, into a fresh state."""
    offset = daemon.recover()
    assert f"{len(sealed)} of {len(sealed)} journaled blocks restored" in daemon.log(offset)
    with daemon.connect() as client:
        check_fresh_recovery(client)
        check_present(client, sealed)


def test_crash_during_recovery_then_recovery_again(restartable):
    daemon = restartable()
    sealed = crash_with_sealed(daemon, 40)
    daemon.start("--recover", wait=False, KVD_FAILPOINT="during-recovery")
    daemon.expect_crash()
    recover_all(daemon, sealed)
    daemon.stop_cli()


# ---- 3. stamp mismatches start clean, with one log line -----------------------------------------

def check_started_clean(daemon: Restartable, offset: int, reason: str,
                        sealed: dict[bytes, int]) -> None:
    lines = starting_clean_lines(daemon.log(offset))
    assert len(lines) == 1 and reason in lines[0], daemon.log(offset)
    assert "restored" not in daemon.log(offset)
    with daemon.connect() as client:
        stats = client.stats()
        assert stats["indexed"] == stats["cached"] == stats["owned"] == 0, stats
        check_absent(client, list(sealed)[:5])
        check_invariants(client)


def test_geometry_change_starts_clean(restartable):
    daemon = restartable()
    sealed = crash_with_sealed(daemon, 10)
    offset = daemon.start("--recover", geometry={**GEOMETRY, "num_blocks": 128})
    check_started_clean(daemon, offset, "geometry changed", sealed)
    daemon.stop_cli()


def test_missing_segment_starts_clean(restartable):
    daemon = restartable()
    sealed = crash_with_sealed(daemon, 10)
    os.unlink(daemon.segment_path)
    offset = daemon.recover()
    check_started_clean(daemon, offset, "no usable segment", sealed)
    daemon.stop_cli()


def test_journal_of_another_segment_starts_clean(restartable, tmp_path):
    # Daemon `other` keeps its journal in a directory that `daemon` is then pointed at.
    other, daemon = restartable(), restartable()
    other_dir = tmp_path / "other-state"
    other.start("--state-dir", str(other_dir))
    with other.connect() as client:
        other_sealed = seal_new(client, 5)
    other.stop_cli("--keep")
    sealed = crash_with_sealed(daemon, 10)
    offset = daemon.start("--recover", "--state-dir", str(other_dir))
    check_started_clean(daemon, offset, "does not describe this segment",
                        {**sealed, **other_sealed})
    daemon.stop_cli()  # removes other_dir's journal: it now belongs to `daemon`
    assert not (other_dir / JOURNAL_FILENAME).exists()


def test_segment_from_another_boot_starts_clean(restartable):
    # A reboot normally empties /dev/shm; a segment that survived one (a persistent /dev/shm,
    # a checkpointed container) carries the old boot id in its header. Forge that.
    daemon = restartable()
    sealed = crash_with_sealed(daemon, 10)
    shm = posix_ipc.SharedMemory(daemon.paths.segment_name)
    try:
        with mmap.mmap(shm.fd, BOOT_ID_OFFSET + 16) as header:
            header[BOOT_ID_OFFSET:BOOT_ID_OFFSET + 16] = os.urandom(16)
    finally:
        shm.close_fd()
    offset = daemon.recover()
    check_started_clean(daemon, offset, "another boot", sealed)
    daemon.stop_cli()


# ---- 4. a failing journal fails closed ---------------------------------------------------------

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(port: int, metric: str) -> float:
    time.sleep(RENDER_TTL_S)  # (a scrape's numbers may be that old: one rendering is shared)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(metric + " "):
                return float(line.split()[1])
    raise AssertionError(f"metric {metric} not served")


def test_journal_failure_refuses_writes_serves_reads_and_heals(restartable, tmp_path):
    daemon = restartable()
    fail_file = tmp_path / "journal-fails"
    port = free_port()
    daemon.start("--metrics-port", str(port), KVD_JOURNAL_FAIL_FILE=str(fail_file))
    with daemon.connect() as client:
        before = seal_new(client, 10)
        assert client.stats()["journal"] == "ok" and scrape(port, "kvd_journal_writable") == 1
        held = client.lookup(list(before)[:4])  # pinned across the failure
        pending_ids = client.alloc(2)
        pending = dict(zip(new_keys(2), pending_ids))
        fill(client, pending_ids, list(pending))
        fail_file.touch()
        with pytest.raises(kvd.JournalError):
            client.seal(pending_ids, list(pending))  # the commit fails: not acknowledged
        with pytest.raises(kvd.JournalError):
            client.alloc(1)
        with pytest.raises(kvd.JournalError):
            client.open_sequence(list(range(8)))
        stats = client.stats()
        assert stats["journal"] == "failed" and stats["journal_failures"] >= 1, stats
        assert scrape(port, "kvd_journal_writable") == 0
        assert scrape(port, "kvd_journal_failures_total") >= 1
        check_present(client, before)  # lookups and reads go on
        client.release(held)
        fail_file.unlink()
        wait_until_writable(client)
        assert client.stats()["journal"] == "ok" and scrape(port, "kvd_journal_writable") == 1
        after = seal_new(client, 5)
        client.release(pending_ids)
    daemon.kill()
    daemon.recover()
    with daemon.connect() as client:
        check_fresh_recovery(client)
        check_present(client, {**before, **after})  # the rewrite restored the whole index
        check_maybe_present(client, pending)
    daemon.stop_cli()


def wait_until_writable(client: kvd.Client) -> None:
    """Allocations succeed again within 2.5 s of the journal healing (it retries each second)."""
    started = time.monotonic()
    while True:
        try:
            client.release(client.alloc(1))
            return
        except kvd.JournalError:
            assert time.monotonic() - started < 2.5, "writes not accepted 2.5 s after healing"
            time.sleep(0.05)


# The daemon checkpointing its WAL after every write, and the checkpoints failing while a file
# exists: a fault in the upkeep that runs after the replies, which the fail file (it fails every
# write) cannot single out.
FAILING_UPKEEP = """
import os, sqlite3, sys
import kvd.server.journal
from kvd.cli import main

checkpoint = kvd.server.journal.Journal._checkpoint

def failing_checkpoint(journal):
    if os.path.exists({fail_file!r}):
        raise sqlite3.OperationalError("disk I/O error (checkpoint failure injected by the test)")
    checkpoint(journal)

kvd.server.journal.CHECKPOINT_NBYTES = 1
kvd.server.journal.Journal._checkpoint = failing_checkpoint
sys.exit(main(sys.argv[1:]))
"""


def test_failed_upkeep_keeps_the_acknowledged_seal_and_fails_closed(restartable, tmp_path):
    daemon = restartable()
    fail_file = tmp_path / "upkeep-fails"
    command = [sys.executable, "-c", FAILING_UPKEEP.format(fail_file=str(fail_file)), "start",
               "--name", daemon.name]
    for option, value in daemon.geometry.items():
        command += [f"--{option.replace('_', '-')}", str(value)]
    with open(daemon.log_path, "ab") as log:
        daemon.proc = subprocess.Popen(command, env=child_env(), cwd=ROOT, stdout=log, stderr=log)
    wait_ready(daemon.proc, daemon.name, daemon.log_path)
    with daemon.connect() as client:
        before = seal_new(client, 10)
        fail_file.touch()
        during = seal_new(client, 3)  # committed, so acknowledged; its upkeep then fails ...
        with pytest.raises(kvd.JournalError):
            client.alloc(1)  # ... and the daemon fails closed
        stats = client.stats()
        assert stats["journal"] == "failed" and stats["journal_failures"] >= 1, stats
        check_present(client, {**before, **during})  # lookups and reads go on
        fail_file.unlink()
        wait_until_writable(client)
        assert client.stats()["journal"] == "ok"
    daemon.kill()
    daemon.recover()
    with daemon.connect() as client:
        check_fresh_recovery(client)
        check_present(client, {**before, **during})
    daemon.stop_cli()


# ---- 5. stop --keep, plain stop, clients across restarts ---------------------------------------

def test_stop_keep_then_recover_keeps_bytes_and_index(restartable):
    daemon = restartable()
    daemon.start()
    with daemon.connect() as client:
        sealed = seal_new(client, 50)
    daemon.stop_cli("--keep")
    assert os.path.exists(daemon.segment_path) and daemon.journal_path.exists()
    assert not os.path.exists(daemon.paths.socket_path)
    recover_all(daemon, sealed)
    daemon.stop_cli()
    for path in (daemon.segment_path, daemon.paths.socket_path, daemon.paths.pid_path,
                 str(daemon.journal_path), f"{daemon.journal_path}-wal"):
        assert not os.path.exists(path), f"plain kvd stop left {path}"
    assert not daemon.state_dir.exists()


def test_a_clean_start_without_a_journal_removes_a_kept_one(restartable):
    """Regression: stop --keep, then start --no-journal and stop: the kept journal (of a segment
    that start replaced) stayed in /dev/shm for good."""
    daemon = restartable()
    daemon.start()
    with daemon.connect() as client:
        seal_new(client, 3)
    daemon.stop_cli("--keep")
    assert daemon.journal_path.exists()
    daemon.start("--no-journal")
    assert not daemon.state_dir.exists()
    daemon.stop_cli()


def test_no_journal_has_nothing_to_recover(restartable):
    daemon = restartable()
    daemon.start("--no-journal")
    with daemon.connect() as client:
        assert client.stats()["journal"] == "off"
        seal_new(client, 3)
    assert not daemon.journal_path.exists()
    daemon.kill()
    offset = daemon.start("--recover", "--no-journal")
    assert len(starting_clean_lines(daemon.log(offset))) == 1
    daemon.stop_cli()


@pytest.mark.parametrize("restart", ["stop --keep", "sigkill"])
def test_clients_survive_a_restart(restartable, restart):
    daemon = restartable()
    daemon.start()
    reader, sealer, sequencer, releaser = (daemon.connect() for _ in range(4))
    clients = [reader, sealer, sequencer, releaser]
    try:
        sealed = seal_new(reader, 8)
        keys = list(sealed)
        old_view = reader.view(sealed[keys[0]])
        owned = sealer.alloc(2)
        seq = sequencer.open_sequence(list(range(9)))
        pinned = releaser.lookup(keys)
        if restart == "sigkill":
            daemon.kill()
        else:
            daemon.stop_cli("--keep")
        daemon.recover()

        assert reader.lookup(keys) == [sealed[key] for key in keys]  # retried after reconnect
        assert reader.num_reconnects == 1
        assert np.array_equal(old_view.reshape(-1).view(np.uint8),
                              pattern(keys[0], reader.geometry.block_nbytes))  # same segment
        reader.release([sealed[key] for key in keys])

        with pytest.raises(kvd.DisconnectedError, match="restarted"):
            sealer.seal(owned, new_keys(2))  # those blocks died with the old session
        assert sealer.stats()["owned"] == 0  # and the client works again

        with pytest.raises(kvd.DisconnectedError):
            sequencer.extend_sequence(seq, [1, 2])
        with pytest.raises(kvd.DisconnectedError):
            sequencer.extend_sequence(seq, [1, 2])  # still gone, now known without a request
        sequencer.close_sequence(seq)  # silently: the restart closed it
        assert seq.is_closed

        releaser.release(pinned)  # the restart dropped those pins already: succeeds
        assert releaser.num_reconnects == 1
        del old_view
        check_invariants(reader)
    finally:
        for client in clients:
            client.close()
    daemon.stop_cli()


def mappings_of(segment_path: str) -> int:
    """How many mappings of the segment this process holds (an unlinked one shows "(deleted)")."""
    with open("/proc/self/maps") as maps:
        fields = [line.split(maxsplit=5) for line in maps]
    return sum(len(row) == 6 and row[5].split(" (deleted)")[0].rstrip() == segment_path
               for row in fields)


def test_a_clean_restart_is_reported_and_stale_views_never_alias_the_new_segment(restartable):
    """Regression: after `kvd stop` + `kvd start` (a new segment) a retried call returned as if
    nothing had changed, so a worker kept writing through its old `pool` into unlinked memory and
    sealed the new segment's unwritten blocks; and the new segment's generations started at 0
    again, so a stale (id, generation) matched."""
    daemon = restartable()
    daemon.start()
    with daemon.connect() as client:
        sealed = seal_new(client, 4)
        keys = list(sealed)
        old_pool = client.pool
        block_id = sealed[keys[0]]
        old_generation = client.generation(block_id)
        daemon.stop_cli()
        daemon.start()

        with pytest.raises(kvd.DisconnectedError, match="new segment"):
            client.lookup(keys)  # a retried op, yet it must not pass as if nothing happened
        assert client.lookup(keys) == []  # reconnected: nothing cached survived a clean start
        assert not np.shares_memory(client.pool, old_pool)
        assert client.generation(block_id) != old_generation
        assert mappings_of(daemon.segment_path) == 2  # the old one stays while old_pool lives
        assert np.array_equal(old_pool[block_id].reshape(-1).view(np.uint8),
                              pattern(keys[0], client.geometry.block_nbytes))
        del old_pool
        daemon.stop_cli()
        daemon.start()
        with pytest.raises(kvd.DisconnectedError, match="new segment"):
            client.stats()
        # No view held either replaced segment: both were unmapped, only the new one is left.
        assert mappings_of(daemon.segment_path) == 1
    assert mappings_of(daemon.segment_path) == 0
    daemon.stop_cli()


def test_a_reply_timeout_closes_the_client_instead_of_passing_for_a_restart(restartable):
    """Regression: a stalled daemon (SIGSTOP) past timeout_s was taken for a restart: the client
    opened a new session, dropped its own pins and retried, and a timed-out seal was reported as
    'restarted' although it had been applied."""
    daemon = restartable()
    daemon.start()
    with daemon.connect() as monitor:
        client = daemon.connect(timeout_s=0.3)
        assert len(client.lookup(list(seal_new(client, 2)))) == 2  # pins of this session
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(kvd.DisconnectedError, match="no reply to 'stats' within"):
                client.stats()
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert client.is_closed and client.num_reconnects == 0
        with pytest.raises(kvd.DisconnectedError, match="closed"):
            client.stats()
        deadline = time.monotonic() + 10
        while monitor.stats()["sessions"] > 1:  # the daemon ends the closed session
            assert time.monotonic() < deadline, monitor.stats()
            time.sleep(0.01)
        check_invariants(monitor)
        client.close()
    daemon.stop_cli()


def test_without_reconnecting_a_lost_daemon_closes_the_client(restartable):
    """Regression: with reconnect_timeout_s=0 the socket stayed open after a failure, so every
    later call read the previous call's reply and failed while the daemon applied it."""
    daemon = restartable()
    daemon.start()
    client = daemon.connect(reconnect_timeout_s=0)
    daemon.kill()
    with pytest.raises(kvd.DisconnectedError):
        client.alloc(1)
    assert client.is_closed
    daemon.recover()
    with pytest.raises(kvd.DisconnectedError, match="closed"):
        client.alloc(1)  # at once, not another wait on a dead socket
    client.close()
    daemon.stop_cli()


def test_a_start_that_fails_after_recovering_keeps_the_cache_for_the_next(restartable):
    """Regression: a --recover whose start then failed (here its metrics port was taken) cleaned
    up like a plain stop: the re-attached segment and journal, every acknowledged seal, gone."""
    daemon = restartable()
    daemon.start()
    with daemon.connect() as client:
        sealed = seal_new(client, 20)
    daemon.kill()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        offset = daemon.start("--recover", "--metrics-port", str(taken.getsockname()[1]),
                              wait=False)
        assert daemon.proc.wait(30) == 2
    assert "kvd: cannot serve metrics" in daemon.log(offset)
    assert "Traceback" not in daemon.log(offset)
    assert os.path.exists(daemon.segment_path) and daemon.journal_path.exists()
    recover_all(daemon, sealed)
    daemon.stop_cli()


def test_an_unreadable_stamp_refuses_recovery_and_keeps_what_it_could_not_read(restartable):
    """Regression: a stamp row that is not JSON killed `kvd start --recover` with a raw
    JSONDecodeError, and the failed start deleted the journal, so the next --recover started
    clean. Now it is a typed refusal that keeps segment and journal: repaired, they recover."""
    daemon = restartable()
    sealed = crash_with_sealed(daemon, 10)
    with sqlite3.connect(daemon.journal_path) as db:
        (good,) = db.execute("SELECT value FROM stamp WHERE key = 'segment_uuid'").fetchone()
        db.execute("UPDATE stamp SET value = '{not json' WHERE key = 'segment_uuid'")
    db.close()
    offset = daemon.start("--recover", wait=False)
    assert daemon.proc.wait(30) == 2
    text = daemon.log(offset)
    assert "Traceback" not in text
    assert "kvd: recovery: the stamp of the journal" in text and "cannot be read" in text
    assert "start without --recover" in text
    assert os.path.exists(daemon.segment_path) and daemon.journal_path.exists()
    with sqlite3.connect(daemon.journal_path) as db:
        db.execute("UPDATE stamp SET value = ? WHERE key = 'segment_uuid'", (good,))
    db.close()
    recover_all(daemon, sealed)
    daemon.stop_cli()


def test_a_journal_the_pool_cannot_take_starts_clean_and_says_so(restartable):
    """Regression: a journal naming a block outside the pool failed the start and removed
    everything; the contract is to start clean with one log line, never mapping that state, and
    (a later regression: the clean start overwrote it) keeping the journal aside, named there."""
    daemon = restartable()
    daemon.start()
    with daemon.connect() as client:
        sealed = seal_new(client, 5)
    daemon.kill()
    journal = Journal(daemon.state_dir)
    journal.sealed([(GEOMETRY["num_blocks"] + 7, os.urandom(16), 0, ORPHAN, 0, 0)])
    journal.commit()
    journal.close()
    offset = daemon.recover()
    (line,) = starting_clean_lines(daemon.log(offset))
    assert "corrupt" in line
    aside = daemon.state_dir / f"{JOURNAL_FILENAME}.damaged-1"
    assert f"kept as {aside}" in line and aside.exists()
    with daemon.connect() as client:
        check_absent(client, list(sealed))
        check_invariants(client)
        assert client.stats()["cached"] == 0
    daemon.stop_cli()


def test_a_bug_escaping_the_loop_keeps_segment_and_journal_for_recover(tmp_path):
    """Regression: an exception escaping the daemon's loop ran the plain stop's cleanup, removing
    the segment and journal, so a kvd bug cost the whole cache where a crash (SIGKILL) costs
    nothing that --recover cannot restore."""
    paths = DaemonPaths.for_name(daemon_name(), str(tmp_path / "kvd.sock"))
    geometry = Geometry(num_blocks=GEOMETRY["num_blocks"], block_size=GEOMETRY["block_size"],
                        num_layers=1, num_kv_heads=1, head_dim=8)
    state = str(tmp_path / "state")
    daemon = launch(DaemonConfig(paths, geometry, state_dir=state))
    pool = daemon.service.pool
    session = daemon.service.open_session(os.getpid(), os.getuid())
    block_ids = pool.allocate(2, session.session_id)
    keys = new_keys(2)
    pool.seal(block_ids, keys, session.session_id)
    assert daemon.journal is not None
    daemon.journal.commit()
    pool.release(block_ids, session.session_id)

    def explode() -> None:
        raise RuntimeError("a kvd bug")

    pool.choose_next_victim = explode
    with pytest.raises(RuntimeError, match="a kvd bug"):
        daemon.serve_forever()
    segment_path = f"/dev/shm{paths.segment_name}"
    assert os.path.exists(segment_path)
    recovered = launch(DaemonConfig(paths, geometry, state_dir=state, recover=True))
    try:
        assert recovered.started.num_restored == 2
        assert [recovered.service.pool.find(key) for key in keys] == block_ids
    finally:
        recovered.stop()
        recovered.serve_forever()
    assert not os.path.exists(segment_path)
