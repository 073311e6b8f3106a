"""The embedded cache against cachetools, side by side in one process; and what its lock costs.

The op mix of the seed's measurement: a full cache, where op i allocates a new (layer, position)
pair -- evicting one block -- except every third op, a `get_block` of the pair allocated just
before (a hit). cachetools' `LRUCache`/`LFUCache` of the same size does the same with
`cache[pair] = i` and `cache.get(pair)`. Three kvd arms run beside it:
  * `kvd.PagedKVCache` as users call it (its lock included);
  * the same calls less their lock (the methods the public ones wrap), so the difference
    is what thread safety costs a single thread;
  * kvd on 1-element blocks: the default geometry's blocks are 16 KiB, which an allocation zeroes
    (a reused block must not show its previous pair's data): work cachetools has no counterpart
    for. These rows are the metadata path alone.
The arms take turns in rounds of CHUNK ops each; µs/op are medians over the rounds, and each ratio
is the median of the ratios within a round (arms of one round ran moments apart, so a busy host
moves both sides of a ratio alike).

    python -m bench.embedded [--quick] [--out DIR]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cachetools

from bench.common import bench_main, markdown_table, write_json
from kvd import PagedKVCache

NUM_BLOCKS = 256
NUM_LAYERS = 8
CHUNK = 600  # ops per turn of an arm: short, so the arms of a round meet the same load
ALTERNATIVES = {"lru": cachetools.LRUCache, "lfu": cachetools.LFUCache}
TINY = 1  # block_size and head_dim of the 1-element blocks: the metadata path alone


def pair(op: int) -> tuple[int, int]:
    return op % NUM_LAYERS, op // NUM_LAYERS


def chunk_timer(run_ops: Callable[[int, int], None]) -> Callable[[], float]:
    """A callable timing the next CHUNK ops of `run_ops(first, stop)`, in µs per op."""
    next_op = [NUM_BLOCKS]

    def timed() -> float:
        first = next_op[0]
        start = time.perf_counter_ns()
        run_ops(first, first + CHUNK)
        next_op[0] = first + CHUNK
        return (time.perf_counter_ns() - start) / CHUNK / 1e3

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


def kvd_arm(policy: str, block_size: int = 16, head_dim: int = 128) -> Callable[[], float]:
    cache = filled(policy, block_size, head_dim)

    def run_ops(first: int, stop: int) -> None:
        allocate, get = cache.allocate_block, cache.get_block
        for op in range(first, stop):
            if op % 3 == 2:
                get(*pair(op - 1))
            else:
                allocate(*pair(op))

    return chunk_timer(run_ops)


def kvd_unlocked_arm(policy: str) -> Callable[[], float]:
    """`allocate_block` and `get_block` as written, less their lock: the same calls, each in a
    function of its own as the public methods are, so the difference is the lock alone."""
    cache = filled(policy)
    key_of, get_unlocked, block = cache._key, cache._get, cache._block

    def allocate(layer_id: int, position: int) -> int:
        return cache._allocate(key_of(layer_id, position))

    def get(layer_id: int, position: int) -> Any:
        key = key_of(layer_id, position)
        block_id = get_unlocked(key)
        return None if block_id is None else block(block_id, key)

    def run_ops(first: int, stop: int) -> None:
        for op in range(first, stop):
            if op % 3 == 2:
                get(*pair(op - 1))
            else:
                allocate(*pair(op))

    return chunk_timer(run_ops)


def measure(policy: str, num_chunks: int) -> dict[str, Any]:
    arms = {"cachetools": cachetools_arm(policy), "kvd": kvd_arm(policy),
            "kvd_unlocked": kvd_unlocked_arm(policy), "kvd_tiny": kvd_arm(policy, TINY, TINY)}
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(num_chunks):
        for name, timed in arms.items():
            samples[name].append(timed())
    def ratio(name: str, base: str) -> float:
        return statistics.median(a / b for a, b in zip(samples[name], samples[base]))

    return {"policy": policy,
            "us_per_op": {name: statistics.median(values) for name, values in samples.items()},
            "kvd_x_cachetools": ratio("kvd", "cachetools"),
            "kvd_tiny_x_cachetools": ratio("kvd_tiny", "cachetools"),
            "lock_cost": ratio("kvd", "kvd_unlocked") - 1}


def run_bench(quick: bool, out: Path) -> str:
    """`python -m bench` calls this; returns markdown."""
    rows = [measure(policy, 3 if quick else 101) for policy in ALTERNATIVES]
    write_json(out, "embedded", {"num_blocks": NUM_BLOCKS, "chunk_ops": CHUNK, "rows": rows})
    table = markdown_table(
        ["policy", "cachetools µs/op", "kvd µs/op", "kvd ÷ cachetools (goal ≤ 3)",
         "lock's cost (goal ≤ 10 %)", "kvd 1-element blocks ÷ cachetools"],
        [[row["policy"], f"{row['us_per_op']['cachetools']:.2f}",
          f"{row['us_per_op']['kvd']:.2f}", f"{row['kvd_x_cachetools']:.2f}x",
          f"{100 * row['lock_cost']:+.1f} %", f"{row['kvd_tiny_x_cachetools']:.2f}x"]
         for row in rows])
    return (f"## bench/embedded.py\n\n`kvd.PagedKVCache` ({NUM_BLOCKS} blocks of the default "
            "16 KiB, full) against cachetools, side by side: 2 of 3 ops allocate a new pair "
            "(one eviction), 1 of 3 gets the last one. Medians of alternating chunks.\n\n"
            + table)


if __name__ == "__main__":
    raise SystemExit(bench_main(__doc__ or "", run_bench))
