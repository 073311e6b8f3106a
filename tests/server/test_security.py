"""Security model (DESIGN.md section 5): private runtime dir, 0600 socket and segment, SO_PEERCRED.

The tests run as root; a child process drops to `nobody` (uid/gid 65534) with os.setgid/os.setuid
after importing kvd, then tries to reach the daemon. Two layers are checked separately: the 0700
directory and 0600 socket stop the connect itself, and — with a socket the test deliberately makes
world-writable — the daemon's SO_PEERCRED check still refuses the peer with DENIED.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvd
from kvd.server.journal import JOURNAL_FILENAME
from kvd.runtime import DaemonPaths, runtime_dir, state_dir

from conftest import ROOT, child_env, daemon_name
NOBODY = 65534

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.getuid() != 0, reason="dropping to another uid needs root"),
]

# Imports first (nobody cannot read root's Python install), then drop privileges for good.
AS_NOBODY = r"""
import os, socket, struct, sys
import msgpack
import kvd
kvd.connect, kvd.KvdError  # (kvd loads its names lazily: before the files become unreadable)
path = sys.argv[1]
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
try:
    sock.connect(path)
except PermissionError as exc:
    print("raw-connect", "EACCES", exc.errno)
else:  # read what the daemon says without sending anything
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    (length,) = struct.unpack(">I", data[:4])
    print("raw-reply", msgpack.unpackb(data[4:4 + length])[2][0], len(data) == 4 + length)
sock.close()
try:
    kvd.connect(path, reconnect_timeout_s=0)
    print("client", "CONNECTED")
except kvd.KvdError as exc:
    print("client", type(exc).__name__, exc.code, str(exc).replace(chr(10), " "))
"""


def run_as_nobody(socket_path: str) -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", AS_NOBODY, socket_path], env=child_env(),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}


def test_the_private_runtime_dir_stops_another_uid_at_connect(kvd_daemon):
    result = run_as_nobody(kvd_daemon.paths.socket_path)
    assert result["raw-connect"] == ["EACCES", "13"]
    assert result["client"][:2] == ["DeniedError", "DENIED"]
    with kvd_daemon.connect() as client:  # the owner is still served
        client.release(client.alloc(1))


def test_files_are_private(kvd_daemon):
    paths = kvd_daemon.paths
    assert stat.S_IMODE(os.stat(Path(paths.socket_path).parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(paths.socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(f"/dev/shm{paths.segment_name}").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(paths.lock_path).st_mode) == 0o600
    journal_dir = state_dir(kvd_daemon.name)  # the default: beside the segment
    assert stat.S_IMODE(journal_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(journal_dir / JOURNAL_FILENAME).st_mode) == 0o600


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A world-writable directory straight under /tmp (pytest's tmp_path is private)."""
    path = Path(tempfile.mkdtemp(prefix="kvd-open-", dir="/tmp"))
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_so_peercred_refuses_another_uid_even_on_a_world_writable_socket(tmp_path, open_dir):
    socket_path = str(open_dir / "kvd.sock")
    name = daemon_name()
    paths = DaemonPaths.for_name(name, socket_path)
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli", "start", "--name", name, "--socket", socket_path,
             "--num-blocks", "8", "--layers", "1", "--kv-heads", "1", "--head-dim", "8"],
            env=child_env(), cwd=ROOT, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(paths.pid_path):  # written after the socket is bound
            assert daemon.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        os.chmod(socket_path, 0o666)  # what a careless admin might do
        result = run_as_nobody(socket_path)
        assert result["raw-reply"] == ["DENIED", "True"]  # one error frame, then EOF
        assert result["client"][:2] == ["DeniedError", "DENIED"]
        assert "you are uid 65534" in " ".join(result["client"])
        with kvd.connect(socket_path) as client:  # and it keeps serving its own user
            assert client.stats()["sessions"] == 1
        log_text = log_path.read_text()
        assert re.search(r"WARNING refused pid \d+ of uid 65534", log_text), log_text
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(20) == 0
    assert not os.path.exists(socket_path)
    assert not os.path.exists(f"/dev/shm{paths.segment_name}")


def test_runtime_dir_of_another_user_is_refused_and_a_loose_one_is_tightened(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "kvd").mkdir(mode=0o755)
    os.chmod(tmp_path / "kvd", 0o755)
    assert stat.S_IMODE(runtime_dir().stat().st_mode) == 0o700
    os.chown(tmp_path / "kvd", NOBODY, NOBODY)
    with pytest.raises(kvd.DeniedError,
                       match=f"is a directory owned by uid {NOBODY}, not a directory of uid 0"):
        runtime_dir()


def test_a_journal_dir_planted_by_another_user_is_refused(tmp_path):
    """/dev/shm is world-writable: another user could create the default journal directory
    first and read or forge the index there. The daemon refuses to start and says why."""
    name = daemon_name()
    planted = state_dir(name)
    planted.mkdir(mode=0o777)
    os.chown(planted, NOBODY, NOBODY)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "kvd.cli", "start", "--name", name, "--num-blocks", "8",
             "--layers", "1", "--kv-heads", "1", "--head-dim", "8"],
            env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr  # the CLI's code for a refused start
        refusal = f"{planted} is a directory owned by uid {NOBODY}, not a directory of uid 0"
        assert refusal in result.stderr, result.stderr
        assert list(planted.iterdir()) == []  # nothing written into it
        paths = DaemonPaths.for_name(name)
        assert not os.path.exists(f"/dev/shm{paths.segment_name}")
        assert not os.path.exists(paths.socket_path)
    finally:
        shutil.rmtree(planted)


def test_no_pickle_anywhere_in_kvd():
    sources = [p for p in (ROOT / "kvd").rglob("*.py")]
    assert sources
    for path in sources:
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|marshal|shelve)\b",
                             path.read_text(), re.MULTILINE), path
