"""kvd.PagedKVCache: the acceptance scenarios of issue 2 item 5, then the edges around them."""

from __future__ import annotations

import numpy as np
import pytest

import kvd
from kvd import PagedKVCache
from kvd.core.policies import DEFAULT_POLICY, POLICIES

USAGE_KEYS = ("total_blocks", "used_blocks", "free_blocks", "utilization")


def usage(cache: PagedKVCache) -> dict:
    stats = cache.stats()
    return {key: stats[key] for key in USAGE_KEYS}


def fill_four(policy: str) -> PagedKVCache:
    cache = PagedKVCache(num_blocks=4, eviction_policy=policy)
    for position in range(4):
        cache.allocate_block(0, position)
    cache.check_invariants()
    return cache


# ---- acceptance (issue 2, item 5) --------------------------------------------------------------
def test_lru_evicts_the_least_recently_used_position():
    cache = fill_four("lru")
    assert cache.get_block(0, 0) is not None
    cache.allocate_block(0, 4)
    assert cache.get_block(0, 1) is None
    assert cache.get_block(0, 0) is not None
    assert usage(cache) == {"total_blocks": 4, "used_blocks": 4, "free_blocks": 0,
                            "utilization": "100.0%"}
    cache.check_invariants()


def test_lfu_evicts_the_least_frequent_and_older_position():
    cache = fill_four("lfu")
    for _ in range(3):
        cache.get_block(0, 0)
    cache.get_block(0, 1)
    cache.allocate_block(0, 4)
    assert cache.get_block(0, 2) is None
    for position in (0, 1, 3, 4):
        assert cache.get_block(0, position) is not None, position
    cache.check_invariants()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_three_times_capacity_never_raises_and_ids_are_valid(policy):
    cache = PagedKVCache(num_blocks=8, num_layers=2, eviction_policy=policy)
    for step in range(3 * 8):
        block_id = cache.allocate_block(step % 2, step)
        assert isinstance(block_id, int) and 0 <= block_id < 8
        cache.check_invariants()
    assert usage(cache)["used_blocks"] == 8
    assert cache.stats()["evictions"] == 2 * 8


def test_writes_through_keys_and_values_are_visible_on_next_lookup():
    cache = PagedKVCache(num_blocks=4)
    cache.allocate_block(1, 7)
    block = cache.get_block(1, 7)
    block.keys[:] = 1.5
    block.values[3, 5] = -2.0
    again = cache.get_block(1, 7)
    assert again.block_id == block.block_id
    assert np.all(again.keys == 1.5) and again.values[3, 5] == -2.0 and again.values[0, 0] == 0


def test_block_shape_with_default_arguments():
    cache = PagedKVCache()
    cache.allocate_block(2, 100)
    block = cache.get_block(2, 100)
    assert block.keys.shape == (16, 128) and block.values.shape == (16, 128)
    assert (block.layer_id, block.position) == (2, 100)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_blocks": 0}, r"num_blocks must be a positive int \(1 or more\)"),
    ({"num_blocks": -4}, r"num_blocks must be a positive int \(1 or more\)"),
    ({"num_layers": 0}, r"num_layers must be a positive int \(1 or more\)"),
    ({"block_size": -1}, r"block_size must be a positive int \(1 or more\)"),
    ({"head_dim": 0}, r"head_dim must be a positive int \(1 or more\)"),
    ({"num_blocks": 2.5}, r"num_blocks must be a positive int"),
    ({"eviction_policy": "mru"}, "choose one of " + ", ".join(sorted(POLICIES))),
])
def test_invalid_constructor_arguments_are_value_errors_naming_the_valid_range(kwargs, match):
    with pytest.raises(ValueError, match=match) as caught:
        PagedKVCache(**kwargs)
    assert isinstance(caught.value, kvd.KvdError)


@pytest.mark.parametrize("layer_id", [-1, 8, 100, True, 1.0])
def test_layer_out_of_range_names_the_range(layer_id):
    cache = PagedKVCache()
    for call in (cache.allocate_block, cache.get_block):
        with pytest.raises(ValueError, match=r"layer_id must be an int in \[0, 8\)"):
            call(layer_id, 0)


@pytest.mark.parametrize("position", [-1, 1.0, "3", None, False])
def test_bad_position_names_the_valid_range(position):
    cache = PagedKVCache()
    with pytest.raises(ValueError, match="non-negative int"):
        cache.allocate_block(0, position)


def test_numpy_integer_indices_name_the_same_block_as_ints():
    """Regression: np.int64 layer ids and positions (what iterating an array yields) were
    refused while True passed as layer 1."""
    cache = PagedKVCache(num_blocks=4, num_layers=2)
    block_id = cache.allocate_block(np.int64(1), np.int32(3))
    assert cache.get_block(1, 3).block_id == block_id
    assert cache.allocate_block(1, 3) == block_id


def test_a_pool_this_process_cannot_hold_is_a_no_space_error_and_object_dtype_is_refused():
    with open("/proc/sys/vm/overcommit_memory") as mode:
        overcommits_always = mode.read().strip() == "1"
    if not overcommits_always:  # (there a terabyte "succeeds" until it is touched)
        with pytest.raises(kvd.NoSpaceError, match="ask for fewer"):
            PagedKVCache(num_blocks=1 << 40, num_layers=1, block_size=16, head_dim=128)
    with pytest.raises(kvd.BadArgsError, match="float or integer"):
        PagedKVCache(dtype=object)


# ---- beyond the acceptance list ----------------------------------------------------------------
def test_allocating_an_existing_pair_returns_its_block_and_keeps_its_data():
    cache = PagedKVCache(num_blocks=2)
    block_id = cache.allocate_block(0, 0)
    cache.get_block(0, 0).keys[:] = 3.0
    assert cache.allocate_block(0, 0) == block_id
    assert np.all(cache.get_block(0, 0).keys == 3.0)
    assert usage(cache)["used_blocks"] == 1


def test_allocating_an_existing_pair_counts_as_an_access():
    cache = PagedKVCache(num_blocks=2, eviction_policy="lru")
    cache.allocate_block(0, 0)
    cache.allocate_block(0, 1)
    cache.allocate_block(0, 0)
    cache.allocate_block(0, 2)
    assert cache.get_block(0, 1) is None and cache.get_block(0, 0) is not None


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint16", "int8"])
def test_reused_block_does_not_show_the_evicted_pairs_data(dtype):
    cache = PagedKVCache(num_blocks=1, dtype=dtype)
    cache.allocate_block(0, 0)
    cache.get_block(0, 0).keys[:] = 9
    cache.get_block(0, 0).values[-1, -1] = 9
    cache.allocate_block(0, 1)
    block = cache.get_block(0, 1)
    assert not block.keys.any() and not block.values.any()


def test_stats_start_empty_and_count_hits_and_misses():
    cache = PagedKVCache(num_blocks=8)
    assert usage(cache) == {"total_blocks": 8, "used_blocks": 0, "free_blocks": 8,
                            "utilization": "0.0%"}
    cache.allocate_block(0, 0)
    cache.get_block(0, 0)
    cache.get_block(0, 1)
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["utilization"]) == (1, 1, "12.5%")
    assert stats["policy"] == "lru"


def test_default_policy_name_is_accepted():
    cache = PagedKVCache(num_blocks=2, eviction_policy="default")
    assert cache.stats()["policy"] == DEFAULT_POLICY


def test_layers_are_separate_keys():
    cache = PagedKVCache(num_blocks=4, num_layers=2)
    assert cache.allocate_block(0, 5) != cache.allocate_block(1, 5)
    assert cache.get_block(1, 6) is None


def test_dtype_and_head_dim_shape_the_blocks():
    cache = PagedKVCache(num_blocks=2, block_size=4, head_dim=8, dtype="float16")
    cache.allocate_block(0, 0)
    block = cache.get_block(0, 0)
    assert block.keys.shape == (4, 8) and block.keys.dtype == np.float16
