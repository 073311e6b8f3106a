"""The model math against its two KV stores, with a private NumPy pool (no daemon)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvd.errors import BadArgsError
from workers.model import ContiguousKV, DecoderLM, ModelConfig, PagedKV, from_storage, to_storage

BLOCK_SIZE = 16


def _pool(config: ModelConfig, num_blocks: int, dtype: str | type = np.float32) -> np.ndarray:
    shape = (num_blocks, config.num_layers, 2, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    return np.full(shape, np.nan if dtype != np.uint16 else 0, dtype=dtype)


def _scattered_table(rng: np.random.Generator, num_blocks: int, count: int) -> list[int]:
    """Non-contiguous, shuffled block ids, as a real pool hands them out."""
    return [int(i) for i in rng.permutation(num_blocks)[:count]]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("config", [
    ModelConfig(),
    ModelConfig(num_layers=2, num_kv_heads=1, num_heads=4, head_dim=16),   # multi-query
    ModelConfig(num_layers=3, num_kv_heads=4, num_heads=4, head_dim=8),    # multi-head
    ModelConfig(tie_embeddings=True, seed=7),
])
@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 75])
def test_paged_equals_contiguous(config: ModelConfig, prompt_len: int) -> None:
    model = DecoderLM(config)
    rng = np.random.default_rng(prompt_len)
    prompt = rng.integers(0, config.vocab_size, prompt_len)
    num_new = 20
    ref_tokens, ref_logits = model.generate(prompt, num_new, ContiguousKV(config, 128))
    table = _scattered_table(rng, 64, -(-(prompt_len + num_new) // BLOCK_SIZE))
    tokens, logits = model.generate(prompt, num_new, PagedKV(_pool(config, 64), table))
    assert tokens == ref_tokens
    assert len(logits) == num_new
    assert _max_diff(logits, ref_logits) <= 1e-5


@pytest.mark.parametrize("num_cached_blocks", [1, 3, 4])
def test_cached_prefix_skips_prefill_and_matches(num_cached_blocks: int) -> None:
    """A second sequence reuses the first one's prefix blocks and computes only its suffix."""
    config = ModelConfig()
    model = DecoderLM(config)
    rng = np.random.default_rng(0)
    pool = _pool(config, 64)
    system = rng.integers(0, config.vocab_size, 4 * BLOCK_SIZE)
    first = np.concatenate([system, rng.integers(0, config.vocab_size, 9)])
    table = _scattered_table(rng, 64, 6)
    model.generate(first, 8, PagedKV(pool, table))

    cached = num_cached_blocks * BLOCK_SIZE
    second = np.concatenate([system[:cached], rng.integers(0, config.vocab_size, 30)])
    fresh = [i for i in range(64) if i not in table][:4]
    frozen_before = pool[table[:num_cached_blocks]].copy()
    paged = PagedKV(pool, table[:num_cached_blocks] + fresh, num_frozen_tokens=cached)
    tokens, logits = model.generate(second, 12, paged, num_cached_tokens=cached)

    ref_tokens, ref_logits = model.generate(second, 12, ContiguousKV(config, 128))
    assert tokens == ref_tokens
    assert _max_diff(logits, ref_logits) <= 1e-5
    np.testing.assert_array_equal(pool[table[:num_cached_blocks]], frozen_before)


def test_fully_cached_prompt_recomputes_only_last_query() -> None:
    config = ModelConfig()
    model = DecoderLM(config)
    rng = np.random.default_rng(3)
    pool = _pool(config, 16)
    prompt = rng.integers(0, config.vocab_size, 2 * BLOCK_SIZE)
    table = [5, 2, 9]
    model.generate(prompt, 1, PagedKV(pool, table))
    frozen = pool[[5, 2]].copy()
    tokens, logits = model.generate(prompt, 5, PagedKV(pool, table, num_frozen_tokens=32),
                                    num_cached_tokens=32)
    ref_tokens, ref_logits = model.generate(prompt, 5, ContiguousKV(config, 64))
    assert tokens == ref_tokens
    assert _max_diff(logits, ref_logits) <= 1e-5
    np.testing.assert_array_equal(pool[[5, 2]], frozen)


@pytest.mark.parametrize("dtype", [np.float16, np.uint16])   # uint16 = bfloat16 words
def test_half_precision_pool_matches_same_precision_reference(dtype: type) -> None:
    config = ModelConfig()
    model = DecoderLM(config)
    prompt = np.random.default_rng(5).integers(0, config.vocab_size, 40)
    ref_tokens, ref_logits = model.generate(prompt, 10, ContiguousKV(config, 64, dtype=dtype))
    tokens, logits = model.generate(prompt, 10, PagedKV(_pool(config, 8, dtype), [3, 1, 7, 0]))
    assert tokens == ref_tokens
    assert _max_diff(logits, ref_logits) <= 1e-5


def test_bfloat16_round_trip_is_nearest_even() -> None:
    x = np.array([1.0, -2.5, 1.00390625, 1.01171875, 3.0e38, 1e-3], dtype=np.float32)
    y = from_storage(to_storage(x, np.dtype(np.uint16)))
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, x, rtol=2 ** -8)
    assert y[2] == 1.0          # halfway between 1.0 and 1.0078125: ties to even
    assert y[3] == 1.015625     # halfway between 1.0078125 and 1.015625: ties to even


def test_prefill_in_one_batch_equals_token_by_token() -> None:
    config = ModelConfig()
    model = DecoderLM(config)
    prompt = np.random.default_rng(8).integers(0, config.vocab_size, 33)
    batched = model.forward(prompt, 0, ContiguousKV(config, 64))
    stepped_kv = ContiguousKV(config, 64)
    stepped = np.stack([model.forward(prompt[i:i + 1], i, stepped_kv)[0] for i in range(33)])
    assert np.abs(batched - stepped).max() <= 1e-5


def test_geometry_mismatch_and_bad_config_are_typed_errors() -> None:
    with pytest.raises(BadArgsError, match="multiple of num_kv_heads"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(BadArgsError, match="--layers"):
        PagedKV(_pool(ModelConfig(num_layers=2), 4), [0]).check_config(ModelConfig())


@pytest.mark.parametrize("chunk_tokens", [1, 7, 16, 1000])
def test_chunked_prefill_equals_one_batch(chunk_tokens: int) -> None:
    config = ModelConfig()
    model = DecoderLM(config)
    prompt = np.random.default_rng(9).integers(0, config.vocab_size, 50)
    whole = model.prefill(prompt, 0, ContiguousKV(config, 64), chunk_tokens=1000)
    paged = PagedKV(_pool(config, 8), [6, 0, 3, 5])
    chunked = model.prefill(prompt, 0, paged, chunk_tokens=chunk_tokens)
    assert np.abs(whole - chunked).max() <= 1e-5


def _token_by_token(pool: np.ndarray, table: list[int], layer: int, start_pos: int,
                    keys: np.ndarray, values: np.ndarray, num_frozen_tokens: int) -> None:
    """The reference for PagedKV.write: one token at a time, straight from the definition."""
    for i, position in enumerate(range(start_pos, start_pos + len(keys))):
        if position >= num_frozen_tokens:
            block, offset = table[position // BLOCK_SIZE], position % BLOCK_SIZE
            pool[block, layer, 0, offset] = keys[i]
            pool[block, layer, 1, offset] = values[i]


@pytest.mark.parametrize("start_pos,num_tokens,num_frozen_tokens", [
    (0, 1, 0), (0, 16, 0), (0, 80, 0), (5, 3, 0), (5, 11, 0), (5, 12, 0), (5, 60, 0),
    (16, 1, 0), (31, 2, 0), (0, 80, 20), (0, 80, 32), (10, 40, 50), (3, 70, 3),
])
def test_write_in_runs_equals_token_by_token(start_pos: int, num_tokens: int,
                                             num_frozen_tokens: int) -> None:
    """Partial first block, full blocks, partial last block: every split lands where the
    per-token definition puts it, and nothing else changes (other layers, frozen tokens)."""
    config = ModelConfig(num_layers=2)
    rng = np.random.default_rng(start_pos * 100 + num_tokens)
    table = _scattered_table(rng, 16, 6)
    shape = (num_tokens, config.num_kv_heads, config.head_dim)
    keys, values = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    pool = rng.standard_normal((16, 2, 2, BLOCK_SIZE, config.num_kv_heads, config.head_dim))
    pool = pool.astype(np.float32)
    expected = pool.copy()
    _token_by_token(expected, table, 1, start_pos, keys, values, num_frozen_tokens)
    PagedKV(pool, table, num_frozen_tokens).write(1, start_pos, keys, values)
    np.testing.assert_array_equal(pool, expected)


def test_gather_reuses_its_buffer_and_grows_it() -> None:
    config = ModelConfig()
    rng = np.random.default_rng(11)
    pool = rng.standard_normal((12, config.num_layers, 2, BLOCK_SIZE, config.num_kv_heads,
                                config.head_dim)).astype(np.float16)
    table = _scattered_table(rng, 12, 7)
    paged = PagedKV(pool, table)
    by_token = pool[table, 2].swapaxes(0, 1).reshape(2, -1, config.num_kv_heads, config.head_dim)
    for num_tokens in (1, 16, 17, 40, 112, 3, 100):
        keys, values = paged.gather(2, num_tokens)
        assert keys.dtype == np.float16 and keys.shape == (num_tokens, *by_token.shape[2:])
        np.testing.assert_array_equal(keys, by_token[0, :num_tokens])
        np.testing.assert_array_equal(values, by_token[1, :num_tokens])
    again, _ = paged.gather(0, 100)
    assert np.shares_memory(again, keys)  # one buffer, overwritten by the next gather
    np.testing.assert_array_equal(keys, pool[table, 0, 0].reshape(-1, *by_token.shape[2:])[:100])


def test_gather_and_read_buffers_start_on_a_page() -> None:
    """A copy into a destination 16 bytes past a 64-byte line (np.empty's placement) ran at
    about half speed (bench/data_plane.py), so the buffers PagedKV copies into, grown ones too,
    start on a page; V's half follows K's whole runs."""
    config = ModelConfig()
    rng = np.random.default_rng(13)
    pool = _pool(config, 24)
    table = _scattered_table(rng, 24, 20)
    paged = PagedKV(pool, table)
    for num_tokens in (16, 40, 300):  # the buffers grow twice
        for keys, values in (paged.gather(1, num_tokens), paged.read(1, num_tokens)):
            assert keys.ctypes.data % mmap.PAGESIZE == 0 and values.ctypes.data % 64 == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16])
def test_read_copies_only_what_changed_and_follows_writes_and_the_table(dtype: type) -> None:
    """`read` keeps a float32 copy per layer: it must still see every write, a table entry that
    changed under it (as a copy-on-write fork's would), a table that grew, and other layers'
    writes must not disturb it; from a half-precision pool too (uint16: bfloat16 words)."""
    config = ModelConfig()
    rng = np.random.default_rng(12)
    pool = to_storage(rng.standard_normal((12, config.num_layers, 2, BLOCK_SIZE,
                                           config.num_kv_heads, config.head_dim)).astype(
                                               np.float32), np.dtype(dtype))
    table = _scattered_table(rng, 12, 3)
    spare = next(i for i in range(12) if i not in table)
    paged = PagedKV(pool, table)

    def expected(layer: int, num_tokens: int) -> np.ndarray:
        return from_storage(pool[table, layer].swapaxes(0, 1).reshape(
            2, -1, config.num_kv_heads, config.head_dim)[:, :num_tokens])

    def check(layer: int, num_tokens: int) -> None:
        keys, values = paged.read(layer, num_tokens)
        assert keys.dtype == values.dtype == np.float32
        np.testing.assert_array_equal(np.stack([keys, values]), expected(layer, num_tokens))

    check(1, 40)
    check(0, 40)
    new = rng.standard_normal((5, config.num_kv_heads, config.head_dim)).astype(np.float32)
    paged.write(1, 20, new, -new)  # inside the second block
    check(1, 40)
    paged.write(0, 3, new, new)  # another layer: layer 1's copy stays right
    check(1, 40)
    check(0, 40)
    table[1] = spare  # re-tabled in place
    check(1, 40)
    table.append(int(table[0]))  # grown
    check(1, 48)
    check(1, 10)  # shorter
    keys, _ = paged.read(2, 48)
    assert not np.shares_memory(keys, paged.read(1, 48)[0])  # a copy per layer


def test_gather_checks_layer_and_block_ids_and_the_pool_must_be_contiguous() -> None:
    config = ModelConfig()
    pool = _pool(config, 4)
    with pytest.raises(BadArgsError, match="outside the pool"):
        PagedKV(pool, [0, 4]).gather(0, 20)
    with pytest.raises(BadArgsError, match="outside the pool"):
        PagedKV(pool, [0, -1]).gather(0, 20)
    with pytest.raises(BadArgsError, match="outside the pool"):
        PagedKV(pool, [0]).gather(config.num_layers, 1)
    with pytest.raises(BadArgsError, match="C-contiguous"):
        PagedKV(pool[::2], [0])


def test_positions_past_the_block_table_are_a_typed_error() -> None:
    """Asking for more tokens than the table covers must not quietly return fewer."""
    config = ModelConfig()
    pool = _pool(config, 4)
    kv = np.ones((5, config.num_kv_heads, config.head_dim), dtype=np.float32)
    paged = PagedKV(pool, [1, 2])
    for call in (lambda: paged.gather(0, 33), lambda: paged.read(0, 33),
                 lambda: paged.write(0, 30, kv, kv)):
        with pytest.raises(BadArgsError, match="need 3 blocks of 16 tokens but the block table "
                                               "holds 2"):
            call()
    assert np.isnan(pool).all()  # the write wrote nothing
    assert paged.gather(0, 32)[0].shape == (32, config.num_kv_heads, config.head_dim)


@pytest.mark.parametrize("table", [[0, 4, 1], [0, -1, 1], [-4, 1, 2]])
def test_write_checks_block_ids_before_writing_anything(table: list[int]) -> None:
    """A bad id anywhere in the written range is a typed error and no block is touched (a
    negative one would otherwise wrap around to another sequence's block)."""
    config = ModelConfig()
    pool = _pool(config, 4)
    kv = np.ones((40, config.num_kv_heads, config.head_dim), dtype=np.float32)
    for start_pos in (0, 8):  # whole blocks first, or a partial first block
        with pytest.raises(BadArgsError, match="outside the pool"):
            PagedKV(pool, table).write(1, start_pos, kv[:40 - start_pos], kv[:40 - start_pos])
        assert np.isnan(pool).all()
    with pytest.raises(BadArgsError, match="outside the pool"):
        PagedKV(pool, [0]).write(config.num_layers, 0, kv[:1], kv[:1])
