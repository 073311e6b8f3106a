"""Why kvd's daemon runs a selectors loop: the same echo server on selectors and on asyncio.

Both servers answer the echo floor's frames (bench/common.py), one on a plain `selectors` loop,
one on an asyncio Protocol (not streams); one client alternates between them in chunks of CHUNK
batch-1 requests, and both sit alike in each of bench/common.py's placements. Reported: the
round trip's p50 and p99 and the server's CPU per request. Not part of `python -m bench`: it
measures a design choice, not kvd.

    python -m bench.diagnostics.event_loop [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from bench.common import (EchoClient, EchoServer, cpu_ns, markdown_table, percentiles, pinned,
                          placements)

CHUNK = 50
LOOPS = ("selectors", "asyncio")


def measure(servers: dict[str, EchoServer], num_requests: int) -> dict[str, Any]:
    clients = {loop: EchoClient(server.socket_path) for loop, server in servers.items()}
    samples: dict[str, list[int]] = {loop: [] for loop in servers}
    cpu = dict.fromkeys(servers, 0)
    try:
        for _ in range(max(num_requests // CHUNK, 1)):
            for loop, client in clients.items():
                before = cpu_ns(servers[loop].proc.pid)
                for _ in range(CHUNK):
                    start = time.perf_counter_ns()
                    client.call("alloc", {"num_blocks": 1})
                    samples[loop].append(time.perf_counter_ns() - start)
                cpu[loop] += cpu_ns(servers[loop].proc.pid) - before
    finally:
        for client in clients.values():
            client.close()
    return {loop: {**percentiles(samples[loop]),
                   "server_cpu_us": cpu[loop] / len(samples[loop]) / 1e3} for loop in samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (few requests)")
    args = parser.parse_args(argv)
    rows = []
    with EchoServer("selectors") as plain, EchoServer("asyncio") as on_asyncio:
        servers = {"selectors": plain, "asyncio": on_asyncio}
        for placement, cpu_of in placements([os.getpid()], [s.proc.pid for s in servers.values()]
                                            ).items():
            with pinned(cpu_of):
                result = measure(servers, 200 if args.quick else 4000)
            rows += [[placement, loop, f"{row['p50_us']:.1f}", f"{row['p99_us']:.1f}",
                      f"{row['server_cpu_us']:.1f}"] for loop, row in result.items()]
    print(markdown_table(["placement", "echo server on", "p50 µs", "p99 µs",
                          "server CPU µs / request"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
