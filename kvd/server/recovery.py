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
    load        the journal reads back whole

The caller then restores the rows into a fresh pool over the segment's generation counters
(`BlockPool.restore` keeps only rows whose generation still matches and whose parent came back),
and bumps the generation of every block left FREE (`bump_free_generations`), so that a block id
a worker held across the crash is detectably stale.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

import numpy as np

from kvd.core.pool import BlockPool, IndexRows
from kvd.errors import DeniedError, JournalError, KvdError
from kvd.geometry import Geometry
from kvd.hashing import HASH_VERSION
from kvd.segment import LAYOUT_VERSION, Segment, current_boot_id
from kvd.server.journal import JOURNAL_VERSION, Journal

log = logging.getLogger("kvd")


def stamp(segment: Segment) -> dict[str, Any]:
    """What a journal must agree with to be restored into `segment`."""
    return {"journal_version": JOURNAL_VERSION, "layout_version": LAYOUT_VERSION,
            "hash_version": HASH_VERSION,
            "geometry": segment.geometry.to_dict(), "segment_uuid": segment.uuid.hex(),
            "boot_id": segment.boot_id.hex()}


def attach_recoverable(segment_name: str, geometry: Geometry,
                       journal: Journal) -> tuple[Segment, IndexRows] | None:
    """The previous segment and its journaled blocks, or None (logged) to start clean."""
    try:
        segment = Segment.attach(segment_name)
    except DeniedError:  # not ours to map, nor to replace: the start is refused, saying why
        raise
    except KvdError as exc:
        log.warning("recovery: no usable segment (%s); starting clean", exc)
        return None
    expected = stamp(segment)
    try:
        found = journal.read_stamp()
    except JournalError as exc:
        segment.close()
        raise JournalError(f"recovery: {exc}; the segment and the journal are kept as they "
                           f"were: move {journal.state_dir} aside to keep it, or start without "
                           f"--recover to start clean") from None
    reason = None
    if segment.boot_id != current_boot_id():
        reason = "the segment is from another boot"
    elif segment.geometry != geometry:
        reason = f"geometry changed from {segment.geometry} to {geometry}"
    elif found != expected:
        reason = (f"the journal in {journal.path} does not describe this segment "
                  f"(journal {found or 'empty'}, segment {expected})")
    if reason is None:
        try:
            return segment, journal.load()
        except (JournalError, sqlite3.Error, ValueError) as exc:  # unreadable: never map it
            reason = f"the journal in {journal.path} cannot be read ({exc})"
    log.warning("recovery: %s; starting clean", reason)
    segment.close()
    return None


def bump_free_generations(pool: BlockPool, generations: np.ndarray) -> None:
    """After recovery every block that was not restored is FREE: make stale ids detectable."""
    is_free = np.frombuffer(pool.states(), dtype=np.uint8) == 0
    generations[is_free] += 1
