"""Scaling with workers: aggregate requests/s of N client processes, kvd vs the echo floor.

N worker processes each open their own session and repeat the control plane's batch-1 cycle
(alloc, seal, release, lookup, release) as fast as they can for a fixed time; the echo floor
(bench/common.py) gets the same N clients sending the same request bodies. The daemon is one
thread, as is the echo server, so both saturate one core: the ratio says how much of a core kvd
spends per request beyond the floor's framing and syscalls. The goal (issue 5) is >= 0.8x the
floor's throughput at 8 workers on a 16-core host (`--workers 1,2,4,8,16`); the default goes up to
the host's core count (at least 4).

Placement is held equal: either server is pinned to the last CPU this process may use and the
workers to the others (given two CPUs), so kvd and the floor get a core of their own, as on the
16-core host, and the same one. Each point also reads the server's CPU time and reports CPU per
request: a server running flat out serves 1 / (its CPU per request), so once workers outnumber
what either server can answer, kvd / floor tends to the floor's CPU per request over kvd's.

Each point takes turns: kvd and the floor back to back, three times (which goes first
alternating), and reports the medians; a single pair of runs swings with the VM.

    python -m bench.scaling [--quick] [--workers 1,2,4] [--duration-s 1] [--turns 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import (ROOT, Daemon, EchoClient, EchoServer, cpu_ns, markdown_table, pinned,
                          progress, pyplot, report, save_plot)

# Every kvd cycle leaves one more block cached (its keys are fresh), so the pool must outlast
# the run for nothing to be evicted (eviction is bench/pool.py's): 2-core runs cache ~70k
# blocks, and a 16-core host may serve ~10x the requests. Each point reports the evictions it
# saw anyway. (512 B blocks: 128 MiB of /dev/shm on 2 cores, 1 GiB on 16.)
NUM_BLOCKS = max(1 << 18, (os.cpu_count() or 1) << 17)
GOAL_RATIO_AT_8 = 0.8
KEYS_PER_WORKER = 1 << 40  # disjoint hash ranges per worker and run


def default_worker_counts() -> list[int]:
    limit = max(4, os.cpu_count() or 1)
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def kvd_cycle(client: Any, key: bytes) -> None:
    block_ids = client.alloc(1)
    client.seal(block_ids, [key])
    client.release(block_ids)
    client.release(client.lookup([key]))


def echo_cycle(echo: EchoClient, key: bytes, block_ids: list[int]) -> None:
    echo.call("alloc", {"num_blocks": 1})
    echo.call("seal", {"block_ids": block_ids, "hashes": [key]})
    echo.call("release", {"block_ids": block_ids})
    echo.call("lookup", {"hashes": [key]})
    echo.call("release", {"block_ids": block_ids})


def server_and_client_cpus() -> tuple[int | None, set[int]]:
    """The CPU either server is pinned to (None: only one CPU, nothing pinned) and the workers'."""
    cpus = sorted(os.sched_getaffinity(os.getpid()))
    if len(cpus) < 2:
        return None, set(cpus)
    return cpus[-1], set(cpus[:-1])


def worker(kind: str, socket_path: str, first_key: int, duration_s: float,
           start: Any, results: Any) -> None:
    """Run cycles until `duration_s` after `start` is set; put (requests, seconds) on `results`."""
    os.sched_setaffinity(0, server_and_client_cpus()[1])
    client: Any
    if kind == "kvd":
        import kvd
        client = kvd.connect(socket_path, reconnect_timeout_s=0)
        cycle = lambda key: kvd_cycle(client, key)
    else:
        client = EchoClient(socket_path)
        cycle = lambda key: echo_cycle(client, key, [first_key % 65_536])
    keys = (key.to_bytes(16, "little") for key in itertools.count(first_key))
    start.wait()
    began = time.perf_counter()
    deadline = began + duration_s
    num_cycles = 0
    while time.perf_counter() < deadline:
        cycle(next(keys))
        num_cycles += 1
    results.put((5 * num_cycles, time.perf_counter() - began))
    client.close()


def measure(kind: str, socket_path: str, server_pid: int, num_workers: int, duration_s: float,
            run_index: int) -> dict[str, float]:
    """Aggregate requests/s of `num_workers` processes, and the server's CPU per request."""
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    procs = [context.Process(target=worker, args=(
        kind, socket_path, (run_index * 64 + i) * KEYS_PER_WORKER, duration_s, start, results))
        for i in range(num_workers)]
    for proc in procs:
        proc.start()
    time.sleep(0.2 + 0.05 * num_workers)  # let every worker connect before the clock starts
    server_before, began = cpu_ns(server_pid), time.perf_counter()
    start.set()
    shares = [results.get(timeout=60 + duration_s) for _ in procs]
    server_ns, wall_s = cpu_ns(server_pid) - server_before, time.perf_counter() - began
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        raise RuntimeError(f"a {kind} worker failed")
    num_requests = sum(count for count, _ in shares)
    return {"requests_per_s": num_requests / max(seconds for _, seconds in shares),
            "server_us_per_request": server_ns / 1e3 / num_requests,
            "server_busy": server_ns / 1e9 / wall_s}


def run(worker_counts: list[int], duration_s: float, num_turns: int) -> dict[str, Any]:
    """Each point is `num_turns` turns of kvd and the floor back to back (which goes first
    alternates), `duration_s` each: a VM's drift within the point then moves both sides of a
    turn alike, and the medians over turns are what is reported."""
    results: dict[str, Any] = {"cpus": os.cpu_count(), "num_blocks": NUM_BLOCKS,
                               "duration_s": duration_s,
                               "turns": num_turns, "goal_ratio_at_8_workers": GOAL_RATIO_AT_8,
                               "rows": []}
    run_indices = itertools.count()
    server_cpu = results["server_cpu"] = server_and_client_cpus()[0]
    with EchoServer() as echo, Daemon(NUM_BLOCKS) as daemon, daemon.connect() as watcher, \
            pinned({} if server_cpu is None else {daemon.proc.pid: server_cpu,
                                                  echo.proc.pid: server_cpu}):
        servers = {"kvd": (daemon.socket_path, daemon.proc.pid),
                   "echo": (echo.socket_path, echo.proc.pid)}
        for num_workers in worker_counts:
            evictions_before = watcher.stats()["evictions"]
            progress(f"scaling: {num_workers} workers, {num_turns} turns of {duration_s} s each "
                     "for kvd and echo")
            turns: list[dict[str, dict[str, float]]] = []
            for turn in range(num_turns):
                order = ("kvd", "echo") if turn % 2 == 0 else ("echo", "kvd")
                turns.append({kind: measure(kind, *servers[kind], num_workers, duration_s,
                                            next(run_indices)) for kind in order})
            ratios = [t["kvd"]["requests_per_s"] / t["echo"]["requests_per_s"] for t in turns]
            # What the ratio tends to once both servers are saturated, each on a core of its
            # own (a host with cores for every worker): their CPU per request.
            saturated = [t["echo"]["server_us_per_request"] / t["kvd"]["server_us_per_request"]
                         for t in turns]
            results["rows"].append({
                "workers": num_workers,
                **{kind: {field: statistics.median([t[kind][field] for t in turns])
                          for field in turns[0][kind]} for kind in ("kvd", "echo")},
                "ratio": statistics.median(ratios), "turn_ratios": ratios,
                "saturated_ratio": statistics.median(saturated), "turn_saturated_ratios": saturated,
                "evictions": watcher.stats()["evictions"] - evictions_before})
    return results


def markdown(results: dict[str, Any]) -> str:
    def spread(values: list[float]) -> str:
        return f"{min(values):.2f}–{max(values):.2f}"
    rows = [[r["workers"], f"{r['kvd']['requests_per_s']:,.0f}",
             f"{r['echo']['requests_per_s']:,.0f}",
             f"{r['ratio']:.2f}x ({spread(r['turn_ratios'])})",
             f"{r['kvd']['server_us_per_request']:.1f}",
             f"{r['echo']['server_us_per_request']:.1f}",
             f"{r['kvd']['server_busy']:.0%} / {r['echo']['server_busy']:.0%}",
             f"{r['saturated_ratio']:.2f}x ({spread(r['turn_saturated_ratios'])})"]
            for r in results["rows"]]
    table = markdown_table(["workers", "kvd requests/s", "echo requests/s",
                            "kvd / floor (turns)", "kvd server CPU µs/request",
                            "echo server CPU µs/request", "servers busy (kvd / echo)",
                            "floor CPU / kvd CPU (turns)"], rows)
    note = (f"{results['cpus']} CPUs; batch-1 requests (alloc, seal, release, lookup, release); "
            f"each point {results['turns']} turn{'s' if results['turns'] != 1 else ''} of kvd "
            "and the floor back to back, "
            f"{results['duration_s']} s each, medians over the turns (the ratios' range in "
            "parentheses). On a 16-core host the goal is >= "
            f"{GOAL_RATIO_AT_8}x the floor at 8 workers (`python -m bench.scaling --workers "
            "1,2,4,8,16`). "
            + ("Nothing pinned (one CPU). " if results["server_cpu"] is None else
               f"Either server pinned to CPU {results['server_cpu']}, the workers to the other"
               f"{'s' if results['cpus'] > 2 else ''}. ")
            + "Server CPU per request "
            "(from /proc/PID/schedstat over each point) is what bounds a saturated server: "
            "once both run flat out on cores of their own, kvd / floor tends to the last "
            "column, the floor's CPU per request over kvd's. "
            f"Pool of {results['num_blocks']:,} blocks: "
            + (", ".join(f"{r['evictions']:,} evictions at {r['workers']} workers"
                         for r in results["rows"] if r["evictions"])
               + " (those points also measured eviction)"
               if any(r["evictions"] for r in results["rows"]) else "nothing was evicted")
            + ".")
    return ("## Scaling with worker processes (bench/scaling.py)\n\n" + table + "\n" + note + "\n")


def plot(results: dict[str, Any], out: Path) -> Path:
    """Throughput of both servers, and kvd / floor per point with its turns' range."""
    plt = pyplot()
    figure, (throughput, ratios) = plt.subplots(1, 2, figsize=(10, 3.8))
    rows = results["rows"]
    workers = [r["workers"] for r in rows]
    throughput.plot(workers, [r["kvd"]["requests_per_s"] for r in rows], marker="o",
                    label="kvd daemon")
    throughput.plot(workers, [r["echo"]["requests_per_s"] for r in rows], marker="s",
                    label="msgpack echo floor")
    throughput.set(ylabel="aggregate requests/s",
                   title=f"Scaling with workers ({results['cpus']} CPUs)")
    throughput.set_ylim(bottom=0)
    for key, turns_key, label, marker in (
            ("ratio", "turn_ratios", "requests/s, kvd / floor", "o"),
            ("saturated_ratio", "turn_saturated_ratios",
             "server CPU per request, floor / kvd", "s")):
        medians = [r[key] for r in rows]
        spread = [[m - min(r[turns_key]) for m, r in zip(medians, rows)],
                  [max(r[turns_key]) - m for m, r in zip(medians, rows)]]
        ratios.errorbar(workers, medians, yerr=spread, marker=marker, capsize=3, label=label)
    ratios.axhline(results["goal_ratio_at_8_workers"], color="red", linestyle="--",
                   linewidth=0.8, label="goal at 8 workers (16 cores)")
    ratios.axhline(1.0, color="black", linewidth=0.8)
    ratios.set(ylabel="ratio (median, bars: turns' range)", title="kvd against the floor")
    ratios.set_ylim(bottom=0)
    for axes in (throughput, ratios):
        axes.set_xscale("log")
        axes.set_xticks(workers, [str(w) for w in workers])
        axes.minorticks_off()  # (log axes would label 3, 5, 6 ... as 3x10^0)
        axes.set_xlabel("worker processes")
        axes.legend(fontsize=8)
    return save_plot(figure, out, "scaling")


def run_bench(quick: bool, out: Path, worker_counts: list[int] | None = None,
              duration_s: float | None = None, num_turns: int | None = None) -> str:
    counts = worker_counts or ([1, 2] if quick else default_worker_counts())
    results = run(counts, duration_s or (0.3 if quick else 1.0), num_turns or (1 if quick else 3))
    return report(out, "scaling", results, markdown, plot)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (1 and 2 workers)")
    parser.add_argument("--workers", help="comma-separated worker counts (default: 1, 2, 4, ... "
                        "up to the core count)")
    parser.add_argument("--duration-s", type=float, help="seconds per turn (default 1)")
    parser.add_argument("--turns", type=int, help="turns of kvd and the floor per point "
                        "(default 3)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")] if args.workers else None
    print(run_bench(args.quick, args.out, counts, args.duration_s, args.turns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
