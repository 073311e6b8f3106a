"""Recovery: how long `kvd start --recover` takes to bring back a 1M-block pool after a crash.

Goal (issue 6): <= 2 s for 1M blocks.

A child process runs a real `Daemon` in-process, seals every block of the pool under a fresh
16-byte key (in a random block order, committing the journal every COMMIT_EVERY seals, as the
daemon's group commit would), keeps replacing cached blocks by new seals until the journal's log
is as long as compaction lets it grow (about 2 records per live block: the worst case a recovery
reads), and then SIGKILLs itself: segment and un-checkpointed WAL journal are left exactly as a
crash leaves them. Each repeat then recovers:
  * end to end, in a fresh child: `launch(DaemonConfig(recover=True))` (flock, journal open, stamp
    check, journal load, pool build, restore, generation bump, socket bind), what a restart costs
    once Python is up; the first repeat reads the crash-left WAL, later ones a checkpointed
    journal;
  * the main steps again one by one in the same child (journal load, pool build, restore);
  * `cli ready`: `kvd start --recover` from exec to the first successful connect (interpreter
    start and imports included), stopped with --keep for the next repeat.
Geometry: 1 layer, 1 KV head, head_dim 8, block_size 1, float16: 32-byte blocks, so the segment
is 32 MiB and only metadata is measured.

    python -m bench.recovery [--quick] [--num-blocks N] [--repeats N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import (OWNER, ROOT, Daemon, GeometryFlags, child_env, digests, geometry_of,
                          markdown_table, progress, report)

# 32-byte blocks: `Daemon`'s flags for `kvd start`, and geometry_of's for an in-process daemon.
GEOMETRY: GeometryFlags = {"layers": 1, "kv_heads": 1, "head_dim": 8, "block_size": 1,
                           "dtype": "float16"}
COMMIT_EVERY = 65_536
GOAL_RECOVERY_S = 2.0
STEPS = ("end_to_end", "journal_load", "pool_build", "pool_restore")


def churn(pool: Any, journal: Any, first_key: int, num_rounds_compacting: int = 4) -> int:
    """Replace cached blocks of a full `pool` by new seals (evicting them), committing each round,
    until the journal has compacted its log in a few commits: the log is then as long as
    compaction lets it grow. Returns how many blocks were sealed."""
    num_sealed, batch_size = 0, min(COMMIT_EVERY, pool.num_blocks // 4)
    while num_rounds_compacting:
        num_records = journal.num_log_records
        block_ids = pool.allocate(batch_size, OWNER)
        pool.seal(block_ids, digests(first_key + num_sealed, len(block_ids)), OWNER)
        journal.commit()
        journal.tidy()
        pool.release(block_ids, OWNER)
        num_sealed += len(block_ids)
        # A commit appends a record per seal (and a tombstone per eviction of a block not
        # sealed again): a log grown by less was compacted.
        if journal.num_log_records < num_records + len(block_ids):
            num_rounds_compacting -= 1
    return num_sealed


# ---- the children ---------------------------------------------------------------------------
def daemon_config(name: str, num_blocks: int, recover: bool) -> Any:
    from kvd.runtime import DaemonPaths
    from kvd.server.daemon import DaemonConfig

    return DaemonConfig(DaemonPaths.for_name(name), geometry_of(num_blocks, GEOMETRY),
                        recover=recover)


def child_fill(name: str, num_blocks: int) -> dict[str, Any]:
    """Seal the whole pool through the daemon's pool and journal, churn, then die like a crash."""
    started = time.perf_counter()
    from kvd.server.daemon import launch
    from kvd.server.journal import Journal

    config = daemon_config(name, num_blocks, recover=False)
    daemon = launch(config)
    pool, journal = daemon.service.pool, daemon.journal
    assert isinstance(journal, Journal)  # one pool, journaled (DaemonConfig's default)
    block_ids = pool.allocate(num_blocks, OWNER)
    assert block_ids is not None  # a new pool has them all
    random.Random(0).shuffle(block_ids)  # seal order is not block order after real traffic
    for start in range(0, num_blocks, COMMIT_EVERY):
        chunk = block_ids[start:start + COMMIT_EVERY]
        pool.seal(chunk, digests(start, len(chunk)), OWNER)
        journal.commit()
        journal.tidy()
    pool.release(block_ids, OWNER)
    num_churned = churn(pool, journal, first_key=num_blocks)
    print(json.dumps({"fill_s": time.perf_counter() - started, "num_churned": num_churned,
                      "num_log_records": journal.num_log_records,
                      "journal_nbytes": sum(path.stat().st_size
                                            for path in Path(config.journal_dir).iterdir())}),
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def child_recover(name: str, num_blocks: int) -> dict[str, Any]:
    """A real recovery end to end, then its main steps one by one (wall and CPU seconds)."""
    from kvd.core.pool import BlockPool
    from kvd.runtime import DaemonPaths, state_dir
    from kvd.segment import Segment
    from kvd.server.journal import Journal

    times: dict[str, float] = {}

    def lap(step: str, since: tuple[float, float]) -> tuple[float, float]:
        now = time.perf_counter(), time.process_time()
        times[f"{step}_s"], times[f"{step}_cpu_s"] = now[0] - since[0], now[1] - since[1]
        return now

    from kvd.server.daemon import launch

    config = daemon_config(name, num_blocks, recover=True)
    clock = time.perf_counter(), time.process_time()
    daemon = launch(config)
    lap("end_to_end", clock)
    if daemon.started.num_restored != num_blocks:
        raise SystemExit(f"recovered {daemon.started.num_restored} blocks, expected {num_blocks}")
    daemon.stop(keep=True)
    daemon.serve_forever()  # returns at once: stopping, keeps segment and journal

    journal = Journal(state_dir(name))
    segment = Segment.attach(DaemonPaths.for_name(name).segment_name)
    clock = time.perf_counter(), time.process_time()
    rows = journal.load().rows
    clock = lap("journal_load", clock)
    pool = BlockPool(num_blocks, "default", segment.generations)
    clock = lap("pool_build", clock)
    pool.restore(rows)
    lap("pool_restore", clock)
    del pool
    segment.close()
    journal.close()
    return times


CHILDREN = {"fill": child_fill, "recover": child_recover}


def run_child(what: str, name: str, num_blocks: int, runtime_dir: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "bench.recovery", "--child", what, name,
                           str(num_blocks)], cwd=ROOT, env=child_env(runtime_dir),
                          capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"child {what} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(lines[-1])


# ---- the bench ------------------------------------------------------------------------------
def run(num_blocks: int, repeats: int) -> dict[str, Any]:
    from kvd.runtime import state_dir

    name = f"bench-recovery-{uuid.uuid4().hex[:8]}"
    runtime_dir = tempfile.mkdtemp(prefix="kvdb-", dir="/tmp")
    try:
        progress(f"recovery: sealing {num_blocks:,} blocks, churning until the journal "
                 "compacts, then SIGKILL")
        fill = run_child("fill", name, num_blocks, runtime_dir)
        runs = []
        for repeat in range(repeats):
            progress(f"recovery {repeat + 1} of {repeats}")
            row = run_child("recover", name, num_blocks, runtime_dir)
            daemon = Daemon(num_blocks, journal=True, recover=True, name=name,
                            runtime_dir=runtime_dir, **GEOMETRY)
            row["cli_ready_s"] = daemon.ready_s
            daemon.stop(keep=True)
            runs.append(row)
        return {"num_blocks": num_blocks, "geometry": GEOMETRY, "goal_s": GOAL_RECOVERY_S,
                **fill, "runs": runs,
                "best_end_to_end_s": min(r["end_to_end_s"] for r in runs),
                "best_cli_ready_s": min(r["cli_ready_s"] for r in runs)}
    finally:
        segment = f"/dev/shm/kvd-{os.getuid()}-{name}"
        if os.path.exists(segment):
            os.unlink(segment)
        shutil.rmtree(state_dir(name), ignore_errors=True)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def markdown(results: dict[str, Any]) -> str:
    rows = [[index, *(f"{row[f'{step}_s']:.3f} ({row[f'{step}_cpu_s']:.3f})" for step in STEPS),
             f"{row['cli_ready_s']:.3f}"] for index, row in enumerate(results["runs"], 1)]
    table = markdown_table(["run", "end to end s (CPU s)", "journal load", "pool build",
                            "pool restore", "`kvd start --recover` ready s"], rows)
    best = results["best_end_to_end_s"]
    return (f"## Recovery of a {results['num_blocks']:,}-block pool after SIGKILL "
            "(bench/recovery.py)\n\n"
            f"Best end to end **{best:.2f} s** (goal <= {results['goal_s']} s: "
            f"{'met' if best <= results['goal_s'] else 'NOT met'}); from exec to the first "
            f"connect {results['best_cli_ready_s']:.2f} s. The fill took "
            f"{results['fill_s']:.1f} s; the journal's log holds "
            f"{results['num_log_records']:,} records ({results['num_churned']:,} blocks replaced "
            "after the fill: as long as compaction lets it grow), its files "
            f"{results['journal_nbytes'] / 2**20:.1f} MiB, "
            f"{results['journal_nbytes'] / results['num_blocks']:.0f} B per cached block. Wall "
            "seconds, with the CPU seconds of the recovering process (what a busy machine "
            "inflates least):\n\n" + table)


def run_bench(quick: bool, out: Path, num_blocks: int | None = None,
              repeats: int | None = None) -> str:
    results = run(num_blocks or (20_000 if quick else 1_000_000), repeats or (1 if quick else 3))
    return report(out, "recovery", results, markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (20,000 blocks)")
    parser.add_argument("--num-blocks", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--child", nargs=3, metavar=("WHAT", "NAME", "NUM_BLOCKS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        what, name, num_blocks = args.child
        print(json.dumps(CHILDREN[what](name, int(num_blocks))), flush=True)
        return 0
    print(run_bench(args.quick, args.out, args.num_blocks, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
