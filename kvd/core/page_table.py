"""The daemon-side page table: sequences as lists of blocks, with prefix reuse and fork.

Theory of operation
-------------------
A *sequence* is one request's KV: its token ids and the block table mapping token `t` to block
`block_ids[t // block_size]`. Each sequence pins its blocks under its own pool owner id, so a
client's raw `release` can never pull a block out from under one of its sequences, and closing a
sequence releases exactly what it holds (tail first, so a chain's tail is evicted first).

    open(tokens)       hash the full blocks, pin the longest cached prefix (capped so at least one
                       token is left to compute: an engine needs the last prompt token's logits),
                       allocate the rest — all or nothing.
    commit(n)          the KV of the first n tokens is written: seal every full block below n under
                       its chained content hash. Sealed blocks are read-only and shareable. Each is
                       sealed with its parent's hash (the pool's prefix tree) and its tier: a block
                       holding any token past the prompt given to `open` was written by decode.
    extend(tokens, n)  commit(n), then append tokens, allocating blocks as they are needed.
    fork()             a new sequence with the same tokens: sealed blocks are shared (one more
                       pin), unsealed ones are copied into fresh blocks by the `copy_block`
                       callback — copy-on-write where it matters, since sealed blocks never change.
    close()            release every block (unsealed → FREE, sealed → CACHED once unpinned).

Token ids are kept as little-endian uint32 bytes, the encoding `hash_blocks` hashes, so sealing a
block hashes a slice without converting anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvd.errors import BadArgsError, InternalError, NoSpaceError
from kvd.hashing import hash_blocks, root_hash
from kvd.core.policies import TIER_DECODE, TIER_PREFILL
from kvd.core.pool import BlockPool


@dataclass
class SequenceRecord:
    seq_id: int
    owner: int  # the pool owner id that holds this sequence's pins
    salt: bytes
    tokens: bytearray  # uint32 little-endian
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of the sealed prefix blocks
    num_prompt_tokens: int = 0  # tokens given to open; later ones are decode's

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def num_sealed(self) -> int:
        return len(self.hashes)


class PageTable:
    """All open sequences of a pool. Sequence and pool-owner ids come from `new_owner`."""

    def __init__(self, pool: BlockPool, block_size: int, new_owner: Callable[[], int],
                 copy_block: Callable[[int, int], None]) -> None:
        self.pool = pool
        self.block_size = block_size
        self._new_owner = new_owner
        self._copy_block = copy_block
        self.sequences: dict[int, SequenceRecord] = {}
        self.counters = {"opened": 0, "prompt_tokens": 0, "cached_tokens": 0}

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def open(self, tokens: bytes, salt: bytes = b"", max_cached_tokens: int | None = None,
             hashes: list[bytes] | None = None) -> tuple[SequenceRecord, int]:
        """Open a sequence; returns it and the number of tokens whose KV is already cached.
        `hashes`: `cacheable_hashes` of the same arguments, if the caller has them."""
        num_tokens = len(tokens) // 4
        if hashes is None:
            hashes = self.cacheable_hashes(tokens, salt, max_cached_tokens)
        owner = self._new_owner()
        hit_ids = self.pool.lookup(hashes, owner)
        new_ids = self.pool.allocate(self._blocks_for(num_tokens) - len(hit_ids), owner)
        if new_ids is None:
            # The message first: counted after the release, the hits would look available.
            message = self._no_space(self._blocks_for(num_tokens) - len(hit_ids))
            self.pool.release(hit_ids, owner)
            raise NoSpaceError(message)
        record = SequenceRecord(owner, owner, salt, bytearray(tokens), hit_ids + new_ids,
                                hashes[: len(hit_ids)], num_tokens)
        self.sequences[record.seq_id] = record
        num_cached = len(hit_ids) * self.block_size
        self.counters["opened"] += 1
        self.counters["prompt_tokens"] += num_tokens
        self.counters["cached_tokens"] += num_cached
        return record, num_cached

    def cacheable_hashes(self, tokens: bytes, salt: bytes = b"",
                         max_cached_tokens: int | None = None) -> list[bytes]:
        """The hashes `open` looks up: of the full blocks below its cap (by default all but the
        last token, whose logits an engine needs)."""
        num_tokens = len(tokens) // 4
        if num_tokens == 0:
            raise BadArgsError("a sequence needs at least one token")
        cap = num_tokens - 1 if max_cached_tokens is None else min(max_cached_tokens, num_tokens)
        num_cacheable = max(cap, 0) // self.block_size
        token_ids = np.frombuffer(tokens, dtype="<u4")
        return hash_blocks(token_ids[: num_cacheable * self.block_size], self.block_size,
                           salt=salt)

    def _no_space(self, num_needed: int) -> str:
        return (f"need {num_needed} blocks but only {self.pool.num_available} are free or "
                f"evictable (of {self.pool.num_blocks}; the rest are pinned): release blocks, "
                "close sequences or start the daemon with more --num-blocks")

    def commit(self, record: SequenceRecord, num_computed: int) -> int:
        """Seal the full blocks below `num_computed` tokens; returns how many were sealed."""
        if not 0 <= num_computed <= record.num_tokens:
            raise BadArgsError(f"num_computed must be in [0, {record.num_tokens}] (the sequence's "
                               f"tokens), got {num_computed}")
        first, last = record.num_sealed, num_computed // self.block_size
        if last <= first:
            return 0
        parent = record.hashes[-1] if record.hashes else root_hash(record.salt)
        token_ids = np.frombuffer(record.tokens, dtype="<u4")
        new_hashes = hash_blocks(token_ids[first * self.block_size: last * self.block_size],
                                 self.block_size, parent=parent)
        parents = [record.hashes[-1] if record.hashes else None, *new_hashes[:-1]]
        tiers = [TIER_DECODE if (index + 1) * self.block_size > record.num_prompt_tokens
                 else TIER_PREFILL for index in range(first, last)]
        self.pool.seal(record.block_ids[first:last], new_hashes, record.owner, parents, tiers)
        record.hashes.extend(new_hashes)
        return last - first

    def extend(self, record: SequenceRecord, tokens: bytes, num_computed: int) -> list[int]:
        """Commit `num_computed`, append `tokens`; returns the newly allocated block ids.

        All or nothing: without room for the new blocks it raises NoSpaceError before sealing
        anything (sealing keeps blocks pinned, so it cannot make room).
        """
        num_tokens = record.num_tokens + len(tokens) // 4
        num_needed = max(self._blocks_for(num_tokens) - len(record.block_ids), 0)
        if num_needed > self.pool.num_available:
            raise NoSpaceError(self._no_space(num_needed))
        self.commit(record, num_computed)
        new_ids = self.pool.allocate(num_needed, record.owner)
        if new_ids is None:
            raise InternalError(f"{num_needed} blocks were available before the commit but not "
                                "after it: sealing must not consume space")
        record.tokens += tokens
        record.block_ids.extend(new_ids)
        return new_ids

    def fork(self, record: SequenceRecord) -> SequenceRecord:
        """A copy of `record` sharing its sealed blocks and owning copies of the others."""
        owner = self._new_owner()
        shared = record.block_ids[: record.num_sealed]
        private_src = record.block_ids[record.num_sealed:]
        copies = self.pool.allocate(len(private_src), owner)
        if copies is None:
            raise NoSpaceError(self._no_space(len(private_src)))
        self.pool.pin(shared, owner)
        for src, dst in zip(private_src, copies):
            self._copy_block(src, dst)
        child = SequenceRecord(owner, owner, record.salt, bytearray(record.tokens),
                               shared + copies, list(record.hashes), record.num_prompt_tokens)
        self.sequences[child.seq_id] = child
        return child

    def close(self, record: SequenceRecord) -> None:
        del self.sequences[record.seq_id]
        self.pool.release(record.block_ids, record.owner)
