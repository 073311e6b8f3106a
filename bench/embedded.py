"""The embedded cache against cachetools, side by side in one process; and what its lock costs.

The op mix of the seed's measurement: a full cache, where op i allocates a new (layer, position)
pair -- evicting one block -- except every third op, a `get_block` of the pair allocated just
before (a hit). cachetools' `LRUCache`/`LFUCache` of the same size does the same with
`cache[pair] = i` and `cache.get(pair)`. Three kvd arms run beside it:
  * `kvd.PagedKVCache` as users call it (its lock included);
  * the public methods' code less the lines that take and drop the lock, on the SAME cache
    (the two take turns through one sequence of pairs), so the difference is what thread
    safety costs a single thread and nothing else;
  * kvd on 1-element blocks: the default geometry's blocks are 16 KiB, which an allocation zeroes
    (a reused block must not show its previous pair's data): work cachetools has no counterpart
    for. These rows are the metadata path alone.
The process is pinned to one CPU and the arms take turns in rounds of CHUNK ops each, in an order
reversed every round (whichever arm runs right after another meets the caches that one left).
Each turn is timed in the thread's CPU time, which a busy host's preemptions do not inflate.
µs/op are medians over the rounds, each ratio is the median of the ratios within a round (arms
of one round ran moments apart, so a busy host moves both sides of a ratio alike), and the lock's
cost comes with its quartiles. `python -m bench.diagnostics.embedded_lock` counts the lock's
instructions instead.

    python -m bench.embedded [--quick] [--out DIR]
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import MethodType
from typing import Any

import cachetools

from bench.common import bench_main, markdown_table, pinned, write_json
from kvd import PagedKVCache

NUM_BLOCKS = 256
NUM_LAYERS = 8
CHUNK = 600  # ops per turn of an arm: short, so the arms of a round meet the same load
ALTERNATIVES = {"lru": cachetools.LRUCache, "lfu": cachetools.LFUCache}
TINY = 1  # block_size and head_dim of the 1-element blocks: the metadata path alone


def pair(op: int) -> tuple[int, int]:
    return op % NUM_LAYERS, op // NUM_LAYERS


def chunk_timer(run_ops: Callable[[int, int], None],
                next_op: list[int] | None = None) -> Callable[[], float]:
    """A callable timing the next CHUNK ops of `run_ops(first, stop)`, in µs of this thread's
    CPU time per op (on a shared host a chunk's wall time also counts whoever ran while it was
    preempted). Arms that share one cache share `next_op`, so each allocation is of a new pair
    (an eviction)."""
    next_op = [NUM_BLOCKS] if next_op is None else next_op

    def timed() -> float:
        first = next_op[0]
        start = time.thread_time_ns()
        run_ops(first, first + CHUNK)
        next_op[0] = first + CHUNK
        return (time.thread_time_ns() - start) / CHUNK / 1e3

    return timed


def cachetools_arm(policy: str) -> Callable[[], float]:
    cache: cachetools.Cache = ALTERNATIVES[policy](maxsize=NUM_BLOCKS)
    for op in range(NUM_BLOCKS):
        cache[pair(op)] = op

    def run_ops(first: int, stop: int) -> None:
        get = cache.get
        for op in range(first, stop):
            if op % 3 == 2:
                get(pair(op - 1))
            else:
                cache[pair(op)] = op

    return chunk_timer(run_ops)


def filled(policy: str, block_size: int = 16, head_dim: int = 128) -> PagedKVCache:
    cache = PagedKVCache(num_blocks=NUM_BLOCKS, num_layers=NUM_LAYERS, eviction_policy=policy,
                         block_size=block_size, head_dim=head_dim)
    for op in range(NUM_BLOCKS):
        cache.allocate_block(*pair(op))
    return cache


def ops_of(allocate: Callable[[int, int], Any],
           get: Callable[[int, int], Any]) -> Callable[[int, int], None]:
    def run_ops(first: int, stop: int) -> None:
        for op in range(first, stop):
            if op % 3 == 2:
                get(*pair(op - 1))
            else:
                allocate(*pair(op))

    return run_ops


def kvd_arm(policy: str, block_size: int = 16, head_dim: int = 128) -> Callable[[], float]:
    cache = filled(policy, block_size, head_dim)
    return chunk_timer(ops_of(cache.allocate_block, cache.get_block))


# `allocate_block` and `get_block` less their lock: the public methods' code without the lines
# that take and drop it, bound to the cache as methods, so that a call is shaped the same.
def _allocate_unlocked(self: PagedKVCache, layer_id: int, position: int) -> int:
    return self._allocate(self._key(layer_id, position))


def _get_unlocked(self: PagedKVCache, layer_id: int, position: int) -> Any:
    key = self._key(layer_id, position)
    block_id = self._get(key)
    return None if block_id is None else self._block(block_id, key)


def lock_arms(policy: str) -> tuple[Callable[[], float], Callable[[], float]]:
    """The public methods and the same code less the lock, on ONE cache, taking turns through
    one sequence of pairs: both meet the same pool, policy state and memory (arms on caches of
    their own differed by ~10 % in time by which one's 4 MiB of blocks the last turn had left in
    the CPU's caches)."""
    cache, next_op = filled(policy), [NUM_BLOCKS]
    unlocked = ops_of(MethodType(_allocate_unlocked, cache), MethodType(_get_unlocked, cache))
    return (chunk_timer(ops_of(cache.allocate_block, cache.get_block), next_op),
            chunk_timer(unlocked, next_op))


def quartiles(values: list[float]) -> tuple[float, float, float]:
    low, median, high = statistics.quantiles(values, n=4)
    return low, median, high


def measure(policy: str, num_rounds: int) -> dict[str, Any]:
    kvd_locked, kvd_unlocked = lock_arms(policy)
    arms = {"cachetools": cachetools_arm(policy), "kvd": kvd_locked,
            "kvd_unlocked": kvd_unlocked, "kvd_tiny": kvd_arm(policy, TINY, TINY)}
    samples: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    for _ in range(num_rounds):
        for name in order:
            samples[name].append(arms[name]())
        order.reverse()  # an arm runs first and last in turn: no arm always follows another

    def ratios(name: str, base: str) -> list[float]:
        return [a / b for a, b in zip(samples[name], samples[base])]

    lock_cost = [ratio - 1 for ratio in ratios("kvd", "kvd_unlocked")]
    return {"policy": policy,
            "us_per_op": {name: statistics.median(values) for name, values in samples.items()},
            "kvd_x_cachetools": statistics.median(ratios("kvd", "cachetools")),
            "kvd_tiny_x_cachetools": statistics.median(ratios("kvd_tiny", "cachetools")),
            "lock_cost": statistics.median(lock_cost),
            "lock_cost_quartiles": quartiles(lock_cost),
            "lock_ns_per_op": statistics.median(
                1e3 * (a - b) for a, b in zip(samples["kvd"], samples["kvd_unlocked"]))}


def run_bench(quick: bool, out: Path) -> str:
    """`python -m bench` calls this; returns markdown."""
    cpu = max(os.sched_getaffinity(0))
    with pinned({os.getpid(): cpu}):  # (one CPU throughout: no arm's turn migrates mid-chunk)
        rows = [measure(policy, 4 if quick else 201) for policy in ALTERNATIVES]
    write_json(out, "embedded", {"num_blocks": NUM_BLOCKS, "chunk_ops": CHUNK, "cpu": cpu,
                                 "rows": rows})
    table = markdown_table(
        ["policy", "cachetools µs/op", "kvd µs/op", "kvd ÷ cachetools (goal ≤ 3)",
         "lock's cost (goal ≤ 10 %)", "lock's cost, quartiles", "lock ns/op",
         "kvd 1-element blocks ÷ cachetools"],
        [[row["policy"], f"{row['us_per_op']['cachetools']:.2f}",
          f"{row['us_per_op']['kvd']:.2f}", f"{row['kvd_x_cachetools']:.2f}x",
          f"{100 * row['lock_cost']:+.1f} %",
          " to ".join(f"{100 * q:+.1f} %" for q in row["lock_cost_quartiles"][::2]),
          f"{row['lock_ns_per_op']:.0f}", f"{row['kvd_tiny_x_cachetools']:.2f}x"]
         for row in rows])
    return (f"## bench/embedded.py\n\n`kvd.PagedKVCache` ({NUM_BLOCKS} blocks of the default "
            "16 KiB, full) against cachetools, side by side on one pinned CPU: 2 of 3 ops "
            "allocate a new pair (one eviction), 1 of 3 gets the last one. Medians of chunks "
            "taken in turns (the order reversed each round); the lock's cost compares the "
            "public methods with the same code less the lock on one cache.\n\n" + table)


if __name__ == "__main__":
    raise SystemExit(bench_main(__doc__ or "", run_bench))
