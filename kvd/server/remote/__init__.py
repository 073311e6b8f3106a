"""The remote tier (`kvd start --remote`): sealed blocks written behind to Redis (or a Redis
Cluster), local misses read through from it. docs/remote.md is the operator's guide.

    codec.py        the URL, the key of a block and the value format (pure)
    tier.py         RemoteTier: the write-behind and fetch threads, health and counters
    this module     what the loop thread does: tap the pool's seals, find a request's keys
                    past its local prefix, import fetched blocks into the pool

Read-through on the loop (kvd/server/loop.py holds the deferred replies):

    1. a lookup or seq_open arrives; `keys_to_fetch` finds the keys after its local prefix
       (none: served as usual, no cost beyond one index probe of its last key);
    2. the tier queues a fetch (or declines: served at once from what is local) and the
       request's reply is deferred; the loop goes on serving everyone else;
    3. the fetch thread's wake-up arrives, or the deadline (--remote-timeout-ms) passes first;
    4. `import_fetched` pins the local prefix, allocates fresh blocks, copies the fetched bytes
       in and seals them (journaled like any seal; not written back), all under IMPORT_OWNER;
    5. the request runs as if it had just arrived (its lookup now hits the imported blocks),
       then IMPORT_OWNER's pins are dropped: the blocks stay pinned by the requester or become
       cached like any other.
A fetch that finishes after its deadline is still imported (the next request finds it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from kvd.core.pool import BlockPool
from kvd.server.remote.codec import MAX_HASH_NBYTES, BlockCodec, RemoteURL, parse_url
from kvd.server.remote.tier import DEFAULT_TIMEOUT_MS, FetchJob, RemoteTier, require_redis

__all__ = ["BlockCodec", "DEFAULT_TIMEOUT_MS", "FetchJob", "IMPORT_OWNER", "RemoteTier",
           "RemoteURL", "SealTap", "import_fetched", "keys_to_fetch", "parse_url",
           "require_redis"]

# The pool owner of blocks being imported; never a session's (those count up from 1), and it
# holds nothing between two loop iterations.
IMPORT_OWNER = -1
DEFERRABLE_OPS = frozenset({"lookup", "seq_open"})


class SealTap:
    """The pool's observer with a remote tier: the journal's (if any), and every newly indexed
    block queued for writing. `evicted` is the journal's own method, so an eviction costs no
    extra call (kvd/core/_pool.c calls it directly)."""

    def __init__(self, journal: Any, tier: RemoteTier) -> None:
        self._journal_sealed = None if journal is None else journal.sealed
        self._tier_sealed = tier.sealed
        self.evicted = _ignore if journal is None else journal.evicted

    def sealed(self, rows: list[Any]) -> None:
        if self._journal_sealed is not None:
            self._journal_sealed(rows)
        self._tier_sealed(rows)


def _ignore(block_id: int) -> None:
    """No journal: evictions concern no one."""


def keys_to_fetch(pool: BlockPool, op: str, args: Any, prefix_hashes: Any
                  ) -> tuple[list[bytes], list[bytes]] | None:
    """(the keys of the local prefix, the keys after it) of a lookup or seq_open, or None when
    nothing is missing or the args are malformed (the op then answers them as usual).

    Args:
        prefix_hashes: PageTable.cacheable_hashes (seq_open's keys).
    """
    index = pool.tables.index
    if op == "lookup":
        keys = args.get("hashes") if type(args) is dict else None
        if type(keys) is not list or not keys:
            return None
        last = keys[-1]
        if type(last) is bytes and last in index:  # the usual hit: all local, as far as a
            return None  # prefix can tell (cached children have cached parents)
        if not all(type(key) is bytes and 0 < len(key) <= MAX_HASH_NBYTES for key in keys):
            return None  # (the lookup answers BAD_ARGS)
    else:
        try:
            keys = prefix_hashes(args)
        except Exception:  # malformed: seq_open answers with the right error
            return None
        if not keys or keys[-1] in index:
            return None
    num_local = 0
    for key in keys:
        if key not in index:
            break
        num_local += 1
    return keys[:num_local], keys[num_local:]


def import_fetched(pool: BlockPool, tier: RemoteTier, job: FetchJob,
                   local_keys: Sequence[Hashable]) -> list[int]:
    """Seal `job`'s payloads into fresh blocks held by IMPORT_OWNER (module docstring, step
    4); returns their ids. The caller releases IMPORT_OWNER. `local_keys` (the local prefix the
    request had) are pinned first, so that allocating cannot evict them."""
    index = pool.tables.index
    prefix_ids = [index[key] for key in local_keys if key in index]
    if prefix_ids:
        pool.pin(prefix_ids, IMPORT_OWNER)
    keys, payloads, parents = [], [], []
    previous = local_keys[-1] if local_keys else None
    for key, payload in zip(job.keys, job.payloads):
        if key not in index:  # (else sealed here meanwhile)
            keys.append(key)
            payloads.append(payload)
            parents.append(previous)
        previous = key
    num_blocks = min(len(keys), pool.num_available)
    block_ids = pool.allocate(num_blocks, IMPORT_OWNER) if num_blocks else None
    blocks = tier.blocks
    if not block_ids or blocks is None:
        return []
    for block_id, payload in zip(block_ids, payloads):
        blocks[block_id] = np.frombuffer(payload, dtype=np.uint8)
    tier.is_importing = True
    try:
        pool.seal(block_ids, keys[:num_blocks], IMPORT_OWNER, parents[:num_blocks])
    finally:
        tier.is_importing = False
    return block_ids
