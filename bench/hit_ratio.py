"""Prefix hit ratio vs capacity for every policy and Belady's OPT on the Mooncake traces.

Prints one markdown table per trace (prefix hit ratio; OPT is the block hit ratio ceiling),
plus kvd's default policy as a fraction of the best of LRU, LFU, ARC, S3-FIFO and SIEVE — the
goal of issue 7 is >= 0.98 everywhere. Traces are read from ../shared/traces (never copied).

Run: `python -m bench.hit_ratio [--mode pool|anchor] [--no-prefix-tree] [--out DIR]` (about a
minute per trace in pool mode); DIR gets hit_ratio_<mode>.md, .json and one PNG per trace.

`--tier-study` instead replays kvd's default policy with decode blocks (kvd/traces.py
`decode_blocks`) under several prefill/decode splits (TIER_SHARES) and prints the prefix hit ratio
of each split, and of no split, per capacity: DIR gets hit_ratio_tiers.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/hit_ratio.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.policies import DEFAULT_POLICY, POLICIES  # noqa: E402
from kvd.replay import DEFAULT_CAPACITIES, MODES, Row, plot_rows, replay_rows  # noqa: E402
from kvd.traces import load_trace  # noqa: E402

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
TRACE_NAMES = ("synthetic_trace.jsonl", "conversation_trace_part1.jsonl")
CLASSIC = ("lru", "lfu", "arc", "s3fifo", "sieve")
TIER_SHARES = (None, "prefill=0.95,decode=0.05", "prefill=0.9,decode=0.1",
               "prefill=0.8,decode=0.2", "prefill=0.7,decode=0.3", "prefill=0.5,decode=0.5")
TIER_CAPACITIES = (1000, 2000, 5000, 10000, 20000)


def markdown(trace_name: str, rows: list[Row]) -> str:
    capacities = sorted({row.capacity for row in rows})
    ratio = {(row.policy, row.capacity): row.prefix_hit_ratio for row in rows}
    opt = {row.capacity: row.opt_hit_ratio for row in rows}
    header = "| policy | " + " | ".join(f"{c // 1000}k" for c in capacities) + " |"
    lines = [f"{trace_name}, prefix hit ratio ({rows[0].mode} replay):", "", header,
             "|---|" + "---:|" * len(capacities)]
    for name in dict.fromkeys(row.policy for row in rows):
        lines.append(f"| {name} | " + " | ".join(f"{ratio[name, c]:.4f}" for c in capacities)
                     + " |")
    lines.append("| Belady OPT (block) | " + " | ".join(f"{opt[c]:.4f}" for c in capacities)
                 + " |")
    best = {c: max(ratio[name, c] for name in CLASSIC) for c in capacities}
    lines.append(f"| {DEFAULT_POLICY} / best of five | "
                 + " | ".join(f"{ratio[DEFAULT_POLICY, c] / best[c]:.3f}" for c in capacities)
                 + " |")
    return "\n".join(lines) + "\n"


def run_bench(quick: bool, out: Path) -> str:
    """`python -m bench` calls this: both traces in pool mode (quick: the first 300 requests at
    two capacities), tables and plots into `out`; a skip note when the traces are absent."""
    title = "## Hit ratio vs capacity, every policy and Belady's OPT (bench/hit_ratio.py)\n\n"
    missing = [name for name in TRACE_NAMES if not (TRACES / name).is_file()]
    if missing:
        return title + f"Skipped: traces {missing} not found under {TRACES.resolve()}.\n"
    capacities = (1000, 2000) if quick else DEFAULT_CAPACITIES
    tables, all_rows = [], {}
    out.mkdir(parents=True, exist_ok=True)
    for trace_name in TRACE_NAMES:
        trace = load_trace(TRACES / trace_name)
        rows = replay_rows(trace[:300] if quick else trace, list(POLICIES), capacities, "pool")
        tables.append(markdown(trace_name, rows))
        all_rows[trace_name] = [asdict(row) for row in rows]
        plot_rows(rows, str(out / f"hit_ratio_pool_{trace_name.split('_')[0]}.png"),
                  f"{trace_name} (pool replay)")
    (out / "hit_ratio_pool.json").write_text(json.dumps(all_rows, indent=1))
    return title + "\n".join(tables)


def tier_study(out: Path | None) -> None:
    """Prefix hit ratio of the default policy with decode blocks, per split and capacity."""
    tables, all_rows = [], {}
    header = "| split | " + " | ".join(f"{c // 1000}k" for c in TIER_CAPACITIES) + " |"
    for trace_name in TRACE_NAMES:
        trace = load_trace(TRACES / trace_name)
        lines = [f"{trace_name}, prefix hit ratio of {DEFAULT_POLICY} with decode blocks "
                 "(pool replay):", "", header, "|---|" + "---:|" * len(TIER_CAPACITIES)]
        all_rows[trace_name] = {}
        for tiers in TIER_SHARES:
            rows = replay_rows(trace, [DEFAULT_POLICY], TIER_CAPACITIES, "pool", tiers=tiers,
                               decode=True)
            all_rows[trace_name][tiers or "none"] = [asdict(row) for row in rows]
            lines.append(f"| {tiers or 'no split'} | "
                         + " | ".join(f"{row.prefix_hit_ratio:.4f}" for row in rows) + " |")
            print(lines[-1], flush=True)
        tables.append("\n".join(lines) + "\n")
        print(tables[-1], flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "hit_ratio_tiers.md").write_text("\n".join(tables))
        (out / "hit_ratio_tiers.json").write_text(json.dumps(all_rows, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="pool")
    parser.add_argument("--no-prefix-tree", action="store_true",
                        help="pool mode: seal without parents (tail-first release only)")
    parser.add_argument("--tier-study", action="store_true",
                        help="measure prefill/decode splits instead (see the module docstring)")
    parser.add_argument("--out", type=Path, help="write the table, JSON rows and plots here")
    args = parser.parse_args(argv)
    missing = [name for name in TRACE_NAMES if not (TRACES / name).is_file()]
    if missing:
        print(f"traces {missing} not found under {TRACES.resolve()}: check out ../shared/traces",
              file=sys.stderr)
        return 2
    if args.tier_study:
        tier_study(args.out)
        return 0
    suffix = "_flat" if args.no_prefix_tree else ""
    tables, all_rows = [], {}
    for trace_name in TRACE_NAMES:
        rows = replay_rows(load_trace(TRACES / trace_name), list(POLICIES), DEFAULT_CAPACITIES,
                           args.mode, prefix_tree=not args.no_prefix_tree)
        tables.append(markdown(trace_name, rows))
        print(tables[-1], flush=True)
        all_rows[trace_name] = [asdict(row) for row in rows]
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            plot_rows(rows, str(args.out / f"hit_ratio_{args.mode}{suffix}_"
                                f"{trace_name.split('_')[0]}.png"),
                      f"{trace_name} ({args.mode} replay)")
    if args.out:
        (args.out / f"hit_ratio_{args.mode}{suffix}.md").write_text("\n".join(tables))
        (args.out / f"hit_ratio_{args.mode}{suffix}.json").write_text(json.dumps(all_rows,
                                                                                 indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
