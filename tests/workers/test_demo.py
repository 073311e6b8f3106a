"""`kvd demo` end to end: exits 0, prints what happened, leaves nothing behind — also on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SMALL = ["--workers", "2", "--conversations", "1", "--turns", "2", "--system-tokens", "64",
         "--user-tokens", "16", "--new-tokens", "8", "--num-blocks", "64"]


def _our_demo_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"kvd-{os.getuid()}-demo-")}


def _our_demo_lock_files(env: dict) -> set[str]:
    from kvd.runtime import runtime_dir

    directory = Path(env["XDG_RUNTIME_DIR"]) / "kvd" if "XDG_RUNTIME_DIR" in env else runtime_dir()
    return {path.name for path in directory.glob("demo-*.lock")} if directory.is_dir() else set()


def test_demo_runs_and_cleans_up(worker_env: dict, source_root: Path) -> None:
    before = _our_demo_segments(), _our_demo_lock_files(worker_env)
    done = subprocess.run([sys.executable, "-m", "kvd.cli", "demo", *SMALL], env=worker_env,
                          cwd=source_root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _our_demo_lock_files(worker_env) == before[1]  # (a lock file a run was once left)
    out = done.stdout
    assert re.search(r"^\s+0\s+2\s+16\s+\d+\s+[\d.]+%", out, re.M), out   # worker 0's row
    assert re.search(r"^\s+all\s+4\s+32\s", out, re.M), out
    assert "evictions" in out and "daemon stopped" in out
    assert _our_demo_segments() == before[0]


def test_demo_with_the_transformers_engine(worker_env: dict, source_root: Path) -> None:
    if os.environ.get("KVD_REQUIRE_ENGINES") != "1":
        pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[engines]'")
        pytest.importorskip("transformers", reason="transformers is not installed")
    before = _our_demo_segments()
    done = subprocess.run([sys.executable, "-m", "kvd.cli", "demo", "--engine", "transformers",
                           "--workers", "2", "--conversations", "1", "--turns", "2",
                           "--system-prompts", "1",
                           "--system-tokens", "64", "--user-tokens", "16", "--new-tokens", "4",
                           "--head-dim", "32", "--num-blocks", "64"],
                          env=worker_env, cwd=source_root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # 2 workers x 1 conversation x 2 turns (regression: --turns was ignored, 2 requests ran) =
    # 4 requests of 80 tokens: whichever runs second finds the 64-token system prompt cached
    match = re.search(r"^\s+all\s+4\s+16\s+\d+\s+[\d.]+%\s+(\d+) of 320", done.stdout, re.M)
    assert match and int(match.group(1)) >= 64, done.stdout
    assert "1 conversations x 2 turns" in done.stdout
    assert _our_demo_segments() == before


def test_demo_interrupted_stops_daemon_and_workers(worker_env: dict, source_root: Path) -> None:
    before = _our_demo_segments()
    env = {k: v for k, v in worker_env.items() if k != "PYTHONUNBUFFERED"}  # a real pipe
    proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "demo", *SMALL,
                             "--conversations", "100"],
                            env=env, cwd=source_root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first_line = proc.stdout.readline()          # printed once the daemon is up
    assert first_line.startswith("kvd demo: daemon"), first_line
    time.sleep(1.0)                                # workers are running now
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert _our_demo_segments() == before
