"""Seal throughput: what the journal costs a seal through the daemon, one client and several.

Goal (issue 6): the journal costs <= 20 % of seal throughput at batch 16.

Two real daemons side by side, `kvd start` journaled and `--no-journal`, in two scenarios
(POOL_BLOCKS): a fresh pool that never evicts (each reply waits for one commit, the seal's), and a
full one where every allocation evicts (a warm cache: the journal also commits tombstones and
compacts). Rounds of alloc → seal → release at batch 1, 16 and 256 run on both daemons in turn,
which goes first alternating, so noise hits both alike:
  * one client, in each of bench/common.py's placements (all on one CPU; the client on one CPU
    and both daemons on another): blocks sealed per second of seal calls (the round trip the
    client waits for, commit included) and per second of the whole loop. Every seal is its own
    commit: the worst case for the journal;
  * NUM_CLIENTS client processes at once, pinned as in the second placement: blocks sealed per
    second of the loop, all together. Seals that arrive in one loop iteration share a group
    commit, so the journal's cost per seal falls as clients are added;
  * in both, the daemon's CPU time per sealed block (alloc and release included).
The journal's cost is 1 - journal rate / plain rate, and on CPU 1 - plain CPU / journal CPU (the
rate a CPU-bound daemon would lose).

    python -m bench.seal_throughput [--quick] [--out DIR]
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import kvd
from bench.common import (Daemon, bench_main, cpu_ns, digests, markdown_table, pinned, placements,
                          progress, report)
from bench.recovery import GEOMETRY

BATCH_SIZES = (1, 16, 256)
MODES = ("journal", "no_journal")
NUM_CLIENTS = 4
NUM_ROUNDS = 10
GOAL_JOURNAL_COST = 0.20
# "fresh": too big to fill during the bench; "full": sealed full first, and small enough that
# the journal's log soon reaches the length where compaction runs.
POOL_BLOCKS = {"fresh": 1 << 21, "full": 1 << 16}


def seal_rounds(client: kvd.Client, batch_size: int, seconds: float, next_key: list[int],
                num_rounds: int = 0) -> tuple[int, float]:
    """alloc → seal → release until `seconds` passed and `num_rounds` were made: (blocks
    sealed, seconds spent in seals)."""
    clock = time.perf_counter
    seal_s, num_sealed = 0.0, 0
    deadline = clock() + seconds
    while clock() < deadline or num_sealed < num_rounds * batch_size:
        block_ids = client.alloc(batch_size)
        keys = digests(next_key[0], batch_size)
        next_key[0] += batch_size
        started = clock()
        client.seal(block_ids, keys)
        seal_s += clock() - started
        num_sealed += batch_size
        client.release(block_ids)
    return num_sealed, seal_s


def client_process(index: int, socket_paths: dict[str, str], conn: Any) -> None:
    """One of the concurrent clients: runs the rounds the parent sends, answers their counts."""
    clients = {mode: kvd.connect(path) for mode, path in socket_paths.items()}
    next_key = [(index + 1) << 48]  # keys distinct from every other client's
    try:
        while (job := conn.recv()) is not None:
            mode, batch_size, seconds = job
            conn.send(seal_rounds(clients[mode], batch_size, seconds, next_key)[0])
    finally:
        for client in clients.values():
            client.close()


class Clients:
    """One client of each daemon here, and NUM_CLIENTS client processes."""

    def __init__(self, daemons: dict[str, Daemon]) -> None:
        self.daemons = daemons
        self.clients = {mode: daemon.connect() for mode, daemon in daemons.items()}
        context = multiprocessing.get_context("spawn")  # no inherited sockets
        paths = {mode: daemon.socket_path for mode, daemon in daemons.items()}
        self.pipes, self.procs = [], []
        for index in range(NUM_CLIENTS):
            here, there = context.Pipe()
            proc = context.Process(target=client_process, args=(index, paths, there),
                                   daemon=True)
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)

    def one(self, mode: str, batch_size: int, seconds: float,
            next_key: list[int]) -> dict[str, float]:
        pid = self.daemons[mode].proc.pid
        cpu, started = cpu_ns(pid), time.perf_counter()
        num_sealed, seal_s = seal_rounds(self.clients[mode], batch_size, seconds, next_key)
        return {"seal_call_blocks_per_s": num_sealed / seal_s,
                "blocks_per_s": num_sealed / (time.perf_counter() - started),
                "cpu_us_per_block": (cpu_ns(pid) - cpu) / num_sealed / 1e3}

    def many(self, mode: str, batch_size: int, seconds: float) -> dict[str, float]:
        pid = self.daemons[mode].proc.pid
        cpu, started = cpu_ns(pid), time.perf_counter()
        for pipe in self.pipes:
            pipe.send((mode, batch_size, seconds))
        num_sealed = sum(pipe.recv() for pipe in self.pipes)
        return {"blocks_per_s": num_sealed / (time.perf_counter() - started),
                "cpu_us_per_block": (cpu_ns(pid) - cpu) / num_sealed / 1e3}

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(30)
        for client in self.clients.values():
            client.close()


def summarise(samples: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per metric: the median of each mode and the journal's cost."""
    row: dict[str, Any] = {}
    for metric in samples["journal"][0]:
        journal, plain = (statistics.median(sample[metric] for sample in samples[mode])
                          for mode in MODES)
        cost = 1 - plain / journal if metric.startswith("cpu") else 1 - journal / plain
        row[metric] = {"journal": journal, "no_journal": plain, "journal_cost": cost}
    return row


def scenario(name: str, seconds: float) -> dict[str, Any]:
    num_blocks = POOL_BLOCKS[name]
    os.sync()  # the writeback of what ran before must not slow this one
    with contextlib.ExitStack() as stack:
        daemons = {mode: stack.enter_context(Daemon(num_blocks, journal=mode == "journal",
                                                    **GEOMETRY)) for mode in MODES}
        clients = Clients(daemons)
        stack.callback(clients.close)
        if name == "full":
            for client in clients.clients.values():
                seal_rounds(client, 4096, 0.0, [1 << 60], num_rounds=num_blocks // 4096)
        daemon_pids = [daemon.proc.pid for daemon in daemons.values()]
        one_client = placements([os.getpid()], daemon_pids)
        many_clients = list(placements([proc.pid for proc in clients.procs if proc.pid],
                                       daemon_pids).values())[-1]
        rows: dict[str, dict[str, Any]] = {f"1 client, {placement}": {}
                                           for placement in one_client}
        rows[f"{NUM_CLIENTS} clients"] = {}
        for batch_size in BATCH_SIZES:
            progress(f"seal throughput, {name} pool, batch {batch_size}")
            samples: dict[str, dict[str, list[dict[str, float]]]] = {
                label: {mode: [] for mode in MODES} for label in rows}
            next_key = [0]
            for round_index in range(NUM_ROUNDS):
                for mode in MODES[::1 if round_index % 2 else -1]:
                    for placement, cpu_of in one_client.items():
                        with pinned(cpu_of):
                            samples[f"1 client, {placement}"][mode].append(clients.one(
                                mode, batch_size, seconds / NUM_ROUNDS, next_key))
                    with pinned(many_clients):
                        samples[f"{NUM_CLIENTS} clients"][mode].append(clients.many(
                            mode, batch_size, seconds / NUM_ROUNDS))
            for label, by_mode in samples.items():
                rows[label][str(batch_size)] = summarise(by_mode)
        return {"num_blocks": num_blocks, "clients": rows}


def run(quick: bool) -> dict[str, Any]:
    return {"goal_cost_at_16": GOAL_JOURNAL_COST,
            "scenarios": {name: scenario(name, 0.2 if quick else 2.0) for name in POOL_BLOCKS}}


def markdown(results: dict[str, Any]) -> str:
    metrics = (("seal_call_blocks_per_s", "seal calls k blocks/s", 1e3),
               ("blocks_per_s", "rounds k blocks/s", 1e3),
               ("cpu_us_per_block", "daemon CPU µs/block", 1))
    header = ["scenario", "clients", "batch"] + [
        f"{label}: {column}" for _, label, _ in metrics
        for column in ("no journal", "journal", "cost")]
    rows = []
    for name, result in results["scenarios"].items():
        for label, batches in result["clients"].items():
            for batch, row in batches.items():
                cells = []
                for metric, _, scale in metrics:
                    cell = row.get(metric)
                    cells += (["-"] * 3 if cell is None else
                              [f"{cell['no_journal'] / scale:.1f}",
                               f"{cell['journal'] / scale:.1f}", f"{cell['journal_cost']:.1%}"])
                rows.append([f"{name} ({result['num_blocks']:,} blocks)", label, batch, *cells])
    fresh = results["scenarios"]["fresh"]["clients"]
    at_16 = [row["16"]["blocks_per_s"]["journal_cost"] for label, row in fresh.items()
             if label.startswith("1 client") and "16" in row]
    worst = max(at_16, default=float("nan"))
    goal = results["goal_cost_at_16"]
    return ("## Seal throughput, journal vs --no-journal (bench/seal_throughput.py)\n\n"
            f"Journal cost at batch 16, one client, fresh pool, rounds: at most **{worst:.0%}** "
            f"(goal <= {goal:.0%}: {'met' if worst <= goal else 'NOT met'}). Medians of "
            f"{NUM_ROUNDS} rounds; cost = what the journal takes off.\n\n"
            + markdown_table(header, rows))


def run_bench(quick: bool, out: Path) -> str:
    return report(out, "seal_throughput", run(quick), markdown)


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run_bench))
