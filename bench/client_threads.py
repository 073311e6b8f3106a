"""One kvd.Client shared by threads against a Client per thread, side by side in one run.

Each thread runs the control plane's round -- alloc B, seal them under fresh hashes, release,
look them up, release: five requests -- as fast as it can, for PERIOD_S, against one daemon.
The two arms alternate period by period: NUM_THREADS threads sharing one Client (their requests
in flight on its connection together) and NUM_THREADS threads with a Client each (a connection
each). The figure is the median over periods of (shared requests/s) / (own requests/s); the goal
is >= 0.8 at batch 1 and 16.

`--base REV` adds the single-threaded round trip of kvd/client.py as committed at REV (loaded
with `git show` as a module of its own, on this tree's protocol) next to this tree's, one
thread, alternating chunks of rounds: what thread safety costs a lone caller.

    python -m bench.client_threads [--quick] [--out DIR] [--base REV]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.common import ROOT, Daemon, markdown_table, progress, write_json

NUM_THREADS = 4
BATCHES = (1, 16)
PERIOD_S = 1.0  # long enough that starting and stopping threads is noise
NUM_BLOCKS = 4096
REQUESTS_PER_ROUND = 5


def run_round(client: Any, batch: int, first_hash: int) -> None:
    """The control plane's round: alloc → seal → release → lookup → release."""
    block_ids = client.alloc(batch)
    hashes = [number.to_bytes(16, "little") for number in range(first_hash, first_hash + batch)]
    client.seal(block_ids, hashes)
    client.release(block_ids)
    client.release(client.lookup(hashes))


def requests_per_s(clients: list[Any], batch: int, period_s: float, first_hash: int) -> float:
    """NUM_THREADS threads, thread i on clients[i % len(clients)], running rounds for
    `period_s`; all their requests per second."""
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
    began = time.perf_counter()
    time.sleep(period_s)
    stop.set()
    for thread in threads:
        thread.join()
    return sum(rounds) * REQUESTS_PER_ROUND / (time.perf_counter() - began)


def measure_sharing(daemon: Daemon, batch: int, num_periods: int) -> dict[str, Any]:
    shared = daemon.connect()
    own = [daemon.connect() for _ in range(NUM_THREADS)]
    samples: dict[str, list[float]] = {"shared": [], "own": []}
    try:
        for period in range(num_periods):
            first_hash = period << 48
            samples["shared"].append(requests_per_s([shared], batch, PERIOD_S, first_hash))
            samples["own"].append(requests_per_s(own, batch, PERIOD_S, first_hash + (1 << 47)))
    finally:
        for client in (shared, *own):
            client.close()
    return {"batch": batch, "shared_requests_per_s": statistics.median(samples["shared"]),
            "own_requests_per_s": statistics.median(samples["own"]),
            "shared_x_own": statistics.median(a / b for a, b in zip(samples["shared"],
                                                                    samples["own"]))}


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
    with Daemon(NUM_BLOCKS) as daemon:
        results["sharing"] = []
        for batch in BATCHES:
            progress(f"client_threads: batch {batch}")
            results["sharing"].append(measure_sharing(daemon, batch, 2 if quick else 9))
        if base is not None:
            progress(f"client_threads: one thread, {base} against this tree")
            with tempfile.TemporaryDirectory() as directory:
                results["lone_caller"] = measure_lone_caller(
                    daemon, client_module_at(base, directory), 3 if quick else 60)
                results["lone_caller"]["base"] = base
    write_json(out, "client_threads", results)
    text = ("## bench/client_threads.py\n\n"
            f"{NUM_THREADS} threads sharing one `kvd.Client` against {NUM_THREADS} threads with "
            "a Client each, alternating periods of the control plane's round (5 requests).\n\n"
            + markdown_table(
                ["batch", "shared: requests/s", "own: requests/s", "shared ÷ own (goal ≥ 0.8)"],
                [[row["batch"], f"{row['shared_requests_per_s']:,.0f}",
                  f"{row['own_requests_per_s']:,.0f}", f"{row['shared_x_own']:.2f}x"]
                 for row in results["sharing"]]))
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
