"""kvd.server.startup in this process: what a start builds, and that a failed one releases it.

The subprocess tests (test_daemon.py, test_recovery.py) check the same through `kvd start`; here
the fds of this process are counted too, which a subprocess cannot show.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

import kvd
from conftest import daemon_name
from kvd.geometry import Geometry
from kvd.runtime import DaemonPaths
from kvd.server.journal import JOURNAL_FILENAME
from kvd.server import startup
from kvd.server.startup import DaemonConfig, is_running, start, take_lock

GEOMETRY = Geometry(num_blocks=4, num_layers=1, block_size=2, num_kv_heads=1, head_dim=8)


def open_fds() -> set[str]:
    """This process's fds, but for unlinked segments' mappings: a release unlinks the segment,
    and its mapping goes when the pool's NumPy views of it do (Segment.close refuses before)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # (the fd listdir itself used)
            continue
        if not (target.startswith("/dev/shm/kvd-") and target.endswith(" (deleted)")):
            fds.add(fd)
    return fds


def made_paths(paths: DaemonPaths, state_dir: Path) -> list[str]:
    """What a start makes and a release removes, of those that exist now."""
    return [path for path in (paths.socket_path, paths.pid_path, paths.lock_path,
                              f"/dev/shm{paths.segment_name}", str(state_dir / JOURNAL_FILENAME))
            if os.path.exists(path)]


def test_a_start_that_fails_at_its_last_step_releases_everything_it_made(tmp_path):
    """Metrics come last: by then every other piece was built, and each must be released
    (socket, pidfile, segment, journal, the lock, and every fd: lock, signal pair, selector)."""
    paths = DaemonPaths.for_name(daemon_name(), str(tmp_path / "kvd.sock"))
    state_dir = tmp_path / "state"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = DaemonConfig(paths, GEOMETRY, metrics_port=taken.getsockname()[1],
                              state_dir=str(state_dir))
        fds = open_fds()
        with pytest.raises(kvd.InUseError, match="cannot serve metrics"):
            start(config)
        assert open_fds() == fds
    assert made_paths(paths, state_dir) == []
    assert not is_running(paths)


def test_a_started_daemon_has_every_piece_and_its_release_removes_them(tmp_path):
    paths = DaemonPaths.for_name(daemon_name(), str(tmp_path / "kvd.sock"))
    state_dir = tmp_path / "state"
    fds = open_fds()
    started = start(DaemonConfig(paths, GEOMETRY, state_dir=str(state_dir)))
    try:
        assert is_running(paths) and len(made_paths(paths, state_dir)) == 5
        assert started.journal is not None and started.num_restored == 0
        assert started.service.stats()["journal"] == "ok"
        assert not started.stop.is_requested and not started.stop.keep
    finally:
        started.resources.close()
    assert made_paths(paths, state_dir) == [] and not is_running(paths)
    assert open_fds() == fds


def test_a_bad_metrics_port_is_refused_before_anything_starts(tmp_path):
    paths = DaemonPaths.for_name(daemon_name(), str(tmp_path / "kvd.sock"))
    with pytest.raises(kvd.BadArgsError, match="metrics port"):
        DaemonConfig(paths, GEOMETRY, metrics_port=70000)
    assert not is_running(paths)


def test_a_lock_taken_on_a_file_a_stopping_daemon_unlinked_does_not_count(tmp_path, monkeypatch):
    """A clean stop unlinks <name>.lock while it still holds the flock. A starter B that opened
    the file just before that can then flock the unlinked inode while C holds the lock of a new
    file at the path: B must see its file is gone, try again and be refused, not serve beside C."""
    paths = DaemonPaths.for_name(daemon_name(), str(tmp_path / "kvd.sock"))
    first = take_lock(paths)
    stale = os.open(paths.lock_path, os.O_RDWR)  # B opens the file...
    startup._release_lock(first, paths.lock_path)  # ...the first daemon stops cleanly...
    assert not os.path.exists(paths.lock_path)
    third = take_lock(paths)  # ...C starts, on a new file...
    opened = []
    real_open = os.open

    def open_stale_first(path: str, flags: int, mode: int = 0o777) -> int:
        opened.append(path)
        return stale if len(opened) == 1 else real_open(path, flags, mode)

    monkeypatch.setattr(startup.os, "open", open_stale_first)
    try:
        with pytest.raises(kvd.DeniedError, match="already running"):
            take_lock(paths)  # ...and B's flock of the old inode succeeds: it must not count
    finally:
        monkeypatch.undo()
    assert opened == [paths.lock_path, paths.lock_path]  # it looked again at the path
    startup._release_lock(third, paths.lock_path)
    assert not os.path.exists(paths.lock_path) and not is_running(paths)
    # With nobody holding the name, a starter that locked a stale inode gets the new file's lock.
    stale = os.open(paths.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.unlink(paths.lock_path)
    opened.clear()
    monkeypatch.setattr(startup.os, "open", open_stale_first)
    try:
        fd = take_lock(paths)
    finally:
        monkeypatch.undo()
    assert os.fstat(fd).st_ino == os.stat(paths.lock_path).st_ino and is_running(paths)
    startup._release_lock(fd, paths.lock_path)


def test_a_stop_signal_logs_nothing_in_its_handler(caplog):
    """The handler runs between two bytecodes of the main thread, perhaps inside that thread's
    own write to the log's stream: logging there raised `RuntimeError: reentrant call` out of the
    loop (a `kvd demo` interrupted while its workers' sessions closed left segment and journal
    behind). The loop logs the signal once it sees the request."""
    import signal

    from kvd.server.startup import Stop

    stop = Stop()
    with caplog.at_level("DEBUG", logger="kvd"):
        stop.on_signal(signal.SIGTERM, None)
    assert caplog.records == []
    assert stop.is_requested and stop.signal_name == "SIGTERM" and not stop.keep
