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

Sliding-window pools (`window` W tokens): the next token at position p attends to itself and the
W - 1 tokens before it, so a block all of whose tokens lie before p - W + 1 is never read again.
`commit(n)` releases such blocks (they stay CACHED, each its own chain head: a window pool seals
without parents, since the prefix tree would keep the oldest blocks and orphan the newest), and
their block-table entries become HOLE. A prefix hit of k blocks needs only the last
ceil((W - 1) / block_size) blocks before the hit point (vLLM's rule for sliding-window groups);
`servable` says, for every k, whether this pool can serve a hit of k blocks, so that a model
spanning several pools (kvd/core/models.py) can take the longest k every one of them serves.
Holes are always a prefix of the block table: hits pin the suffix of the hit range and decode
releases from the front.

Token ids are kept as little-endian uint32 bytes, the encoding `hash_blocks` hashes, so sealing a
block hashes a slice without converting anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvd.errors import BadArgsError, InternalError, NoSpaceError
from kvd.geometry import num_outside_window
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
    num_released: int = 0  # leading entries of block_ids released (HOLE): outside the window

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def num_sealed(self) -> int:
        return len(self.hashes)


HOLE = -1  # a block-table entry released for lying outside the window


class PageTable:
    """All open sequences of a pool. Sequence and pool-owner ids come from `new_owner`."""

    def __init__(self, pool: BlockPool, block_size: int, new_owner: Callable[[], int],
                 copy_block: Callable[[int, int], None], window: int | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.window = window
        # the blocks before a hit point that a hit must hold (module docstring)
        self.window_blocks = None if window is None else -(-(window - 1) // block_size)
        self._new_owner = new_owner
        self._copy_block = copy_block
        self.sequences: dict[int, SequenceRecord] = {}
        self.counters = {"opened": 0, "prompt_tokens": 0, "cached_tokens": 0}

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def open(self, tokens: bytes, salt: bytes = b"", max_cached_tokens: int | None = None
             ) -> tuple[SequenceRecord, int]:
        """Open a sequence; returns it and the number of tokens whose KV is already cached."""
        (record,), num_cached = open_spanning([self], self._new_owner(), tokens, salt,
                                              max_cached_tokens)
        return record, num_cached

    def chain(self, tokens: bytes, salt: bytes, max_cached_tokens: int | None) -> list[bytes]:
        """The chained hashes of the full blocks of `tokens` a hit may cover (capped so that at
        least one token is left to compute unless `max_cached_tokens` says otherwise)."""
        num_tokens = len(tokens) // 4
        if num_tokens == 0:
            raise BadArgsError("a sequence needs at least one token")
        cap = num_tokens - 1 if max_cached_tokens is None else min(max_cached_tokens, num_tokens)
        num_cacheable = max(cap, 0) // self.block_size
        token_ids = np.frombuffer(tokens, dtype="<u4")
        return hash_blocks(token_ids[: num_cacheable * self.block_size], self.block_size,
                           salt=salt)

    def servable(self, hashes: list[bytes]) -> list[bool]:
        """For k in 0..len(hashes): whether this pool holds what a hit of k blocks needs (all k
        blocks; a window pool the last `window_blocks` of them). Pins nothing."""
        find = self.pool.find
        present = [find(key) is not None for key in hashes]
        if self.window_blocks is None:
            num_leading = present.index(False) if False in present else len(present)
            return [k <= num_leading for k in range(len(hashes) + 1)]
        ok, run = [True], 0  # run: present blocks ending at k
        for k, is_present in enumerate(present, 1):
            run = run + 1 if is_present else 0
            ok.append(run >= min(k, self.window_blocks))
        return ok

    def pin_hit(self, tokens: bytes, salt: bytes, hashes: list[bytes], num_hit: int,
                seq_id: int) -> SequenceRecord:
        """A new sequence (id and owner `seq_id`) holding the hit of `num_hit` blocks, which
        `servable` said this pool serves; `fill` then allocates the rest."""
        first = 0 if self.window_blocks is None else max(num_hit - self.window_blocks, 0)
        hit_ids = self.pool.lookup(hashes[first:num_hit], seq_id)
        if len(hit_ids) != num_hit - first:
            self.pool.release(hit_ids, seq_id)
            raise InternalError(f"a hit of {num_hit} blocks was servable but only "
                                f"{len(hit_ids)} of its blocks were found")
        record = SequenceRecord(seq_id, seq_id, salt, bytearray(tokens),
                                [HOLE] * first + hit_ids, hashes[:num_hit], len(tokens) // 4,
                                num_released=first)
        self.sequences[seq_id] = record
        return record

    def reserve(self, record: SequenceRecord, num_new_tokens: int) -> list[int]:
        """Allocate the blocks `num_new_tokens` more tokens need (added to the block table, the
        tokens are the caller's to append); NoSpaceError, nothing done, without room."""
        num_needed = max(self._blocks_for(record.num_tokens + num_new_tokens)
                         - len(record.block_ids), 0)
        new_ids = self.pool.allocate(num_needed, record.owner)
        if new_ids is None:
            raise NoSpaceError(self._no_space(num_needed))
        record.block_ids.extend(new_ids)
        return new_ids

    def unreserve(self, record: SequenceRecord, new_ids: list[int]) -> None:
        """Undo `reserve` (its blocks are unsealed: they go back FREE)."""
        if new_ids:
            self.pool.release(new_ids, record.owner)
            del record.block_ids[-len(new_ids):]

    def count_open(self, record: SequenceRecord, num_hit: int) -> int:
        """Count an opened sequence; returns its number of cached tokens."""
        num_cached = num_hit * self.block_size
        self.counters["opened"] += 1
        self.counters["prompt_tokens"] += record.num_tokens
        self.counters["cached_tokens"] += num_cached
        return num_cached

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
            if self.window is not None:
                self._release_outside(record, num_computed)
            return 0
        parent = record.hashes[-1] if record.hashes else root_hash(record.salt)
        token_ids = np.frombuffer(record.tokens, dtype="<u4")
        new_hashes = hash_blocks(token_ids[first * self.block_size: last * self.block_size],
                                 self.block_size, parent=parent)
        parents = [record.hashes[-1] if record.hashes else None, *new_hashes[:-1]]
        tiers = [TIER_DECODE if (index + 1) * self.block_size > record.num_prompt_tokens
                 else TIER_PREFILL for index in range(first, last)]
        self.pool.seal(record.block_ids[first:last], new_hashes, record.owner,
                       parents if self.window is None else None, tiers)
        record.hashes.extend(new_hashes)
        if self.window is not None:
            self._release_outside(record, num_computed)
        return last - first

    def _release_outside(self, record: SequenceRecord, num_computed: int) -> None:
        """Release the blocks no token from `num_computed` on attends to (all sealed)."""
        end = num_outside_window(num_computed, self.window or 0, self.block_size)
        if end <= record.num_released:
            return
        start, block_ids = record.num_released, record.block_ids
        self.pool.release(block_ids[start:end], record.owner)
        block_ids[start:end] = [HOLE] * (end - start)
        record.num_released = end

    def extend(self, record: SequenceRecord, tokens: bytes, num_computed: int) -> list[int]:
        """Commit `num_computed`, append `tokens`; returns the newly allocated block ids.

        All or nothing: without room for the new blocks it raises NoSpaceError before sealing
        anything (sealing keeps blocks pinned, so it cannot make room).
        """
        return extend_spanning([self], [record], tokens, num_computed)[0]

    def fork(self, record: SequenceRecord, seq_id: int | None = None) -> SequenceRecord:
        """A copy of `record` sharing its sealed blocks and owning copies of the others."""
        owner = self._new_owner() if seq_id is None else seq_id
        shared = record.block_ids[record.num_released: record.num_sealed]
        private_src = record.block_ids[record.num_sealed:]
        copies = self.pool.allocate(len(private_src), owner)
        if copies is None:
            raise NoSpaceError(self._no_space(len(private_src)))
        self.pool.pin(shared, owner)
        for src, dst in zip(private_src, copies):
            self._copy_block(src, dst)
        child = SequenceRecord(owner, owner, record.salt, bytearray(record.tokens),
                               [HOLE] * record.num_released + shared + copies,
                               list(record.hashes), record.num_prompt_tokens,
                               record.num_released)
        self.sequences[child.seq_id] = child
        return child

    def close(self, record: SequenceRecord) -> None:
        del self.sequences[record.seq_id]
        self.pool.release(record.block_ids[record.num_released:], record.owner)


def longest_hit(servables: list[list[bool]]) -> int:
    """The largest k every pool serves (`PageTable.servable` of each; k = 0 always is)."""
    return max(k for k, row in enumerate(zip(*servables)) if all(row))


# ---- sequences spanning pools (a model's pools: same block size, one hash chain) -------------
def open_spanning(tables: list[PageTable], seq_id: int, tokens: bytes, salt: bytes,
                  max_cached_tokens: int | None) -> tuple[list[SequenceRecord], int]:
    """Open one sequence (`seq_id` in every pool) over `tables`: the longest hit all of them
    serve, pinned in each before anything is allocated (an allocation may evict another pool's
    unpinned blocks through the arena), then the rest allocated; all or nothing."""
    hashes = tables[0].chain(tokens, salt, max_cached_tokens)
    num_hit = longest_hit([table.servable(hashes) for table in tables])
    records = [table.pin_hit(tokens, salt, hashes, num_hit, seq_id) for table in tables]
    try:
        for table, record in zip(tables, records):
            table.reserve(record, 0)
    except NoSpaceError:
        for table, record in zip(tables, records):
            table.close(record)
        raise
    return records, [table.count_open(record, num_hit)
                     for table, record in zip(tables, records)][0]


def extend_spanning(tables: list[PageTable], records: list[SequenceRecord], tokens: bytes,
                    num_computed: int) -> list[list[int]]:
    """Allocate for `tokens` in every pool (NoSpaceError, nothing changed, without room), then
    append them and commit `num_computed` (which may count appended tokens: a window pool then
    releases what falls before the window of the token the engine computes next); returns
    each pool's new block ids."""
    reserved: list[list[int]] = []
    try:
        for table, record in zip(tables, records):
            reserved.append(table.reserve(record, len(tokens) // 4))
    except NoSpaceError:
        for table, record, new_ids in zip(tables, records, reserved):
            table.unreserve(record, new_ids)
        raise
    for table, record in zip(tables, records):
        record.tokens += tokens
        table.commit(record, num_computed)
    return reserved


def fork_spanning(tables: list[PageTable], records: list[SequenceRecord], seq_id: int
                  ) -> list[SequenceRecord]:
    """Fork in every pool under one new `seq_id`; all or nothing."""
    children: list[SequenceRecord] = []
    try:
        for table, record in zip(tables, records):
            children.append(table.fork(record, seq_id))
    except NoSpaceError:
        for table, child in zip(tables, children):
            table.close(child)
        raise
    return children
