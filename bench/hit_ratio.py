"""Prefix hit ratio vs capacity for every policy and Belady's OPT on the Mooncake traces.

Prints one markdown table per trace (prefix hit ratio; OPT is the block hit ratio ceiling),
plus kvd's default policy as a fraction of the best of LRU, LFU, ARC, S3-FIFO and SIEVE — the
goal of issue 7 is >= 0.98 everywhere. Traces are read from ../shared/traces (never copied).

Run: `python -m bench.hit_ratio [--mode pool|anchor] [--no-prefix-tree] [--out DIR]` (about a
minute per trace in pool mode); DIR gets hit_ratio_<mode>.md, .json and one PNG per trace.

`--tier-study` instead replays kvd's default policy with decode blocks (kvd/traces.py
`decode_blocks`) under several prefill/decode splits (TIER_SHARES) and prints the prefix hit ratio
of each split, and of no split, per capacity: DIR gets hit_ratio_tiers.md and .json.

`--generalisation` checks the default policy on traces its design never saw (about 10 minutes):
each Mooncake trace's halves, a 50% sample of its requests and of its conversations, four copies
with 2% of the requests dropped (how much a cell moves by chance), and generated traces with other
reuse (`generated_trace`). It prints kvd / best of five per cell in both modes and a summary per
group of traces: DIR gets hit_ratio_generalisation.md and .json.

`--sharing` (issue 31 item 4, a few minutes) replays the conversation trace into pool A and the
synthetic trace into pool B, interleaved by timestamp, the pools sharing one budget through
kvd/core/arena.py, next to every static split of that budget from 10 % to 90 %, at five budgets:
DIR gets hit_ratio_sharing[_PAIRING].md and .json. `--pairing` replays another pair instead
(SHARING_PAIRINGS: the traces swapped, equal block sizes, generated traces), to check that the
arena's rule is not fitted to the first pair.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypedDict

from bench.common import SHARED_TRACES as TRACES
from bench.common import markdown_table, write_json
from kvd.core.policies import DEFAULT_POLICY, POLICIES
from kvd.replay import DEFAULT_CAPACITIES, MODES, Row, plot_rows, replay_rows, replay_shared
from kvd.traces import Request, load_trace

TRACE_NAMES = ("synthetic_trace.jsonl", "conversation_trace_part1.jsonl")
CLASSIC = ("lru", "lfu", "arc", "s3fifo", "sieve")
TIER_SHARES = (None, "prefill=0.95,decode=0.05", "prefill=0.9,decode=0.1",
               "prefill=0.8,decode=0.2", "prefill=0.7,decode=0.3", "prefill=0.5,decode=0.5")
TIER_CAPACITIES = (1000, 2000, 5000, 10000, 20000)


class TraceKnobs(TypedDict, total=False):
    """generated_trace's keyword arguments (its docstring says what each does)."""
    p_new: float
    num_live: int
    recent_bias: bool
    num_documents: int
    turn_blocks: tuple[int, int]
    p_one_shot: float


class SharingRow(TypedDict):
    """--sharing at one budget: the arena's combined prefix hit ratio beside each static split's
    (by percent of the budget to pool A)."""
    budget_blocks: int
    budget_nbytes: int
    arena: float
    static: dict[int, float]
    best_share_a: int
    arena_of_best: float
    arena_of_half: float
    best_of_half: float


# Generated traces for --generalisation: (name, seed, generated_trace keywords).
GENERATED: tuple[tuple[str, int, TraceKnobs], ...] = (
    ("chat", 11, {}),  # multi-turn chats, any live conversation may continue
    ("chat-recent", 12, {"recent_bias": True, "num_live": 2000}),  # recent ones likelier
    ("documents", 13, {"p_new": 0.6, "num_documents": 800, "turn_blocks": (1, 3)}),
    ("scans", 14, {"p_one_shot": 0.5, "num_live": 300}),  # half are never-reused one-shots
)
NUM_DROPPED_COPIES = 4
# --sharing: pool A's blocks (a 32-layer bfloat16 model) and pool B's (a 4x smaller one), and the
# budgets in blocks of their mean size, from tight to ample.
SHARING_BLOCK_NBYTES = (2 << 20, 512 << 10)
SHARING_BUDGETS = (1000, 2000, 5000, 10000, 20000)
# --pairing NAME: (pool A's trace, pool B's trace, block bytes), traces named as in
# generalisation_traces() or TRACE_NAMES.
SHARING_PAIRINGS = {
    "conversation-synthetic": (TRACE_NAMES[1], TRACE_NAMES[0], SHARING_BLOCK_NBYTES),
    "synthetic-conversation": (TRACE_NAMES[0], TRACE_NAMES[1], SHARING_BLOCK_NBYTES),
    "equal-blocks": (TRACE_NAMES[1], TRACE_NAMES[0], (1 << 20, 1 << 20)),
    "documents-chat": ("generated documents", "generated chat-recent", SHARING_BLOCK_NBYTES),
    "scans-chat": ("generated scans", "generated chat", (2 << 20, 768 << 10)),
}


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


def replay_all(out: Path | None, mode: str, capacities: tuple[int, ...] | list[int],
               num_requests: int | None = None, prefix_tree: bool = True) -> str:
    """Every policy on both traces (their first `num_requests` requests if given): the tables,
    and into `out` hit_ratio_<mode>[_flat].md and .json and one PNG per trace."""
    suffix = "" if prefix_tree else "_flat"
    tables, all_rows = [], {}
    for trace_name in TRACE_NAMES:
        trace = load_trace(TRACES / trace_name)[:num_requests]
        rows = replay_rows(trace, list(POLICIES), capacities, mode, prefix_tree=prefix_tree)
        tables.append(markdown(trace_name, rows))
        all_rows[trace_name] = [asdict(row) for row in rows]
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            plot_rows(rows, str(out / f"hit_ratio_{mode}{suffix}_{trace_name.split('_')[0]}.png"),
                      f"{trace_name} ({mode} replay)")
    if out is not None:
        write_json(out, f"hit_ratio_{mode}{suffix}", all_rows)
        (out / f"hit_ratio_{mode}{suffix}.md").write_text("\n".join(tables))
    return "\n".join(tables)


def run_bench(quick: bool, out: Path) -> str:
    """Both traces in pool mode (quick: the first 300 requests at two capacities); a skip note
    when the traces are absent."""
    title = "## Hit ratio vs capacity, every policy and Belady's OPT (bench/hit_ratio.py)\n\n"
    missing = [name for name in TRACE_NAMES if not (TRACES / name).is_file()]
    if missing:
        return title + (f"Skipped: traces {missing} not found under {TRACES.resolve()} (set "
                        "KVD_TRACES to their directory).\n")
    if quick:
        return title + replay_all(out, "pool", (1000, 2000), num_requests=300)
    return title + replay_all(out, "pool", DEFAULT_CAPACITIES)


def tier_study(out: Path | None) -> None:
    """Prefix hit ratio of the default policy with decode blocks, per split and capacity."""
    tables: list[str] = []
    all_rows: dict[str, dict[str, list[dict[str, Any]]]] = {}  # trace, split: replay rows
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
        write_json(out, "hit_ratio_tiers", all_rows)
        (out / "hit_ratio_tiers.md").write_text("\n".join(tables))


# ---- --generalisation -------------------------------------------------------------------------
def generated_trace(num_requests: int = 6000, seed: int = 0, *, p_new: float = 0.25,
                    num_live: int = 600, recent_bias: bool = False, num_documents: int = 0,
                    turn_blocks: tuple[int, int] = (1, 8),
                    p_one_shot: float = 0.0) -> list[Request]:
    """Chat traffic with knobs for its reuse: each request starts a conversation (probability
    `p_new`; one of 4 system prompts, then with `num_documents` a Zipf-popular shared document,
    then 4 turns' worth of new blocks) or extends a live one by `turn_blocks` new blocks;
    `num_live` conversations stay live (one from the older half ends at random when a new one
    starts); `recent_bias` picks conversation i of n with weight 1 / (n - i); `p_one_shot` adds
    long requests that are never reused."""
    rng = random.Random(seed)
    ids = itertools.count(1)
    systems = [[next(ids) for _ in range(rng.randint(1, 4))] for _ in range(4)]
    documents = [[next(ids) for _ in range(rng.randint(10, 60))] for _ in range(num_documents)]
    weights = [1 / rank for rank in range(1, num_documents + 1)]
    live: list[list[int]] = []
    trace = []
    for number in range(num_requests):
        if rng.random() < p_one_shot:
            chain = rng.choice(systems) + [next(ids) for _ in range(rng.randint(5, 80))]
        elif not live or rng.random() < p_new:
            chain = list(rng.choice(systems))
            if documents:
                chain += rng.choices(documents, weights)[0]
            chain += [next(ids) for _ in range(rng.randint(*turn_blocks) * 4)]
            live.append(chain)
            if len(live) > num_live:
                live.pop(rng.randrange(len(live) // 2))
        else:
            choice = rng.choices(live, [1 / (len(live) - i) for i in range(len(live))])[0] \
                if recent_bias else rng.choice(live)
            choice.extend(next(ids) for _ in range(rng.randint(*turn_blocks)))
            chain = choice
        trace.append(Request(number * 300, len(chain) * 512 - rng.randrange(512), 200,
                             tuple(chain)))
    return trace


def conversation_sample(trace: list[Request], share: float, seed: int) -> list[Request]:
    """Whole conversations, kept with probability `share`: a request belongs to the conversation
    named by its first block that not every request shares (a common system prompt)."""
    common = set.intersection(*(set(request.hash_ids) for request in trace))
    kept = []
    for request in trace:
        name = next((key for key in request.hash_ids if key not in common), request.hash_ids[0])
        if random.Random(f"{seed}:{name}").random() < share:
            kept.append(request)
    return kept


def generalisation_traces() -> dict[str, list[Request]]:
    """Every trace --generalisation replays, by name (module docstring)."""
    traces = {}
    for trace_name in TRACE_NAMES:
        trace, short = load_trace(TRACES / trace_name), trace_name.split("_")[0]
        half = len(trace) // 2
        traces[f"{short} first half"], traces[f"{short} second half"] = trace[:half], trace[half:]
        rng = random.Random(1)
        traces[f"{short} 50% of requests"] = [r for r in trace if rng.random() < 0.5]
        traces[f"{short} 50% of conversations"] = conversation_sample(trace, 0.5, 1)
        for seed in range(1, NUM_DROPPED_COPIES + 1):
            rng = random.Random(seed)
            traces[f"{short} 2% dropped #{seed}"] = [r for r in trace if rng.random() >= 0.02]
    for name, seed, knobs in GENERATED:
        traces[f"generated {name}"] = generated_trace(seed=seed, **knobs)
    documents, scans = GENERATED[2][2], GENERATED[3][2]
    first, second = generated_trace(3000, 15, **documents), generated_trace(3000, 16, **scans)
    offset = 1 + max(key for request in first for key in request.hash_ids)
    traces["generated documents, then scans"] = first + [
        Request(r.timestamp_ms, r.input_length, r.output_length,
                tuple(key + offset for key in r.hash_ids)) for r in second]
    return traces


def generalisation(out: Path | None) -> None:
    """kvd / best of five on every generalisation trace, both modes (module docstring)."""
    header = "| trace | mode | " + " | ".join(f"{c // 1000}k" for c in DEFAULT_CAPACITIES) + " |"
    lines = [f"{DEFAULT_POLICY} / best of {', '.join(CLASSIC)} (prefix hit ratio):", "", header,
             "|---|---|" + "---:|" * len(DEFAULT_CAPACITIES)]
    # trace → mode → policy → ratios
    all_rows: dict = {"capacities": list(DEFAULT_CAPACITIES)}
    groups: dict[str, list[float]] = {"halves and samples": [], "2% dropped": [], "generated": []}
    for trace_name, trace in generalisation_traces().items():
        group = "2% dropped" if "dropped" in trace_name else \
            "generated" if trace_name.startswith("generated") else "halves and samples"
        all_rows[trace_name] = {}
        for mode in MODES:
            rows = replay_rows(trace, [*CLASSIC, DEFAULT_POLICY], DEFAULT_CAPACITIES, mode)
            all_rows[trace_name][mode] = {
                name: [row.prefix_hit_ratio for row in rows if row.policy == name]
                for name in (*CLASSIC, DEFAULT_POLICY)}
            cells = [_of_best(rows, capacity) for capacity in DEFAULT_CAPACITIES]
            groups[group].extend(cells)
            lines.append(f"| {trace_name} | {mode} | " + " | ".join(f"{x:.3f}" for x in cells)
                         + " |")
            print(lines[-1], flush=True)
    lines.append("")
    for group, ratios in ((group, ratios) for group, ratios in groups.items() if ratios):
        lines.append(f"- {group}: {len(ratios)} cells, {sum(x >= 0.98 for x in ratios)} at "
                     f">= 0.98, worst {min(ratios):.3f}, mean {sum(ratios) / len(ratios):.3f}")
        print(lines[-1])
    if out:
        write_json(out, "hit_ratio_generalisation", all_rows)
        (out / "hit_ratio_generalisation.md").write_text("\n".join(lines) + "\n")


def _of_best(rows: list[Row], capacity: int) -> float:
    ratio = {row.policy: row.prefix_hit_ratio for row in rows if row.capacity == capacity}
    best = max(ratio[name] for name in CLASSIC)
    return ratio[DEFAULT_POLICY] / best if best else 1.0


def sharing_trace(name: str) -> list[Request]:
    """A trace of TRACE_NAMES, or a generated one of GENERATED ("generated NAME")."""
    if name in TRACE_NAMES:
        return load_trace(TRACES / name)
    _, seed, knobs = next(each for each in GENERATED if f"generated {each[0]}" == name)
    return generated_trace(seed=seed, **knobs)


def sharing(out: Path | None, pairing: str = "conversation-synthetic") -> None:
    """Issue 31 item 4: by default the conversation trace into pool A, the synthetic one into
    pool B (block bytes SHARING_BLOCK_NBYTES), interleaved by timestamp, sharing one budget: the
    arena vs every static split 10 %..90 % to A, at five budgets (in blocks of the mean block
    size). `pairing` names another pair of SHARING_PAIRINGS."""
    name_a, name_b, block_nbytes = SHARING_PAIRINGS[pairing]
    traces = [sharing_trace(name_a), sharing_trace(name_b)]

    def ratio(shares: list[float] | None, budget: int) -> float:
        counts = replay_shared(traces, block_nbytes, budget, DEFAULT_POLICY, shares)
        return (sum(count.num_prefix_hits for count in counts)
                / sum(count.num_refs for count in counts))

    rows: list[SharingRow] = []
    for num_blocks in SHARING_BUDGETS:
        budget = num_blocks * sum(block_nbytes) // len(block_nbytes)
        static = {share: ratio([share / 100, 1 - share / 100], budget)
                  for share in range(10, 100, 10)}
        best = max(static, key=static.__getitem__)
        shared = ratio(None, budget)
        rows.append({"budget_blocks": num_blocks, "budget_nbytes": budget, "arena": shared,
                     "static": static, "best_share_a": best,
                     "arena_of_best": shared / static[best],
                     "arena_of_half": shared / static[50],
                     "best_of_half": static[best] / static[50]})
        print(f"budget {num_blocks}: arena {shared:.4f}, best static {static[best]:.4f} "
              f"({best}% to A), 50/50 {static[50]:.4f}", file=sys.stderr)
    table = markdown_table(
        ("budget (mean blocks)", "arena", "best static (A share)", "50/50", "arena / best",
         "arena / 50-50", "best / 50-50"),
        [(row["budget_blocks"], f"{row['arena']:.4f}",
          f"{row['static'][row['best_share_a']]:.4f} ({row['best_share_a']}%)",
          f"{row['static'][50]:.4f}", f"{row['arena_of_best']:.3f}", f"{row['arena_of_half']:.3f}",
          f"{row['best_of_half']:.3f}") for row in rows])
    text = ("Two traces into two pools sharing one budget, combined prefix hit ratio "
            f"(A: {name_a}, {block_nbytes[0]} B blocks; B: {name_b}, "
            f"{block_nbytes[1]} B blocks; policy {DEFAULT_POLICY}):\n\n" + table)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = "hit_ratio_sharing" + ("" if pairing == "conversation-synthetic" else f"_{pairing}")
        (out / f"{stem}.md").write_text(text)
        write_json(out, stem, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="pool")
    parser.add_argument("--no-prefix-tree", action="store_true",
                        help="pool mode: seal without parents (tail-first release only)")
    parser.add_argument("--tier-study", action="store_true",
                        help="measure prefill/decode splits instead (see the module docstring)")
    parser.add_argument("--generalisation", action="store_true",
                        help="check the default policy on unseen traces (module docstring)")
    parser.add_argument("--sharing", action="store_true",
                        help="two traces into two pools sharing a budget (module docstring)")
    parser.add_argument("--pairing", choices=SHARING_PAIRINGS, default="conversation-synthetic",
                        help="--sharing: the pair of traces (module docstring)")
    parser.add_argument("--out", type=Path, help="write the table, JSON rows and plots here")
    args = parser.parse_args(argv)
    missing = [name for name in TRACE_NAMES if not (TRACES / name).is_file()]
    if missing:
        print(f"traces {missing} not found under {TRACES.resolve()}: check out ../shared/traces "
              "or set KVD_TRACES", file=sys.stderr)
        return 2
    if args.tier_study:
        tier_study(args.out)
        return 0
    if args.generalisation:
        generalisation(args.out)
        return 0
    if args.sharing:
        sharing(args.out, args.pairing)
        return 0
    print(replay_all(args.out, args.mode, DEFAULT_CAPACITIES, prefix_tree=not args.no_prefix_tree))
    return 0


if __name__ == "__main__":
    sys.exit(main())
