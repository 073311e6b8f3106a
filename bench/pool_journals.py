"""Several pools' journals: what a loop iteration's commits cost when its seals are spread over
1 or 3 pools (one journal-<pool>.sqlite3 each, kvd/server/journal.py's PoolJournals).

In this process, as bench/journal_commit.py: full pools (every allocation evicts) with their
journals on /dev/shm, churned until compaction bounds their logs, the same total of blocks split
evenly over the pools. An iteration seals `batch` blocks spread evenly over the pools, then runs
what the loop runs: `PoolJournals.commit()` (one commit per pool with seals: what the replies
wait for) and `tidy()` (upkeep, after the replies). The two layouts take turns slice by slice.
Reported per iteration: commit CPU and wall, upkeep CPU, and the commit CPU per sealed block.

The alternative of one transaction for every pool: raw SQLite with the journal's settings
(exclusive locking, WAL, synchronous=NORMAL) and its table, 3 databases, each iteration
inserting one chunk of `records` 51-byte records into each: an autocommit INSERT per database
(what the journals do) against one BEGIN ... COMMIT over the three ATTACHed to one connection
(in WAL mode atomic per database, not across them, which per-pool recovery would allow).

`--instructions` counts instructions as well (valgrind --tool=callgrind, PYTHONHASHSEED=0, no
churn, 4,096 blocks): every layout runs in a child with and without journals (the SQLite ones
with a chunk and without), at two numbers of iterations; the difference of the differences is
the journals' instructions per iteration (commit and upkeep), with no start-up, setup or clock
in it.

    python -m bench.pool_journals [--quick] [--out DIR] [--instructions]
"""

from __future__ import annotations

import argparse
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import OWNER, ROOT, digests, markdown_table, progress, report
from bench.pool import fill_cached
from bench.recovery import churn

POOL_COUNTS = (1, 3)
BATCHES = (3, 48, 384)  # seals per iteration, over all pools
NUM_BLOCKS = 65_536  # in all pools together
NUM_SLICES = 10
CALLGRIND_BLOCKS = 4_096
CALLGRIND_ROUNDS = (100, 600)
SQLITE_RECORDS = (1, 16, 128)  # records per database and iteration
SQLITE_PRAGMAS = ("locking_mode=EXCLUSIVE", "journal_mode=WAL", "synchronous=NORMAL")


def open_pools(state_dir: str, num_pools: int, num_blocks: int, journaled: bool,
               steady: bool) -> tuple[list[Any], Any]:
    """`num_pools` full pools of `num_blocks` in all, each with its journal (PoolJournals) if
    `journaled`; `steady`: churned until compaction bounds each log."""
    from kvd.core.pool import BlockPool
    from kvd.server.journal import Journal, PoolJournals, pool_journal_filename

    journals = {f"p{index}": Journal(state_dir, filename=pool_journal_filename(f"p{index}"))
                for index in range(num_pools)} if journaled else {}
    pools = [BlockPool(num_blocks // num_pools, "default", observer=journals.get(f"p{index}"))
             for index in range(num_pools)]
    first_key = 0
    each_journal: list[Journal | None] = [*journals.values()] or [None] * num_pools
    for pool, journal in zip(pools, each_journal):
        pool_keys = digests(first_key, pool.num_blocks)
        block_ids = pool.allocate(pool.num_blocks, OWNER)
        assert block_ids is not None  # a new pool has them all
        pool.seal(block_ids, pool_keys, OWNER)
        pool.release(block_ids, OWNER)
        first_key += pool.num_blocks
        if journal is not None:
            journal.commit()
            journal.tidy()
            if steady:
                first_key += churn(pool, journal, first_key)
    return pools, (PoolJournals(state_dir, journals) if journaled else None)


def one_round(pools: list[Any], journals: Any, batch: int, next_key: int,
              samples: dict[str, list[int]] | None) -> int:
    """Seal `batch` blocks spread over `pools`, commit and tidy; returns the next unused key."""
    per_pool = batch // len(pools)
    held = []
    for pool in pools:
        block_ids = pool.allocate(per_pool, OWNER)
        pool.seal(block_ids, digests(next_key, per_pool), OWNER)
        next_key += per_pool
        held.append(block_ids)
    if journals is not None:
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        journals.commit()
        committed, committed_wall = time.thread_time_ns(), time.perf_counter_ns()
        journals.tidy()
        if samples is not None:
            samples["commit"].append(committed - cpu)
            samples["commit_wall"].append(committed_wall - wall)
            samples["tidy"].append(time.thread_time_ns() - committed)
    for pool, block_ids in zip(pools, held):
        pool.release(block_ids, OWNER)
    return next_key


def measure(batch: int, seconds: float, num_blocks: int) -> dict[str, dict[str, float]]:
    from kvd.runtime import SHM_DIR

    sides: dict[int, dict[str, list[int]]] = {
        count: {"commit": [], "commit_wall": [], "tidy": []} for count in POOL_COUNTS}
    with tempfile.TemporaryDirectory(dir=SHM_DIR) as one_dir, \
            tempfile.TemporaryDirectory(dir=SHM_DIR) as three_dir:
        layouts = {count: open_pools(state_dir, count, num_blocks, True, True)
                   for count, state_dir in zip(POOL_COUNTS, (one_dir, three_dir))}
        next_key = 1 << 40  # (above every key the setup sealed)
        for _ in range(NUM_SLICES):  # taking turns: machine noise hits both alike
            for count, (pools, journals) in layouts.items():
                deadline = time.perf_counter() + seconds / NUM_SLICES / len(layouts)
                while time.perf_counter() < deadline:
                    next_key = one_round(pools, journals, batch, next_key, sides[count])
        for _, journals in layouts.values():
            journals.close()
    rows = {}
    for count, samples in sides.items():
        walls = sorted(samples["commit_wall"])
        cpu_us = statistics.mean(samples["commit"]) / 1e3
        rows[str(count)] = {"num_iterations": len(walls), "commit_cpu_us": cpu_us,
                            "commit_wall_us_p50": walls[len(walls) // 2] / 1e3,
                            "tidy_cpu_us": statistics.mean(samples["tidy"]) / 1e3,
                            "commit_cpu_us_per_seal": cpu_us / batch}
    return rows


# ---- one transaction over ATTACHed databases, in raw SQLite ------------------------------------
def sqlite_commit(state_dir: str, layout: str) -> Callable[[int, bytes], None]:
    """3 databases in `layout` ("separate": a connection each, "attached": one connection);
    returns `commit(chunk_id, records)`, which inserts the chunk into each."""
    from kvd.server.journal import _INSERT_CHUNK, _LOG_TABLE

    names = ["main", "p1", "p2"]
    connections = [sqlite3.connect(f"{state_dir}/{layout}{index}.sqlite3", isolation_level=None)
                   for index in range(len(names) if layout == "separate" else 1)]
    schemas = ["main"] * 3 if layout == "separate" else names
    if layout == "attached":
        for index, name in enumerate(names[1:], 1):
            connections[0].execute(f"ATTACH DATABASE '{state_dir}/{layout}{index}.sqlite3' "
                                   f"AS {name}")
    for index, schema in enumerate(schemas):
        connection = connections[index % len(connections)]
        for pragma in SQLITE_PRAGMAS:
            connection.execute(f"PRAGMA {schema}.{pragma}")
        connection.execute(_LOG_TABLE.replace("EXISTS log", f"EXISTS {schema}.log"))
    cursors = [connection.cursor() for connection in connections]
    if layout == "separate":
        def commit(chunk_id: int, records: bytes) -> None:
            for cursor in cursors:
                cursor.execute(_INSERT_CHUNK, (chunk_id, 16, records, chunk_id, 0))
        return commit
    cursor = cursors[0]
    inserts = [_INSERT_CHUNK.replace("INTO log", f"INTO {name}.log") for name in names]

    def commit_attached(chunk_id: int, records: bytes) -> None:
        cursor.execute("BEGIN")
        for insert in inserts:
            cursor.execute(insert, (chunk_id, 16, records, chunk_id, 0))
        cursor.execute("COMMIT")
    return commit_attached


def measure_sqlite(num_records: int, seconds: float) -> dict[str, float]:
    """CPU µs per iteration of each layout, in turns."""
    from kvd.runtime import SHM_DIR

    records = os.urandom(51 * num_records)
    samples: dict[str, list[int]] = {"separate": [], "attached": []}
    with tempfile.TemporaryDirectory(dir=SHM_DIR) as state_dir:
        commits = {layout: sqlite_commit(state_dir, layout) for layout in samples}
        chunk_id = 0
        for _ in range(NUM_SLICES):
            for layout, commit in commits.items():
                deadline = time.perf_counter() + seconds / NUM_SLICES / len(commits)
                while time.perf_counter() < deadline:
                    chunk_id += 1
                    started = time.thread_time_ns()
                    commit(chunk_id, records)
                    samples[layout].append(time.thread_time_ns() - started)
    return {layout: statistics.mean(values) / 1e3 for layout, values in samples.items()}


def child_sqlite(layout: str, num_records: int, num_rounds: int) -> None:
    """The body a callgrind child runs: `num_rounds` iterations (0 records: none committed)."""
    from kvd.runtime import SHM_DIR

    records = bytes(range(256)) * (51 * num_records // 256 + 1)
    with tempfile.TemporaryDirectory(dir=SHM_DIR) as state_dir:
        commit = sqlite_commit(state_dir, layout)
        for chunk_id in range(num_rounds):
            if num_records:
                commit(chunk_id, records[:51 * num_records])


# ---- instructions (callgrind) ----------------------------------------------------------------
def child_rounds(num_pools: int, batch: int, num_rounds: int, journaled: bool) -> None:
    """The body a callgrind child runs: setup, then `num_rounds` iterations."""
    from kvd.runtime import SHM_DIR

    with tempfile.TemporaryDirectory(dir=SHM_DIR) as state_dir:
        pools, journals = open_pools(state_dir, num_pools, CALLGRIND_BLOCKS, journaled, False)
        next_key = 1 << 40
        for _ in range(num_rounds):
            next_key = one_round(pools, journals, batch, next_key, None)
        if journals is not None:
            journals.close()


def count_instructions(*child_args: object) -> int:
    """Instructions of a `--child` run of this module under callgrind."""
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
               sys.executable, "-m", "bench.pool_journals", "--child",
               ",".join(map(str, child_args))]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    return int(re.findall(r"Collected : (\d+)", done.stderr)[-1])


def per_round(with_args: tuple[object, ...], without_args: tuple[object, ...]) -> float:
    """Instructions per iteration of `--child with_args,ROUNDS` beyond `without_args`'s."""
    few, many = CALLGRIND_ROUNDS
    per_round = []
    for args in (with_args, without_args):
        low, high = (count_instructions(*args, rounds) for rounds in (few, many))
        per_round.append((high - low) / (many - few))
    return per_round[0] - per_round[1]


def instructions(batches: tuple[int, ...], records: tuple[int, ...]
                 ) -> dict[str, dict[str, dict[str, float]]]:
    """Journal instructions per iteration, for each batch and pool count; SQLite's for each
    number of records and layout."""
    rows: dict[str, dict[str, dict[str, float]]] = {"journals": {}, "sqlite": {}}
    for batch in batches:
        for count in POOL_COUNTS:
            progress(f"callgrind: batch {batch}, {count} pool(s)")
            rows["journals"].setdefault(str(batch), {})[str(count)] = per_round(
                ("journals", count, batch, 1), ("journals", count, batch, 0))
    for num_records in records:
        for layout in ("separate", "attached"):
            progress(f"callgrind: SQLite {layout}, {num_records} records")
            rows["sqlite"].setdefault(str(num_records), {})[layout] = per_round(
                ("sqlite", layout, num_records), ("sqlite", layout, 0))
    return rows


def run(quick: bool, with_instructions: bool) -> dict[str, Any]:
    os.sync()
    num_blocks = CALLGRIND_BLOCKS if quick else NUM_BLOCKS
    results: dict[str, Any] = {"num_blocks": num_blocks, "batches": {}}
    for batch in BATCHES:
        progress(f"pool journals in-process, batch {batch}")
        results["batches"][str(batch)] = measure(batch, 0.6 if quick else 6.0, num_blocks)
    results["sqlite"] = {}
    for num_records in SQLITE_RECORDS:
        progress(f"SQLite: 3 databases, {num_records} records each")
        results["sqlite"][str(num_records)] = measure_sqlite(num_records, 0.6 if quick else 3.0)
    if with_instructions:
        results["instructions"] = instructions(BATCHES[:2] if quick else BATCHES,
                                               SQLITE_RECORDS[:2] if quick else SQLITE_RECORDS)
    return results


def markdown(results: dict[str, Any]) -> str:
    rows = []
    for batch, by_count in results["batches"].items():
        one = by_count["1"]
        for count, row in by_count.items():
            rows.append([batch, count, f"{row['commit_cpu_us']:.1f}",
                         f"{row['commit_cpu_us'] / one['commit_cpu_us']:.2f}×",
                         f"{row['commit_cpu_us_per_seal']:.2f}",
                         f"{row['commit_wall_us_p50']:.1f}", f"{row['tidy_cpu_us']:.1f}"])
    text = ("## Several pools' journals (bench/pool_journals.py)\n\n"
            f"{results['num_blocks']:,} blocks in 1 or 3 full pools, churned; an iteration seals "
            "`batch` blocks spread evenly over the pools and commits every journal with seals "
            "(means over the iterations, the layouts in turns):\n\n"
            + markdown_table(["batch", "pools", "commit CPU µs", "vs 1 pool", "per seal µs",
                              "commit wall p50 µs", "upkeep CPU µs"], rows))
    text += ("\nRaw SQLite, 3 databases, a chunk into each per iteration: an INSERT each, or one "
             "transaction over them ATTACHed (CPU µs per iteration, in turns):\n\n"
             + markdown_table(["records per database", "INSERT each", "ATTACHed", "ratio"],
                              [[records, f"{by['separate']:.1f}", f"{by['attached']:.1f}",
                                f"{by['attached'] / by['separate']:.2f}×"]
                               for records, by in results["sqlite"].items()]))
    if "instructions" in results:
        counts = results["instructions"]
        text += ("\nInstructions per iteration (callgrind): the journals' (commit and upkeep; "
                 f"{CALLGRIND_BLOCKS:,} blocks, no churn), then raw SQLite's:\n\n"
                 + markdown_table(
                     ["batch", "1 pool", "3 pools", "3 / 1", "per seal, 1 pool", "3 pools"],
                     [[batch, f"{by['1']:,.0f}", f"{by['3']:,.0f}", f"{by['3'] / by['1']:.2f}×",
                       f"{by['1'] / int(batch):,.0f}", f"{by['3'] / int(batch):,.0f}"]
                      for batch, by in counts["journals"].items()])
                 + "\n" + markdown_table(
                     ["records per database", "INSERT each", "ATTACHed", "ratio"],
                     [[records, f"{by['separate']:,.0f}", f"{by['attached']:,.0f}",
                       f"{by['attached'] / by['separate']:.2f}×"]
                      for records, by in counts["sqlite"].items()]))
    return text


def run_bench(quick: bool, out: Path) -> str:
    """`python -m bench`'s entry: the timings (the instructions take minutes of callgrind)."""
    return report(out, "pool_journals", run(quick, False), markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny sizes)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions under valgrind --tool=callgrind")
    # journals,POOLS,BATCH,JOURNALED,ROUNDS or sqlite,LAYOUT,RECORDS,ROUNDS
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *values = args.child.split(",")
        if kind == "journals":
            num_pools, batch, journaled, num_rounds = map(int, values)
            child_rounds(num_pools, batch, num_rounds, bool(journaled))
        else:
            child_sqlite(values[0], int(values[1]), int(values[2]))
        return 0
    print(report(args.out, "pool_journals", run(args.quick, args.instructions), markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
