"""Multiprocess stress with chaos: random workers, random SIGKILLs, every read verified.

N worker processes (stress_procs.StressWorker) run random mixes of lookup / alloc / write / seal /
read / pin / release and open / commit / extend / fork / close sequence cycles on a pool smaller
than half of the prompts' distinct blocks (constant eviction), with shared prefixes so lookups hit.
A chaos loop SIGKILLs a random worker every 0.2-0.8 s and starts a replacement; a third of the
workers first fork a child that keeps their socket open for 2 s after they die, so the daemon
must notice the death through the pidfd, not through EOF.

Reclaim time, per kill: the loop opens a pidfd on the victim, sends SIGKILL, waits for the pidfd
to become readable (the process is dead: this is t0), then polls the daemon's debug op
`check_invariants` (KVD_DEBUG=1) until the victim's session is gone — the daemon removes a
session only after releasing its pins and freeing its unsealed blocks — and records the
elapsed time. Each poll also checks every invariant mid-run.

At the end, with every worker gone: invariants hold, no block is owned or pinned, the whole pool
can be allocated again (0 leaked blocks), 0 corrupt reads, daemon RSS grew < 10 % from warm-up
(VmRSS from /proc/<pid>/status), and the p99 reclaim time is reported (goal < 100 ms).

Across two pools: workers use both pools in one session (and one worker in two only the pool its
session chose) and run sequences on a model spanning them (one pool with a sliding window). The
daemon itself is SIGKILLed twice and restarted with --recover, the workers stopped meanwhile, so
that the recovered state is checked before anyone touches it (nothing owned or pinned, every
index entry cached, every invariant, in every pool); they then reconnect and go on, verifying
every block they read, the recovered ones included.
`KVD_STRESS_SCALE` multiplies workers and duration; `KVD_STRESS_REPORT=path` writes the summary
as JSON. Default tier: ~20 s; `pytest -m slow`: the 10-minute soak.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from stress.stress_procs import (
    COUNTERS,
    NUM_COUNTERS,
    check_invariants,
    context,
    make_prompts,
    num_distinct_blocks,
    stress_worker_main,
)

import kvd
from conftest import start_daemon_process

RECLAIM_GOAL_S = 0.1
RECLAIM_TIMEOUT_S = 5.0
KILL_INTERVAL_S = (0.2, 0.8)
SCALE = float(os.environ.get("KVD_STRESS_SCALE", "1"))
GEOMETRY = {"layers": 2, "kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32"}


@dataclass
class Kill:
    reclaim_s: float
    had_forked_child: bool
    pins_at_kill: int  # the victim's pins at the poll just before SIGKILL


@dataclass
class Chaos:
    """Workers, their shared counters and the chaos loop's records."""

    socket_path: str
    prompts: list[np.ndarray]
    max_slots: int
    seed: int
    # worker i works in the pools worker_pools[i % len(worker_pools)] (None: the one pool)
    worker_pools: tuple[tuple[str | None, ...], ...] = ((None,),)
    model: str | None = None  # and runs sequences of this model
    counters: Any = None
    workers: dict[int, Any] = field(default_factory=dict)  # slot → Process
    fork_holders: set[int] = field(default_factory=set)
    kills: list[Kill] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)
    num_started: int = 0
    num_polls: int = 0
    num_restarts: int = 0  # of the daemon

    def __post_init__(self) -> None:
        self.counters = context().Array("q", (self.max_slots + 1) * NUM_COUNTERS, lock=False)
        self.rng = random.Random(self.seed)

    def start_worker(self) -> None:
        self.num_started += 1
        slot = self.num_started  # row 0 holds the stop flag
        if slot > self.max_slots:
            raise AssertionError("more workers started than max_slots allows")
        fork_holder = slot % 3 == 0
        process = context().Process(
            target=stress_worker_main, daemon=True,
            args=(self.socket_path, self.counters, slot, self.seed * 100_003 + slot, self.prompts,
                  fork_holder, self.worker_pools[slot % len(self.worker_pools)], self.model))
        process.start()
        self.workers[slot] = process
        if fork_holder:
            self.fork_holders.add(slot)

    def kill_one(self, monitor: kvd.Client) -> None:
        slot = self.rng.choice(sorted(self.workers))
        process = self.workers.pop(slot)
        if process.exitcode is not None:  # died on its own: a worker bug
            self.crashed.append(f"worker {slot} exited {process.exitcode}")
            return
        pins = sum(s[2] for s in check_invariants(monitor) if s[1] == process.pid)
        pidfd = os.pidfd_open(process.pid)
        try:
            os.kill(process.pid, signal.SIGKILL)
            select.select([pidfd], [], [])
            died_at = time.perf_counter()
        finally:
            os.close(pidfd)
        reclaim_s = self.await_reclaim(monitor, process.pid, died_at)
        self.kills.append(Kill(reclaim_s, slot in self.fork_holders, pins))
        process.join()

    def await_reclaim(self, monitor: kvd.Client, pid: int, died_at: float) -> float:
        """Seconds from `died_at` until the daemon has no session for `pid` (an upper bound:
        the first poll's round trip when the daemon was faster than it)."""
        while True:
            sessions = check_invariants(monitor)
            self.num_polls += 1
            now = time.perf_counter()
            victim = [s for s in sessions if s[1] == pid]
            if not victim:
                return now - died_at
            if now - died_at > RECLAIM_TIMEOUT_S:
                raise AssertionError(f"the daemon did not reclaim killed worker {pid} in "
                                     f"{RECLAIM_TIMEOUT_S} s (it still holds {victim[0][2]} pins)")
            time.sleep(0.0005)

    def stop_all(self) -> None:
        self.counters[0] = 1  # workers and their socket-holding children exit
        for slot, process in self.workers.items():
            process.join(5)
            if process.exitcode != 0:
                self.crashed.append(f"worker {slot} exited {process.exitcode}")
                process.kill()
                process.join()
        self.workers.clear()
        for slot in self.fork_holders:
            wait_gone(self.column("holder_pid")[slot])

    def signal_workers(self, signum: int) -> None:
        for process in self.workers.values():
            os.kill(process.pid, signum)

    def column(self, name: str) -> np.ndarray:
        table = np.frombuffer(self.counters, dtype=np.int64).reshape(-1, NUM_COUNTERS)
        return table[:, COUNTERS.index(name)].copy()

    def total(self, name: str) -> int:
        return int(self.column(name)[1:].sum())


def wait_gone(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until `pid` (not our child: a worker's orphan) has exited (zombie counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while pid and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as file:
                if file.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    if pid and time.monotonic() >= deadline:
        raise AssertionError(f"socket-holding child {pid} did not exit")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as file:
        for line in file:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_stress(handle: Any, num_workers: int, duration_s: float, seed: int = 1,
               worker_pools: tuple[tuple[str | None, ...], ...] = ((None,),),
               model: str | None = None, restart_args: list[str] | None = None
               ) -> dict[str, Any]:
    """Run workers under chaos for `duration_s` (in `worker_pools`, and `model`); with
    `restart_args` (the daemon's flags), SIGKILL and --recover the daemon at 1/4 and 1/2 of it.
    Returns the summary (asserts nothing itself but the recovered states)."""
    pools = tuple(dict.fromkeys(pool for each in worker_pools for pool in each))
    monitor = handle.connect()
    try:
        geometry = monitor.geometry
        prompts = make_prompts(seed, 8 * max(1, round(num_workers / 6)), geometry.block_size)
        max_slots = num_workers + int(duration_s / KILL_INTERVAL_S[0]) + 1
        chaos = Chaos(handle.paths.socket_path, prompts, max_slots, seed, worker_pools, model)
        for _ in range(num_workers):
            chaos.start_worker()
        started = time.monotonic()
        restarts_at = [] if restart_args is None else [started + duration_s * k / 4
                                                       for k in (1, 2)]
        # (RSS of the last incarnation, from a while after its start)
        warm_at = max([started + max(3.0, duration_s / 4), *(at + 3.0 for at in restarts_at)])
        rss_warm = None
        while time.monotonic() - started < duration_s:
            time.sleep(chaos.rng.uniform(*KILL_INTERVAL_S))
            if restarts_at and time.monotonic() >= restarts_at[0]:
                del restarts_at[0]
                monitor.close()
                monitor = crash_and_recover(handle, restart_args or [], chaos, pools)
            if rss_warm is None and time.monotonic() >= warm_at:
                rss_warm = rss_kib(handle.proc.pid)
            chaos.kill_one(monitor)
            chaos.start_worker()
        rss_end = rss_kib(handle.proc.pid)
        chaos.stop_all()
        summary = final_state(monitor, chaos, pools)
    finally:
        monitor.close()
    reclaim_s = [kill.reclaim_s for kill in chaos.kills]
    forked_s = [kill.reclaim_s for kill in chaos.kills if kill.had_forked_child]
    summary.update({
        "workers": num_workers, "duration_s": round(time.monotonic() - started, 1),
        "distinct_blocks_in_prompts": num_distinct_blocks(prompts, geometry.block_size),
        **{name: chaos.total(name) for name in COUNTERS if name != "holder_pid"},
        "kills": len(chaos.kills), "kills_with_forked_child": len(forked_s),
        "kills_with_pins": sum(1 for kill in chaos.kills if kill.pins_at_kill),
        "crashed_workers": chaos.crashed, "invariant_checks": chaos.num_polls,
        "daemon_restarts": chaos.num_restarts,
        "reclaim_ms_p50": round(1e3 * percentile(reclaim_s, 50), 2),
        "reclaim_ms_p99": round(1e3 * percentile(reclaim_s, 99), 2),
        "reclaim_ms_max": round(1e3 * max(reclaim_s, default=float("nan")), 2),
        "reclaim_ms_p99_forked_child": round(1e3 * percentile(forked_s, 99), 2),
        "rss_kib_warm": rss_warm, "rss_kib_end": rss_end,
        "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
    })
    return summary


def crash_and_recover(handle: Any, args: list[str], chaos: Chaos,
                      pools: tuple[str | None, ...]) -> kvd.Client:
    """SIGKILL the daemon with the workers stopped, `kvd start --recover` it under the same
    name, check what it recovered before the workers go on; returns a monitor connected to it."""
    chaos.signal_workers(signal.SIGSTOP)
    try:
        handle.proc.kill()
        handle.proc.wait()
        handle.proc = start_daemon_process(handle.name, handle.log_path, [*args, "--recover"])
        handle.wait_ready()
        monitor = handle.connect()
        stats = monitor.stats()
        for each in ([stats] if pools == (None,) else [stats["pools"][pool] for pool in pools]):
            assert each["owned"] == each["sealed"] == 0 and each["cached"] == each["indexed"], \
                each
            assert each["cached"] > 0, each  # (the journals kept the cache)
        check_invariants(monitor)
    finally:
        chaos.signal_workers(signal.SIGCONT)
    chaos.num_restarts += 1
    return monitor


def final_state(monitor: kvd.Client, chaos: Chaos,
                pools: tuple[str | None, ...]) -> dict[str, Any]:
    """Wait for the daemon to drop every worker session, then check it kept nothing: in each
    pool, whose every block (with several pools: the whole budget) can be allocated again."""
    deadline = time.monotonic() + RECLAIM_TIMEOUT_S
    while len(sessions := check_invariants(monitor)) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    everything = monitor.stats()
    each = [everything] if pools == (None,) else [everything["pools"][pool] for pool in pools]
    leaked = sum(stats["num_blocks"] - stats["free"] - stats["cached"] for stats in each)
    num_blocks = 0
    for pool in pools:
        capacity = monitor.pools[pool].num_blocks if pool else monitor.geometry.num_blocks
        block_ids = monitor.alloc(capacity, pool=pool)  # evicting the whole cache
        monitor.release(block_ids, pool=pool)
        check_invariants(monitor)
        num_blocks = max(num_blocks, capacity)
    total = {name: sum(stats[name] for stats in each)
             for name in ("owned", "sealed", "evictions", "hit_blocks", "lookup_blocks")}
    return {"sessions_left": len(sessions) - 1, "leaked_blocks": leaked,
            "num_blocks": num_blocks,
            "slab_moves": everything.get("arena", {}).get("slab_moves", 0),
            "owned_at_end": total["owned"], "sealed_at_end": total["sealed"],
            "evictions": total["evictions"], "lookup_hit_ratio":
                round(total["hit_blocks"] / max(1, total["lookup_blocks"]), 3)}


def report(summary: dict[str, Any]) -> None:
    print("\nstress summary: " + json.dumps(summary, indent=1))
    path = os.environ.get("KVD_STRESS_REPORT")
    if path:
        with open(path, "w") as file:
            json.dump(summary, file, indent=1)


def check(summary: dict[str, Any]) -> None:
    assert not summary["crashed_workers"], summary
    assert summary["errors"] == 0, summary
    assert summary["corrupt_reads"] == 0, summary
    assert summary["leaked_blocks"] == 0 and summary["sessions_left"] == 0, summary
    assert summary["owned_at_end"] == 0 and summary["sealed_at_end"] == 0, summary
    assert summary["rss_growth_pct"] < 10, summary
    # The pool must be under real pressure, and the workers must actually share prefixes.
    assert summary["distinct_blocks_in_prompts"] > 2 * summary["num_blocks"], summary
    assert summary["evictions"] > 0 and summary["hit_blocks"] > 0, summary
    assert summary["kills_with_pins"] > 0 and summary["kills_with_forked_child"] > 0, summary
    assert summary["reclaim_ms_p99"] < 1e3 * RECLAIM_GOAL_S, summary


@pytest.fixture
def stress_daemon(daemon_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("KVD_DEBUG", "1")
    num_workers = max(1, round(6 * SCALE))
    return daemon_factory(num_blocks=24 * num_workers + 16, **GEOMETRY), num_workers


def test_stress_with_chaos(stress_daemon: Any) -> None:
    handle, num_workers = stress_daemon
    summary = run_stress(handle, num_workers, 20 * SCALE)
    report(summary)
    check(summary)


def test_stress_with_chaos_across_two_pools(daemon_factory: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The same chaos with the workers using two pools of different block bytes sharing one
    budget (slabs move between them under eviction) in one session, and a model spanning them
    (the thin pool has a sliding window), while the daemon is SIGKILLed and recovered twice;
    every invariant checked in both pools, after each recovery too."""
    monkeypatch.setenv("KVD_DEBUG", "1")
    num_workers = max(2, round(6 * SCALE))
    args = ["--pool", "wide:layers=2,kv-heads=2,head-dim=8,dtype=float32,block-size=4",
            "--pool", "thin:layers=1,kv-heads=2,head-dim=8,dtype=float32,block-size=4,window=9",
            "--model", "both:wide,thin", "--memory", str((12 * num_workers + 8) * 1024)]
    handle = daemon_factory(args)
    summary = run_stress(handle, num_workers, 15 * SCALE, worker_pools=(("wide", "thin"),
                                                                        ("thin",)),
                         model="both", restart_args=args)
    report(summary)
    check(summary)
    assert summary["slab_moves"] > 0, summary  # memory moved between the pools under churn
    assert summary["daemon_restarts"] == 2 and summary["restarts"] > 0, summary
    assert summary["model_cycles"] > 0 and summary["seq_cycles"] > 0, summary


@pytest.mark.slow
def test_soak_ten_minutes(stress_daemon: Any) -> None:
    handle, num_workers = stress_daemon
    summary = run_stress(handle, num_workers, 600 * SCALE, seed=7)
    report(summary)
    check(summary)
