"""One kvd.Client shared by threads against a Client per thread, side by side in one run.

Each thread runs the control plane's round -- alloc B, seal them under fresh hashes, release,
look them up, release: five requests -- as fast as it can, for PERIOD_S, against one daemon.
The arms take turns period by period, in an order reversed every round: NUM_THREADS threads
sharing one Client (their requests in flight on its connection together) and NUM_THREADS
threads with a Client each (a connection each). The goal is shared >= 0.8x own at batch 1 and 16.

Placement is held fixed: the daemon on one CPU, this process (so all its threads) on another
(bench/common.py's `pinned`). Free-running, where the scheduler happens to put the threads moves
the figure more than the client does; threads of one process on one CPU is where a shared
client's hand-offs between threads cost most, and what a server whose other threads keep its
cores busy meets. Reported per arm: the median requests/s, and this process's CPU time and
context switches per request (which a busy host disturbs far less than a rate); the ratio
shared / own is the median over rounds of the ratio within a round, with its smallest and
largest.

`--base REV` adds the threads sharing one Client of kvd/client.py as committed at REV (loaded
with `git show` as a module of its own, on this tree's protocol) as a third arm, and the
single-threaded round trip of both, one thread, alternating chunks of rounds: what thread safety
costs a lone caller.

    python -m bench.client_threads [--quick] [--out DIR] [--base REV]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.common import ROOT, Daemon, markdown_table, pinned, progress, write_json

NUM_THREADS = 4
BATCHES = (1, 16)
PERIOD_S = 0.5  # long enough that starting and stopping threads is noise
NUM_BLOCKS = 4096
REQUESTS_PER_ROUND = 5


def run_round(client: Any, batch: int, first_hash: int) -> None:
    """The control plane's round: alloc → seal → release → lookup → release."""
    block_ids = client.alloc(batch)
    hashes = [number.to_bytes(16, "little") for number in range(first_hash, first_hash + batch)]
    client.seal(block_ids, hashes)
    client.release(block_ids)
    client.release(client.lookup(hashes))


def run_period(clients: list[Any], batch: int, period_s: float,
               first_hash: int) -> dict[str, float]:
    """NUM_THREADS threads, thread i on clients[i % len(clients)], running rounds for
    `period_s`: all their requests per second, and this process's CPU µs and context switches
    per request."""
    stop = threading.Event()
    start = threading.Barrier(NUM_THREADS + 1)
    rounds = [0] * NUM_THREADS

    def work(index: int) -> None:
        client, next_hash = clients[index % len(clients)], first_hash + index * (1 << 32)
        start.wait()
        while not stop.is_set():
            run_round(client, batch, next_hash)
            next_hash += batch
            rounds[index] += 1

    threads = [threading.Thread(target=work, args=(index,)) for index in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    start.wait()
    began, cpu_began, usage = time.perf_counter(), time.process_time(), switches()
    time.sleep(period_s)
    stop.set()
    for thread in threads:
        thread.join()
    num_requests = sum(rounds) * REQUESTS_PER_ROUND
    return {"requests_per_s": num_requests / (time.perf_counter() - began),
            "cpu_us_per_request": 1e6 * (time.process_time() - cpu_began) / num_requests,
            "switches_per_request": (switches() - usage) / num_requests}


def switches() -> int:
    """This process's context switches so far, voluntary and not (every thread's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def measure_sharing(daemon: Daemon, batch: int, num_rounds: int,
                    base: ModuleType | None = None) -> dict[str, Any]:
    arms = {"shared": [daemon.connect()], "own": [daemon.connect() for _ in range(NUM_THREADS)]}
    if base is not None:
        arms["shared_base"] = [base.Client(daemon.socket_path, reconnect_timeout_s=0)]
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    order = list(arms)
    try:
        for round_index in range(num_rounds):
            for arm_index, name in enumerate(order):
                first_hash = (round_index << 48) + (arm_index << 44)
                samples[name].append(run_period(arms[name], batch, PERIOD_S, first_hash))
            order.reverse()  # no arm always runs right after the same other
    finally:
        for clients in arms.values():
            for client in clients:
                client.close()
    result: dict[str, Any] = {"batch": batch}
    for name, runs in samples.items():
        result[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        ratios = [run["requests_per_s"] / own["requests_per_s"]
                  for run, own in zip(runs, samples["own"])]
        result[name]["x_own"] = statistics.median(ratios)
        result[name]["x_own_range"] = (min(ratios), max(ratios))
    return result


def client_module_at(revision: str, directory: str) -> ModuleType:
    """kvd/client.py as committed at `revision`, imported as module kvd_base_client."""
    source = subprocess.run(["git", "show", f"{revision}:kvd/client.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(directory) / "kvd_base_client.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("kvd_base_client", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvd_base_client"] = module
    spec.loader.exec_module(module)
    return module


def measure_lone_caller(daemon: Daemon, base: ModuleType, num_chunks: int) -> dict[str, Any]:
    """One thread's round trip (µs per request, batch 1): base's Client against this tree's."""
    import kvd
    clients = {"base": base.Client(daemon.socket_path, reconnect_timeout_s=0),
               "new": kvd.Client(daemon.socket_path, reconnect_timeout_s=0)}
    samples: dict[str, list[float]] = {name: [] for name in clients}
    rounds_per_chunk, next_hash = 100, 1 << 62
    try:
        for _ in range(num_chunks):
            for name, client in clients.items():
                started = time.perf_counter_ns()
                for _ in range(rounds_per_chunk):
                    run_round(client, 1, next_hash)
                    next_hash += 1
                elapsed_ns = time.perf_counter_ns() - started
                samples[name].append(elapsed_ns / rounds_per_chunk / REQUESTS_PER_ROUND / 1e3)
    finally:
        for client in clients.values():
            client.close()
    return {"base_us": statistics.median(samples["base"]),
            "new_us": statistics.median(samples["new"]),
            "new_x_base": statistics.median(new / old for new, old in zip(samples["new"],
                                                                          samples["base"]))}


def run_bench(quick: bool, out: Path, base: str | None = None) -> str:
    """`python -m bench` calls this; returns markdown."""
    results: dict[str, Any] = {"num_threads": NUM_THREADS, "period_s": PERIOD_S}
    cpus = sorted(os.sched_getaffinity(0))
    with Daemon(NUM_BLOCKS) as daemon, tempfile.TemporaryDirectory() as directory, \
            pinned({daemon.proc.pid: cpus[0], os.getpid(): cpus[-1]}):
        results["cpus"] = {"daemon": cpus[0], "clients": cpus[-1]}
        base_module = None if base is None else client_module_at(base, directory)
        results["sharing"] = []
        for batch in BATCHES:
            progress(f"client_threads: batch {batch}")
            results["sharing"].append(measure_sharing(daemon, batch, 3 if quick else 15,
                                                      base_module))
        if base_module is not None:
            progress(f"client_threads: one thread, {base} against this tree")
            results["lone_caller"] = measure_lone_caller(daemon, base_module,
                                                         3 if quick else 60)
            results["lone_caller"]["base"] = base
    write_json(out, "client_threads", results)
    arms = {"shared": "shared", "own": "a Client each"}
    if base is not None:
        arms["shared_base"] = f"shared, {base}'s Client"
    rows = []
    for row in results["sharing"]:
        for name, label in arms.items():
            arm = row[name]
            low, high = arm["x_own_range"]
            rows.append([row["batch"], label, f"{arm['requests_per_s']:,.0f}",
                         f"{arm['x_own']:.2f}x ({low:.2f}–{high:.2f})",
                         f"{arm['cpu_us_per_request']:.1f}", f"{arm['switches_per_request']:.2f}"])
    text = ("## bench/client_threads.py\n\n"
            f"{NUM_THREADS} threads sharing one `kvd.Client` against {NUM_THREADS} threads with "
            "a Client each, alternating periods of the control plane's round (5 requests); the "
            f"daemon pinned to CPU {cpus[0]}, the threads to CPU {cpus[-1]}.\n\n"
            + markdown_table(
                ["batch", "threads on", "requests/s", "÷ a Client each (goal ≥ 0.8; min–max)",
                 "client CPU µs / request", "context switches / request"], rows))
    if base is not None:
        lone = results["lone_caller"]
        text += ("\nOne thread, batch 1, µs per request: "
                 f"{base}'s Client {lone['base_us']:.2f}, this tree's {lone['new_us']:.2f} "
                 f"({lone['new_x_base']:.3f}x, median of paired chunks).\n")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--base", help="also time a lone caller on kvd/client.py at this revision")
    args = parser.parse_args(argv)
    print(run_bench(args.quick, args.out, args.base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
