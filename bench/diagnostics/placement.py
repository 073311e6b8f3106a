"""Where a small VM's scheduler puts kvd and its echo floor, and what that does to their ratio.

Not part of `python -m bench`: its control plane (bench/control_plane.py) pins client and servers
so that both servers meet the same conditions. This script runs the same rounds free-running:

* rows at batch 1, 16 and 256, sampling every PLACEMENT_EVERY rounds (untimed) the CPU each
  server last ran on (/proc/PID/stat field 39, where its next wake-up most likely lands) and
  reporting the share of samples in which that was the client's CPU. A server beside its client
  answers without waking another vCPU, so a row compares kvd with its floor only when both sat
  alike: both beside the client, or both away from it, in PLACED_ALIKE of the samples;
* placement trials: batch 1 on fresh pairs of servers, the one started first alternating (on
  2-vCPU VMs the first-started server was often the one seated beside the client, and kept
  there, so kvd / floor followed the start order);
* CPU per batch-1 lookup + release pair on each server and in the client, kvd and the floor
  alternating in chunks (a server beside its client also burns less CPU waking).

    python -m bench.diagnostics.placement [--quick] [--trials N] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (Daemon, EchoClient, EchoServer, cpu_ns, digests, markdown_table,
                          progress, write_json)
from bench.control_plane import BATCH_SIZES, NUM_BLOCKS, OPS, keys_used, measure, rounds_for

PLACEMENT_EVERY = 5  # rounds between samples of where each server last ran
PLACED_ALIKE = 0.8
NUM_TRIALS = 4
CHUNK = 50  # request pairs per turn when kvd and the floor alternate in the CPU measurement


def last_cpu(pid: int) -> int:
    """The CPU process `pid` runs on, or last ran on if it sleeps (/proc/PID/stat field 39)."""
    with open(f"/proc/{pid}/stat") as file:
        return int(file.read().rpartition(")")[2].split()[36])


def placed_alike(on_client_cpu: dict[str, float]) -> bool:
    shares = on_client_cpu.values()
    return min(shares) >= PLACED_ALIKE or max(shares) <= 1 - PLACED_ALIKE


class Sampler:
    """Counts, per server, the samples in which it last ran on the client's CPU."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.num_samples = pids, 0
        self.beside = dict.fromkeys(pids, 0)

    def sample(self) -> None:
        mine = last_cpu(os.getpid())
        for kind, pid in self.pids.items():
            self.beside[kind] += last_cpu(pid) == mine
        self.num_samples += 1

    def every(self, num_rounds: int) -> Any:
        return lambda number: self.sample() if number % num_rounds == 0 else None

    def shares(self) -> dict[str, Any]:
        shares = {kind: count / max(1, self.num_samples) for kind, count in self.beside.items()}
        return {"on_client_cpu": shares, "placed_alike": placed_alike(shares)}


def free_running(daemon: Daemon, echo: EchoServer, batch_size: int, num_rounds: int,
                 first_key: int) -> dict[str, Any]:
    sampler = Sampler({"kvd": daemon.proc.pid, "echo": echo.proc.pid})
    row = measure(daemon, echo, batch_size, num_rounds, first_key,
                  sampler.every(PLACEMENT_EVERY))
    return {"p50_ratio": max(row[op]["p50_ratio"] for op in OPS),
            **{f"{kind}_p50_us": max(row[op][kind]["p50_us"] for op in OPS)
               for kind in ("kvd", "echo")}, **sampler.shares()}


def placement_trials(num_trials: int, num_rounds: int) -> list[dict[str, Any]]:
    """Batch 1 on fresh pairs of servers, which is started first alternating."""
    trials = []
    for trial in range(num_trials):
        first = ("echo", "kvd")[trial % 2]
        progress(f"placement trial {trial + 1} of {num_trials}: {first} started first")
        with contextlib.ExitStack() as stack:
            start: dict[str, Callable[[], Any]] = {"echo": EchoServer,
                                                   "kvd": lambda: Daemon(NUM_BLOCKS)}
            servers = {kind: stack.enter_context(start[kind]())
                       for kind in (first, "kvd" if first == "echo" else "echo")}
            trials.append({"started_first": first,
                           **free_running(servers["kvd"], servers["echo"], 1, num_rounds, 0)})
    return trials


def cpu_per_request(daemon: Daemon, echo: EchoServer, num_requests: int) -> dict[str, Any]:
    """CPU µs per batch-1 lookup + release pair on the server and in this process."""
    hashes = digests(10**9, 1)
    totals = {name: [0, 0] for name in ("kvd", "echo")}
    sampler = Sampler({"kvd": daemon.proc.pid, "echo": echo.proc.pid})
    with daemon.connect() as client:
        block_ids = client.alloc(1)
        client.seal(block_ids, hashes)
        client.release(block_ids)
        echo_client = EchoClient(echo.socket_path)
        try:
            sides = (("kvd", lambda: client.release(client.lookup(hashes)), daemon.proc.pid),
                     ("echo", lambda: (echo_client.call("lookup", {"hashes": hashes}),
                                       echo_client.call("release", {"block_ids": block_ids})),
                      echo.proc.pid))
            for _ in range(max(num_requests // CHUNK, 1)):
                for name, call, pid in sides:
                    server, mine = cpu_ns(pid), time.process_time_ns()
                    for _ in range(CHUNK):
                        call()
                    totals[name][0] += cpu_ns(pid) - server
                    totals[name][1] += time.process_time_ns() - mine
                sampler.sample()
        finally:
            echo_client.close()
    num_pairs = max(num_requests // CHUNK, 1) * CHUNK
    rows: dict[str, Any] = {name: {"server_us": server / num_pairs / 1e3,
                                   "client_us": mine / num_pairs / 1e3}
                            for name, (server, mine) in totals.items()}
    rows["ratio"] = ((rows["kvd"]["server_us"] + rows["kvd"]["client_us"])
                     / (rows["echo"]["server_us"] + rows["echo"]["client_us"]))
    return {**rows, **sampler.shares()}


def run(quick: bool, num_trials: int) -> dict[str, Any]:
    results: dict[str, Any] = {"free_running": {}}
    with EchoServer() as echo, Daemon(NUM_BLOCKS) as daemon:
        next_key = 1 << 40  # (the trials' daemons are fresh: their keys start at 0)
        for batch_size in BATCH_SIZES:
            num_rounds = rounds_for(batch_size, quick)
            progress(f"free-running, batch {batch_size}, {num_rounds} rounds")
            results["free_running"][str(batch_size)] = free_running(daemon, echo, batch_size,
                                                                    num_rounds, next_key)
            next_key += keys_used(batch_size, num_rounds)
        progress("CPU per request pair")
        results["cpu_per_request"] = cpu_per_request(daemon, echo, 200 if quick else 4000)
    results["trials"] = placement_trials(num_trials, rounds_for(1, quick) // 3)
    return results


def _shares(row: dict[str, Any]) -> str:
    shares = row["on_client_cpu"]
    return f"{shares['kvd']:.0%} / {shares['echo']:.0%}" + ("" if row["placed_alike"]
                                                            else " (unlike)")


def markdown(results: dict[str, Any]) -> str:
    beside = "on the client's CPU: kvd / echo"
    rows = [[f"batch {batch}", f"{row['kvd_p50_us']:.1f}", f"{row['echo_p50_us']:.1f}",
             f"{row['p50_ratio']:.2f}x", _shares(row)]
            for batch, row in results["free_running"].items()]
    rows += [[f"trial {i}, batch 1, {row['started_first']} started first",
              f"{row['kvd_p50_us']:.1f}", f"{row['echo_p50_us']:.1f}", f"{row['p50_ratio']:.2f}x",
              _shares(row)] for i, row in enumerate(results["trials"], 1)]
    cpu = results["cpu_per_request"]
    cpu_table = markdown_table(
        ["", "server CPU µs", "client CPU µs"],
        [[name, f"{cpu[name]['server_us']:.1f}", f"{cpu[name]['client_us']:.1f}"]
         for name in ("kvd", "echo")])
    return ("## Placement, free-running (bench/diagnostics/placement.py)\n\n"
            + markdown_table(["row", "kvd p50 µs (slowest op)", "echo p50 µs (slowest op)",
                              "p50 / floor (worst op)", beside], rows)
            + f"\nCPU per batch-1 lookup + release pair, kvd / floor {cpu['ratio']:.2f}x "
            f"(both sides; {beside}: {_shares(cpu)}):\n\n" + cpu_table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (few rounds)")
    parser.add_argument("--trials", type=int, default=NUM_TRIALS, help="placement trials")
    parser.add_argument("--out", type=Path, help="write placement.json here")
    args = parser.parse_args(argv)
    results = run(args.quick, args.trials)
    if args.out:
        write_json(args.out, "placement", results)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
