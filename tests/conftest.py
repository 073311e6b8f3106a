"""Shared fixtures: real daemons in subprocesses, a private runtime dir, leak checks.

Every daemon a test starts gets a unique name; at teardown it is stopped with SIGTERM and must
exit 0 leaving no socket, pidfile or /dev/shm segment. An autouse fixture also fails any test
after which a kvd segment appeared in /dev/shm that was not there before it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACES = ROOT.parent / "shared" / "traces"

# A private runtime dir for the whole run (short: socket paths are limited to 107 bytes).
_RUNTIME_DIR = tempfile.mkdtemp(prefix="kvdt-", dir="/tmp")
os.environ["XDG_RUNTIME_DIR"] = _RUNTIME_DIR

import kvd  # noqa: E402  (after XDG_RUNTIME_DIR: the runtime dir is read at call time anyway)
from kvd.runtime import DaemonPaths, state_dir  # noqa: E402

# Names of daemons started by this run carry RUN_TAG, so the leak checks see only this run's
# segments even when other test runs share the machine.
RUN_TAG = uuid.uuid4().hex[:6]

SMALL_GEOMETRY = {"num_blocks": 64, "layers": 2, "kv_heads": 2, "head_dim": 8,
                  "block_size": 4, "dtype": "float32"}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_RUNTIME_DIR, ignore_errors=True)
    leaked = kvd_segments()
    for name in leaked:
        remove_shm_entry(f"/dev/shm/{name}")
    if leaked and session.exitstatus == 0:
        print(f"\nFAILED: this test run leaked shared-memory segments {sorted(leaked)}")
        session.exitstatus = 1


def remove_shm_entry(path: str) -> None:
    """Remove a segment or a journal directory from /dev/shm."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def child_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: this checkout importable, one BLAS thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def daemon_name(prefix: str = "t") -> str:
    """A unique daemon name that the leak checks of this run recognise."""
    return f"{prefix}{RUN_TAG}-{uuid.uuid4().hex[:8]}"


def kvd_segments() -> set[str]:
    """This run's kvd segments and default journal directories in /dev/shm."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("kvd") and RUN_TAG in name}


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = kvd_segments()
    yield
    leaked = kvd_segments() - before
    assert not leaked, f"test leaked shared-memory segments: {sorted(leaked)}"


@dataclass
class DaemonHandle:
    name: str
    proc: subprocess.Popen
    paths: DaemonPaths
    log_path: Path

    @classmethod
    def launch(cls, log_dir: Path, extra_args: list[str] | None = None,
               **options: object) -> DaemonHandle:
        """Start `kvd start --name <unique> --<option> <value>...` without waiting for it."""
        name = daemon_name()
        log_path = log_dir / f"{name}.log"
        proc = start_daemon_process(name, log_path, extra_args, **options)
        return cls(name, proc, DaemonPaths.for_name(name), log_path)

    def wait_ready(self) -> None:
        wait_ready(self.proc, self.name, self.log_path)

    def connect(self, **kwargs: object) -> kvd.Client:
        return kvd.connect(self.name, **kwargs)

    def leftovers(self) -> list[str]:
        return [p for p in ("/dev/shm" + self.paths.segment_name, str(state_dir(self.name)),
                            self.paths.socket_path, self.paths.pid_path) if os.path.exists(p)]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop_and_check(self) -> None:
        """SIGTERM; a running daemon must exit 0, and none may leave segment, socket or pidfile."""
        was_running = self.proc.poll() is None
        stop_daemon(self)
        left = self.leftovers()
        for path in left:  # clean up before failing so one failure does not cascade
            if path.startswith("/dev/shm/"):
                remove_shm_entry(path)
        if was_running:
            assert self.proc.returncode == 0, (
                f"daemon {self.name} exited {self.proc.returncode}:\n{self.log()}")
        assert not left, f"daemon {self.name} left {left}"


def start_daemon_process(name: str, log_path: Path, extra_args: list[str] | None = None,
                         **options: object) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvd.cli", "start", "--name", name]
    for key, value in options.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    command += extra_args or []
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, env=child_env(), cwd=ROOT, stdout=log, stderr=log)


def wait_ready(proc: subprocess.Popen, name: str, log_path: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"daemon {name} exited with {proc.returncode}:\n"
                                 f"{log_path.read_text(errors='replace')}")
        try:
            kvd.connect(name).close()
            return
        except kvd.DisconnectedError:
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon {name} not ready in {timeout_s} s") from None
            time.sleep(0.02)


def stop_daemon(handle: DaemonHandle) -> None:
    if handle.proc.poll() is None:
        handle.proc.send_signal(signal.SIGTERM)
        try:
            handle.proc.wait(20)
        except subprocess.TimeoutExpired:
            handle.proc.kill()
            handle.proc.wait()
            raise AssertionError(f"daemon {handle.name} ignored SIGTERM:\n{handle.log()}")


@contextlib.contextmanager
def running_daemons(log_dir: Path, *option_sets: dict[str, object]) -> Iterator[list[DaemonHandle]]:
    """Start one daemon per option set, all at once; stop and check every one at exit."""
    handles: list[DaemonHandle] = []
    try:
        for options in option_sets:
            handles.append(DaemonHandle.launch(log_dir, **options))
        for handle in handles:
            handle.wait_ready()
        yield handles
    finally:
        errors = []
        for handle in handles:
            try:
                handle.stop_and_check()
            except AssertionError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonHandle]]:
    """`daemon_factory(**options)` starts `kvd start --name <unique> --<option> <value>...`."""
    with contextlib.ExitStack() as stack:
        def start(extra_args: list[str] | None = None, **options: object) -> DaemonHandle:
            handle = DaemonHandle.launch(tmp_path, extra_args, **options)
            stack.callback(handle.stop_and_check)
            handle.wait_ready()
            return handle

        yield start


@pytest.fixture
def kvd_daemon(daemon_factory: Callable[..., DaemonHandle]) -> DaemonHandle:
    """A small float32 daemon: 64 blocks of (2 layers, 2, 4 tokens, 2 heads, 8 dims)."""
    return daemon_factory(**SMALL_GEOMETRY)


@pytest.fixture
def shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real traces not found at {SHARED_TRACES} (../shared/traces beside the "
                    "checkout); the default run uses generated fixtures instead")
    return SHARED_TRACES


@pytest.fixture
def worker_env() -> dict[str, str]:
    """Children import kvd and workers from this checkout, one BLAS thread each."""
    return child_env()


@pytest.fixture
def source_root() -> Path:
    return ROOT


# ---- threads -----------------------------------------------------------------------------------
@pytest.fixture
def fine_switching() -> Iterator[None]:
    """Switch threads every microsecond (default 5 ms), so races show within a short run."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def run_threads(target: Callable[[int], None], num_threads: int, timeout_s: float = 60.0) -> None:
    """Run `target(index)` in threads started together; fail on a hang, re-raise a failure."""
    errors: list[BaseException] = []
    start = threading.Barrier(num_threads, timeout=30)

    def main(index: int) -> None:
        try:
            start.wait()
            target(index)
        except BaseException as exc:  # (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(index,), daemon=True)
               for index in range(num_threads)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        assert not thread.is_alive(), "a thread hung"
    if errors:
        raise errors[0]
