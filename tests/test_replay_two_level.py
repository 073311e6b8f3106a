"""`kvd replay --remote-capacity`: a fleet of hosts over a shared remote tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.errors import BadArgsError
from kvd.replay import RemoteLRU, replay_pool, replay_two_level, two_level_rows
from kvd.traces import Request, write_trace
from test_replay import generated_trace


def test_one_host_without_a_tier_is_pool_mode():
    trace = generated_trace()
    counts, remote_hits, writes = replay_two_level(trace, "lru", 50, 0)
    reference = replay_pool(trace, "lru", 50)
    assert (counts.num_prefix_hits, counts.num_hits) == (reference.num_prefix_hits,
                                                          reference.num_hits)
    assert remote_hits == writes == 0


def test_a_prompt_computed_on_one_host_is_a_remote_hit_on_the_next():
    trace = [Request(0, 3 * 512, 10, (1, 2, 3)), Request(1, 4 * 512, 10, (1, 2, 3, 4))]
    alone, _, _ = replay_two_level(trace, "lru", 100, 0, num_hosts=2)
    counts, remote_hits, writes = replay_two_level(trace, "lru", 100, 100, num_hosts=2)
    assert alone.num_prefix_hits == 0
    assert counts.num_prefix_hits == remote_hits == 3 and writes == 3 + 1
    # written only once hit locally: the second host finds nothing
    _, remote_hits, writes = replay_two_level(trace, "lru", 100, 100, num_hosts=2, write="hit")
    assert remote_hits == writes == 0


def test_the_remote_tier_is_lru_and_reads_a_consecutive_head():
    tier = RemoteLRU(2)
    tier.write([1, 2])
    assert tier.read([1, 3, 2]) == [1]  # (1 touched: most recent now)
    tier.write([3])
    assert list(tier.keys) == [1, 3] and tier.num_writes == 3


def test_rows_and_bad_arguments():
    rows = two_level_rows(generated_trace(), ["lru"], [20], [0, 200], 3, ["all", "hit"])
    assert [(row.remote_capacity, row.remote_write) for row in rows] == [
        (0, "-"), (200, "all"), (200, "hit")]
    assert rows[0].prefix_hit_ratio <= rows[1].prefix_hit_ratio
    with pytest.raises(BadArgsError, match="remote-write"):
        two_level_rows(generated_trace(), ["lru"], [20], [10], 1, ["some"])
    with pytest.raises(BadArgsError, match="hosts"):
        two_level_rows(generated_trace(), ["lru"], [20], [10], 0, ["all"])


def test_cli_json(tmp_path: Path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, generated_trace(100))
    result = subprocess.run([sys.executable, "-m", "kvd.cli", "replay", str(path), "--policy",
                             "lru", "--capacity", "10", "--remote-capacity", "0,1k",
                             "--hosts", "2", "--json"],
                            capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(result.stdout)
    assert [(row["remote_capacity"], row["hosts"]) for row in rows] == [(0, 2), (1000, 2)]
    assert {"prefix_hit_ratio", "remote_hit_ratio", "writes_per_ref"} <= set(rows[0])
