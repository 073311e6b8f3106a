"""`kvd replay`: replay a block-hash trace against eviction policies and Belady's optimum.

Theory of operation
-------------------
A trace (kvd/traces.py) lists, per request, the content keys of its prompt blocks, head first.
Replay feeds them to the *same policy objects the daemon runs* at each capacity, in one of two
modes:

``pool`` (default) drives `kvd.core.pool.BlockPool` exactly as an engine drives the daemon:
    `lookup` pins the longest cached prefix; every later key that is still cached is pinned too
    (a block hit that an engine could reuse only by recomputing the gap); the missing keys are
    allocated (evicting as the policy says) and sealed; at the end of the request everything is
    released, and the pool makes the blocks evictable tail first. A request's own blocks are
    pinned while it runs, so it never evicts itself. When a request needs more blocks than the
    pool can give, its tail is simply not cached. Blocks are sealed with their parent's key, as
    the page table does, so the pool's prefix tree is on (`prefix_tree=False` measures without).
    With `decode`, each request also writes the full blocks its output fills, as decode-tier
    blocks under the keys kvd/traces.py `decode_blocks` gives them (a follow-up turn's keys where
    one exists), before it releases; `tiers` runs the policy as a TieredPolicy.

``anchor`` is the reference semantics of ../shared/traces/SOURCES.md: each block reference alone,
    head first; hit → `accessed`; miss → `victim()` if full, then `inserted`. Nothing is pinned,
    so a long request can evict its own head. It reproduces the published table exactly (LRU
    0.0825 / 0.2791 / 0.4235 prefix hit ratio on synthetic_trace.jsonl at 1k / 5k / 10k blocks)
    and is what the anchor test checks.

``--remote-capacity`` (two levels, pool semantics): a fleet of `--hosts` daemons, each with a
    pool of the local capacity, over one shared remote tier of the remote capacity (blocks),
    modelled as LRU (Redis' allkeys-lru approximates it). Requests are dealt to the hosts in turn,
    as a load balancer without affinity does: a conversation's next turn lands anywhere. Each
    request is served as the daemon serves it: the local prefix, then the consecutive keys after
    it that the remote tier holds (imported: allocated and sealed locally, counted as prefix
    hits), then the rest as in pool mode. What is written remotely is `--remote-write`: `all`
    (every block a host computes, kvd's choice) or `hit` (a block once it is hit locally).
    Remote capacity 0 is the same fleet without the tier: local alone.

Metrics per (policy, capacity):
  * prefix hit ratio — leading hits of each request / block references: what an engine reuses;
  * block hit ratio — every hit / block references;
  * token hit ratio — prompt tokens covered by the leading hits / prompt tokens (the last block
    of a prompt is partial, so this weighs it by the tokens it really holds);
  * OPT — Belady's offline optimum block hit ratio over the same reference stream with every miss
    inserted (anchor semantics), and the prefix hit ratio as a fraction of it.

Belady's OPT in O(n log n): one backward pass computes each reference's next-use index; the
cache is a dict key → next use plus a max-heap of (next use, key) with lazy deletion (stale heap
entries are skipped when popped). The victim is the cached key used farthest in the future.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Callable, Hashable, Iterable, Sequence
from collections import OrderedDict
from dataclasses import asdict, dataclass

from kvd.errors import BadArgsError
from kvd.core.policies import (DEFAULT_POLICY, POLICIES, TIER_DECODE, TieredPolicy,
                               make_policy)
from kvd.core.arena import Arena
from kvd.core.pool import BlockPool
from kvd.traces import TRACE_BLOCK_TOKENS, Request, decode_blocks, load_trace

MODES = ("pool", "anchor")
REMOTE_WRITES = ("all", "hit")
DEFAULT_CAPACITIES = (1000, 2000, 5000, 10000, 20000, 50000)
_OWNER = 1  # replay plays one engine; requests run one after another


@dataclass
class Counts:
    """Hit counts of one replay."""

    num_refs: int = 0
    num_hits: int = 0
    num_prefix_hits: int = 0
    num_tokens: int = 0
    num_prefix_tokens: int = 0

    def add_request(self, request: Request, num_prefix_hits: int, num_hits: int) -> None:
        self.num_refs += len(request.hash_ids)
        self.num_hits += num_hits
        self.num_prefix_hits += num_prefix_hits
        self.num_tokens += request.input_length
        self.num_prefix_tokens += min(num_prefix_hits * TRACE_BLOCK_TOKENS, request.input_length)


@dataclass
class Row:
    """One line of `kvd replay --json`."""

    policy: str
    capacity: int
    prefix_hit_ratio: float
    block_hit_ratio: float
    token_hit_ratio: float
    opt_hit_ratio: float
    fraction_of_opt: float
    mode: str


# ---- the two replay modes --------------------------------------------------------------------
def replay_anchor(trace: Sequence[Request], policy_name: str, capacity: int) -> Counts:
    """Reference semantics: per block reference, head first; hit → access, miss → insert."""
    policy = make_policy(policy_name, capacity)
    cached: set[Hashable] = set()
    counts = Counts()
    for request in trace:
        num_prefix = num_hits = 0
        is_prefix = True
        for key in request.hash_ids:
            if key in cached:
                policy.accessed(key)
                num_hits += 1
                num_prefix += is_prefix
                continue
            is_prefix = False
            if len(cached) >= capacity:
                cached.remove(policy.victim())
            cached.add(key)
            policy.inserted(key)
        counts.add_request(request, num_prefix, num_hits)
    return counts


def replay_pool(trace: Sequence[Request], policy_name: str, capacity: int, *,
                tiers: str | None = None, decode: Sequence[Sequence[int]] | None = None,
                prefix_tree: bool = True) -> Counts:
    """Drive a BlockPool as an engine drives the daemon (see the module docstring).

    Args:
        tiers: a `--tiers` text: run the policy as a prefill/decode TieredPolicy.
        decode: per request, the keys of the blocks its decode writes (`decode_blocks(trace)`).
        prefix_tree: seal with parents (the pool's strict prefix awareness), as the daemon does.
    """
    pool = BlockPool(capacity, make_policy(policy_name, capacity, tiers=tiers))
    counts = Counts()
    for number, request in enumerate(trace):
        _replay_request(pool, request, counts, prefix_tree,
                        None if decode is None else decode[number])
    return counts


def _replay_request(pool: BlockPool, request: Request, counts: Counts, prefix_tree: bool,
                    written: Sequence[int] | None = None) -> None:
    """One request of pool mode: lookup, pin later hits, write the rest (and `written`)."""
    keys = request.hash_ids
    block_ids = pool.lookup(keys, _OWNER)
    num_prefix = len(block_ids)
    num_hits = num_prefix + _pin_later_hits(pool, keys, num_prefix, block_ids, prefix_tree)
    if written:
        parent = keys[request.input_length // TRACE_BLOCK_TOKENS - 1] \
            if request.input_length >= TRACE_BLOCK_TOKENS else None
        _write(pool, written, [parent, *written[:-1]], block_ids, prefix_tree, TIER_DECODE)
    pool.release(block_ids, _OWNER)
    counts.add_request(request, num_prefix, num_hits)


def replay_shared(traces: Sequence[Sequence[Request]], block_nbytes: Sequence[int],
                  budget_nbytes: int, policy_name: str,
                  shares: Sequence[float] | None = None) -> list[Counts]:
    """Replay traces into one pool each, interleaved by timestamp, the pools sharing a budget.

    With `shares` (fractions of the budget, one per pool) each pool is a BlockPool of its static
    share; without, the pools are one kvd.core.arena.Arena's, taking memory where the demand is
    (issue 31 item 4). Pool mode, prefix tree on. Returns one Counts per trace.
    """
    if shares is None:
        arena = Arena(budget_nbytes, block_nbytes)
        pools: list[BlockPool] = [arena.add_pool(number, policy_name)
                                  for number in range(len(traces))]
    else:
        pools = [BlockPool(max(1, int(share * budget_nbytes) // nbytes),
                           make_policy(policy_name, max(1, int(share * budget_nbytes) // nbytes)))
                 for share, nbytes in zip(shares, block_nbytes)]
    counts = [Counts() for _ in traces]
    merged = heapq.merge(*([(request.timestamp_ms, number, request) for request in trace]
                           for number, trace in enumerate(traces)), key=lambda item: item[:2])
    for _, number, request in merged:
        _replay_request(pools[number], request, counts[number], prefix_tree=True)
    return counts


def _pin_later_hits(pool: BlockPool, keys: Sequence[int], num_prefix: int, block_ids: list[int],
                    prefix_tree: bool) -> int:
    """Pin cached keys after the prefix, allocate and seal the missing ones; return the hits.

    Appends to `block_ids` in chain order so that releasing them makes the tail evictable first.
    """
    num_hits = 0
    missing: list[int] = []
    parents: list[int | None] = []
    for position in range(num_prefix, len(keys)):
        block_id = pool.touch(keys[position])
        if block_id is None:
            missing.append(keys[position])
            parents.append(keys[position - 1] if position else None)
            continue
        pool.pin([block_id], _OWNER)
        block_ids.append(block_id)
        num_hits += 1
    _write(pool, missing, parents, block_ids, prefix_tree)
    return num_hits


def _write(pool: BlockPool, keys: Sequence[int], parents: Sequence[int | None],
           block_ids: list[int], prefix_tree: bool, tier: int = 0) -> None:
    """Allocate and seal as many of `keys` (head first) as the pool can hold."""
    num_blocks = min(len(keys), pool.num_available)
    new_ids = pool.allocate(num_blocks, _OWNER) or []
    pool.seal(new_ids, keys[:num_blocks], _OWNER, parents[:num_blocks] if prefix_tree else None,
              [tier] * num_blocks)
    block_ids.extend(new_ids)




# ---- two levels: hosts over a shared remote tier ---------------------------------------------
@dataclass
class TwoLevelRow:
    """One line of `kvd replay --remote-capacity ... --json`."""

    policy: str
    capacity: int  # per host
    remote_capacity: int  # 0: no remote tier
    hosts: int
    remote_write: str
    prefix_hit_ratio: float  # local and remote prefix hits / block references
    remote_hit_ratio: float  # the remote part of it
    writes_per_ref: float  # blocks written to the remote tier / block references


class RemoteLRU:
    """The shared remote tier of a two-level replay: LRU over `capacity` keys."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()
        self.num_writes = 0

    def read(self, keys: Sequence[int]) -> list[int]:
        """The consecutive head of `keys` held here (each one touched)."""
        found = []
        for key in keys:
            if key not in self.keys:
                break
            self.keys.move_to_end(key)
            found.append(key)
        return found

    def write(self, keys: Iterable[int]) -> None:
        for key in keys:
            if self.capacity <= 0:
                return
            self.num_writes += 1
            self.keys[key] = None
            self.keys.move_to_end(key)
            if len(self.keys) > self.capacity:
                self.keys.popitem(last=False)


def replay_two_level(trace: Sequence[Request], policy_name: str, capacity: int,
                     remote_capacity: int, num_hosts: int = 1, write: str = "all"
                     ) -> tuple[Counts, int, int]:
    """The fleet of the module docstring: (counts, remote prefix hits, remote writes)."""
    pools = [BlockPool(capacity, make_policy(policy_name, capacity)) for _ in range(num_hosts)]
    remote = RemoteLRU(remote_capacity)
    counts = Counts()
    num_remote_hits = 0
    for number, request in enumerate(trace):
        pool, keys = pools[number % num_hosts], request.hash_ids
        block_ids = pool.lookup(keys, _OWNER)
        num_local = len(block_ids)
        if write == "hit":  # (a block written once hit, if the tier lacks it)
            remote.write(key for key in keys[:num_local] if key not in remote.keys)
        fetched = remote.read(keys[num_local:])
        _write(pool, fetched, [keys[i - 1] if i else None
                               for i in range(num_local, num_local + len(fetched))],
               block_ids, True)
        num_prefix = len(block_ids)
        num_remote_hits += num_prefix - num_local
        missing = [key for key in keys[num_prefix:] if pool.find(key) is None]
        num_hits = num_prefix + _pin_later_hits(pool, keys, num_prefix, block_ids, True)
        if write == "all":  # what this host computed and sealed
            remote.write(key for key in missing if pool.find(key) is not None)
        pool.release(block_ids, _OWNER)
        counts.add_request(request, num_prefix, num_hits)
    return counts, num_remote_hits, remote.num_writes


def two_level_rows(trace: Sequence[Request], policy_names: Sequence[str],
                   capacities: Sequence[int], remote_capacities: Sequence[int],
                   num_hosts: int, writes: Sequence[str],
                   progress: Callable[[str], None] | None = None) -> list[TwoLevelRow]:
    """Replay every (policy, capacity, remote capacity, write choice); one row each."""
    for write in writes:
        if write not in REMOTE_WRITES:
            raise BadArgsError(f"--remote-write takes {' or '.join(REMOTE_WRITES)}, got {write!r}")
    if num_hosts < 1:
        raise BadArgsError(f"--hosts must be at least 1, got {num_hosts}")
    num_refs = max(1, sum(len(request.hash_ids) for request in trace))
    rows = []
    for name in policy_names:
        for capacity in capacities:
            for remote_capacity in remote_capacities:
                for write in writes if remote_capacity else writes[:1]:
                    if progress:
                        progress(f"{name} @ {capacity} + {remote_capacity} remote ({write})")
                    counts, remote_hits, num_writes = replay_two_level(
                        trace, name, capacity, remote_capacity, num_hosts, write)
                    rows.append(TwoLevelRow(name, capacity, remote_capacity, num_hosts,
                                            write if remote_capacity else "-",
                                            counts.num_prefix_hits / num_refs,
                                            remote_hits / num_refs, num_writes / num_refs))
    return rows


def format_two_level(rows: Sequence[TwoLevelRow]) -> str:
    lines = [f"{'policy':<10} {'hosts':>5} {'capacity':>9} {'remote':>9} {'write':>5} "
             f"{'prefix':>7} {'remote':>7} {'writes/ref':>10}"]
    for row in rows:
        lines.append(f"{row.policy:<10} {row.hosts:>5} {row.capacity:>9} "
                     f"{row.remote_capacity:>9} {row.remote_write:>5} "
                     f"{row.prefix_hit_ratio:>7.4f} {row.remote_hit_ratio:>7.4f} "
                     f"{row.writes_per_ref:>10.3f}")
    return "\n".join(lines)


# ---- Belady's OPT ------------------------------------------------------------------------------
def reference_stream(trace: Iterable[Request],
                     decode: Sequence[Sequence[int]] | None = None) -> list[int]:
    """Every block reference of the trace, in order; with `decode`, each request's decode writes
    follow its prompt (each is written once, so they are misses and add no hits to OPT)."""
    if decode is None:
        return [key for request in trace for key in request.hash_ids]
    return [key for request, written in zip(trace, decode)
            for key in (*request.hash_ids, *written)]


def next_uses(refs: Sequence[int]) -> list[int]:
    """For each reference, the index of the next reference to the same key (len(refs) if none)."""
    never = len(refs)
    result = [never] * len(refs)
    last_seen: dict[int, int] = {}
    for index in range(len(refs) - 1, -1, -1):
        result[index] = last_seen.get(refs[index], never)
        last_seen[refs[index]] = index
    return result


def belady_hits(refs: Sequence[int], capacity: int) -> int:
    """Hits of Belady's OPT with every miss inserted (no bypass), in O(n log n)."""
    following = next_uses(refs)
    next_use: dict[int, int] = {}  # cached key → index of its next reference
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries skipped lazily
    num_hits = 0
    for index, key in enumerate(refs):
        if key in next_use:
            num_hits += 1
        elif len(next_use) >= capacity:
            while True:
                negated_use, candidate = heapq.heappop(heap)
                if next_use.get(candidate) == -negated_use:
                    break
            del next_use[candidate]
        next_use[key] = following[index]
        heapq.heappush(heap, (-following[index], key))
    return num_hits


# ---- rows, output, CLI -----------------------------------------------------------------------
def replay_rows(trace: Sequence[Request], policy_names: Sequence[str],
                capacities: Sequence[int], mode: str = "pool",
                progress: Callable[[str], None] | None = None, *, tiers: str | None = None,
                decode: bool = False, prefix_tree: bool = True) -> list[Row]:
    """Replay every (policy, capacity) and Belady's OPT; one Row each.

    `tiers`, `decode` and `prefix_tree` are replay_pool's (pool mode only); with `decode` the
    ratios still count prompt references only, and the Row's mode reads `pool+decode`. A Row's
    policy is `policy_label`'s: with `tiers`, names that run the same split give one row.
    """
    if mode == "anchor" and (tiers or decode or not prefix_tree):
        raise BadArgsError("--tiers and --decode need --mode pool (anchor is the reference "
                           "semantics: prompt blocks only, no pool)")
    runs: dict[str, str] = {}  # label -> the first policy name that runs it
    for name in policy_names:
        runs.setdefault(policy_label(name, tiers), name)
    written = decode_blocks(trace) if decode else None
    num_refs = max(1, sum(len(request.hash_ids) for request in trace))
    refs = reference_stream(trace, written)
    rows = []
    for capacity in capacities:
        opt_ratio = belady_hits(refs, capacity) / num_refs
        for label, name in runs.items():
            if progress:
                progress(f"{label} @ {capacity} blocks")
            if mode == "anchor":
                counts = replay_anchor(trace, name, capacity)
            else:
                counts = replay_pool(trace, name, capacity, tiers=tiers, decode=written,
                                     prefix_tree=prefix_tree)
            prefix_ratio = counts.num_prefix_hits / num_refs
            rows.append(Row(label, capacity, prefix_ratio, counts.num_hits / num_refs,
                            counts.num_prefix_tokens / max(1, counts.num_tokens), opt_ratio,
                            prefix_ratio / opt_ratio if opt_ratio else 0.0,
                            mode + "+decode" if decode else mode))
    return rows


def policy_label(name: str, tiers: str | None = None) -> str:
    """What a row ran: `name`, or with `tiers` the split as the pool runs it, e.g.
    `tiered(prefill=0.7:lru,decode=0.3:lfu)`: a tier that names its own policy ignores `name`.

    Raises:
        BadArgsError: bad tiers, or an unknown policy in them.
    """
    if not tiers:
        return name
    # (the split's description does not depend on the capacity: the smallest that has 2 tiers)
    policy = make_policy(name, 2, tiers=tiers)
    assert isinstance(policy, TieredPolicy)  # (what make_policy builds for tiers)
    return f"tiered({policy.describe()})"


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width table of the rows, one line per (policy, capacity)."""
    width = max([10, *(len(row.policy) for row in rows)])
    lines = [f"{'policy':<{width}} {'capacity':>9} {'prefix':>7} {'block':>7} {'token':>7} "
             f"{'OPT':>7} {'of OPT':>7}"]
    for row in rows:
        lines.append(f"{row.policy:<{width}} {row.capacity:>9} {row.prefix_hit_ratio:>7.4f} "
                     f"{row.block_hit_ratio:>7.4f} {row.token_hit_ratio:>7.4f} "
                     f"{row.opt_hit_ratio:>7.4f} {row.fraction_of_opt:>7.1%}")
    return "\n".join(lines)


def plot_rows(rows: Sequence[Row], path: str, title: str) -> None:
    """Prefix hit ratio vs capacity per policy, with OPT, to a PNG (matplotlib Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    capacities = sorted({row.capacity for row in rows})
    for name in dict.fromkeys(row.policy for row in rows):
        ratios = [row.prefix_hit_ratio for capacity in capacities for row in rows
                  if row.policy == name and row.capacity == capacity]
        axes.plot(capacities, ratios, marker="o", label=name)
    opt = {row.capacity: row.opt_hit_ratio for row in rows}
    axes.plot(capacities, [opt[c] for c in capacities], "k--", label="Belady OPT (block)")
    axes.set(xscale="log", xlabel="capacity (blocks)", ylabel="prefix hit ratio", title=title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_policies(text: str) -> list[str]:
    """Comma-separated policy names; `all` means every registered policy."""
    names = list(POLICIES) + ["default"] if text == "all" else _csv(text)
    for name in names:
        if name != "default" and name not in POLICIES:
            raise BadArgsError(f"unknown policy {name!r}: choose from {', '.join(POLICIES)}, "
                               "default or all")
    return names


def parse_capacities(text: str) -> list[int]:
    """Comma-separated positive block counts; `k` suffix allowed (`5k` = 5000)."""
    capacities = []
    for item in _csv(text):
        try:
            value = int(float(item[:-1]) * 1000) if item.lower().endswith("k") else int(item)
        except ValueError:
            value = 0
        if value <= 0:
            raise BadArgsError(f"capacity {item!r} is not a positive block count (e.g. 5000 or 5k)")
        capacities.append(value)
    return capacities


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvd replay`."""
    parser.add_argument("trace", help="JSONL trace (../shared/traces format)")
    parser.add_argument("--policy", default="lru,lfu,arc,s3fifo,sieve,default",
                        help="comma-separated policies, 'default' or 'all' "
                             f"(default policy: {DEFAULT_POLICY})")
    parser.add_argument("--capacity", default=",".join(map(str, DEFAULT_CAPACITIES)),
                        help="comma-separated pool sizes in blocks (e.g. 1000,5k)")
    parser.add_argument("--mode", choices=MODES, default="pool",
                        help="pool: drive kvd's BlockPool (default); anchor: the reference "
                             "semantics of ../shared/traces/SOURCES.md")
    parser.add_argument("--decode", action="store_true",
                        help="pool mode: also write each request's decode blocks (a follow-up "
                             "turn may reuse them; kvd/traces.py decode_blocks)")
    parser.add_argument("--tiers", metavar="prefill=S,decode=S",
                        help="pool mode: split the pool into prefill and decode tiers with these "
                             "shares (e.g. prefill=0.7,decode=0.3; add :POLICY to a tier)")
    parser.add_argument("--remote-capacity", metavar="N[,N...]",
                        help="two levels: a fleet of --hosts pools of --capacity over a shared "
                             "remote tier of these sizes in blocks (0: no tier)")
    parser.add_argument("--hosts", type=int, default=1,
                        help="with --remote-capacity: hosts the requests are dealt to in turn")
    parser.add_argument("--remote-write", default="all",
                        help="with --remote-capacity: which blocks are written remotely: all "
                             "(every block computed, kvd's choice), hit (once hit locally), "
                             "or all,hit")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument("--plot", metavar="OUT.png", help="draw hit ratio vs capacity")


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvd replay`; returns the exit status."""
    trace = load_trace(args.trace)
    names, capacities = parse_policies(args.policy), parse_capacities(args.capacity)
    total = len(names) * len(capacities)
    done = [0]

    def progress(what: str) -> None:
        done[0] += 1
        if sys.stderr.isatty() or total > 1:
            print(f"\r[{done[0]:>3}/{total}] {what:<40}", end="", file=sys.stderr, flush=True)

    if args.remote_capacity is not None:
        return _run_two_level(args, trace, names, capacities, progress)
    rows = replay_rows(trace, names, capacities, args.mode, progress, tiers=args.tiers,
                       decode=args.decode)
    print("\r" + " " * 50 + "\r", end="", file=sys.stderr, flush=True)
    print(json.dumps([asdict(row) for row in rows], indent=1) if args.json else format_table(rows))
    if args.plot:
        plot_rows(rows, args.plot, f"{args.trace.rsplit('/', 1)[-1]} ({args.mode} replay)")
    return 0


def _run_two_level(args: argparse.Namespace, trace: Sequence[Request], names: list[str],
                   capacities: list[int], progress: Callable[[str], None]) -> int:
    if args.mode != "pool" or args.tiers or args.decode or args.plot:
        raise BadArgsError("--remote-capacity replays pool mode alone: drop --mode anchor, "
                           "--tiers, --decode and --plot")
    remote_capacities = [0 if item == "0" else parse_capacities(item)[0]
                         for item in _csv(args.remote_capacity)]
    rows = two_level_rows(trace, names, capacities, remote_capacities, args.hosts,
                          _csv(args.remote_write), progress)
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)
    print(json.dumps([asdict(row) for row in rows], indent=1) if args.json
          else format_two_level(rows))
    return 0
