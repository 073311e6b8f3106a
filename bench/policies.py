"""Per-event cost of every eviction policy vs pool size, and O(1) LFU vs a naive min() LFU.

Each round at N evictable blocks: insert a new key, take a victim, hit a recent key — the
steady state of a full pool; every cell is measured in several turns and the median kept.
Goal (issue 2 item 7): the cost at 1M blocks within 1.5x of the cost at 1k, and LFU's victim
>= 1000x faster than `min()` over a dict at 50k blocks.

Run: `python -m bench.policies [--out DIR]` (about 15 s); DIR gets policies.json and
policies.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.common import pyplot, save_plot, write_json
from kvd.core.policies import POLICIES, make_policy

SIZES = (1_000, 10_000, 100_000, 1_000_000)
NUM_ROUNDS = 100_000
NAIVE_SIZE = 50_000
NUM_TURNS = 3


def per_round_ns(name: str, size: int, num_rounds: int = NUM_ROUNDS) -> float:
    """Nanoseconds per insert + victim + access round with `size` evictable keys."""
    policy = make_policy(name, size)
    for key in range(size):
        policy.inserted(key)
    inserted, victim, accessed = policy.inserted, policy.victim, policy.accessed
    start = time.perf_counter_ns()
    for key in range(size, size + num_rounds):
        inserted(key)
        victim()
        accessed(key - (key & 63))  # a key inserted a few rounds ago: usually still cached
    return (time.perf_counter_ns() - start) / num_rounds


def naive_lfu_victim_ns(size: int, num_victims: int = 50) -> float:
    """`min()` over {key: (frequency, last use)}: the textbook O(n) LFU victim."""
    table = {key: (1 + key % 7, key) for key in range(size)}
    start = time.perf_counter_ns()
    for key in range(size, size + num_victims):
        del table[min(table, key=table.__getitem__)]
        table[key] = (1, key)
    return (time.perf_counter_ns() - start) / num_victims


def lfu_victim_ns(size: int, num_victims: int = 20_000) -> float:
    """kvd's LFU-DA victim (plus the insert that keeps the size steady)."""
    policy = make_policy("lfu", size)
    for key in range(size):
        policy.inserted(key)
        for _ in range(key % 7):
            policy.accessed(key)
    start = time.perf_counter_ns()
    for key in range(size, size + num_victims):
        policy.victim()
        policy.inserted(key)
    return (time.perf_counter_ns() - start) / num_victims


def measure(sizes: tuple[int, ...] = SIZES, num_rounds: int = NUM_ROUNDS,
            naive_size: int = NAIVE_SIZE, num_turns: int = NUM_TURNS) -> dict:
    """Every (policy, size) cell `num_turns` times, a turn going over all cells (sizes in
    alternating order), and each cell's median: measured cell after cell, one policy's sizes
    would be seconds apart, and the 1M / 1k ratio would move with the VM's speed between them."""
    turns: dict[str, dict[int, list[float]]] = {
        name: {size: [] for size in sizes} for name in POLICIES}
    for turn in range(num_turns):
        for size in sizes if turn % 2 == 0 else sizes[::-1]:
            for name in POLICIES:
                turns[name][size].append(per_round_ns(name, size, num_rounds))
    results: dict = {"sizes": list(sizes), "turns": num_turns, "per_round_ns": {},
                     "ratio_1m_1k": {}, "turn_ratios_1m_1k": {}}
    for name, cells in turns.items():
        costs = [statistics.median(cells[size]) for size in sizes]
        results["per_round_ns"][name] = costs
        results["ratio_1m_1k"][name] = costs[-1] / costs[0]
        results["turn_ratios_1m_1k"][name] = [
            last / first for first, last in zip(cells[sizes[0]], cells[sizes[-1]])]
        cells_text = "  ".join(f"{cost:8.0f}" for cost in costs)
        print(f"{name:<8} {cells_text}   1M/1k = {costs[-1] / costs[0]:.2f}", flush=True)
    naive, fast = naive_lfu_victim_ns(naive_size), lfu_victim_ns(naive_size)
    results["lfu_vs_naive_at_50k"] = {"naive_ns": naive, "lfu_ns": fast, "speedup": naive / fast}
    print(f"LFU victim at {naive_size}: naive min() {naive / 1e3:.0f} us, kvd {fast:.0f} ns "
          f"-> {naive / fast:.0f}x (goal >= 1000x)")
    return results


def plot(results: dict, out: Path) -> Path:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, costs in results["per_round_ns"].items():
        axes.plot(results["sizes"], costs, marker="o", label=name)
    axes.set(xscale="log", xlabel="evictable blocks", ylabel="ns per insert+victim+access",
             title=f"Eviction policy cost vs pool size (medians of {results['turns']} turns)")
    axes.set_ylim(bottom=0)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower center", ncol=3)  # below the curves, which start above 300 ns
    return save_plot(figure, out, "policies")


def run_bench(quick: bool, out: Path) -> str:
    """`python -m bench` calls this: measure (quick: 1k and 4k blocks), write JSON and PNG,
    return a markdown section."""
    from bench.common import markdown_table

    results = measure((1_000, 4_000), 2_000, 2_000, 1) if quick else measure()
    write_json(out, "policies", results)
    plot(results, out)
    rows = [[name, *(f"{cost:.0f}" for cost in costs), f"{results['ratio_1m_1k'][name]:.2f} "
             f"({min(results['turn_ratios_1m_1k'][name]):.2f}–"
             f"{max(results['turn_ratios_1m_1k'][name]):.2f})"]
            for name, costs in results["per_round_ns"].items()]
    naive = results["lfu_vs_naive_at_50k"]
    return ("## Policies: ns per insert + victim + access vs evictable blocks (bench/policies.py)"
            "\n\n" + markdown_table(["policy", *(f"{size:,}" for size in results["sizes"]),
                                      "largest / smallest (turns)"], rows)
            + f"\nEach cell is the median of {results['turns']} turn"
            f"{'s' if results['turns'] > 1 else ''}, a turn going over every cell.\n"
            + f"LFU victim vs a naive min() LFU: {naive['speedup']:,.0f}x faster "
            f"({naive['lfu_ns']:.0f} ns vs {naive['naive_ns'] / 1e3:,.0f} µs).\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write policies.json and policies.png here")
    args = parser.parse_args(argv)
    print(f"{'policy':<8} " + "  ".join(f"{size:>8}" for size in SIZES) + "   (ns per round)")
    results = measure()
    if args.out:
        write_json(args.out, "policies", results)
        plot(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
