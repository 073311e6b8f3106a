"""Journal commit: what one group commit costs, and the journal's share of the metadata work.

In this process, no sockets, scheduler or cold caches in between, so no placement moves it. A
full pool of 65,536 blocks with a Journal (on /dev/shm, where the daemon keeps it by default) is
churned until its log is as long as compaction lets it grow (bench/recovery.py's `churn`: the
steady state of a warm cache, every allocation evicting). Then rounds of alloc → seal → commit →
upkeep (`Journal.tidy`: compaction steps and WAL checkpoints, which the daemon runs once the
replies are out) → release at batch 1, 16 and 256, taking turns slice by slice with:
  * the same rounds on a second full pool without a journal: CPU per round with and without it,
    the journal's own share of a round (its cost);
  * where kvd/server/_journal.c is built, the journaled pool again with its records packed in
    Python (`kvd.server.journal.use_c(False)`): what the C packer saves.
Reported: CPU and wall time of a commit (what a seal's reply waits for) and of its upkeep, the
mean wall time of both (a commit amortised) and the max (the longest stall).

    python -m bench.journal_commit [--quick] [--out DIR]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import OWNER, bench_main, digests, markdown_table, progress, report
from bench.pool import fill_cached
from bench.recovery import churn

BATCH_SIZES = (1, 16, 256)
NUM_BLOCKS = 65_536
NUM_SLICES = 10
# What each round times: CPU ns (seal, commit, tidy, round) and wall ns (commit_wall;
# total_wall: commit and tidy).
ROUND_STEPS = ("seal", "commit", "commit_wall", "tidy", "total_wall", "round")


def _nothing() -> None:
    pass


def time_rounds(pool: Any, journal: Any, batch_size: int, seconds: float, next_key: int,
                samples: dict[str, list[int]]) -> int:
    """alloc → seal → commit → tidy → release rounds for `seconds` (without a journal, commit and
    tidy do nothing, and every clock is read alike); appends to `samples`; returns the next
    unused key."""
    cpu_clock, wall_clock = time.thread_time_ns, time.perf_counter_ns
    commit: Callable[[], None] = journal.commit if journal is not None else _nothing
    tidy: Callable[[], None] = journal.tidy if journal is not None else _nothing
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        keys = digests(next_key, batch_size)
        next_key += batch_size
        started = cpu_clock()
        block_ids = pool.allocate(batch_size, OWNER)
        sealing = cpu_clock()
        pool.seal(block_ids, keys, OWNER)
        sealed, wall = cpu_clock(), wall_clock()
        commit()
        committed, committed_wall = cpu_clock(), wall_clock()
        tidy()
        tidied, tidied_wall = cpu_clock(), wall_clock()
        pool.release(block_ids, OWNER)
        done = cpu_clock()
        for step, value in (("seal", sealed - sealing), ("commit", committed - sealed),
                            ("commit_wall", committed_wall - wall), ("tidy", tidied - committed),
                            ("total_wall", tidied_wall - wall), ("round", done - started)):
            samples[step].append(value)
    return next_key


def summarise(samples: dict[str, list[int]], plain: dict[str, list[int]]) -> dict[str, Any]:
    commit_wall = sorted(samples["commit_wall"])
    journal_round, plain_round = (statistics.mean(rounds["round"]) for rounds in (samples, plain))
    return {"num_commits": len(samples["commit"]),
            "cpu_us": statistics.mean(samples["commit"]) / 1e3,
            "wall_us_p50": commit_wall[len(commit_wall) // 2] / 1e3,
            "wall_us_p99": commit_wall[len(commit_wall) * 99 // 100] / 1e3,
            "tidy_cpu_us": statistics.mean(samples["tidy"]) / 1e3,
            "total_wall_us_mean": statistics.mean(samples["total_wall"]) / 1e3,
            "total_wall_us_max": max(samples["total_wall"]) / 1e3,
            "seal_cpu_us": statistics.mean(samples["seal"]) / 1e3,
            "plain_seal_cpu_us": statistics.mean(plain["seal"]) / 1e3,
            "round_cpu_us": journal_round / 1e3, "plain_round_cpu_us": plain_round / 1e3,
            "journal_cost": 1 - plain_round / journal_round}


def measure(batch_size: int, seconds: float) -> dict[str, Any]:
    from kvd.core.pool import BlockPool
    from kvd.runtime import SHM_DIR
    from kvd.server.journal import Journal, use_c

    with tempfile.TemporaryDirectory(dir=SHM_DIR) as state_dir:  # the default's place
        journal = Journal(state_dir)
        pool = BlockPool(NUM_BLOCKS, "default", observer=journal)
        plain_pool = BlockPool(NUM_BLOCKS, "default")
        for each in (pool, plain_pool):
            fill_cached(each)
        journal.commit()
        journal.tidy()
        next_key = NUM_BLOCKS + churn(pool, journal, first_key=NUM_BLOCKS)
        sides: dict[str, dict[str, list[int]]] = {
            side: {step: [] for step in ROUND_STEPS} for side in ("journal", "plain", "python")}
        turns = [("journal", pool, journal), ("plain", plain_pool, None)]
        if use_c(True):
            turns.append(("python", pool, journal))
        for _ in range(NUM_SLICES):  # taking turns: machine noise hits every one alike
            for side, each, each_journal in turns:
                use_c(side != "python")
                next_key = time_rounds(each, each_journal, batch_size,
                                       seconds / NUM_SLICES / len(turns), next_key, sides[side])
        use_c(True)
        row = summarise(sides["journal"], sides["plain"])
        if sides["python"]["round"]:
            row["python"] = summarise(sides["python"], sides["plain"])
        row.update(num_log_records=journal.num_log_records, num_live=pool.num_cached)
        journal.close()
    return row


def run(quick: bool) -> dict[str, Any]:
    os.sync()  # the writeback of what ran before (a 1M-block journal) must not slow this
    rows = {}
    for batch_size in BATCH_SIZES:
        progress(f"journal commit in-process, batch {batch_size}")
        rows[str(batch_size)] = measure(batch_size, 0.3 if quick else 1.5)
    return {"num_blocks": NUM_BLOCKS, "batches": rows}


def markdown(results: dict[str, Any]) -> str:
    commits = markdown_table(
        ["batch", "commit CPU µs", "commit wall p50 µs", "p99", "upkeep CPU µs",
         "commit + upkeep wall mean µs", "max µs", "log / live records"],
        [[batch, f"{row['cpu_us']:.1f}", f"{row['wall_us_p50']:.1f}", f"{row['wall_us_p99']:.1f}",
          f"{row['tidy_cpu_us']:.1f}", f"{row['total_wall_us_mean']:.1f}",
          f"{row['total_wall_us_max']:.0f}", f"{row['num_log_records'] / row['num_live']:.2f}"]
         for batch, row in results["batches"].items()])

    def python_cells(row: dict[str, Any]) -> list[str]:
        python = row.get("python")
        return (["-"] * 3 if python is None else
                [f"{python['cpu_us']:.1f}", f"{python['tidy_cpu_us']:.1f}",
                 f"{python['journal_cost']:.1%}"])
    shares = markdown_table(
        ["batch", "round CPU µs, no journal", "with journal", "seal, no journal", "seal, journal",
         "journal cost", "records in Python: commit", "upkeep", "cost"],
        [[batch, f"{row['plain_round_cpu_us']:.1f}", f"{row['round_cpu_us']:.1f}",
          f"{row['plain_seal_cpu_us']:.1f}", f"{row['seal_cpu_us']:.1f}",
          f"**{row['journal_cost']:.1%}**", *python_cells(row)]
         for batch, row in results["batches"].items()])
    return ("## Journal commit in one process (bench/journal_commit.py)\n\n"
            f"A full pool of {results['num_blocks']:,} blocks churned: each allocation evicts, so "
            "a commit holds a round's tombstones and seals. One commit and its upkeep:\n\n"
            + commits + "\nThe same rounds (alloc → seal → release; commit + upkeep with the "
            "journal) on full pools with and without a journal, in turns; CPU µs per round, "
            "means. Journal cost = 1 - round without / round with:\n\n" + shares)


def run_bench(quick: bool, out: Path) -> str:
    return report(out, "journal_commit", run(quick), markdown)


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run_bench))
