"""The model math against its two KV stores, with a private NumPy pool (no daemon)."""

from __future__ import annotations

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
