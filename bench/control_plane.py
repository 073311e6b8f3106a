"""Control plane: round trips of alloc, seal, release and lookup through a real daemon vs the floor.

Each round at batch size B: alloc(B) → seal(B ids, B fresh hashes) → release (now CACHED) →
lookup(B hashes) (pinned again) → release. Every kvd call is followed by the same request body
sent to the echo floor (bench/common.py), so both see the same machine noise and each server has
been idle for exactly one call when it is asked. The pool is large enough that nothing is
evicted: this measures the request path (eviction is bench/pool.py's). Daemons: `kvd start
--no-journal` and journaled (seals committed to SQLite before the reply).

Placement is held equal: client, echo server and daemon are pinned (`os.sched_setaffinity`)
all to one CPU, then the client to one CPU and both servers to another. Free-running on a small
VM the scheduler seats one server beside its client and the other across vCPUs, not alike for
the two, and the ratio then compares placements rather than kvd with its floor
(`python -m bench.diagnostics.placement` measures that).

Goals (issue 5): p50 <= 1.3x the floor at batch 1; >= 500,000 block-ops/s at batch 256 (the
slowest op, in the slower placement).

    python -m bench.control_plane [--quick] [--out DIR]
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (Daemon, EchoClient, EchoServer, bench_main, digests, markdown_table,
                          percentiles, pinned, placements, progress, pyplot, report, save_plot)

BATCH_SIZES = (1, 16, 256)
OPS = ("alloc", "seal", "release", "lookup")
# Nothing is evicted: each placement's rounds leave ~140k blocks cached, and two placements
# share a daemon (512 B blocks: 256 MiB of /dev/shm).
NUM_BLOCKS = 1 << 19
NUM_WARM_UP_ROUNDS = 5
GOAL_RATIO_BATCH1 = 1.3
GOAL_BLOCK_OPS_PER_S = 500_000


def interleaved_round(client: Any, echo: EchoClient, hashes: list[bytes],
                      kvd_samples: dict[str, list[int]],
                      echo_samples: dict[str, list[int]]) -> None:
    """alloc, seal, release, lookup, release through kvd, each call followed by the same request
    body through the echo floor."""
    clock = time.perf_counter_ns

    def step(op: str, args: dict[str, Any], call: Callable[[], Any]) -> Any:
        start = clock()
        result = call()
        kvd_samples[op].append(clock() - start)
        start = clock()
        echo.call(op, args)
        echo_samples[op].append(clock() - start)
        return result

    block_ids = step("alloc", {"num_blocks": len(hashes)}, lambda: client.alloc(len(hashes)))
    step("seal", {"block_ids": block_ids, "hashes": hashes},
         lambda: client.seal(block_ids, hashes))
    step("release", {"block_ids": block_ids}, lambda: client.release(block_ids))
    found = step("lookup", {"hashes": hashes}, lambda: client.lookup(hashes))
    step("release", {"block_ids": found}, lambda: client.release(found))
    if found != block_ids:
        raise RuntimeError(f"lookup found {len(found)} of {len(hashes)} blocks just sealed")


def measure(daemon: Daemon, echo: EchoServer, batch_size: int, num_rounds: int, first_key: int,
            after_round: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Alternate kvd and echo calls for `num_rounds` rounds (after a few dropped warm-up ones);
    p50/p99 per op for both, their ratio and kvd's block-ops/s. `after_round(number)` runs
    untimed after each kept round (bench/diagnostics/placement.py samples placement there)."""
    kvd_samples: dict[str, list[int]] = {op: [] for op in OPS}
    echo_samples: dict[str, list[int]] = {op: [] for op in OPS}
    with daemon.connect() as client:
        echo_client = EchoClient(echo.socket_path)
        try:
            for number in range(-NUM_WARM_UP_ROUNDS, num_rounds):
                hashes = digests(first_key + (number + NUM_WARM_UP_ROUNDS) * batch_size,
                                 batch_size)
                if number < 0:
                    interleaved_round(client, echo_client, hashes, {op: [] for op in OPS},
                                      {op: [] for op in OPS})
                    continue
                interleaved_round(client, echo_client, hashes, kvd_samples, echo_samples)
                if after_round is not None:
                    after_round(number)
        finally:
            echo_client.close()
    row: dict[str, Any] = {}
    for op in OPS:
        mine, floor = percentiles(kvd_samples[op]), percentiles(echo_samples[op])
        row[op] = {"kvd": mine, "echo": floor, "p50_ratio": mine["p50_us"] / floor["p50_us"],
                   "block_ops_per_s": batch_size / (mine["p50_us"] / 1e6)}
    return row


def keys_used(batch_size: int, num_rounds: int) -> int:
    """How many fresh hashes `measure` seals (the next one's first key is this far on)."""
    return (num_rounds + NUM_WARM_UP_ROUNDS) * batch_size


def rounds_for(batch_size: int, quick: bool) -> int:
    base = {1: 3000, 16: 2000, 256: 400}[batch_size]
    return base // 20 if quick else base


def run(quick: bool) -> dict[str, Any]:
    """Every daemon mode, placement and batch size; `rows[mode][placement][batch]`."""
    results: dict[str, Any] = {"num_blocks": NUM_BLOCKS, "goal_p50_ratio_batch1": GOAL_RATIO_BATCH1,
                               "goal_block_ops_per_s_batch256": GOAL_BLOCK_OPS_PER_S, "rows": {},
                               "evictions": {}}
    with EchoServer() as echo:
        for mode, journal in (("no-journal", False), ("journal", True)):
            with Daemon(NUM_BLOCKS, journal=journal) as daemon:
                next_key = 0
                chosen = placements([os.getpid()], (echo.proc.pid, daemon.proc.pid))
                for placement, cpu_of in chosen.items():
                    rows = results["rows"].setdefault(mode, {}).setdefault(placement, {})
                    for batch_size in BATCH_SIZES:
                        num_rounds = rounds_for(batch_size, quick)
                        progress(f"control plane: {mode}, {placement}, batch {batch_size}")
                        with pinned(cpu_of):
                            rows[str(batch_size)] = measure(daemon, echo, batch_size,
                                                            num_rounds, next_key)
                        next_key += keys_used(batch_size, num_rounds)
                with daemon.connect() as client:
                    results["evictions"][mode] = client.stats()["evictions"]
    return {**results, "goals": goals(results)}


def slowest(row: dict[str, Any], field: str) -> float:
    """The worst op of a row: its largest p50 ratio, or its fewest block-ops/s."""
    values = [row[op][field] for op in OPS]
    return max(values) if field == "p50_ratio" else min(values)


def goals(results: dict[str, Any]) -> dict[str, float]:
    """The goals' figures, no journal: the worst batch-1 p50 ratio and the fewest batch-256
    block-ops/s of any op in any placement."""
    by_placement = results["rows"]["no-journal"].values()
    return {"p50_ratio_batch1": max(slowest(rows["1"], "p50_ratio") for rows in by_placement),
            "block_ops_per_s_batch256": min(slowest(rows["256"], "block_ops_per_s")
                                            for rows in by_placement)}


def markdown(results: dict[str, Any]) -> str:
    rows = [[mode, placement, batch, op, f"{row[op]['kvd']['p50_us']:.1f}",
             f"{row[op]['kvd']['p99_us']:.1f}", f"{row[op]['echo']['p50_us']:.1f}",
             f"{row[op]['echo']['p99_us']:.1f}", f"{row[op]['p50_ratio']:.2f}x",
             f"{row[op]['block_ops_per_s']:,.0f}"]
            for mode, by_placement in results["rows"].items()
            for placement, by_batch in by_placement.items()
            for batch, row in by_batch.items() for op in OPS]
    table = markdown_table(["daemon", "placement", "batch", "op", "kvd p50 µs", "kvd p99 µs",
                            "echo p50 µs", "echo p99 µs", "p50 / floor", "block-ops/s (p50)"],
                           rows)
    met = goals(results)
    ratio, rate = met["p50_ratio_batch1"], met["block_ops_per_s_batch256"]
    summary = (f"Goals (no journal, the worse placement): p50 at batch 1 is at most "
               f"**{ratio:.2f}x** the echo floor (goal <= {GOAL_RATIO_BATCH1}x: "
               f"{'met' if ratio <= GOAL_RATIO_BATCH1 else 'NOT met'}); the slowest op at batch "
               f"256 does **{rate:,.0f}** block-ops/s (goal >= {GOAL_BLOCK_OPS_PER_S:,}: "
               f"{'met' if rate >= GOAL_BLOCK_OPS_PER_S else 'NOT met'}). Placements: *one CPU* "
               "pins client, echo server and daemon to one CPU; *client apart* pins the client "
               "to one CPU and both servers to another. Pool of "
               f"{results['num_blocks']:,} blocks; evictions: "
               + ", ".join(f"{count:,} ({mode})" for mode, count in results["evictions"].items())
               + ".")
    return ("## Control plane: round trip vs a msgpack echo server (bench/control_plane.py)\n\n"
            + table + "\n" + summary + "\n")


def plot(results: dict[str, Any], out: Path) -> Path:
    plt = pyplot()
    figure, (ratios, rates) = plt.subplots(1, 2, figsize=(10, 4))
    by_placement = results["rows"]["no-journal"]
    width = 0.8 / len(by_placement)
    for i, (placement, by_batch) in enumerate(by_placement.items()):
        x = [j + i * width for j in range(len(BATCH_SIZES))]
        ratios.bar(x, [slowest(by_batch[str(b)], "p50_ratio") for b in BATCH_SIZES], width,
                   label=placement)
    ratios.axhline(1.0, color="black", linewidth=0.8)
    ratios.axhline(GOAL_RATIO_BATCH1, color="red", linestyle="--", linewidth=0.8,
                   label=f"goal {GOAL_RATIO_BATCH1}x (batch 1)")
    ratios.set(xticks=[j + 0.4 - width / 2 for j in range(len(BATCH_SIZES))],
               xticklabels=[str(b) for b in BATCH_SIZES], xlabel="batch size",
               ylabel="kvd p50 / echo p50 (slowest op)",
               title="Round trip vs the echo floor (no journal)")
    ratios.legend(fontsize=8, loc="upper left")
    for mode, by_placement in results["rows"].items():
        for placement, by_batch in by_placement.items():
            rates.plot(BATCH_SIZES, [slowest(by_batch[str(b)], "block_ops_per_s")
                                     for b in BATCH_SIZES], marker="o",
                       label=f"{mode}, {placement}")
    rates.axhline(GOAL_BLOCK_OPS_PER_S, color="red", linestyle="--", linewidth=0.8, label="goal")
    rates.set(xscale="log", yscale="log", xlabel="batch size",
              ylabel="block-ops/s (p50, slowest op)", title="Throughput per connection")
    rates.legend(fontsize=7)
    return save_plot(figure, out, "control_plane")


def run_bench(quick: bool, out: Path) -> str:
    """Measure, write JSON and PNG, return the markdown section."""
    return report(out, "control_plane", run(quick), markdown, plot)


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run_bench))
