"""The `kvd` command as users run it: start/stop/status/stats, single instance, signals, errors."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import kvd
from kvd import native, protocol
from kvd.runtime import DaemonPaths
from conftest import daemon_name

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-blocks", "16", "--layers", "1", "--kv-heads", "1", "--head-dim", "8",
        "--block-size", "4"]

pytestmark = pytest.mark.integration


def kvd_cli(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "kvd.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def leftovers(paths: DaemonPaths) -> list[str]:
    """What a stopped daemon must not leave (its lock file included: only a --detach log stays)."""
    return [p for p in (f"/dev/shm{paths.segment_name}", paths.socket_path, paths.pid_path,
                        paths.lock_path) if os.path.exists(p)]


def test_a_second_start_with_the_same_name_is_refused_while_the_first_serves(kvd_daemon):
    second = kvd_cli("start", "--name", kvd_daemon.name, *TINY)
    assert second.returncode != 0
    assert "already running" in second.stderr and kvd_daemon.name in second.stderr
    assert "kvd stop" in second.stderr  # says what to do
    assert not second.stdout
    assert kvd_daemon.proc.poll() is None
    assert os.path.exists(kvd_daemon.paths.socket_path)  # the loser touched nothing
    with kvd_daemon.connect() as client:
        client.release(client.alloc(4))
        assert client.stats()["daemon_pid"] == kvd_daemon.proc.pid


def test_a_socket_path_another_daemon_serves_or_a_plain_file_is_never_replaced(kvd_daemon,
                                                                              tmp_path):
    """Regression: the name's lock does not cover --socket, so a second daemon under another
    name unlinked the first one's live socket (leaving it unreachable), and a mistyped --socket
    naming a file deleted the file."""
    thief = kvd_cli("start", "--name", daemon_name(), "--socket", kvd_daemon.paths.socket_path,
                    *TINY)
    assert thief.returncode == 2 and "another daemon serves" in thief.stderr, thief.stderr
    with kvd_daemon.connect() as client:
        assert client.stats()["daemon_pid"] == kvd_daemon.proc.pid
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    typo = kvd_cli("start", "--name", daemon_name(), "--socket", str(precious), *TINY)
    assert typo.returncode == 2 and "is not a socket" in typo.stderr, typo.stderr
    assert precious.read_text() == "keep me"
    bad_name = kvd_cli("start", "--name", f"{kvd_daemon.name}.journal", *TINY)
    assert bad_name.returncode == 2 and "must not end in '.journal'" in bad_name.stderr


def test_kvd_stop_removes_socket_segment_and_pidfile(kvd_daemon):
    with kvd_daemon.connect() as client:  # a connected client does not keep it alive
        client.alloc(2)
        done = kvd_cli("stop", "--name", kvd_daemon.name)
    assert done.returncode == 0, done.stderr
    assert f"stopped {kvd_daemon.name}" in done.stdout
    assert kvd_daemon.proc.wait(20) == 0
    assert leftovers(kvd_daemon.paths) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_stop_cleanly(kvd_daemon, signum):
    with kvd_daemon.connect() as client:
        client.alloc(2)
        kvd_daemon.proc.send_signal(signum)
        assert kvd_daemon.proc.wait(20) == 0
    assert leftovers(kvd_daemon.paths) == []
    assert f"received {signal.Signals(signum).name}, stopping" in kvd_daemon.log()
    assert "Traceback" not in kvd_daemon.log()


def test_stop_status_and_stats_of_a_daemon_that_is_not_running():
    name = daemon_name()
    stop = kvd_cli("stop", "--name", name)
    assert stop.returncode == 1 and "no daemon named" in stop.stderr
    status = kvd_cli("status", "--name", name)
    assert status.returncode == 3 and "not running" in status.stdout
    assert kvd_cli("stats", "--name", name, "--json").returncode == 3


def test_detach_status_stats_stop_round_trip():
    name = daemon_name()
    paths = DaemonPaths.for_name(name)
    try:
        started = kvd_cli("start", "--name", name, "--detach", "--policy", "lru",
                          "--metrics-port", "0", *TINY)
        assert started.returncode == 0, started.stderr
        assert started.stdout.startswith(f"kvd: serving name={name}")
        # --metrics-port 0: the port the kernel chose is in the ready line, the log and stats
        port = int(re.search(r" metrics=127\.0\.0\.1:(\d+) ", started.stdout).group(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b'kvd_pool_blocks{pool="default"} 16.0' in reply.read()
        log_path = re.search(r" log=(\S+)$", started.stdout.strip()).group(1)
        assert f"serving metrics on 127.0.0.1:{port}" in Path(log_path).read_text()
        assert f"socket={paths.socket_path}" in started.stdout
        assert f"segment={paths.segment_name}" in started.stdout
        assert f"codec={protocol.codec()}" in started.stdout  # as built here: C unless it fell back
        assert f"native={native.summary()}" in started.stdout  # which compiled modules run
        with kvd.connect(name) as client:
            client.alloc(3)
            status = kvd_cli("status", "--name", name)
            assert status.returncode == 0
            assert "sessions" in status.stdout and "16 blocks" in status.stdout
            assert "policy lru" in status.stdout
            table = kvd_cli("stats", "--name", name)
            assert table.returncode == 0 and "blocks free / owned / sealed / cached" in table.stdout
            assert "13 / 3 / 0 / 0 of 16" in table.stdout
            assert f"http://127.0.0.1:{port}/metrics" in table.stdout
            assert "tiers" not in table.stdout  # (none asked for)
            as_json = kvd_cli("stats", "--name", name, "--json")
            stats = json.loads(as_json.stdout)
        assert (stats["num_blocks"], stats["owned"], stats["policy"]) == (16, 3, "lru")
        assert stats["metrics_port"] == port
        assert stats["geometry"]["block_size"] == 4
        stopped = kvd_cli("stop", "--name", name)
        assert stopped.returncode == 0, stopped.stderr
        assert leftovers(paths) == []
        assert os.path.exists(log_path)  # the log stays (docs/operations.md)
        assert kvd_cli("status", "--name", name).returncode == 3
    finally:
        with contextlib.suppress(OSError, ValueError):  # only if a check above failed
            os.kill(int(Path(paths.pid_path).read_text()), signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm{paths.segment_name}")
        with contextlib.suppress(FileNotFoundError, UnboundLocalError):
            os.unlink(log_path)


def test_stats_text_shows_the_tiers_and_their_blocks(daemon_factory):
    """Regression: only `kvd stats --json` showed --tiers and the blocks each tier holds."""
    daemon = daemon_factory(["--tiers", "prefill=0.75,decode=0.25:lru"], num_blocks=16,
                            layers=1, kv_heads=1, head_dim=8, block_size=4)
    with daemon.connect() as client:
        sequence = client.open_sequence(list(range(8)))  # 2 prompt blocks
        client.extend_sequence(sequence, [100, 101, 102, 103], num_computed=8)  # seals them
        client.commit_sequence(sequence)  # and a block of generated tokens: decode tier
        client.close_sequence(sequence)
        table = kvd_cli("stats", "--name", daemon.name)
        stats = client.stats()
    assert table.returncode == 0, table.stderr
    lines = dict(line.split("  ", 1) for line in table.stdout.splitlines())
    assert lines["tiers"].strip() == stats["tiers"] == "prefill=0.75:kvd,decode=0.25:lru"
    blocks = stats["tier_blocks"]
    assert blocks == {"prefill": 2, "decode": 1}
    assert lines["tier blocks prefill / decode"].strip() == "2 / 1"
    assert lines["metrics"].strip() == "off"


def test_a_pool_larger_than_dev_shm_is_a_one_line_error_at_start():
    name = daemon_name()
    paths = DaemonPaths.for_name(name)
    free_nbytes = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    memory = f"{free_nbytes // (1 << 20) * 2 + 1024}M"  # twice what is free
    done = kvd_cli("start", "--name", name, "--memory", memory, "--layers", "1")
    assert done.returncode == 2, (done.returncode, done.stderr)  # not -SIGBUS
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kvd: /dev/shm has ") and "lower --num-blocks" in lines[0]
    assert leftovers(paths) == []


def test_stop_and_status_of_a_hung_daemon_are_bounded_and_say_so(kvd_daemon):
    """Regression: `kvd stop --timeout 1` waited forever on a stopped (SIGSTOP) daemon, and
    `kvd status` called a daemon that holds its name but does not answer "not running"."""
    kvd_daemon.proc.send_signal(signal.SIGSTOP)
    try:
        stop = kvd_cli("stop", "--name", kvd_daemon.name, "--timeout", "1", timeout_s=20)
        assert stop.returncode == 1 and "did not answer within 1.0 s" in stop.stderr
        status = kvd_cli("status", "--name", kvd_daemon.name, "--timeout", "0.5", timeout_s=20)
        assert status.returncode == 4 and "not responding" in status.stdout
    finally:
        kvd_daemon.proc.send_signal(signal.SIGCONT)
    assert kvd_cli("status", "--name", kvd_daemon.name).returncode == 0
    bad = kvd_cli("stop", "--name", kvd_daemon.name, "--timeout", "0")
    assert bad.returncode == 2 and "--timeout must be > 0" in bad.stderr
    assert kvd_daemon.proc.poll() is None  # still serving after all of that


def test_status_and_stop_work_when_the_segment_was_deleted_under_the_daemon(kvd_daemon):
    """Regression: with its segment unlinked from /dev/shm, `kvd status` said "not responding"
    and `kvd stop` could not stop the daemon: both attached the segment before asking."""
    segment_path = f"/dev/shm{kvd_daemon.paths.segment_name}"
    os.unlink(segment_path)
    status = kvd_cli("status", "--name", kvd_daemon.name, timeout_s=20)
    assert status.returncode == 0, status.stdout + status.stderr
    assert " up " in status.stdout and "64 blocks" in status.stdout
    assert f"segment {kvd_daemon.paths.segment_name} is MISSING" in status.stdout
    stop = kvd_cli("stop", "--name", kvd_daemon.name, timeout_s=20)
    assert stop.returncode == 0, stop.stderr
    assert kvd_daemon.proc.wait(20) == 0
    assert leftovers(kvd_daemon.paths) == []
    assert "Traceback" not in kvd_daemon.log()


@pytest.mark.parametrize("flags, message", [
    (["--metrics-port", "99999"], "is not a TCP port"),
    (["--metrics-port", "http"], "is not a TCP port"),
    (["--memory", "0"], "0 bytes hold no block"),
    (["--tiers", "prefill=0.5:bogus,decode=0.5"], "unknown --tiers prefill=...:POLICY 'bogus'"),
    (["--tiers", "prefill=0.5,decode=0.5", "--policy", "bogus"], "unknown --policy 'bogus'"),
])
def test_bad_start_flags_are_one_line_errors(flags, message):
    """Regression: --metrics-port 99999 was a raw OverflowError traceback, --memory 0 silently
    became the 512 MiB default, and a tier's unknown policy failed inside the daemon (exit 1)."""
    name = daemon_name()
    started = kvd_cli("start", "--name", name, *flags, *TINY[2:])
    assert started.returncode == 2 and message in started.stderr, started.stderr
    assert "Traceback" not in started.stderr
    assert started.stderr.splitlines()[-1].startswith("kvd")  # `kvd: ...` or argparse's
    assert leftovers(DaemonPaths.for_name(name)) == []


@pytest.mark.parametrize("flag, value", [("--layers", 2**62), ("--head-dim", 2**62),
                                         ("--num-blocks", 2**62)])
def test_absurd_geometry_is_a_one_line_error_naming_the_flag(flag, value):
    """Regression (issue 34 item 8): --layers 2**62 was a ZeroDivisionError traceback and
    --head-dim 2**62 an OverflowError (np.prod wrapped the block's byte count)."""
    name = daemon_name()
    geometry = {"--num-blocks": "16", "--block-size": "4", "--layers": "1", "--kv-heads": "1",
                "--head-dim": "8", "--dtype": "float32", flag: str(value)}
    started = kvd_cli("start", "--name", name, *(arg for item in geometry.items() for arg in item))
    assert started.returncode == 2, (started.returncode, started.stderr)
    lines = [line for line in started.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvd: "), started.stderr
    assert f"lower {flag} ({value})" in lines[0] and f"{2**47} bytes" in lines[0], lines[0]
    assert leftovers(DaemonPaths.for_name(name)) == []
