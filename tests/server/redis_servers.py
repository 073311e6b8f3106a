"""Real Redis servers for the remote tier's tests: one server, or a 3-master 3-replica cluster,
on free loopback ports in temporary directories, removed afterwards.

Tests that need them skip (with the command that installs it) where redis-server is missing,
unless KVD_REQUIRE_REDIS=1 (CI, which installs Debian's: .ci/run) makes that a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CLUSTER_NODE_TIMEOUT_MS = 1000  # how long a dead master takes to be failed over (plus election)


def skip_without_redis() -> None:
    missing = redis_missing()
    if missing and os.environ.get("KVD_REQUIRE_REDIS") == "1":
        pytest.fail(f"KVD_REQUIRE_REDIS=1 but {missing}")
    if missing:
        pytest.skip(missing)


def redis_missing() -> str | None:
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py is not installed (pip install -e .[test])"
    return None


def free_port() -> int:
    """A loopback port free now, with its cluster bus port (+10000) free too."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisServer:
    """One redis-server process in `directory` (no persistence), restartable on its port."""

    def __init__(self, directory: Path, port: int | None = None, *extra: str) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                   "--enable-debug-command", "local", *self.extra]
        log = open(self.directory / "redis.log", "ab")
        with log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.cli("PING") == "PONG":
                    return self
            except subprocess.CalledProcessError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"redis-server on {self.port} did not start: "
                                     f"{(self.directory / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.02)

    def cli(self, *args: str) -> str:
        done = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True,
                              text=True, timeout=30, check=True)
        if done.stdout.startswith("Could not connect"):
            raise subprocess.CalledProcessError(1, "redis-cli", done.stdout)
        return done.stdout.strip()

    def client(self) -> object:
        import redis
        return redis.Redis(port=self.port)

    def kill(self) -> None:
        """SIGKILL (a crash: no goodbye to clients)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class RedisClusterNodes:
    """Six cluster-enabled servers joined as 3 masters with a replica each."""

    def __init__(self, directory: Path) -> None:
        self.nodes = [RedisServer(directory / f"node{i}", None, "--cluster-enabled", "yes",
                                  "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS),
                                  "--cluster-config-file", "nodes.conf",
                                  "--repl-diskless-sync-delay", "0")
                      for i in range(6)]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def start(self) -> RedisClusterNodes:
        for node in self.nodes:
            node.start()
        subprocess.run(["redis-cli", "--cluster", "create",
                        *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", "1", "--cluster-yes"],
                       capture_output=True, text=True, timeout=60, check=True)
        self.wait_ok()
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says cluster_state:ok, the slots have 3 masters and every
        replica has synced (a replica that has not cannot be failed over to)."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = [n for n in self.nodes if n.proc is not None]
            states = [n.cli("CLUSTER", "INFO") for n in live]
            replication = [n.cli("INFO", "replication") for n in live]
            if (all("cluster_state:ok" in s for s in states) and len(self.masters()) == 3
                    and all("master_link_status:up" in r for r in replication
                            if "role:slave" in r)):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster not ok in {timeout_s} s: {states}")
            time.sleep(0.1)

    def masters(self) -> list[RedisServer]:
        """Live nodes that serve slots as masters (as the first live node sees it)."""
        live = [n for n in self.nodes if n.proc is not None]
        lines = live[0].cli("CLUSTER", "NODES").splitlines()
        ports = {int(line.split()[1].split(":")[1].split("@")[0]) for line in lines
                 if "master" in line.split()[2] and "fail" not in line.split()[2]
                 and len(line.split()) > 8}
        return [n for n in live if n.port in ports]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def started_in_temp_dir(make: Callable[[Path], Any], prefix: str) -> Iterator[Any]:
    """`make(directory)`'s servers, started in a fresh temp dir; stopped and removed after."""
    skip_without_redis()
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    servers = make(directory)
    try:
        yield servers.start()
    finally:
        servers.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for a test module (tests flush it as they need)."""
    with started_in_temp_dir(RedisServer, "kvd-redis-") as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """A 3-master 3-replica Redis Cluster for the whole run (a few seconds to form)."""
    with started_in_temp_dir(RedisClusterNodes, "kvd-rcluster-") as cluster:
        yield cluster
