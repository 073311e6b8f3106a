"""PagedKVCache: the pool and policies in one process, with the classic tutorial API.

Each `(layer_id, position)` pair owns one block of `block_size` tokens × `head_dim` for keys and
as many for values. Allocating a pair that has no block takes a free one or evicts the policy's
victim; every block here is evictable at all times (there are no readers to pin it), exactly as in
the tutorial, but without its bugs: eviction picks the policy's victim rather than an arbitrary
block, block ids are always valid indices, and a re-allocated pair keeps its data.

It is the same BlockPool the daemon runs: a pair's block is allocated, sealed under the key
`(layer_id, position)` and released at once, so it is CACHED and the policy orders it;
`get_block` is a policy access.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import SupportsIndex, cast

import numpy as np

from kvd.errors import BadArgsError, InternalError, NoSpaceError
from kvd.core.policies import POLICIES
from kvd.core.pool import BlockPool

_EMBEDDED_OWNER = 0


@dataclass(frozen=True)
class Block:
    """One block: `keys` and `values` are writable views of shape (block_size, head_dim)."""

    block_id: int
    layer_id: int
    position: int
    keys: np.ndarray
    values: np.ndarray


def _index_or_none(value: object) -> int | None:
    """A plain int from an int or a NumPy integer (not a bool, nor a float's truncation)."""
    if isinstance(value, bool):
        return None
    try:  # (any object may be tried: TypeError is the answer for those without __index__)
        return operator.index(cast(SupportsIndex, value))
    except TypeError:
        return None


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BadArgsError(f"{name} must be a positive int (1 or more), got {value!r}")
    return value


class PagedKVCache:
    """A paged KV cache in this process's memory: no daemon, same pool and policies."""

    def __init__(
        self,
        num_blocks: int = 256,
        num_layers: int = 8,
        block_size: int = 16,
        eviction_policy: str = "lru",
        head_dim: int = 128,
        dtype: str | np.dtype = "float32",
    ) -> None:
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.num_layers = _positive_int("num_layers", num_layers)
        self.block_size = _positive_int("block_size", block_size)
        self.head_dim = _positive_int("head_dim", head_dim)
        if eviction_policy not in POLICIES and eviction_policy != "default":
            choices = ", ".join(sorted(POLICIES))
            raise BadArgsError(f"unknown eviction_policy {eviction_policy!r}: choose one of "
                               f"{choices} or 'default'")
        self.eviction_policy = eviction_policy
        try:
            dtype = np.dtype(dtype)
        except TypeError as exc:
            raise BadArgsError(f"dtype {dtype!r} is not a NumPy dtype: {exc}") from None
        if dtype.kind not in "fiu":  # (uint16 holds bfloat16, as in a daemon's pool)
            raise BadArgsError(f"dtype must be a float or integer dtype for K/V, got {dtype}")
        shape = (num_blocks, 2, block_size, head_dim)  # (num_blocks, K/V, block_size, head_dim)
        try:
            self._pool = BlockPool(num_blocks, eviction_policy)
            self.storage = np.zeros(shape, dtype=dtype)
        except MemoryError:
            raise NoSpaceError(f"cannot allocate {num_blocks} blocks of {shape[1:]} {dtype} "
                               "in this process: ask for fewer") from None
        self.hits = 0
        self.misses = 0

    def _key(self, layer_id: int, position: int) -> tuple[int, int]:
        layer, index = _index_or_none(layer_id), _index_or_none(position)
        if layer is None or not 0 <= layer < self.num_layers:
            raise BadArgsError(f"layer_id must be an int in [0, {self.num_layers}), got {layer_id!r}")
        if index is None or index < 0:
            raise BadArgsError(f"position must be a non-negative int (block index), got {position!r}")
        return (layer, index)

    def allocate_block(self, layer_id: int, position: int) -> int:
        """Return the block id of `(layer_id, position)`, allocating (and evicting) if needed."""
        key = self._key(layer_id, position)
        block_id = self._pool.touch(key)
        if block_id is not None:
            return block_id
        block_ids = self._pool.allocate(1, _EMBEDDED_OWNER)
        if block_ids is None:
            raise InternalError("the embedded pool found no block to evict, but every block here "
                                "is evictable at all times: a kvd bug")
        (block_id,) = block_ids
        self.storage[block_id] = 0  # a reused block must not show its previous pair's data
        self._pool.seal([block_id], [key], _EMBEDDED_OWNER)
        self._pool.release([block_id], _EMBEDDED_OWNER)
        return block_id

    def get_block(self, layer_id: int, position: int) -> Block | None:
        """The block of `(layer_id, position)` (an access for the policy), or None if absent."""
        key = self._key(layer_id, position)
        block_id = self._pool.touch(key)
        if block_id is None:
            self.misses += 1
            return None
        self.hits += 1
        kv = self.storage[block_id]
        return Block(block_id, layer_id, position, kv[0], kv[1])

    def stats(self) -> dict:
        """Pool usage; `utilization` is a percentage string like "100.0%"."""
        used = self.num_blocks - self._pool.num_free
        return {
            "total_blocks": self.num_blocks,
            "used_blocks": used,
            "free_blocks": self._pool.num_free,
            "utilization": f"{100.0 * used / self.num_blocks:.1f}%",
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self._pool.counters["evictions"],
            "policy": self._pool.policy.name,
        }

    def check_invariants(self) -> None:
        self._pool.check_invariants()
