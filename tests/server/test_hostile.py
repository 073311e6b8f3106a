"""Another local user squatting on the names a daemon needs (issue 34 item 3).

/tmp and /dev/shm are world-writable, so any local user can plant a file or a symlink at a
daemon's segment name or runtime directory before it starts. kvd must neither follow, map nor
(as root) delete such a thing: `kvd start` refuses with one `kvd: ...` line naming the path, its
owner and what to do, and `kvd.connect()` raises DeniedError. The tests run as root and play the
squatter by chowning what they plant to `nobody` (uid 65534), as test_security.py does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvd
from kvd.runtime import DaemonPaths

from conftest import ROOT, child_env, daemon_name

NOBODY = 65534
GEOMETRY = ["--num-blocks", "16", "--block-size", "4", "--layers", "1", "--kv-heads", "1",
            "--head-dim", "8", "--dtype", "float32"]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.getuid() != 0, reason="playing another uid needs root"),
]


def start(name: str, *flags: str, **env: str) -> subprocess.CompletedProcess:
    """`kvd start --detach`; a start the squatter failed to stop is stopped again."""
    started = subprocess.run([sys.executable, "-m", "kvd.cli", "start", "--name", name,
                              "--detach", *flags, *GEOMETRY], env=child_env(**env), cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    if started.returncode == 0:
        subprocess.run([sys.executable, "-m", "kvd.cli", "stop", "--name", name],
                       env=child_env(**env), cwd=ROOT, capture_output=True, timeout=60)
    return started


def assert_refused(started: subprocess.CompletedProcess, path: str, kind: str) -> None:
    assert started.returncode != 0, (started.returncode, started.stderr)  # 1 when detached
    assert "Traceback" not in started.stderr, started.stderr
    lines = [line for line in started.stderr.splitlines() if line.startswith("kvd: ")]
    assert len(lines) == 1, started.stderr
    assert f"kvd: {path} is {kind} owned by uid {NOBODY}, not " in lines[0], lines[0]
    assert "remove it" in lines[0], lines[0]


@pytest.fixture
def segment_path() -> Iterator[tuple[str, str]]:
    """(daemon name, its segment's path), the path removed afterwards whatever is there."""
    name = daemon_name()
    path = "/dev/shm" + DaemonPaths.for_name(name).segment_name
    yield name, path
    if os.path.lexists(path):
        os.unlink(path)


def test_a_file_of_another_uid_at_the_segment_name_is_refused_not_deleted(segment_path):
    """Regression: a non-root daemon died with a PermissionError traceback (the sticky /dev/shm
    refused its unlink), and a root daemon deleted the other user's file."""
    name, path = segment_path
    Path(path).write_bytes(b"not kvd")
    os.chown(path, NOBODY, NOBODY)
    assert_refused(start(name), path, "a file")
    assert Path(path).read_bytes() == b"not kvd"


@pytest.mark.parametrize("recover", [False, True])
def test_a_dangling_symlink_at_the_segment_name_is_refused(segment_path, recover):
    """Regression: with --recover, shm_open's ELOOP was a raw OSError traceback."""
    name, path = segment_path
    os.symlink(f"/nonexistent-{name}", path)
    os.lchown(path, NOBODY, NOBODY)
    assert_refused(start(name, *(["--recover"] if recover else [])), path, "a symlink")
    assert os.path.islink(path)


def test_a_dangling_symlink_at_the_runtime_dir_is_refused_at_start_and_connect(tmp_path,
                                                                               monkeypatch):
    """Regression: `kvd start` and `kvd.connect()` raised FileExistsError (not a KvdError).
    (The test plants it under XDG_RUNTIME_DIR: /tmp/kvd-<uid> is the same code path, and other
    daemons of this machine live there.)"""
    planted = tmp_path / "kvd"
    os.symlink(tmp_path / "elsewhere", planted)
    os.lchown(planted, NOBODY, NOBODY)
    assert_refused(start(daemon_name(), XDG_RUNTIME_DIR=str(tmp_path)), str(planted),
                   "a symlink")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(kvd.DeniedError, match=f"{planted} is a symlink owned by uid {NOBODY}.*"
                                              "set XDG_RUNTIME_DIR"):
        kvd.connect(daemon_name())
    assert os.path.islink(planted) and not (tmp_path / "elsewhere").exists()
