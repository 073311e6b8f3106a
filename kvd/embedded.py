"""PagedKVCache: the pool and policies in one process, with the classic tutorial API.

Each `(layer_id, position)` pair owns one block of `block_size` tokens × `head_dim` for keys and
as many for values. Allocating a pair that has no block takes a free one or evicts the policy's
victim; an allocated block stays evictable, exactly as in the tutorial, but without its bugs:
eviction picks the policy's victim rather than an arbitrary block, block ids are always valid
indices, and a re-allocated pair keeps its data.

It is the same BlockPool the daemon runs: a pair's block is put under the key
`(layer_id, position)` (`BlockPool.put`: what an allocation, a seal and a release do, in one call)
and zeroed, so it is CACHED and the policy orders it; `get_block` is a policy access. The zeroing
is the one cost cachetools has no counterpart for: a reused block must not show its previous
pair's K/V, which a caller could not tell from its own (the seed zeroed too). `hold_block` is the pool's pin: a held block is SEALED (never
evicted, never reused) until `release_block`, so a thread can write through it and read back
what it wrote while other threads allocate.

Threads: one lock guards the pool, the hit counters and the zeroing of a reused block, so every
public method may be called from any number of threads at once and the pool's invariants hold
between any two calls. Only the pool work runs under it: argument checks come before, and the
NumPy views of a Block are made after (`storage` never moves). A Block from `get_block` is a view
of whatever pair holds that block when you touch it: another thread's allocation may evict the
pair and reuse the block meanwhile. Hold it to keep it.

What the lock costs a lone thread is one acquire and one release per public call, ~940
instructions (`python -m bench.diagnostics.embedded_lock`): CPython 3.11's `Lock.acquire` parses
its arguments and reads the monotonic clock even when the lock is free. A `with` block costs more
(its `__exit__` takes three arguments through a tuple) and an RLock no less (nothing here
re-enters), so the hot methods call acquire and release themselves.
"""

from __future__ import annotations

import operator
import threading
from typing import NamedTuple, SupportsIndex

import numpy as np

from kvd.errors import BadArgsError, NoSpaceError, NotFoundError
from kvd.core.policies import POLICIES
from kvd.core.pool import BlockPool

_EMBEDDED_OWNER = 0  # every hold is one pin of this owner (threads share holds as they share pairs)


class Block(NamedTuple):
    """One block: `keys` and `values` are writable views of shape (block_size, head_dim).

    (A NamedTuple, immutable: a frozen dataclass took 0.57 µs to build against 0.22 µs, a third of
    a `get_block`.)
    """

    block_id: int
    layer_id: int
    position: int
    keys: np.ndarray
    values: np.ndarray


def _index_or_none(value: object) -> int | None:
    """A plain int from an int or a NumPy integer (not a bool, nor a float's truncation)."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BadArgsError(f"{name} must be a positive int (1 or more), got {value!r}")
    return value


class PagedKVCache:
    """A paged KV cache in this process's memory: no daemon, same pool and policies.

    Thread-safe: any number of threads may call every public method at once (one lock; see the
    module docstring). A block a thread holds (`hold_block`) keeps its pair and its data until
    that hold is released; a block from `get_block` or `allocate_block` may be evicted by another
    thread's allocation at any time.
    """

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
        self._keys, self._values = self.storage[:, 0], self.storage[:, 1]  # (a view less per Block)
        # Each block as raw bytes, to zero: NumPy fills bytes with a memset, a float32 block
        # elementwise (0.45 µs against 0.67 µs for 16 KiB, timeit on the NumPy we run).
        self._bytes = self.storage.view(np.uint8).reshape(num_blocks, -1)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    # ---- the public methods: check arguments, then the work below under the lock ----------
    def allocate_block(self, layer_id: int, position: int) -> int:
        """Return the block id of `(layer_id, position)`, allocating (and evicting) if needed.

        Raises NoSpaceError if the pair has no block and every block is held.
        """
        key = self._key(layer_id, position)
        self._lock.acquire()  # (not `with`: ~80 ns less per call, module docstring)
        try:
            return self._allocate(key)
        finally:
            self._lock.release()

    def get_block(self, layer_id: int, position: int) -> Block | None:
        """The block of `(layer_id, position)` (an access for the policy), or None if absent."""
        key = self._key(layer_id, position)
        self._lock.acquire()
        try:
            block_id = self._get(key)
        finally:
            self._lock.release()
        return None if block_id is None else self._block(block_id, key)

    def hold_block(self, layer_id: int, position: int) -> Block:
        """The block of `(layer_id, position)`, allocated if absent, held: until `release_block`
        it is neither evicted nor reused, so what is written through it stays. Holds add up
        (hold twice, release twice), whichever threads take and drop them.

        Raises NoSpaceError if the pair has no block and every block is held.
        """
        key = self._key(layer_id, position)
        with self._lock:
            block_ids = self._pool.lookup([key], _EMBEDDED_OWNER)
            if not block_ids:
                block_ids = [self._new_block(key)]
                self._pool.pin(block_ids, _EMBEDDED_OWNER)
        return self._block(block_ids[0], key)

    def release_block(self, layer_id: int, position: int) -> None:
        """Drop one hold of `(layer_id, position)`'s block; with none left it is evictable again.

        Raises NotFoundError if the pair's block is not held.
        """
        key = self._key(layer_id, position)
        with self._lock:
            block_id = self._pool.find(key)
            if block_id is None or not self._pool.ref_count(block_id):
                raise NotFoundError(f"block of (layer {key[0]}, position {key[1]}) is not held: "
                                    "release_block only what hold_block took")
            self._pool.release([block_id], _EMBEDDED_OWNER)

    def stats(self) -> dict:
        """Pool usage; `utilization` is a percentage string like "100.0%"."""
        with self._lock:
            num_free, num_held = self._pool.num_free, self._pool.num_sealed
            hits, misses = self.hits, self.misses
            evictions = self._pool.counters["evictions"]
        used = self.num_blocks - num_free
        return {
            "total_blocks": self.num_blocks,
            "used_blocks": used,
            "free_blocks": num_free,
            "utilization": f"{100.0 * used / self.num_blocks:.1f}%",
            "held_blocks": num_held,
            "hits": hits,
            "misses": misses,
            "evictions": evictions,
            "policy": self._pool.policy.name,
        }

    def check_invariants(self) -> None:
        """The pool's invariants (BlockPool.check_invariants); InternalError if one is broken."""
        with self._lock:
            self._pool.check_invariants()

    # ---- under the lock --------------------------------------------------------------------
    def _allocate(self, key: tuple[int, int]) -> int:
        block_id = self._pool.touch(key)
        return self._new_block(key) if block_id is None else block_id

    def _get(self, key: tuple[int, int]) -> int | None:
        block_id = self._pool.touch(key)
        if block_id is None:
            self.misses += 1
        else:
            self.hits += 1
        return block_id

    def _new_block(self, key: tuple[int, int]) -> int:
        """A zeroed block indexed under `key` (absent), CACHED: the policy orders it."""
        block_id = self._pool.put(key)
        if block_id is None:
            raise NoSpaceError(f"all {self.num_blocks} blocks are held: release_block some "
                               "(or make the cache larger)")
        self._bytes[block_id] = 0  # a reused block must not show its previous pair's data
        return block_id

    # ---- without it ------------------------------------------------------------------------
    def _key(self, layer_id: int, position: int) -> tuple[int, int]:
        if (type(layer_id) is int and type(position) is int  # the usual call: no further calls
                and 0 <= layer_id < self.num_layers and position >= 0):
            return (layer_id, position)
        layer, index = _index_or_none(layer_id), _index_or_none(position)
        if layer is None or not 0 <= layer < self.num_layers:
            raise BadArgsError(f"layer_id must be an int in [0, {self.num_layers}), got {layer_id!r}")
        if index is None or index < 0:
            raise BadArgsError(f"position must be a non-negative int (block index), got {position!r}")
        return (layer, index)

    def _block(self, block_id: int, key: tuple[int, int]) -> Block:
        return Block(block_id, key[0], key[1], self._keys[block_id], self._values[block_id])
