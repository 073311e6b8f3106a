"""BlockPool: build time and metadata bytes per block of a pool, and its op throughput.

Goals (issue 2, item 2): a 1,000,000-block pool builds in < 2 s and holds <= 200 bytes of
metadata per block. Memory is measured for an *empty* pool and for a *full* one, every block
sealed under a 16-byte digest (the size kvd.hash_blocks returns) and released, so it is CACHED:
hashes, the index and the policy's structures all count. Each measurement runs in a fresh
subprocess: tracemalloc (the bytes Python and NumPy asked for, with the allocation sites that
explain them) and, separately, the RSS delta (what the OS actually gave, allocator slack included;
tracemalloc's own bookkeeping would inflate it, hence two children).

Throughput: a pool kept full of cached blocks, so every allocation evicts; each round allocates a
batch, seals it under fresh keys, releases it (CACHED), looks it up (pinned again) and releases it.

    python -m bench.pool [--num-blocks 1000000] [--policies lru,lfu] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench.common import (OWNER, ROOT, best_seconds, child_env, digests, markdown_table, progress,
                          report, write_json)
from kvd.core.policies import DEFAULT_POLICY, POLICIES
from kvd.core.pool import BlockPool

BATCH_SIZES = (1, 16, 256)
OPS = ("allocate", "seal", "lookup", "release")
GOAL_BUILD_S = 2.0
GOAL_BYTES_PER_BLOCK = 200


def fill_cached(pool: BlockPool) -> None:
    """Seal every block under its own key and release it: the whole pool is CACHED."""
    block_ids = pool.allocate(pool.num_blocks, OWNER)
    assert block_ids is not None  # an empty pool has them all
    pool.seal(block_ids, digests(0, pool.num_blocks), OWNER)
    pool.release(block_ids, OWNER)


def build_time_s(policy: str, num_blocks: int) -> float:
    return best_seconds(lambda: BlockPool(num_blocks, policy), repeats=3)


# ---- memory (each in a fresh child) -----------------------------------------------------------
def rss_nbytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child_rss(policy: str, num_blocks: int) -> dict:
    gc.collect()
    base = rss_nbytes()
    pool = BlockPool(num_blocks, policy)
    empty = rss_nbytes() - base
    fill_cached(pool)
    gc.collect()
    return {"empty_bytes_per_block": empty / num_blocks,
            "full_bytes_per_block": (rss_nbytes() - base) / num_blocks}


def child_tracemalloc(policy: str, num_blocks: int) -> dict:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pool = BlockPool(num_blocks, policy)
    empty = tracemalloc.get_traced_memory()[0] - base
    fill_cached(pool)
    gc.collect()
    full = tracemalloc.get_traced_memory()[0] - base
    sites = tracemalloc.take_snapshot().statistics("lineno")
    return {"empty_bytes_per_block": empty / num_blocks, "full_bytes_per_block": full / num_blocks,
            "full_sites": [{"site": site_name(stat), "bytes_per_block": stat.size / num_blocks}
                           for stat in sites if stat.size / num_blocks >= 1.0]}


def site_name(stat: tracemalloc.Statistic) -> str:
    frame = stat.traceback[0]
    return f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}"


def measure_in_child(method: str, policy: str, num_blocks: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "bench.pool", "--child", method, "--policies", policy,
         "--num-blocks", str(num_blocks)],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


# ---- throughput --------------------------------------------------------------------------------
def throughput(policy: str, batch_size: int, num_blocks: int, blocks_per_run: int) -> dict:
    """Calls/s and blocks/s of each op at `batch_size`, the pool full of cached blocks."""
    pool = BlockPool(num_blocks, policy)
    fill_cached(pool)
    num_rounds = max(1, blocks_per_run // batch_size)
    keys = digests(num_blocks, num_rounds * batch_size)
    spent = dict.fromkeys(OPS, 0.0)
    calls = dict.fromkeys(OPS, 0)
    clock = time.perf_counter
    # allocate cannot fail here (between rounds every block is cached, so evictable), and a None
    # check would sit inside the timed spans: hence the ignores below.
    for round_number in range(num_rounds):
        batch_keys = keys[round_number * batch_size:(round_number + 1) * batch_size]
        t0 = clock()
        block_ids = pool.allocate(batch_size, OWNER)
        t1 = clock()
        pool.seal(block_ids, batch_keys, OWNER)  # type: ignore[arg-type]
        t2 = clock()
        pool.release(block_ids, OWNER)  # type: ignore[arg-type]
        t3 = clock()
        pool.lookup(batch_keys, OWNER)
        t4 = clock()
        pool.release(block_ids, OWNER)  # type: ignore[arg-type]
        t5 = clock()
        spent["allocate"] += t1 - t0
        spent["seal"] += t2 - t1
        spent["release"] += (t3 - t2) + (t5 - t4)
        spent["lookup"] += t4 - t3
    for op in OPS:
        calls[op] = num_rounds * (2 if op == "release" else 1)
    pool.check_invariants()
    return {op: {"calls_per_s": calls[op] / spent[op],
                 "blocks_per_s": calls[op] * batch_size / spent[op]} for op in OPS}


# ---- driver ------------------------------------------------------------------------------------
def run(policies: list[str], num_blocks: int, ops_blocks: int, ops_per_batch: int) -> dict:
    results: dict[str, Any] = {"num_blocks": num_blocks, "goal_build_s": GOAL_BUILD_S,
               "goal_bytes_per_block": GOAL_BYTES_PER_BLOCK, "ops_pool_blocks": ops_blocks,
               "policies": {}}
    for policy in policies:
        progress(f"pool: {policy}, build and memory")
        row = {"build_s": build_time_s(policy, num_blocks),
               "tracemalloc": measure_in_child("tracemalloc", policy, num_blocks),
               "rss": measure_in_child("rss", policy, num_blocks)}
        progress(f"pool: {policy}, throughput")
        row["ops"] = {str(batch): throughput(policy, batch, ops_blocks, ops_per_batch)
                      for batch in BATCH_SIZES}
        results["policies"][policy] = row
    return results


def markdown(results: dict) -> str:
    policies = results["policies"]
    memory = markdown_table(
        ["policy", "build s", "empty B/block", "full B/block", "empty RSS B/block",
         "full RSS B/block"],
        [[policy, f"{row['build_s']:.3f}",
          *(f"{row[method][f'{state}_bytes_per_block']:.1f}" for method in ("tracemalloc", "rss")
            for state in ("empty", "full"))] for policy, row in policies.items()])
    sites = "\n".join(f"- {policy}: " + ", ".join(
        f"{site['site']} {site['bytes_per_block']:.0f}"
        for site in row["tracemalloc"]["full_sites"]) for policy, row in policies.items())
    ops = markdown_table(
        ["policy", "batch", *(f"{op} k blocks/s" for op in OPS)],
        [[policy, batch, *(f"{by_op[op]['blocks_per_s'] / 1e3:.0f}" for op in OPS)]
         for policy, row in policies.items() for batch, by_op in row["ops"].items()])
    return (f"## BlockPool: build time, bytes per block, op throughput (bench/pool.py)\n\n"
            f"{results['num_blocks']:,} blocks (goals: build < {results['goal_build_s']} s, "
            f"<= {results['goal_bytes_per_block']} B/block); bytes from tracemalloc (what "
            "Python and NumPy asked for) and RSS (what the OS gave):\n\n" + memory
            + "\nWhere a full pool's bytes go (tracemalloc, bytes per block, >= 1 B):\n\n"
            + sites + f"\n\nOps on a full pool of {results['ops_pool_blocks']:,} cached blocks "
            "(every allocation evicts; calls/s = blocks/s ÷ batch):\n\n" + ops)


def run_bench(quick: bool, out: Path) -> str:
    """The default policy and LRU at 1M blocks (quick: LRU at 10k blocks)."""
    policies = ["lru"] if quick else ["lru", DEFAULT_POLICY]
    results = run(policies, 10_000 if quick else 1_000_000, 4096 if quick else 65_536,
                  4096 if quick else 65_536)
    return report(out, "pool", results, markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-blocks", type=int, default=1_000_000)
    parser.add_argument("--policies", default=",".join(sorted(POLICIES)))
    parser.add_argument("--ops-pool-blocks", type=int, default=65_536)
    parser.add_argument("--ops-blocks-per-batch-size", type=int, default=65_536,
                        help="blocks pushed through each op per batch size")
    parser.add_argument("--out", type=Path, help="directory to write pool.json into")
    parser.add_argument("--child", choices=("rss", "tracemalloc"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    if args.child:
        measure = child_rss if args.child == "rss" else child_tracemalloc
        print(json.dumps(measure(policies[0], args.num_blocks)))
        return 0
    results = run(policies, args.num_blocks, args.ops_pool_blocks, args.ops_blocks_per_batch_size)
    print(markdown(results))
    if args.out:
        write_json(args.out, "pool", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
