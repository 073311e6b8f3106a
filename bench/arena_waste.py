"""Issue 31 item 3: bytes of live blocks / bytes of segment memory in use, three pools sharing one
budget, the arena (kvd/core/arena.py) next to padding every block to the largest geometry.

Pools (a target model, its draft, a latent pool):
  * target: 32 layers, 8 KV heads, head dim 128, bfloat16, 16-token blocks (2 MiB a block);
  * draft:  4 layers, 4 KV heads, head dim 64, float32, 16-token blocks (128 KiB);
  * latent: 27 layers, parts=1, one 576-wide latent, bfloat16, 16-token blocks (486 KiB).
Workload: requests pick a pool (the target and its draft together, as speculative decoding does,
and the latent pool on its own), look up a chain from a Zipf-popular set of 3,000 prompts (1 to
24 blocks), write the missing blocks and release; a few requests keep their blocks while others
run. Each side runs the same request stream; once the budget is full, the ratio is sampled every
50 requests.

    live bytes   = blocks owned, sealed or cached, each at its own pool's block bytes
    in-use bytes = the arena: slabs owned by a pool (slab tails and free blocks in them count
                   as waste); padding: every block held, at the largest block's bytes

Run: `python -m bench.arena_waste [--quick]`. Goal: arena >= 0.95.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from bench.common import bench_main, markdown_table, report
from kvd.core.arena import Arena
from kvd.geometry import Geometry

POOLS = {
    "target": Geometry(1, num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
    "draft": Geometry(1, num_layers=4, num_kv_heads=4, head_dim=64, dtype="float32"),
    "latent": Geometry(1, num_layers=27, parts=1, num_kv_heads=1, head_dim=576,
                       dtype="bfloat16"),
}
NUM_PROMPTS = 3000
ZIPF_S = 0.8  # prompt popularity ~ 1 / rank**ZIPF_S
OWNER = 1


def run_side(budget_nbytes: int, padded: bool, num_requests: int, seed: int) -> dict[str, Any]:
    """One side's request stream; returns its mean, min and last sampled ratio."""
    block_nbytes = [geometry.block_nbytes for geometry in POOLS.values()]
    arena = Arena(budget_nbytes, [max(block_nbytes)] * 3 if padded else block_nbytes)
    pools = [arena.add_pool(number) for number in range(3)]
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** ZIPF_S for rank in range(NUM_PROMPTS)]
    held: list[tuple[int, list[int]]] = []
    samples = []
    for request in range(num_requests):
        prompt = rng.choices(range(NUM_PROMPTS), weights)[0]
        numbers = (0, 1) if rng.random() < 0.6 else (2,)
        for number in numbers:
            pool = pools[number]
            keys = [(prompt, i) for i in range(1 + prompt % 24)]
            block_ids = pool.lookup(keys, OWNER)
            new_ids = pool.allocate(len(keys) - len(block_ids), OWNER) or []
            pool.seal(new_ids, keys[len(block_ids):len(block_ids) + len(new_ids)], OWNER)
            held.append((number, block_ids + new_ids))
        while len(held) > 8 or (held and rng.random() < 0.5):  # a few stay in flight
            number, block_ids = held.pop(rng.randrange(len(held)))
            pools[number].release(block_ids, OWNER)
        if not arena.num_unowned() and request % 50 == 0:
            live = sum((pool.num_present - pool.num_free) * nbytes
                       for pool, nbytes in zip(pools, block_nbytes))
            samples.append(live / arena.in_use_nbytes())
    arena.check_invariants()
    return {"mean": sum(samples) / len(samples), "min": min(samples), "last": samples[-1],
            "slab_nbytes": arena.slab_nbytes, "num_slabs": arena.num_slabs,
            "slab_moves": arena.num_moves, "samples": len(samples)}


def run_bench(quick: bool, out: Path) -> str:
    budgets = (1 << 30,) if quick else (1 << 30, 4 << 30, 16 << 30)
    num_requests = 2000 if quick else 6000
    results = []
    for budget in budgets:
        row: dict[str, Any] = {"budget_gib": budget >> 30}
        for side in ("arena", "padded"):
            row[side] = run_side(budget, side == "padded", num_requests, seed=31)
        results.append(row)
    return report(out, "arena_waste", results, markdown)


def markdown(results: list[dict[str, Any]]) -> str:
    rows = [(f"{row['budget_gib']} GiB", f"{row['arena']['mean']:.4f}",
             f"{row['arena']['min']:.4f}", f"{row['padded']['mean']:.4f}", f"{row['padded']['min']:.4f}",
             f"{row['arena']['slab_nbytes'] >> 20} MiB x {row['arena']['num_slabs']}",
             row["arena"]["slab_moves"]) for row in results]
    return ("## Arena waste (issue 31 item 3): live bytes / in-use bytes, goal >= 0.95\n\n"
            + markdown_table(("budget", "arena mean", "arena min", "padded mean", "padded min",
                              "slabs", "slab moves"), rows))


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run_bench))
