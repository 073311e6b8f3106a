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
    fork()             a new sequence with the same tokens, sharing the sealed head copy-on-write
                       (below) and owning copies of the unsealed blocks (the `copy_block` callback).
    close()            release every block (unsealed → FREE, sealed → CACHED once unpinned).

Copy-on-write fork: a sequence's table is a chain of shared *runs* (full sealed blocks: their
tokens, ids and hashes, immutable, pinned once under the run's own pool owner id) followed by the
sequence's own tail (tokens, ids and hashes it may still change, pinned under its owner). A fork
moves the parent's own sealed blocks into a new run on top of its chain (each block moves at most
once: pin under the run, release from the parent) and gives parent and child that run; the child
copies only the unsealed tail. So a fork costs O(unsealed blocks + blocks sealed since the last
fork), and its memory is its tail, where a copy of the table would cost ~70 bytes per block in
tokens, ids, hashes and pins: a 24-byte request must not buy megabytes of the daemon's memory
(`python -m bench.hostile` measures 300 forks of a 262,144-token sequence). A run counts its
referrers (sequences and runs on top of it) and is released when the last one goes, after them,
so the chain is released tail first. Commits seal own blocks only: a run's are sealed already.

Deferred release: closing a whole session (`close(..., is_deferred=True)`, `defer_release`) only
queues its pins, with the sequences' hashes; `release_deferred(n)` drops up to n of them per call,
tail first, and frees as many hashes (a million bytes objects take tens of ms to free), so the
loop spreads a big teardown over its iterations instead of stalling every client for it. A queued
pin still pins: an allocation that finds no room drains the queue first (the service does).

Sliding-window pools (`window` W tokens): the next token at position p attends to itself and the
W - 1 tokens before it, so a block all of whose tokens lie before p - W + 1 is never read again.
`commit(n)` releases such blocks (they stay CACHED, each its own chain head: a window pool seals
without parents, since the prefix tree would keep the oldest blocks and orphan the newest), and
their block-table entries become HOLE. A prefix hit of k blocks needs only the last
ceil((W - 1) / block_size) blocks before the hit point (vLLM's rule for sliding-window groups);
`servable` says, for every k, whether this pool can serve a hit of k blocks, so that a model
spanning several pools (`open_spanning`) can take the longest k every one of them serves.
Holes are always a prefix of the block table: hits pin the suffix of the hit range and decode
releases from the front. Decode releases own blocks only: a run's are shared (forks keep a
window pool's shared head pinned until its last sequence closes).

Token ids are kept as little-endian uint32 bytes, the encoding `hash_blocks` hashes, so sealing a
block hashes a slice without converting anything.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvd.errors import BadArgsError, InternalError, NoSpaceError
from kvd.geometry import num_outside_window
from kvd.hashing import hash_blocks, root_hash
from kvd.core.policies import TIER_DECODE, TIER_PREFILL
from kvd.core.pool import BlockPool


@dataclass(eq=False)
class Run:
    """Full sealed blocks at the head of every sequence sharing them, pinned once by `owner`."""

    owner: int
    tokens: bytes
    block_ids: list[int]
    hashes: list[bytes]
    parent: Run | None  # the run before this one in the chain
    num_chain_blocks: int  # blocks of this run and those before it
    num_chain_tokens: int  # their tokens
    num_refs: int = 0  # sequences and runs on top of this one

    def chain(self) -> list[Run]:
        """This run and those before it, first run first."""
        runs: list[Run] = []
        run: Run | None = self
        while run is not None:
            runs.append(run)
            run = run.parent
        return runs[::-1]


@dataclass(eq=False)
class SequenceRecord:
    seq_id: int
    owner: int  # the pool owner id that holds the pins of the sequence's own blocks
    salt: bytes
    own_tokens: bytearray  # uint32 little-endian, those after the run's
    own_block_ids: list[int]
    own_hashes: list[bytes]  # of the sealed own blocks
    num_prompt_tokens: int  # tokens given to open; later ones are decode's
    run: Run | None = None  # the shared head, None when nothing is shared
    num_released: int = 0  # leading own blocks released (HOLE): outside a window pool's window

    @property
    def num_run_blocks(self) -> int:
        return 0 if self.run is None else self.run.num_chain_blocks

    @property
    def num_tokens(self) -> int:
        return (0 if self.run is None else self.run.num_chain_tokens) + len(self.own_tokens) // 4

    @property
    def num_sealed(self) -> int:
        return self.num_run_blocks + len(self.own_hashes)

    @property
    def last_hash(self) -> bytes | None:
        """The hash of the last sealed block (the next one's parent), None if none is."""
        if self.own_hashes:
            return self.own_hashes[-1]
        return None if self.run is None else self.run.hashes[-1]

    def _chain(self) -> list[Run]:
        return [] if self.run is None else self.run.chain()

    @property
    def tokens(self) -> bytes:
        return b"".join([*(run.tokens for run in self._chain()), self.own_tokens])

    @property
    def block_ids(self) -> list[int]:
        return [b for run in self._chain() for b in run.block_ids] + self.own_block_ids

    @property
    def hashes(self) -> list[bytes]:
        return [key for run in self._chain() for key in run.hashes] + self.own_hashes


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
        self.runs: dict[int, Run] = {}  # live runs by owner id
        self.counters = {"opened": 0, "prompt_tokens": 0, "cached_tokens": 0}
        # Pins held by sequences and runs (their blocks): what a session's pin limit counts.
        self.num_pins = 0
        # (block ids, owner, hashes to free along) to release
        self._deferred: deque[tuple[list[int], int, list[bytes]]] = deque()
        self.num_deferred = 0  # pins in `_deferred`

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def open(self, tokens: bytes, salt: bytes = b"", max_cached_tokens: int | None = None,
             hashes: list[bytes] | None = None) -> tuple[SequenceRecord, int]:
        """Open a sequence; returns it and the number of tokens whose KV is already cached.
        `hashes`: `cacheable_hashes` of the same arguments, if the caller has them."""
        (record,), num_cached = open_spanning([self], self._new_owner(), tokens, salt,
                                              max_cached_tokens, hashes)
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

    def servable(self, hashes: list[bytes]) -> list[bool]:
        """For k in 0..len(hashes): whether this pool holds what a hit of k blocks needs (all k
        blocks; a window pool the last `window_blocks` of them). Pins nothing."""
        find = self.pool.find
        return servable_of([find(key) is not None for key in hashes], self.window_blocks)

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
        self.num_pins += len(hit_ids)
        return record

    def reserve(self, record: SequenceRecord, num_new_tokens: int) -> list[int]:
        """Allocate the blocks `num_new_tokens` more tokens need (added to the block table, the
        tokens are the caller's to append); NoSpaceError, nothing done, without room."""
        num_blocks = record.num_run_blocks + len(record.own_block_ids)
        num_needed = max(self._blocks_for(record.num_tokens + num_new_tokens) - num_blocks, 0)
        new_ids = self.pool.allocate(num_needed, record.owner)
        if new_ids is None:
            raise NoSpaceError(self._no_space(num_needed))
        record.own_block_ids.extend(new_ids)
        self.num_pins += len(new_ids)
        return new_ids

    def unreserve(self, record: SequenceRecord, new_ids: list[int]) -> None:
        """Undo `reserve` (its blocks are unsealed: they go back FREE)."""
        if new_ids:
            self.pool.release(new_ids, record.owner)
            del record.own_block_ids[-len(new_ids):]
            self.num_pins -= len(new_ids)

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
        # Own blocks only (a run's are sealed): positions relative to the own tail.
        num_run = record.num_run_blocks
        own_first, own_last = first - num_run, last - num_run
        parent = record.last_hash
        token_ids = np.frombuffer(record.own_tokens, dtype="<u4")
        new_hashes = hash_blocks(
            token_ids[own_first * self.block_size: own_last * self.block_size], self.block_size,
            parent=parent if parent is not None else root_hash(record.salt))
        parents = [parent, *new_hashes[:-1]]
        tiers = [TIER_DECODE if (index + 1) * self.block_size > record.num_prompt_tokens
                 else TIER_PREFILL for index in range(first, last)]
        self.pool.seal(record.own_block_ids[own_first:own_last], new_hashes, record.owner,
                       parents if self.window is None else None, tiers)
        record.own_hashes.extend(new_hashes)
        if self.window is not None:
            self._release_outside(record, num_computed)
        return last - first

    def _release_outside(self, record: SequenceRecord, num_computed: int) -> None:
        """Release the own blocks no token from `num_computed` on attends to (all sealed)."""
        end = min(num_outside_window(num_computed, self.window or 0, self.block_size)
                  - record.num_run_blocks, len(record.own_hashes))
        start, block_ids = record.num_released, record.own_block_ids
        if end <= start:
            return
        self.pool.release(block_ids[start:end], record.owner)
        block_ids[start:end] = [HOLE] * (end - start)
        record.num_released = end
        self.num_pins -= end - start

    def extend(self, record: SequenceRecord, tokens: bytes, num_computed: int) -> list[int]:
        """Commit `num_computed`, append `tokens`; returns the newly allocated block ids.

        All or nothing: without room for the new blocks it raises NoSpaceError before sealing
        anything (sealing keeps blocks pinned, so it cannot make room).
        """
        return extend_spanning([self], [record], tokens, num_computed)[0]

    def fork(self, record: SequenceRecord, seq_id: int | None = None) -> SequenceRecord:
        """A copy of `record` (id `seq_id`, default a new one) sharing its sealed blocks
        (copy-on-write) and owning copies of the others."""
        owner = self._new_owner() if seq_id is None else seq_id
        num_own_sealed = len(record.own_hashes)
        private_src = record.own_block_ids[num_own_sealed:]
        copies = self.pool.allocate(len(private_src), owner)
        if copies is None:
            raise NoSpaceError(self._no_space(len(private_src)))
        if num_own_sealed:
            self._share_sealed(record)
        for src, dst in zip(private_src, copies):
            self._copy_block(src, dst)
        child = SequenceRecord(owner, owner, record.salt, bytearray(record.own_tokens),
                               copies, [], record.num_prompt_tokens, record.run)
        if record.run is not None:
            record.run.num_refs += 1
        self.sequences[child.seq_id] = child
        self.num_pins += len(copies)
        return child

    def _share_sealed(self, record: SequenceRecord) -> None:
        """Move the record's own sealed blocks into a new run on top of its chain."""
        num_blocks = len(record.own_hashes)
        num_tokens = num_blocks * self.block_size
        block_ids = record.own_block_ids[:num_blocks]
        parent = record.run
        run = Run(self._new_owner(), bytes(record.own_tokens[: num_tokens * 4]), block_ids,
                  record.own_hashes, parent, record.num_run_blocks + num_blocks,
                  record.num_tokens - len(record.own_tokens) // 4 + num_tokens, num_refs=1)
        live = block_ids[record.num_released:]  # (a window pool's released ones are HOLE)
        self.pool.pin(live, run.owner)  # (before the release: never unpinned between)
        self.pool.release(live, record.owner)
        self.runs[run.owner] = run  # (the parent's reference passes from the record to the run)
        del record.own_tokens[: num_tokens * 4]
        del record.own_block_ids[:num_blocks]
        record.own_hashes = []
        record.run = run
        record.num_released = 0

    def close(self, record: SequenceRecord, is_deferred: bool = False) -> None:
        """Release the sequence's own blocks, then the runs nobody else refers to, tail first;
        `is_deferred`: only queue the releases (`release_deferred`)."""
        del self.sequences[record.seq_id]
        self._release(record.own_block_ids, record.owner, record.own_hashes, is_deferred)
        run = record.run
        while run is not None:
            run.num_refs -= 1
            if run.num_refs:
                break
            del self.runs[run.owner]
            self._release(run.block_ids, run.owner, run.hashes, is_deferred)
            run = run.parent

    def _release(self, block_ids: list[int], owner: int, hashes: list[bytes],
                 is_deferred: bool) -> None:
        if block_ids and block_ids[0] == HOLE:  # (holes lead: a window pool released them)
            block_ids = [block_id for block_id in block_ids if block_id != HOLE]
        self.num_pins -= len(block_ids)
        if is_deferred:
            self.defer_release(block_ids, owner, hashes)
        else:
            self.pool.release(block_ids, owner)

    # ---- deferred release (module docstring) -------------------------------------------------
    def defer_release(self, block_ids: list[int], owner: int,
                      hashes: list[bytes] | None = None) -> None:
        """Queue the release of one pin of `owner` on each block, and the freeing of `hashes`
        (no longer than `block_ids`), for `release_deferred`."""
        if block_ids:
            self._deferred.append((block_ids, owner, hashes if hashes is not None else []))
            self.num_deferred += len(block_ids)

    def release_deferred(self, max_pins: int) -> None:
        """Release up to `max_pins` queued pins, each batch's tail first, oldest batch first."""
        while max_pins > 0 and self._deferred:
            block_ids, owner, hashes = self._deferred[0]
            chunk = block_ids[-max_pins:]
            self.pool.release(chunk, owner)  # (the pool releases the chunk tail first)
            del block_ids[-max_pins:]
            del hashes[-max_pins:]
            if not block_ids:
                self._deferred.popleft()
            self.num_deferred -= len(chunk)
            max_pins -= len(chunk)

    def owners(self) -> set[int]:
        """Pool owners that are neither sequences nor sessions: live runs and queued releases."""
        return set(self.runs) | {owner for _, owner, _ in self._deferred}


def servable_of(present: list[bool], window_blocks: int | None) -> list[bool]:
    """`PageTable.servable` of a pool holding the blocks `present` says it holds (the remote
    tier asks it of blocks not fetched yet, kvd/server/remote)."""
    if window_blocks is None:
        num_leading = present.index(False) if False in present else len(present)
        return [k <= num_leading for k in range(len(present) + 1)]
    ok, run = [True], 0  # run: present blocks ending at k
    for k, is_present in enumerate(present, 1):
        run = run + 1 if is_present else 0
        ok.append(run >= min(k, window_blocks))
    return ok


def longest_hit(servables: list[list[bool]]) -> int:
    """The largest k every pool serves (`PageTable.servable` of each; k = 0 always is)."""
    return max(k for k, row in enumerate(zip(*servables)) if all(row))


# ---- sequences spanning pools (a model's pools: same block size, one hash chain) -------------
def open_spanning(tables: list[PageTable], seq_id: int, tokens: bytes, salt: bytes,
                  max_cached_tokens: int | None, hashes: list[bytes] | None = None
                  ) -> tuple[list[SequenceRecord], int]:
    """Open one sequence (`seq_id` in every pool) over `tables`: the longest hit all of them
    serve, pinned in each before anything is allocated (an allocation may evict another pool's
    unpinned blocks through the arena), then the rest allocated; all or nothing."""
    if hashes is None:  # (one chain for every pool: they share the block size)
        hashes = tables[0].cacheable_hashes(tokens, salt, max_cached_tokens)
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
        record.own_tokens += tokens
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
