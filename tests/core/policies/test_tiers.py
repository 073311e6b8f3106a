"""The prefill/decode split: parsing `--tiers`, the composite policy, the page table's tiers, and
`kvd start --tiers` on a real daemon."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from kvd.errors import BadArgsError
from kvd.core.page_table import PageTable
from kvd.core.policies import (TIER_DECODE, TIER_PREFILL, TieredPolicy, TierSpec, make_policy,
                          parse_tiers)
from kvd.core.pool import BlockPool


def test_parse_tiers() -> None:
    assert parse_tiers("prefill=0.7,decode=0.3") == [TierSpec(0.7), TierSpec(0.3)]
    assert parse_tiers(" decode=0.25:lru , prefill=0.75") == [TierSpec(0.75), TierSpec(0.25, "lru")]
    for bad in ("prefill=0.7", "prefill=0.7,decode=0.4", "prefill=1,decode=0", "x=0.5,decode=0.5",
                "prefill=a,decode=0.3", "prefill=0.5,prefill=0.5"):
        with pytest.raises(BadArgsError, match="tiers"):
            parse_tiers(bad)


def test_each_tier_runs_its_own_policy_sized_to_its_share() -> None:
    policy = make_policy("kvd", 100, tiers="prefill=0.8,decode=0.2:lru")
    assert isinstance(policy, TieredPolicy)
    assert [(p.name, p.capacity) for p in policy.policies] == [("kvd", 80), ("lru", 20)]
    assert policy.describe() == "prefill=0.8:kvd,decode=0.2:lru"


def test_victim_comes_from_the_tier_furthest_over_its_share() -> None:
    policy = make_policy("lru", 10, tiers="prefill=0.5,decode=0.5")
    for key in range(4):
        policy.inserted(f"p{key}", TIER_PREFILL)
    for key in range(6):
        policy.inserted(f"d{key}", TIER_DECODE)
    assert policy.victim() == "d0"  # decode holds 6 of its 5 blocks, prefill 4 of its 5
    assert policy.victim() == "d1"  # decode 5 of 5 is still further over than prefill 4 of 5
    assert policy.victim() == "p0"  # level (4 and 4): the first tier goes first
    assert policy.num_resident == [3, 4]


def test_a_tier_with_nothing_evictable_lends_its_space() -> None:
    policy = make_policy("lru", 10, tiers="prefill=0.9,decode=0.1")
    for key in range(3):
        policy.inserted(key, TIER_PREFILL)
    policy.inserted("d", TIER_DECODE)
    policy.removed("d")  # pinned: decode is over its share but has nothing evictable
    assert policy.victim() == 0
    assert policy.num_resident == [2, 1]


def test_page_table_seals_prompt_blocks_as_prefill_and_output_blocks_as_decode() -> None:
    block_size = 4
    policy = make_policy("lru", 16, tiers="prefill=0.5,decode=0.5")
    pool = BlockPool(16, policy)
    owners = itertools.count(1)
    table = PageTable(pool, block_size, lambda: next(owners), lambda src, dst: None)
    prompt = np.arange(10, dtype="<u4").tobytes()  # 2 full prompt blocks + 2 tokens
    record, _ = table.open(prompt)
    table.extend(record, np.arange(100, 106, dtype="<u4").tobytes(), record.num_tokens)
    table.commit(record, record.num_tokens)  # 16 tokens: blocks 2 and 3 hold decode tokens
    table.close(record)
    assert policy.num_resident == [2, 2]
    pool.check_invariants()


def test_kvd_start_with_tiers_reports_them(daemon_factory: Any) -> None:
    daemon = daemon_factory(["--num-blocks", "64", "--tiers", "prefill=0.75,decode=0.25:lru"])
    with daemon.connect() as client:
        stats = client.stats()
    assert stats["policy"] == "tiered"
    assert stats["tiers"] == "prefill=0.75:kvd,decode=0.25:lru"
    assert stats["tier_blocks"] == {"prefill": 0, "decode": 0}
