"""Recovery: whether a crashed daemon's segment and journal can be served again, and restoring them.

Theory of operation
-------------------
A daemon that crashed (or stopped with --keep) leaves its segment, with the KV data, and its
journal (kvd/server/journal.py), which maps content hashes to the segment's blocks. `kvd start
--recover` serves them again only if the journal provably describes that very segment; anything
less starts clean, logged, never an error: a wrong mapping would hand workers another prompt's KV.
The one refusal is a stamp that cannot be read: starting clean would overwrite a journal nobody
could check, so the start fails (JournalError) and keeps segment and journal as they were.

    attach      the segment exists, is ours and has this kvd's layout (Segment.attach checks)
    boot        it was created in this boot: memory from before a reboot is gone
    geometry    it has the geometry this start asks for
    stamp       the journal's stamp names this segment's uuid, boot id and geometry, and this
                kvd's journal, layout and hash versions (`stamp`: written when a segment is made)
    load        the journal reads back (Journal.load: what it cannot prove is left out)

`restore` then puts the rows into a fresh pool over the segment's generation counters
(`BlockPool.restore` keeps only rows whose generation still matches and whose parent came back),
and bumps the generation of every block left FREE, so that a block id a worker held across the
crash is detectably stale.

Damage is never restored and never hidden. Journal.load leaves out chunks that fail their
checksum and blocks claimed twice, `restore` rows that claim one hash twice at current
generations (with them go their descendants: a child is restored only under its parent), and
the segment's acknowledged-seals counter says whether the log lost commits from its end (the WAL
drops every frame after a damaged one). Any of these makes the recovery's log line a warning
that says what was lost, and sets the journal's files aside (`journal.sqlite3.damaged-N`, named
in that line) before a fresh journal is written from what was restored: a damaged journal is
never deleted, and never appended to. A journal that cannot be read at all, or that the pool
refuses, is set aside too, and the daemon starts clean.

Several pools (kvd/core/arena.py) have one journal each and one acknowledged-seals counter each
in the layout-2 header; each journal's stamp names its pool, geometry and slab size, so the
checks above run per pool, with the same code (`read_stamp`, `load_journal`, `restore`).
`attach_pools` keeps the segment while its boot, budget and slab size still hold; if the pool
table changed it rewrites the segment in place (Segment.reshape_pools): a pool of the same name
and geometry keeps its generations, so its journal still matches, while a changed or new pool's
does not (it restarts clean) and a removed pool's blocks are dropped. Slab ownership is not
journaled: a slab belongs to the pool whose restored blocks it holds (ArenaPool.restore), and a
slab that two pools' current records claim is damage (`drop_shared_slabs`: both claims go).
"""

from __future__ import annotations

import logging
import sqlite3
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from kvd.core.pool import BlockPool, IndexRows
from kvd.errors import BadArgsError, DeniedError, JournalError, KvdError
from kvd.geometry import Geometry
from kvd.hashing import HASH_VERSION
from kvd.segment import LAYOUT_VERSION, POOLS_LAYOUT_VERSION, Segment, current_boot_id
from kvd.server.journal import JOURNAL_VERSION, Damage, Journal, Loaded

log = logging.getLogger("kvd")


def stamp(segment: Segment, pool: str | None = None) -> dict[str, Any]:
    """What a journal must agree with to be restored into `segment` (into its pool `pool`, for
    one of several pools' journals)."""
    found = {"journal_version": JOURNAL_VERSION, "layout_version": LAYOUT_VERSION,
             "hash_version": HASH_VERSION,
             "geometry": segment.geometry.to_dict(), "segment_uuid": segment.uuid.hex(),
             "boot_id": segment.boot_id.hex()}
    if pool is not None:
        found.update(layout_version=POOLS_LAYOUT_VERSION, pool=pool,
                     geometry=segment.pools[pool].geometry.to_dict(),
                     slab_nbytes=segment.pools[pool].slab_nbytes)
    return found


def attach_recoverable(segment_name: str, geometry: Geometry,
                       journal: Journal) -> tuple[Segment, Loaded] | None:
    """The previous segment and its journaled blocks, or None (logged) to start clean.

    Raises:
        JournalError: the stamp cannot be read, or a journal that cannot be read could not be
            set aside: both are kept as they were.
    """
    try:
        segment = Segment.attach(segment_name)
    except DeniedError:  # not ours to map, nor to replace: the start is refused, saying why
        raise
    except KvdError as exc:
        log.warning("recovery: no usable segment (%s); starting clean", exc)
        return None
    try:
        found = read_stamp(journal)
    except JournalError:
        segment.close()
        raise
    reason = None
    if segment.boot_id != current_boot_id():
        reason = "the segment is from another boot"
    elif segment.geometry != geometry:
        reason = f"geometry changed from {segment.geometry} to {geometry}"
    if reason is not None:
        log.warning("recovery: %s; starting clean", reason)
    else:
        try:
            loaded = load_journal(journal, found, stamp(segment))
        except JournalError:
            segment.close()
            raise
        if loaded is not None:
            return segment, loaded
    segment.close()
    return None


def read_stamp(journal: Journal) -> dict[str, Any]:
    """The journal's stamp. Raises JournalError (saying what is kept) if it cannot be read."""
    try:
        return journal.read_stamp()
    except JournalError as exc:
        raise JournalError(f"recovery: {exc}; the segment and the journal are kept as they "
                           f"were: move {journal.state_dir} aside to keep it, or start without "
                           f"--recover to start clean") from None


def load_journal(journal: Journal, found: dict[str, Any], expected: dict[str, Any],
                 starting: str = "starting clean") -> Loaded | None:
    """The journal's blocks if its stamp `found` is the one `expected`, else None, logged with
    `starting` (what happens instead); a journal that cannot be read is set aside.

    Raises:
        JournalError: a journal that cannot be read could not be set aside (it is kept).
    """
    if found != expected:
        reason = (f"the journal in {journal.path} does not describe this segment "
                  f"(journal {found or 'empty'}, segment {expected})")
    else:
        try:
            return journal.load()
        except (JournalError, sqlite3.Error, ValueError) as exc:  # unreadable: never map it
            reason = (f"the journal in {journal.path} cannot be read ({exc}); it is kept as "
                      f"{journal.set_aside()}")
    log.warning("recovery: %s; %s", reason, starting)
    return None


def restore(pool: BlockPool, segment: Segment, journal: Journal, loaded: Loaded,
            pool_name: str | None = None) -> int:
    """Restore `loaded` into a fresh `pool` over `segment` (its pool `pool_name`, for one of
    several pools) and log what came back; where anything was damaged or lost, say so and write
    a fresh journal of what was restored (module docstring). Returns the blocks restored.

    Raises:
        BadArgsError: rows the pool cannot take (a corrupt journal): nothing restored.
        JournalError: a damaged journal could not be set aside (so it is kept as it was).
    """
    damage, rows = loaded.damage, loaded.rows
    name = pool_name or next(iter(segment.pools))
    generations = segment.generations_of(name)
    acknowledged = segment.pool_acknowledged_seals(name)
    try:
        num_restored = pool.restore(rows)
    except BadArgsError:  # (before restoring anything) a hash claimed twice, say: drop those
        rows = _without_duplicate_keys(rows, generations, damage)
        if len(rows.keys) == len(loaded.rows.keys):
            raise
        num_restored = pool.restore(rows)
    is_free = np.frombuffer(pool.states(), dtype=np.uint8) == 0
    generations[is_free] += 1  # a block id a worker held across the crash is stale
    text = (f"recovered segment {segment.name}: {num_restored} of {len(rows.block_ids)} journaled "
            f"blocks restored from {journal.path}")
    problems = damage.describe()
    if acknowledged > loaded.seal_seq:
        problems.append(f"it ends at seal {loaded.seal_seq} where the segment counted "
                        f"{acknowledged} acknowledged: {acknowledged - loaded.seal_seq} "
                        "acknowledged seals lost")
    if not problems:
        log.info("%s", text)
        return num_restored
    aside = journal.set_aside()
    # What the fresh journal holds until its rewrite commits:
    segment.set_pool_acknowledged_seals(name, 0)
    journal.reset(stamp(segment, pool_name))
    journal.rewrite(pool.journal_rows())
    log.warning("%s; the journal was damaged: %s; its files are kept as %s", text,
                "; ".join(problems), aside)
    return num_restored


def _without_duplicate_keys(rows: IndexRows, generations: np.ndarray,
                            damage: Damage) -> IndexRows:
    """`rows` less every row whose hash another row claims at the generation the segment shows:
    a sound log has one such row per hash (an older one names a block freed since), so which of
    two to believe is unknown; both go, counted in `damage`."""
    keys = rows.keys
    is_current = _is_current(rows, generations)
    current = is_current.tolist()
    claims = Counter(key for key, is_claim in zip(keys, current) if is_claim)
    keep = np.array([not (is_claim and claims[key] > 1) for key, is_claim in zip(keys, current)],
                    dtype=bool)
    damage.duplicate_claims += int(np.count_nonzero(~keep))
    return _rows_where(rows, keep)


def _rows_where(rows: IndexRows, keep: np.ndarray) -> IndexRows:
    columns: list[Any] = [np.asarray(column)[keep] for column in rows]
    columns[1] = [key for key, is_kept in zip(rows.keys, keep.tolist()) if is_kept]
    return IndexRows(*columns)


def _current_slabs(rows: IndexRows, generations: np.ndarray, blocks_per_slab: int) -> np.ndarray:
    """Per row, the slab of its block if the row is at the generation the segment shows (it
    would be restored there), else -1."""
    return np.where(_is_current(rows, generations),
                    np.asarray(rows.block_ids, dtype=np.int64) // blocks_per_slab, -1)


def _is_current(rows: IndexRows, generations: np.ndarray) -> np.ndarray:
    """Per row, whether its block exists and is at the generation the row recorded."""
    ids = np.asarray(rows.block_ids, dtype=np.int64)
    is_current = (ids >= 0) & (ids < generations.size)
    is_current[is_current] = generations[ids[is_current]] \
        == np.asarray(rows.generations, dtype=np.uint64)[is_current]
    return is_current


def drop_shared_slabs(segment: Segment, loaded: dict[str, Loaded]) -> dict[str, Loaded]:
    """Several pools' journals: a slab belongs to the pool whose restored blocks it holds, so
    a slab that two pools' current rows claim is damage (which to believe is unknown): every
    such row goes, from each pool, counted in its `damage.shared_slabs`."""
    slabs = {name: _current_slabs(each.rows, segment.generations_of(name),
                                  segment.pools[name].blocks_per_slab)
             for name, each in loaded.items()}
    claims = Counter(slab for each in slabs.values() for slab in np.unique(each[each >= 0]).tolist())
    shared = np.array([slab for slab, num in claims.items() if num > 1], dtype=np.int64)
    if not shared.size:
        return loaded
    kept = {}
    for name, each in loaded.items():
        drop = np.isin(slabs[name], shared)
        each.damage.shared_slabs += int(np.count_nonzero(drop))
        kept[name] = each._replace(rows=_rows_where(each.rows, ~drop))
    log.warning("recovery: %d arena slabs are claimed by two pools' journals: their blocks are "
                "dropped from both", shared.size)
    return kept


def attach_pools(segment_name: str, shapes: list[tuple[str, Geometry]],
                 budget_nbytes: int) -> tuple[Segment, set[str]] | None:
    """The previous layout-2 segment and the configured pools it holds unchanged (same name and
    geometry: their journals may be restored), or None (logged) to start every pool clean. A
    changed pool restarts clean, a removed one is dropped, a new one starts empty (logged);
    `reshape` then fits the segment to the pools."""
    try:
        segment = Segment.attach(segment_name)
    except DeniedError:
        raise
    except KvdError as exc:
        log.warning("recovery: no usable segment (%s); starting clean", exc)
        return None
    first = next(iter(segment.pools.values()))
    num_slabs = (segment.nbytes - first.data_offset) // first.slab_nbytes
    reason = None
    if segment.boot_id != current_boot_id():
        reason = "the segment is from another boot"
    elif not segment.is_multi_pool:
        reason = "the segment holds one pool, not several"
    elif budget_nbytes // first.slab_nbytes != num_slabs:
        reason = (f"the budget changed from {num_slabs} slabs of {first.slab_nbytes} bytes to "
                  f"{budget_nbytes} bytes")
    elif max(shape.block_nbytes for _, shape in shapes) > first.slab_nbytes:
        reason = f"a pool's blocks no longer fit the segment's {first.slab_nbytes}-byte slabs"
    if reason is not None:
        log.warning("recovery: %s; starting clean", reason)
        segment.close()
        return None
    old = {name: pool.geometry for name, pool in segment.pools.items()}
    kept = set()
    for name, shape in shapes:
        geometry = replace(shape, num_blocks=num_slabs * (first.slab_nbytes // shape.block_nbytes))
        if old.get(name) == geometry:
            kept.add(name)
        elif name not in old:
            log.info("recovery: pool %s is new: it starts empty", name)
        else:
            log.warning("recovery: pool %s changed geometry from %s to %s: it starts clean",
                        name, old[name], shape)
    for name in old.keys() - {name for name, _ in shapes}:
        log.warning("recovery: pool %s is no longer configured: its blocks are dropped", name)
    return segment, kept


def reshape(segment: Segment, shapes: list[tuple[str, Geometry]]) -> Segment:
    """`segment` itself if it has exactly the pools `shapes`, else the segment rewritten in place
    for them under a new uuid (Segment.reshape_pools: a client's old mapping is then stale, and
    tells), which closes `segment`.

    Raises:
        KvdError: it could not be reshaped (NoSpaceError, say); `segment` is closed.
    """
    if [(name, replace(pool.geometry, num_blocks=1)) for name, pool in segment.pools.items()] \
            == [(name, replace(shape, num_blocks=1)) for name, shape in shapes]:
        return segment
    return Segment.reshape_pools(segment, shapes)
