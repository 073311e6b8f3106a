"""`kvd replay`: Belady's OPT against brute force, the published anchor, the CLI on a fixture."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.errors import BadArgsError
from kvd.replay import belady_hits, format_table, replay_anchor, replay_pool, replay_rows
from kvd.traces import Request, decode_blocks, load_trace, write_trace

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
SYNTHETIC = TRACES / "synthetic_trace.jsonl"


def brute_force_opt(refs: list[int], capacity: int) -> int:
    """Most hits over every choice of victim (exponential; tiny traces only)."""
    best = 0
    stack = [(0, frozenset(), 0)]
    while stack:
        index, cache, hits = stack.pop()
        if index == len(refs):
            best = max(best, hits)
            continue
        key = refs[index]
        if key in cache:
            stack.append((index + 1, cache, hits + 1))
        elif len(cache) < capacity:
            stack.append((index + 1, cache | {key}, hits))
        else:
            stack.extend((index + 1, (cache - {out}) | {key}, hits) for out in cache)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_belady_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    refs = [rng.randrange(6) for _ in range(rng.randrange(4, 13))]
    capacity = rng.randrange(1, 4)
    assert belady_hits(refs, capacity) == brute_force_opt(refs, capacity)


def generated_trace(num_requests: int = 300, seed: int = 7) -> list[Request]:
    """Conversations sharing a system prompt: each turn extends its conversation's chain."""
    rng = random.Random(seed)
    ids = itertools.count(1)
    chains: list[list[int]] = []
    trace = []
    for turn in range(num_requests):
        if not chains or rng.random() < 0.3:
            chains.append([0])
        chain = rng.choice(chains)
        chain.extend(next(ids) for _ in range(rng.randrange(1, 6)))
        trace.append(Request(turn * 100, len(chain) * 512 - rng.randrange(512), 50, tuple(chain)))
    return trace


@pytest.mark.parametrize("mode", ["anchor", "pool"])
def test_rows_are_consistent_on_a_generated_trace(mode: str) -> None:
    rows = replay_rows(generated_trace(), ["lru", "default"], [20, 200], mode)
    assert len(rows) == 4
    for row in rows:
        assert 0 <= row.prefix_hit_ratio <= row.block_hit_ratio <= row.opt_hit_ratio + 1e-9
        assert 0 <= row.token_hit_ratio <= 1


def test_pool_replay_never_beats_infinite_cache() -> None:
    trace = generated_trace()
    refs = [key for request in trace for key in request.hash_ids]
    ceiling = (len(refs) - len(set(refs))) / len(refs)
    counts = replay_pool(trace, "kvd", 10_000)
    assert counts.num_hits / counts.num_refs == pytest.approx(ceiling)


def test_cli_json_on_a_fixture(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    write_trace(path, generated_trace(100))
    plot = tmp_path / "hit.png"
    result = subprocess.run([sys.executable, "-m", "kvd.cli", "replay", str(path), "--policy",
                             "lru,default", "--capacity", "10,50", "--json", "--plot", str(plot)],
                            capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(result.stdout)
    assert {(row["policy"], row["capacity"]) for row in rows} == {
        ("lru", 10), ("lru", 50), ("default", 10), ("default", 50)}
    assert {"prefix_hit_ratio", "block_hit_ratio", "opt_hit_ratio"} <= set(rows[0])
    assert plot.stat().st_size > 0


@pytest.mark.skipif(not SYNTHETIC.is_file(),
                    reason=f"{SYNTHETIC} absent: the shared Mooncake traces are not checked out")
def test_anchor_on_synthetic_trace() -> None:
    """The published reference (../shared/traces/SOURCES.md), to four decimals."""
    trace = load_trace(SYNTHETIC)
    for capacity, lru, opt in ((1000, 0.0825, 0.2766), (5000, 0.2791, 0.5262),
                               (10000, 0.4235, 0.6180)):
        counts = replay_anchor(trace, "lru", capacity)
        assert round(counts.num_prefix_hits / counts.num_refs, 4) == lru
        refs = [key for request in trace for key in request.hash_ids]
        assert round(belady_hits(refs, capacity) / len(refs), 4) == opt


def test_decode_blocks_take_the_follow_up_turns_keys() -> None:
    first = Request(0, 2 * 512 + 100, 600, (1, 2, 3))  # 2 full prompt blocks, 1 decode block
    follow_up = Request(1, 4 * 512, 10, (1, 2, 7, 8))  # holds the prompt and the output
    shared = Request(2, 512 + 10, 2000, (1, 9))  # block 1 is everyone's: no follow-up guessed
    unrelated = Request(3, 2 * 512, 10, (1, 10))
    assert decode_blocks([first, follow_up, shared, unrelated]) == [(7,), (), (-1, -2, -3), ()]


@pytest.mark.parametrize("tiers", [None, "prefill=0.8,decode=0.2"])
def test_decode_replay_counts_prompt_references_only(tiers: str | None) -> None:
    trace = generated_trace()
    plain = replay_rows(trace, ["lru"], [10_000], "pool")[0]
    rows = replay_rows(trace, ["lru", "default"], [20, 10_000], "pool", tiers=tiers, decode=True)
    for row in rows:
        assert row.mode == "pool+decode"
        assert 0 <= row.prefix_hit_ratio <= row.block_hit_ratio <= row.opt_hit_ratio + 1e-9
    assert rows[2].block_hit_ratio == pytest.approx(plain.block_hit_ratio)  # lru, all fits


def test_tiers_need_pool_mode() -> None:
    with pytest.raises(BadArgsError, match="--mode pool"):
        replay_rows(generated_trace(20), ["lru"], [10], "anchor", tiers="prefill=0.5,decode=0.5")


def test_tiered_rows_are_labelled_with_the_policies_they_ran() -> None:
    """Regression: with --tiers each row was labelled with a --policy name, also where every
    tier named its own policy and the row's name ran nowhere."""
    trace = generated_trace(50)
    rows = replay_rows(trace, ["lru", "sieve"], [20], "pool", tiers="prefill=0.8,decode=0.2:lfu")
    assert [row.policy for row in rows] == ["tiered(prefill=0.8:lru,decode=0.2:lfu)",
                                            "tiered(prefill=0.8:sieve,decode=0.2:lfu)"]
    both = replay_rows(trace, ["lru", "sieve"], [20], "pool",
                       tiers="prefill=0.8:arc,decode=0.2:lfu")
    assert [row.policy for row in both] == ["tiered(prefill=0.8:arc,decode=0.2:lfu)"]  # one run
    lines = format_table(rows).splitlines()
    assert len({line.index(" 20 ") for line in lines[1:]}) == 1  # columns still line up
    assert lines[0].index("capacity") + len("capacity") == lines[1].index(" 20 ") + len(" 20")
    with pytest.raises(BadArgsError, match="bogus"):
        replay_rows(trace, ["lru"], [20], "pool", tiers="prefill=0.8:bogus,decode=0.2")
